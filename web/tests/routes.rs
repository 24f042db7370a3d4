//! Every route, in memory (`Router::oneshot`), live and replaying.

mod http;
mod inproc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use stagehand_events::{Hub, Snapshot};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_exporter::Metrics;
use inproc::call;
use stagehand_web::{router, AppState, ReplayDriver};
use std::sync::Arc;
use tower::ServiceExt;

fn live_state(steps: u64) -> AppState {
    let hub = Arc::new(Hub::new());
    let metrics = Metrics::new();
    hub.add_snapshot_sink(Box::new(metrics.clone()));
    // Before the run, as a server is started: the page's log sees every event.
    let state = AppState::live(hub.clone(), metrics);
    for e in synthetic::events(SyntheticRun::finished(steps)) {
        hub.ingest(e);
    }
    state
}

async fn call_json(state: &AppState, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
    let (status, ctype, bytes) = call(state, method, uri, body).await;
    assert!(ctype.starts_with("application/json"), "{uri}: content-type {ctype}");
    (status, serde_json::from_slice(&bytes).expect("JSON body"))
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, mentions: &str) {
    assert_eq!(status, want, "{body}");
    assert_eq!(body["status"], want.as_u16());
    let msg = body["error"].as_str().expect("an error message");
    assert!(msg.contains(mentions), "{msg:?} should mention {mentions:?}");
}

#[tokio::test]
async fn snapshot_run_and_steps() {
    let state = live_state(6);
    let (status, snap) = call_json(&state, "GET", "/api/snapshot", None).await;
    assert_eq!(status, StatusCode::OK);
    let snap: Snapshot = serde_json::from_value(snap).expect("a snapshot");
    let expected = state.hub().snapshot();
    assert_eq!(snap.last_seq, expected.last_seq);
    assert_eq!(snap.blocks, expected.blocks);

    let (status, run) = call_json(&state, "GET", "/api/run", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(run["mode"], "live");
    assert_eq!(run["run"]["device"]["name"], "host (simulated)");
    assert_eq!(run["run"]["model"], "gpt d=512 L=12");
    assert!(run["run"]["versions"]["stagehand"].is_string());
    assert_eq!(run["run"]["config"]["prefetch_window"], 2);
    assert_eq!(run["ended"], true);

    let (status, steps) = call_json(&state, "GET", "/api/steps?from=2&limit=3", None).await;
    assert_eq!(status, StatusCode::OK);
    let numbers: Vec<u64> = steps["steps"].as_array().expect("steps").iter()
        .map(|s| s["step"].as_u64().expect("number")).collect();
    assert_eq!(numbers, [2, 3, 4]);
    assert_eq!(steps["more"], true);
    assert!(steps["steps"][0]["train"]["loss"].is_number());
    let (_, all) = call_json(&state, "GET", "/api/steps", None).await;
    assert_eq!(all["steps"].as_array().map(Vec::len), Some(6));
    assert_eq!(all["more"], false);
}

#[tokio::test]
async fn bad_requests_get_json_4xx() {
    let state = live_state(1);
    let (s, b) = call_json(&state, "GET", "/api/steps?limit=0", None).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "limit=0");
    let (s, b) = call_json(&state, "GET", "/api/steps?limit=100000", None).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "limit=100000");
    let (s, b) = call_json(&state, "GET", "/api/steps?from=abc", None).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "from=abc");
    let (s, b) = call_json(&state, "GET", "/api/steps?frm=1", None).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "frm");
    let (s, b) = call_json(&state, "GET", "/api/nothing", None).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "/api/nothing");
    let (s, b) = call_json(&state, "POST", "/api/snapshot", None).await;
    assert_error(s, &b, StatusCode::METHOD_NOT_ALLOWED, "/api/snapshot");
    let (s, b) = call_json(&state, "GET", "/api/replay/status", None).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "live run");
    let (s, b) = call_json(&state, "POST", "/api/replay/play", None).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "live run");
}

