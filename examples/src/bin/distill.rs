//! Distillation: a small student GPT trained against a larger frozen teacher on one handle.
//!
//! Phase 1 trains the teacher on the task (arithmetic progressions) on a handle of its own,
//! saves it and shuts the handle down keeping its pinned host pool. Phase 2 builds one handle
//! with that pool for both models: the teacher declared frozen (quantized to INT8 unless
//! `--teacher-quantize none`) and loaded from its checkpoint, the student built on the root.
//! Each step runs the teacher's forward (under `no_grad`) and the student's forward and
//! backward; one budget, one room and one Conductor serve both, Belady's rule evicting along
//! the interleaved itinerary (with `--micro-batches N`, N such passes a step before one optimizer
//! step). The student learns from the teacher's softened distribution and
//! the targets. Printed: both loss curves, each model's share of the plan and of the copies,
//! and what handing the pool over took against pinning the same bytes afresh. Phase 2 appears
//! on the dashboards with `--serve` (and in a telemetry file with `--out`).
//!
//! Run: `cargo run --release -p stagehand-examples --bin distill -- --serve`

use anyhow::{Context, Result};
use clap::Parser;
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::session::ModelOptions;
use stagehand::{Precision, QuantFormat, Stagehand};
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Attention, Gpt, GptConfig, StreamedLayersAt};
use stagehand_examples::watch::WatchArgs;
use std::time::Instant;
use tch::nn::{self, Module};
use tch::Kind;

/// A student trained against a frozen teacher on one Stagehand handle.
#[derive(Parser)]
struct Args {
    /// Steps training the teacher (phase 1).
    #[arg(long, default_value_t = 300)]
    teacher_steps: u64,
    /// Steps distilling the student (phase 2).
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Teacher blocks and width.
    #[arg(long, default_value_t = 6)]
    teacher_layers: i64,
    #[arg(long, default_value_t = 256)]
    teacher_d: i64,
    /// Student blocks and width.
    #[arg(long, default_value_t = 2)]
    student_layers: i64,
    #[arg(long, default_value_t = 128)]
    student_d: i64,
    /// Sequence length and sequences a batch.
    #[arg(long, default_value_t = 64)]
    seq: i64,
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Micro-batches a step in both phases (gradient accumulation): the batch in that many
    /// forwards and backwards, each running the teacher's forward then the student's in phase
    /// 2, and one optimizer step. Must divide --batch.
    #[arg(long, default_value_t = 1)]
    micro_batches: i64,
    /// How the frozen teacher is stored in phase 2: int8, fp8_e4m3 or none (full width).
    #[arg(long, default_value = "int8")]
    teacher_quantize: String,
    /// Weight of the teacher's distribution in the student's loss (the rest: the targets').
    #[arg(long, default_value_t = 0.7)]
    alpha: f64,
    /// Softmax temperature of the distillation term.
    #[arg(long, default_value_t = 2.0)]
    temperature: f64,
    /// Device budget in MiB for each phase (default: the budget where both phases' plans stream
    /// the teacher with their prefetch window covered, from the handles' budget guides).
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Run on the host device even when CUDA is present.
    #[arg(long)]
    cpu: bool,
    #[command(flatten)]
    watch: WatchArgs,
}

const VOCAB: i64 = 128;

fn gpt_config(layers: i64, d: i64, seq: i64, precision: Precision) -> GptConfig {
    let cfg = GptConfig {
        vocab: VOCAB,
        block_size: seq,
        n_layer: layers,
        n_head: 4,
        n_embd: d,
        attention: Attention::Recomputed,
        checkpoint: false,
    };
    // The demo's attention for `precision`; the blocks stay unchecked, as this example has
    // always trained them.
    GptConfig { checkpoint: false, ..cfg.with_precision(precision) }
}

/// The smallest budget where each phase's plan keeps its prefetch window ahead of the block in
/// use while the teacher streams (`BudgetGuide::full_window_bytes`), the larger of the two:
/// phase 1 trains the teacher alone, phase 2 runs it frozen (stored as `quantize` says) beside
/// the trained student. Read off the guides of handles made for the purpose, with the models
/// registered as the phases register them, after libtorch's own allocations on the device.
fn default_budget(device: &Device, precision: Precision, tcfg: GptConfig, scfg: GptConfig, quantize: Option<QuantFormat>) -> Result<u64> {
    device.warm_up()?;
    let guide = |phase2: bool| -> Result<u64> {
        let total = device.info().total_bytes;
        let sh = Stagehand::builder().budget_bytes(total).device(device.clone()).precision(precision).bus(Bus::disabled()).build()?;
        let opts = if phase2 { frozen_teacher(quantize) } else { ModelOptions::trained() };
        let _teacher = Gpt::new(&StreamedLayersAt(sh.model("teacher", opts)?), tcfg);
        let _student = phase2.then(|| Gpt::new(&StreamedLayersAt(sh.root()), scfg));
        Ok(sh.budget_guide()?.full_window_bytes)
    };
    Ok(guide(false)?.max(guide(true)?))
}

