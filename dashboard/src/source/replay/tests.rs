use super::*;
use crate::app::State;
use stagehand_events::synthetic::{events, jsonl, SyntheticRun};
use stagehand_events::{BlockId, EventKind, EventSink, JsonlSink, OpenMode, Phase};
use std::time::Duration;

fn drive(src: &mut ReplaySource, c: Control, state: &mut State) {
    let mut out = Vec::new();
    src.control(c, &mut out);
    for u in out {
        state.ingest(u);
    }
    assert_eq!(&state.snapshot, replay_snapshot(src), "after {c:?}");
}

/// Writes `events` to `path` as the runtime's sink does (zstd when the name ends in `.zst`).
fn write(path: &Path, events: &[Event]) {
    let compress = path.extension().is_some_and(|e| e == "zst");
    let mut sink = JsonlSink::open_with(path, OpenMode::CreateNew, compress, None).expect("opens");
    for e in events {
        sink.on_event(e);
    }
    sink.flush();
}

fn play_to_end(src: &mut ReplaySource) -> State {
    let mut out = Vec::new();
    // From the start: a followed source may already have played some or all of its events to
    // the polls that waited for them (its clock runs), which a fresh state did not see.
    src.control(Control::ToStart, &mut out);
    src.control(Control::ToEnd, &mut out);
    src.poll(Instant::now(), &mut out);
    let mut state = State::new();
    for u in out {
        state.ingest(u);
    }
    state
}

#[test]
fn replay_controls_keep_the_state_equal_to_the_replay() {
    let ev = events(SyntheticRun::default());
    let mut src = ReplaySource::from_events(ev.clone(), "mem");
    let mut state = State::new();
    drive(&mut src, Control::StepTraining(1), &mut state);
    assert_eq!(state.snapshot.step, 1);
    drive(&mut src, Control::StepEvents(5), &mut state);
    drive(&mut src, Control::StepEvents(-3), &mut state);
    assert_eq!(state.recent.back().map(|e| e.seq), Some(src.position() as u64));
    drive(&mut src, Control::StepTraining(1), &mut state);
    assert_eq!(state.snapshot.step, 2);
    drive(&mut src, Control::StepTraining(-1), &mut state);
    assert_eq!(state.snapshot.step, 1);
    drive(&mut src, Control::SeekFraction(0.5), &mut state);
    drive(&mut src, Control::ToEnd, &mut state);
    assert_eq!(state.snapshot, Snapshot::from_events(&ev));
    drive(&mut src, Control::ToStart, &mut state);
    assert_eq!(state.snapshot.events_applied, 0);
    assert!(state.recent.is_empty());
    assert!(src.paused());
    drive(&mut src, Control::Faster, &mut state);
    assert_eq!(src.replay_status().speed, 2.0);
    drive(&mut src, Control::Slower, &mut state);
    drive(&mut src, Control::Slower, &mut state);
    assert_eq!(src.replay_status().speed, 0.5);
    drive(&mut src, Control::TogglePause, &mut state);
    assert!(!src.paused());
}

#[test]
fn a_file_plays_through_the_indexed_replay_with_the_same_controls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ev = events(SyntheticRun::finished(20));
    for name in ["run.jsonl", "run.jsonl.zst"] {
        let path = dir.path().join(name);
        write(&path, &ev);
        let mut src = ReplaySource::open(&path, false).expect("opens");
        src.configure(1.0, true);
        assert!(!src.is_loading());
        assert_eq!(src.len(), ev.len(), "{name}");
        let mut state = State::new();
        drive(&mut src, Control::StepTraining(3), &mut state);
        assert_eq!(state.snapshot.step, 3, "{name}");
        drive(&mut src, Control::SeekFraction(0.7), &mut state);
        drive(&mut src, Control::StepTraining(-2), &mut state);
        drive(&mut src, Control::ToEnd, &mut state);
        assert_eq!(state.snapshot, Snapshot::from_events(&ev), "{name}");
        drive(&mut src, Control::ToStart, &mut state);
        assert_eq!(state.snapshot.events_applied, 0);
        assert_eq!(src.report().skipped_total, 0);
    }
}

#[test]
fn replay_plays_over_time() {
    let ev = events(SyntheticRun::default());
    let mut src = ReplaySource::from_events(ev.clone(), "mem");
    let mut state = State::new();
    let t0 = Instant::now();
    let mut out = Vec::new();
    src.poll(t0, &mut out);
    // The whole synthetic run lasts well under a minute of recorded time.
    src.poll(t0 + Duration::from_secs(60), &mut out);
    for u in out {
        state.ingest(u);
    }
    assert_eq!(state.snapshot, Snapshot::from_events(&ev));
    match src.status() {
        SourceStatus::Replay(info) => {
            assert_eq!(info.status.position, ev.len());
            assert_eq!(info.skipped, 0);
            assert_eq!(info.loading, None);
        }
        other => panic!("not a replay status: {other:?}"),
    }
}

