//! Two models on one handle: a trained student and a frozen teacher of the main job's size (on a
//! GPU, the 1.21 B GPT of 24 layers at d=2048, each) under one budget, one pinned pool, one room
//! and one Conductor, every telemetry sink attached (a full-level JSONL file and the Prometheus
//! metrics). Each step runs the teacher's forward (no gradients) and the student's forward,
//! backward and optimizer step, the student learning the teacher's outputs.
//!
//! Prints, for steady state (every step after the first): the step time against the floor of
//! the combined bytes, max(H2D bytes / H2D bandwidth, D2H bytes / D2H bandwidth) (every byte
//! on the link: weights, restored activations, and over micro-batches the gradient sums) with the
//! bandwidths measured in this run (target <= 1.25x); against that floor with the student's host
//! optimizer step timed alone beside it (as the main job's floor has it); and against the fuller
//! floor that adds the resident forward (teacher) and forward+backward (student) when both fit
//! the device; the
//! weights moved against the Belady minimum of the combined itinerary, each model's share; the
//! peak of every step against the one budget; and, once the run is over, what handing its
//! pinned pool to a next handle takes against pinning the same bytes afresh (target < 1%).
//!
//! Knobs: `TM_LAYERS`, `TM_D`, `TM_SEQ`, `TM_BATCH` (both models), `TM_BUDGET_MIB` (above what
//! libtorch holds on CUDA), `TM_STEPS`, `TM_PRECISION` (default bf16 where the device computes
//! it fast, else fp32), `TM_TEACHER` (`full`, `int8`, `fp8`: how the teacher is stored),
//! `TM_RESIDENT=0` (no resident term), `TM_CHECKPOINT` (1: both models' blocks checkpointed,
//! 0: not; default: on in 16-bit precisions, as the demo), `TM_MICRO` (the step's batch split into
//! that many micro-batches, gradient accumulation: the teacher's forward and the student's
//! forward+backward per micro-batch, one optimizer step; the resident term runs the same
//! micro-batches), `TM_HOST_SUMS=1` (the later micro-batches' gradients added on the host, the
//! handle's `host_gradient_sums(true)`), `TM_HOOK_GPU=1` (the compute stream's time inside the
//! weights' hooks measured, the handle's `measure_hook_gpu_time`). Telemetry goes to `$OUT/two_models.jsonl`.
//!
//! Run: `cargo bench -p stagehand-examples --bench two_models`.

use stagehand::device::{bandwidth, Device};
use stagehand::events::telemetry::{Level, TelemetryConfig};
use stagehand::events::{Bus, Hub};
use stagehand::session::ModelOptions;
use stagehand::{Precision, QuantFormat, Stagehand, StateStorage};
use stagehand_examples::data::progression_batch;
use stagehand_examples::floors::host_optimizer_step_s;
use stagehand_examples::gpt::{Attention, Gpt, GptConfig, StreamedLayersAt, TchLayers};
use std::sync::Arc;
use std::time::Instant;
use tch::nn::{self, Module};
use tch::Kind;

