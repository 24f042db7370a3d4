//! What stream clients cost the run and the machine. Prints figures; asserts nothing.
//!
//! 1. A CPU-bound "training" loop (fixed arithmetic per step, then the step's events published
//!    on a bus) with 0, 50 and 200 SSE clients reading the full stream: steps per second, and
//!    how many events the bus dropped.
//! 2. Memory with 1000 WebSocket clients that connect and never read: resident set size before,
//!    while they are connected during a run, and after they left.
//! 3. `watchers`: a run shaped like a training job's host side (each step publishes a full
//!    step's events, then works on every core at once, as the host optimizer does, then on the
//!    training thread alone) with no client, then with 50 SSE and 50 WebSocket clients reading
//!    the full stream from another process, alternating; then the same with 8 clients polling
//!    `/api/snapshot` as fast as they can. Prints the step time of each, their ratio, and where
//!    the CPU went (the training threads, the event dispatcher, the server's threads, the
//!    readers' process).
//!
//! Run: `cargo bench -p stagehand-web --bench clients` (or `-- watchers`, `-- training`, `--
//! memory` for one part).

use stagehand_events::bus::DEFAULT_QUEUE_CAPACITY;
use stagehand_events::model::{EventKind, Phase};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::{Bus, Event, Hub};
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

/// CPU time (user + system) so far, in seconds, of this process's threads by name (threads of
/// one name summed), from `/proc/self/task/*/stat`.
fn cpu_by_thread() -> std::collections::BTreeMap<String, f64> {
    let tick = 100.0; // USER_HZ on Linux
    let mut out = std::collections::BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let name = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks: f64 = fields.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
            + fields.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
        *out.entry(name).or_insert(0.0) += ticks / tick;
    }
    out
}

/// CPU time so far of another process (its threads, finished ones included), in seconds.
fn cpu_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let f = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (f(11) + f(12)) / 100.0
}

