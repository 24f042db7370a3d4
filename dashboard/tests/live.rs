//! The live source against a tiny SSE server that speaks the `/api/stream` protocol.

mod common;

use common::*;
use stagehand::events::{Snapshot, StreamMessage};
use stagehand_dashboard::app::{SourceStatus, State};
use stagehand_dashboard::source::{stream_url, Backoff, LiveSource, Source};
use stagehand::events::synthetic::{self, SyntheticRun};
use std::time::{Duration, Instant};

const QUICK: Backoff = Backoff {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(100),
};

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
    pump(&mut src, &mut state, |_, st| matches!(st, SourceStatus::Connected { .. }));
    assert_eq!(src.status(), SourceStatus::Connected { url });
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
        matches!(st, SourceStatus::Disconnected { attempt, .. } if *attempt >= 3)
    });
    match src.status() {
        SourceStatus::Disconnected { error, retry_in, .. } => {
            assert!(!error.is_empty());
            assert!(retry_in >= QUICK.delay(3), "back-off grows: {retry_in:?}");
        }
        SourceStatus::Connecting { attempt, .. } => assert!(attempt >= 3),
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
    pump(&mut src, &mut state, |_, st| matches!(st, SourceStatus::Connected { .. }));
    // Give the reader time to have queued the snapshot, then check nothing was taken.
    std::thread::sleep(Duration::from_millis(100));
    src.poll(Instant::now(), &mut out);
    assert!(out.is_empty());
    src.control(stagehand_dashboard::app::Control::TogglePause, &mut out);
    pump(&mut src, &mut state, |s, _| s.resets == 1);
    assert_eq!(state.snapshot.last_seq, 10);
}
