//! The main job: trains a small GPT under one Stagehand handle with its telemetry, on CUDA where
//! present and on the host device otherwise. Run it with `scripts/demo` (which sets everything up
//! first).

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand::device::Device;
use stagehand::events::telemetry::{self, flight, Level, TelemetryConfig};
use stagehand::events::Bus;
use stagehand_examples::trainer::{announce_with, demo_budget, train, train_group, train_stagehand, Memory, TrainConfig, DEMO_DEFAULTS};
use stagehand::{Precision, StateStorage};
use stagehand_web::cli::ServeArgs;
use std::path::{Path, PathBuf};

/// Train a GPT-style model under Stagehand and watch it live.
#[derive(Debug, Parser)]
#[command(name = "stagehand-demo", version)]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = DEMO_DEFAULTS.steps)]
    steps: u64,
    /// Transformer blocks.
    #[arg(long, default_value_t = DEMO_DEFAULTS.layers)]
    layers: i64,
    /// Embedding width.
    #[arg(long, default_value_t = DEMO_DEFAULTS.d_model)]
    d_model: i64,
    /// Sequence length.
    #[arg(long, default_value_t = DEMO_DEFAULTS.seq)]
    seq: i64,
    /// Sequences per batch.
    #[arg(long, default_value_t = DEMO_DEFAULTS.batch)]
    batch: i64,
    /// Device memory budget in MiB (the simulated VRAM on the host device). Everything else (the
    /// weights' room, the spill watermarks, the pools, the Conductor) is derived from it. Default:
    /// 16 MiB; on CUDA, 32 MiB above what libtorch holds for itself (cuBLAS's workspaces; the
    /// ops' temporaries count there too), so the small model streams and spills there as it
    /// does on the host.
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Telemetry file; never overwritten. Default: `runs/stagehand-<time>.jsonl` (.jsonl.zst with
    /// --compress). Flight records of incidents are written beside it.
    #[arg(long)]
    out: Option<PathBuf>,
    /// What the telemetry file keeps: off (no file; incidents still leave flight records),
    /// summary (per-step figures, warnings and incidents, a few KB a step) or full (every event).
    #[arg(long, value_name = "LEVEL", default_value = "summary", value_parser = parse_level)]
    telemetry_level: Level,
    /// Compress the telemetry file with zstd.
    #[arg(long)]
    compress: bool,
    /// Check block outputs, gradients and the loss for NaN and infinity (one device read a step).
    #[arg(long)]
    guards: bool,
    /// Checksum every spilled activation (CRC32C) and refuse a restore whose bytes changed in
    /// host memory: a debugging aid that reads each spilled byte twice more on the host.
    #[arg(long)]
    checksums: bool,
    /// Run on the host device even when CUDA is present.
    #[arg(long)]
    cpu: bool,
    /// Train data parallel on this many GPUs (CUDA devices 0..N; without CUDA, or with --cpu,
    /// N simulated host devices), each under the budget, on its slice of the batch, all streaming
    /// from one host copy of the model. The batch is the global batch (a multiple of N).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    gpus: u64,
    /// What the run computes and updates in: fp32, tf32 (float32 storage, TF32 matmuls on
    /// CUDA), bf16 or fp16 (16-bit weights and gradients on the device and over PCIe, float32
    /// masters and optimizer state on the host; fp16 with dynamic loss scaling), or auto: bf16
    /// where the device computes bf16 fast (CUDA compute capability 8.0 or later), else fp32.
    #[arg(long, value_name = "PRECISION", default_value = "auto", value_parser = parse_precision)]
    precision: PrecisionChoice,
    /// How the host optimizer stores its state: fp32, bf16 (half the bytes) or int8 (8-bit
    /// block-wise, about a quarter).
    #[arg(long, value_name = "STORAGE", default_value = "fp32", value_parser = parse_state)]
    optimizer_state: StateStorage,
    #[command(flatten)]
    serve: ServeArgs,
    /// Do not serve the API and dashboards.
    #[arg(long, conflicts_with = "keep_serving")]
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

fn parse_level(s: &str) -> Result<Level, String> {
    s.parse()
}

/// `--precision`: one precision, or `auto` (the device decides).
#[derive(Debug, Clone, Copy, PartialEq)]
enum PrecisionChoice {
    Auto,
    Fixed(Precision),
}

fn parse_precision(s: &str) -> Result<PrecisionChoice, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(PrecisionChoice::Auto);
    }
    s.parse().map(PrecisionChoice::Fixed).map_err(|e: String| format!("{e}, or auto"))
}