#[tokio::test]
async fn metrics_page_and_openapi() {
    let state = live_state(2);
    let (s, ctype, body) = call(&state, "GET", "/metrics", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/plain; version=0.0.4"));
    let text = String::from_utf8(body).expect("utf-8");
    assert!(text.contains("# TYPE stagehand_transfer_duration_seconds histogram"));

    let (s, ctype, body) = call(&state, "GET", "/", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(ctype.starts_with("text/html"));
    let html = String::from_utf8(body).expect("utf-8");
    for id in ["connection", "vram-chart", "residency-grid", "event-log"] {
        assert!(html.contains(&format!("data-testid=\"{id}\"")), "page lacks {id}");
    }
    for asset in ["app.js", "app.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"] {
        let (s, _, body) = call(&state, "GET", &format!("/assets/{asset}"), None).await;
        assert_eq!(s, StatusCode::OK, "{asset}");
        assert!(!body.is_empty(), "{asset}");
    }
    let (s, b) = call_json(&state, "GET", "/assets/nope.js", None).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "nope.js");

}

/// Every route the router has.
const ROUTES: [&str; 18] = [
    "/", "/assets/{file}", "/api/openapi.json", "/api/snapshot", "/api/run", "/api/steps", "/metrics", "/api/flight",
    "/api/view", "/api/view/stream", "/api/stream", "/api/ws", "/api/replay/status", "/api/replay/play",
    "/api/replay/pause", "/api/replay/seek", "/api/replay/speed", "/api/replay/step",
];

fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get("$ref") {
                out.push(r);
            }
            o.values().for_each(|x| refs(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
        _ => {}
    }
}

/// Validates `value` against the document's schema `name`.
fn validate(doc: &Value, name: &str, value: &Value) {
    let schema = json!({ "$ref": format!("#/components/schemas/{name}"), "components": doc["components"] });
    let validator = jsonschema::draft202012::new(&schema).unwrap_or_else(|e| panic!("schema {name}: {e}"));
    let errors: Vec<String> = validator.iter_errors(value).take(5).map(|e| format!("{e} at {}", e.instance_path())).collect();
    assert!(errors.is_empty(), "{name}: {errors:#?}");
}

/// The document is generated from the response types: every route is in it, every reference
/// resolves, the snapshot's schema has the snapshot's fields, and real answers validate.
#[tokio::test]
async fn openapi_document_describes_every_route_and_its_answers() {
    let state = live_state(3);
    let (s, doc) = call_json(&state, "GET", "/api/openapi.json", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let mut paths: Vec<&str> = doc["paths"].as_object().expect("paths").keys().map(String::as_str).collect();
    paths.sort_unstable();
    let mut want = ROUTES.to_vec();
    want.sort_unstable();
    assert_eq!(paths, want);

    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(all.len() > 50, "{} references", all.len());
    for r in all {
        let name = r.strip_prefix("#/components/schemas/").unwrap_or_else(|| panic!("a local schema: {r}"));
        assert!(schemas.contains_key(name), "{r} does not resolve");
    }
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("operations") {
            let ok = op["responses"].get("200").or_else(|| op["responses"].get("101"));
            assert!(ok.is_some_and(|r| r["description"].is_string()), "{method} {path}: no success answer");
            assert!(op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].is_string(), "{method} {path}: 401");
        }
    }
    let snap_schema = &schemas["Snapshot"];
    let props = snap_schema["properties"].as_object().expect("the snapshot's fields");
    let real = serde_json::to_value(state.hub().snapshot()).expect("a snapshot");
    for key in real.as_object().expect("fields").keys() {
        assert!(props.contains_key(key), "the Snapshot schema lacks '{key}'");
    }
    assert_eq!(props["steps"]["items"]["$ref"], "#/components/schemas/StepRecord");
    assert!(schemas["StepRecord"]["properties"]["time"].is_object());

    for (uri, schema) in [("/api/snapshot", "Snapshot"), ("/api/run", "RunResponse"), ("/api/steps", "StepsPage"),
                          ("/api/view", "ViewMessage"), ("/api/steps?limit=0", "ErrorBody"), ("/api/replay/status", "ErrorBody")] {
        let (_, body) = call_json(&state, "GET", uri, None).await;
        validate(&doc, schema, &body);
    }
    let (replay, _, _file) = replay_state(2);
    let (_, st) = call_json(&replay, "POST", "/api/replay/step", Some(json!({ "steps": 1 }))).await;
    validate(&doc, "ReplayState", &st);
    let (_, view) = call_json(&replay, "GET", "/api/view", None).await;
    validate(&doc, "ViewMessage", &view);
    // The validator is not lenient: a wrong answer fails.
    let schema = json!({ "$ref": "#/components/schemas/ReplayState", "components": doc["components"] });
    let validator = jsonschema::draft202012::new(&schema).expect("a schema");
    assert!(!validator.is_valid(&json!({ "position": "three" })));
}

