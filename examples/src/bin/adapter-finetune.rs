//! Adapter fine-tuning over a quantized frozen base, against the same base at full width.
//!
//! A stack of MLP blocks (the base) is written to a safetensors file, as a pretrained model
//! would be. Each run builds a handle, declares the base a frozen model (quantized to INT8, or
//! FP8 with `--quantize fp8_e4m3`), loads the file into it (quantized as it is read) and trains
//! low-rank adapters beside it: the base streams from pinned host memory at its payload's width
//! and is dequantized on the device just before each block runs; the adapters live on the device
//! and train there. The same run over the base at full width (bf16 where the device computes it
//! fast, else fp32) is the reference: the two loss curves are printed side by side, with each
//! base block's quantization error and what each run moved over PCIe. The quantized run appears
//! on the dashboards with `--serve` (and in a telemetry file with `--out`).
//!
//! Run: `cargo run --release -p stagehand-examples --bin adapter-finetune -- --steps 200`

use anyhow::{ensure, Context, Result};
use clap::Parser;
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::nn as snn;
use stagehand::session::ModelOptions;
use stagehand::{Precision, QuantFormat, Stagehand};
use stagehand_examples::watch::{Watch, WatchArgs};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Adapters trained over a quantized frozen base, against the base at full width.
#[derive(Parser)]
struct Args {
    /// Training steps of each run.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Base blocks.
    #[arg(long, default_value_t = 8)]
    layers: i64,
    /// Width of the base (its MLPs are four times wider).
    #[arg(long, default_value_t = 256)]
    d: i64,
    /// Rank of the adapters.
    #[arg(long, default_value_t = 8)]
    rank: i64,
    /// How the base is quantized: int8 or fp8_e4m3.
    #[arg(long, default_value = "int8")]
    quantize: QuantFormat,
    /// Device budget in MiB (default: six of the base's blocks, so it streams).
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Run on the host device even when CUDA is present.
    #[arg(long)]
    cpu: bool,
    /// Skip the full-width reference run.
    #[arg(long)]
    no_reference: bool,
    #[command(flatten)]
    watch: WatchArgs,
}

const BATCH: i64 = 64;

/// The base's blocks and the adapters beside them.
struct Adapted {
    base: Vec<(Box<dyn Module>, Box<dyn Module>)>,
    lora: Vec<(nn::Linear, nn::Linear)>,
}

impl Adapted {
    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for ((up, down), (a, b)) in self.base.iter().zip(&self.lora) {
            h = &h + down.forward(&up.forward(&h).gelu("none")) * 0.1 + b.forward(&a.forward(&h));
        }
        h
    }
}

/// What one run did.
struct Run {
    losses: Vec<f64>,
    h2d_bytes: u64,
    step_ms: Vec<f64>,
    plan: Option<stagehand::Plan>,
}

#[allow(clippy::too_many_arguments)]
fn train(args: &Args, device: &Device, precision: Precision, budget: u64, base_file: &std::path::Path, quantize: Option<QuantFormat>, watch: Option<&mut Watch>) -> Result<Run> {
    let builder = Stagehand::builder().budget_bytes(budget).device(device.clone()).precision(precision);
    let builder = match watch {
        Some(w) => {
            let config = serde_json::json!({
                "layers": args.layers, "d": args.d, "rank": args.rank, "steps": args.steps,
                "quantize": quantize.map(|q| q.name()), "precision": precision.name(), "budget_bytes": budget,
            });
            let what = format!("adapters (rank {}) over a {}-block frozen base, {}", args.rank, args.layers, quantize.map_or("full width", |q| q.name()));
            w.builder(builder, device, "adapter-finetune", what, config)
        }
        None => builder.bus(Bus::disabled()),
    };
    let sh = builder.build()?;
    sh.set_tokens_per_step(BATCH as u64);
    let opts = match quantize {
        Some(q) => ModelOptions::frozen().quantized(q),
        None => ModelOptions::frozen(),
    };
    let base_root = sh.model("base", opts)?;
    let d = args.d;
    tch::manual_seed(1);
    let base = (0..args.layers)
        .map(|i| {
            let p = &base_root / "blocks" / i;
            let up: Box<dyn Module> = Box::new(snn::linear(&p / "up", d, 4 * d, Default::default()));
            let down: Box<dyn Module> = Box::new(snn::linear(&p / "down", 4 * d, d, Default::default()));
            (up, down)
        })
        .collect();
    let root = sh.root();
    let lora = (0..args.layers)
        .map(|i| {
            let p = &*root / "lora" / i;
            let a = nn::linear(&p / "a", d, args.rank, nn::LinearConfig { bias: false, ..Default::default() });
            let b = nn::linear(&p / "b", args.rank, d, nn::LinearConfig { ws_init: nn::Init::Const(0.0), bias: false, ..Default::default() });
            (a, b)
        })
        .collect();
    let model = Adapted { base, lora };
    // The pretrained base, quantized as it is read when the base is.
    let missing = sh.load_partial(base_file)?;
    ensure!(missing.iter().all(|n| n.starts_with("lora.")), "the base file lacks {missing:?}");
    let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3)?;
    // A task the frozen base cannot do alone: a fixed rotation of the input.
    tch::manual_seed(2);
    let dev = device.tch_device();
    let target_map = Tensor::randn([d, d], (Kind::Float, dev)) / (d as f64).sqrt();
    let mut run = Run { losses: Vec::new(), h2d_bytes: 0, step_ms: Vec::new(), plan: None };
    for _ in 0..args.steps {
        let x = Tensor::randn([BATCH, d], (Kind::Float, dev));
        let y = x.matmul(&target_map);
        let r = sh.train_step(&mut opt, || model.forward(&x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean))?;
        run.losses.push(r.loss);
        run.step_ms.push(r.step_ms);
        run.h2d_bytes += sh.weights().last_step_metrics().h2d_bytes;
    }
    opt.wait()?;
    run.plan = sh.plan();
    sh.finish()?;
    Ok(run)
}