/// Phase 2's teacher: frozen, stored as `quantize` says (full width where `None`).
fn frozen_teacher(quantize: Option<QuantFormat>) -> ModelOptions {
    match quantize {
        Some(q) => ModelOptions::frozen().quantized(q),
        None => ModelOptions::frozen(),
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.micro_batches >= 1 && args.batch % args.micro_batches == 0,
        "--micro-batches {} does not split --batch {} into equal micro-batches",
        args.micro_batches,
        args.batch
    );
    stagehand::torch::init();
    let device = if args.cpu { Device::host(1 << 30) } else { Device::auto(1 << 30) };
    let precision = if device.is_cuda() && device.computes_bf16_fast() { Precision::Bf16 } else { Precision::Fp32 };
    let quantize: Option<QuantFormat> = match args.teacher_quantize.as_str() {
        "none" => None,
        q => Some(q.parse().map_err(anyhow::Error::msg)?),
    };
    let tcfg = gpt_config(args.teacher_layers, args.teacher_d, args.seq, precision);
    let scfg = gpt_config(args.student_layers, args.student_d, args.seq, precision);
    let budget = match args.budget_mib {
        Some(m) => m << 20,
        None => default_budget(&device, precision, tcfg, scfg, quantize)?,
    };
    let lr = 3e-3 * (128.0 / args.teacher_d as f64).min(1.0);
    println!("distillation: teacher gpt L={} d={} ({:.1}M params), student L={} d={} ({:.1}M), {precision}", tcfg.n_layer, tcfg.n_embd, tcfg.parameters() as f64 / 1e6, scfg.n_layer, scfg.n_embd, scfg.parameters() as f64 / 1e6);
    println!("  device     {}", device.info().name);
    println!("  budget     {:.1} MiB each phase", mib(budget));
    let dir = std::env::temp_dir().join(format!("stagehand-distill-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let teacher_file = dir.join("teacher.safetensors");
    let dev = device.tch_device();

    // ---- phase 1: the teacher learns the task on a handle of its own ----------------------
    let sh = Stagehand::builder().budget_bytes(budget).device(device.clone()).precision(precision).bus(Bus::disabled()).build()?;
    let teacher = Gpt::new(&StreamedLayersAt(sh.model("teacher", ModelOptions::trained())?), tcfg);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr)?;
    let mut teacher_losses = Vec::new();
    tch::manual_seed(10);
    for _ in 0..args.teacher_steps {
        let b = progression_batch(args.batch, args.seq, VOCAB, dev);
        let (inputs, targets) = (b.inputs.chunk(args.micro_batches, 0), b.targets.chunk(args.micro_batches, 0));
        let r = sh.train_step_micro(&mut opt, inputs.len(), |i| Gpt::loss(&teacher.forward(&inputs[i]), &targets[i]))?;
        teacher_losses.push(r.loss);
    }
    opt.wait()?;
    sh.save(&teacher_file)?;
    let pool = sh.shutdown_keep_pool()?;
    let handed = pool.stats();
    drop(opt);
    drop(teacher);
    drop(sh);
    println!(
        "phase 1: teacher loss {:.3} -> {:.3} in {} steps; its handle shut down keeping {:.1} MiB of pinned host memory",
        teacher_losses.first().copied().unwrap_or(f64::NAN),
        teacher_losses.last().copied().unwrap_or(f64::NAN),
        args.teacher_steps,
        mib(handed.pinned_bytes)
    );

    // ---- phase 2: teacher and student on one handle, one budget, the handed pool ----------
    let mut watch = args.watch.start()?;
    let config = serde_json::json!({
        "teacher": {"layers": tcfg.n_layer, "d": tcfg.n_embd, "quantize": quantize.map(|q| q.name())},
        "student": {"layers": scfg.n_layer, "d": scfg.n_embd},
        "budget_bytes": budget, "precision": precision.name(), "alpha": args.alpha, "temperature": args.temperature,
        "micro_batches": args.micro_batches,
    });
    let what = format!("student gpt L={} d={} distilled from a frozen teacher L={} d={}", scfg.n_layer, scfg.n_embd, tcfg.n_layer, tcfg.n_embd);
    let builder = Stagehand::builder().budget_bytes(budget).device(device.clone()).precision(precision).host_pool(pool.clone());
    let sh = watch.builder(builder, &device, "distill", what, config).build()?;
    sh.set_tokens_per_step((args.batch * args.seq) as u64);
    let teacher = Gpt::new(&StreamedLayersAt(sh.model("teacher", frozen_teacher(quantize))?), tcfg);
    tch::manual_seed(20);
    let student = Gpt::new(&StreamedLayersAt(sh.root()), scfg);
    let missing = sh.load_partial(&teacher_file)?;
    anyhow::ensure!(missing.iter().all(|n| !n.starts_with("teacher.")), "the teacher's checkpoint lacks {missing:?}");
    let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3 * (128.0 / args.student_d as f64).min(1.0))?;
    let (alpha, t) = (args.alpha, args.temperature);
    let mut curves: Vec<(f64, f64)> = Vec::new();
    tch::manual_seed(30);
    for step in 1..=args.steps {
        let b = progression_batch(args.batch, args.seq, VOCAB, dev);
        let (inputs, targets) = (b.inputs.chunk(args.micro_batches, 0), b.targets.chunk(args.micro_batches, 0));
        let mut hard = Vec::new();
        let r = sh.train_step_micro(&mut opt, inputs.len(), |i| {
            let soft_teacher = tch::no_grad(|| (teacher.forward(&inputs[i]).to_kind(Kind::Float) / t).softmax(-1, Kind::Float));
            let logits = student.forward(&inputs[i]).to_kind(Kind::Float);
            let ce = Gpt::loss(&logits, &targets[i]);
            hard.push(ce.detach());
            // KL(teacher || student) over the softened distributions, scaled by T² (Hinton et al.).
            let log_student = (&logits / t).log_softmax(-1, Kind::Float);
            let kl = (&soft_teacher * (soft_teacher.clamp_min(1e-12).log() - log_student)).sum_dim_intlist(-1, false, Kind::Float).mean(Kind::Float) * (t * t);
            ce * (1.0 - alpha) + kl * alpha
        })?;
        // The micro-batches are equal: the step's cross-entropy is the mean of theirs.
        let ce = hard.iter().map(|h| h.double_value(&[])).sum::<f64>() / hard.len().max(1) as f64;
        curves.push((r.loss, if hard.is_empty() { f64::NAN } else { ce }));
        if step == 1 {
            let s = pool.stats();
            println!(
                "phase 2: {:.1} MiB of the two models' host memory cut from the handed pool in {:.3} ms; {:.1} MiB pinned anew in {:.1} ms",
                mib(s.served_bytes - handed.served_bytes),
                s.serve_ms - handed.serve_ms,
                mib(s.pinned_bytes - handed.pinned_bytes),
                s.pin_ms - handed.pin_ms
            );
        }
    }
    opt.wait()?;
    let plan = sh.plan().context("a plan")?;
    let last = sh.weights().last_step_metrics();
    let models = sh.model_memory();
    sh.finish()?;
    watch.finish()?;

    println!("loss curves (every {} steps): distillation loss | the student's cross-entropy", (args.steps / 15).max(1));
    for (i, (l, ce)) in curves.iter().enumerate() {
        let step = i as u64 + 1;
        if step == 1 || step.is_multiple_of((args.steps / 15).max(1)) {
            println!("  step {step:4}  {l:.4} | {ce:.4}");
        }
    }
    println!("the plan for both models:");
    for line in &plan.reasons {
        println!("  {line}");
    }
    println!(
        "last step: {:.1} MiB moved against a Belady minimum of {:.1} MiB for the combined itinerary",
        mib(last.load_bytes()),
        mib(last.min_h2d_bytes)
    );
    for m in &last.models {
        println!("  {:<8} {:.1} MiB moved (its share of the minimum {:.1} MiB), {} loads, {} evictions", m.model, mib(m.h2d_bytes), mib(m.min_h2d_bytes), m.loads, m.evictions);
    }
    for m in &models {
        println!("  {:<8} {} blocks, {} on the device, {} resident ({:.1} MiB)", m.model, m.blocks, m.on_device, m.resident, mib(m.device_bytes));
    }
    // What handing the pool over saved: pinning the bytes it served afresh, timed now.
    let served = pool.stats().served_bytes - handed.served_bytes;
    if served > 0 {
        let t0 = Instant::now();
        let fresh = device.alloc_host(served as usize)?;
        let pin_ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(fresh);
        let s = pool.stats();
        println!(
            "handing the pool over: {:.3} ms for {:.1} MiB, pinning the same bytes afresh: {pin_ms:.1} ms ({:.3}%)",
            s.serve_ms - handed.serve_ms,
            mib(served),
            100.0 * (s.serve_ms - handed.serve_ms) / pin_ms.max(1e-9)
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