fn hostile() -> Vec<Event> {
    let mut ev = events(SyntheticRun::default());
    let last = ev.last().map_or(0, |e| e.seq);
    ev.push(Event::new(last + 1, 0, 0, Phase::Idle, EventKind::BlockRegistered {
        block: BlockId(u32::MAX),
        name: "huge".into(),
        bytes: 1,
        exec_order: 0,
        file_backed: false,
        trainable: false,
    }));
    ev
}

#[test]
fn a_file_with_implausible_ids_has_them_refused_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hostile.jsonl");
    write(&path, &hostile());
    for follow in [false, true] {
        let mut src = ReplaySource::open(&path, follow).expect("opens");
        src.configure(1.0, true);
        let state = play_to_end(&mut src);
        // Played again from the start: the refusal is counted once.
        let mut out = Vec::new();
        src.control(Control::ToStart, &mut out);
        let _ = play_to_end(&mut src);
        let report = src.report();
        assert_eq!(report.skipped_total, 1, "follow {follow}: {report:?}");
        assert!(report.skipped[0].detail.contains("implausible: block id"), "{report:?}");
        assert_eq!(state.snapshot.blocks.len(), 8, "follow {follow}");
        assert!(!state.recent.iter().any(|e| matches!(e.kind, EventKind::BlockRegistered { block, .. } if block.0 == u32::MAX)));
    }
    let mut mem = ReplaySource::from_events(hostile(), "mem");
    assert_eq!(mem.report().skipped_total, 1);
    assert_eq!(play_to_end(&mut mem).snapshot.blocks.len(), 8);
}

#[test]
fn a_followed_file_shows_its_first_events_while_the_rest_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("big.jsonl");
    let text = jsonl(SyntheticRun::finished(400));
    std::fs::write(&path, &text).expect("writes");
    let mut src = ReplaySource::open_in_background(&path, true).expect("opens");
    src.configure(1.0, true);
    // The first screen comes from the file itself, whatever the index has read yet.
    let mut out = Vec::new();
    src.control(Control::StepEvents(50), &mut out);
    let mut state = State::new();
    for u in out {
        state.ingest(u);
    }
    assert!(state.snapshot.run.is_some(), "the first screen has the run");
    let SourceStatus::Replay(info) = src.status() else { panic!("a replay") };
    if let Some(loading) = info.loading {
        assert_eq!(loading.total_bytes, text.len() as u64);
    }
    src.finish_loading();
    assert!(!src.is_loading());
    assert_eq!(src.len(), text.lines().count());
    let SourceStatus::Replay(info) = src.status() else { panic!("a replay") };
    assert_eq!(info.loading, None);
}

#[test]
fn a_followed_file_holds_no_more_events_than_a_finished_one() {
    // A followed file is read on demand like a finished one: what it holds in memory does not
    // grow with the file.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("long.jsonl");
    let text = jsonl(SyntheticRun::finished(400));
    std::fs::write(&path, &text).expect("writes");
    let mut src = ReplaySource::open(&path, true).expect("opens");
    src.configure(1024.0, false);
    let _ = play_to_end(&mut src);
    assert_eq!(src.position(), text.lines().count());
    assert!(src.events_held() <= stagehand_events::replay::file::RECENT_KEPT + 1, "{} held", src.events_held());
}

#[test]
fn a_followed_compressed_file_grows_and_starts_over_when_rewritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("live.jsonl.zst");
    let run = events(SyntheticRun::finished(6));
    let half = run.len() / 2;
    let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, None).expect("opens");
    for e in &run[..half] {
        sink.on_event(e);
    }
    sink.flush();
    let mut src = ReplaySource::open(&path, true).expect("opens");
    src.configure(1.0, true);
    assert_eq!(src.len(), half);
    for e in &run[half..] {
        sink.on_event(e);
    }
    sink.flush();
    drop(sink);
    let limit = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while src.len() < run.len() {
        assert!(Instant::now() < limit, "the appended events never came");
        src.poll(Instant::now(), &mut out);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(play_to_end(&mut src).snapshot, Snapshot::from_events(&run));

    // The file is written again from scratch with another run: the replay starts over.
    let other = events(SyntheticRun::finished(2));
    std::fs::remove_file(&path).expect("removes");
    write(&path, &other);
    let mut state = State::new();
    while !matches!(src.status(), SourceStatus::Replay(ref i) if i.report.contains("started over")) {
        assert!(Instant::now() < limit + Duration::from_secs(30), "the rewrite was never noticed");
        let mut out = Vec::new();
        src.poll(Instant::now(), &mut out);
        for u in out {
            state.ingest(u);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    while src.len() < other.len() {
        assert!(Instant::now() < limit + Duration::from_secs(60), "the new run never came");
        src.poll(Instant::now(), &mut Vec::new());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(src.len(), other.len(), "the old run's events are gone");
    assert_eq!(play_to_end(&mut src).snapshot, Snapshot::from_events(&other));
}
