//! Replays a telemetry file: serves it to the web dashboard (play, pause, seek, speed from the
//! page or the API), writes it as a Chrome/Perfetto trace, and says how to open it in
//! stagehand-top. Serves until Ctrl-C.
//!
//! The file is read once: the replay's background index hands each event to the trace writer
//! as it goes, and the replay then reads on demand, so memory does not grow with the file.
//!
//! Run: `cargo run --release -p stagehand-examples --bin replay -- FILE` (`--help` for options).

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use stagehand::events::replay::{FileReplay, IndexObserver};
use stagehand::events::{Event, ReadReport};
use stagehand_examples::process::sibling;
use stagehand_exporter::trace::{Summary, TraceWriter};
use stagehand_web::cli::ServeArgs;
use stagehand_web::{AppState, ReplayDriver, Server};
use std::fs::File;
use std::io::BufWriter;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// Replay a Stagehand telemetry file in the web dashboard, and write it as a Perfetto trace.
#[derive(Debug, Parser)]
#[command(name = "replay", version)]
struct Args {
    /// The telemetry file (JSONL) a run wrote.
    file: PathBuf,
    // Serves on 127.0.0.1:7879 unless --addr says otherwise: a fixed address to bookmark,
    // beside the live run's 7878.
    #[command(flatten)]
    serve: ServeArgs,
    /// Stop after this many seconds (default: serve until Ctrl-C).
    #[arg(long, value_name = "SECS")]
    serve_secs: Option<u64>,
    /// Start playing at once instead of paused at the start.
    #[arg(long)]
    play: bool,
    /// Do not write the Perfetto trace (FILE.trace.json).
    #[arg(long)]
    no_trace: bool,
}

/// Where a replay serves unless `--addr` says otherwise.
const DEFAULT_REPLAY_ADDR: &str = "127.0.0.1:7879";

/// What the index pass found: the read report, and the trace if one was written.
type PassResult = (ReadReport, Option<Result<Summary>>);

/// Rides along the replay's index pass: writes the trace (if asked) and reports the read.
struct IndexPass {
    trace: Option<TraceWriter<BufWriter<File>>>,
    failed: Option<stagehand_exporter::Error>,
    done: mpsc::Sender<PassResult>,
}

impl IndexObserver for IndexPass {
    fn on_event(&mut self, event: &Event) {
        if let Some(w) = &mut self.trace {
            if let Err(e) = w.write(event) {
                // Keep the reason; the replay itself goes on without the trace.
                self.failed = Some(e);
                self.trace = None;
            }
        }
    }

    fn finish(&mut self, report: &ReadReport, error: Option<&str>) {
        let trace = match (self.trace.take(), self.failed.take(), error) {
            (_, _, Some(e)) => Some(Err(anyhow!("the file could not be read to its end: {e}"))),
            (_, Some(e), None) => Some(Err(e.into())),
            (Some(w), None, None) => Some(w.finish(report.clone()).map_err(Into::into)),
            (None, None, None) => None,
        };
        // The receiver waits for this; if it is gone the program is stopping anyway.
        let _ = self.done.send((report.clone(), trace));
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file = &args.file;
    std::fs::metadata(file).with_context(|| format!("reading {}", file.display()))?;
    let trace_path = PathBuf::from(format!("{}.trace.json", file.display()));
    let trace = if args.no_trace {
        None
    } else {
        let out = File::create(&trace_path).with_context(|| format!("writing {}", trace_path.display()))?;
        Some(TraceWriter::new(BufWriter::new(out))?)
    };
    let (done, pass) = mpsc::channel();
    let observer = Box::new(IndexPass { trace, failed: None, done });
    let replay = FileReplay::open_observed(file, observer).with_context(|| format!("reading {}", file.display()))?;
    let driver = Arc::new(ReplayDriver::from_file(replay));

    // The summary and the trace need the whole file: wait for the one pass that reads it.
    let (report, trace) = pass
        .recv()
        .map_err(|_| anyhow!("the index of {} stopped without a word", file.display()))?;
    println!("{}: {}", file.display(), report.summary());
    if let Some(summary) = trace {
        summary.with_context(|| format!("writing {}", trace_path.display()))?;
        println!("perfetto   open {} in ui.perfetto.dev or chrome://tracing", trace_path.display());
    }

    if args.play {
        driver.set_paused(false);
    }
    // A fixed address by default, beside a live run's on 7878; --addr for another.
    let config = args.serve.config(DEFAULT_REPLAY_ADDR);
    let server = Server::start(&config, AppState::replay(driver)).with_context(|| {
        format!("serving on {} (another replay there? --addr 127.0.0.1:0 takes any free port)", config.addr)
    })?;
    let url = server.url();
    println!("dashboard  {} (replay controls at the top)", server.login_url());
    println!("api        {url}/api/replay/status; POST {url}/api/replay/play with content-type application/json");
    println!("terminal   {} --replay {}", sibling("stagehand-top", "stagehand-dashboard"), file.display());

    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .context("installing the Ctrl-C handler")?;
    match args.serve_secs {
        Some(secs) => {
            let _ = stop_rx.recv_timeout(Duration::from_secs(secs));
        }
        None => {
            println!("serving until Ctrl-C");
            let _ = stop_rx.recv();
        }
    }
    server.shutdown()?;
    Ok(())
}
