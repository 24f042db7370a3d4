//! `/metrics` text parsed back with a Prometheus text parser: names, types, units, labels and
//! values against the snapshot of the same events.

use prometheus_parse::{Scrape, Value};
use stagehand_events::model::{BlockState, Direction};
use stagehand_events::bus::feed;
use stagehand_events::Snapshot;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_exporter::{DeviceLabels, Metrics, CATALOG};
use std::collections::BTreeMap;

fn scrape(text: &str) -> Scrape {
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses")
}

fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
        .map(|x| match &x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            other => panic!("{name} is not a scalar: {other:?}"),
        })
        .collect();
    assert!(!found.is_empty(), "no sample {name}{labels:?}");
    found.iter().sum()
}

#[test]
fn metrics_parse_back_with_prometheus_names_types_and_values() {
    let events = synthetic::events(SyntheticRun::finished(4));
    let snap = Snapshot::from_events(&events);
    let mut sink = Metrics::new();
    feed(&mut sink, &events);
    let text = sink.render().expect("renders");
    let s = scrape(&text);
    assert!(s.samples.len() > 50, "{} samples", s.samples.len());

    // Declared types, straight from the `# TYPE` lines.
    let types: BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    for d in CATALOG {
        let name = d.prometheus_name();
        assert_eq!(types.get(name.as_str()), Some(&d.kind.prometheus_type()), "{name} declared as {:?}", types.get(name.as_str()));
    }
    for (name, ty) in &types {
        assert!(name.starts_with("stagehand_"), "{name} lacks the prefix");
        match *ty {
            "counter" => assert!(name.ends_with("_total"), "counter {name} must end in _total"),
            "histogram" => assert!(name.ends_with("_seconds"), "histogram {name} must be in seconds"),
            "gauge" => assert!(!name.ends_with("_total"), "gauge {name} must not end in _total"),
            other => panic!("{name}: unexpected type {other}"),
        }
        // Units: byte and time quantities are in base units.
        assert!(!name.contains("_ms") && !name.contains("_mb") && !name.contains("_kb"), "{name}");
    }
    // Parser's view of types agrees with the declaration.
    for x in &s.samples {
        let declared = types.get(x.metric.as_str()).copied();
        match (&x.value, declared) {
            (Value::Counter(_), Some("counter"))
            | (Value::Gauge(_), Some("gauge"))
            | (Value::Histogram(_), Some("histogram")) => {}
            // `_sum` and `_count` of histograms.
            (Value::Untyped(_), None) if x.metric.ends_with("_sum") || x.metric.ends_with("_count") => {}
            (v, d) => panic!("{} parsed as {v:?} but declared {d:?}", x.metric),
        }
        assert_eq!(x.labels.get("device"), Some("0"), "{}", x.metric);
        assert_eq!(x.labels.get("device_name"), Some("host (simulated)"), "{}", x.metric);
        for (k, v) in x.labels.iter() {
            assert!(!["block", "tensor", "id", "block_id", "tensor_id", "name", "subject"].contains(&k.as_str()),
                "{}: per-object label {k}", x.metric);
            assert!(!v.starts_with("blocks.") && !v.starts_with("tensor "), "{}: label value {v}", x.metric);
        }
    }

    // Values agree with the reducer.
    assert_eq!(value(&s, "stagehand_prefetch_hits_total", &[]), snap.weights.prefetch_hits as f64);
    assert_eq!(value(&s, "stagehand_prefetch_misses_total", &[]), snap.weights.prefetch_misses as f64);
    assert_eq!(value(&s, "stagehand_evictions_total", &[]), snap.weights.evictions as f64);
    for d in [Direction::H2d, Direction::D2h] {
        assert_eq!(
            value(&s, "stagehand_transfer_bytes_total", &[("direction", d.as_str())]),
            snap.transfers.dir(d).bytes as f64
        );
    }
    let counts = snap.residency_counts();
    for st in BlockState::ALL {
        assert_eq!(
            value(&s, "stagehand_residency_blocks", &[("state", st.as_str())]),
            counts.get(&st).copied().unwrap_or(0) as f64,
            "{st}"
        );
    }
    let vram = snap.vram.expect("vram sampled");
    assert_eq!(value(&s, "stagehand_vram_bytes", &[("kind", "allocated")]), vram.allocated_bytes as f64);
    assert_eq!(value(&s, "stagehand_vram_bytes", &[("kind", "peak")]), vram.peak_allocated_bytes as f64);
    // Limits are their own metric, by owner: readings and limits never share a series.
    assert_eq!(
        value(&s, "stagehand_memory_limit_bytes", &[("owner", "activations"), ("limit", "high")]),
        snap.spill_watermarks().map_or(0, |w| w.0) as f64
    );
    assert_eq!(
        value(&s, "stagehand_memory_limit_bytes", &[("owner", "device"), ("limit", "budget")]),
        snap.vram_budget_bytes().unwrap_or(0) as f64
    );
    assert!(!s.samples.iter().any(|x| x.metric == "stagehand_vram_bytes"
        && !["allocated", "reserved", "peak"].contains(&x.labels.get("kind").unwrap_or(""))));
    // The step time breakdown: the last step's parts, and the parts summed over the steps.
    let last = snap.steps.iter().rev().find_map(|r| r.time).expect("a step time");
    assert!((value(&s, "stagehand_last_step_time_seconds", &[("part", "compute")]) - last.compute_ms / 1e3).abs() < 1e-12);
    let total: f64 = snap.steps.iter().filter_map(|r| r.time).map(|t| t.optimizer_ms / 1e3).sum();
    assert!((value(&s, "stagehand_step_time_seconds_total", &[("part", "optimizer")]) - total).abs() < 1e-9);
    // VRAM by owner, now and at the last finished step's peak.
    let owners = snap.vram_owners.expect("owners read").owners;
    assert_eq!(value(&s, "stagehand_vram_owner_bytes", &[("owner", "weights")]), owners.weights_bytes as f64);
    let peak = snap.steps.iter().rev().find(|r| r.train.is_some()).and_then(|r| r.vram_at_peak).expect("a peak");
    assert_eq!(value(&s, "stagehand_vram_at_peak_bytes", &[("owner", "other")]), peak.other_bytes as f64);
    assert_eq!(value(&s, "stagehand_activations_packed_total", &[("decision", "spilled")]), snap.activations.counts.spilled as f64);
    assert_eq!(value(&s, "stagehand_activation_restores_total", &[]), snap.activations.counts.restored as f64);
    let denials: u64 = snap.conductor.denials_by_reason.values().sum();
    assert_eq!(value(&s, "stagehand_conductor_denials_total", &[]), denials as f64);
    assert_eq!(value(&s, "stagehand_step", &[]), 4.0);
    assert_eq!(value(&s, "stagehand_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), 1.0);
    let pool = snap.activation_pool.as_ref().expect("pool");
    assert_eq!(
        value(&s, "stagehand_pool_capacity_bytes", &[("pool", "activations")]),
        pool.capacity_bytes() as f64
    );
    // Phase durations: one observation per phase per step.
    let fwd = s
        .samples
        .iter()
        .find(|x| x.metric == "stagehand_phase_duration_seconds" && x.labels.get("phase") == Some("forward"))
        .expect("forward histogram");
    match &fwd.value {
        Value::Histogram(b) => {
            let inf = b.iter().find(|c| c.less_than.is_infinite()).expect("+Inf bucket");
            assert_eq!(inf.count, 4.0);
        }
        v => panic!("{v:?}"),
    }
}

#[test]
fn host_optimizer_steps_count_the_blocks_given_during_backward() {
    let mut events = synthetic::events(SyntheticRun::finished(4));
    let mut steps = 0;
    for e in &mut events {
        if let stagehand_events::EventKind::WeightStep(w) = &mut e.kind {
            // The last step's figures claim more overlapped than stepped: counted as stepped.
            steps += 1;
            (w.host_steps, w.host_steps_overlapped) = if steps < 4 { (27, 24) } else { (27, 30) };
        }
    }
    assert_eq!(steps, 4);
    let mut sink = Metrics::new();
    feed(&mut sink, &events);
    let s = scrape(&sink.render().expect("renders"));
    assert_eq!(value(&s, "stagehand_host_optimizer_steps_total", &[("during_backward", "true")]), (3 * 24 + 27) as f64);
    assert_eq!(value(&s, "stagehand_host_optimizer_steps_total", &[("during_backward", "false")]), (3 * 3) as f64);
}

#[test]
fn labels_fixed_at_construction_win_over_the_run() {
    let mut m = Metrics::with_labels(DeviceLabels::new(3, "NVIDIA H200")).expect("builds");
    feed(&mut m, synthetic::events(SyntheticRun::finished(1)));
    let s = scrape(&m.render().expect("renders"));
    assert!(s.samples.iter().all(|x| x.labels.get("device") == Some("3")
        && x.labels.get("device_name") == Some("NVIDIA H200")));
}

#[test]
fn dropped_events_are_counted_from_the_running_total() {
    use stagehand_events::model::{Event, EventKind, Phase};
    let mut m = Metrics::new();
    feed(&mut m, [3u64, 3, 10].into_iter().enumerate().map(|(i, total)| Event::new(i as u64 + 1, 0, 0, Phase::Idle, EventKind::EventsDropped { total })));
    let s = scrape(&m.render().expect("renders"));
    assert_eq!(value(&s, "stagehand_events_dropped_total", &[]), 10.0);
}

#[test]
fn panel_series_exist_from_the_first_scrape() {
    let s = scrape(&Metrics::new().render().expect("renders"));
    let has = |name: &str, labels: &[(&str, &str)]| {
        s.samples.iter().any(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
    };
    for (name, labels) in [
        ("stagehand_conductor_denials_total", vec![("what", "slot"), ("reason", "d2h_slots_exhausted")]),
        ("stagehand_conductor_denials_total", vec![("what", "reservation"), ("reason", "insufficient_headroom")]),
        ("stagehand_conductor_reservations_total", vec![("outcome", "denied"), ("mode", "burst")]),
        ("stagehand_conductor_reserved_bytes", vec![]),
        ("stagehand_events_dropped_total", vec![]),
        ("stagehand_telemetry_lost_total", vec![]),
        ("stagehand_step_time_seconds_total", vec![("part", "h2d_wait")]),
        ("stagehand_last_step_time_seconds", vec![("part", "compute")]),
        ("stagehand_vram_owner_bytes", vec![("owner", "activations_kept")]),
        ("stagehand_phase_duration_seconds_count", vec![("phase", "backward")]),
        ("stagehand_transfer_bytes_total", vec![("direction", "d2h"), ("owner", "activations")]),
    ] {
        assert!(has(name, &labels), "{name}{labels:?} missing from the first scrape");
    }
    assert_eq!(value(&s, "stagehand_conductor_denials_total", &[]), 0.0);
}

/// Every sample of a scrape but the event counts (a summary file has fewer events by design),
/// as `name{labels} value` lines.
fn samples_but_event_counts(text: &str) -> Vec<String> {
    let mut out: Vec<String> = scrape(text)
        .samples
        .into_iter()
        .filter(|s| s.metric != "stagehand_events_total")
        .map(|s| {
            let labels: BTreeMap<&String, &String> = s.labels.iter().collect();
            format!("{}{labels:?} {:?}", s.metric, s.value)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_replay_of_either_file_level_scrapes_as_the_live_run() {
    use stagehand_events::jsonl::read_file;
    use stagehand_events::telemetry::{attach, Level, TelemetryConfig};
    let dir = tempfile::tempdir().expect("tempdir");
    let bus = stagehand_events::Bus::new();
    let live = Metrics::new();
    bus.hub().expect("enabled").add_snapshot_sink(Box::new(live.clone()));
    let file = |level, name: &str| TelemetryConfig { level, path: Some(dir.path().join(name)), ..Default::default() };
    let full = attach(&bus, file(Level::Full, "full.jsonl")).expect("full");
    let summary = attach(&bus, file(Level::Summary, "summary.jsonl")).expect("summary");
    synthetic::publish(SyntheticRun::finished(6), &bus, std::time::Duration::ZERO);
    bus.close();
    let want = samples_but_event_counts(&live.render().expect("renders"));
    for t in [&full, &summary] {
        let (events, _) = read_file(&t.paths()[0]).expect("reads");
        let mut replay = Metrics::new();
        feed(&mut replay, &events);
        let got = samples_but_event_counts(&replay.render().expect("renders"));
        let differ: Vec<_> = got.iter().zip(&want).filter(|(g, w)| g != w).take(5).collect();
        assert!(differ.is_empty() && got.len() == want.len(), "{:?}: {} vs {} samples, first differences {differ:?}", t.level(), got.len(), want.len());
    }
    // The counts are really there (not zero on both sides).
    let s = scrape(&live.render().expect("renders"));
    for name in ["stagehand_prefetch_hits_total", "stagehand_transfers_total", "stagehand_evictions_total", "stagehand_conductor_denials_total"] {
        assert!(value(&s, name, &[]) > 0.0, "{name}");
    }
}

#[test]
fn each_device_of_a_data_parallel_run_has_its_series() {
    use stagehand_events::model::{CopyCount, DeviceInfo, DeviceKind, Event, EventKind, Owner, Phase, StepCounts, TransferId};
    let started = Event::new(
        1,
        0,
        0,
        Phase::Idle,
        EventKind::RunStarted {
            run_id: "r".into(),
            wall_clock_unix_ms: 0,
            device: DeviceInfo { kind: DeviceKind::Cuda, index: 0, name: "NVIDIA H100".into(), total_bytes: 80 << 30 },
            model: "m".into(),
            versions: Default::default(),
            config: serde_json::Value::Null,
        },
    );
    let mut events = vec![started];
    // Each device's copies and their step's counts (the counters' source), as its step closer
    // publishes them.
    for (seq, (device, step, bytes)) in [(0u32, 1u64, 1000u64), (1, 1, 3000), (1, 2, 500)].into_iter().enumerate() {
        let id = TransferId(seq as u64);
        let kind = EventKind::TransferCompleted { id, dir: Direction::Collective, owner: Owner::Weights, bytes, duration_ms: Some(1.0) };
        events.push(Event::new(2 * seq as u64 + 2, 10, step, Phase::Backward, kind).on_device(Some(device)));
        let mut counts = StepCounts::default();
        counts.copies.entry(Direction::Collective).or_default().insert(Owner::Weights, CopyCount { count: 1, bytes });
        events.push(Event::new(2 * seq as u64 + 3, 11, step, Phase::StepEnd, EventKind::StepCounts(Box::new(counts))).on_device(Some(device)));
    }
    let mut sink = Metrics::new();
    feed(&mut sink, &events);
    let text = sink.render().expect("renders");
    let s = scrape(&text);
    for (device, bytes) in [("0", 1000.0), ("1", 3500.0)] {
        let labels = [("direction", "collective"), ("device", device), ("device_name", "NVIDIA H100")];
        assert_eq!(value(&s, "stagehand_transfer_bytes_total", &labels), bytes, "device {device}");
    }
    // One family per name, one series per label set.
    let mut seen = std::collections::HashSet::new();
    for x in &s.samples {
        let mut labels: Vec<String> = x.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        assert!(seen.insert((x.metric.clone(), labels.join(","))), "duplicate series {} {:?}", x.metric, x.labels);
    }
    assert_eq!(text.matches("# TYPE stagehand_transfer_bytes_total ").count(), 1);
}

#[test]
fn a_resized_pool_shows_only_its_current_classes() {
    use stagehand_events::model::{Event, EventKind, Phase, PoolClass, PoolKind};
    let configured = |seq: u64, slab_bytes: u64| {
        let classes = vec![PoolClass { slab_bytes, slabs: 4 }];
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PoolConfigured { pool: PoolKind::Activations, classes, pinned: true })
    };
    let hub = stagehand_events::Hub::new();
    let m = Metrics::new();
    hub.add_snapshot_sink(Box::new(m.clone()));
    // The pool as first sized, seen by a batch (a scrape in between would show it), then resized.
    hub.ingest(configured(1, 1 << 20));
    hub.flush();
    hub.ingest(configured(2, 4 << 20));
    hub.flush();
    let s = scrape(&m.render().expect("renders"));
    let classes: Vec<&str> = s
        .samples
        .iter()
        .filter(|x| x.metric == "stagehand_pool_capacity_bytes")
        .filter_map(|x| x.labels.get("slab_bytes"))
        .collect();
    assert_eq!(classes, ["4194304"], "the resized pool's class alone");
}
