//! The demo's training loop as a library function, so the demo binary and the end-to-end tests
//! run exactly the same code.

use crate::data::progression_batch;
use crate::gpt::{Gpt, GptConfig};
use anyhow::Result;
use stagehand::device::Device;
use stagehand::events::{Bus, EventKind, Phase, TrainStepMetrics};
use std::time::Instant;
use tch::nn::{self, Module, OptimizerConfig};

/// What to train and where.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub steps: u64,
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
            model: GptConfig {
                vocab: 128,
                block_size: seq,
                n_layer: layers,
                n_head: 4,
                n_embd: d_model,
            },
            batch,
            learning_rate: 3e-3,
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
        }),
    });
}

/// Trains the GPT for `cfg.steps` steps on `device`, publishing every phase and per-step
/// metrics on `bus`. `on_step(step, loss, seconds)` runs after each step (progress display).
pub fn train(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
) -> Result<Summary> {
    tch::manual_seed(cfg.seed);
    let vs = nn::VarStore::new(device.tch_device());
    let model = Gpt::new(&vs.root(), cfg.model);
    let mut opt = nn::AdamW::default().build(&vs, cfg.learning_rate)?;
    let budget = cfg.budget_bytes;
    let tokens = (cfg.batch * cfg.model.block_size) as u64;
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
        let mem = device.memory();
        peak = peak.max(mem.peak);
        bus.publish(EventKind::VramSample {
            allocated_bytes: mem.allocated,
            reserved_bytes: mem.reserved,
            peak_allocated_bytes: mem.peak,
            high_watermark_bytes: budget * 8 / 10,
            low_watermark_bytes: budget * 6 / 10,
            budget_bytes: budget,
        });
        bus.publish(EventKind::TrainStep(TrainStepMetrics {
            loss: loss_v,
            step_time_s: dt,
            tokens,
            vram_peak_bytes: mem.peak,
        }));
        total += dt;
        losses.push(loss_v);
        on_step(step, loss_v, dt);
    }
    bus.enter_phase(cfg.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: cfg.steps });
    Ok(Summary {
        steps: cfg.steps,
        losses,
        mean_step_s: total / cfg.steps.max(1) as f64,
        peak_bytes: peak,
    })
}
