//! The main job: trains a small GPT under Stagehand with its telemetry, on CUDA where present and
//! on the host device otherwise. Run it with `scripts/demo` (which sets everything up first).

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand::device::Device;
use stagehand::events::jsonl::{JsonlSink, OpenMode};
use stagehand::events::Bus;
use stagehand_examples::trainer::{announce, train, Memory, TrainConfig};
use std::path::PathBuf;

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
    #[arg(long, default_value_t = 32)]
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
    /// Train with plain tch (everything resident), to compare.
    #[arg(long)]
    resident: bool,
    /// Stream and spill without the Conductor, to compare.
    #[arg(long)]
    no_conductor: bool,
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

    let mut cfg = TrainConfig::demo(args.steps, args.layers, args.d_model, args.seq, args.batch, budget);
    if args.resident {
        cfg.memory = Memory::Resident;
    }
    cfg.conductor = !args.no_conductor;
    let run_id = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    announce(&bus, &cfg, &device, &run_id);
    let model_desc = cfg.describe();

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
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    match cfg.memory {
        Memory::Resident => {
            println!("  memory     resident: plain tch, no streaming, no spilling (--resident)")
        }
        Memory::Streamed {
            weight_budget_bytes,
            spill_high_bytes,
            spill_low_bytes,
        } => {
            let weights = (cfg.model.parameters() * 4) as u64;
            println!(
                "  weights    streamed: {:.1} MiB of weights through {:.1} MiB of device room{}",
                mib(weights),
                mib(weight_budget_bytes),
                if weights > weight_budget_bytes { " (so blocks really stream)" } else { "" }
            );
            println!(
                "  activations spilled to pinned host memory above {:.1} MiB, down to {:.1} MiB",
                mib(spill_high_bytes),
                mib(spill_low_bytes)
            );
            if cfg.conductor {
                println!("  conductor  phases, budgets and hints (soft cap {:.0} MiB)", mib(budget));
            } else {
                println!("  conductor  off (--no-conductor)");
            }
        }
    }

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let summary = train(&cfg, &device, &bus, |_, loss, dt| {
        bar.set_message(format!("loss {loss:.3}  {:.0} ms/step", dt * 1e3));
        bar.inc(1);
    })?;
    bar.finish();
    bus.flush();
    let snap = hub.snapshot();
    bus.close();

    println!("summary");
    let (first, last) = summary.loss_drop();
    println!("  loss       {first:.3} -> {last:.3} (mean of the first and last tenth)");
    println!("  step time  {:.1} ms mean", summary.mean_step_s * 1e3);
    println!("  peak VRAM  {:.1} MiB", summary.peak_bytes as f64 / (1 << 20) as f64);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    if matches!(cfg.memory, Memory::Streamed { .. }) {
        println!(
            "  moved      {:.1} MiB H2D, {:.1} MiB D2H",
            mib(snap.transfers.h2d.bytes),
            mib(snap.transfers.d2h.bytes)
        );
        println!(
            "  weights    {} prefetch hits, {} misses, {} evictions, {:.1} ms stalled",
            snap.weights.prefetch_hits,
            snap.weights.prefetch_misses,
            snap.weights.evictions,
            snap.weights.stall_time_ms
        );
        println!(
            "  activations {} saved, {} spilled ({:.1} MiB), {} restored ({} predicted), {} stalls",
            snap.activations.saved,
            snap.activations.spilled,
            mib(snap.activations.spill_bytes),
            snap.activations.restored,
            snap.activations.predicted,
            snap.activations.stall_count
        );
    }
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
