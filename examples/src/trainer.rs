//! The demo's training loop as a library function, so the demo binary, the benchmark and the
//! end-to-end tests run exactly the same code: the GPT of this crate trained resident in plain
//! tch, or under one [`Stagehand`] handle with a device budget.

use crate::data::progression_batch;
use crate::gpt::{Gpt, GptConfig, StreamedLayers, TchLayers};
use anyhow::Result;
use serde::Serialize;
use stagehand::device::Device;
use stagehand::events::{Bus, EventKind, Phase, StepTimeBreakdown, TrainStepMetrics};
use stagehand::optim::Kernel;
use stagehand::{Plan, Stagehand};
use std::time::Instant;
use tch::nn::{self, OptimizerConfig};

/// How the model's memory is managed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Memory {
    /// Plain tch: every weight and activation stays on the device.
    Resident,
    /// One Stagehand handle: weights stream, activations spill, under the budget's plan.
    Stagehand,
}

/// What to train and where.
#[derive(Debug, Clone, Serialize)]
pub struct TrainConfig {
    pub steps: u64,
    pub memory: Memory,
    /// Run the Conductor (Stagehand only).
    pub conductor: bool,
    #[serde(skip)]
    pub model: GptConfig,
    pub batch: i64,
    pub learning_rate: f64,
    /// Device memory budget in bytes (the simulated VRAM on the host device).
    pub budget_bytes: u64,
    pub seed: i64,
    /// The host optimizer's kernel (Stagehand only; `None`: the handle's choice).
    #[serde(skip)]
    pub kernel: Option<Kernel>,
}

/// The demo's default shape: what `stagehand-demo` runs with no flags.
#[derive(Debug, Clone, Copy)]
pub struct DemoDefaults {
    /// Training steps.
    pub steps: u64,
    /// Transformer blocks.
    pub layers: i64,
    /// Embedding width.
    pub d_model: i64,
    /// Sequence length.
    pub seq: i64,
    /// Sequences per batch.
    pub batch: i64,
    /// Device budget in MiB on the host device.
    pub budget_mib: u64,
    /// On CUDA, MiB of budget above what libtorch holds for itself: the host device counts only
    /// what the runtimes hold, CUDA also the temporaries of the ops (about 12 MiB above the
    /// spill watermark for this model, measured on an H100).
    pub cuda_budget_mib: u64,
}

impl DemoDefaults {
    /// Bytes of the default budget on `device` (on CUDA, above what libtorch holds; see
    /// [`demo_budget`]).
    pub fn budget_above(&self, device: &Device) -> u64 {
        (if device.is_cuda() { self.cuda_budget_mib } else { self.budget_mib }) << 20
    }
}

/// `stagehand-demo`'s defaults, shared with the test that checks they show the system working
/// as designed (weights prefetched, nothing through pageable memory after the first step).
pub const DEMO_DEFAULTS: DemoDefaults = DemoDefaults {
    steps: 300,
    layers: 8,
    d_model: 128,
    seq: 64,
    batch: 16,
    budget_mib: 16,
    cuda_budget_mib: 32,
};

/// The budget the demo's default stands for on `device`: `above` bytes as they are on the host
/// device; on CUDA, `above` bytes beyond what libtorch holds for itself once work starts
/// (cuBLAS's workspaces, tens of MiB, which a budget this small would otherwise not hold).
/// `None` when no default is asked for.
pub fn demo_budget(device: &Device, above: Option<u64>) -> anyhow::Result<Option<u64>> {
    let Some(above) = above else { return Ok(None) };
    if !device.is_cuda() {
        return Ok(Some(above));
    }
    device.warm_up()?;
    Ok(Some(above.saturating_add(device.memory().allocated)))
}