#[tokio::test]
async fn sse_starts_with_a_snapshot() {
    let state = live_state(1);
    let req = Request::builder().uri("/api/stream").header("host", "localhost").body(Body::empty()).expect("request");
    let resp = router(state.clone()).oneshot(req).await.expect("answers");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let frame = body.frame().await.expect("a frame").expect("ok").into_data().expect("data");
    let text = String::from_utf8(frame.to_vec()).expect("utf-8");
    assert!(text.starts_with("event: snapshot\ndata: {\"type\":\"snapshot\""), "{}", &text[..80.min(text.len())]);
}

/// A metric's value on `/metrics` (the sum of its samples); fails when it has no sample.
async fn scraped(state: &AppState, name: &str) -> f64 {
    let (_, _, body) = call(state, "GET", "/metrics", None).await;
    http::metric(&String::from_utf8(body).expect("utf-8"), name).unwrap_or_else(|| panic!("no sample of {name}"))
}

#[tokio::test]
async fn replay_controls_drive_the_hub() {
    let (state, total, _file) = replay_state(4);
    let (s, st) = call_json(&state, "GET", "/api/replay/status", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!((st["position"].as_u64(), st["total"].as_u64(), st["paused"].as_bool()), (Some(0), Some(total as u64), Some(true)));
    let (_, run) = call_json(&state, "GET", "/api/run", None).await;
    assert_eq!(run["mode"], "replay");

    let (s, st) = call_json(&state, "POST", "/api/replay/step", Some(json!({ "events": 10 }))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["position"], 10);
    assert_eq!(state.hub().snapshot().events_applied, 10);

    let (s, st) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "fraction": 1.0 }))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["position"].as_u64(), Some(total as u64));
    assert!(state.hub().snapshot().ended);

    let end_hits = state.hub().snapshot().weights.prefetch_hits;
    assert_eq!(scraped(&state, "stagehand_prefetch_hits_total").await, end_hits as f64);

    // Back to the middle: /metrics counts what the replay has reached, not what it once did.
    let (s, _) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "position": total / 2 }))).await;
    assert_eq!(s, StatusCode::OK);
    let mid = state.hub().snapshot();
    assert!(mid.weights.prefetch_hits < end_hits);
    assert_eq!(scraped(&state, "stagehand_prefetch_hits_total").await, mid.weights.prefetch_hits as f64);
    assert_eq!(scraped(&state, "stagehand_step").await, mid.step as f64);

    let (s, _) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "position": 0 }))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(state.hub().snapshot().events_applied, 0, "a seek back resets the hub");
    assert_eq!(scraped(&state, "stagehand_prefetch_hits_total").await, 0.0);

    let (s, st) = call_json(&state, "POST", "/api/replay/speed", Some(json!({ "speed": 4.0 }))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["speed"], 4.0);
    let (s, st) = call_json(&state, "POST", "/api/replay/play", None).await;
    assert_eq!((s, st["paused"].as_bool()), (StatusCode::OK, Some(false)));
    let (_, st) = call_json(&state, "POST", "/api/replay/pause", None).await;
    assert_eq!(st["paused"], true);

    let (s, b) = call_json(&state, "POST", "/api/replay/speed", Some(json!({ "speed": 0 }))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "speed 0");
    let (s, b) = call_json(&state, "POST", "/api/replay/speed", Some(json!({ "speed": "fast" }))).await;
    assert!(s.is_client_error(), "{s}");
    assert!(b["error"].as_str().is_some_and(|m| m.contains("bad request body")));
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({}))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "exactly one");
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "position": total + 1 }))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "past the end");
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "fraction": 2.0 }))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "fraction 2");
}

/// `router(AppState::live(..))` is how a user serves with their own tokio: its stream must
/// follow the run to its end, not stop after the first snapshot.
#[tokio::test]
async fn sse_from_a_plain_router_follows_the_run_to_its_end() {
    let hub = Arc::new(Hub::new());
    let state = AppState::live(hub.clone(), Metrics::new());
    let req = Request::builder().uri("/api/stream").header("host", "localhost").body(Body::empty()).expect("request");
    let resp = router(state).oneshot(req).await.expect("answers");
    assert_eq!(resp.status(), StatusCode::OK);
    let events = synthetic::events(SyntheticRun::finished(3));
    let total = events.len();
    let publisher = std::thread::spawn(move || {
        for e in events {
            hub.ingest(e);
        }
    });
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut seen = 0;
    while !text.contains("\"kind\":\"run_ended\"") {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(60), body.frame())
            .await
            .expect("the stream keeps sending until the run ends")
            .expect("the stream is still open")
            .expect("a frame");
        let Ok(data) = frame.into_data() else { continue };
        text.push_str(std::str::from_utf8(&data).expect("utf-8"));
        seen += 1;
    }
    publisher.join().expect("publisher");
    let events_seen = text.matches("event: event\n").count();
    assert_eq!(events_seen, total, "every event of the run arrived ({seen} frames)");
}

