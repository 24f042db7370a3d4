//! A telemetry file played through the runtime's replays: a file through [`FileReplay`]
//! (indexed in the background, bounded memory, the first screen at once, seeks from the nearest
//! checkpoint, and with `--follow` indexed on as it grows), and events already in memory
//! (`--demo`, tests) through [`Replay`]. Playing reads at most a slice of the file per frame,
//! so the terminal's loop never waits on the file, whatever it holds.

use super::vetting::{vet, with_refusals};
use super::{Error, Source};
use crate::app::{Control, Loading, ReplayInfo, SourceStatus, SourceUpdate, RECENT_EVENTS};
use stagehand_events::jsonl::{JsonlError, ReadReport, Restart};
use stagehand_events::replay::{Change, FileReplay, Played};
use stagehand_events::{Event, Replay, ReplayStatus, Snapshot};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What plays the events.
#[derive(Debug)]
enum Playback {
    /// Events in memory: `--demo`, tests.
    Memory(Box<Replay>),
    /// A file, read on demand (and followed as it grows).
    File(Box<FileReplay>),
}

/// A telemetry file (or events in memory) played for the state.
#[derive(Debug)]
pub struct ReplaySource {
    playback: Playback,
    path: PathBuf,
    /// What reading found, for events in memory (a file replay's is read from its index).
    report: ReadReport,
    /// Events refused as implausible, counted into the report.
    refused: ReadReport,
    /// The highest sequence number vetted so far: a seek back plays events again, and their
    /// refusals are counted once.
    vetted_seq: Option<u64>,
    /// The size of the file when it was opened.
    total_bytes: u64,
    /// Restarts of a followed file seen so far (each starts the refusal count over).
    restarts_seen: usize,
    /// The file was read to its end once: a followed file that grows is not "loading" again.
    caught_up: std::cell::Cell<bool>,
    error: Option<String>,
}

impl ReplaySource {
    /// Reads `path` to its end (following it afterwards when `follow`), ready to play from the
    /// start. [`ReplaySource::open_in_background`] shows the first events sooner.
    pub fn open(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let mut src = ReplaySource::open_in_background(path, follow)?;
        src.finish_loading();
        Ok(src)
    }

    /// Opens `path` (plain or zstd, a rotated run's segments as one file), ready to play from
    /// the start while the rest is indexed in the background, with the progress in the status;
    /// with `follow`, keeps indexing as the file grows (across new segments). Fails at once when
    /// the file cannot be opened or is not a regular file.
    pub fn open_in_background(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let total_bytes = std::fs::metadata(path)
            .map_err(|source| Error::Jsonl(JsonlError::Io { path: path.to_path_buf(), source }))?
            .len();
        let replay = if follow { FileReplay::follow(path)? } else { FileReplay::open(path)? };
        Ok(ReplaySource::with(Playback::File(Box::new(replay)), path.to_path_buf(), total_bytes))
    }

    /// A replay of events already in memory (tests, benchmarks, `--demo`).
    pub fn from_events(events: Vec<Event>, label: &str) -> ReplaySource {
        let mut refused = ReadReport::default();
        let n = events.len() as u64;
        let events = vet(events, &mut refused);
        let mut src = ReplaySource::with(Playback::Memory(Box::new(Replay::new(events))), PathBuf::from(label), 0);
        src.report = ReadReport { lines: n, events: n, ..Default::default() };
        src.refused = refused;
        src
    }

    fn with(playback: Playback, path: PathBuf, total_bytes: u64) -> ReplaySource {
        ReplaySource {
            playback,
            path,
            report: ReadReport::default(),
            refused: ReadReport::default(),
            vetted_seq: None,
            total_bytes,
            restarts_seen: 0,
            caught_up: std::cell::Cell::new(false),
            error: None,
        }
    }

