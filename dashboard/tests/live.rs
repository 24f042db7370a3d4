//! The live source against a tiny SSE server that speaks the `/api/stream` protocol.

mod common;

use common::*;
use stagehand_events::{Snapshot, StreamMessage};
use stagehand_dashboard::app::{Link, LiveStatus, Skipped, SourceStatus, State};
use stagehand_dashboard::source::{stream_url, Backoff, LiveSource, Source};
use stagehand_events::synthetic::{self, SyntheticRun};
use std::time::{Duration, Instant};

const QUICK: Backoff = Backoff {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(100),
};

fn connected(st: &SourceStatus) -> bool {
    matches!(st, SourceStatus::Live(LiveStatus { link: Link::Connected, .. }))
}

/// Polls until `done` holds; gives up (failing) after a generous limit so a bug cannot hang CI.
fn pump(src: &mut LiveSource, state: &mut State, done: impl Fn(&State, &SourceStatus) -> bool) {
    let limit = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    loop {
        src.poll(Instant::now(), &mut out);
        for u in out.drain(..) {
            state.ingest(u);
        }
        let status = src.status();
        if done(state, &status) {
            return;
        }
        assert!(Instant::now() < limit, "gave up waiting; status {status:?}, state at seq {}", state.snapshot.last_seq);
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn follows_the_stream_resyncs_after_lag_and_reconnects() {
    let ev = synthetic::events(SyntheticRun::default());
    let (a, b) = (200, 400);
    let mut first = vec![snapshot_of(&ev[..a]), Msg::Comment];
    first.extend(events_of(&ev[a..b]));
    first.push(Msg::Message(StreamMessage::Lagged { missed: 5 }));
    first.push(snapshot_of(&ev[..b + 5]));
    first.extend(events_of(&ev[b + 5..]));
    // The server goes away after the first connection; the second one starts over.
    let second = vec![snapshot_of(&ev)];
    let addr = sse_server(vec![(first, true), (second, false)]);
    let url = stream_url(Some(&addr)).expect("url");
    let mut src = LiveSource::connect(url.clone(), QUICK);
    let mut state = State::new();
    let full = Snapshot::from_events(&ev);
    pump(&mut src, &mut state, |s, _| s.resets >= 3);
    assert_eq!(state.snapshot, full);
    assert_eq!(state.lagged, 5);
    pump(&mut src, &mut state, |_, st| connected(st));
    assert_eq!(
        src.status(),
        SourceStatus::Live(LiveStatus { url, link: Link::Connected, skipped: Skipped::default() })
    );
    // The events that came one by one are in the log; none newer than the snapshot.
    assert_eq!(state.recent.back().map(|e| e.seq), Some(full.last_seq));
}

#[test]
fn shows_a_refused_connection_and_keeps_trying() {
    // A port that was free a moment ago: nothing listens there.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        l.local_addr().expect("addr").to_string()
    };
    let mut src = LiveSource::connect(stream_url(Some(&addr)).expect("url"), QUICK);
    let mut state = State::new();
    pump(&mut src, &mut state, |_, st| {
        matches!(st, SourceStatus::Live(LiveStatus { link: Link::Disconnected { attempt, .. }, .. }) if *attempt >= 3)
    });
    match src.status() {
        SourceStatus::Live(LiveStatus { link: Link::Disconnected { error, retry_in, .. }, url, .. }) => {
            assert!(!error.is_empty());
            assert!(!error.contains(&url), "the reason leaves the URL to the header: {error}");
            assert!(retry_in <= QUICK.max, "counts down from the back-off: {retry_in:?}");
        }
        SourceStatus::Live(LiveStatus { link: Link::Connecting { attempt }, .. }) => assert!(attempt >= 3),
        other => panic!("unexpected status {other:?}"),
    }
    assert_eq!(state.snapshot.events_applied, 0);
}

#[test]
fn pausing_stops_taking_updates_until_resumed() {
    let ev = synthetic::events(SyntheticRun::default());
    let addr = sse_server(vec![(vec![snapshot_of(&ev[..10])], false)]);
    let mut src = LiveSource::connect(stream_url(Some(&addr)).expect("url"), QUICK);
    let mut state = State::new();
    let mut out = Vec::new();
    src.control(stagehand_dashboard::app::Control::TogglePause, &mut out);
    assert!(src.paused());
    pump(&mut src, &mut state, |_, st| connected(st));
    // Once the reader has queued the snapshot, a paused source takes nothing from the queue.
    let limit = Instant::now() + Duration::from_secs(10);
    while src.queued_bytes() == 0 {
        assert!(Instant::now() < limit, "the reader never queued the snapshot");
        std::thread::sleep(Duration::from_millis(5));
    }
    let queued = src.queued_bytes();
    src.poll(Instant::now(), &mut out);
    assert!(out.is_empty());
    assert_eq!(src.queued_bytes(), queued, "a paused source leaves the queue alone");
    src.control(stagehand_dashboard::app::Control::TogglePause, &mut out);
    pump(&mut src, &mut state, |s, _| s.resets == 1);
    assert_eq!(state.snapshot.last_seq, 10);
}

/// A server that sends `body` as its SSE stream and then holds the connection open.
fn raw_server(body: Vec<u8>) -> String {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds a port");
    let addr = listener.local_addr().expect("has an address").to_string();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else { return };
        let mut r = BufReader::new(conn.try_clone().expect("clones the stream"));
        let mut line = String::new();
        while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) && line != "\r\n" {
            line.clear();
        }
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
        if conn.write_all(head.as_bytes()).and_then(|_| conn.write_all(&body)).is_err() {
            return;
        }
        let _ = conn.flush();
        // Hold the connection until the process ends.
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    });
    addr
}

