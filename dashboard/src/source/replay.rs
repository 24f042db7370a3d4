//! A telemetry file played through the runtime's replays: a finished file through
//! [`FileReplay`] (indexed in the background, bounded memory, the first screen at once and seeks
//! from the nearest checkpoint), a file still being written (`--follow`) through [`Replay`] fed
//! by the runtime's [`Follower`](stagehand::events::jsonl::Follower), and events already in
//! memory (`--demo`, tests) through [`Replay`].

use super::loader::{vet, with_refusals, Batch, Loader};
use super::{Error, Source};
use crate::app::{Control, Loading, ReplayInfo, SourceStatus, SourceUpdate, RECENT_EVENTS};
use stagehand::events::jsonl::{JsonlError, ReadReport, Restart};
use stagehand::events::replay::{Change, FileReplay, Played};
use stagehand::events::{Event, Replay, ReplayStatus, Snapshot};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What plays the events.
#[derive(Debug)]
enum Playback {
    /// Events in memory: `--demo`, tests, and a followed file (appended as it grows).
    Memory(Box<Replay>),
    /// A finished file, read on demand.
    File(Box<FileReplay>),
}

/// A telemetry file (or events in memory) played for the state.
#[derive(Debug)]
pub struct ReplaySource {
    playback: Playback,
    path: PathBuf,
    /// What reading found (the follower's report; the file replay's is read from its index).
    report: ReadReport,
    /// Events refused as implausible, counted into the report.
    refused: ReadReport,
    /// The highest sequence number vetted so far: a seek back plays events again, and their
    /// refusals are counted once.
    vetted_seq: Option<u64>,
    follower: Option<Loader>,
    /// While a followed file's existing content is read: how far.
    loading: Option<Loading>,
    /// The size of the file when it was opened.
    total_bytes: u64,
    restarts: Vec<Restart>,
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

    /// Opens `path` (plain or zstd), ready to play from the start while the rest is read in the
    /// background, with the progress in the status; with `follow`, keeps reading as the file
    /// grows (across rotated segments). Fails at once when the file cannot be opened.
    pub fn open_in_background(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let total_bytes = std::fs::metadata(path)
            .map_err(|source| Error::Jsonl(JsonlError::Io { path: path.to_path_buf(), source }))?
            .len();
        let (playback, follower) = if follow {
            let mut replay = Replay::new(Vec::new());
            replay.set_following(true);
            (Playback::Memory(Box::new(replay)), Some(Loader::follow(path)?))
        } else {
            (Playback::File(Box::new(FileReplay::open(path)?)), None)
        };
        let loading = follow.then_some(Loading { bytes_read: 0, total_bytes, events: 0 });
        Ok(ReplaySource::with(playback, path.to_path_buf(), follower, loading, total_bytes))
    }

    /// A replay of events already in memory (tests, benchmarks, `--demo`).
    pub fn from_events(events: Vec<Event>, label: &str) -> ReplaySource {
        let mut refused = ReadReport::default();
        let n = events.len() as u64;
        let events = vet(events, &mut refused);
        let mut src = ReplaySource::with(Playback::Memory(Box::new(Replay::new(events))), PathBuf::from(label), None, None, 0);
        src.report = ReadReport { lines: n, events: n, ..Default::default() };
        src.refused = refused;
        src
    }

    fn with(
        playback: Playback,
        path: PathBuf,
        follower: Option<Loader>,
        loading: Option<Loading>,
        total_bytes: u64,
    ) -> ReplaySource {
        ReplaySource {
            playback,
            path,
            report: ReadReport::default(),
            refused: ReadReport::default(),
            vetted_seq: None,
            follower,
            loading,
            total_bytes,
            restarts: Vec::new(),
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
            Playback::File(r) => !r.indexed(),
            Playback::Memory(_) => self.loading.is_some(),
        }
    }

    /// Blocks until the file has been read to its end once (tests, and callers that want the
    /// whole file before they start).
    pub fn finish_loading(&mut self) {
        if let Playback::File(r) = &self.playback {
            r.wait_indexed();
            return;
        }
        while self.loading.is_some() {
            let Some(loader) = &mut self.follower else { break };
            match loader.wait_batch() {
                Some(b) => self.take(b, &mut Vec::new()),
                None => self.loading = None,
            }
        }
    }

    /// Takes a followed file's batch; a restart resets the state to the new run's start.
    fn take(&mut self, b: Batch, out: &mut Vec<SourceUpdate>) {
        let Playback::Memory(replay) = &mut self.playback else { return };
        if let Some(why) = b.restarted {
            let (speed, paused) = (replay.speed(), replay.paused());
            **replay = Replay::new(Vec::new());
            replay.set_following(true);
            replay.set_speed(speed);
            replay.set_paused(paused);
            self.restarts.push(why);
            out.push(SourceUpdate::Reset { snapshot: Box::new(Snapshot::new()), history: Some(Vec::new()) });
        }
        if !b.events.is_empty() {
            replay.append(b.events);
        }
        self.report = b.report;
        if let Some(l) = &mut self.loading {
            l.bytes_read = b.bytes_read;
            l.total_bytes = l.total_bytes.max(b.bytes_read);
            l.events = self.report.events;
        }
        if b.caught_up {
            self.loading = None;
        }
        if let Some(e) = b.error {
            self.error = Some(e);
            self.loading = None;
        }
    }

    /// The events of a replayed range as updates, vetted (a file is as untrusted as a server).
    fn push_events(&mut self, events: Vec<Event>, out: &mut Vec<SourceUpdate>) {
        for e in events {
            let seq = e.seq;
            match super::live::vet_event(&e) {
                Ok(()) => out.push(SourceUpdate::Event(Box::new(e))),
                Err(why) if self.vetted_seq.is_none_or(|s| seq > s) => {
                    self.refused.skip(0, stagehand::events::jsonl::SkipReason::InvalidValue, format!("implausible: {why}"));
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
        if let Some(loader) = &mut self.follower {
            for b in loader.try_batches() {
                self.take(b, out);
            }
        }
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
        for why in &self.restarts {
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
            Playback::File(r) if !r.indexed() => Some(Loading {
                bytes_read: r.indexed_bytes().min(self.total_bytes),
                total_bytes: self.total_bytes,
                events: r.len() as u64,
            }),
            Playback::File(_) => None,
            Playback::Memory(_) => self.loading,
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