    /// Sets the playback speed and whether to start paused.
    pub fn configure(&mut self, speed: f64, paused: bool) {
        match &mut self.playback {
            Playback::Memory(r) => {
                r.set_speed(speed);
                r.set_paused(paused);
            }
            Playback::File(r) => {
                r.set_speed(speed);
                r.set_paused(paused);
            }
        }
    }

    /// Where the replay is.
    pub fn replay_status(&self) -> ReplayStatus {
        match &self.playback {
            Playback::Memory(r) => r.status(),
            Playback::File(r) => r.status(),
        }
    }

    /// Events known so far.
    pub fn len(&self) -> usize {
        self.replay_status().total
    }

    /// True when no event is known yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events the replay holds in memory: a file's replay (followed or not) the last ones
    /// played, whatever the file's size; events in memory all of them.
    pub fn events_held(&self) -> usize {
        match &self.playback {
            Playback::Memory(r) => r.events().len(),
            Playback::File(r) => r.events_held(),
        }
    }

    /// Events applied so far.
    pub fn position(&self) -> usize {
        self.replay_status().position
    }

    /// The state after the events applied so far.
    pub fn snapshot(&self) -> &Snapshot {
        match &self.playback {
            Playback::Memory(r) => r.snapshot(),
            Playback::File(r) => r.snapshot(),
        }
    }

    /// What reading the file found so far, refused events included.
    pub fn report(&self) -> ReadReport {
        let read = match &self.playback {
            Playback::File(r) => r.report().0,
            Playback::Memory(_) => self.report.clone(),
        };
        with_refusals(&read, &self.refused)
    }

    /// Whether the file is still being read for the first time.
    pub fn is_loading(&self) -> bool {
        match &self.playback {
            Playback::File(r) => {
                if r.indexed() {
                    self.caught_up.set(true);
                }
                !self.caught_up.get()
            }
            Playback::Memory(_) => false,
        }
    }

    /// Blocks until the file has been read to its end once (tests, and callers that want the
    /// whole file before they start).
    pub fn finish_loading(&mut self) {
        if let Playback::File(r) = &self.playback {
            r.wait_indexed();
        }
    }

    /// A followed file that started over: refusals are counted afresh for the new run.
    fn note_restarts(&mut self) {
        if let Playback::File(r) = &self.playback {
            let n = r.restarts().len();
            if n > self.restarts_seen {
                self.restarts_seen = n;
                self.refused = ReadReport::default();
                self.vetted_seq = None;
            }
        }
    }

    /// The events of a replayed range as updates, vetted (a file is as untrusted as a server).
    fn push_events(&mut self, events: Vec<Event>, out: &mut Vec<SourceUpdate>) {
        for e in events {
            let seq = e.seq;
            match super::live::vet_event(&e) {
                Ok(()) => out.push(SourceUpdate::Event(Box::new(e))),
                Err(why) if self.vetted_seq.is_none_or(|s| seq > s) => {
                    self.refused.skip(0, stagehand_events::jsonl::SkipReason::InvalidValue, format!("implausible: {why}"));
                }
                Err(_) => {}
            }
            self.vetted_seq = Some(self.vetted_seq.map_or(seq, |s| s.max(seq)));
        }
    }

    /// A resync from the replay's snapshot and its recent events.
    fn push_reset(&mut self, out: &mut Vec<SourceUpdate>) {
        let (snapshot, history): (Snapshot, Vec<Event>) = match &self.playback {
            Playback::Memory(r) => {
                let pos = r.position();
                (r.snapshot().clone(), r.events()[pos.saturating_sub(RECENT_EVENTS)..pos].to_vec())
            }
            Playback::File(r) => {
                let skip = r.recent().len().saturating_sub(RECENT_EVENTS);
                (r.snapshot().clone(), r.recent().iter().skip(skip).cloned().collect())
            }
        };
        if let Err(why) = super::live::vet_snapshot(&snapshot) {
            self.error = Some(format!("refused an implausible state: {why}"));
            return;
        }
        let history = history.into_iter().filter(|e| super::live::vet_event(e).is_ok()).collect();
        out.push(SourceUpdate::Reset { snapshot: Box::new(snapshot), history: Some(history) });
    }

