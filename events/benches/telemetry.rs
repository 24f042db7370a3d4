//! Telemetry figures: bytes per step at each level, the cost of a publish with every sink
//! attached, and how fast a large telemetry file replays (first screen, seeks).
//!
//! Run: `cargo bench -p stagehand-events --features synthetic --bench telemetry`.
//! `STAGEHAND_BENCH_REPLAY_MB` sets the size of the replayed file (default 1024);
//! `STAGEHAND_BENCH_DEMO_FILE` names a full-level file of the real demo to measure its summary
//! size per step.

use stagehand_events::jsonl::{self, JsonlSink, OpenMode};
use stagehand_events::replay::FileReplay;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::telemetry::{self, FlightConfig, Level, LevelFilter, TelemetryConfig};
use stagehand_events::{Bus, EventKind, EventSink, Phase};
use std::path::Path;
use std::time::{Duration, Instant};

/// Blocks of the synthetic run whose step has about the demo's event mix (about 1,900 events a
/// step: residency, copies, slabs, packs, spills, restores, Conductor decisions).
const DEMO_BLOCKS: u32 = 64;
const STEPS: u64 = 20;

fn demo_run(steps: u64) -> SyntheticRun {
    SyntheticRun { blocks: DEMO_BLOCKS, steps, end_mid_step: false }
}

fn file_len(paths: &[std::path::PathBuf]) -> u64 {
    paths.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum()
}

fn size_per_step(dir: &Path) {
    let events = synthetic::events(demo_run(STEPS));
    let per_step = events.iter().filter(|e| e.step == 2).count();
    println!("telemetry size, synthetic demo-shaped run: {per_step} events a step, {STEPS} steps");
    for (level, compress) in [(Level::Full, false), (Level::Full, true), (Level::Summary, false), (Level::Summary, true)] {
        let name = format!("size-{}-{compress}.jsonl{}", level.as_str(), if compress { ".zst" } else { "" });
        let bus = Bus::new();
        let t = telemetry::attach(
            &bus,
            TelemetryConfig {
                level,
                path: Some(dir.join(name)),
                compress,
                flight_recorder: FlightConfig { enabled: false, ..Default::default() },
                ..Default::default()
            },
        )
        .expect("attach");
        synthetic::publish(demo_run(STEPS), &bus, Duration::ZERO);
        bus.close();
        let bytes = file_len(&t.paths());
        if level == Level::Summary && !compress {
            let (events, _) = jsonl::read_file(&t.paths()[0]).expect("reads");
            let mut by_kind = std::collections::BTreeMap::<&str, (u64, u64)>::new();
            for e in &events {
                let n = serde_json::to_string(e).map_or(0, |s| s.len() as u64 + 1);
                let k = by_kind.entry(e.kind.name()).or_default();
                k.0 += 1;
                k.1 += n;
            }
            let mut v: Vec<_> = by_kind.into_iter().collect();
            v.sort_by_key(|(_, (_, b))| std::cmp::Reverse(*b));
            let top: Vec<String> = v.iter().take(8).map(|(k, (n, b))| format!("{k} {n}x {:.1} KB", *b as f64 / 1e3)).collect();
            println!("  summary keeps: {}", top.join(", "));
        }
        println!(
            "  {:<8} {:<5}: {:>9} bytes, {:>8.1} KB a step",
            level.as_str(),
            if compress { "zstd" } else { "plain" },
            bytes,
            bytes as f64 / STEPS as f64 / 1000.0
        );
    }
    if let Ok(demo) = std::env::var("STAGEHAND_BENCH_DEMO_FILE") {
        let (events, _) = jsonl::read_file(&demo).expect("the demo file reads");
        let steps = events.iter().map(|e| e.step).max().unwrap_or(1).max(1);
        let mut filter = LevelFilter::new(Level::Summary);
        let (mut full, mut summary) = (0usize, 0usize);
        let mut kept = Vec::new();
        for e in &events {
            let n = serde_json::to_string(e).map_or(0, |s| s.len() + 1);
            full += n;
            if filter.keeps(e) {
                summary += n;
                kept.push(e.clone());
            }
        }
        // Whether the runtimes' step aggregates are the sums of their detail events: then the
        // summary replays to the same totals as the full file.
        let a = stagehand_events::Snapshot::from_events(&events);
        let b = stagehand_events::Snapshot::from_events(&kept);
        let pairs = [
            ("weights.prefetch_hits", a.weights.prefetch_hits as f64, b.weights.prefetch_hits as f64),
            ("weights.prefetch_misses", a.weights.prefetch_misses as f64, b.weights.prefetch_misses as f64),
            ("weights.evictions", a.weights.evictions as f64, b.weights.evictions as f64),
            ("weights.h2d_bytes", a.weights.h2d_bytes as f64, b.weights.h2d_bytes as f64),
            ("weights.d2h_bytes", a.weights.d2h_bytes as f64, b.weights.d2h_bytes as f64),
            ("weights.stall_time_ms", a.weights.stall_time_ms, b.weights.stall_time_ms),
            ("activations.saved", a.activations.counts.saved as f64, b.activations.counts.saved as f64),
            ("activations.spilled", a.activations.counts.spilled as f64, b.activations.counts.spilled as f64),
            ("activations.restored", a.activations.counts.restored as f64, b.activations.counts.restored as f64),
            ("activations.spill_bytes", a.activations.counts.spill_bytes as f64, b.activations.counts.spill_bytes as f64),
            ("conductor.grants", a.conductor.grants as f64, b.conductor.grants as f64),
            ("conductor.slot_grants", a.conductor.slot_grants as f64, b.conductor.slot_grants as f64),
            ("transfers.h2d.bytes", a.transfers.h2d.bytes as f64, b.transfers.h2d.bytes as f64),
            ("transfers.d2h.count", a.transfers.d2h.count as f64, b.transfers.d2h.count as f64),
        ];
        let differ: Vec<String> = pairs
            .iter()
            .filter(|(_, x, y)| x != y)
            .map(|(k, x, y)| format!("{k} full {x} summary {y}"))
            .collect();
        println!(
            "  real demo: step records {}; totals {}",
            if a.steps == b.steps { "agree" } else { "DIFFER" },
            if differ.is_empty() { "agree".to_owned() } else { format!("DIFFER: {}", differ.join("; ")) }
        );
        println!(
            "  real demo ({demo}, {steps} steps, {} events a step): full {:.1} KB a step, summary {:.1} KB a step",
            events.len() as u64 / steps,
            full as f64 / steps as f64 / 1000.0,
            summary as f64 / steps as f64 / 1000.0
        );
    }
}