fn parse_state(s: &str) -> Result<StateStorage, String> {
    s.parse()
}

/// How to run a sibling binary as printed: its path when it was built beside this one (as
/// `scripts/demo` does), its name when it is installed on PATH, else the cargo command that
/// builds and runs it from the repository (where `scripts/demo` runs).
fn sibling(name: &str, package: &str) -> String {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .filter(|p| p.exists());
    if let Some(p) = beside {
        let cwd = std::env::current_dir().unwrap_or_default();
        return p.strip_prefix(&cwd).map(Path::to_path_buf).unwrap_or(p).display().to_string();
    }
    let on_path = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()));
    if on_path {
        name.to_owned()
    } else {
        format!("cargo run --release -q -p {package} --bin {name} --")
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    stagehand::torch::init();
    let asked = args.budget_mib.unwrap_or(DEMO_DEFAULTS.budget_mib);
    let asked = asked.checked_mul(1 << 20).context("--budget-mib is too large")?;
    let device = if args.cpu { Device::host(asked) } else { Device::auto(asked) };
    let gpus = args.gpus as usize;
    if gpus > 1 && args.resident {
        anyhow::bail!("--resident trains plain tch on one device: leave out --gpus {gpus}");
    }
    let above = args.budget_mib.is_none().then(|| DEMO_DEFAULTS.budget_above(&device));
    let budget = demo_budget(&device, above)?.unwrap_or(asked);
    let info = device.info();

    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("runs/stagehand-{secs}.jsonl{}", if args.compress { ".zst" } else { "" }))
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // The file's name also names the flight records, so it is given at every level.
    let tcfg = TelemetryConfig {
        level: args.telemetry_level,
        path: Some(out.clone()),
        compress: args.compress,
        ..TelemetryConfig::default()
    };
    let writes_file = args.telemetry_level != Level::Off;
    let bus = Bus::new();
    let hub = bus.hub().context("the bus is enabled")?.clone();
    // The server binds before the telemetry file is made, so a port clash leaves no empty file
    // behind; it starts before `run_started`, so /metrics takes its device labels from it.
    let server = if args.no_serve {
        None
    } else {
        let config = args.serve.config(stagehand_web::DEFAULT_SERVER_ADDR);
        let metrics = stagehand_exporter::Metrics::new();
        hub.add_sink(Box::new(metrics.clone()));
        let state = stagehand_web::AppState::live(hub.clone(), metrics);
        Some(stagehand_web::Server::start(&config, state).with_context(|| format!("serving on {}", config.addr))?)
    };
    // OTLP whenever the standard OTEL_* variables ask for it.
    let otlp = stagehand_exporter::otlp::attach_from_env(&hub).context("the OTLP exporter (OTEL_* variables)")?;

    let precision = match args.precision {
        PrecisionChoice::Fixed(p) => p,
        PrecisionChoice::Auto => TrainConfig::default_precision(&device),
    };
    let mut cfg = TrainConfig::demo(args.steps, args.layers, args.d_model, args.seq, args.batch, budget).with_precision(precision);
    cfg.optimizer_state = args.optimizer_state;
    if args.resident {
        cfg.memory = Memory::Resident;
    }
    cfg.conductor = !args.no_conductor;
    let run_id = out
        .file_name()
        .map(|s| s.to_string_lossy().split(".jsonl").next().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let described = serde_json::json!({ "telemetry": &tcfg, "guards": args.guards, "checksums": args.checksums });

    // The devices of a data-parallel run: the GPUs when CUDA is here (all N of them, or an
    // error), else N simulated host devices.
    let group_devices = (gpus > 1).then(|| -> Result<Vec<Device>> {
        Ok(if device.is_cuda() { stagehand::parallel::Devices::cuda(gpus)? } else { stagehand::parallel::Devices::host(gpus, budget) })
    });
    let group_devices = group_devices.transpose()?;
    println!("stagehand demo: {}", cfg.describe());
    println!(
        "  device     {}{}{}",
        info.name,
        if info.host_simulated() { " (no CUDA: VRAM is simulated on the host)" } else { "" },
        if gpus > 1 { format!(", {gpus} of them: data parallel, each its slice of the batch, one host copy of the model") } else { String::new() }
    );
    if gpus > 1 && device.is_cuda() {
        match stagehand::parallel::nccl_version() {
            Ok(v) => println!("  nccl       {v}"),
            Err(e) => anyhow::bail!("{e}"),
        }
    }
    println!(
        "  precision  {}{}{}",
        precision,
        if args.precision == PrecisionChoice::Auto { " (auto: bf16 where the device computes bf16 fast)" } else { "" },
        if args.optimizer_state == StateStorage::Fp32 { String::new() } else { format!(", optimizer state in {}", args.optimizer_state) }
    );
    if let Some(server) = &server {
        let url = server.url();
        println!("  dashboard  {}", server.login_url());
        match server.token() {
            None => println!("  metrics    {url}/metrics"),
            Some(t) => println!("  metrics    {url}/metrics (send 'Authorization: Bearer {t}')"),
        }
        if url.starts_with("http://") {
            let connect = match server.token() {
                None => url.clone(),
                Some(t) => format!("{url}/api/stream?token={t}"),
            };
            println!("  live TUI   {} --connect {connect}", sibling("stagehand-top", "stagehand-dashboard"));
        }
    }
    if writes_file {
        println!("  telemetry  {} ({} level)", out.display(), args.telemetry_level.as_str());
    } else {
        println!("  telemetry  off (--telemetry-level off): no file; incidents still leave flight records");
    }
    let (dir, stem) = flight::dump_location(Some(&out));
    println!(
        "  flight     stalls, exhausted pools, pageable copies, out-of-memory{} dump the last steps in full to {}",
        if args.guards { " and NaNs" } else { "" },
        dir.join(format!("{stem}.flight-NNNN-REASON.jsonl")).display()
    );
    if otlp {
        println!("  otlp       metrics and step spans to the OTEL_EXPORTER_OTLP_* endpoint");
    }
    if writes_file {
        println!("  replay it  {} --replay {}", sibling("stagehand-top", "stagehand-dashboard"), out.display());
        println!("  trace it   {} {}", sibling("stagehand-trace", "stagehand-exporter"), out.display());
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match cfg.memory {
        Memory::Resident => println!("  memory     resident: plain tch, no streaming, no spilling (--resident)"),
        Memory::Stagehand => {
            println!(
                "  memory     {} with a {:.0} MiB budget{}; the plan follows the first step",
                if gpus > 1 { "a Stagehand handle per GPU" } else { "one Stagehand handle" },
                mib(budget),
                if gpus > 1 { " each" } else { "" }
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
    let mut ranks = Vec::new();
    let summary = match (cfg.memory, group_devices) {
        (Memory::Stagehand, Some(devices)) => {
            let (b, c, d) = (bus.clone(), cfg.clone(), device.clone());
            // Rank 0 drives the progress bar (the ranks step together).
            let on_rank_step = |rank: usize, step: u64, loss: f64, dt: f64| {
                if rank == 0 {
                    on_step(step, loss, dt);
                }
            };
            ranks = train_group(&cfg, devices, &bus, on_rank_step, move |builder| {
                builder.telemetry(tcfg).guards(args.guards).checksums(args.checksums).attach(move |_| {
                    announce_with(&b, &c, &d, &run_id, described);
                    Ok(Box::new(()))
                })
            })?;
            ranks.first().map(|r| r.summary.clone()).context("a group of no ranks")?
        }
        (Memory::Resident, _) => {
            // No handle: the telemetry is attached to the bus directly.
            let _t = telemetry::attach(&bus, tcfg).context("attaching the telemetry")?;
            announce_with(&bus, &cfg, &device, &run_id, described);
            train(&cfg, &device, &bus, on_step)?
        }
        (Memory::Stagehand, None) => {
            let (b, c, d) = (bus.clone(), cfg.clone(), device.clone());
            train_stagehand(&cfg, &device, &bus, on_step, move |builder| {
                // The handle attaches the telemetry first; `run_started` follows, before the
                // handle publishes anything of its own.
                builder.telemetry(tcfg).guards(args.guards).checksums(args.checksums).attach(move |_| {
                    announce_with(&b, &c, &d, &run_id, described);
                    Ok(Box::new(()))
                })
            })?
        }
    };
    bar.finish();
    // Closing delivers everything, flushes the sinks and publishes what they report about it
    // (telemetry lost to a failed write included) before the summary reads the snapshot.
    bus.close();
    let snap = hub.snapshot();

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
            "  activations {} saved, {} spilled ({:.1} MiB), {} restored ({} predicted), {} through pageable memory, {} recomputed ({:.1} MiB never stored)",
            snap.activations.saved,
            snap.activations.spilled,
            mib(snap.activations.spill_bytes),
            snap.activations.restored,
            snap.activations.predicted,
            snap.activations.pool_misses,
            snap.activations.recomputed,
            mib(snap.activations.recompute_bytes)
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
        // Each GPU of a data-parallel run: its own lane (the lines above are GPU 0's).
        for r in &ranks {
            let lane = snap.lanes.get(&r.device);
            let moved = lane.map(|l| l.transfers).unwrap_or_default();
            let coll: f64 = r.weights.iter().skip(1).map(|w| w.collective_ms).sum::<f64>() / r.weights.len().saturating_sub(1).max(1) as f64;
            println!(
                "  GPU {}      {:.1} ms/step, peak {:.1} MiB; moved {:.1} MiB H2D, {:.1} MiB D2H; collectives {:.1} MiB reduced, {coll:.2} ms a step on the device",
                r.device,
                r.summary.steady_step_s() * 1e3,
                mib(r.summary.peak_bytes),
                mib(moved.h2d.bytes),
                mib(moved.d2h.bytes),
                mib(moved.collective.bytes)
            );
        }
    }
    println!(
        "  events     {} recorded, {} dropped, {} lost writing the telemetry",
        snap.events_applied, snap.dropped_events, snap.telemetry_lost
    );
    if writes_file {
        let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        println!(
            "  telemetry  {} ({:.1} KB, {:.1} KB a step)",
            out.display(),
            size as f64 / 1e3,
            size as f64 / 1e3 / args.steps.max(1) as f64
        );
    }
    if snap.flight_records.is_empty() {
        println!("  flight     no incidents, no flight records");
    }
    for path in &snap.flight_records {
        println!("  flight     {path}");
    }
    if let Some(server) = server {
        if args.keep_serving {
            println!("serving {} until Enter is pressed", server.login_url());
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        server.shutdown()?;
    }
    // A run whose record is incomplete must not look like a clean one to a script.
    if snap.dropped_events > 0 || snap.telemetry_lost > 0 {
        anyhow::bail!(
            "telemetry incomplete: {} events dropped on the bus, {} lost writing {} (see the warnings above)",
            snap.dropped_events,
            snap.telemetry_lost,
            out.display()
        );
    }
    Ok(())
}
