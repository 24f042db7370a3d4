//! The web page in a real headless browser (Debian's chromium, driven over WebDriver by
//! chromedriver): it loads against a real server, receives live events, and the figures it
//! shows match `/api/snapshot`. A screenshot is kept in `target/artifacts/web-dashboard.png`.

mod http;

use base64::Engine as _;
use serde_json::{json, Value};
use stagehand::events::{Bus, Hub, Snapshot};
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand_web::Server;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

struct Driver {
    child: Child,
    addr: SocketAddr,
    session: String,
}

impl Driver {
    fn start(chromium: &PathBuf, chromedriver: &PathBuf, profile: &std::path::Path) -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on {addr}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                         "--disable-background-networking", "--disable-component-update",
                         "--disable-sync", "--disable-dev-shm-usage", "--window-size=1440,1280",
                         format!("--user-data-dir={}", profile.display())],
            }
        }}});
        let r = http::request(addr, "POST", "/session", Some(&caps.to_string()));
        let v = r.json();
        let session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_owned();
        Driver { child, addr, session }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string());
        let r = http::request(self.addr, method, &format!("/session/{}{path}", self.session), body.as_deref());
        let v = r.json();
        assert_eq!(r.status, 200, "WebDriver {method} {path}: {v}");
        v["value"].clone()
    }

    fn script(&self, script: &str) -> Value {
        self.cmd("POST", "/execute/sync", Some(json!({ "script": script, "args": [] })))
    }

    /// Every figure the page shows: data-testid -> data-value (or the text).
    fn figures(&self) -> HashMap<String, String> {
        let v = self.script(
            "return Array.from(document.querySelectorAll('[data-testid]')).map(e => \
             [e.dataset.testid, e.dataset.value !== undefined ? e.dataset.value : (e.dataset.state || e.textContent)]);",
        );
        v.as_array()
            .expect("pairs")
            .iter()
            .map(|p| (p[0].as_str().unwrap_or("").to_owned(), p[1].as_str().unwrap_or("").to_owned()))
            .collect()
    }

    /// Polls the page until `done` holds (the page updates asynchronously); fails after a
    /// generous deadline with what the page showed.
    fn wait_for(&self, what: &str, done: impl Fn(&HashMap<String, String>) -> bool) -> HashMap<String, String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let f = self.figures();
            if done(&f) {
                return f;
            }
            assert!(Instant::now() < deadline, "the page never showed {what}: {f:#?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = http::request(self.addr, "DELETE", &format!("/session/{}", self.session), None);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn dashboard_shows_the_live_run_as_the_api_does() {
    let (Some(chromium), Some(chromedriver)) = (find(&["chromium", "chromium-browser"]), find(&["chromedriver"])) else {
        let msg = "chromium and chromedriver are needed for the browser test: \
                   apt-get install chromium chromium-driver (scripts/test does)";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{msg}");
        }
        eprintln!("skipping: {msg}");
        return;
    };
    let hub = Arc::new(Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    let profile = tempfile::tempdir().expect("profile dir");
    let driver = Driver::start(&chromium, &chromedriver, profile.path());
    driver.cmd("POST", "/url", Some(json!({ "url": server.url() })));
    driver.wait_for("a live connection", |f| f.get("connection").map(String::as_str) == Some("live"));

    // The run starts after the page is connected: everything it shows arrived live.
    let bus = Bus::with_hub(hub.clone(), stagehand::events::bus::DEFAULT_QUEUE_CAPACITY);
    let publisher = {
        let bus = bus.clone();
        std::thread::spawn(move || synthetic::publish(SyntheticRun::finished(6), &bus, Duration::from_millis(150)))
    };
    publisher.join().expect("publisher");
    bus.flush();
    let api: Snapshot = serde_json::from_slice(&http::request(server.addr(), "GET", "/api/snapshot", None).body).expect("snapshot");
    let total = api.events_applied.to_string();
    let f = driver.wait_for("the whole run", |f| f.get("events-applied") == Some(&total));

    assert_eq!(f["run-ended"], "true");
    assert!(f["events-received"].parse::<u64>().expect("number") > 1000, "live events reached the page");
    assert_eq!(f["connection"], "live");
    assert_eq!(f["last-seq"], api.last_seq.to_string());
    assert_eq!(f["step"], api.step.to_string());
    assert_eq!(f["dropped-banner"], api.dropped_events.to_string());
    let v = api.vram.expect("vram");
    for (id, want) in [
        ("vram-allocated", v.allocated_bytes), ("vram-reserved", v.reserved_bytes),
        ("vram-peak", v.peak_allocated_bytes), ("vram-high", api.spill_watermarks().map_or(0, |w| w.0)),
        ("vram-low", api.spill_watermarks().map_or(0, |w| w.1)), ("vram-budget", api.vram_budget_bytes().unwrap_or(0)),
        ("prefetch-hits", api.weights.prefetch_hits), ("prefetch-misses", api.weights.prefetch_misses),
        ("evictions", api.weights.evictions),
        ("h2d-inflight", api.transfers.h2d.inflight as u64), ("h2d-count", api.transfers.h2d.count),
        ("h2d-bytes", api.transfers.h2d.bytes), ("d2h-count", api.transfers.d2h.count),
        ("d2h-bytes", api.transfers.d2h.bytes),
        ("slot-grants", api.conductor.slot_grants), ("slot-denials", api.conductor.slot_denials),
        ("act-saved", api.activations.saved), ("act-kept", api.activations.kept),
        ("act-spilled", api.activations.spilled), ("act-restored", api.activations.restored),
        ("act-predicted", api.activations.predicted), ("act-spill-bytes", api.activations.spill_bytes),
        ("act-restore-bytes", api.activations.restore_bytes),
        ("cond-grants", api.conductor.grants), ("cond-partials", api.conductor.partials),
        ("cond-denials", api.conductor.denials), ("cond-active", api.conductor.active_reservations),
        ("cond-active-bytes", api.conductor.active_bytes),
    ] {
        assert_eq!(f.get(id).map(String::as_str), Some(want.to_string().as_str()), "{id}");
    }
    let counts = api.residency_counts();
    for st in stagehand::events::BlockState::ALL {
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
    let lines = driver.script("return document.querySelectorAll('[data-testid=event-log] div').length;");
    assert!(lines.as_u64().is_some_and(|n| n > 100), "event log lines: {lines}");
    assert_eq!(driver.script("return document.querySelector('[data-testid=replay-controls]').offsetParent === null;"), json!(true),
        "no replay controls on a live run");
    let charts = driver.script("return document.querySelectorAll('.uplot canvas').length;");
    assert!(charts.as_u64().is_some_and(|n| n >= 2), "uPlot charts drawn: {charts}");

    let png = driver.cmd("GET", "/screenshot", None);
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png.as_str().expect("base64"))
        .expect("decodes");
    assert!(bytes.starts_with(b"\x89PNG"));
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    std::fs::write(dir.join("web-dashboard.png"), bytes).expect("screenshot saved");
    drop(driver);
    server.shutdown().expect("shuts down");
}
