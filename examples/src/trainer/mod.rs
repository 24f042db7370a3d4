//! The demo's training loop as a library function, so the demo binary, the benchmark and the
//! end-to-end tests run exactly the same code: the GPT of this crate trained resident in plain
//! tch, or under one [`Stagehand`] handle with a device budget. The resident reference is in
//! `resident`, data parallel training over several GPUs in `group`.

use crate::data::progression_batch;
use crate::gpt::{Attention, Gpt, GptConfig, StreamedLayers};
use anyhow::Result;
use serde::Serialize;
use stagehand::device::Device;
use stagehand::events::{Bus, EventKind, StepTimeBreakdown};
use stagehand::optim::Kernel;
use stagehand::{Plan, Precision, Stagehand, StateStorage};
use std::sync::atomic::{AtomicBool, Ordering};
use tch::nn;

mod group;
mod resident;

pub use group::{train_group, RankSummary};
pub use resident::time_forward_backward;

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
    /// Sequences a step trains on (in a data-parallel group, the group's batch).
    pub batch: i64,
    /// Micro-batches a step's batch is split into (gradient accumulation; 1: none): each is a
    /// forward and a backward, and one optimizer step follows the last. More tokens a step
    /// spread the host optimizer's one pass over more device work.
    pub micro_batches: usize,
    pub learning_rate: f64,
    /// Device memory budget in bytes (the simulated VRAM on the host device).
    pub budget_bytes: u64,
    pub seed: i64,
    /// The host optimizer's kernel (Stagehand only; `None`: the handle's choice).
    #[serde(skip)]
    pub kernel: Option<Kernel>,
    /// What the run computes and updates in; the resident reference uses the same (bf16:
    /// bf16 weights, float32 masters, AdamW on the masters).
    pub precision: Precision,
    /// How the host optimizer stores its state (Stagehand only).
    pub optimizer_state: StateStorage,
    /// Intra-op threads of the training thread and of the host optimizer, the same for a
    /// resident run and a Stagehand one (`None`: libtorch's default, every core).
    pub threads: Option<usize>,
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

