//! A replay server over a large telemetry file holds a bounded number of events, whatever the
//! file's size, and still reaches exactly the state the in-memory reducer computes.

mod http;
mod inproc;

use axum::http::StatusCode;
use inproc::call;
use serde_json::{json, Value};
use stagehand_events::jsonl::read_file;
use stagehand_events::replay::file::RECENT_KEPT;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::{EventKind, Phase, Snapshot};
use stagehand_web::{AppState, ReplayDriver};
use std::io::Write;
use std::sync::Arc;

/// Bytes the generated file holds at least: far more than the driver may keep.
const FILE_BYTES: u64 = 16 << 20;

async fn seek(state: &AppState, body: Value) -> Value {
    let (status, _, bytes) = call(state, "POST", "/api/replay/seek", Some(body.clone())).await;
    let v: Value = serde_json::from_slice(&bytes).expect("JSON body");
    assert_eq!(status, StatusCode::OK, "seek {body}: {v}");
    v
}

/// A metric's value on `/metrics` (the sum of its samples, 0 when it has none).
async fn scraped(state: &AppState, name: &str) -> f64 {
    let (_, _, body) = call(state, "GET", "/metrics", None).await;
    http::metric(&String::from_utf8(body).expect("utf-8"), name).unwrap_or(0.0)
}

/// Writes a synthetic run long enough to reach `FILE_BYTES`, one event a line.
fn write_large_run(path: &std::path::Path) {
    let mut steps = 64;
    loop {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("creates"));
        for e in synthetic::events(SyntheticRun::finished(steps)) {
            serde_json::to_writer(&mut out, &e).expect("writes");
            out.write_all(b"\n").expect("writes");
        }
        out.flush().expect("flushes");
        drop(out);
        if std::fs::metadata(path).expect("metadata").len() >= FILE_BYTES {
            return;
        }
        steps *= 2;
    }
}

#[tokio::test]
async fn a_large_file_replays_with_bounded_memory_and_exact_snapshots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("large.jsonl");
    write_large_run(&path);
    // The reference: every event in memory, read separately, reduced by the in-memory reducer.
    let (events, _) = read_file(&path).expect("reads");
    let total = events.len();
    assert!(total > 20 * RECENT_KEPT, "{total} events is not large enough to show a bound");

    let driver = Arc::new(ReplayDriver::open(&path).expect("opens"));
    let state = AppState::replay(driver.clone());
    let bound = RECENT_KEPT + 1;
    assert!(driver.events_held() <= bound, "{} events held at the start", driver.events_held());

    // To the end by event index (judged against the whole file even while it is indexed).
    let st = seek(&state, json!({ "position": total })).await;
    assert_eq!((st["position"].as_u64(), st["total"].as_u64()), (Some(total as u64), Some(total as u64)));
    let end = Snapshot::from_events(&events);
    assert!(end.ended && end.weights.prefetch_hits > 0);
    assert_eq!(state.hub().snapshot(), end, "the end, as the reducer computes it");
    assert_eq!(scraped(&state, "stagehand_prefetch_hits_total").await, end.weights.prefetch_hits as f64);
    assert!(driver.events_held() <= bound, "{} events held at the end", driver.events_held());

    // Back to the start of a step in the middle.
    let step = events.last().expect("events").step / 2;
    let after_begin = events
        .iter()
        .position(|e| e.step == step && matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. }))
        .expect("the step is in the file")
        + 1;
    let st = seek(&state, json!({ "step": step })).await;
    assert_eq!(st["position"].as_u64(), Some(after_begin as u64));
    let mid = Snapshot::from_events(&events[..after_begin]);
    assert!(mid.step == step && mid.weights.prefetch_hits < end.weights.prefetch_hits);
    assert_eq!(state.hub().snapshot(), mid, "step {step}, as the reducer computes it");
    assert_eq!(scraped(&state, "stagehand_prefetch_hits_total").await, mid.weights.prefetch_hits as f64);
    assert!(driver.events_held() <= bound, "{} events held at step {step}", driver.events_held());

    // The whole file by fraction, once indexed, and the same state as a driver over the events
    // in memory reaches.
    driver.wait_indexed();
    seek(&state, json!({ "fraction": 1.0 })).await;
    assert_eq!(state.hub().snapshot(), end);
    let in_memory = AppState::replay(Arc::new(ReplayDriver::new(events)));
    seek(&in_memory, json!({ "fraction": 1.0 })).await;
    assert_eq!(in_memory.hub().snapshot(), state.hub().snapshot());
    assert!(driver.events_held() <= bound);
}