/// The readers' process: `clients readers ADDR SSE WS POLL` opens that many streams and reads
/// them (discarding what comes), and has POLL clients ask for `/api/snapshot` again and again on
/// kept-alive connections, until killed.
fn readers(addr: &str, sse: usize, ws: usize, poll: usize) {
    let addr: SocketAddr = addr.parse().expect("an address");
    let mut threads = Vec::new();
    for _ in 0..sse {
        threads.push(std::thread::spawn(move || {
            let Ok(mut s) = TcpStream::connect(addr) else { return };
            let _ = write!(s, "GET /api/stream HTTP/1.1\r\nhost: {addr}\r\n\r\n");
            let mut buf = vec![0u8; 64 * 1024];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        }));
    }
    for _ in 0..ws {
        threads.push(std::thread::spawn(move || {
            let Ok((mut c, _)) = tungstenite::connect(format!("ws://{addr}/api/ws")) else { return };
            while c.read().is_ok() {}
        }));
    }
    for _ in 0..poll {
        threads.push(std::thread::spawn(move || {
            let Ok(s) = TcpStream::connect(addr) else { return };
            let mut r = std::io::BufReader::new(s.try_clone().expect("clone"));
            let mut w = s;
            let mut body = Vec::new();
            loop {
                if write!(w, "GET /api/snapshot HTTP/1.1\r\nhost: {addr}\r\n\r\n").is_err() {
                    return;
                }
                let mut len = 0usize;
                loop {
                    let mut line = String::new();
                    match std::io::BufRead::read_line(&mut r, &mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    if line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
                body.resize(len, 0);
                if r.read_exact(&mut body).is_err() {
                    return;
                }
            }
        }));
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    for t in threads {
        let _ = t.join();
    }
}

/// Work on every core at once: `cores` threads of `units` each, all waited for (a barrier,
/// as a parallel optimizer step is).
fn on_every_core(cores: usize, units: u64) -> f64 {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..cores).map(|_| s.spawn(move || work(units))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    })
}

/// One run of the job-shaped loop: mean step time (s), events published, dropped (both so far).
fn job(bus: &Bus, groups: &[Vec<Event>], repeat: usize, cores: usize) -> (f64, u64, u64) {
    let mut sink = 0.0;
    let t = Instant::now();
    for g in groups {
        // A full step's events: the synthetic step's, several times over (a real model has
        // more blocks and copies than the synthetic one).
        for _ in 0..repeat {
            for e in g {
                match e.kind.clone() {
                    EventKind::PhaseChanged { to, .. } => bus.enter_phase(e.step, to),
                    kind => bus.publish(kind),
                }
            }
        }
        sink += on_every_core(cores, WORK_PER_STEP / 2);
        sink += work(WORK_PER_STEP / 4);
    }
    let dt = t.elapsed().as_secs_f64() / groups.len() as f64;
    bus.flush();
    std::hint::black_box(sink);
    (dt, bus.published(), bus.dropped())
}

/// The job alone and watched, alternating: medians, and the CPU of each thread group a watched
/// step costs.
fn watched(server: &stagehand_web::ServerHandle, bus: &Bus, groups: &[Vec<Event>], what: &str, clients: [usize; 3]) {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let addr = server.addr();
    let repeat = 4;
    let exe = std::env::current_exe().expect("this program");
    // Rounds alternate between no client and the clients, so the machine's drift touches both.
    let rounds = 5;
    let (mut alone, mut watched) = (Vec::new(), Vec::new());
    let mut cpu: std::collections::BTreeMap<&str, f64> = Default::default();
    let mut reader_cpu = 0.0;
    let streams = clients[0] + clients[1];
    for _ in 0..rounds {
        let (dt, _, _) = job(bus, groups, repeat, cores);
        alone.push(dt);
        let [sse, ws, poll] = clients.map(|n| n.to_string());
        let mut child = std::process::Command::new(&exe)
            .args(["readers", &addr.to_string(), &sse, &ws, &poll])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the readers start");
        let mut ready = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let _ = std::io::BufRead::read_line(&mut out, &mut ready);
        let deadline = Instant::now() + Duration::from_secs(30);
        while server.stream_clients() < streams && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let before = cpu_by_thread();
        let (process_before, child_before) = (cpu_of(std::process::id()), cpu_of(child.id()));
        let (dt, _, dropped) = job(bus, groups, repeat, cores);
        let after = cpu_by_thread();
        reader_cpu += cpu_of(child.id()) - child_before;
        watched.push(dt);
        // The training's own threads end with each step: theirs is the process's less the rest.
        let mut rest = 0.0;
        for (name, t) in &after {
            let group = if name.starts_with("stagehand-web") {
                "server threads"
            } else if name.starts_with("stagehand-even") {
                "event dispatcher"
            } else {
                continue;
            };
            let used = t - before.get(name).copied().unwrap_or(0.0);
            rest += used;
            *cpu.entry(group).or_insert(0.0) += used;
        }
        *cpu.entry("training threads").or_insert(0.0) += cpu_of(std::process::id()) - process_before - rest;
        if dropped > 0 {
            println!("  {dropped} events dropped so far");
        }
        let _ = child.kill();
        let _ = child.wait();
        while server.stream_clients() > 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // Medians: the machine may be shared, and a round can be slowed by anything.
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, w) = (median(&alone), median(&watched));
    let steps = (groups.len() * rounds) as f64;
    println!(
        "watchers: {cores} cores; median step {:.2} ms alone, {:.2} ms with {what}: {:.3}x the speed alone",
        a * 1e3,
        w * 1e3,
        a / w
    );
    println!("  rounds alone   {:?} ms", alone.iter().map(|t| (t * 1e5).round() / 1e2).collect::<Vec<_>>());
    println!("  rounds watched {:?} ms", watched.iter().map(|t| (t * 1e5).round() / 1e2).collect::<Vec<_>>());
    println!("  CPU per watched step:");
    for (group, t) in &cpu {
        println!("    {group:<18} {:>7.2} ms", t * 1e3 / steps);
    }
    println!("    {:<18} {:>7.2} ms (another process)", "readers", reader_cpu * 1e3 / steps);
    println!("  {} events a step", groups.iter().map(Vec::len).sum::<usize>() * repeat / groups.len());
}

fn watchers() {
    let (hub, server) = server(256);
    // One bus for every round: its dispatcher thread lives on and is measured.
    let bus = Bus::with_hub(hub.clone(), DEFAULT_QUEUE_CAPACITY);
    let groups = steps();
    watched(&server, &bus, &groups, "50 SSE + 50 WebSocket readers", [50, 50, 0]);
    watched(&server, &bus, &groups, "8 clients polling /api/snapshot", [0, 0, 8]);
    drop(server);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    if let [_, mode, addr, sse, ws, poll, ..] = args.as_slice() {
        if mode == "readers" {
            readers(addr, sse.parse().unwrap_or(0), ws.parse().unwrap_or(0), poll.parse().unwrap_or(0));
            return;
        }
    }
    if args.iter().any(|a| a == "watchers") {
        watchers();
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
