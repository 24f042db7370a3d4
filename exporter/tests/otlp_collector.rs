//! A hostile or stuck OTLP collector against the exporter: an answer without end is cut off
//! (the process does not grow with it), and a collector that never answers costs the run's end
//! a bounded wait, said as an error. This binary sets the process environment: one test.

use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::bus::feed;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Resident memory of this process, in MiB.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

/// A collector that answers every request with `200` and then streams zeros without end (or
/// until the client goes); counts the bytes it managed to send.
fn endless_collector() -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr");
    let sent = Arc::new(AtomicU64::new(0));
    let count = sent.clone();
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            let count = count.clone();
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = [0u8; 65536];
                let _ = s.read(&mut buf);
                if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n\r\n").is_err() {
                    return;
                }
                let zeros = vec![0u8; 1 << 20];
                while s.write_all(&zeros).is_ok() {
                    count.fetch_add(zeros.len() as u64, Ordering::Relaxed);
                }
            });
        }
    });
    (format!("http://{addr}"), sent)
}

/// A collector that accepts and never answers.
fn silent_collector() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    format!("http://{addr}")
}

fn export_a_run(endpoint: &str) -> stagehand_exporter::Result<()> {
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    let mut sink = stagehand_exporter::otlp::from_env().expect("builds").expect("asked for");
    feed(&mut sink, synthetic::events(SyntheticRun::finished(3)));
    sink.force_flush().ok();
    sink.shutdown()
}

#[test]
fn a_hostile_collector_neither_bloats_nor_holds_the_run() {
    for k in ["OTEL_SDK_DISABLED", "OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        std::env::remove_var(k);
    }
    std::env::set_var("OTEL_EXPORTER_OTLP_TIMEOUT", "3000");
    // An answer without end: read only up to the bound, so the process does not grow with it.
    let (endpoint, sent) = endless_collector();
    let before = rss_mib();
    let _ = export_a_run(&endpoint);
    let grown = rss_mib() - before;
    let streamed = sent.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
    assert!(grown < 64.0, "the process grew {grown:.0} MiB while the collector streamed {streamed:.0} MiB");
    // A collector that never answers: the last export is given up on, and the error says so.
    let err = export_a_run(&silent_collector()).expect_err("the last export never went");
    assert!(err.to_string().contains("did not take the last export"), "{err}");
}
