//! OpenTelemetry export: the SDK's in-memory exporters, and the OTLP/HTTP exporters built from
//! the `OTEL_*` variables against an in-process receiver.

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use stagehand_events::bus::feed;
use stagehand_events::Snapshot;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_exporter::OtelSink;
use std::io::{Read, Write};

#[test]
fn metrics_and_step_spans_reach_the_in_memory_exporters() {
    let metrics = InMemoryMetricExporter::default();
    let spans = InMemorySpanExporter::default();
    let mp = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(metrics.clone()).build())
        .build();
    let tp = SdkTracerProvider::builder().with_simple_exporter(spans.clone()).build();
    let mut sink = OtelSink::with_providers(mp, tp);
    let events = synthetic::events(SyntheticRun::finished(3));
    let snap = Snapshot::from_events(&events);
    feed(&mut sink, &events);
    sink.force_flush().expect("flushes");

    let finished = metrics.get_finished_metrics().expect("metrics");
    let last = finished.last().expect("one export at least");
    let mut seen = std::collections::BTreeMap::new();
    for scope in last.scope_metrics() {
        for m in scope.metrics() {
            seen.insert(m.name().to_owned(), m.unit().to_owned());
            if m.name() == "stagehand.prefetch.hits" {
                let AggregatedMetrics::F64(MetricData::Sum(sum)) = m.data() else {
                    panic!("prefetch hits is a sum")
                };
                let total: f64 = sum.data_points().map(|p| p.value()).sum();
                assert_eq!(total, snap.weights.prefetch_hits as f64);
                let p = sum.data_points().next().expect("a point");
                let keys: Vec<String> = p.attributes().map(|kv| kv.key.to_string()).collect();
                assert!(keys.contains(&"device".to_owned()) && keys.contains(&"device_name".to_owned()));
            }
            if m.name() == "stagehand.transfer" {
                let AggregatedMetrics::F64(MetricData::Sum(sum)) = m.data() else {
                    panic!("transfer bytes is a sum")
                };
                let total: f64 = sum.data_points().map(|p| p.value()).sum();
                assert_eq!(total, (snap.transfers.h2d.bytes + snap.transfers.d2h.bytes) as f64);
            }
        }
    }
    for (name, unit) in [
        ("stagehand.transfer", "By"),
        ("stagehand.transfer.duration", "s"),
        ("stagehand.phase.duration", "s"),
        ("stagehand.vram", "By"),
        ("stagehand.residency.blocks", "{block}"),
        ("stagehand.conductor.denials", "{request}"),
        ("stagehand.activation.restores", "{tensor}"),
        ("stagehand.loss", "1"),
        ("stagehand.transfers.inflight", "{copy}"),
        ("stagehand.step.time", "s"),
    ] {
        assert_eq!(seen.get(name).map(String::as_str), Some(unit), "{name} in {seen:?}");
    }

    let spans = spans.get_finished_spans().expect("spans");
    let steps: Vec<_> = spans.iter().filter(|s| s.name == "step").collect();
    assert_eq!(steps.len(), 3, "one span per step, all named 'step'");
    assert!(!spans.iter().any(|s| s.name.starts_with("step ")), "no span is named after its step number");
    let mut numbers = Vec::new();
    for step in &steps {
        let n = step.attributes.iter().find(|kv| kv.key.as_str() == "step").map(|kv| kv.value.to_string());
        numbers.push(n.expect("the step number is an attribute"));
        let children: Vec<_> = spans
            .iter()
            .filter(|s| s.parent_span_id == step.span_context.span_id())
            .map(|s| s.name.to_string())
            .collect();
        assert_eq!(children, ["step_begin", "forward", "backward", "optimizer", "step_end"]);
        assert!(step.end_time >= step.start_time);
    }
    numbers.sort();
    assert_eq!(numbers, ["1", "2", "3"]);
    sink.shutdown().expect("shuts down");
}

/// A minimal OTLP/HTTP receiver: answers every POST with an empty protobuf response and
/// reports the request paths.
fn receiver() -> (String, std::sync::mpsc::Receiver<(String, String, Vec<u8>)>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            // Read the head, then the body by its length.
            let (head, body_len, head_len) = loop {
                let n = match s.read(&mut chunk) { Ok(0) | Err(_) => break (String::new(), 0, 0), Ok(n) => n };
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..i]).to_string();
                    let len = head.lines()
                        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                        .unwrap_or(0);
                    break (head, len, i + 4);
                }
            };
            while buf.len() < head_len + body_len {
                match s.read(&mut chunk) { Ok(0) | Err(_) => break, Ok(n) => buf.extend_from_slice(&chunk[..n]) }
            }
            let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
            let ctype = head.lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type:").map(|v| v.trim().to_owned()))
                .unwrap_or_default();
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let body = buf.get(head_len..).unwrap_or_default().to_vec();
            let _ = tx.send((path, ctype, body));
        }
    });
    (format!("http://{addr}"), rx)
}

/// Whether `needle` occurs in `hay` (protobuf carries strings as plain bytes).
fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn from_env_exports_over_otlp_http_to_the_configured_endpoint() {
    // The only test of this binary that touches the process environment.
    for k in ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER"] {
        std::env::remove_var(k);
    }
    assert!(stagehand_exporter::otlp::from_env().expect("nothing asked").is_none(), "no endpoint, no exporter");

    let (endpoint, rx) = receiver();
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
    std::env::set_var("OTEL_SERVICE_NAME", "stagehand-test");
    let hub = stagehand_events::Hub::new();
    assert!(stagehand_exporter::otlp::attach_from_env(&hub).expect("builds from env"), "an endpoint, an exporter");
    let sink = stagehand_exporter::otlp::from_env().expect("builds").expect("asked for");
    let mut sink = sink;
    feed(&mut sink, synthetic::events(SyntheticRun::finished(2)));
    sink.shutdown().expect("exports and shuts down");
    let got: Vec<(String, String, Vec<u8>)> = rx.try_iter().collect();
    let metrics: Vec<&Vec<u8>> = got.iter().filter(|(p, c, _)| p == "/v1/metrics" && c == "application/x-protobuf").map(|g| &g.2).collect();
    assert!(!metrics.is_empty(), "{:?}", got.iter().map(|g| &g.0).collect::<Vec<_>>());
    assert!(metrics.iter().any(|b| contains(b, "stagehand.transfer.duration") && contains(b, "stagehand-test")));
    let traces: Vec<&Vec<u8>> = got.iter().filter(|(p, _, _)| p == "/v1/traces").map(|g| &g.2).collect();
    assert!(traces.iter().any(|b| contains(b, "forward") && contains(b, "step")), "spans were sent");
    assert!(!traces.iter().any(|b| contains(b, "step 1")), "no span named after its step number");

    std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
    let err = stagehand_exporter::otlp::from_env().expect_err("grpc is not in this build");
    assert!(err.to_string().contains("http/protobuf"), "{err}");
    std::env::remove_var("OTEL_EXPORTER_OTLP_PROTOCOL");
    drop(hub);
}