#[test]
fn a_hostile_server_is_bounded_skipped_and_counted() {
    use stagehand_events::{BlockId, Event, EventKind, Phase};
    use stagehand_dashboard::source::sse::Limits;
    let limits = Limits { max_line: 1 << 20, max_message: 1 << 20 };
    let mut body = Vec::new();
    // One endless-looking line, three times the line bound.
    body.extend_from_slice(b"data: ");
    body.extend(std::iter::repeat_n(b'x', 3 << 20));
    body.extend_from_slice(b"\n\n");
    // Many short data lines that add up to twice the message bound.
    for _ in 0..2048 {
        body.extend_from_slice(b"data: ");
        body.extend(std::iter::repeat_n(b'y', 1024));
        body.push(b'\n');
    }
    body.push(b'\n');
    // A well-formed event whose block id would make the reducer allocate 4 G block views.
    let huge = Event::new(
        1,
        0,
        0,
        Phase::Idle,
        EventKind::BlockRegistered {
            block: BlockId(u32::MAX),
            name: "huge".into(),
            bytes: 1,
            exec_order: 0,
            file_backed: false,
            trainable: false,
        },
    );
    let msg = StreamMessage::Event { event: Box::new(huge) };
    body.extend(format!("event: event\ndata: {}\n\n", serde_json::to_string(&msg).expect("json")).bytes());
    // Not UTF-8, and not JSON.
    body.extend_from_slice(b"data: \xff\xfe\n\n");
    body.extend_from_slice(b"event: event\ndata: not json\n\n");
    // Then a good snapshot: the stream goes on.
    let ev = synthetic::events(SyntheticRun::default());
    let snap = StreamMessage::Snapshot { snapshot: Box::new(Snapshot::from_events(&ev)) };
    body.extend(format!("event: snapshot\ndata: {}\n\n", serde_json::to_string(&snap).expect("json")).bytes());

    let addr = raw_server(body);
    let mut src = LiveSource::connect_with(stream_url(Some(&addr)).expect("url"), QUICK, limits, stagehand_dashboard::source::Auth::none());
    let mut state = State::new();
    pump(&mut src, &mut state, |s, _| s.resets >= 1);
    assert_eq!(state.snapshot, Snapshot::from_events(&ev));
    assert!(state.snapshot.blocks.len() < 100);
    match src.status() {
        SourceStatus::Live(LiveStatus { skipped, link, .. }) => {
            assert_eq!(skipped, Skipped { oversize: 2, unreadable: 2, implausible: 1 });
            assert_eq!(link, Link::Connected, "a hostile message does not drop the connection");
        }
        other => panic!("not live: {other:?}"),
    }
}