/// Mean of the last tenth of a curve (the loss a run ends at, less its step-to-step noise).
fn tail(losses: &[f64]) -> f64 {
    let n = (losses.len() / 10).max(1);
    losses[losses.len() - n..].iter().sum::<f64>() / n as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    stagehand::torch::init();
    let device = if args.cpu { Device::host(1 << 30) } else { Device::auto(1 << 30) };
    let precision = if device.is_cuda() && device.computes_bf16_fast() { Precision::Bf16 } else { Precision::Fp32 };
    let width = precision.weight_bytes();
    let block_bytes = (8 * args.d * args.d + 5 * args.d) as u64 * width;
    let budget = match args.budget_mib {
        Some(m) => m << 20,
        None => {
            // Six blocks' worth (the plan gives the room a slot or two of them and the rest to
            // activations), a MiB for the allocator's reserve, above what the device holds.
            device.warm_up()?;
            6 * block_bytes + (1 << 20) + device.memory().allocated
        }
    };
    println!("adapter fine-tuning: {} frozen blocks of d={} ({:.1} MiB at {precision}), rank-{} adapters, {} steps", args.layers, args.d, (args.layers as u64 * block_bytes) as f64 / (1u64 << 20) as f64, args.rank, args.steps);
    println!("  device     {}", device.info().name);
    println!("  budget     {:.1} MiB", budget as f64 / (1u64 << 20) as f64);

    // The pretrained base, as a file.
    let dir = std::env::temp_dir().join(format!("stagehand-adapter-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let base_file = dir.join("base.safetensors");
    {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        for i in 0..args.layers {
            let p = vs.root() / "base" / "blocks" / i;
            let _ = nn::linear(&p / "up", args.d, 4 * args.d, Default::default());
            let _ = nn::linear(&p / "down", 4 * args.d, args.d, Default::default());
        }
        vs.save(&base_file).context("writing the base")?;
    }

    let reference = if args.no_reference { None } else { Some(train(&args, &device, precision, budget, &base_file, None, None)?) };
    let mut watch = args.watch.start()?;
    let quantized = train(&args, &device, precision, budget, &base_file, Some(args.quantize), Some(&mut watch))?;
    watch.finish()?;
    std::fs::remove_dir_all(&dir)?;

    let plan = quantized.plan.as_ref().context("the quantized run made a plan")?;
    println!("quantization of the base ({}):", args.quantize);
    for r in &plan.quantization {
        println!(
            "  {:<16} {:>8.1} KiB -> {:>8.1} KiB  max error {:.3}% of a group's largest weight, mean {:.3}% of the weights' magnitude",
            r.name,
            r.full_bytes as f64 / 1024.0,
            r.quantized_bytes as f64 / 1024.0,
            r.max_rel_error * 100.0,
            r.mean_rel_error * 100.0
        );
    }
    let mean_ms = |r: &Run| r.step_ms.iter().skip(1).sum::<f64>() / (r.step_ms.len().saturating_sub(1)).max(1) as f64;
    match &reference {
        Some(full) => {
            println!("loss curves (every {} steps): {precision} base | {} base", (args.steps / 20).max(1), args.quantize);
            for (i, (a, b)) in full.losses.iter().zip(&quantized.losses).enumerate() {
                let step = i as u64 + 1;
                if step.is_multiple_of((args.steps / 20).max(1)) || step == 1 {
                    println!("  step {step:4}  {a:.5} | {b:.5}");
                }
            }
            let (a, b) = (tail(&full.losses), tail(&quantized.losses));
            let diff = (b - a).abs() / a;
            println!("  final loss (mean of the last tenth): {a:.5} | {b:.5}: the quantized base within {:.2}% of the {precision} base", diff * 100.0);
            println!(
                "  weights moved over PCIe: {:.1} MiB | {:.1} MiB ({:.2}x less); mean step {:.1} ms | {:.1} ms",
                full.h2d_bytes as f64 / (1u64 << 20) as f64,
                quantized.h2d_bytes as f64 / (1u64 << 20) as f64,
                full.h2d_bytes as f64 / quantized.h2d_bytes.max(1) as f64,
                mean_ms(full),
                mean_ms(&quantized)
            );
            ensure!(diff <= 0.02, "the quantized base's final loss is {:.2}% from the full-width base's (target: within 2%)", diff * 100.0);
        }
        None => {
            let first = quantized.losses.first().copied().unwrap_or(f64::NAN);
            println!("loss {first:.5} -> {:.5} over a {} base", tail(&quantized.losses), args.quantize);
        }
    }
    Ok(())
}
