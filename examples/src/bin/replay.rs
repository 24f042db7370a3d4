//! Replays a telemetry file: serves it to the web dashboard (with play/pause/seek/speed over the
//! API), exports it as a Chrome/Perfetto trace, and prints how to open it in stagehand-top.
//!
//! Run: `cargo run --release -p stagehand-examples --bin replay -- FILE [--serve-secs N]`

use anyhow::Context;
use stagehand::events::jsonl::read_file;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let file = args.next().context("usage: replay FILE [--serve-secs N]")?;
    let serve_secs: u64 = match (args.next().as_deref(), args.next()) {
        (Some("--serve-secs"), Some(n)) => n.parse()?,
        _ => 0,
    };
    let (events, report) = read_file(&file)?;
    println!("{file}: {}", report.summary());

    let trace = format!("{file}.trace.json");
    std::fs::write(&trace, serde_json::to_vec(&stagehand_exporter::trace::to_chrome_trace(&events))?)?;
    println!("perfetto   open {trace} in ui.perfetto.dev or chrome://tracing");

    let server = stagehand_web::Server::replay(&file, "127.0.0.1:0")?;
    println!("dashboard  {}/ (replay controls at the top; POST {}/api/replay/play to start)", server.url(), server.url());
    println!("terminal   stagehand-top --replay {file}");
    std::thread::sleep(std::time::Duration::from_secs(serve_secs));
    server.shutdown()?;
    Ok(())
}