impl TrainConfig {
    /// The demo's defaults at a given size.
    pub fn demo(steps: u64, layers: i64, d_model: i64, seq: i64, batch: i64, budget_bytes: u64) -> TrainConfig {
        TrainConfig {
            steps,
            memory: Memory::Stagehand,
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
            kernel: None,
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

    /// Tokens one step processes.
    pub fn tokens(&self) -> u64 {
        (self.batch * self.model.block_size) as u64
    }
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub steps: u64,
    pub losses: Vec<f64>,
    /// Wall time of each step, in seconds.
    pub step_times: Vec<f64>,
    /// Each step's time breakdown (Stagehand only).
    pub breakdowns: Vec<StepTimeBreakdown>,
    /// Saved tensors the activation runtime spilled, by its own count (0 when resident).
    pub activations_spilled: u64,
    /// Bytes it spilled.
    pub spill_bytes: u64,
    pub peak_bytes: u64,
    /// Each step's peak allocated device memory.
    pub step_peaks: Vec<u64>,
    /// The memory plan (Stagehand only).
    pub plan: Option<Plan>,
}

impl Summary {
    /// Mean loss of the first and last tenth of the run.
    pub fn loss_drop(&self) -> (f64, f64) {
        let n = (self.losses.len() / 10).max(1);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
        (mean(&self.losses[..n]), mean(&self.losses[self.losses.len() - n..]))
    }

    /// Why the run counts as failed for its numbers: a loss that was NaN or infinite, or
    /// non-finite values the guards found (`guards`, the tensors they named). `None` when
    /// every loss was finite and the guards found nothing.
    pub fn non_finite(&self, guards: &[&str]) -> Option<String> {
        let bad: Vec<usize> = (0..self.losses.len()).filter(|&i| !self.losses[i].is_finite()).collect();
        if bad.is_empty() && guards.is_empty() {
            return None;
        }
        let mut why = format!("the run went non-finite: {} of {} losses NaN or infinite", bad.len(), self.losses.len());
        if let Some(first) = bad.first() {
            why.push_str(&format!(" (the first at step {})", first + 1));
        }
        if !guards.is_empty() {
            why.push_str(&format!("; the guards found non-finite values in {}", guards.join(", ")));
        }
        Some(why)
    }

    /// Mean step time in seconds over steady state: every step after the first (which traces
    /// the itinerary and sizes the pools), or the only step.
    pub fn steady_step_s(&self) -> f64 {
        let s = if self.step_times.len() > 1 { &self.step_times[1..] } else { &self.step_times[..] };
        s.iter().sum::<f64>() / s.len().max(1) as f64
    }
}

/// The run's configuration as structured JSON: the training settings, the model, and how its
/// memory is managed (`memory.mode`, the budget, the Conductor).
pub fn run_config(cfg: &TrainConfig) -> serde_json::Value {
    let mut config = serde_json::to_value(cfg).unwrap_or_default();
    if let Some(o) = config.as_object_mut() {
        let m = &cfg.model;
        o.insert(
            "model".into(),
            serde_json::json!({
                "layers": m.n_layer, "d_model": m.n_embd, "heads": m.n_head,
                "seq": m.block_size, "vocab": m.vocab, "parameters": m.parameters(),
            }),
        );
        let streamed = cfg.memory == Memory::Stagehand;
        o.insert(
            "memory".into(),
            serde_json::json!({
                "mode": cfg.memory,
                "budget_bytes": cfg.budget_bytes,
                "streams_weights": streamed,
                "spills_activations": streamed,
                "conductor": streamed && cfg.conductor,
            }),
        );
    }
    config
}

/// Publishes `run_started` for this run on `bus`, with its configuration as structured JSON.
pub fn announce(bus: &Bus, cfg: &TrainConfig, device: &Device, run_id: &str) {
    announce_with(bus, cfg, device, run_id, serde_json::Value::Null);
}

/// [`announce`], with `extra`'s fields (an object) added to the configuration.
pub fn announce_with(bus: &Bus, cfg: &TrainConfig, device: &Device, run_id: &str, extra: serde_json::Value) {
    let mut config = run_config(cfg);
    if let (Some(o), serde_json::Value::Object(extra)) = (config.as_object_mut(), extra) {
        o.extend(extra);
    }
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
        config,
    });
}

/// Trains the GPT for `cfg.steps` steps on `device`, publishing every phase and per-step
/// metrics on `bus`. `on_step(step, loss, seconds)` runs after each step (progress display).
pub fn train(cfg: &TrainConfig, device: &Device, bus: &Bus, on_step: impl FnMut(u64, f64, f64)) -> Result<Summary> {
    match cfg.memory {
        Memory::Resident => train_resident(cfg, device, bus, on_step),
        Memory::Stagehand => train_stagehand(cfg, device, bus, on_step, |b| b),
    }
}

