//! A telemetry file played through the runtime's [`Replay`] controller, read in the background
//! (and followed as it grows, with `--follow`).

use super::loader::{Batch, Input, Loader};
use super::{Error, Source};
use crate::app::{Control, Loading, ReplayInfo, SourceStatus, Update, RECENT_EVENTS};
use stagehand::events::jsonl::{JsonlError, ReadReport};
use stagehand::events::replay::Change;
use stagehand::events::{Event, Replay, Snapshot};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A telemetry file played through [`Replay`], optionally followed as it grows.
#[derive(Debug)]
pub struct ReplaySource {
    replay: Replay,
    path: PathBuf,
    report: ReadReport,
    loader: Option<Loader>,
    /// While the initial read goes on: how far it is.
    loading: Option<Loading>,
    error: Option<String>,
}

impl ReplaySource {
    /// Reads `path` to its end (following it afterwards when `follow`), ready to play from the
    /// start. For a large file, [`ReplaySource::open_in_background`] shows the first events
    /// sooner.
    pub fn open(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let mut src = ReplaySource::open_in_background(path, follow)?;
        src.finish_loading();
        Ok(src)
    }

    /// Starts reading `path` in the background (following it when `follow`), ready to play
    /// from the start: events come in as they are read, with the progress in the status. Fails
    /// at once when the file cannot be opened.
    pub fn open_in_background(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let io = |source| Error::Jsonl(JsonlError::Io { path: path.to_path_buf(), source });
        let file = std::fs::File::open(path).map_err(io)?;
        let total = file.metadata().map_err(io)?.len();
        let loader = Loader::start(Input::File { file, follow }).map_err(io)?;
        Ok(ReplaySource::loading(loader, path.to_path_buf(), total, follow))
    }

    /// Reads events from `reader` in the background, as from a file of `total_bytes` (tests,
    /// and readers other than files).
    pub fn from_reader(reader: impl Read + Send + 'static, total_bytes: u64, label: &str) -> Result<ReplaySource, Error> {
        let loader = Loader::start(Input::Reader(Box::new(reader)))
            .map_err(|source| Error::Jsonl(JsonlError::Io { path: PathBuf::from(label), source }))?;
        Ok(ReplaySource::loading(loader, PathBuf::from(label), total_bytes, false))
    }

    fn loading(loader: Loader, path: PathBuf, total_bytes: u64, follow: bool) -> ReplaySource {
        let mut replay = Replay::new(Vec::new());
        replay.set_following(follow);
        ReplaySource {
            replay,
            path,
            report: ReadReport::default(),
            loader: Some(loader),
            loading: Some(Loading { bytes_read: 0, total_bytes, events: 0 }),
            error: None,
        }
    }

    /// A replay of events already in memory (tests, benchmarks, `--demo`).
    pub fn from_events(events: Vec<Event>, label: &str) -> ReplaySource {
        let report = ReadReport {
            lines: events.len() as u64,
            events: events.len() as u64,
            ..Default::default()
        };
        ReplaySource {
            replay: Replay::new(events),
            path: PathBuf::from(label),
            report,
            loader: None,
            loading: None,
            error: None,
        }
    }

    /// Sets the playback speed and whether to start paused.
    pub fn configure(&mut self, speed: f64, paused: bool) {
        self.replay.set_speed(speed);
        self.replay.set_paused(paused);
    }

    /// The replay controller.
    pub fn replay(&self) -> &Replay {
        &self.replay
    }

    /// What reading the file found so far.
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    /// Whether the initial read is still going on.
    pub fn is_loading(&self) -> bool {
        self.loading.is_some()
    }

    /// Blocks until the initial read has reached the end of the file (tests, and callers that
    /// want the whole file before they start).
    pub fn finish_loading(&mut self) {
        while self.loading.is_some() {
            let Some(loader) = &mut self.loader else { break };
            match loader.wait_batch() {
                Some(b) => self.take(b),
                None => {
                    self.loading = None;
                    self.loader = None;
                }
            }
        }
    }

    fn take(&mut self, b: Batch) {
        if !b.events.is_empty() {
            self.replay.append(b.events);
        }
        self.report = b.report;
        if let Some(l) = &mut self.loading {
            l.bytes_read = b.bytes_read;
            l.events = self.report.events;
        }
        if b.done {
            self.loading = None;
        }
        if let Some(e) = b.error {
            self.error = Some(e);
            self.loading = None;
        }
    }

    fn push_change(&self, change: Change, out: &mut Vec<Update>) {
        let events = self.replay.events();
        match change {
            Change::None => {}
            // A long jump forward resyncs from the replay's snapshot rather than re-applying.
            Change::Advanced(r) if r.len() <= RECENT_EVENTS => {
                out.extend(events[r].iter().map(|e| Update::Event(Box::new(e.clone()))));
            }
            Change::Advanced(_) | Change::Reset => {
                let pos = self.replay.position();
                out.push(Update::Reset {
                    snapshot: Box::new(self.replay.snapshot().clone()),
                    history: Some(events[pos.saturating_sub(RECENT_EVENTS)..pos].to_vec()),
                });
            }
        }
    }
}

impl Source for ReplaySource {
    fn poll(&mut self, now: Instant, out: &mut Vec<Update>) {
        if let Some(loader) = &mut self.loader {
            for b in loader.try_batches() {
                self.take(b);
            }
        }
        let change = self.replay.tick(now);
        self.push_change(change, out);
    }

