//! Replays a telemetry file: serves it to the web dashboard (play, pause, seek, speed from the
//! page or the API), writes it as a Chrome/Perfetto trace, and says how to open it in
//! stagehand-top. Serves until Ctrl-C.
//!
//! Run: `cargo run --release -p stagehand-examples --bin replay -- FILE` (`--help` for options).

use anyhow::{Context, Result};
use clap::Parser;
use stagehand::events::jsonl::read_file;
use stagehand_web::cli::ServeArgs;
use stagehand_web::{AppState, ReplayDriver, Server};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Replay a Stagehand telemetry file in the web dashboard, and write it as a Perfetto trace.
#[derive(Debug, Parser)]
#[command(name = "replay", version)]
struct Args {
    /// The telemetry file (JSONL) a run wrote.
    file: PathBuf,
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

fn main() -> Result<()> {
    let args = Args::parse();
    let file = &args.file;
    // Read once: the trace is written from the same events the replay then serves.
    let (events, report) = read_file(file).with_context(|| format!("reading {}", file.display()))?;
    println!("{}: {}", file.display(), report.summary());

    if !args.no_trace {
        let trace = PathBuf::from(format!("{}.trace.json", file.display()));
        let json = serde_json::to_vec(&stagehand_exporter::trace::to_chrome_trace(&events))?;
        std::fs::write(&trace, json).with_context(|| format!("writing {}", trace.display()))?;
        println!("perfetto   open {} in ui.perfetto.dev or chrome://tracing", trace.display());
    }

    let driver = Arc::new(ReplayDriver::new(events));
    if args.play {
        driver.set_paused(false);
    }
    // Any free port by default, so a replay never collides with a live run on 7878.
    let config = args.serve.config("127.0.0.1:0");
    let server = Server::start(&config, AppState::replay(driver))
        .with_context(|| format!("serving on {}", config.addr))?;
    let url = server.url();
    println!("dashboard  {} (replay controls at the top)", server.login_url());
    println!("api        {url}/api/replay/status; POST {url}/api/replay/play with content-type application/json");
    println!("terminal   stagehand-top --replay {}", file.display());

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
