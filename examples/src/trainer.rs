//! The demo's training loop as a library function, so the demo binary and the end-to-end tests
//! run exactly the same code.

use crate::data::progression_batch;
use crate::gpt::{Gpt, GptConfig, StreamedLayers, TchLayers};
use anyhow::Result;
use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::conductor::{Conductor, ConductorConfig};
use stagehand::device::Device;
use stagehand::nn::{LayerOptions, ManagedVarStore};
use stagehand::weights::OffloadedAdamW;
use stagehand::events::{Bus, EventKind, Phase, TrainStepMetrics};
use std::time::Instant;
use tch::nn::{self, Module, OptimizerConfig};

/// How the model's memory is managed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Memory {
    /// Plain tch: every weight and activation stays on the device.
    Resident,
    /// Stagehand: weights stream through layer mode with `weight_budget_bytes` of device room,
    /// activations spill above `spill_high_bytes` (until under `spill_low_bytes`), and the
    /// Conductor runs the phases with a soft cap at the whole budget.
    Streamed {
        weight_budget_bytes: u64,
        spill_high_bytes: u64,
        spill_low_bytes: u64,
    },
}

impl Memory {
    /// Splits a device budget the way the demo does: an eighth of it for resident weights,
    /// activations spilled above a half (down to three eighths).
    pub fn streamed_within(budget: u64) -> Memory {
        Memory::Streamed {
            weight_budget_bytes: budget / 8,
            spill_high_bytes: budget / 2,
            spill_low_bytes: budget * 3 / 8,
        }
    }
}

/// What to train and where.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub steps: u64,
    pub memory: Memory,
    /// Run the Conductor in streamed mode (off: the trainer tags phases itself).
    pub conductor: bool,
    pub model: GptConfig,
    pub batch: i64,
    pub learning_rate: f64,
    /// Device VRAM budget in bytes (the simulated VRAM on the host device).
    pub budget_bytes: u64,
    pub seed: i64,
}

impl TrainConfig {
    /// The demo's defaults at a given size.
    pub fn demo(steps: u64, layers: i64, d_model: i64, seq: i64, batch: i64, budget_bytes: u64) -> TrainConfig {
        TrainConfig {
            steps,
            memory: Memory::streamed_within(budget_bytes),
            conductor: true,
            model: GptConfig {
                vocab: 128,
                block_size: seq,
                n_layer: layers,
                n_head: 4,
                n_embd: d_model,
            },
            batch,
            // Wider models need smaller steps: AdamW at 3e-3 trains d=128 well but diverges from
            // d=1024 on, so the rate falls with the width beyond 128.
            learning_rate: 3e-3 * (128.0 / d_model as f64).min(1.0),
            budget_bytes,
            seed: 0,
        }
    }

    /// "gpt L=8 d=128 seq=64 (1.6M params)".
    pub fn describe(&self) -> String {
        let m = &self.model;
        format!(
            "gpt L={} d={} seq={} ({:.1}M params)",
            m.n_layer,
            m.n_embd,
            m.block_size,
            m.parameters() as f64 / 1e6
        )
    }
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub steps: u64,
    pub losses: Vec<f64>,
    /// Saved tensors the activation runtime spilled, by its own count (0 when resident).
    pub activations_spilled: u64,
    /// Bytes it spilled.
    pub spill_bytes: u64,
    pub mean_step_s: f64,
    pub peak_bytes: u64,
}

impl Summary {
    /// Mean loss of the first and last tenth of the run.
    pub fn loss_drop(&self) -> (f64, f64) {
        let n = (self.losses.len() / 10).max(1);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
        (mean(&self.losses[..n]), mean(&self.losses[self.losses.len() - n..]))
    }
}

