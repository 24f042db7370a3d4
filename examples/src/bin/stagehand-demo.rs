//! The main job: trains a small GPT under Stagehand with its telemetry, on CUDA where present and
//! on the host device otherwise. Run it with `scripts/demo` (which sets everything up first).

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand::device::Device;
use stagehand::events::jsonl::{JsonlSink, OpenMode};
use stagehand::events::{Bus, EventKind, Phase, TrainStepMetrics};
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Gpt, GptConfig};
use std::path::PathBuf;
use std::time::Instant;
use tch::nn::{self, Module, OptimizerConfig};

/// Train a GPT-style model under Stagehand and watch it live.
#[derive(Debug, Parser)]
#[command(name = "stagehand-demo", version)]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 8)]
    layers: i64,
    /// Embedding width.
    #[arg(long, default_value_t = 128)]
    d_model: i64,
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    seq: i64,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Device VRAM budget in MiB (the simulated VRAM on the host device).
    #[arg(long, default_value_t = 64)]
    budget_mib: u64,
    /// Telemetry file (JSONL); never overwritten. Default: runs/stagehand-<time>.jsonl
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run on the host device even when CUDA is present.
    #[arg(long)]
    cpu: bool,
    /// Address of the HTTP API, web dashboard and /metrics (loopback by default).
    #[arg(long, default_value = stagehand_web::DEFAULT_SERVER_ADDR)]
    addr: String,
    /// Do not serve the API and dashboards.
    #[arg(long)]
    no_serve: bool,
    /// After training, keep serving until Enter is pressed.
    #[arg(long)]
    keep_serving: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    stagehand::torch::init();
    let budget = args.budget_mib << 20;
    let device = if args.cpu {
        Device::host(budget)
    } else {
        Device::auto(budget)
    };
    let info = device.info();

    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("runs/stagehand-{secs}.jsonl"))
    });
    let bus = Bus::new();
    let hub = bus.hub().context("the bus is enabled")?.clone();
    hub.add_sink(Box::new(
        JsonlSink::open(&out, OpenMode::CreateNew).context("opening the telemetry file")?,
    ));
    // Started before `run_started` is published, so /metrics takes its device labels from it.
    let server = if args.no_serve {
        None
    } else {
        Some(
            stagehand_web::Server::live(hub.clone(), &args.addr)
                .with_context(|| format!("serving on {}", args.addr))?,
        )
    };

    let cfg = GptConfig {
        vocab: 128,
        block_size: args.seq,
        n_layer: args.layers,
        n_head: 4,
        n_embd: args.d_model,
    };
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device.tch_device());
    let model = Gpt::new(&vs.root(), cfg);
    let mut opt = nn::AdamW::default().build(&vs, 3e-3)?;

    let model_desc = format!(
        "gpt L={} d={} seq={} ({:.1}M params)",
        cfg.n_layer,
        cfg.n_embd,
        cfg.block_size,
        cfg.parameters() as f64 / 1e6
    );
    bus.publish(EventKind::RunStarted {
        run_id: out
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        wall_clock_unix_ms: bus.wall_clock_unix_ms(),
        device: info.clone(),
        model: model_desc.clone(),
        versions: [
            ("stagehand".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
            ("libtorch".to_owned(), "2.11.0".to_owned()),
        ]
        .into_iter()
        .collect(),
        config: serde_json::json!({
            "steps": args.steps, "batch": args.batch, "budget_mib": args.budget_mib,
        }),
    });

    println!("stagehand demo: {model_desc}");
    println!(
        "  device     {}{}",
        info.name,
        if info.host_simulated() {
            " (no CUDA: VRAM is simulated on the host)"
        } else {
            ""
        }
    );
    if let Some(server) = &server {
        let url = server.url();
        println!("  dashboard  {url}/");
        println!("  metrics    {url}/metrics");
        println!("  live TUI   stagehand-top --connect {url}");
    }
    println!("  telemetry  {}", out.display());
    println!("  replay it  stagehand-top --replay {}", out.display());
    println!("  weights    resident (weight streaming is not wired into the demo yet)");
    println!("  activations resident (activation spilling is not wired into the demo yet)");

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut first_loss, mut last_loss) = (None, 0.0);
    let mut total_time = 0.0;
    for step in 1..=args.steps {
        let t0 = Instant::now();
        device.reset_peak();
        bus.enter_phase(step, Phase::StepBegin);
        let batch = progression_batch(args.batch, args.seq, cfg.vocab, device.tch_device());
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
        total_time += dt;
        let mem = device.memory();
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
            tokens: (args.batch * args.seq) as u64,
            vram_peak_bytes: mem.peak,
        }));
        first_loss.get_or_insert(loss_v);
        last_loss = loss_v;
        bar.set_message(format!("loss {loss_v:.3}  {:.0} ms/step", dt * 1e3));
        bar.inc(1);
    }
    bus.enter_phase(args.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: args.steps });
    bar.finish();
    bus.flush();
    let snap = hub.snapshot();
    bus.close();

    println!("summary");
    println!(
        "  loss       {:.3} -> {last_loss:.3}",
        first_loss.unwrap_or(f64::NAN)
    );
    println!(
        "  step time  {:.1} ms mean",
        total_time / args.steps.max(1) as f64 * 1e3
    );
    println!(
        "  events     {} recorded, {} dropped",
        snap.events_applied, snap.dropped_events
    );
    println!("  telemetry  {}", out.display());
    if let Some(server) = server {
        if args.keep_serving {
            println!("serving {} until Enter is pressed", server.url());
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        server.shutdown()?;
    }
    Ok(())
}
