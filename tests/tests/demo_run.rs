//! A real tch training run (the demo's loop) on the host device, or on CUDA where present,
//! drives runtime -> bus -> JSONL file, the HTTP stream, `/metrics`, the snapshot and the
//! terminal UI's state (live from the server, and replaying the file); all of them must agree
//! with each other and with the run's own counts, and the loss must fall.

use stagehand::device::Device;
use stagehand_dashboard::app::State as TuiState;
use stagehand_dashboard::source::{stream_url, Backoff, LiveSource, ReplaySource, Source};
use stagehand::events::jsonl::{read_file, JsonlSink, OpenMode};
use stagehand::events::{
    Bus, Direction, EventKind, Hub, Phase, PolicyRule, Snapshot, StreamMessage,
};
use stagehand_examples::trainer::{announce, demo_budget, train, TrainConfig, DEMO_DEFAULTS};
use stagehand_web::Server;
use std::io::{BufRead, BufReader};
use std::sync::Arc;

/// Reads `/api/stream` until `run_ended`, applying every message as a client does.
fn follow_stream(url: String) -> std::thread::JoinHandle<(Snapshot, u64, u64)> {
    std::thread::spawn(move || {
        let resp = ureq::get(&format!("{url}/api/stream"))
            .call()
            .expect("stream opens");
        let reader = BufReader::new(resp.into_reader());
        let (mut snap, mut events, mut lagged) = (None::<Snapshot>, 0u64, 0u64);
        let mut name = String::new();
        for line in reader.lines() {
            let line = line.expect("stream line");
            if let Some(n) = line.strip_prefix("event:") {
                name = n.trim().to_owned();
            } else if let Some(data) = line.strip_prefix("data:") {
                let msg: StreamMessage = serde_json::from_str(data.trim()).expect("message");
                assert_eq!(msg.name(), name);
                match msg {
                    StreamMessage::Snapshot { snapshot } => snap = Some(*snapshot),
                    StreamMessage::Lagged { .. } => lagged += 1,
                    StreamMessage::Event { event } => {
                        events += 1;
                        let s = snap.as_mut().expect("snapshot first");
                        s.apply(&event);
                        if s.ended {
                            break;
                        }
                    }
                }
            }
        }
        (snap.expect("a snapshot arrived"), events, lagged)
    })
}

