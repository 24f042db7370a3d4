//! The main job's benchmark: the demo GPT trained resident in plain tch and through one
//! Stagehand handle (layer mode, trainable weights, the host optimizer, activation spilling, the
//! Conductor, telemetry written and exported), from the same initial weights, in one run.
//!
//! Prints, for steady state (every step after the first): the step times, each term of the
//! floor max(resident step, H2D bytes / H2D bandwidth, D2H bytes / D2H bandwidth, one host
//! optimizer step over the same parameters timed alone), the ratio to it, the weight bytes
//! moved against the Belady minimum, the prefetch hit rate, the bytes spilled through pageable
//! memory, the peak against the budget, the time breakdown, and how far the two runs' losses
//! drift apart.
//!
//! On a GPU the default is the 1.21 B parameter model (24 layers, d=2048, seq 512, batch 8)
//! under a 4 GiB budget; on the host device a small one. Override with `MJ_LAYERS`, `MJ_D`,
//! `MJ_SEQ`, `MJ_BATCH`, `MJ_BUDGET_MIB`, `MJ_STEPS`, `MJ_THREADS` (libtorch's intra-op
//! threads, every thread's), `MJ_OPT_THREADS` (the host optimizer's threads alone, the handle's
//! `host_optimizer_threads`), `MJ_PARTS` (each block streamed as that many parts, the handle's
//! `Grouping::Parts`), `MJ_RECOMPUTE` (the fraction of recompute scopes that recompute, the
//! handle's `recompute_fraction`), `MJ_EARLY_STOP=0` (recomputations run their function to its
//! end, the handle's `recompute_early_stop(false)`), `MJ_HOST_SUMS=1` (later micro-batches'
//! gradients added on the host, the handle's `host_gradient_sums(true)`), `MJ_HOOK_GPU=1` (the
//! compute stream's time inside the weights' hooks measured, the handle's
//! `measure_hook_gpu_time`), `MJ_SPILL_BATCH_KIB` (spill batches of up to that many KiB for
//! tensors under a quarter of it, 0: none; the handle's `spill_batches`), `MJ_POOL_GIB` (the
//! activation pool's pinned limit, the handle's `activation_pool_limit_bytes`); `MJ_PRECISION`
//! (fp32, tf32, bf16, fp16; default bf16 where the device computes bf16 fast, else fp32: the
//! resident run trains in the same precision, from the same initial weights), `MJ_STATE` (the
//! host optimizer's state: fp32, bf16, int8), `MJ_RESIDENT` (`train`, the default: the resident
//! run trains with its optimizer; `fwdbwd`: its forward and backward alone, for a model whose
//! optimizer does not fit on the device, in `MJ_RESIDENT_MICRO` micro-batches (default
//! `MJ_MICRO`) with blocks checkpointed or not as `MJ_RESIDENT_CHECKPOINT` says (default as the
//! handle's run), so that the floor's resident term is measured in the same command; `skip`, or
//! `MJ_SKIP_RESIDENT=1`: no resident run, so the floor has no resident term), `MJ_CHECKPOINT` (1: each block checkpointed, one recompute
//! scope over its input and weights, so only block inputs are stored; 0: not; default: the
//! demo's rule, on in 16-bit precisions), `MJ_MICRO` (the step's batch split into that many
//! micro-batches, gradient accumulation, in both runs; with `MJ_GPUS=N`, each GPU takes
//! `MJ_MICRO / N` of them: a multiple of N, or fewer than N, each GPU then one).
//! Telemetry goes to `$OUT/main_job-<pid>.jsonl` (or a temporary file) at the full level, every
//! event, with the Prometheus exporter attached (a data-parallel run's, every GPU on its lane, to
//! `main_job-group-<pid>.jsonl`, with the same sinks); `MJ_COMPARE_DISABLED=1` trains a third time with the
//! event bus disabled and prints what the telemetry costs the step.
//!
//! `MJ_GPUS=N` (N > 1) then trains the same model data parallel on N GPUs (on the host device,
//! N simulated ones) at the same global batch (each GPU its `MJ_BATCH / N` sequences), from the
//! same initial weights and batches, and prints each GPU's step breakdown (compute, waits, the
//! optimizer, its gradient reductions' time on the device, the H2D and D2H bytes, its host
//! optimizer's time, and with micro-batches its last backward against the others', which the
//! host optimizer's pass overlaps), the tokens a second against the one-GPU run's (the scaling), both loss
//! curves, and the host memory each run took (peak resident set over what was there before, and
//! what the plans count) with its ratio, and each GPU's own pinned staging (its activation pool)
//! against the bound 1.1x one GPU's host memory plus the staging beyond one GPU's. Two GPUs:
//! `MJ_GPUS=2 cargo bench -p stagehand-examples --bench main_job`. `MJ_RANK_OPT_THREADS=16,14`
//! sets each rank's host optimizer threads (the one-GPU run keeps its own), one data-parallel
//! run per value listed, each against the same one-GPU run.
//!
//! Run: `cargo bench -p stagehand-examples --bench main_job`.

