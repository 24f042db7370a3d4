//! The main job: trains a small GPT under one Stagehand handle with its telemetry, on CUDA where
//! present and on the host device otherwise. Run it with `scripts/demo` (which sets everything up
//! first).
//!
//! It prints the memory plan as soon as it is known (before the first step), a line whenever the
//! spill watermarks move, and a summary whose figures are the snapshot's (the same the page,
//! `stagehand-top` and `/metrics` show). SIGINT (Ctrl-C) or SIGTERM ends the run after the step
//! in progress, with its summary and a complete telemetry file; a second one exits at once.

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use stagehand::device::Device;
use stagehand::events::telemetry::{self, flight, Level, TelemetryConfig};
use stagehand::events::{Bus, Event, EventKind, EventSink};
use stagehand_examples::process::{sibling, Stop};
use stagehand_examples::report::Report;
use stagehand_examples::trainer::{announce_with, demo_budget, group_budget, train_group, train_with, Hooks, Memory, TrainConfig, DEMO_DEFAULTS};
use stagehand::{Precision, StateStorage};
use stagehand_web::cli::ServeArgs;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Micro-batches each step's batch is split into (gradient accumulation): each a forward and
    /// a backward, one optimizer step after the last. The batch must split evenly (with --gpus,
    /// each GPU's share).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    micro_batches: u32,
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
    /// Checkpoint each block (on: only its input is stored, backward computes it again; off:
    /// its activations are stored, spilled over PCIe where the budget needs), or auto: on in
    /// bf16 and fp16, whose steps are short enough on the device that the host's memory is the
    /// wall, off in fp32 and tf32.
    #[arg(long, value_name = "WHEN", default_value = "auto", value_parser = ["auto", "on", "off"])]
    checkpoint: String,
    /// How the host optimizer stores its state: fp32, bf16 (half the bytes) or int8 (8-bit
    /// block-wise, about a quarter).
    #[arg(long, value_name = "STORAGE", default_value = "fp32", value_parser = parse_state)]
    optimizer_state: StateStorage,
    /// Exit 0 even when the loss went NaN or infinite (by default such a run, whether the
    /// guards or the loss itself showed it, exits 1).
    #[arg(long)]
    allow_non_finite: bool,
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
    /// After training, keep serving until Enter is pressed (or Ctrl-C).
    #[arg(long)]
    keep_serving: bool,
    /// Intra-op threads of the training thread and the host optimizer, the same with
    /// --resident (default: libtorch's, every core).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    threads: Option<u64>,
    /// AdamW's learning rate (default: 3e-3, smaller for models wider than 128).
    #[arg(long, value_name = "LR")]
    learning_rate: Option<f64>,
    /// Weight blocks prefetched ahead (the handle's `prefetch_window`; default 2; 0: each block
    /// loads when it is used).
    #[arg(long, value_name = "BLOCKS")]
    prefetch_window: Option<u32>,
    /// Loads and restores in flight at once (`max_inflight_h2d`; default: the plan's).
    #[arg(long, value_name = "COPIES")]
    max_inflight_h2d: Option<u32>,
    /// Spills in flight at once (`max_inflight_d2h`; default: the plan's).
    #[arg(long, value_name = "COPIES")]
    max_inflight_d2h: Option<u32>,
    /// Spilled tensors restored ahead of backward (`restore_lookahead`; default 8).
    #[arg(long, value_name = "TENSORS")]
    restore_lookahead: Option<u32>,
    /// The least pinned slabs in each size class of the activation pool (`slabs_per_class`;
    /// default: what the traced first step held at once).
    #[arg(long, value_name = "SLABS")]
    slabs_per_class: Option<u32>,
    /// The most pinned host memory the activation pool may take, in MiB
    /// (`activation_pool_limit`; default: half the host memory the model leaves, rounded down
    /// to a power of two; more than the model leaves is refused).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    activation_pool_limit: Option<u64>,
}

/// The handle's settings the flags above give, applied to its builder.
fn knobs(args: &Args, mut b: stagehand::StagehandBuilder) -> stagehand::StagehandBuilder {
    if let Some(k) = args.prefetch_window {
        b = b.prefetch_window(k);
    }
    if let Some(n) = args.max_inflight_h2d {
        b = b.max_inflight_h2d(n);
    }
    if let Some(n) = args.max_inflight_d2h {
        b = b.max_inflight_d2h(n);
    }
    if let Some(n) = args.restore_lookahead {
        b = b.restore_lookahead(n);
    }
    if let Some(n) = args.slabs_per_class {
        b = b.slabs_per_class(n);
    }
    if let Some(mib) = args.activation_pool_limit {
        b = b.activation_pool_limit_bytes(mib.saturating_mul(1 << 20));
    }
    b
}

/// Prints a line above the progress bar (also when the bar is hidden: output to a file or a
/// pipe shows every line and no bar).
fn say(bar: &ProgressBar, line: String) {
    bar.suspend(|| println!("{line}"));
}

/// Prints a line for each event a user should see as it happens (the watermarks moving), above
/// the progress bar.
struct Lines(ProgressBar);