fn train_resident(cfg: &TrainConfig, device: &Device, bus: &Bus, mut on_step: impl FnMut(u64, f64, f64)) -> Result<Summary> {
    tch::manual_seed(cfg.seed);
    // Built on the CPU, as the streamed model is, so both start from the same weights.
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Gpt::new(&TchLayers(vs.root()), cfg.model);
    vs.set_device(device.tch_device());
    let mut opt = nn::AdamW::default().build(&vs, cfg.learning_rate)?;
    let mut s = Summary {
        steps: cfg.steps,
        losses: Vec::new(),
        step_times: Vec::new(),
        breakdowns: Vec::new(),
        activations_spilled: 0,
        spill_bytes: 0,
        peak_bytes: 0,
        step_peaks: Vec::new(),
        plan: None,
    };
    for step in 1..=cfg.steps {
        let t0 = Instant::now();
        device.reset_peak();
        bus.enter_phase(step, Phase::StepBegin);
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        bus.enter_phase(step, Phase::Forward);
        let loss = Gpt::loss(&tch::nn::Module::forward(&model, &batch.inputs), &batch.targets);
        bus.enter_phase(step, Phase::Backward);
        opt.zero_grad();
        loss.backward();
        bus.enter_phase(step, Phase::Optimizer);
        opt.step();
        let loss_v = loss.double_value(&[]);
        device.synchronize()?;
        bus.enter_phase(step, Phase::StepEnd);
        let dt = t0.elapsed().as_secs_f64();
        let mem = device.memory();
        bus.publish(EventKind::VramSample {
            allocated_bytes: mem.allocated,
            reserved_bytes: mem.reserved,
            peak_allocated_bytes: mem.peak,
        });
        bus.publish(EventKind::TrainStep(TrainStepMetrics {
            loss: loss_v,
            step_time_s: dt,
            tokens: cfg.tokens(),
            vram_peak_bytes: mem.peak,
        }));
        s.peak_bytes = s.peak_bytes.max(mem.peak);
        s.step_peaks.push(mem.peak);
        s.losses.push(loss_v);
        s.step_times.push(dt);
        on_step(step, loss_v, dt);
    }
    bus.enter_phase(cfg.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: cfg.steps });
    Ok(s)
}

/// Trains under a [`Stagehand`] handle built from `cfg` on `device` and `bus`; `customize` may
/// change the builder (attach the web server, say) before it is built.
pub fn train_stagehand(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
) -> Result<Summary> {
    let mut builder = Stagehand::builder()
        .budget_bytes(cfg.budget_bytes)
        .device(device.clone())
        .bus(bus.clone())
        .conductor(cfg.conductor);
    if let Some(k) = cfg.kernel {
        builder = builder.kernel(k);
    }
    let sh = customize(builder).build()?;
    sh.set_tokens_per_step(cfg.tokens());
    tch::manual_seed(cfg.seed);
    let model = Gpt::new(&StreamedLayers(sh.store()), cfg.model);
    let mut opt = sh.optimizer(nn::AdamW::default(), cfg.learning_rate)?;
    let mut s = Summary {
        steps: cfg.steps,
        losses: Vec::new(),
        step_times: Vec::new(),
        breakdowns: Vec::new(),
        activations_spilled: 0,
        spill_bytes: 0,
        peak_bytes: 0,
        step_peaks: Vec::new(),
        plan: None,
    };
    for step in 1..=cfg.steps {
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        let r = sh.train_step(&mut opt, || Gpt::loss(&tch::nn::Module::forward(&model, &batch.inputs), &batch.targets))?;
        if let Some(m) = sh.activations().and_then(|a| a.last_step_metrics()) {
            s.activations_spilled += m.activations_spilled;
            s.spill_bytes += m.spill_bytes;
        }
        s.peak_bytes = s.peak_bytes.max(r.vram_peak_bytes);
        s.step_peaks.push(r.vram_peak_bytes);
        s.losses.push(r.loss);
        s.step_times.push(r.step_ms / 1e3);
        s.breakdowns.push(r.time);
        on_step(step, r.loss, r.step_ms / 1e3);
    }
    opt.wait()?;
    s.plan = sh.plan();
    sh.finish()?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_loss_or_a_guard_finding_fails_the_run() {
        let mut s = Summary {
            steps: 3,
            losses: vec![2.0, 1.5, 1.2],
            step_times: Vec::new(),
            breakdowns: Vec::new(),
            activations_spilled: 0,
            spill_bytes: 0,
            peak_bytes: 0,
            step_peaks: Vec::new(),
            plan: None,
        };
        assert_eq!(s.non_finite(&[]), None);
        s.losses[1] = f64::NAN;
        s.losses[2] = f64::INFINITY;
        let why = s.non_finite(&[]).expect("failed");
        assert!(why.contains("2 of 3") && why.contains("step 2"), "{why}");
        s.losses = vec![1.0, 0.5];
        let why = s.non_finite(&["blocks.3 output"]).expect("the guards' finding fails it too");
        assert!(why.contains("blocks.3 output"), "{why}");
    }

    #[test]
    fn the_configuration_is_structured_json() {
        let c = run_config(&TrainConfig::demo(3, 2, 32, 8, 2, 16 << 20));
        assert_eq!(c["memory"]["mode"], "stagehand");
        assert_eq!(c["memory"]["budget_bytes"], 16u64 << 20);
        assert_eq!(c["memory"]["conductor"], true);
        assert_eq!(c["model"]["layers"], 2);
        let mut r = TrainConfig::demo(3, 2, 32, 8, 2, 16 << 20);
        r.memory = Memory::Resident;
        let c = run_config(&r);
        assert_eq!((c["memory"]["mode"].as_str(), c["memory"]["conductor"].as_bool()), (Some("resident"), Some(false)));
    }
}