use stagehand::device::{bandwidth, Device};
use stagehand::events::{Bus, Hub, Snapshot, StepTimeBreakdown};
use stagehand::{Precision, StateStorage};
use stagehand_examples::floors::host_optimizer_step_s;
use stagehand_examples::trainer::{time_forward_backward, train, train_group, train_stagehand, Memory, Summary, TrainConfig};
use std::sync::Arc;
use std::time::Instant;


fn env(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const MIB: f64 = (1u64 << 20) as f64;

/// The activation runtime's spill copies after step 1, tallied as the telemetry tallies a step's
/// copies: how many, their bytes, and the rate of the timed ones (one in 16 on CUDA).
struct SpillCopySink(Arc<std::sync::Mutex<stagehand::events::CopyStats>>);

impl stagehand::events::EventSink for SpillCopySink {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        use stagehand::events::{Direction, EventKind, Owner};
        if let EventKind::TransferCompleted {
            dir: Direction::D2h,
            owner: Owner::Activations,
            bytes,
            duration_ms,
            ..
        } = &e.kind
        {
            if e.step <= 1 {
                return;
            }
            if let Ok(mut c) = self.0.lock() {
                c.record(*bytes, *duration_ms);
            }
        }
    }
}

/// Each device's backward passes, step by step, in order (ms): whether the last micro-batch's
/// backward, which the host optimizer's pass overlaps, takes longer than the others.
#[derive(Clone, Default)]
struct Backwards(Arc<std::sync::Mutex<BackwardsByStep>>);

/// (device, step) -> that step's backward passes, ms.
type BackwardsByStep = std::collections::BTreeMap<(u32, u64), Vec<f64>>;

impl stagehand::events::EventSink for Backwards {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        use stagehand::events::{EventKind, Phase};
        if let EventKind::PhaseChanged { from: Phase::Backward, duration_s, .. } = &e.kind {
            if let Ok(mut m) = self.0.lock() {
                m.entry((e.device.unwrap_or(0), e.step)).or_default().push(duration_s * 1e3);
            }
        }
    }
}

impl Backwards {
    /// Over device `dev`'s steady steps of more than one micro-batch: the last backward's mean
    /// and the others' mean, ms.
    fn tail(&self, dev: u32) -> Option<(f64, f64)> {
        let m = self.0.lock().ok()?;
        let (mut last, mut others) = (Vec::new(), Vec::new());
        for (_, passes) in m.range((dev, 2)..=(dev, u64::MAX)).filter(|(_, p)| p.len() > 1) {
            let (l, o) = passes.split_last()?;
            last.push(*l);
            others.extend_from_slice(o);
        }
        (!last.is_empty()).then(|| (mean(&last), mean(&others)))
    }

    /// The line the summaries print, where there is one.
    fn line(&self, dev: u32) -> Option<String> {
        self.tail(dev)
            .map(|(last, others)| format!("the last micro-batch's backward {last:.1} ms, the others' {others:.1} ms on average (steady steps)"))
    }
}

/// This process's resident set now and at its highest (kB from /proc/self/status), in bytes.
fn host_memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Hands freed heap memory back to the system and restarts the resident set's high-water mark,
/// so that the next run's peak counts only what it holds.
fn reset_host_memory() {
    // SAFETY: glibc's malloc_trim only releases free memory of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
    // "5" restarts VmHWM (Linux 4.0 and later); a kernel without it keeps the process's peak.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn steady<T>(v: &[T]) -> &[T] {
    if v.len() > 1 {
        &v[1..]
    } else {
        v
    }
}