/// Publishes `run_started` for this run on `bus`.
pub fn announce(bus: &Bus, cfg: &TrainConfig, device: &Device, run_id: &str) {
    bus.publish(EventKind::RunStarted {
        run_id: run_id.to_owned(),
        wall_clock_unix_ms: bus.wall_clock_unix_ms(),
        device: device.info(),
        model: cfg.describe(),
        versions: [
            ("stagehand".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
            ("libtorch".to_owned(), "2.11.0".to_owned()),
        ]
        .into_iter()
        .collect(),
        config: serde_json::json!({
            "steps": cfg.steps,
            "batch": cfg.batch,
            "layers": cfg.model.n_layer,
            "d_model": cfg.model.n_embd,
            "seq": cfg.model.block_size,
            "budget_bytes": cfg.budget_bytes,
            "memory": format!("{:?}", cfg.memory),
        }),
    });
    bus.publish(EventKind::LimitsSet {
        owner: stagehand::events::Owner::Device,
        budget_bytes: cfg.budget_bytes,
        high_watermark_bytes: None,
        low_watermark_bytes: None,
    });
}

/// Trains the GPT for `cfg.steps` steps on `device`, publishing every phase and per-step
/// metrics on `bus`. `on_step(step, loss, seconds)` runs after each step (progress display).
pub fn train(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    on_step: impl FnMut(u64, f64, f64),
) -> Result<Summary> {
    match cfg.memory {
        Memory::Resident => train_resident(cfg, device, bus, on_step),
        Memory::Streamed { .. } => train_streamed(cfg, device, bus, on_step),
    }
}

/// Publishes the end-of-step samples every run reports.
fn report_step(bus: &Bus, device: &Device, cfg: &TrainConfig, loss: f64, dt: f64) -> u64 {
    let mem = device.memory();
    bus.publish(EventKind::VramSample {
        allocated_bytes: mem.allocated,
        reserved_bytes: mem.reserved,
        peak_allocated_bytes: mem.peak,
    });
    bus.publish(EventKind::TrainStep(TrainStepMetrics {
        loss,
        step_time_s: dt,
        tokens: (cfg.batch * cfg.model.block_size) as u64,
        vram_peak_bytes: mem.peak,
    }));
    mem.peak
}

fn train_resident(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
) -> Result<Summary> {
    tch::manual_seed(cfg.seed);
    let vs = nn::VarStore::new(device.tch_device());
    let model = Gpt::new(&TchLayers(vs.root()), cfg.model);
    let mut opt = nn::AdamW::default().build(&vs, cfg.learning_rate)?;
    let mut losses = Vec::with_capacity(cfg.steps as usize);
    let (mut total, mut peak) = (0.0, 0u64);
    for step in 1..=cfg.steps {
        let t0 = Instant::now();
        device.reset_peak();
        bus.enter_phase(step, Phase::StepBegin);
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        bus.enter_phase(step, Phase::Forward);
        let logits = model.forward(&batch.inputs);
        let loss = Gpt::loss(&logits, &batch.targets);
        bus.enter_phase(step, Phase::Backward);
        opt.zero_grad();
        loss.backward();
        bus.enter_phase(step, Phase::Optimizer);
        opt.step();
        let loss_v = loss.double_value(&[]);
        bus.enter_phase(step, Phase::StepEnd);
        let dt = t0.elapsed().as_secs_f64();
        peak = peak.max(report_step(bus, device, cfg, loss_v, dt));
        total += dt;
        losses.push(loss_v);
        on_step(step, loss_v, dt);
    }
    bus.enter_phase(cfg.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: cfg.steps });
    Ok(Summary {
        steps: cfg.steps,
        losses,
        activations_spilled: 0,
        spill_bytes: 0,
        mean_step_s: total / cfg.steps.max(1) as f64,
        peak_bytes: peak,
    })
}