/// Mean cost of a publish on the training thread with every sink attached: a full JSONL file, a
/// compressed summary file with the flight recorder (its default configuration) and the
/// snapshot.
fn publish_cost(dir: &Path) {
    let bus = Bus::new();
    let _full = telemetry::attach(
        &bus,
        TelemetryConfig { level: Level::Full, path: Some(dir.join("pub-full.jsonl")), ..Default::default() },
    )
    .expect("attach full");
    let _summary = telemetry::attach(
        &bus,
        TelemetryConfig {
            level: Level::Summary,
            path: Some(dir.join("pub-summary.jsonl.zst")),
            compress: true,
            ..Default::default()
        },
    )
    .expect("attach summary");
    // One demo-shaped step's kinds, published again and again in bursts, as a training step does.
    let step: Vec<EventKind> = synthetic::events(demo_run(2))
        .into_iter()
        .filter(|e| e.step == 2 && !matches!(e.kind, EventKind::PhaseChanged { .. }))
        .map(|e| e.kind)
        .collect();
    bus.enter_phase(1, Phase::Forward);
    let mut spent = Duration::ZERO;
    let mut n = 0u64;
    for round in 0..200 {
        let kinds: Vec<EventKind> = step.clone();
        let t0 = Instant::now();
        for k in kinds {
            bus.publish(k);
        }
        spent += t0.elapsed();
        n += step.len() as u64;
        if round % 10 == 0 {
            bus.flush();
        }
    }
    bus.flush();
    println!(
        "publish with every sink attached (full file, zstd summary file + flight recorder, snapshot): {:.0} ns a publish over {n} publishes ({} dropped)",
        spent.as_nanos() as f64 / n as f64,
        bus.dropped()
    );
    bus.close();
}