fn main() -> anyhow::Result<()> {
    stagehand::torch::init();
    stagehand::torch::hooks::install()?;
    let probe = Device::auto(1 << 30);
    let cuda = probe.is_cuda();
    let layers = env("MJ_LAYERS", if cuda { 24 } else { 4 });
    let d = env("MJ_D", if cuda { 2048 } else { 64 });
    let seq = env("MJ_SEQ", if cuda { 512 } else { 32 });
    let batch = env("MJ_BATCH", if cuda { 8 } else { 4 });
    let budget_mib = env("MJ_BUDGET_MIB", if cuda { 4096 } else { 8 }) as u64;
    let steps = env("MJ_STEPS", if cuda { 6 } else { 4 }).max(2) as u64;
    let budget = budget_mib << 20;
    if let Some(n) = std::env::var("MJ_THREADS").ok().and_then(|v| v.parse::<i32>().ok()) {
        // libtorch's intra-op threads: the host optimizer's kernels share the cores with the
        // training thread and the copy issue.
        tch::set_num_threads(n);
        println!("libtorch threads: {n}");
    }
    let device = if cuda { probe.clone() } else { Device::host(budget) };
    let precision = match std::env::var("MJ_PRECISION") {
        Ok(p) => p.parse::<Precision>().map_err(anyhow::Error::msg)?,
        Err(_) => TrainConfig::default_precision(&device),
    };
    let storage = match std::env::var("MJ_STATE") {
        Ok(s) => s.parse::<StateStorage>().map_err(anyhow::Error::msg)?,
        Err(_) => StateStorage::Fp32,
    };
    let mut cfg = TrainConfig::demo(steps, layers, d, seq, batch, budget).with_precision(precision);
    cfg.optimizer_state = storage;
    // 0 or less is refused by the split's check, not taken as 1.
    cfg.micro_batches = usize::try_from(env("MJ_MICRO", 1)).unwrap_or(0);
    cfg.check(1)?;
    // Checkpointed blocks (each block one recompute scope; the resident run computes the same):
    // the demo's rule (on in 16-bit precisions) unless MJ_CHECKPOINT says.
    if let Ok(v) = std::env::var("MJ_CHECKPOINT") {
        cfg.model.checkpoint = v != "0";
    }
    let resident_mode = match std::env::var("MJ_RESIDENT") {
        Ok(m) => m,
        Err(_) if std::env::var_os("MJ_SKIP_RESIDENT").is_some() => "skip".to_owned(),
        Err(_) => "train".to_owned(),
    };
    println!("device: {} ({})", device.info().name, if cuda { "cuda" } else { "host-simulated" });
    println!(
        "model: {} batch {batch}{} ({} tokens a step), budget {budget_mib} MiB, {steps} steps (steady state: steps 2..), optimizer state {storage}",
        cfg.describe(),
        if cfg.micro_batches > 1 { format!(" in {} micro-batches of {}", cfg.micro_batches, batch / cfg.micro_batches as i64) } else { String::new() },
        cfg.tokens()
    );

    // ---- resident: plain tch, same precision -------------------------------------------------
    let mut resident_fwdbwd_s = None;
    let resident: Option<Summary> = match resident_mode.as_str() {
        "train" => {
            let mut r = cfg.clone();
            r.memory = Memory::Resident;
            let s = train(&r, &device, &Bus::disabled(), |_, _, _| {})?;
            println!(
                "resident: {:.1} ms/step (steady mean), peak {:.0} MiB ({precision}{})",
                mean(steady(&s.step_times)) * 1e3,
                s.peak_bytes as f64 / MIB,
                if precision.is_mixed() { ": 16-bit weights, float32 masters, AdamW on the masters on the device" } else { "" }
            );
            Some(s)
        }
        "fwdbwd" => {
            // The same tokens, in the split that fits the device: a model whose optimizer does not
            // fit may still not fit with the handle's micro-batches unless they are smaller.
            let mut r = cfg.clone();
            r.micro_batches = usize::try_from(env("MJ_RESIDENT_MICRO", cfg.micro_batches as i64)).unwrap_or(0);
            if let Ok(v) = std::env::var("MJ_RESIDENT_CHECKPOINT") {
                r.model.checkpoint = v != "0";
            }
            r.check(1)?;
            let t = time_forward_backward(&r, &device)?;
            let s = mean(steady(&t));
            println!(
                "resident forward+backward alone (no optimizer{}, {} micro-batches of {}): {:.1} ms/step (steady mean), {:.0} TFLOPS at 6 x parameters x tokens",
                if r.model.checkpoint { ", blocks recomputed" } else { ", nothing recomputed" },
                r.micro_batches,
                batch / r.micro_batches as i64,
                s * 1e3,
                6.0 * cfg.model.parameters() as f64 * cfg.tokens() as f64 / s / 1e12
            );
            resident_fwdbwd_s = Some(s);
            None
        }
        "skip" => None,
        other => anyhow::bail!("MJ_RESIDENT={other}: one of train, fwdbwd, skip"),
    };
    device.synchronize()?;
    reset_host_memory();
    let (rss_before, _) = host_memory();

    // ---- Stagehand, with telemetry written and exported ------------------------------------
    let (hub, file, metrics) = telemetry("main_job")?;
    let spill_copies = Arc::new(std::sync::Mutex::new(stagehand::events::CopyStats::default()));
    hub.add_sink(Box::new(SpillCopySink(spill_copies.clone())));
    let backwards = Backwards::default();
    hub.add_sink(Box::new(backwards.clone()));
    let bus = Bus::with_hub(hub.clone(), 1 << 20);
    let t_all = Instant::now();
    // Each rank's host optimizer threads with MJ_GPUS, as many variants as listed, each against
    // the one-GPU run below (default: the trainer's, its thread count over the GPUs).
    let rank_threads: Vec<Option<usize>> = match std::env::var("MJ_RANK_OPT_THREADS") {
        Ok(v) => v
            .split(',')
            .map(|t| t.trim().parse::<usize>().ok().filter(|&n| n > 0).map(Some))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("MJ_RANK_OPT_THREADS={v}: thread counts over 0, separated by commas"))?,
        Err(_) => vec![None],
    };
    let opt_threads = std::env::var("MJ_OPT_THREADS").ok().and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = opt_threads {
        println!("host optimizer threads: {n}");
    }
    let parts = std::env::var("MJ_PARTS").ok().and_then(|v| v.parse::<u32>().ok());
    if let Some(n) = parts {
        println!("streaming units: {n} parts per block");
    }
    let recompute = std::env::var("MJ_RECOMPUTE").ok().and_then(|v| v.parse::<f64>().ok());
    if let Some(f) = recompute {
        println!("recompute fraction: {f}");
    }
    let early_stop = std::env::var("MJ_EARLY_STOP").ok().map(|v| v != "0");
    if let Some(on) = early_stop {
        println!("recomputations stop at their last save: {on}");
    }
    let batch_kib = std::env::var("MJ_SPILL_BATCH_KIB").ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(k) = batch_kib {
        println!("spill batches: up to {k} KiB, tensors under {} KiB", k / 4);
    }
    let pool_gib = std::env::var("MJ_POOL_GIB").ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(g) = pool_gib {
        println!("activation pool limit: {g} GiB");
    }
    let hook_gpu = std::env::var("MJ_HOOK_GPU").is_ok_and(|v| v != "0");
    let host_sums = std::env::var("MJ_HOST_SUMS").ok().map(|v| v != "0");
    if let Some(on) = host_sums {
        println!("later micro-batches' gradients added on the host: {on}");
    }
    let customize = |mut b: stagehand::StagehandBuilder| {
        if hook_gpu {
            b = b.measure_hook_gpu_time(true);
        }
        if let Some(on) = host_sums {
            b = b.host_gradient_sums(on);
        }
        if let Some(g) = pool_gib {
            b = b.activation_pool_limit_bytes(g.saturating_mul(1 << 30));
        }
        if let Some(k) = batch_kib {
            b = b.spill_batches((k << 10) / 4, k << 10);
        }
        if let Some(f) = recompute {
            b = b.recompute_fraction(f);
        }
        if let Some(on) = early_stop {
            b = b.recompute_early_stop(on);
        }
        if let Some(n) = opt_threads {
            b = b.host_optimizer_threads(n);
        }
        if let Some(n) = parts {
            b = b.grouping(stagehand::nn::Grouping::Parts(n));
        }
        b
    };
    let s = train_stagehand(&cfg, &device, &bus, |_, _, _| {}, customize)?;
    bus.flush();
    let snap: Snapshot = hub.snapshot();
    bus.close();
    let wall = t_all.elapsed().as_secs_f64();
    let step_s = mean(steady(&s.step_times));
    println!(
        "stagehand: {:.1} ms/step (steady mean; step 1 {:.1} ms = {:.2}x the steady step), {:.1} s in all, telemetry {} ({} events, {} dropped)",
        step_s * 1e3,
        s.step_times[0] * 1e3,
        s.step_times[0] / step_s.max(1e-12),
        wall,
        file.display(),
        snap.events_applied,
        snap.dropped_events
    );
    let flops = 6.0 * cfg.model.parameters() as f64 * cfg.tokens() as f64;
    println!(
        "throughput: {:.1} TFLOPS (6 x {:.3} B parameters x {} tokens / step time), {:.0} tokens/s",
        flops / step_s / 1e12,
        cfg.model.parameters() as f64 / 1e9,
        cfg.tokens(),
        cfg.tokens() as f64 / step_s
    );
    let (rss, hwm) = host_memory();
    println!(
        "host memory: {:.1} GiB resident now, {:.1} GiB at the most ({:.1} GiB before the handle was made)",
        rss as f64 / (1u64 << 30) as f64,
        hwm as f64 / (1u64 << 30) as f64,
        rss_before as f64 / (1u64 << 30) as f64
    );
    let ms: Vec<String> = s.step_times.iter().map(|t| format!("{:.1}", t * 1e3)).collect();
    println!("  step times: [{}] ms", ms.join(", "));
    if let Some(plan) = &s.plan {
        for line in &plan.reasons {
            println!("  plan: {line}");
        }
    }

    // ---- per-step figures from the telemetry ---------------------------------------------
    let records: Vec<_> = snap.steps.iter().filter(|r| r.step > 1 && r.step <= steps).collect();
    let n = records.len().max(1) as f64;
    let sum = |f: &dyn Fn(&stagehand::events::snapshot::StepRecord) -> f64| records.iter().map(|r| f(r)).sum::<f64>() / n;
    let w_h2d = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.load_bytes() as f64));
    let w_min = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.min_h2d_bytes as f64));
    let w_d2h = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.d2h_bytes as f64));
    let g_sum = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_h2d_bytes as f64));
    let host_sum_bytes = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_host_bytes as f64));
    let host_sum_ms = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_host_ms));
    let a_restore = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.restore_bytes as f64));
    let a_spill = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.spill_bytes as f64));
    let pageable = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.pageable_bytes as f64));
    let hits = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.prefetch_hits as f64));
    let misses = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.prefetch_misses as f64));
    let h2d = w_h2d + a_restore + g_sum;
    let d2h = w_d2h + a_spill;
    let host_w = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.host_ms));
    let hook_gpu_ms = sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.hook_gpu_ms));
    let host_a = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.host_ms));
    let recomputed = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.recompute_bytes as f64));
    let recompute_ms = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.recompute_ms));
    let scopes = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.scopes_recomputed as f64));
    let stopped = sum(&|r| r.activations.as_ref().map_or(0.0, |a| a.scopes_stopped_early as f64));

    // ---- the floor, measured in this run -----------------------------------------------------
    let bw = bandwidth::measure(&device, if cuda { 256 << 20 } else { 32 << 20 })?;
    let trained = cfg.model.parameters();
    let streamed_blocks = layers.max(1);
    let opt_s = host_optimizer_step_s(trained.max(1), streamed_blocks, precision, storage)?;
    let resident_s = resident.as_ref().map_or(resident_fwdbwd_s.unwrap_or(0.0), |r| mean(steady(&r.step_times)));
    let terms = [
        (if resident_fwdbwd_s.is_some() { "resident forward+backward" } else { "resident step" }, resident_s),
        ("H2D bytes / bandwidth", h2d / bw.h2d),
        ("D2H bytes / bandwidth", d2h / bw.d2h),
        ("host optimizer step alone", opt_s),
    ];
    let floor = terms.iter().map(|t| t.1).fold(0.0, f64::max);
    println!("pinned bandwidth: H2D {:.1} GB/s, D2H {:.1} GB/s", bw.h2d / 1e9, bw.d2h / 1e9);
    for (name, v) in terms {
        println!("  term {name:28} {:9.1} ms", v * 1e3);
    }
    println!(
        "  per step: H2D {:.1} MiB (weights {:.1}, restores {:.1}, gradient sums {:.1}), D2H {:.1} MiB (gradients {:.1}, spills {:.1})",
        h2d / MIB,
        w_h2d / MIB,
        a_restore / MIB,
        g_sum / MIB,
        d2h / MIB,
        w_d2h / MIB,
        a_spill / MIB
    );
    if host_sum_bytes > 0.0 {
        println!("  gradient sums on the host: {:.1} MiB added a step, {host_sum_ms:.1} ms on their worker", host_sum_bytes / MIB);
    }
    println!(
        "weights moved per step: {:.1} MiB against a Belady minimum of {:.1} MiB ({:.3}x)",
        w_h2d / MIB,
        w_min / MIB,
        if w_min > 0.0 { w_h2d / w_min } else { 0.0 }
    );
    println!(
        "prefetch hit rate after step 1: {:.1}% ({hits:.0} hits, {misses:.0} misses per step)",
        100.0 * hits / (hits + misses).max(1.0)
    );
    println!("pageable-fallback bytes per step after step 1: {pageable:.0}");
    if let Ok(c) = spill_copies.lock() {
        println!(
            "spill copies per step after step 1: {:.1} ({:.2} MiB on average), {:.1} GB/s while copying (the timed ones)",
            c.count as f64 / n,
            c.bytes as f64 / c.count.max(1) as f64 / MIB,
            c.mean_gbps()
        );
    }
    println!(
        "recomputed in backward instead of stored, per step: {:.1} MiB ({recompute_ms:.1} ms of host time; {scopes:.0} scopes, {stopped:.0} stopped at their last save)",
        recomputed / MIB
    );
    println!(
        "training-thread time in Stagehand's hooks per step: {:.1} ms (weights {host_w:.1}, saved tensors {host_a:.1}; the recomputation above not in it)",
        host_w + host_a
    );
    if hook_gpu {
        println!("  the compute stream inside the weights' hooks per step: {hook_gpu_ms:.1} ms (idle while the training thread is in them, plus the waits and kernels they queue)");
    }
    println!(
        "host optimizer busy per step: {:.1} ms (steady mean; overlapping the step), against {:.1} ms alone; {:.1} of its {:.1} blocks a step given to it while backward ran",
        mean(steady(&s.host_optimizer_ms)),
        opt_s * 1e3,
        sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.host_steps_during_backward() as f64)),
        sum(&|r| r.weights.as_ref().map_or(0.0, |w| w.host_steps as f64)),
    );
    let first = s.step_peaks.first().copied().unwrap_or(0);
    let later = steady(&s.step_peaks).iter().copied().max().unwrap_or(0);
    let over = |b: u64| if b > budget { " (OVER)" } else { "" };
    println!(
        "peak allocated: {:.0} MiB in step 1{}, {:.0} MiB in steps 2.. {}, of a {budget_mib} MiB budget; per step {:?} MiB",
        first as f64 / MIB,
        over(first),
        later as f64 / MIB,
        over(later),
        s.step_peaks.iter().map(|&b| b >> 20).collect::<Vec<_>>()
    );
    println!("{}", stagehand_examples::report::time_per_step(steady(&s.breakdowns)));
    if let Some(line) = backwards.line(0) {
        println!("backward: {line}");
    }
    // Step by step: where a step that is slower than the others (warming up, a busy host) loses.
    for (i, b) in s.breakdowns.iter().enumerate() {
        let rec = snap.steps.iter().find(|r| r.step == i as u64 + 1);
        let hooks_w = rec.and_then(|r| r.weights.as_ref()).map_or(0.0, |w| w.host_ms);
        let hooks_a = rec.and_then(|r| r.activations.as_ref()).map_or(0.0, |a| a.host_ms);
        let pin = rec.and_then(|r| r.activations.as_ref()).map_or(0.0, |a| a.pin_ms);
        println!(
            "  step {}: {:.1} ms: compute {:.1}, waits H2D {:.1} / D2H {:.1}, stalls {:.1}, optimizer {:.1}, other {:.1}; hooks weights {hooks_w:.1} / saved tensors {hooks_a:.1} ms (pinning for spills {pin:.1} ms)",
            i + 1,
            b.step_ms,
            b.compute_ms,
            b.h2d_wait_ms,
            b.d2h_wait_ms,
            b.weight_stall_ms + b.restore_stall_ms,
            b.optimizer_ms,
            b.other_ms
        );
    }
    if let Some(r) = &resident {
        let drift = r
            .losses
            .iter()
            .zip(&s.losses)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1e-12))
            .fold(0.0, f64::max);
        println!("losses resident {:?}", r.losses);
        println!("losses stagehand {:?}", s.losses);
        println!("largest relative loss difference: {drift:.2e}");
        println!("ratio to resident: {:.2}x", step_s / resident_s.max(1e-12));
    }
    if resident.is_some() || resident_fwdbwd_s.is_some() {
        println!("ratio to floor: {:.3} (target <= 1.25)", step_s / floor.max(1e-12));
    } else {
        // Without the resident step the floor misses its largest term: no ratio to quote.
        println!(
            "ratio to floor: not measured (MJ_SKIP_RESIDENT: the floor lacks the resident step; {:.3}x the copy and optimizer terms)",
            step_s / floor.max(1e-12)
        );
    }
    let _ = metrics.render();
    let gpus = env("MJ_GPUS", 1).max(1) as usize;
    if gpus > 1 {
        for threads in rank_threads {
            let customize = move |b| match threads {
                Some(n) => customize(b).host_optimizer_threads(n),
                None => customize(b),
            };
            if let Some(n) = threads {
                println!();
                println!("each rank's host optimizer threads: {n}");
            }
            data_parallel(&cfg, gpus, cuda, budget, &s, customize, (hwm.saturating_sub(rss_before), rss_before))?;
        }
    }
    if std::env::var_os("MJ_COMPARE_DISABLED").is_some() {
        // The same run with no event bus: what every sink together (the full-level file and
        // the metrics) costs the step.
        device.synchronize()?;
        let quiet = train_stagehand(&cfg, &device, &Bus::disabled(), |_, _, _| {}, customize)?;
        let quiet_s = mean(steady(&quiet.step_times));
        println!(
            "telemetry cost: {:.1} ms/step with every event to the file and the metrics, {:.1} ms/step with the bus disabled: {:+.1}%",
            step_s * 1e3,
            quiet_s * 1e3,
            100.0 * (step_s / quiet_s.max(1e-12) - 1.0)
        );
    }
    Ok(())
}