    fn push_change(&mut self, change: Change, out: &mut Vec<SourceUpdate>) {
        match change {
            Change::None => {}
            // A long jump forward resyncs from the replay's snapshot rather than re-applying.
            Change::Advanced(r) if r.len() <= RECENT_EVENTS => {
                let Playback::Memory(replay) = &self.playback else { return };
                let events = replay.events()[r].to_vec();
                self.push_events(events, out);
            }
            Change::Advanced(_) | Change::Reset => self.push_reset(out),
        }
    }

    fn push_played(&mut self, played: Result<Played, JsonlError>, out: &mut Vec<SourceUpdate>) {
        match played {
            Ok(Played::None) => {}
            Ok(Played::Advanced(events)) => self.push_events(events, out),
            Ok(Played::Reset) => self.push_reset(out),
            Err(e) => self.error = Some(e.to_string()),
        }
    }
}

impl Source for ReplaySource {
    fn poll(&mut self, now: Instant, out: &mut Vec<SourceUpdate>) {
        self.note_restarts();
        match &mut self.playback {
            Playback::Memory(r) => {
                let change = r.tick(now);
                self.push_change(change, out);
            }
            Playback::File(r) => {
                let played = r.tick(now);
                self.push_played(played, out);
            }
        }
    }

    fn control(&mut self, c: Control, out: &mut Vec<SourceUpdate>) {
        match &mut self.playback {
            Playback::Memory(r) => {
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
            Playback::File(r) => {
                let played = match c {
                    Control::TogglePause => {
                        r.toggle_pause();
                        Ok(Played::None)
                    }
                    Control::StepEvents(n) => r.step_events(n),
                    Control::StepTraining(n) => r.step_training(n),
                    Control::SeekFraction(d) => {
                        let at = if r.is_empty() { 0.0 } else { r.position() as f64 / r.len() as f64 };
                        r.seek_fraction(at + d)
                    }
                    Control::Faster => {
                        r.faster();
                        Ok(Played::None)
                    }
                    Control::Slower => {
                        r.slower();
                        Ok(Played::None)
                    }
                    Control::ToStart => r.to_start(),
                    Control::ToEnd => r.to_end(),
                };
                self.push_played(played, out);
            }
        }
    }

    fn status(&self) -> SourceStatus {
        let report = self.report();
        let mut line = report.summary();
        let restarts = match &self.playback {
            Playback::File(r) => r.restarts(),
            Playback::Memory(_) => Vec::new(),
        };
        for why in &restarts {
            line.push_str(match why {
                Restart::Truncated => "; the file was truncated and written again: started over",
                Restart::Replaced => "; the file was replaced: started over",
            });
        }
        let index_error = match &self.playback {
            Playback::File(r) => r.report().1,
            Playback::Memory(_) => None,
        };
        for e in self.error.iter().chain(index_error.iter()) {
            line.push_str(&format!("; {e}"));
        }
        let loading = match &self.playback {
            Playback::File(r) if self.is_loading() => Some(Loading {
                bytes_read: r.indexed_bytes().min(self.total_bytes),
                total_bytes: self.total_bytes,
                events: r.len() as u64,
            }),
            Playback::File(_) | Playback::Memory(_) => None,
        };
        SourceStatus::Replay(ReplayInfo {
            path: self.path.display().to_string(),
            status: self.replay_status(),
            report: line,
            skipped: report.skipped_total,
            loading,
        })
    }

    fn paused(&self) -> bool {
        match &self.playback {
            Playback::Memory(r) => r.paused(),
            Playback::File(r) => r.paused(),
        }
    }
}

/// The state a replay source shows after the events applied so far, for tests: the replay's
/// own snapshot.
pub fn replay_snapshot(src: &ReplaySource) -> &Snapshot {
    src.snapshot()
}

#[cfg(test)]
mod tests;