impl EventSink for Lines {
    fn on_event(&mut self, e: &Event) {
        if let EventKind::WatermarksMoved { from_high_bytes, from_low_bytes, high_bytes, low_bytes, reason } = &e.kind {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            say(&self.0, format!(
                "  watermarks spill {:.1}/{:.1} MiB -> {:.1}/{:.1} MiB (high/low) after step {}: {reason}",
                mib(*from_high_bytes),
                mib(*from_low_bytes),
                mib(*high_bytes),
                mib(*low_bytes),
                e.step
            ));
        }
    }
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

fn main() -> Result<()> {
    let args = Args::parse();
    stagehand::torch::init();
    let stop = Stop::install()?;
    let asked = args.budget_mib.unwrap_or(DEMO_DEFAULTS.budget_mib);
    let asked = asked.checked_mul(1 << 20).context("--budget-mib is too large")?;
    let device = if args.cpu { Device::host(asked) } else { Device::auto(asked) };
    let gpus = args.gpus as usize;
    if gpus > 1 && args.resident {
        anyhow::bail!("--resident trains plain tch on one device: leave out --gpus {gpus}");
    }
    let above = args.budget_mib.is_none().then(|| DEMO_DEFAULTS.budget_above(&device));
    let mut budget = demo_budget(&device, above)?.unwrap_or(asked);
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
        hub.add_snapshot_sink(Box::new(metrics.clone()));
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
    cfg.micro_batches = args.micro_batches as usize;
    cfg.check(gpus.max(1))?;
    match args.checkpoint.as_str() {
        "on" => cfg.model.checkpoint = true,
        "off" => cfg.model.checkpoint = false,
        _ => {}
    }
    if args.resident {
        cfg.memory = Memory::Resident;
    }
    cfg.conductor = !args.no_conductor;
    cfg.threads = args.threads.map(|n| n as usize);
    if let Some(lr) = args.learning_rate {
        cfg.learning_rate = lr;
    }
    let run_id = out
        .file_name()
        .map(|s| s.to_string_lossy().split(".jsonl").next().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let described = serde_json::json!({
        "telemetry": &tcfg, "guards": args.guards, "checksums": args.checksums, "threads": cfg.thread_count(),
        "knobs": {
            "prefetch_window": args.prefetch_window, "max_inflight_h2d": args.max_inflight_h2d,
            "max_inflight_d2h": args.max_inflight_d2h, "restore_lookahead": args.restore_lookahead,
            "slabs_per_class": args.slabs_per_class, "activation_pool_limit_mib": args.activation_pool_limit,
        },
    });

    // The devices of a data-parallel run: the GPUs when CUDA is here (all N of them, or an
    // error), else N simulated host devices.
    let group_devices = (gpus > 1)
        .then(|| -> Result<Vec<Device>> {
            Ok(if device.is_cuda() { stagehand::parallel::Devices::cuda(gpus)? } else { stagehand::parallel::Devices::host(gpus, budget) })
        })
        .transpose()?;
    // Each rank's thread keeps cuBLAS workspaces of its own: the default budget counts them.
    if let (Some(devs), Some(above)) = (&group_devices, above) {
        if device.is_cuda() {
            budget = group_budget(devs, above)?;
            cfg.budget_bytes = budget;
        }
    }
    println!("stagehand demo: {}", cfg.describe());
    println!(
        "  device     {}{}{}",
        info.name,
        if info.host_simulated() { " (no CUDA: VRAM is simulated on the host)" } else { "" },
        if gpus > 1 { format!(", {gpus} of them: data parallel, each its slice of the batch, one host copy of the model") } else { String::new() }
    );
    if gpus > 1 && device.is_cuda() {
        println!("  nccl       {}", stagehand::parallel::nccl_version()?);
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
        // The token goes in the environment: a command line shows in `ps` to every user.
        let token = server.token().map(|t| format!("STAGEHAND_TOKEN={t} ")).unwrap_or_default();
        let cert = args.serve.tls_cert.as_ref().map(|c| format!(" --tls-cert {}", c.display())).unwrap_or_default();
        println!("  live TUI   {token}{} --connect {url}{cert}", sibling("stagehand-top", "stagehand-dashboard"));
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
        Memory::Resident => {
            println!("  memory     resident: plain tch, no streaming, no spilling, no budget (--resident)")
        }
        Memory::Stagehand => {
            if gpus > 1 {
                println!("  memory     a Stagehand handle per GPU, each with a {:.0} MiB budget", mib(budget));
            } else {
                println!("  memory     one Stagehand handle with a {:.0} MiB budget", mib(budget));
            }
            if !cfg.conductor {
                println!("  conductor  off (--no-conductor)");
            }
        }
    }
    println!(
        "  threads    {} intra-op threads for the training thread and the optimizer, as in --resident (--threads)",
        cfg.thread_count()
    );
    if args.guards && cfg.memory == Memory::Stagehand {
        println!("  guards     every block output, gradient and the loss checked for NaN and infinity, read once a step");
    }
    if args.checksums && cfg.memory == Memory::Stagehand {
        println!("  checksums  every spilled activation checksummed (CRC32C) and checked before its restore");
    }
    println!("  stop       Ctrl-C or SIGTERM ends the run after the step in progress; a second one at once");

    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    hub.add_sink(Box::new(Lines(bar.clone())));
    // Says at once that a signal was heard (the step in progress may take a while).
    {
        let (stop, bar) = (stop.clone(), bar.clone());
        std::thread::spawn(move || loop {
            if let Some((name, _)) = stop.signal() {
                say(&bar, format!("  {name}: stopping after the step in progress (again to exit at once)"));
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        });
    }
    let on_step = |step: u64, loss: f64, dt: f64| {
        bar.set_message(format!("loss {loss:.3}  {:.0} ms/step", dt * 1e3));
        bar.inc(1);
        if step == 1 && cfg.memory == Memory::Stagehand {
            say(&bar, "  step 1 traced the itinerary and sized the pools".into());
        }
    };
    let on_plan = |plan: &stagehand::Plan| {
        say(&bar, "plan".into());
        for line in &plan.reasons {
            say(&bar, format!("  {line}"));
        }
    };
    let hooks = Hooks { on_plan: Some(Box::new(on_plan)), stop: Some(stop.flag()) };
    // The telemetry is attached before `run_started`, which comes before anything else.
    let (b, c, d, r) = (bus.clone(), cfg.clone(), device.clone(), run_id.clone());
    let mut resident_telemetry = None;
    if cfg.memory == Memory::Resident {
        resident_telemetry = Some(telemetry::attach(&bus, tcfg.clone()).context("attaching the telemetry")?);
        announce_with(&bus, &cfg, &device, &run_id, described.clone());
    }
    let customize = |builder| {
        knobs(&args, builder).telemetry(tcfg).guards(args.guards).checksums(args.checksums).attach(move |_| {
            announce_with(&b, &c, &d, &r, described);
            Ok(Box::new(()))
        })
    };
    let mut ranks = Vec::new();
    let trained = match group_devices {
        // Rank 0 drives the progress bar (the ranks step together).
        Some(devices) => train_group(&cfg, devices, &bus, |rank, step, loss, dt| if rank == 0 { on_step(step, loss, dt) }, hooks, customize)
            .map(|r| {
                ranks = r;
                ranks.first().map(|r| r.summary.clone())
            })
            .and_then(|s| s.context("a group of no ranks")),
        None => train_with(&cfg, &device, &bus, on_step, hooks, customize),
    };
    if trained.is_err() {
        bar.abandon();
    }
    let summary = trained?;
    bar.finish();
    // Closing delivers everything, flushes the sinks and publishes what they report about it
    // (telemetry lost to a failed write included) before the summary reads the snapshot.
    bus.close();
    drop(resident_telemetry);
    let snap = hub.snapshot();
    let stopped = stop.signal().filter(|_| summary.stopped);

    println!("summary");
    let report = Report {
        summary: &summary,
        snapshot: &snap,
        memory: cfg.memory,
        budget,
        vram_measured: cfg.memory == Memory::Stagehand || device.is_cuda(),
        steps_asked: args.steps,
        stopped_by: stopped.map(|s| s.0),
    };
    for line in report.lines() {
        println!("{line}");
    }
    // Each GPU of a data-parallel run: its own lane (the lines above follow GPU 0).
    for r in &ranks {
        let lane = snap.lanes.get(&r.device);
        let moved = lane.map(|l| l.transfers).unwrap_or_default();
        let steady = r.weights.iter().skip(1);
        let coll = steady.clone().map(|w| w.collective_ms).sum::<f64>() / r.weights.len().saturating_sub(1).max(1) as f64;
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
    if writes_file {
        let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
        println!(
            "  telemetry  {} ({:.1} KB, {:.1} KB a step)",
            out.display(),
            size as f64 / 1e3,
            size as f64 / 1e3 / summary.steps.max(1) as f64
        );
    }
    if snap.flight_records.is_empty() {
        println!("  flight     no incidents, no flight records");
    }
    for path in &snap.flight_records {
        println!("  flight     {path}");
    }
    if let Some(server) = server {
        if args.keep_serving && stopped.is_none() {
            println!("serving {} until Enter is pressed (or Ctrl-C)", server.login_url());
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
                let _ = tx.send(());
            });
            while rx.recv_timeout(Duration::from_millis(100)) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                if stop.signal().is_some() {
                    break;
                }
            }
        }
        server.shutdown()?;
    }
    // A loss gone NaN or infinite is a failed run, unless asked otherwise.
    let guards: Vec<&str> = snap.non_finite.keys().map(String::as_str).collect();
    if let Some(why) = summary.non_finite(&guards).filter(|_| !args.allow_non_finite) {
        anyhow::bail!("{why}; --allow-non-finite to exit 0 anyway");
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
    // Nor one a signal cut short (everything above is written and flushed by now).
    if let Some((_, code)) = stop.signal() {
        std::process::exit(code);
    }
    Ok(())
}
