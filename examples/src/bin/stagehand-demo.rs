//! The main job: trains a small GPT under one Stagehand handle with its telemetry, on CUDA where
//! present and on the host device otherwise. Run it with `scripts/demo` (which sets everything up
//! first).

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand_examples::trainer::{announce, train, train_stagehand, Memory, TrainConfig};
use std::path::{Path, PathBuf};

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
    /// Device memory budget in MiB (the simulated VRAM on the host device). Everything else (the
    /// weights' room, the spill watermarks, the pools, the Conductor) is derived from it.
    #[arg(long, default_value_t = 16)]
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

/// How to run a sibling binary as printed: its path when it was built beside this one (as
/// `scripts/demo` does), else its name (installed on PATH).
fn sibling(name: &str) -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .filter(|p| p.exists())
        .map(|p| {
            let cwd = std::env::current_dir().unwrap_or_default();
            p.strip_prefix(&cwd).map(Path::to_path_buf).unwrap_or(p).display().to_string()
        })
        .unwrap_or_else(|| name.to_owned())
}

fn main() -> Result<()> {
    let args = Args::parse();
    stagehand::torch::init();
    let budget = args.budget_mib.checked_mul(1 << 20).context("--budget-mib is too large")?;
    let device = if args.cpu { Device::host(budget) } else { Device::auto(budget) };
    let info = device.info();

    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("runs/stagehand-{secs}.jsonl"))
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let bus = Bus::new();
    let hub = bus.hub().context("the bus is enabled")?.clone();
    // The server binds before the telemetry file is made, so a port clash leaves no empty file
    // behind; it starts before `run_started`, so /metrics takes its device labels from it.
    let server = if args.no_serve {
        None
    } else {
        Some(stagehand_web::Server::live(hub.clone(), &args.addr).with_context(|| format!("serving on {}", args.addr))?)
    };
    hub.add_sink(Box::new(
        stagehand::events::JsonlSink::open(&out, stagehand::events::OpenMode::CreateNew)
            .with_context(|| format!("opening the telemetry file {}", out.display()))?,
    ));
    // OTLP whenever the standard OTEL_* variables ask for it.
    let otlp = stagehand_exporter::otlp::attach_from_env(&hub).context("the OTLP exporter (OTEL_* variables)")?;

    let mut cfg = TrainConfig::demo(args.steps, args.layers, args.d_model, args.seq, args.batch, budget);
    if args.resident {
        cfg.memory = Memory::Resident;
    }
    cfg.conductor = !args.no_conductor;
    let run_id = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    announce(&bus, &cfg, &device, &run_id);

    println!("stagehand demo: {}", cfg.describe());
    println!(
        "  device     {}{}",
        info.name,
        if info.host_simulated() { " (no CUDA: VRAM is simulated on the host)" } else { "" }
    );
    if let Some(server) = &server {
        let url = server.url();
        println!("  dashboard  {url}/");
        println!("  metrics    {url}/metrics");
        println!("  live TUI   {} --connect {url}", sibling("stagehand-top"));
    }
    println!("  telemetry  {}", out.display());
    if otlp {
        println!("  otlp       metrics and step spans to the OTEL_EXPORTER_OTLP_* endpoint");
    }
    println!("  replay it  {} --replay {}", sibling("stagehand-top"), out.display());
    println!("  trace it   {} {}", sibling("stagehand-trace"), out.display());
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match cfg.memory {
        Memory::Resident => println!("  memory     resident: plain tch, no streaming, no spilling (--resident)"),
        Memory::Stagehand => {
            println!(
                "  memory     one Stagehand handle with a {:.0} MiB budget; the plan follows the first step",
                mib(budget)
            );
            if !cfg.conductor {
                println!("  conductor  off (--no-conductor)");
            }
        }
    }

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let on_step = |step: u64, loss: f64, dt: f64| {
        bar.set_message(format!("loss {loss:.3}  {:.0} ms/step", dt * 1e3));
        bar.inc(1);
        if step == 1 {
            bar.println("  step 1 traced the itinerary and sized the pools");
        }
    };
    let summary = match cfg.memory {
        Memory::Resident => train(&cfg, &device, &bus, on_step)?,
        Memory::Stagehand => train_stagehand(&cfg, &device, &bus, on_step, |b| b)?,
    };
    bar.finish();
    bus.flush();
    let snap = hub.snapshot();
    bus.close();

    if let Some(plan) = &summary.plan {
        println!("plan");
        for line in &plan.reasons {
            println!("  {line}");
        }
    }
    println!("summary");
    let (first, last) = summary.loss_drop();
    println!("  loss       {first:.3} -> {last:.3} (mean of the first and last tenth)");
    println!(
        "  step time  {:.1} ms mean over steps 2 and later (step 1: {:.1} ms)",
        summary.steady_step_s() * 1e3,
        summary.step_times.first().copied().unwrap_or(0.0) * 1e3
    );
    println!("  peak VRAM  {:.1} MiB of a {:.0} MiB budget", mib(summary.peak_bytes), mib(budget));
    if cfg.memory == Memory::Stagehand {
        println!(
            "  moved      {:.1} MiB H2D, {:.1} MiB D2H (weights, gradients, activations)",
            mib(snap.transfers.h2d.bytes),
            mib(snap.transfers.d2h.bytes)
        );
        let hits = snap.weights.prefetch_hits;
        let misses = snap.weights.prefetch_misses;
        println!(
            "  weights    {hits} prefetch hits, {misses} misses ({:.1}% hit rate), {} evictions",
            100.0 * hits as f64 / (hits + misses).max(1) as f64,
            snap.weights.evictions
        );
        println!(
            "  activations {} saved, {} spilled ({:.1} MiB), {} restored ({} predicted), {} through pageable memory",
            snap.activations.saved,
            snap.activations.spilled,
            mib(snap.activations.spill_bytes),
            snap.activations.restored,
            snap.activations.predicted,
            snap.activations.pool_misses
        );
        if let Some(t) = summary.breakdowns.last() {
            println!(
                "  last step  {:.1} ms: compute {:.1}, waiting on copies {:.1} in / {:.1} out, stalls {:.1}, optimizer {:.1}",
                t.step_ms,
                t.compute_ms,
                t.h2d_wait_ms,
                t.d2h_wait_ms,
                t.weight_stall_ms + t.restore_stall_ms,
                t.optimizer_ms
            );
        }
    }
    println!("  events     {} recorded, {} dropped", snap.events_applied, snap.dropped_events);
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