/// The page's first message carries what the page shows, not the whole snapshot.
#[tokio::test]
async fn the_pages_view_is_small_beside_the_snapshot() {
    let state = live_state(600);
    let (_, _, snapshot) = call(&state, "GET", "/api/snapshot", None).await;
    let (status, ctype, view) = call(&state, "GET", "/api/view", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(ctype.starts_with("application/json"));
    eprintln!("snapshot {} bytes, view {} bytes", snapshot.len(), view.len());
    let msg: Value = serde_json::from_slice(&view).expect("JSON");
    assert_eq!(msg["type"], "view");
    assert_eq!(msg["log"]["reset"], true);
    assert_eq!(msg["log"]["lines"].as_array().map(Vec::len), Some(stagehand_web::RECENT_EVENTS));
    assert_eq!(msg["log"]["lines"][199]["kind"], "run_ended", "the log ends where the run did");
    assert!(view.len() < 160 * 1024, "view of {} bytes", view.len());
    assert!(view.len() * 3 < snapshot.len(), "view {} vs snapshot {} bytes", view.len(), snapshot.len());
}

/// A replay server's state over a synthetic run written to a file (in the directory returned,
/// which must outlive the state: the replay reads the file on demand), indexed, and its events.
fn replay_state(steps: u64) -> (AppState, usize, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run.jsonl");
    let run = SyntheticRun::finished(steps);
    std::fs::write(&path, synthetic::jsonl(run)).expect("writes");
    let driver = ReplayDriver::open(&path).expect("opens");
    // The totals these tests expect are the whole file's.
    driver.wait_indexed();
    (AppState::replay(Arc::new(driver)), synthetic::events(run).len(), dir)
}

/// Extreme and meaningless values get a 4xx JSON answer, never a panic or an overflow.
#[tokio::test]
async fn replay_controls_refuse_bad_values_with_clear_errors() {
    let (state, total, _file) = replay_state(3);
    for body in [
        json!({ "events": i64::MAX }), json!({ "events": i64::MIN }), json!({ "steps": i64::MIN }),
        json!({ "steps": i64::MAX }), json!({ "events": 0 }), json!({ "steps": 0 }),
        json!({ "events": total as i64 + 1 }),
    ] {
        let (s, b) = call_json(&state, "POST", "/api/replay/step", Some(body.clone())).await;
        assert_error(s, &b, StatusCode::BAD_REQUEST, "out of range");
        assert!(b["error"].as_str().is_some_and(|m| m.contains(&total.to_string())), "{body}: {b}");
    }
    for (path, body) in [
        ("/api/replay/step", r#"{"events": 1e300}"#), ("/api/replay/step", r#"{"events": "1"}"#),
        ("/api/replay/step", r#"{"steps": 18446744073709551616}"#), ("/api/replay/seek", r#"{"position": -1}"#),
        ("/api/replay/seek", r#"{"speed": 1}"#), ("/api/replay/step", r#""text""#), ("/api/replay/seek", "{"),
    ] {
        let req = Request::builder().method("POST").uri(path).header("host", "localhost")
            .header("content-type", "application/json").body(Body::from(body)).expect("request");
        let resp = router(state.clone()).oneshot(req).await.expect("answers");
        let s = resp.status();
        let b: Value = serde_json::from_slice(&resp.into_body().collect().await.expect("body").to_bytes()).expect("JSON");
        assert!(s.is_client_error(), "{body}: {s}");
        assert!(b["error"].as_str().is_some_and(|m| m.contains("bad request body")), "{body}: {b}");
    }
    for speed in [json!(1e308), json!(-1), json!(0.0001)] {
        let (s, b) = call_json(&state, "POST", "/api/replay/speed", Some(json!({ "speed": speed }))).await;
        assert_error(s, &b, StatusCode::BAD_REQUEST, "out of range");
    }
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "t_ns": u64::MAX }))).await;
    assert_eq!(s, StatusCode::OK, "a time past the end is the end: {b}");
    assert_eq!(b["position"].as_u64(), Some(total as u64));
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "step": 99 }))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "step 99 is not in the file: it holds steps 1 to 3");
    let (s, b) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "step": 1, "position": 2 }))).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "exactly one");
}

