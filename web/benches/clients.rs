//! What stream clients cost the run and the machine. Prints figures; asserts nothing.
//!
//! 1. A CPU-bound "training" loop (fixed arithmetic per step, then the step's events published
//!    on a bus) with 0, 50 and 200 SSE clients reading the full stream: steps per second, and
//!    how many events the bus dropped.
//! 2. Memory with 1000 WebSocket clients that connect and never read: resident set size before,
//!    while they are connected during a run, and after they left.
//!
//! Run: `cargo bench -p stagehand-web --bench clients`

use stagehand::events::bus::DEFAULT_QUEUE_CAPACITY;
use stagehand::events::model::{EventKind, Phase};
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand::events::{Bus, Event, Hub};
use stagehand_exporter::Metrics;
use stagehand_web::{AppState, Server, ServerConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const STEPS: u64 = 60;
/// Floating-point work per step, standing in for the forward and backward pass.
const WORK_PER_STEP: u64 = 4_000_000;

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

fn work(n: u64) -> f64 {
    let mut x = 1.0f64;
    for i in 0..n {
        x = (x * 1.000_000_1 + i as f64 * 1e-9).sqrt() + 0.5;
    }
    x
}

fn server(max: usize) -> (Arc<Hub>, stagehand_web::ServerHandle) {
    let hub = Arc::new(Hub::new());
    let mut config = ServerConfig::new("127.0.0.1:0");
    config.max_connections = max;
    let server = Server::start(&config, AppState::live(hub.clone(), Metrics::new())).expect("starts");
    (hub, server)
}

/// An SSE client that reads everything until the run ends.
fn reader(addr: SocketAddr, ready: Arc<Barrier>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("connects");
        write!(s, "GET /api/stream HTTP/1.1\r\nhost: {addr}\r\n\r\n").expect("sends");
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        let n = s.read(&mut buf).expect("the snapshot");
        total += n as u64;
        ready.wait();
        let mut tail = Vec::new();
        loop {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            total += n as u64;
            tail.extend_from_slice(&buf[..n]);
            const END: &[u8] = b"\"kind\":\"run_ended\"";
            if tail.windows(END.len()).any(|w| w == END) {
                break;
            }
            let keep = tail.len().saturating_sub(END.len());
            tail.drain(..keep);
        }
        total
    })
}

/// The synthetic run's events grouped by step, for the training loop to publish.
fn steps() -> Vec<Vec<Event>> {
    let mut out: Vec<Vec<Event>> = vec![Vec::new()];
    for e in synthetic::events(SyntheticRun::finished(STEPS)) {
        let end = matches!(e.kind, EventKind::PhaseChanged { to: Phase::Idle, .. });
        out.last_mut().expect("a group").push(e);
        if end {
            out.push(Vec::new());
        }
    }
    out
}

fn training(clients: usize) {
    let (hub, server) = server(clients + 16);
    let ready = Arc::new(Barrier::new(clients + 1));
    let readers: Vec<_> = (0..clients).map(|_| reader(server.addr(), ready.clone())).collect();
    ready.wait();
    let bus = Bus::with_hub(hub.clone(), DEFAULT_QUEUE_CAPACITY);
    let groups = steps();
    let events: usize = groups.iter().map(Vec::len).sum();
    let t = Instant::now();
    let mut sink = 0.0;
    for g in &groups {
        sink += work(WORK_PER_STEP);
        for e in g {
            match e.kind.clone() {
                EventKind::PhaseChanged { to, .. } => bus.enter_phase(e.step, to),
                kind => bus.publish(kind),
            }
        }
    }
    let train = t.elapsed();
    bus.flush();
    let bytes: u64 = readers.into_iter().map(|r| r.join().unwrap_or(0)).sum();
    let all = t.elapsed();
    println!(
        "{clients:>4} SSE clients: {STEPS} steps in {:>7.1} ms = {:>6.1} steps/s; {events} events, {} dropped; \
         every client done after {:>7.1} ms, {:.1} MiB sent in all ({sink:.0})",
        train.as_secs_f64() * 1e3,
        STEPS as f64 / train.as_secs_f64(),
        bus.dropped(),
        all.as_secs_f64() * 1e3,
        bytes as f64 / (1 << 20) as f64,
    );
    drop(server);
}

fn stalled_websockets(n: usize) {
    let (hub, server) = server(n + 16);
    let addr = server.addr();
    let before = rss_mib();
    let clients: Vec<_> = (0..n)
        .filter_map(|_| tungstenite::connect(format!("ws://{addr}/api/ws")).ok())
        .collect();
    let connected = rss_mib();
    for e in synthetic::events(SyntheticRun::finished(STEPS)) {
        hub.ingest(e);
    }
    std::thread::sleep(Duration::from_secs(2));
    let during = rss_mib();
    let count = clients.len();
    drop(clients);
    std::thread::sleep(Duration::from_secs(3));
    let after = rss_mib();
    println!(
        "{count} WebSocket clients that never read: resident {before:.0} MiB before, {connected:.0} MiB connected, \
         {during:.0} MiB after a {STEPS}-step run ({:.1} KiB per client), {after:.0} MiB after they left",
        (during - before) * 1024.0 / count.max(1) as f64
    );
    drop(server);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let only = |name: &str| !args.iter().any(|a| a == "training" || a == "memory") || args.iter().any(|a| a == name);
    if only("training") {
        for clients in [0, 50, 200] {
            training(clients);
        }
    }
    if only("memory") {
        stalled_websockets(1000);
    }
}