    fn control(&mut self, c: Control, out: &mut Vec<Update>) {
        let r = &mut self.replay;
        let change = match c {
            Control::TogglePause => {
                r.toggle_pause();
                Change::None
            }
            Control::StepEvents(n) => r.step_events(n),
            Control::StepTraining(n) => r.step_training(n),
            Control::SeekFraction(d) => {
                let at = if r.is_empty() { 0.0 } else { r.position() as f64 / r.len() as f64 };
                r.seek_fraction(at + d)
            }
            Control::Faster => {
                r.faster();
                Change::None
            }
            Control::Slower => {
                r.slower();
                Change::None
            }
            Control::ToStart => r.to_start(),
            Control::ToEnd => r.to_end(),
        };
        self.push_change(change, out);
    }

    fn status(&self) -> SourceStatus {
        let mut report = self.report.summary();
        if let Some(e) = &self.error {
            report.push_str(&format!("; {e}"));
        }
        SourceStatus::Replay(ReplayInfo {
            path: self.path.display().to_string(),
            status: self.replay.status(),
            report,
            skipped: self.report.skipped_total,
            loading: self.loading,
        })
    }

    fn paused(&self) -> bool {
        self.replay.paused()
    }
}

/// The state a replay source shows after `n` events, for tests: the replay's own snapshot.
pub fn replay_snapshot(src: &ReplaySource) -> &Snapshot {
    src.replay.snapshot()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::State;
    use stagehand::events::synthetic::{events, jsonl, SyntheticRun};
    use std::sync::mpsc::{channel, Receiver};
    use std::time::Duration;

    fn drive(src: &mut ReplaySource, c: Control, state: &mut State) {
        let mut out = Vec::new();
        src.control(c, &mut out);
        for u in out {
            state.ingest(u);
        }
        assert_eq!(&state.snapshot, replay_snapshot(src), "after {c:?}");
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
        assert_eq!(state.recent.back().map(|e| e.seq), Some(src.replay().position() as u64));
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
        assert_eq!(src.replay().speed(), 2.0);
        drive(&mut src, Control::Slower, &mut state);
        drive(&mut src, Control::Slower, &mut state);
        assert_eq!(src.replay().speed(), 0.5);
        drive(&mut src, Control::TogglePause, &mut state);
        assert!(!src.paused());
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

    #[test]
    fn a_file_with_implausible_ids_is_skipped_line_by_line() {
        use stagehand::events::{BlockId, EventKind, Phase};
        let mut text = jsonl(SyntheticRun::default());
        let huge = Event::new(9_999, 0, 0, Phase::Idle, EventKind::BlockRegistered {
            block: BlockId(u32::MAX),
            name: "huge".into(),
            bytes: 1,
            exec_order: 0,
            file_backed: false,
            trainable: false,
        });
        text.push_str(&serde_json::to_string(&huge).expect("json"));
        text.push('\n');
        let total = text.len() as u64;
        let mut src = ReplaySource::from_reader(std::io::Cursor::new(text.into_bytes()), total, "hostile.jsonl").expect("starts");
        src.finish_loading();
        assert_eq!(src.report().skipped_total, 1);
        assert!(src.report().skipped[0].detail.contains("implausible: block id"), "{:?}", src.report());
        let mut out = Vec::new();
        src.control(Control::ToEnd, &mut out);
        let mut state = State::new();
        for u in out {
            state.ingest(u);
        }
        assert_eq!(state.snapshot.blocks.len(), 8);
    }

    /// A reader that hands out its text in parts, each when the test says so.
    struct Gated {
        parts: Receiver<Vec<u8>>,
        current: std::io::Cursor<Vec<u8>>,
    }

    impl Read for Gated {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            loop {
                let n = self.current.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                match self.parts.recv() {
                    Ok(next) => self.current = std::io::Cursor::new(next),
                    Err(_) => return Ok(0), // no more parts: the end
                }
            }
        }
    }

    #[test]
    fn the_first_events_show_while_the_rest_is_still_loading() {
        let text = jsonl(SyntheticRun::finished(20));
        let total = text.len() as u64;
        let lines: Vec<&str> = text.lines().collect();
        let head: String = lines[..600].iter().map(|l| format!("{l}\n")).collect();
        let tail: String = lines[600..].iter().map(|l| format!("{l}\n")).collect();
        let (tx, rx) = channel();
        tx.send(head.clone().into_bytes()).expect("sends");
        let gated = Gated { parts: rx, current: std::io::Cursor::new(Vec::new()) };
        let mut src = ReplaySource::from_reader(gated, total, "big.jsonl").expect("starts");
        src.configure(1.0, true);

        // Until the rest is released, the loader is stuck after the head: poll until the
        // first batch (at least the first-batch size) is in.
        let limit = Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        while src.replay().len() < 256 {
            assert!(Instant::now() < limit, "the first batch never came");
            src.poll(Instant::now(), &mut out);
            std::thread::sleep(Duration::from_millis(5));
        }
        let SourceStatus::Replay(info) = src.status() else { panic!("a replay") };
        let loading = info.loading.expect("still loading");
        assert!(loading.bytes_read > 0 && loading.bytes_read <= head.len() as u64, "{loading:?}");
        assert_eq!(loading.total_bytes, total);
        src.control(Control::ToEnd, &mut out);
        let mut state = State::new();
        for u in out.drain(..) {
            state.ingest(u);
        }
        assert!(state.snapshot.run.is_some(), "the first screen has the run");

        tx.send(tail.into_bytes()).expect("sends");
        drop(tx);
        src.finish_loading();
        assert!(!src.is_loading());
        assert_eq!(src.replay().len(), lines.len());
        assert_eq!(src.report().skipped_total, 0);
        let SourceStatus::Replay(info) = src.status() else { panic!("a replay") };
        assert_eq!(info.loading, None);
    }
}
