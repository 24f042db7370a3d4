//! A headless Chromium driven over WebDriver (chromedriver), for the page tests.

#![allow(dead_code)]

use crate::http;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

pub struct Driver {
    child: Child,
    addr: SocketAddr,
    session: String,
}

impl Driver {
    pub fn start(chromium: &PathBuf, chromedriver: &PathBuf, profile: &std::path::Path) -> Driver {
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

    pub fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string());
        let r = http::request(self.addr, method, &format!("/session/{}{path}", self.session), body.as_deref());
        let v = r.json();
        assert_eq!(r.status, 200, "WebDriver {method} {path}: {v}");
        v["value"].clone()
    }

    pub fn script(&self, script: &str) -> Value {
        self.cmd("POST", "/execute/sync", Some(json!({ "script": script, "args": [] })))
    }

    /// Every figure the page shows: data-testid -> data-value (or the text).
    pub fn figures(&self) -> HashMap<String, String> {
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
    pub fn wait_for(&self, what: &str, done: impl Fn(&HashMap<String, String>) -> bool) -> HashMap<String, String> {
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


/// Chromium and chromedriver, or `None` (with a message; a failure on CI, where they must be).
pub fn browser() -> Option<(PathBuf, PathBuf)> {
    match (find(&["chromium", "chromium-browser"]), find(&["chromedriver"])) {
        (Some(c), Some(d)) => Some((c, d)),
        _ => {
            let msg = "chromium and chromedriver are needed for the browser test: \
                       apt-get install chromium chromium-driver (scripts/test does)";
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{msg}");
            }
            eprintln!("skipping: {msg}");
            None
        }
    }
}

impl Driver {
    /// Opens `url` in the session.
    pub fn open(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    /// A PNG of the window.
    pub fn screenshot(&self) -> Vec<u8> {
        use base64::Engine as _;
        let png = self.cmd("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64"))
            .expect("decodes");
        assert!(bytes.starts_with(b"\x89PNG"));
        bytes
    }

    /// A PNG of the whole page: the window is made as tall as the page for the shot.
    pub fn full_page_screenshot(&self) -> Vec<u8> {
        let height = self.script("return Math.ceil(document.documentElement.scrollHeight);").as_u64().unwrap_or(1280);
        let width = self.script("return window.outerWidth;").as_u64().unwrap_or(1440);
        self.cmd("POST", "/window/rect", Some(json!({ "width": width, "height": height + 140 })));
        std::thread::sleep(Duration::from_millis(300)); // charts redraw on resize
        let png = self.screenshot();
        self.cmd("POST", "/window/rect", Some(json!({ "width": width, "height": 1280 })));
        png
    }

    /// Polls a script until it returns `true`; fails after a generous deadline.
    pub fn wait_script(&self, what: &str, script: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.script(script) != json!(true) {
            assert!(Instant::now() < deadline, "the page never showed {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
