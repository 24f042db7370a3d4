//! A real server on port 0 during a (synthetic) run: the SSE stream and the WebSocket stream
//! read as clients do, and the picture each builds checked against `/api/snapshot`.

mod http;

use stagehand_events::{Bus, Snapshot, StreamMessage};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_web::Server;
use std::sync::Arc;
use std::time::Duration;

/// What a stream client builds: the snapshot it was sent, with every later event applied.
#[derive(Default)]
struct Picture {
    local: Option<Snapshot>,
    events: u64,
    snapshots: u64,
    lagged: u64,
}

impl Picture {
    /// Takes one message; true once the run has ended.
    fn take(&mut self, msg: StreamMessage) -> bool {
        match msg {
            StreamMessage::Snapshot { snapshot } => {
                self.snapshots += 1;
                self.local = Some(*snapshot);
            }
            StreamMessage::Event { event } => {
                self.events += 1;
                let snap = self.local.as_mut().expect("a snapshot comes first");
                snap.apply(&event);
                return snap.ended;
            }
            StreamMessage::Lagged { missed } => {
                assert!(missed > 0);
                self.lagged += 1;
            }
        }
        false
    }
}

/// A synthetic run of `steps` steps published on the hub from another thread.
fn publish(hub: &Arc<stagehand_events::Hub>, steps: u64) -> (Bus, std::thread::JoinHandle<u64>) {
    let bus = Bus::with_hub(hub.clone(), stagehand_events::bus::DEFAULT_QUEUE_CAPACITY);
    let b = bus.clone();
    let publisher = std::thread::spawn(move || synthetic::publish(SyntheticRun::finished(steps), &b, Duration::from_millis(20)));
    (bus, publisher)
}

#[test]
fn sse_stream_follows_a_run_from_snapshot_to_its_end() {
    let hub = Arc::new(stagehand_events::Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    let addr = server.addr();
    assert!(addr.ip().is_loopback());
    assert_eq!(server.stream_clients(), 0);
    let mut sse = http::Sse::open(addr);
    assert_eq!(server.stream_clients(), 1, "subscribed before the answer's headers");

    let (bus, publisher) = publish(&hub, 5);

    let mut picture = Picture::default();
    while let Some((name, data)) = sse.next() {
        if name == "comment" {
            continue;
        }
        let msg: StreamMessage = serde_json::from_str(&data).expect("a stream message");
        assert_eq!(msg.name(), name, "the SSE event name is the message type");
        if picture.take(msg) {
            break;
        }
    }
    assert_eq!(publisher.join().expect("publisher"), synthetic::events(SyntheticRun::finished(5)).len() as u64);
    bus.flush();
    let Picture { local, events, snapshots, lagged } = picture;
    let local = local.expect("snapshot received");
    assert!(local.ended, "the stream reached run_ended");
    assert!(snapshots >= 1 && events > 500, "{snapshots} snapshots, {events} events, {lagged} lagged");

    let api = http::request(addr, "GET", "/api/snapshot", None);
    assert_eq!(api.status, 200);
    let api: Snapshot = serde_json::from_slice(&api.body).expect("a snapshot");
    assert_eq!(api.last_seq, local.last_seq);
    assert_eq!(api.events_applied, local.events_applied);
    assert_eq!(api.blocks, local.blocks);
    assert_eq!(api.weights.prefetch_hits, local.weights.prefetch_hits);
    assert_eq!(api.transfers.h2d.bytes, local.transfers.h2d.bytes);
    assert_eq!(api.conductor.denials_by_reason, local.conductor.denials_by_reason);
    assert_eq!(api.steps.len(), 5);

    let metrics = http::request(addr, "GET", "/metrics", None);
    assert_eq!(metrics.status, 200);
    let hits = http::metric(&metrics.text(), "stagehand_prefetch_hits_total");
    assert_eq!(hits, Some(local.weights.prefetch_hits as f64));
    assert!(metrics.text().contains("device_name=\"host (simulated)\""));

    server.shutdown().expect("shuts down");
    assert!(std::net::TcpStream::connect(addr).is_err(), "the port is closed");
}

#[test]
fn websocket_stream_follows_a_run_from_snapshot_to_its_end() {
    let hub = Arc::new(stagehand_events::Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    let addr = server.addr();
    let (mut socket, response) = tungstenite::connect(format!("ws://{addr}/api/ws")).expect("upgrades");
    assert_eq!(response.status(), 101);

    let (bus, publisher) = publish(&hub, 4);

    let mut picture = Picture::default();
    loop {
        // Pings are answered by the client library as it reads.
        let text = match socket.read().expect("the stream stays open until the run ends") {
            tungstenite::Message::Text(t) => t,
            tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_) => continue,
            other => panic!("unexpected frame {other:?}"),
        };
        if picture.take(serde_json::from_str(&text).expect("a stream message")) {
            break;
        }
    }
    publisher.join().expect("publisher");
    bus.flush();
    let Picture { local, events, snapshots, .. } = picture;
    let local = local.expect("snapshot received");
    assert!(snapshots >= 1 && events > 300, "{snapshots} snapshots, {events} events");

    let api: Snapshot = serde_json::from_slice(&http::request(addr, "GET", "/api/snapshot", None).body).expect("a snapshot");
    assert_eq!(api.last_seq, local.last_seq);
    assert_eq!(api.events_applied, local.events_applied);
    assert_eq!(api.blocks, local.blocks);
    assert_eq!(api.transfers, local.transfers);
    assert_eq!(api.steps.len(), 4);

    socket.close(None).expect("closes");
    server.shutdown().expect("shuts down");
}

/// The page's stream: views computed by the server, throttled, each with the log lines since
/// the last, to the end of the run.
#[test]
fn view_stream_follows_a_run_with_server_computed_views() {
    let hub = Arc::new(stagehand_events::Hub::new());
    let server = Server::live(hub.clone(), "127.0.0.1:0").expect("starts");
    let addr = server.addr();
    let mut sse = http::Sse::open_path(addr, "/api/view/stream", "");
    let (bus, publisher) = publish(&hub, 5);
    let (mut views, mut last_i, mut lines, mut gaps) = (0u64, None::<u64>, 0u64, 0u64);
    let mut last = serde_json::Value::Null;
    while let Some((name, data)) = sse.next() {
        if name == "comment" {
            continue;
        }
        assert_eq!(name, "view");
        let msg: serde_json::Value = serde_json::from_str(&data).expect("a view message");
        views += 1;
        if msg["log"]["reset"] == true {
            last_i = None;
        }
        for l in msg["log"]["lines"].as_array().expect("lines") {
            let i = l["i"].as_u64().expect("a position");
            if let Some(prev) = last_i {
                assert!(i > prev, "lines move forward: {prev} then {i}");
                gaps += u64::from(i > prev + 1);
            }
            last_i = Some(i);
            lines += 1;
        }
        let ended = msg["view"]["header"]["ended"] == true;
        last = msg;
        if ended {
            break;
        }
    }
    publisher.join().expect("publisher");
    bus.flush();
    let api: Snapshot = serde_json::from_slice(&http::request(addr, "GET", "/api/snapshot", None).body).expect("a snapshot");
    assert_eq!(last["view"]["header"]["events_applied"], api.events_applied);
    assert_eq!(last["log"]["lines"].as_array().and_then(|l| l.last()).map(|l| l["kind"].clone()), Some("run_ended".into()));
    assert!(views >= 1 && views * 10 < api.events_applied, "{views} views for {} events: throttled, not one per event", api.events_applied);
    assert!(lines > 0, "{lines} log lines, {gaps} gaps");
    server.shutdown().expect("shuts down");
}