fn train_streamed(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
) -> Result<Summary> {
    let Memory::Streamed {
        weight_budget_bytes,
        spill_high_bytes,
        spill_low_bytes,
    } = cfg.memory
    else {
        anyhow::bail!("train_streamed needs Memory::Streamed");
    };
    tch::manual_seed(cfg.seed);
    // Weights: layer mode. The model is built in host memory; each linear and embedding is a
    // block streamed to the device ahead of use. The activation runtime's store resolves saved
    // weights through this runtime, so it installs no hooks of its own.
    let store = ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        LayerOptions {
            vram_budget: Some(weight_budget_bytes),
            prefetch_k: 2,
            telemetry: bus.clone(),
            device: Some(device.clone()),
            install_hooks: false,
            ..LayerOptions::default()
        },
    )?;
    let model = Gpt::new(&StreamedLayers(&store), cfg.model);
    let weights = store.runtime().clone();
    let mut opt = OffloadedAdamW::new(&weights, cfg.learning_rate, nn::AdamW::default())?;

    // Activations: spill above the high watermark into a pinned pool sized from the budget:
    // the seed's classes up to a quarter of the budget, each holding about half the budget.
    let budget_mb = (cfg.budget_bytes >> 20).max(4);
    let classes: Vec<u64> = [1u64, 4, 16, 64, 256]
        .into_iter()
        .filter(|c| *c <= (budget_mb / 4).max(1))
        .collect();
    let slabs: Vec<u32> = classes
        .iter()
        .map(|c| (budget_mb / (2 * c)).clamp(2, 128) as u32)
        .collect();
    let acts = ActivationRuntime::new(
        device.clone(),
        ActivationConfig::builder()
            .watermarks_bytes(spill_high_bytes, spill_low_bytes)
            .classes_mb(&classes)
            .slabs_per_class(&slabs)
            .max_inflight(4, 2)
            // Restores ahead of backward may use what the weights leave of the spill window.
            .restore_ahead(4, (spill_high_bytes - spill_low_bytes).max(1))
            .build()?,
        bus.clone(),
        Some(weights.resolver()),
    )?;

    // Conductor: phases, and for both runtimes knobs that follow its hints and a transfer
    // slot before every copy. The weights' prefetches (2 in flight) and the activations'
    // restores (2) share two H2D slots; the spills (4) have a D2H slot each.
    let mib = |b: u64| (b >> 20).max(1);
    let conductor = {
        let dev = device.clone();
        Conductor::new(
            ConductorConfig::builder()
                .enabled(cfg.conductor)
                .vram_soft_cap_mb(mib(cfg.budget_bytes))
                .vram_hard_cap_mb(mib(cfg.budget_bytes) + mib(cfg.budget_bytes) / 10 + 1)
                .h2d_slots(2)
                .d2h_slots(4)
                .build()?,
            bus.clone(),
            move || dev.memory().allocated,
        )?
    };
    weights.attach_conductor(&conductor)?;
    acts.attach_conductor(&conductor)?;

    let mut losses = Vec::with_capacity(cfg.steps as usize);
    let (mut total, mut peak) = (0.0, 0u64);
    let (mut spilled, mut spill_bytes) = (0u64, 0u64);
    for step in 1..=cfg.steps {
        let t0 = Instant::now();
        device.reset_peak();
        let phase = |p: Phase| -> Result<()> {
            if !conductor.is_enabled() {
                bus.enter_phase(step, p);
                return Ok(());
            }
            match p {
                Phase::StepBegin => conductor.begin_step(step)?,
                Phase::Forward => conductor.enter_forward()?,
                Phase::Backward => conductor.enter_backward()?,
                Phase::Optimizer => conductor.enter_optimizer()?,
                _ => conductor.end_step()?,
            }
            Ok(())
        };
        phase(Phase::StepBegin)?;
        acts.step_begin(step);
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        phase(Phase::Forward)?;
        let loss = {
            let _hooks = acts.managed_forward()?;
            let mut x = model.embed(&batch.inputs);
            for (i, block) in model.blocks.iter().enumerate() {
                let _region = acts.region(&format!("blocks.{i}"));
                x = block.forward(&x);
            }
            Gpt::loss(&model.logits(&x), &batch.targets)
        };
        phase(Phase::Backward)?;
        opt.zero_grad()?;
        loss.backward();
        let loss_v = loss.double_value(&[]);
        drop(loss);
        let m = acts.step_end()?;
        spilled += m.activations_spilled;
        spill_bytes += m.spill_bytes;
        phase(Phase::Optimizer)?;
        opt.step()?;
        phase(Phase::StepEnd)?;
        let dt = t0.elapsed().as_secs_f64();
        peak = peak.max(report_step(bus, device, cfg, loss_v, dt));
        total += dt;
        losses.push(loss_v);
        on_step(step, loss_v, dt);
    }
    weights.finish()?;
    conductor.shutdown();
    bus.enter_phase(cfg.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: cfg.steps });
    Ok(Summary {
        steps: cfg.steps,
        losses,
        activations_spilled: spilled,
        spill_bytes,
        mean_step_s: total / cfg.steps.max(1) as f64,
        peak_bytes: peak,
    })
}