/// The demo's default budget for a data-parallel group on CUDA: `above` plus what each GPU
/// holds once a thread other than this one has run a product forward and backward on it. Each
/// rank trains on a thread of its own, and libtorch keeps cuBLAS workspaces per thread and
/// device (32 MiB each on Hopper): a budget read off this thread's warm-up alone left a rank's
/// plan no room. A second thread's workspaces are counted too, in case the rank's thread gets
/// handles of its own rather than the pooled ones. The largest over the GPUs.
pub fn group_budget(devices: &[Device], above: u64) -> Result<u64> {
    let mut budget = 0u64;
    for d in devices {
        d.warm_up()?;
        let before = d.memory().allocated;
        std::thread::scope(|s| {
            s.spawn(|| -> stagehand::Result<()> {
                d.bind_to_thread()?;
                d.warm_up()
            })
            .join()
        })
        .map_err(|_| anyhow::anyhow!("warming up {} on a thread of its own panicked", d.info().name))??;
        let held = d.memory().allocated;
        budget = budget.max(above.saturating_add(held).saturating_add(held.saturating_sub(before)));
    }
    Ok(budget)
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
                attention: Attention::Recomputed,
                checkpoint: false,
            },
            batch,
            micro_batches: 1,
            // Wider models need smaller steps: AdamW at 3e-3 trains d=128 well but diverges from
            // d=1024 on, so the rate falls with the width beyond 128.
            learning_rate: 3e-3 * (128.0 / d_model as f64).min(1.0),
            budget_bytes,
            seed: 0,
            kernel: None,
            precision: Precision::Fp32,
            optimizer_state: StateStorage::Fp32,
            threads: None,
        }
    }

    /// The intra-op threads the run uses: the setting, else libtorch's default.
    pub fn thread_count(&self) -> usize {
        self.threads.unwrap_or_else(|| usize::try_from(tch::get_num_threads()).unwrap_or(1)).max(1)
    }

    /// Trains in `p`, with the model as it trains in `p` ([`GptConfig::with_precision`]: in
    /// 16-bit precisions fused attention and checkpointed blocks; the float32 model keeps its
    /// recomputed attention and spills).
    pub fn with_precision(mut self, p: Precision) -> TrainConfig {
        self.precision = p;
        self.model = self.model.with_precision(p);
        self
    }

    /// The default precision on `device`: bf16 where it computes bf16 fast (CUDA compute
    /// capability 8.0 or later), fp32 elsewhere (the host device).
    pub fn default_precision(device: &Device) -> Precision {
        if device.is_cuda() && device.computes_bf16_fast() {
            Precision::Bf16
        } else {
            Precision::Fp32
        }
    }

    /// "gpt L=8 d=128 seq=64 (1.6M params), fp32".
    pub fn describe(&self) -> String {
        let m = &self.model;
        format!(
            "gpt L={} d={} seq={} ({:.1}M params){}, {}{}",
            m.n_layer,
            m.n_embd,
            m.block_size,
            m.parameters() as f64 / 1e6,
            if m.checkpoint { ", checkpointed blocks" } else { "" },
            self.precision,
            if self.micro_batches > 1 { format!(", {} micro-batches a step", self.micro_batches) } else { String::new() }
        )
    }

    /// The handle's builder for this run, its devices still to set: the budget, the bus, the
    /// Conductor, the precision, the optimizer's state and kernel as configured, the host
    /// optimizer on `host_threads` threads.
    fn builder(&self, bus: &Bus, host_threads: usize) -> stagehand::StagehandBuilder {
        let b = Stagehand::builder()
            .budget_bytes(self.budget_bytes)
            .bus(bus.clone())
            .conductor(self.conductor)
            .precision(self.precision)
            .optimizer_state(self.optimizer_state)
            .host_optimizer_threads(host_threads);
        match self.kernel {
            Some(k) => b.kernel(k),
            None => b,
        }
    }

    /// Tokens one step processes.
    pub fn tokens(&self) -> u64 {
        (self.batch.max(0) as u64).saturating_mul(self.model.block_size.max(0) as u64)
    }

    /// Checks the run before anything is built: the model's shape, a batch that splits evenly
    /// over `world` devices and each device's share over the micro-batches, and a model and
    /// batch the host's memory can hold while they are made (the plan then checks the whole
    /// host state, with its numbers, before the first step).
    pub fn check(&self, world: usize) -> Result<()> {
        self.model.check().map_err(|e| anyhow::anyhow!("the model's {e}"))?;
        let parts = (world.max(1) * self.micro_batches) as i64;
        anyhow::ensure!(self.micro_batches > 0, "micro-batches: at least 1");
        anyhow::ensure!(self.batch > 0, "a batch of {} sequences: at least 1", self.batch);
        anyhow::ensure!(
            self.batch % parts == 0,
            "a batch of {} sequences over {world} device(s) in {} micro-batch(es): a multiple of {parts}",
            self.batch,
            self.micro_batches
        );
        let available = stagehand::session::plan::host_available_bytes();
        if available > 0 {
            let gib = |b: f64| b / (1u64 << 30) as f64;
            // The float32 values the store makes and the pinned copy they move into.
            let model = self.model.parameters() as f64 * 8.0;
            anyhow::ensure!(
                model <= available as f64,
                "the model's {:.1}M parameters take {:.1} GiB of host memory to build (float32 values and their pinned copy), more than the {:.1} GiB available",
                self.model.parameters() as f64 / 1e6,
                gib(model),
                gib(available as f64)
            );
            // A step's token ids and targets (int64) and the temporaries that draw them.
            let inputs = self.tokens() as f64 * 32.0;
            anyhow::ensure!(
                inputs <= available as f64,
                "a step of {} tokens ({} sequences of {}) takes {:.1} GiB of host memory for its inputs alone, more than the {:.1} GiB available",
                self.tokens(),
                self.batch,
                self.model.block_size,
                gib(inputs),
                gib(available as f64)
            );
        }
        Ok(())
    }
}

/// Micro-batch `i` of `n` of a batch's rows (each `rows / n` sequences).
fn micro(t: &tch::Tensor, i: usize, n: usize) -> tch::Tensor {
    if n == 1 {
        return t.shallow_clone();
    }
    let rows = t.size()[0] / n as i64;
    t.narrow(0, i as i64 * rows, rows)
}

/// Called with the memory plan once it is known.
pub type OnPlan<'a> = Box<dyn FnMut(&Plan) + Send + 'a>;

/// What a caller adds to a run beyond each step's progress.
#[derive(Default)]
pub struct Hooks<'a> {
    /// Called with the memory plan once it is known, before the first step (Stagehand only).
    pub on_plan: Option<OnPlan<'a>>,
    /// Set (by a signal handler, say) to end the run after the step in progress: the run then
    /// ends as any run does (`run_ended`, the telemetry flushed).
    pub stop: Option<&'a AtomicBool>,
}

impl std::fmt::Debug for Hooks<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks").field("on_plan", &self.on_plan.is_some()).field("stop", &self.stop).finish()
    }
}

