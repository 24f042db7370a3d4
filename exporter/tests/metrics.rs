//! `/metrics` text parsed back with a Prometheus text parser: names, types, units, labels and
//! values against the snapshot of the same events.

use prometheus_parse::{Scrape, Value};
use stagehand::events::model::{BlockState, Direction};
use stagehand::events::{EventSink, Snapshot};
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand_exporter::{DeviceLabels, Metrics, METRIC_NAMES};
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
    for e in &events {
        sink.on_event(e);
    }
    let text = sink.render().expect("renders");
    let s = scrape(&text);
    assert!(s.samples.len() > 50, "{} samples", s.samples.len());

    // Declared types, straight from the `# TYPE` lines.
    let types: BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    for (name, ty) in METRIC_NAMES {
        assert_eq!(types.get(name), Some(ty), "{name} declared as {:?}", types.get(name));
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
    assert_eq!(value(&s, "stagehand_vram_bytes", &[("kind", "high_watermark")]), snap.spill_watermarks().map_or(0, |w| w.0) as f64);
    assert_eq!(value(&s, "stagehand_activations_packed_total", &[("decision", "spilled")]), snap.activations.spilled as f64);
    assert_eq!(value(&s, "stagehand_activation_restores_total", &[]), snap.activations.restored as f64);
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
fn labels_fixed_at_construction_win_over_the_run() {
    let m = Metrics::with_labels(DeviceLabels::new(3, "NVIDIA H200")).expect("builds");
    for e in synthetic::events(SyntheticRun::finished(1)) {
        m.record(&e).expect("records");
    }
    let s = scrape(&m.render().expect("renders"));
    assert!(s.samples.iter().all(|x| x.labels.get("device") == Some("3")
        && x.labels.get("device_name") == Some("NVIDIA H200")));
}

#[test]
fn dropped_events_are_counted_from_the_running_total() {
    use stagehand::events::model::{Event, EventKind, Phase};
    let m = Metrics::new();
    for (i, total) in [3u64, 3, 10].into_iter().enumerate() {
        m.record(&Event::new(i as u64 + 1, 0, 0, Phase::Idle, EventKind::EventsDropped { total }))
            .expect("records");
    }
    let s = scrape(&m.render().expect("renders"));
    assert_eq!(value(&s, "stagehand_events_dropped_total", &[]), 10.0);
}

#[test]
fn grafana_dashboard_queries_only_exported_metrics() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/stagehand.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10);
    let known: Vec<&str> = METRIC_NAMES.iter().map(|(n, _)| *n).collect();
    for p in panels {
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            let names: Vec<&str> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("stagehand_"))
                .collect();
            assert!(!names.is_empty(), "{expr}");
            for n in names {
                let base = n.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
                assert!(known.contains(&n) || known.contains(&base), "{} queries unknown {n}", p["title"]);
            }
        }
    }
}