/// Writes a plain telemetry file of about `mib` MiB from the synthetic run.
fn big_file(path: &Path, mib: u64) -> (u64, u64) {
    let mut sink = JsonlSink::open(path, OpenMode::CreateNew).expect("opens");
    let one = synthetic::events(demo_run(50));
    let (mut seq, mut t_ns, mut step, mut n) = (0u64, 0u64, 0u64, 0u64);
    let bytes_per_round = one.iter().map(|e| serde_json::to_string(e).map_or(0, |s| s.len() + 1) as u64).sum::<u64>();
    let rounds = (mib << 20).div_ceil(bytes_per_round).max(1);
    for r in 0..rounds {
        let last_t = one.last().map_or(0, |e| e.t_ns);
        for e in &one {
            if r > 0 && matches!(e.kind, EventKind::RunStarted { .. }) {
                continue;
            }
            let mut e = e.clone();
            seq += 1;
            e.seq = seq;
            e.t_ns += t_ns;
            e.step += step;
            sink.on_event(&e);
            n += 1;
        }
        t_ns += last_t;
        step += 50;
    }
    sink.flush();
    drop(sink);
    (std::fs::metadata(path).map_or(0, |m| m.len()), n)
}

/// Peak resident memory of this process so far, MiB (Linux; 0 elsewhere).
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `--follow` on an existing file: one poll reads it all, linearly.
fn follow_speed(dir: &Path) {
    let path = dir.join("follow.jsonl");
    let mut sink = JsonlSink::open(&path, OpenMode::CreateNew).expect("opens");
    let one = synthetic::events(demo_run(100));
    let mut n = 0u64;
    for e in one.iter().cycle().take(160_000) {
        n += 1;
        let mut e = e.clone();
        e.seq = n;
        sink.on_event(&e);
    }
    drop(sink);
    let t0 = Instant::now();
    let mut f = jsonl::Follower::open(&path).expect("opens");
    let got = f.poll().expect("polls").events.len();
    println!(
        "follow: first poll of an existing {n}-line file read {got} events in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
}

fn replay_speed(dir: &Path) {
    let mib: u64 = std::env::var("STAGEHAND_BENCH_REPLAY_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    let path = dir.join("big.jsonl");
    let t0 = Instant::now();
    let (bytes, events) = big_file(&path, mib);
    println!("replay: wrote {:.0} MB, {events} events in {:.1} s", bytes as f64 / 1e6, t0.elapsed().as_secs_f64());
    let before = peak_rss_mib();
    let t = Instant::now();
    let mut reader = jsonl::open(&path).expect("opens");
    let streamed = (&mut reader).filter(|e| e.is_ok()).count();
    println!(
        "stream read: {streamed} events in {:.1} s; peak resident memory {before:.0} MiB before, {:.0} MiB after ({})",
        t.elapsed().as_secs_f64(),
        peak_rss_mib(),
        reader.report().summary()
    );
    let t0 = Instant::now();
    let mut r = FileReplay::open(&path).expect("opens");
    r.step_events(2000).expect("first screen");
    let first = t0.elapsed();
    let ready = r.snapshot().blocks.len();
    // A seek while the index is still being built: forward into what is indexed so far.
    while r.checkpoints() < 4 && !r.indexed() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let t1 = Instant::now();
    r.seek(r.len() / 2).expect("seek while indexing");
    let early = t1.elapsed();
    r.wait_indexed();
    let indexed = t0.elapsed();
    let total = r.len();
    let mut worst = Duration::ZERO;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let target = (x % total as u64) as usize;
        let t = Instant::now();
        r.seek(target).expect("seek");
        worst = worst.max(t.elapsed());
    }
    let t = Instant::now();
    r.seek_fraction(0.999).expect("seek");
    r.to_start().expect("start");
    worst = worst.max(t.elapsed() / 2);
    println!(
        "replay of a {:.0} MB file: first screen (2000 events applied, {ready} blocks shown) {:.0} ms; a seek during indexing {:.0} ms; indexed {total} events ({} checkpoints) in {:.1} s; worst of 21 random seeks {:.0} ms",
        bytes as f64 / 1e6,
        first.as_secs_f64() * 1e3,
        early.as_secs_f64() * 1e3,
        r.checkpoints(),
        indexed.as_secs_f64(),
        worst.as_secs_f64() * 1e3
    );
    println!("peak resident memory after the replay: {:.0} MiB", peak_rss_mib());
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let dir = tempfile::tempdir().expect("tempdir");
    size_per_step(dir.path());
    publish_cost(dir.path());
    follow_speed(dir.path());
    replay_speed(dir.path());
}