fn env(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const MIB: f64 = (1u64 << 20) as f64;

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() -> anyhow::Result<()> {
    stagehand::torch::init();
    let device = Device::auto(1 << 30);
    let cuda = device.is_cuda();
    let layers = env("TM_LAYERS", if cuda { 24 } else { 4 });
    let d = env("TM_D", if cuda { 2048 } else { 128 });
    let seq = env("TM_SEQ", if cuda { 512 } else { 64 });
    let batch = env("TM_BATCH", 8);
    let steps = env("TM_STEPS", if cuda { 6 } else { 4 }).max(3) as u64;
    let micro = env("TM_MICRO", 1);
    anyhow::ensure!(
        micro >= 1 && batch % micro == 0,
        "TM_MICRO={micro} does not split TM_BATCH={batch} into equal micro-batches"
    );
    let precision: Precision = match std::env::var("TM_PRECISION") {
        Ok(p) => p.parse().map_err(anyhow::Error::msg)?,
        Err(_) if cuda && device.computes_bf16_fast() => Precision::Bf16,
        Err(_) => Precision::Fp32,
    };
    let teacher_storage = match std::env::var("TM_TEACHER").as_deref() {
        Ok("int8") => Some(QuantFormat::Int8),
        Ok("fp8") => Some(QuantFormat::Fp8E4m3),
        _ => None,
    };
    device.warm_up()?;
    let budget_above = env("TM_BUDGET_MIB", if cuda { 4096 } else { 24 }) as u64;
    let budget = (budget_above << 20) + if cuda { device.memory().allocated } else { 0 };
    let mut cfg = GptConfig {
        vocab: 128,
        block_size: seq,
        n_layer: layers,
        n_head: 4,
        n_embd: d,
        attention: Attention::Recomputed,
        checkpoint: false,
    }
    .with_precision(precision);
    // The demo's rule (checkpointed blocks in 16-bit precisions) unless TM_CHECKPOINT says.
    cfg.checkpoint = env("TM_CHECKPOINT", i64::from(cfg.checkpoint)) != 0;
    println!("device: {} ({})", device.info().name, if cuda { "cuda" } else { "host-simulated" });
    println!(
        "models: student and teacher gpt L={layers} d={d} ({:.3} B parameters each), seq {seq}, batch {batch}{}, {precision}; teacher {}",
        cfg.parameters() as f64 / 1e9,
        if micro > 1 { format!(" in {micro} micro-batches of {}", batch / micro) } else { String::new() },
        teacher_storage.map_or("at full width".to_string(), |q| format!("stored {q}"))
    );
    println!("budget: {:.0} MiB (one, for both)", budget as f64 / MIB);

    // Every sink attached: the full-level file and the Prometheus metrics.
    let out = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let file = out.join(format!("two_models-{}.jsonl", std::process::id()));
    let hub = Arc::new(Hub::new());
    let metrics = stagehand_exporter::Metrics::new();
    hub.add_snapshot_sink(Box::new(metrics.clone()));
    let bus = Bus::with_hub(hub.clone(), 1 << 20);
    // The student's optimizer state, as the handle keeps it and as its floor term times it.
    let storage = StateStorage::Fp32;
    let sh = Stagehand::builder()
        .budget_bytes(budget)
        .device(device.clone())
        .bus(bus.clone())
        .precision(precision)
        .optimizer_state(storage)
        .host_gradient_sums(env("TM_HOST_SUMS", 0) != 0)
        .measure_hook_gpu_time(env("TM_HOOK_GPU", 0) != 0)
        .telemetry(TelemetryConfig { level: Level::Full, path: Some(file.clone()), ..TelemetryConfig::default() })
        .build()?;
    sh.set_tokens_per_step((batch * seq) as u64);
    let opts = match teacher_storage {
        Some(q) => ModelOptions::frozen().quantized(q),
        None => ModelOptions::frozen(),
    };
    tch::manual_seed(1);
    let teacher = Gpt::new(&StreamedLayersAt(sh.model("teacher", opts)?), cfg);
    tch::manual_seed(2);
    let student = Gpt::new(&StreamedLayersAt(sh.root()), cfg);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-4)?;
    let dev = device.tch_device();
    let (mut times, mut peaks, mut weights, mut breakdowns) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 1..=steps {
        let b = progression_batch(batch, seq, cfg.vocab, dev);
        let parts = b.inputs.chunk(micro, 0);
        let r = sh.train_step_micro(&mut opt, parts.len(), |i| {
            let target = tch::no_grad(|| teacher.forward(&parts[i]).to_kind(Kind::Float));
            student.forward(&parts[i]).to_kind(Kind::Float).mse_loss(&target, tch::Reduction::Mean)
        })?;
        times.push(r.step_ms / 1e3);
        peaks.push(r.vram_peak_bytes);
        weights.push(sh.weights().last_step_metrics());
        breakdowns.push(r.time);
        println!("  step {step}: {:.1} ms, loss {:.4}, peak {:.0} MiB", r.step_ms, r.loss, r.vram_peak_bytes as f64 / MIB);
    }
    opt.wait()?;
    let plan = sh.plan().ok_or_else(|| anyhow::anyhow!("no plan"))?;
    for line in &plan.reasons {
        println!("  plan: {line}");
    }
    let step_s = mean(&times[1..]);
    // Where the steady steps' time went, and the training thread's time in the weights' hooks:
    // "compute" is what remains once the waits are counted, so it includes the GPU idling
    // behind a training thread that has not queued the next kernels yet.
    let per_step = |f: fn(&stagehand::events::WeightStepMetrics) -> f64| weights[1..].iter().map(f).sum::<f64>() / weights[1..].len().max(1) as f64;
    println!(
        "{}; the weights' hooks {:.1} ms (the compute stream inside them {:.1} ms, when measured)",
        stagehand_examples::report::time_per_step(&breakdowns[1..]),
        per_step(|w| w.host_ms),
        per_step(|w| w.hook_gpu_ms)
    );
    // Every step's events applied before the snapshot is read (the hub applies them on its
    // own thread): a step missing there would leave its bytes out of the means below.
    bus.flush();
    let snap = hub.snapshot();
    let records: Vec<_> = snap.steps.iter().filter(|r| r.step > 1 && r.step <= steps).collect();
    let n = records.len().max(1) as f64;
    let per = |f: &dyn Fn(&stagehand::events::snapshot::StepRecord) -> f64| records.iter().map(|r| f(r)).sum::<f64>() / n;
    let w_h2d = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.load_bytes() as f64));
    let w_min = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.min_h2d_bytes as f64));
    // Over micro-batches with the sums on the device (the default) the student's gradient
    // sums come back to be added to: bytes on the link as the weights' are, as the main job
    // bench counts them.
    let g_sum = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_h2d_bytes as f64));
    let host_sum_bytes = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_host_bytes as f64));
    let host_sum_ms = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.grad_sum_host_ms));
    let restores = per(&|r| r.activations.as_ref().map_or(0.0, |a| a.restore_bytes as f64));
    let h2d = w_h2d + restores + g_sum;
    let d2h = per(&|r| r.weights.as_ref().map_or(0.0, |w| w.d2h_bytes as f64)) + per(&|r| r.activations.as_ref().map_or(0.0, |a| a.spill_bytes as f64));

    let bw = bandwidth::measure(&device, if cuda { 256 << 20 } else { 32 << 20 })?;
    let bytes_floor = (h2d / bw.h2d).max(d2h / bw.d2h);
    println!("pinned bandwidth: H2D {:.1} GB/s, D2H {:.1} GB/s", bw.h2d / 1e9, bw.d2h / 1e9);
    println!(
        "per step: H2D {:.1} MiB (weights {:.1}, restores {:.1}, gradient sums {:.1}), D2H {:.1} MiB; floor of the combined bytes {:.1} ms",
        h2d / MIB,
        w_h2d / MIB,
        restores / MIB,
        g_sum / MIB,
        d2h / MIB,
        bytes_floor * 1e3
    );
    if host_sum_bytes > 0.0 {
        println!("gradient sums on the host: {:.1} MiB added a step, {host_sum_ms:.1} ms on their worker", host_sum_bytes / MIB);
    }
    println!(
        "weights moved per step: {:.1} MiB against the Belady minimum of the combined itinerary {:.1} MiB ({:.3}x)",
        w_h2d / MIB,
        w_min / MIB,
        if w_min > 0.0 { w_h2d / w_min } else { 0.0 }
    );
    for w in &weights[1..] {
        let shares: Vec<String> = w
            .models
            .iter()
            .map(|m| format!("{} {:.1}/{:.1} MiB", m.model, m.h2d_bytes as f64 / MIB, m.min_h2d_bytes as f64 / MIB))
            .collect();
        println!("  moved/minimum by model: {}", shares.join(", "));
    }
    let over: Vec<usize> = peaks.iter().enumerate().filter(|(_, &p)| p > budget).map(|(i, _)| i + 1).collect();
    println!(
        "peak allocated per step: {:?} MiB of a {:.0} MiB budget: {}",
        peaks.iter().map(|&p| p >> 20).collect::<Vec<_>>(),
        budget as f64 / MIB,
        if over.is_empty() { "every step at or under it".to_string() } else { format!("OVER in steps {over:?}") }
    );
    println!("step time: {:.1} ms (steady mean); ratio to the floor of the combined bytes: {:.3} (target <= 1.25)", step_s * 1e3, step_s / bytes_floor.max(1e-12));
    // The student's host optimizer, timed alone: a term of the main job's floor that the bytes'
    // floor leaves out, and where it is the larger the step cannot come under it.
    let opt_s = host_optimizer_step_s(cfg.parameters().max(1), layers.max(1), precision, storage)?;
    let with_opt = bytes_floor.max(opt_s);
    println!(
        "the student's host optimizer step alone: {:.1} ms; ratio to max(the combined bytes' floor, that) {:.1} ms: {:.3}",
        opt_s * 1e3,
        with_opt * 1e3,
        step_s / with_opt.max(1e-12)
    );
    println!("telemetry: {} ({} events, {} dropped)", file.display(), snap.events_applied, snap.dropped_events);
    let _ = metrics.render();

    // ---- handing the pool on: what the next model's host memory costs ----------------------
    sh.finish()?;
    drop(opt);
    let pool = sh.shutdown_keep_pool()?;
    drop((teacher, student, sh));
    let before = pool.stats();
    let next = Stagehand::builder().budget_bytes(budget).device(device.clone()).precision(precision).host_pool(pool.clone()).bus(Bus::disabled()).build()?;
    tch::manual_seed(3);
    let model = Gpt::new(&StreamedLayersAt(next.root()), cfg);
    let _opt = next.optimizer(nn::AdamW::default(), 1e-4)?;
    next.prepare()?;
    let after = pool.stats();
    let served = after.served_bytes - before.served_bytes;
    let serve_ms = after.serve_ms - before.serve_ms;
    let t0 = Instant::now();
    let fresh = device.alloc_host(served.max(1) as usize)?;
    let pin_ms = t0.elapsed().as_secs_f64() * 1e3;
    drop(fresh);
    println!(
        "handing the pool to the next model: {serve_ms:.3} ms for {:.1} MiB ({:.1} MiB pinned anew); pinning the same bytes afresh: {pin_ms:.1} ms: {:.3}% (target < 1%)",
        served as f64 / MIB,
        (after.pinned_bytes - before.pinned_bytes) as f64 / MIB,
        100.0 * serve_ms / pin_ms.max(1e-9)
    );
    drop(model);
    drop(next);

    // ---- the resident term: both models on the device, plain tch ---------------------------
    if env("TM_RESIDENT", 1) != 0 {
        let resident = (|| -> anyhow::Result<f64> {
            let kind = precision.compute_kind().unwrap_or(Kind::Float);
            let vs_t = nn::VarStore::new(dev);
            let t = Gpt::new(&TchLayers(vs_t.root()), cfg);
            let vs_s = nn::VarStore::new(dev);
            let s = Gpt::new(&TchLayers(vs_s.root()), cfg);
            tch::no_grad(|| {
                for (_, mut w) in vs_t.variables().into_iter().chain(vs_s.variables()) {
                    w.set_data(&w.to_kind(kind));
                }
            });
            let mut best = f64::MAX;
            for _ in 0..3 {
                let b = progression_batch(batch, seq, cfg.vocab, dev);
                device.synchronize()?;
                let t0 = Instant::now();
                for part in b.inputs.chunk(micro, 0) {
                    let _ac = match precision.compute_kind() {
                        Some(k) => Some(stagehand::torch::amp::Autocast::enter(cuda, k)?),
                        None => None,
                    };
                    let target = tch::no_grad(|| t.forward(&part).to_kind(Kind::Float));
                    let loss = s.forward(&part).to_kind(Kind::Float).mse_loss(&target, tch::Reduction::Mean);
                    drop(_ac);
                    (loss / micro as f64).backward();
                }
                device.synchronize()?;
                best = best.min(t0.elapsed().as_secs_f64());
            }
            Ok(best)
        })();
        match resident {
            Ok(r) => {
                let floor = with_opt.max(r);
                println!(
                    "resident teacher forward + student forward+backward: {:.1} ms; floor max(that, the bytes', the host optimizer's) {:.1} ms: ratio {:.3}",
                    r * 1e3,
                    floor * 1e3,
                    step_s / floor.max(1e-12)
                );
            }
            Err(e) => println!("resident term not measured ({e}): the bytes' floor alone"),
        }
    }
    Ok(())
}