#[test]
fn demo_run_agrees_across_every_consumer() {
    stagehand::torch::init();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run.jsonl");
    // Small enough that weights stream (an eighth of it for resident weights) and activations
    // spill (above half of it).
    let device = Device::auto(4 << 20);
    // On CUDA, 4 MiB above what libtorch keeps for itself (cuBLAS's workspaces).
    let budget = demo_budget(&device, Some(4 << 20)).expect("budget").expect("a budget");

    let hub = Arc::new(Hub::new());
    hub.add_sink(Box::new(JsonlSink::open(&path, OpenMode::CreateNew).expect("sink")));
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("server");
    let stream = follow_stream(server.url());
    // Let the client subscribe before the run starts, so it sees the run from its first event.
    while server.stream_clients() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // stagehand-top's live source, on the real server.
    let mut tui_live = LiveSource::connect(
        stream_url(Some(&server.url())).expect("stream url"),
        Backoff::default(),
    );
    let bus = Bus::with_hub(hub.clone(), stagehand::events::bus::DEFAULT_QUEUE_CAPACITY);

    let cfg = TrainConfig::demo(60, 4, 64, 32, 16, budget);
    announce(&bus, &cfg, &device, "e2e");
    let summary = train(&cfg, &device, &bus, |_, _, _| {}).expect("training runs");
    bus.flush();

    // The run's own counts.
    assert_eq!(summary.steps, 60);
    let (first, last) = summary.loss_drop();
    assert!(last < first * 0.8, "loss must fall: {first:.3} -> {last:.3}");

    // The hub's snapshot.
    let live = hub.snapshot();
    assert!(live.ended);
    // Streaming and spilling really happened, and the events count what the runtimes counted.
    assert!(summary.activations_spilled > 0, "activations spilled");
    assert_eq!(live.activations.counts.spilled, summary.activations_spilled);
    assert_eq!(live.activations.counts.spill_bytes, summary.spill_bytes);
    assert_eq!(live.activations.counts.restored, live.activations.counts.spilled, "every spill came back");
    assert!(live.transfers.h2d.bytes > 0 && live.weights.evictions > 0, "weights streamed");
    // The model's repeated structure makes the blocks: one per transformer block, plus the
    // embeddings and the head.
    assert_eq!(live.blocks.len(), 4 + 3, "{:?}", live.blocks.iter().map(|b| &b.name).collect::<Vec<_>>());
    assert!(live.blocks.iter().any(|b| b.name == "blocks.3"));
    // Steady state: prefetch hits, nothing through pageable memory.
    let steady = |f: &dyn Fn(&stagehand::events::snapshot::StepRecord) -> u64| {
        live.steps.iter().filter(|r| r.step > 1).map(f).sum::<u64>()
    };
    let hits = steady(&|r| r.weights.as_ref().map_or(0, |w| w.prefetch_hits));
    let misses = steady(&|r| r.weights.as_ref().map_or(0, |w| w.prefetch_misses));
    assert!(hits > 0 && misses == 0, "{hits} hits, {misses} misses after step 1: every load is prefetched");
    assert_eq!(steady(&|r| r.activations.as_ref().map_or(0, |a| a.pool_misses)), 0, "pageable spills after step 1");
    assert!(live.steps.iter().all(|r| r.step == 0 || r.time.is_some()), "a time breakdown per step");
    assert!(live.conductor.hint_changes > 0, "the Conductor set hints");
    let peak_seen = live
        .vram_history
        .iter()
        .map(|r| r.peak_allocated_bytes)
        .max()
        .unwrap_or(0);
    assert_eq!(peak_seen, summary.peak_bytes, "the VRAM samples carry the run's peak");
    assert_eq!(live.dropped_events, 0);
    let trained: Vec<u64> = live.steps.iter().filter(|r| r.train.is_some()).map(|r| r.step).collect();
    assert_eq!(trained, (1..=60).collect::<Vec<_>>());
    let loss_of = |s: &Snapshot, step: u64| s.step_record(step).and_then(|r| r.train.as_ref()).map(|t| t.loss);
    assert_eq!(loss_of(&live, 60), summary.losses.last().copied());

    // The HTTP stream, applied client-side, reaches the same picture.
    let (streamed, events, lagged) = stream.join().expect("stream reader");
    assert_eq!(lagged, 0, "a fast client on loopback does not lag");
    assert!(events > 60 * 5, "{events} events streamed");
    assert_eq!(streamed.last_seq, live.last_seq);
    assert_eq!(streamed.steps, live.steps);
    assert_eq!(streamed.event_counts, live.event_counts);

    // The JSONL file replays to the same snapshot.
    let (recorded, report) = read_file(&path).expect("telemetry file");
    assert_eq!(report.skipped_total, 0);
    // The Conductor's rules fire in the event stream: optimizer protection in every step's
    // optimizer phase, and the reset at the next step's begin.
    let rule_count = |rule: PolicyRule, phase: Phase| {
        recorded
            .iter()
            .filter(|e| e.phase == phase)
            .filter(|e| matches!(&e.kind, EventKind::HintsChanged { rule: r, .. } if *r == rule))
            .count()
    };
    assert_eq!(rule_count(PolicyRule::OptimizerProtection, Phase::Optimizer), 60);
    assert_eq!(rule_count(PolicyRule::Reset, Phase::StepBegin), 59);
    // Every copy of both runtimes took a Conductor slot: in each step the H2D bytes the slots
    // recorded are the bytes the runtimes reported copied host-to-device (the weights' final
    // reap, after the last step's metrics, excepted), and a required copy was never refused.
    for step in 1..=60u64 {
        let in_step = |e: &&stagehand::events::Event| e.step == step && e.phase != Phase::StepEnd;
        let m = recorded
            .iter()
            .filter(|e| e.step == step)
            .find_map(|e| match &e.kind {
                EventKind::ConductorStep(m) => Some(m.clone()),
                _ => None,
            })
            .expect("a conductor_step per step");
        let copied: u64 = recorded
            .iter()
            .filter(in_step)
            .filter_map(|e| match &e.kind {
                EventKind::TransferCompleted { dir: Direction::H2d, bytes, .. } => Some(*bytes),
                _ => None,
            })
            .sum();
        let issued = recorded
            .iter()
            .filter(in_step)
            .filter(|e| matches!(e.kind, EventKind::TransferIssued { .. }))
            .count() as u64;
        assert!(copied > 0, "step {step} streamed weights");
        assert_eq!(m.h2d_bytes, copied, "step {step}: {m:?}");
        assert!(m.slot_grant_count >= issued, "step {step}: {} grants, {issued} copies", m.slot_grant_count);
    }
    for e in &recorded {
        if let EventKind::SlotDenied { speculative, .. } = &e.kind {
            assert!(speculative, "a required copy was refused: {e:?}");
        }
    }
    assert_eq!(Snapshot::from_events(&recorded), live);

    // /api/snapshot serves it.
    let api: Snapshot = serde_json::from_reader(
        ureq::get(&format!("{}/api/snapshot", server.url()))
            .call()
            .expect("snapshot route")
            .into_reader(),
    )
    .expect("snapshot json");
    assert_eq!(api, live);

    // /metrics counts the same steps and events.
    let text = ureq::get(&format!("{}/metrics", server.url()))
        .call()
        .expect("metrics route")
        .into_string()
        .expect("metrics text");
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("prometheus text format");
    let value = |name: &str| {
        scrape
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
                prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum::<f64>()
    };
    assert_eq!(value("stagehand_step"), 60.0, "{text}");
    assert_eq!(value("stagehand_events_total"), live.events_applied as f64);
    assert!(
        (value("stagehand_loss") - summary.losses[59]).abs() < 1e-9,
        "loss gauge"
    );

    // stagehand-top's state, fed live by the server, reaches the same picture...
    let mut tui = TuiState::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut updates = Vec::new();
    while !(tui.snapshot.ended && tui.snapshot.last_seq == live.last_seq) {
        assert!(std::time::Instant::now() < deadline, "the live TUI source caught up");
        tui_live.poll(std::time::Instant::now(), &mut updates);
        for u in updates.drain(..) {
            tui.ingest(u);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(tui.snapshot.steps, live.steps);
    assert_eq!(tui.snapshot.event_counts, live.event_counts);

    // ...and so does its replay of the file, played to the end.
    let mut replay = ReplaySource::open(&path, false).expect("replay source");
    let mut tui_replay = TuiState::new();
    replay.control(stagehand_dashboard::app::Control::ToEnd, &mut updates);
    replay.poll(std::time::Instant::now(), &mut updates);
    for u in updates.drain(..) {
        tui_replay.ingest(u);
    }
    assert_eq!(tui_replay.snapshot, live);
    server.shutdown().expect("shutdown");
}

/// The demo with no flags is the first thing users see: after the traced first step every weight
/// load is prefetched in time and no spill falls back to pageable memory (whose pinned pool is
/// sized from what the first step held at once, whatever that is next to the device's room).
#[test]
fn the_demos_defaults_show_the_system_working_as_designed() {
    stagehand::torch::init();
    let d = DEMO_DEFAULTS;
    let device = Device::auto(d.budget_mib << 20);
    let budget = demo_budget(&device, Some(d.budget_above(&device))).expect("budget").expect("a default");
    let hub = Arc::new(Hub::new());
    let bus = Bus::with_hub(hub.clone(), stagehand::events::bus::DEFAULT_QUEUE_CAPACITY);
    // Steps enough that a race between the host optimizer and the next step's first load would
    // show (it missed in most steps before the scheduler waited for it at prefetch).
    let cfg = TrainConfig::demo(8, d.layers, d.d_model, d.seq, d.batch, budget);
    announce(&bus, &cfg, &device, "defaults");
    let summary = train(&cfg, &device, &bus, |_, _, _| {}).expect("training runs");
    bus.flush();
    let live = hub.snapshot();
    assert!(summary.activations_spilled > 0, "the defaults spill");
    let steady: Vec<_> = live.steps.iter().filter(|r| r.step > 1).collect();
    assert_eq!(steady.len(), 7, "{:?}", live.steps.iter().map(|r| r.step).collect::<Vec<_>>());
    let first = live.steps.iter().find(|r| r.step == 1).and_then(|r| r.activations.clone());
    let warnings: Vec<&str> = live.warnings.iter().map(|w| w.message.as_str()).collect();
    for r in steady {
        let w = r.weights.as_ref().expect("weights streamed");
        assert!(w.prefetch_hits > 0 && w.prefetch_misses == 0, "step {}: {w:?}", r.step);
        let a = r.activations.as_ref().expect("activations");
        assert!(a.activations_spilled > 0, "step {} spilled", r.step);
        assert_eq!(
            (a.pool_misses, a.pageable_bytes),
            (0, 0),
            "step {}: pageable spills {a:?}; step 1: {first:?}; warnings: {warnings:?}",
            r.step
        );
    }
    assert!(!live.warnings.iter().any(|w| w.message.contains("pinned limit")), "{:?}", live.warnings);
    // Every step, the first included, stays under the budget (on CUDA, temporaries included).
    let peaks: Vec<(u64, u64)> =
        live.steps.iter().filter_map(|r| r.train.as_ref().map(|t| (r.step, t.vram_peak_bytes))).collect();
    assert_eq!(peaks.len(), 8);
    assert!(peaks.iter().all(|&(_, p)| p <= budget), "peaks {peaks:?} over the {budget} budget; {warnings:?}");
    assert!(!warnings.iter().any(|w| w.contains("over the")), "{warnings:?}");
}
