//! Tests of the file-backed replay against the in-memory one.

use super::*;
use crate::bus::EventSink;
use super::file::RECENT_KEPT;
use crate::jsonl::{JsonlSink, OpenMode, ReadReport};
use crate::synthetic::{self, SyntheticRun};
use std::time::Duration;

fn write(path: &std::path::Path, events: &[Event], compress: bool) {
    let mut sink = JsonlSink::open_with(path, OpenMode::CreateNew, compress, None).expect("opens");
    for (i, e) in events.iter().enumerate() {
        sink.on_event(e);
        if i % 500 == 0 {
            sink.flush(); // many frames, as a live run writes them
        }
    }
}

#[test]
fn a_file_replay_reaches_every_position_with_the_in_memory_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = synthetic::events(SyntheticRun { blocks: 10, steps: 12, end_mid_step: true });
    let n = events.len();
    for (name, compress) in [("r.jsonl", false), ("r.jsonl.zst", true)] {
        let path = dir.path().join(name);
        write(&path, &events, compress);
        let mut r = FileReplay::open(&path).expect("opens");
        assert_eq!(r.position(), 0);
        r.wait_indexed();
        assert_eq!(r.len(), n, "{name}");
        let cps = r.checkpoints();
        assert!(cps > 5, "{name}: {cps} checkpoints");
        for target in [n / 2, 3, n - 1, n / 3, 0, n, 17, 2 * n / 3] {
            r.seek(target).expect("seeks");
            assert_eq!(r.position(), target);
            assert_eq!(r.snapshot(), &Snapshot::from_events(&events[..target]), "{name} at {target}");
        }
        // Stepping by training steps lands just after each step_begin, as the in-memory one.
        let mut mem = Replay::new(events.clone());
        r.to_start().expect("start");
        for k in [1i64, 1, 3, -2, -1, 1] {
            mem.step_training(k);
            r.step_training(k).expect("steps");
            assert_eq!(r.position(), mem.position(), "{name}: step_training({k})");
        }
        r.step_events(-5).expect("back");
        mem.step_events(-5);
        assert_eq!(r.snapshot(), mem.snapshot());
        let t = events[n / 2].t_ns;
        r.seek_time(t).expect("seeks by time");
        mem.seek_time(t);
        assert_eq!(r.position(), mem.position(), "{name}: seek_time");
        assert_eq!(r.report().0.skipped_total, 0);
    }
}

#[test]
fn a_file_replay_plays_at_recorded_speed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = synthetic::events(SyntheticRun::finished(2));
    let path = dir.path().join("p.jsonl");
    write(&path, &events, false);
    let mut r = FileReplay::open(&path).expect("opens");
    let t0 = Instant::now();
    let first = r.tick(t0).expect("tick");
    assert!(matches!(first, Played::Advanced(ref v) if v.len() == 1), "{first:?}");
    // 1 ms of recorded time later: exactly the events due by then.
    let due = events[0].t_ns + 1_000_000;
    let expect = events.iter().filter(|e| e.t_ns <= due).count();
    r.tick(t0 + Duration::from_millis(1)).expect("tick");
    assert_eq!(r.position(), expect);
    match r.seek(expect + 3).expect("seek") {
        Played::Advanced(v) => assert_eq!(v, events[expect..expect + 3].to_vec()),
        other => panic!("a short move forward hands over its events: {other:?}"),
    }
    assert_eq!(r.recent().back(), events.get(expect + 2));
}

/// Counts what the index pass hands over, and keeps the report it ends with.
struct Counter(std::sync::Arc<std::sync::Mutex<(usize, Option<ReadReport>)>>);

impl IndexObserver for Counter {
    fn on_event(&mut self, _: &Event) {
        self.0.lock().expect("not poisoned").0 += 1;
    }
    fn finish(&mut self, report: &ReadReport, error: Option<&str>) {
        assert_eq!(error, None);
        self.0.lock().expect("not poisoned").1 = Some(report.clone());
    }
}

#[test]
fn the_index_pass_finds_steps_hands_events_to_an_observer_and_the_replay_holds_few() {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = synthetic::events(SyntheticRun { blocks: 10, steps: 12, end_mid_step: true });
    let n = events.len();
    let path = dir.path().join("o.jsonl.zst");
    write(&path, &events, true);
    let seen = std::sync::Arc::new(std::sync::Mutex::new((0, None)));
    let mut r = FileReplay::open_observed(&path, Box::new(Counter(seen.clone()))).expect("opens");
    r.wait_indexed();
    {
        let seen = seen.lock().expect("not poisoned");
        assert_eq!(seen.0, n, "every event, once");
        assert_eq!(seen.1.as_ref().map(|rep| rep.events), Some(n as u64), "finished before the index is done");
    }
    // Step starts as the in-memory replay finds them.
    let mut mem = Replay::new(events.clone());
    mem.step_training(3);
    let step = mem.snapshot().step;
    assert_eq!(r.step_start(step), Some(mem.position()));
    assert_eq!(r.step_range(), Some((1, events.iter().map(|e| e.step).max().expect("events"))));
    assert_eq!(r.step_start(10_000), None);
    // At the end: a bounded number of events held, and the applied ones read again in order.
    r.to_end().expect("end");
    assert!(r.events_held() <= RECENT_KEPT + 1, "{} held", r.events_held());
    r.seek(n / 2).expect("seeks");
    assert_eq!(r.applied().expect("reads").collect::<Vec<_>>(), events[..n / 2].to_vec());
}

#[test]
fn a_large_snapshot_makes_fewer_checkpoints_not_more_memory() {
    use crate::model::{BlockId, EventKind, Phase};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("wide.jsonl.zst");
    // Many blocks with long names: a snapshot of a few MiB, and events after it to index.
    let name = "x".repeat(200);
    let mut events = Vec::new();
    let mut seq = 0;
    let mut ev = |kind| {
        seq += 1;
        Event::new(seq, seq * 1000, 1, Phase::Forward, kind)
    };
    for b in 0..20_000u32 {
        events.push(ev(EventKind::BlockRegistered {
            block: BlockId(b),
            name: format!("{name}{b}"),
            bytes: 1,
            exec_order: b,
            file_backed: false,
            trainable: false,
        }));
    }
    for i in 0..60_000u32 {
        events.push(ev(EventKind::PrefetchHit { block: BlockId(i % 20_000) }));
    }
    write(&path, &events, true);
    let mut r = FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    assert_eq!(r.len(), events.len());
    let snapshot = super::index::json_size_of(&Snapshot::from_events(&events));
    assert!(snapshot > super::index::CHECKPOINT_BUDGET / 8, "a large snapshot: {snapshot} bytes");
    assert!(r.checkpoint_bytes() <= super::index::CHECKPOINT_BUDGET, "{} bytes of checkpoints", r.checkpoint_bytes());
    assert!(r.checkpoints() >= 2, "still some checkpoints: {}", r.checkpoints());
    // Seeks still land on the right state.
    for target in [events.len() - 1, 30_000, 25_000] {
        r.seek(target).expect("seeks");
        assert_eq!(r.snapshot(), &Snapshot::from_events(&events[..target]), "at {target}");
    }
}
