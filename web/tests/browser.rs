//! The web page in a real headless browser (Debian's chromium, driven over WebDriver by
//! chromedriver): it loads against a real server, follows a live run and a replay, and every
//! figure it shows, the insight panels included, matches `/api/snapshot`. Chart axes are
//! checked for overlapping and clipped labels. A screenshot is kept in
//! `target/artifacts/web-dashboard.png`.

mod http;
mod webdriver;

use serde_json::{json, Value};
use stagehand_events::insight;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::{Bus, Event, EventKind, Hub, Snapshot};
use stagehand_web::{AppState, ReplayDriver, Server, ServerConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use webdriver::{browser, Driver};

fn snapshot(addr: SocketAddr) -> Snapshot {
    serde_json::from_slice(&http::request(addr, "GET", "/api/snapshot", None).body).expect("a snapshot")
}

/// The synthetic run, with the structured configuration a real run publishes.
fn run_events(steps: u64) -> Vec<Event> {
    let mut events = synthetic::events(SyntheticRun::finished(steps));
    for e in &mut events {
        if let EventKind::RunStarted { config, .. } = &mut e.kind {
            *config = json!({ "weights": { "prefetch_window": 2, "room": { "mib": 640 } }, "activations": { "spill": true } });
        }
        // A trained run's host optimizer, which the synthetic run leaves out.
        if let EventKind::WeightStep(w) = &mut e.kind {
            (w.host_steps, w.host_steps_overlapped) = (4, 3);
        }
    }
    events
}

fn close(a: &str, b: f64, what: &str) {
    let a: f64 = a.parse().unwrap_or_else(|_| panic!("{what}: {a:?} is not a number"));
    assert!((a - b).abs() <= 0.0006, "{what}: page {a}, api {b}");
}

/// Every figure the page shows against the API's snapshot.
fn assert_page_matches(driver: &Driver, f: &HashMap<String, String>, api: &Snapshot) {
    assert_eq!(f["events-applied"], api.events_applied.to_string());
    assert_eq!(f["last-seq"], api.last_seq.to_string());
    assert_eq!(f["step"], api.step.to_string());
    assert_eq!(f["dropped-banner"], api.dropped_events.to_string());
    let v = api.vram.expect("vram");
    let (high, low) = api.spill_watermarks().expect("watermarks");
    for (id, want) in [
        ("vram-allocated", v.allocated_bytes), ("vram-reserved", v.reserved_bytes),
        ("vram-peak", api.vram_peak_bytes), ("vram-high", high), ("vram-low", low),
        ("vram-budget", api.vram_budget_bytes().unwrap_or(0)),
        ("prefetch-hits", api.weights.prefetch_hits), ("prefetch-misses", api.weights.prefetch_misses),
        ("evictions", api.weights.evictions),
        ("h2d-inflight", api.transfers.h2d.inflight as u64), ("h2d-count", api.transfers.h2d.count),
        ("h2d-bytes", api.transfers.h2d.bytes), ("d2h-count", api.transfers.d2h.count),
        ("d2h-bytes", api.transfers.d2h.bytes),
        ("slot-grants", api.conductor.slot_grants), ("slot-denials", api.conductor.slot_denials),
        ("act-saved", api.activations.counts.saved), ("act-kept", api.activations.counts.kept),
        ("act-spilled", api.activations.counts.spilled), ("act-restored", api.activations.counts.restored),
        ("act-predicted", api.activations.counts.predicted), ("act-spill-bytes", api.activations.counts.spill_bytes),
        ("act-restore-bytes", api.activations.counts.restore_bytes),
        ("cond-grants", api.conductor.grants), ("cond-partials", api.conductor.partials),
        ("cond-denials", api.conductor.denials), ("cond-active", api.conductor.active_reservations),
        ("cond-active-bytes", api.conductor.active_bytes),
    ] {
        assert_eq!(f.get(id).map(String::as_str), Some(want.to_string().as_str()), "{id}");
    }
    let counts = api.residency_counts();
    for st in stagehand_events::BlockState::ALL {
        let want = counts.get(&st).copied().unwrap_or(0).to_string();
        assert_eq!(f.get(&format!("residency-{}", st.as_str())), Some(&want), "residency {st}");
    }
    for (name, pool) in [("weights", &api.weight_pool), ("activations", &api.activation_pool)] {
        for (i, c) in pool.as_ref().expect("pool").classes.iter().enumerate() {
            assert_eq!(f.get(&format!("pool-{name}-{i}")), Some(&c.in_use.to_string()), "pool {name} class {i}");
        }
    }
    let cells = driver.script("return document.querySelectorAll('[data-testid=residency-grid] .cell').length;");
    assert_eq!(cells.as_u64(), Some(api.blocks.len() as u64));

    // Insight: the findings, in order, with their knobs.
    let shown = driver.script(
        "return Array.from(document.querySelectorAll('[data-testid=finding]')).map(e => \
         [e.dataset.id, e.querySelector('.msg').textContent, (e.querySelector('.knob b') || {}).textContent || '']);",
    );
    let want: Vec<Value> = insight::findings(api).iter().map(|x| json!([x.id, x.message, x.knob])).collect();
    assert_eq!(shown, Value::Array(want), "findings");

    // Where the newest step's time went.
    let (step, t) = api.steps.iter().rev().find_map(|r| r.time.map(|t| (r.step, t))).expect("a timed step");
    assert_eq!(f["time-step"], step.to_string());
    close(&f["time-total"], t.step_ms, "step time");
    for (key, ms) in [("compute", t.compute_ms), ("h2d_wait", t.h2d_wait_ms), ("d2h_wait", t.d2h_wait_ms),
                      ("weight_stall", t.weight_stall_ms), ("restore_stall", t.restore_stall_ms),
                      ("optimizer", t.optimizer_ms), ("other", t.other_ms)] {
        close(&f[&format!("time-{key}")], ms, key);
    }
    let host = api.step_record(step).and_then(|r| r.weights.as_ref()).expect("the step's weights");
    assert_eq!(f["host-steps"], host.host_steps_overlapped.to_string(), "host steps given during backward");
    let said = driver.script("return document.querySelector('[data-testid=host-steps]').textContent;");
    let want = format!("host optimizer: {} of {} blocks given to it while backward ran", host.host_steps_overlapped, host.host_steps);
    assert_eq!(said.as_str(), Some(want.as_str()));
    let bars = driver.script("return document.querySelectorAll('[data-testid=step-time-chart] .tbar').length;");
    let timed = api.steps.iter().filter(|r| r.time.is_some()).count().min(60);
    assert_eq!(bars.as_u64(), Some(timed as u64), "a bar per recent step");

    // VRAM by owner: the step shown and its peak.
    let owners_step = stagehand_web::view::insight::owners_step(api).expect("readings");
    assert_eq!(f["owners-step"], owners_step.to_string());
    let peak = api.step_record(owners_step).and_then(|r| r.vram_at_peak).expect("the step's peak");
    assert_eq!(f["peak-step"], owners_step.to_string());
    for (key, want) in [("allocated", peak.allocated_bytes), ("weights", peak.weights_bytes),
                        ("activations_kept", peak.activations_kept_bytes), ("activations_restored", peak.activations_restored_bytes),
                        ("copies_in_flight", peak.copies_in_flight_bytes), ("other", peak.other_bytes)] {
        assert_eq!(f[&format!("peak-{key}")], want.to_string(), "peak {key}");
    }
}

/// Axis labels: none overlap along x, none is clipped along y, the VRAM axis is binary.
fn assert_axes_readable(driver: &Driver, view: &Value) {
    let axes = driver.script("return window.__stagehand.axes();");
    let axes = axes.as_array().expect("axes");
    assert!(axes.len() >= 6, "three charts with two axes each: {axes:?}");
    for a in axes {
        let labels: Vec<&str> = a["labels"].as_array().expect("labels").iter().map(|l| l.as_str().unwrap_or("")).collect();
        let pos: Vec<f64> = a["positions"].as_array().expect("positions").iter().map(|p| p.as_f64().unwrap_or(0.0)).collect();
        let widths: Vec<f64> = a["widths"].as_array().expect("widths").iter().map(|w| w.as_f64().unwrap_or(0.0)).collect();
        let what = format!("{} axis {}", a["chart"], a["axis"]);
        assert!(labels.iter().filter(|l| !l.is_empty()).count() >= 2, "{what} has labels: {labels:?}");
        if a["axis"] == 0 {
            let mut shown: Vec<(f64, f64)> = pos.iter().zip(&widths).zip(&labels)
                .filter(|(_, l)| !l.is_empty()).map(|((p, w), _)| (*p, *w)).collect();
            shown.sort_by(|x, y| x.0.total_cmp(&y.0));
            for w in shown.windows(2) {
                assert!(w[0].0 + w[0].1 / 2.0 + 2.0 <= w[1].0 - w[1].1 / 2.0, "{what}: labels overlap: {labels:?} at {pos:?}");
            }
        } else {
            let room = a["size"].as_f64().unwrap_or(0.0) - a["tick"].as_f64().unwrap_or(0.0) - a["gap"].as_f64().unwrap_or(0.0);
            let widest = widths.iter().copied().fold(0.0, f64::max);
            assert!(widest <= room, "{what}: a {widest}px label in {room}px: {labels:?}");
        }
    }
    let vram_y = axes.iter().find(|a| a["chart"] == "vram" && a["axis"] == 1).expect("the VRAM axis");
    assert_eq!(vram_y["labels"], view["vram"]["axis"]["labels"], "the server's binary ticks");
    for l in vram_y["labels"].as_array().expect("labels") {
        let l = l.as_str().unwrap_or("");
        assert!(["B", "KiB", "MiB", "GiB"].iter().any(|u| l.ends_with(&format!(" {u}"))), "binary label {l:?}");
    }
}

fn save(name: &str, png: &[u8]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    std::fs::write(dir.join(name), png).expect("screenshot saved");
}

#[test]
fn dashboard_shows_the_live_run_as_the_api_does() {
    let Some((chromium, chromedriver)) = browser() else { return };
    let hub = Arc::new(Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.open(&server.url());
    driver.wait_for("a live connection", |f| f.get("connection").map(String::as_str) == Some("live"));

    // The run starts after the page is connected: everything it shows arrived live.
    let bus = Bus::with_hub(hub.clone(), stagehand_events::bus::DEFAULT_QUEUE_CAPACITY);
    let publisher = {
        let bus = bus.clone();
        let events = run_events(6);
        std::thread::spawn(move || {
            let b = bus.clone();
            for e in events {
                match e.kind {
                    EventKind::PhaseChanged { to, .. } => {
                        b.enter_phase(e.step, to);
                        if to == stagehand_events::Phase::Idle {
                            std::thread::sleep(Duration::from_millis(150));
                        }
                    }
                    kind => b.publish(kind),
                }
            }
        })
    };
    publisher.join().expect("publisher");
    bus.flush();
    let api = snapshot(server.addr());
    let total = api.events_applied.to_string();
    let f = driver.wait_for("the whole run", |f| f.get("events-applied") == Some(&total));

    assert_eq!(f["run-ended"], "true");
    assert_eq!(f["connection"], "ended", "the badge says the run ended");
    // The synthetic run is on the host device: its copy rates are not PCIe's, and the page says so.
    assert!(api.run.as_ref().is_some_and(|r| r.device.host_simulated()));
    assert!(f["pcie-sub"].contains("simulated"), "{}", f["pcie-sub"]);
    assert!(f["views-received"].parse::<u64>().expect("number") > 3, "views arrived while the run went on");
    assert_page_matches(&driver, &f, &api);
    let view: Value = http::request(server.addr(), "GET", "/api/view", None).json();
    assert_axes_readable(&driver, &view["view"]);

    let lines = driver.script("return Array.from(document.querySelectorAll('[data-testid=event-log] div:not(.gap)')).map(d => d.textContent);");
    let lines = lines.as_array().expect("lines");
    assert!(lines.len() >= 100, "event log lines: {}", lines.len());
    assert!(lines.last().and_then(Value::as_str).is_some_and(|l| l.contains("run_ended")), "the log ends with the run");
    assert!(lines.iter().all(|l| !l.as_str().unwrap_or("").contains("999999")), "rounded figures");
    // Lines the page did not get (it fell behind, or events came faster than views) are said.
    let gap = driver.script(
        "const v = window.__stagehand; const last = Array.from(document.querySelectorAll('[data-testid=event-log] div'));\
         v.takeLog({ reset: false, lines: [{ i: 1000000, seq: 1, step: 1, phase: 'idle', kind: 'warning', text: 'x', warn: true }] });\
         const g = document.querySelectorAll('[data-testid=event-log] .gap'); return g[g.length - 1].textContent;",
    );
    assert!(gap.as_str().is_some_and(|g| g.contains("events not shown")), "{gap}");
    assert_eq!(driver.script("return document.querySelector('[data-testid=replay-controls]').offsetParent === null;"), json!(true),
        "no replay controls on a live run");
    // The run's nested configuration, as a tree.
    let config = driver.script("return Array.from(document.querySelectorAll('[data-testid=run-config] dt')).map(d => d.textContent);");
    for key in ["weights", "prefetch_window", "room", "mib", "activations", "spill"] {
        assert!(config.as_array().expect("keys").iter().any(|k| k == key), "config key {key}: {config}");
    }
    let charts = driver.script("return document.querySelectorAll('.uplot canvas').length;");
    assert!(charts.as_u64().is_some_and(|n| n >= 3), "uPlot charts drawn: {charts}");
    save("web-dashboard.png", &driver.full_page_screenshot());
    drop(driver);
    server.shutdown().expect("shuts down");
}

#[test]
fn a_page_opened_after_the_run_shows_how_it_ended() {
    let Some((chromium, chromedriver)) = browser() else { return };
    let hub = Arc::new(Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    for e in run_events(3) {
        hub.ingest(e);
    }
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.open(&server.url());
    let api = snapshot(server.addr());
    let total = api.events_applied.to_string();
    let f = driver.wait_for("the finished run", |f| f.get("events-applied") == Some(&total));
    assert_eq!(f["connection"], "ended");
    assert_page_matches(&driver, &f, &api);
    let n = driver.script("return document.querySelectorAll('[data-testid=event-log] div').length;");
    assert_eq!(n.as_u64(), Some(stagehand_web::RECENT_EVENTS as u64), "the log is filled from history");
}

/// A data-parallel run of two GPUs: each lane its copy of the synthetic run's step events.
fn two_gpu_events(steps: u64) -> Vec<Event> {
    let mut out = Vec::new();
    for e in run_events(steps) {
        match e.kind {
            EventKind::RunStarted { .. } | EventKind::RunEnded { .. } => out.push(e),
            _ => {
                out.push(e.clone().on_device(Some(0)));
                out.push(e.on_device(Some(1)));
            }
        }
    }
    for (i, e) in out.iter_mut().enumerate() {
        e.seq = i as u64 + 1;
    }
    out
}

#[test]
fn a_data_parallel_run_shows_each_gpu() {
    let Some((chromium, chromedriver)) = browser() else { return };
    let hub = Arc::new(Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    for e in two_gpu_events(3) {
        hub.ingest(e);
    }
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.open(&server.url());
    let api = snapshot(server.addr());
    let total = api.events_applied.to_string();
    driver.wait_for("the finished run", |f| f.get("events-applied") == Some(&total));
    let rows = driver.script(
        "return Array.from(document.querySelectorAll('[data-testid=gpu]')).map(r => [r.dataset.device, r.querySelector('[data-testid=gpu-step]').dataset.value, r.querySelector('[data-testid=gpu-host-steps]').textContent]);",
    );
    let want: Vec<Value> = api
        .lanes
        .values()
        .map(|l| {
            let w = l.last_weights.as_ref().expect("the lane's weight step");
            json!([l.device.to_string(), l.step.to_string(), format!("{} of {}", w.host_steps_during_backward(), w.host_steps)])
        })
        .collect();
    assert_eq!(api.lanes.len(), 2);
    assert_eq!(rows, Value::Array(want), "a row per GPU, at its step, with its host steps given during backward");
    assert_eq!(driver.script("return document.querySelector('[data-testid=gpus]').offsetParent !== null;"), json!(true), "the GPUs card shows");
    save("web-dashboard-gpus.png", &driver.full_page_screenshot());
    drop(driver);
    server.shutdown().expect("shuts down");
}

#[test]
fn replay_page_follows_its_controls_and_says_the_speed_in_force() {
    let Some((chromium, chromedriver)) = browser() else { return };
    // Served from a file, as `Server::replay` and the replay program serve one.
    let file = tempfile::tempdir().expect("file dir");
    let path = file.path().join("run.jsonl");
    let mut text = String::new();
    for e in run_events(5) {
        text.push_str(&serde_json::to_string(&e).expect("an event serializes"));
        text.push('\n');
    }
    std::fs::write(&path, text).expect("writes");
    let driver_state = Arc::new(ReplayDriver::open(&path).expect("opens"));
    let server = Server::start(&ServerConfig::new("127.0.0.1:0"), AppState::replay(driver_state.clone())).expect("starts");
    let addr = server.addr();
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.open(&server.url());
    driver.wait_for("the replay, paused", |f| f.get("connection").map(String::as_str) == Some("paused"));
    assert_eq!(driver.script("return document.querySelector('[data-testid=replay-controls]').offsetParent !== null;"), json!(true));

    // The speed set elsewhere (the API, another tab) is the speed shown.
    assert_eq!(http::request(addr, "POST", "/api/replay/speed", Some(r#"{"speed": 8}"#)).status, 200);
    driver.wait_script("8x selected", "return document.querySelector('[data-testid=replay-speed]').value === '8';");
    let status = driver.script("return document.querySelector('[data-testid=replay-status]').textContent;");
    assert!(status.as_str().is_some_and(|s| s.contains("8\u{d7}")), "{status}");
    assert_eq!(http::request(addr, "POST", "/api/replay/speed", Some(r#"{"speed": 3}"#)).status, 200);
    driver.wait_script("an unlisted 3x", "return document.querySelector('[data-testid=replay-speed]').value === '3';");

    // Seek by step from the page's own control.
    driver.script("document.querySelector('[data-testid=replay-step-input]').value = '3'; document.getElementById('rp-go').click(); return true;");
    driver.wait_for("step 3", |f| f.get("step").map(String::as_str) == Some("3"));
    assert_eq!(driver_state.status().step, 3);

    // To the end: the page shows what the API does, insight included.
    assert_eq!(http::request(addr, "POST", "/api/replay/seek", Some(r#"{"fraction": 1.0}"#)).status, 200);
    let api = snapshot(addr);
    let total = api.events_applied.to_string();
    let f = driver.wait_for("the end of the file", |f| f.get("events-applied") == Some(&total));
    assert_page_matches(&driver, &f, &api);
    assert_eq!(f["connection"], "ended");

    // Play from the page.
    assert_eq!(http::request(addr, "POST", "/api/replay/seek", Some(r#"{"position": 0}"#)).status, 200);
    driver.wait_for("the start", |f| f.get("events-applied").map(String::as_str) == Some("0"));
    driver.script("document.getElementById('rp-play').click(); return true;");
    driver.wait_script("playing", "return document.getElementById('rp-play').dataset.paused === 'false';");
    assert!(!driver_state.status().paused);
    save("web-replay.png", &driver.screenshot());
}

/// Screenshots of a real server for the docs: `STAGEHAND_URL=http://127.0.0.1:7878 cargo test -p
/// stagehand-web --test browser screenshots -- --ignored` while the demo runs
/// (`cargo run --release -p stagehand-examples --bin stagehand-demo -- --steps 30 --keep-serving`).
/// Takes `dashboard-live.png` once the run is a few steps in, then `dashboard-ended.png` when it
/// has ended (or `replay.png` for a replay), into `STAGEHAND_SHOTS` (default `docs/screenshots`).
#[test]
#[ignore = "needs a running server: STAGEHAND_URL"]
fn screenshots_of_a_running_server() {
    let Some((chromium, chromedriver)) = browser() else { return };
    let url = std::env::var("STAGEHAND_URL").expect("STAGEHAND_URL: the server's address (with ?token= if it has one)");
    let dir = std::env::var("STAGEHAND_SHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/screenshots"));
    std::fs::create_dir_all(&dir).expect("the screenshot folder");
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.open(&url);
    let state = |f: &HashMap<String, String>| f.get("connection").cloned().unwrap_or_default();
    let f = driver.wait_for("a run or a replay", |f| {
        matches!(state(f).as_str(), "paused" | "replaying") || f.get("events-applied").is_some_and(|n| n != "0")
    });
    if matches!(state(&f).as_str(), "paused" | "replaying") {
        driver.script("document.getElementById('rp-play').click(); return true;");
        driver.wait_for("the replay a few steps in", |f| f.get("step").and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s >= 8));
        driver.script("document.getElementById('rp-play').click(); return true;");
        std::thread::sleep(Duration::from_millis(500));
        std::fs::write(dir.join("replay.png"), driver.full_page_screenshot()).expect("saved");
        return;
    }
    if f.get("connection").map(String::as_str) == Some("live") {
        driver.wait_for("a few steps", |f| f.get("step").and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s >= 5));
        std::fs::write(dir.join("dashboard-live.png"), driver.full_page_screenshot()).expect("saved");
    }
    driver.wait_for("the end of the run", |f| f.get("connection").map(String::as_str) == Some("ended"));
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(dir.join("dashboard-ended.png"), driver.full_page_screenshot()).expect("saved");
}

/// Another server on another port of the same host, as a notebook or another user's dashboard
/// on a shared machine: answers a page, and keeps every request's head.
fn other_server() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = seen.clone();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            keep.lock().expect("lock").push(String::from_utf8_lossy(&head).into_owned());
            let body = "<html><body>another server</body></html>";
            let _ = write!(s, "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
        }
    });
    (addr, seen)
}

#[test]
fn the_token_never_leaves_the_servers_own_port() {
    let Some((chromium, chromedriver)) = browser() else { return };
    const TOKEN: &str = "never-leaves-this-port-1234";
    let hub = Arc::new(Hub::new());
    for e in run_events(3) {
        hub.ingest(e);
    }
    let mut config = ServerConfig::new("127.0.0.1:0");
    config.token = stagehand_web::TokenSetting::Fixed(TOKEN.into());
    let server = Server::start(&config, AppState::live(hub.clone(), stagehand_exporter::Metrics::new())).expect("starts");
    let (other, seen) = other_server();
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());

    // The printed address: the page gets in, and the token leaves the address bar.
    assert!(server.login_url().contains("#token="), "{}", server.login_url());
    driver.open(&server.login_url());
    let total = hub.snapshot().events_applied.to_string();
    driver.wait_for("the run, with the token", |f| f.get("events-applied") == Some(&total));
    let href = driver.script("return location.href;");
    assert!(!href.as_str().unwrap_or("").contains(TOKEN), "{href}");
    // Older links with ?token= still work, and also end without it.
    driver.open(&format!("{}/?token={TOKEN}", server.url()));
    driver.wait_for("the run again", |f| f.get("events-applied") == Some(&total));
    assert!(!driver.script("return location.href;").as_str().unwrap_or("").contains(TOKEN));

    // Another port of the same host: whatever the browser sends it carries no token.
    driver.open(&format!("http://{other}/"));
    driver.wait_script("the other page", "return document.body && document.body.textContent.includes('another server');");
    // And its page cannot read the dashboard's storage: another origin.
    let stored = driver.script("try { return sessionStorage.getItem('stagehand-token'); } catch (e) { return null; }");
    assert_eq!(stored, Value::Null);
    let heads = seen.lock().expect("lock").clone();
    assert!(!heads.is_empty(), "the other server was asked");
    for h in &heads {
        assert!(!h.contains(TOKEN), "another port received the token:\n{h}");
        assert!(!h.to_ascii_lowercase().contains("cookie"), "another port received a cookie:\n{h}");
    }
    // The browser holds no cookie for the host at all.
    driver.open(&server.url());
    driver.wait_for("the run, token from the tab's storage", |f| f.get("events-applied") == Some(&total));
    assert_eq!(driver.cmd("GET", "/cookie", None), json!([]), "no cookie");
    // A page without the token (a new tab of another session) is told how to get in.
    let fresh = tempfile::tempdir().expect("profile dir");
    let stranger = Driver::start(&chromium, &chromedriver, fresh.path());
    stranger.open(&server.url());
    stranger.wait_script("the token notice", "return document.getElementById('conn').textContent.includes('token');");
    server.shutdown().expect("shuts down");
}