/// Seek by event index, by time and by training step.
#[tokio::test]
async fn replay_seeks_by_event_index_time_and_step() {
    let (state, total, _file) = replay_state(4);
    let (s, st) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "step": 3 }))).await;
    assert_eq!(s, StatusCode::OK);
    let snap = state.hub().snapshot();
    assert_eq!((st["step"].as_u64(), snap.step), (Some(3), 3));
    assert_eq!(snap.phase, stagehand_events::Phase::StepBegin, "at the start of the step");
    let at_step = st["position"].as_u64().expect("position");

    let (_, st) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "position": 5 }))).await;
    assert_eq!(st["position"], 5);
    assert_eq!(state.hub().snapshot().events_applied, 5);

    let t = st["end_t_ns"].as_u64().expect("end") / 2;
    let (_, st) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "t_ns": t }))).await;
    let pos = st["position"].as_u64().expect("position") as usize;
    assert!(pos > 0 && pos < total);
    assert!(st["t_ns"].as_u64().expect("t") < t, "the events before the time are applied");

    let (_, st) = call_json(&state, "POST", "/api/replay/step", Some(json!({ "steps": -1 }))).await;
    assert!(st["position"].as_u64() < Some(pos as u64));
    let (_, st) = call_json(&state, "POST", "/api/replay/seek", Some(json!({ "step": 3 }))).await;
    assert_eq!(st["position"].as_u64(), Some(at_step));
}

/// The run's configuration is served as the run published it: structured JSON, not a string.
#[tokio::test]
async fn run_config_keeps_its_structure() {
    let hub = Arc::new(Hub::new());
    let state = AppState::live(hub.clone(), Metrics::new());
    for mut e in synthetic::events(SyntheticRun::finished(1)) {
        if let stagehand_events::EventKind::RunStarted { config, .. } = &mut e.kind {
            *config = json!({ "weights": { "prefetch_window": 3, "room": { "mib": 640 } }, "steps": [1, 2] });
        }
        hub.ingest(e);
    }
    let (_, run) = call_json(&state, "GET", "/api/run", None).await;
    assert_eq!(run["run"]["config"]["weights"]["room"]["mib"], 640);
    assert_eq!(run["run"]["config"]["steps"][1], 2);
}

/// A live run's flight recorder writes the last steps on request, once per its interval; a
/// replay has none to ask.
#[tokio::test]
async fn a_flight_record_is_written_on_request_once_per_interval() {
    use stagehand_events::telemetry::{self, Level, TelemetryConfig};
    let dir = tempfile::tempdir().expect("dir");
    let bus = stagehand_events::Bus::new();
    let hub = bus.hub().expect("an enabled bus").clone();
    let metrics = Metrics::new();
    hub.add_snapshot_sink(Box::new(metrics.clone()));
    let state = AppState::live(hub, metrics);
    let config = TelemetryConfig {
        level: Level::Summary,
        path: Some(dir.path().join("run.jsonl")),
        ..Default::default()
    };
    let _telemetry = telemetry::attach(&bus, config).expect("telemetry");
    synthetic::publish(SyntheticRun { blocks: 4, steps: 3, end_mid_step: false }, &bus, std::time::Duration::ZERO);
    bus.flush();

    let (status, body) = call_json(&state, "POST", "/api/flight", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let path = body["path"].as_str().expect("the record's path");
    assert!(path.contains("run.flight-") && path.ends_with("-api.jsonl"), "{path}");
    let (events, report) = stagehand_events::jsonl::read_file(path).expect("the record reads as telemetry");
    assert_eq!(report.skipped_total, 0);
    assert!(events.len() > 10, "the last steps in full: {} events", events.len());

    let (status, body) = call_json(&state, "POST", "/api/flight", None).await;
    assert_error(status, &body, StatusCode::TOO_MANY_REQUESTS, "api");

    let (replay, _, _dir) = replay_state(2);
    let (status, body) = call_json(&replay, "POST", "/api/flight", None).await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "no flight recorder");
}