impl Hooks<'_> {
    fn stopped(&self) -> bool {
        self.stop.is_some_and(|s| s.load(Ordering::SeqCst))
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Steps run (fewer than asked when the run was stopped).
    pub steps: u64,
    /// Whether a stop ended the run before its last step.
    pub stopped: bool,
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
    /// Milliseconds the host optimizer's worker spent stepping blocks, by step (Stagehand
    /// only; its steps overlap the training step, so this is its load, not a wait).
    pub host_optimizer_ms: Vec<f64>,
    /// The memory plan (Stagehand only).
    pub plan: Option<Plan>,
    /// What the numeric guards checked (when on).
    pub guards: Option<stagehand::guards::Checked>,
    /// Spills checksummed and restores verified (when checksums are on).
    pub checksums: Option<(u64, u64)>,
    /// Bytes the activation runtime's arena held at the end, its pool's slabs and the memory
    /// its fallbacks gave back (pinned on CUDA): a device's own staging.
    pub activation_pool_bytes: u64,
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

    /// Adds step `step` of a handle's run (its report, the activation runtime's counts, and the
    /// host optimizer's busy time since the last step).
    fn record(&mut self, sh: &Stagehand, opt: &stagehand::optim::Optimizer, step: u64, r: &stagehand::StepReport) {
        self.host_optimizer_ms.push(opt.take_host_busy().as_secs_f64() * 1e3);
        if let Some(m) = sh.activations().and_then(|a| a.last_step_metrics()) {
            self.activations_spilled += m.activations_spilled;
            self.spill_bytes += m.spill_bytes;
        }
        self.peak_bytes = self.peak_bytes.max(r.vram_peak_bytes);
        self.step_peaks.push(r.vram_peak_bytes);
        self.losses.push(r.loss);
        self.step_times.push(r.step_ms / 1e3);
        self.breakdowns.push(r.time);
        self.steps = step;
    }

    /// Ends a handle's run: the plan, the guards' and checksums' counts, and the handle's
    /// telemetry finished.
    fn close(&mut self, sh: &Stagehand) -> Result<()> {
        self.plan = sh.plan();
        self.guards = sh.guard_checks();
        self.checksums = sh.checksum_counts();
        self.activation_pool_bytes = sh.activations().map_or(0, |a| a.pool_bytes());
        sh.finish()?;
        Ok(())
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
                "attention": format!("{:?}", m.attention).to_lowercase(), "checkpointed_blocks": m.checkpoint,
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
    train_with(cfg, device, bus, on_step, Hooks::default(), |b| b)
}

/// [`train`] with [`Hooks`], and `customize` for the handle's builder (Stagehand only).
pub fn train_with(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    on_step: impl FnMut(u64, f64, f64),
    hooks: Hooks<'_>,
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
) -> Result<Summary> {
    cfg.check(1)?;
    // The training thread's intra-op threads, the same in both modes; the handle's host
    // optimizer takes the same count.
    tch::set_num_threads(cfg.thread_count() as i32);
    match cfg.memory {
        Memory::Resident => resident::train_resident(cfg, device, bus, on_step, hooks),
        Memory::Stagehand => stagehand_run(cfg, device, bus, on_step, hooks, customize),
    }
}

/// Trains under a [`Stagehand`] handle built from `cfg` on `device` and `bus`; `customize` may
/// change the builder (attach the web server, say) before it is built.
pub fn train_stagehand(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    on_step: impl FnMut(u64, f64, f64),
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
) -> Result<Summary> {
    train_with(&TrainConfig { memory: Memory::Stagehand, ..cfg.clone() }, device, bus, on_step, Hooks::default(), customize)
}

fn stagehand_run(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
    mut hooks: Hooks<'_>,
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
) -> Result<Summary> {
    let sh = customize(cfg.builder(bus, cfg.thread_count()).device(device.clone())).build()?;
    sh.set_tokens_per_step(cfg.tokens());
    tch::manual_seed(cfg.seed);
    let model = Gpt::new(&StreamedLayers(sh.store()), cfg.model);
    let mut opt = sh.optimizer(nn::AdamW::default(), cfg.learning_rate)?;
    // The plan is known once the model and its optimizer are: say it before the first step.
    let plan = sh.prepare()?;
    if let Some(f) = &mut hooks.on_plan {
        f(&plan);
    }
    let mut s = Summary::default();
    for step in 1..=cfg.steps {
        if hooks.stopped() {
            s.stopped = true;
            break;
        }
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        let n = cfg.micro_batches;
        let r = sh.train_step_micro(&mut opt, n, |i| Gpt::loss(&tch::nn::Module::forward(&model, &micro(&batch.inputs, i, n)), &micro(&batch.targets, i, n)))?;
        s.record(&sh, &opt, step, &r);
        on_step(step, r.loss, r.step_ms / 1e3);
    }
    opt.wait()?;
    s.close(&sh)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_loss_or_a_guard_finding_fails_the_run() {
        let mut s = Summary { steps: 3, losses: vec![2.0, 1.5, 1.2], ..Summary::default() };
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
        assert_eq!((c["model"]["attention"].as_str(), c["model"]["checkpointed_blocks"].as_bool()), (Some("recomputed"), Some(false)));
        let c = run_config(&TrainConfig::demo(3, 2, 32, 8, 2, 16 << 20).with_precision(Precision::Bf16));
        assert_eq!((c["model"]["attention"].as_str(), c["model"]["checkpointed_blocks"].as_bool()), (Some("fused"), Some(true)));
        let mut r = TrainConfig::demo(3, 2, 32, 8, 2, 16 << 20);
        r.memory = Memory::Resident;
        let c = run_config(&r);
        assert_eq!((c["memory"]["mode"].as_str(), c["memory"]["conductor"].as_bool()), (Some("resident"), Some(false)));
    }
}