/// Every sink the bench attaches: a full-level JSONL file `$OUT/<name>-<pid>.jsonl` (or in the
/// temporary directory; `-2`, `-3`, ... after the pid for a name used again) and the Prometheus
/// metrics, on a new hub.
fn telemetry(name: &str) -> anyhow::Result<(Arc<Hub>, std::path::PathBuf, stagehand_exporter::Metrics)> {
    let hub = Arc::new(Hub::new());
    let out_dir = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    // A name used again (one data-parallel run per `MJ_RANK_OPT_THREADS` value) gets a number.
    static OPENED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    let again = opened.iter().filter(|n| *n == name).count();
    opened.push(name.to_owned());
    let suffix = if again == 0 { String::new() } else { format!("-{}", again + 1) };
    let file = out_dir.join(format!("{name}-{}{suffix}.jsonl", std::process::id()));
    hub.add_sink(Box::new(stagehand::events::JsonlSink::open(&file, stagehand::events::OpenMode::CreateNew)?));
    let metrics = stagehand_exporter::Metrics::new();
    hub.add_snapshot_sink(Box::new(metrics.clone()));
    Ok((hub, file, metrics))
}

/// `MJ_GPUS`: the same model data parallel on `gpus` GPUs at the same global batch, against the
/// one-GPU run `one` (its host memory: peak growth over what was there before, and that base).
fn data_parallel(
    cfg: &TrainConfig,
    gpus: usize,
    cuda: bool,
    budget: u64,
    one: &Summary,
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
    (one_host, _): (u64, u64),
) -> anyhow::Result<()> {
    use stagehand::parallel::Devices;
    let devices = if cuda { Devices::cuda(gpus)? } else { Devices::host(gpus, budget) };
    // The same micro-batches as one GPU's, shared out: each GPU takes its part of them (one, of
    // its whole slice, when there are fewer than GPUs); a count the GPUs cannot share is refused.
    anyhow::ensure!(
        cfg.micro_batches < gpus || cfg.micro_batches.is_multiple_of(gpus),
        "MJ_MICRO={} micro-batches do not share out over {gpus} GPUs: a multiple of {gpus}, or fewer than {gpus}",
        cfg.micro_batches
    );
    let cfg = &TrainConfig { micro_batches: (cfg.micro_batches / gpus).max(1), ..cfg.clone() };
    println!();
    println!(
        "data parallel: {gpus} GPUs ({}), the same global batch of {} sequences ({} each{}), the same initial weights and batches{}",
        if cuda { "cuda" } else { "host-simulated" },
        cfg.batch,
        cfg.batch / gpus as i64,
        if cfg.micro_batches > 1 { format!(", in {} micro-batches", cfg.micro_batches) } else { String::new() },
        if cuda { stagehand::parallel::nccl_version().map(|v| format!(", NCCL {v}")).unwrap_or_default() } else { String::new() }
    );
    reset_host_memory();
    let (before, _) = host_memory();
    let t0 = Instant::now();
    // Every sink attached, as for one GPU: each GPU's events in the one file, on its lane.
    let (hub, file, metrics) = telemetry("main_job-group")?;
    let backwards = Backwards::default();
    hub.add_sink(Box::new(backwards.clone()));
    let bus = Bus::with_hub(hub.clone(), 1 << 20);
    let ranks = train_group(cfg, devices, &bus, |_, _, _, _| {}, Default::default(), customize)?;
    let (_, hwm) = host_memory();
    let group_host = hwm.saturating_sub(before);
    bus.flush();
    let snap = hub.snapshot();
    let _ = metrics.render();
    println!(
        "  {:.1} s in all, telemetry {} ({} events, {} dropped)",
        t0.elapsed().as_secs_f64(),
        file.display(),
        snap.events_applied,
        snap.dropped_events
    );
    let one_s = mean(steady(&one.step_times));
    // The group's step ends when its slowest rank's does.
    let steps = ranks.iter().map(|r| r.summary.step_times.len()).min().unwrap_or(0);
    let group_times: Vec<f64> = (0..steps).map(|i| ranks.iter().map(|r| r.summary.step_times[i]).fold(0.0, f64::max)).collect();
    let group_s = mean(steady(&group_times));
    for r in &ranks {
        let b: Vec<StepTimeBreakdown> = steady(&r.summary.breakdowns).to_vec();
        let avg = |f: fn(&StepTimeBreakdown) -> f64| b.iter().map(f).sum::<f64>() / b.len().max(1) as f64;
        let w = steady(&r.weights);
        let wavg = |f: &dyn Fn(&stagehand::events::WeightStepMetrics) -> f64| w.iter().map(f).sum::<f64>() / w.len().max(1) as f64;
        println!(
            "  GPU {}: {:.1} ms/step: compute {:.1}, H2D wait {:.1}, D2H wait {:.1}, stalls {:.1}, optimizer {:.1}, other {:.1}; collectives {:.2} ms on the device ({:.1} MiB reduced); H2D {:.1} MiB, D2H {:.1} MiB; host optimizer {:.1} ms ({:.1} of {:.1} blocks given while backward ran); peak {:.0} MiB of {:.0} MiB",
            r.device,
            mean(steady(&r.summary.step_times)) * 1e3,
            avg(|b| b.compute_ms),
            avg(|b| b.h2d_wait_ms),
            avg(|b| b.d2h_wait_ms),
            avg(|b| b.weight_stall_ms + b.restore_stall_ms),
            avg(|b| b.optimizer_ms),
            avg(|b| b.other_ms),
            wavg(&|w| w.collective_ms),
            wavg(&|w| w.collective_bytes as f64) / MIB,
            wavg(&|w| w.h2d_bytes as f64) / MIB,
            wavg(&|w| w.d2h_bytes as f64) / MIB,
            mean(steady(&r.summary.host_optimizer_ms)),
            wavg(&|w| w.host_steps_during_backward() as f64),
            wavg(&|w| w.host_steps as f64),
            r.summary.peak_bytes as f64 / MIB,
            budget as f64 / MIB
        );
        if let Some(line) = backwards.line(r.device) {
            println!("    GPU {}: {line}", r.device);
        }
        let over: Vec<u64> = r.summary.step_peaks.iter().copied().filter(|&p| p > budget).collect();
        if !over.is_empty() {
            println!("    GPU {} went OVER its budget in {} step(s): {:?} MiB", r.device, over.len(), over.iter().map(|b| b >> 20).collect::<Vec<_>>());
        }
    }
    let (one_tps, group_tps) = (cfg.tokens() as f64 / one_s.max(1e-12), cfg.tokens() as f64 / group_s.max(1e-12));
    println!(
        "  tokens/s: {group_tps:.0} on {gpus} GPUs against {one_tps:.0} on one: {:.2}x (target: {})",
        group_tps / one_tps.max(1e-12),
        match gpus {
            2 => ">= 1.85x",
            4 => ">= 3.6x",
            _ => "none set",
        }
    );
    let losses = &ranks[0].summary.losses;
    println!("  losses one GPU   {:?}", one.losses);
    println!("  losses {gpus} GPUs  {:?}", losses);
    let drift = one.losses.iter().zip(losses).map(|(a, b)| (a - b).abs() / a.abs().max(1e-12)).fold(0.0, f64::max);
    println!("  largest relative loss difference: {drift:.2e} (the reduction adds in another order)");
    let plan_one = one.plan.as_ref().map_or(0, |p| p.pinned_bytes + p.optimizer_state_bytes + p.master_bytes);
    let plan_group: u64 = ranks.iter().map(|r| r.plan_host_bytes).sum();
    println!(
        "  host memory: {:.2} GiB on {gpus} GPUs against {:.2} GiB on one ({:.2}x; peak resident set over what was there before the run); the plans count {:.2} GiB against {:.2} GiB ({:.2}x)",
        group_host as f64 / (1u64 << 30) as f64,
        one_host as f64 / (1u64 << 30) as f64,
        group_host as f64 / one_host.max(1) as f64,
        plan_group as f64 / (1u64 << 30) as f64,
        plan_one as f64 / (1u64 << 30) as f64,
        plan_group as f64 / plan_one.max(1) as f64
    );
    // The bound: 1.1x one GPU's, plus each GPU's own pinned staging (its activation
    // pool; the gradient shards are in the plans, one copy's worth together).
    let staging: Vec<u64> = ranks.iter().map(|r| r.summary.activation_pool_bytes).collect();
    let bound = 1.1 * one_host as f64 + staging.iter().sum::<u64>().saturating_sub(one.activation_pool_bytes) as f64;
    println!(
        "  pinned staging (activation pools): [{}] MiB on {gpus} GPUs, {:.1} MiB on one; host memory {:.2} GiB against 1.1x one GPU's plus the staging beyond it, {:.2} GiB: {}",
        staging.iter().map(|b| format!("{:.1}", *b as f64 / MIB)).collect::<Vec<_>>().join(", "),
        one.activation_pool_bytes as f64 / MIB,
        group_host as f64 / (1u64 << 30) as f64,
        bound / (1u64 << 30) as f64,
        if (group_host as f64) <= bound { "within" } else { "over" }
    );
    Ok(())
}
