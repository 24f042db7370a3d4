//! A replay of a telemetry file of any size: [`FileReplay::open`] returns at once with the start
//! of the file, while the file is indexed in the background; seeks start from the nearest
//! checkpoint and read only the events between it and the target. [`FileReplay::follow`] does
//! the same for a file still being written, which it keeps indexing as it grows: memory holds
//! the checkpoints and the recent events, never the file's events.
//!
//! Playing reads at most [`TICK_BYTES`] of the file per [`FileReplay::tick`], so a caller's
//! loop (a terminal UI's) stays responsive whatever the file holds.

use super::index::{self, Checkpoint, Index};
use super::clock::Clock;
use super::ReplayStatus;
use crate::jsonl::{Continuation, JsonlError, Next, ReadReport, Reader, Restart, RunSource};
use crate::model::Event;
use crate::snapshot::Snapshot;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Events applied last that a file replay keeps (for the consumers' recent-events views).
pub const RECENT_KEPT: usize = 4096;
/// Most events one tick applies, so that a fast replay of a huge file stays responsive.
const MAX_PER_TICK: usize = 200_000;
/// Most decoded bytes one tick reads (about a millisecond of decoding).
pub const TICK_BYTES: u64 = 4 << 20;

/// What an operation did to the replayed stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Played {
    /// Nothing moved.
    None,
    /// These events were applied, in order.
    Advanced(Vec<Event>),
    /// The position jumped: consumers resync from [`FileReplay::snapshot`] (and
    /// [`FileReplay::recent`] for history).
    Reset,
}

/// Sees every event of the file as the background index reads it, for a program that wants
/// something else from the whole file (a trace, a summary) without reading it a second time.
/// Runs on the index thread; keep it quick.
pub trait IndexObserver: Send {
    /// The next event of the file, in order.
    fn on_event(&mut self, event: &Event);
    /// The index is complete (or stopped: `error` says why), with what reading found. Called
    /// before [`FileReplay::wait_indexed`] returns.
    fn finish(&mut self, report: &ReadReport, error: Option<&str>);
}

/// A replay that reads its file on demand.
pub struct FileReplay {
    path: PathBuf,
    follow: bool,
    index: std::sync::Arc<Index>,
    /// The index generation the position belongs to (a followed file that started over has a
    /// new one).
    generation: u64,
    pos: usize,
    snapshot: Snapshot,
    /// Positioned at event `pos`; `None` at the end.
    reader: Option<Reader<RunSource>>,
    /// The next event, read ahead to know when it is due.
    peeked: Option<Event>,
    recent: VecDeque<Event>,
    clock: Clock,
}

impl std::fmt::Debug for FileReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileReplay")
            .field("path", &self.path)
            .field("position", &self.pos)
            .finish_non_exhaustive()
    }
}

impl Drop for FileReplay {
    fn drop(&mut self) {
        self.index.cancel();
    }
}

impl FileReplay {
    /// Opens `path` (plain or zstd, a rotated run's segments as one file) positioned before its
    /// first event, playing at recorded speed; indexing starts in the background. The file
    /// must be a regular file: a replay reads it more than once.
    pub fn open(path: impl AsRef<Path>) -> Result<FileReplay, JsonlError> {
        FileReplay::open_with(path, false, None)
    }

    /// Opens `path` as [`FileReplay::open`] does, handing every event the index reads to
    /// `observer` as well: the one pass over the file serves both.
    pub fn open_observed(path: impl AsRef<Path>, observer: Box<dyn IndexObserver>) -> Result<FileReplay, JsonlError> {
        FileReplay::open_with(path, false, Some(observer))
    }

    /// Opens a file that is still being written (like `tail -f`): the index follows it as it
    /// grows (across a rotated run's new segments), and a file truncated and rewritten, or
    /// replaced, starts the replay over ([`FileReplay::restarts`] says why).
    pub fn follow(path: impl AsRef<Path>) -> Result<FileReplay, JsonlError> {
        FileReplay::open_with(path, true, None)
    }

    fn open_with(path: impl AsRef<Path>, follow: bool, observer: Option<Box<dyn IndexObserver>>) -> Result<FileReplay, JsonlError> {
        let path = path.as_ref().to_path_buf();
        let meta = std::fs::metadata(&path).map_err(|e| JsonlError::io(&path, e))?;
        if !meta.is_file() {
            return Err(JsonlError::io(
                &path,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a regular file (a device, a pipe or a folder): a replay reads its file more than once; \
                     copy it to a file first",
                ),
            ));
        }
        let index = index::spawn(path.clone(), follow, observer)?;
        let mut r = FileReplay {
            path,
            follow,
            index,
            generation: 0,
            pos: 0,
            snapshot: Snapshot::new(),
            reader: None,
            peeked: None,
            recent: VecDeque::new(),
            clock: Clock::default(),
        };
        r.reposition(Checkpoint::start())?;
        Ok(r)
    }

    /// The file replayed.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state after the events applied so far.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The last events applied (at most [`RECENT_KEPT`]), oldest first.
    pub fn recent(&self) -> &VecDeque<Event> {
        &self.recent
    }

    /// Events applied so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Events known so far (all of them once indexing is done).
    pub fn len(&self) -> usize {
        let st = self.index.lock();
        self.known(&st)
    }

    /// True when the file has no events (as far as indexed).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the whole file is indexed.
    pub fn indexed(&self) -> bool {
        self.index.lock().done
    }

    /// Bytes of the file indexed so far, for a progress line while a large file loads.
    pub fn indexed_bytes(&self) -> u64 {
        self.index.lock().bytes_read
    }

    /// Snapshot checkpoints indexed so far (seeks start from the nearest one).
    pub fn checkpoints(&self) -> usize {
        self.index.lock().checkpoints.len()
    }

    /// Bytes the checkpoints' snapshots take (measured as JSON): bounded by
    /// [`index::CHECKPOINT_BUDGET`] whatever the file's size.
    pub fn checkpoint_bytes(&self) -> u64 {
        self.index.lock().checkpoints.iter().map(|c| c.bytes).sum()
    }

    /// Whether the file is followed as it grows.
    pub fn following(&self) -> bool {
        self.follow
    }

    /// Why a followed file started over, each time it did.
    pub fn restarts(&self) -> Vec<Restart> {
        self.index.lock().restarts.clone()
    }

    /// Events this replay holds in memory: the recent ones and the one read ahead. Bounded by
    /// [`RECENT_KEPT`] + 1 whatever the file's size (the index keeps snapshots, not events).
    pub fn events_held(&self) -> usize {
        self.recent.len() + usize::from(self.peeked.is_some())
    }

    /// The position just after `step` began (as [`FileReplay::step_training`] stops), if the
    /// file indexed so far has that step.
    pub fn step_start(&self, step: u64) -> Option<usize> {
        let st = self.index.lock();
        st.step_starts.iter().find(|s| s.step == step).map(|s| s.pos)
    }

    /// The first and last steps the file indexed so far begins.
    pub fn step_range(&self) -> Option<(u64, u64)> {
        let st = self.index.lock();
        Some((st.step_starts.first()?.step, st.step_starts.last()?.step))
    }

    /// The events applied so far, read again from the file's start one at a time, for consumers
    /// that rebuild their state from every event (metrics after a seek). A read error ends the
    /// iteration early, as it ends the index.
    pub fn applied(&self) -> Result<impl Iterator<Item = Event> + Send, JsonlError> {
        let reader = index::reader_at(&self.path, Default::default(), Continuation::default(), false).map_err(|e| self.io(e))?;
        Ok(reader.map_while(Result::ok).take(self.pos))
    }

    /// Blocks until the whole file is indexed (tests, tools that need the total).
    pub fn wait_indexed(&self) {
        self.index.wait();
    }

    /// What reading the file found (so far), and an indexing error if one stopped it.
    pub fn report(&self) -> (ReadReport, Option<String>) {
        let st = self.index.lock();
        (st.report.clone(), st.error.clone())
    }

    /// Whether the replay is paused.
    pub fn paused(&self) -> bool {
        self.clock.paused()
    }

    /// Playback speed (1.0 = recorded).
    pub fn speed(&self) -> f64 {
        self.clock.speed()
    }

    /// Replay time: the time of the last applied event.
    pub fn t_ns(&self) -> u64 {
        self.recent.back().map_or(self.snapshot.t_ns, |e| e.t_ns)
    }

    /// Events known: the index's count, or the position when playing ran ahead of the index; a
    /// followed file that started over has only the new content's.
    fn known(&self, st: &index::IndexState) -> usize {
        if st.generation == self.generation {
            st.total.max(self.pos)
        } else {
            st.total
        }
    }

    /// Where the replay is.
    pub fn status(&self) -> ReplayStatus {
        let st = self.index.lock();
        ReplayStatus {
            position: self.pos,
            total: self.known(&st),
            paused: self.clock.paused(),
            speed: self.clock.speed(),
            t_ns: self.t_ns(),
            end_t_ns: st.end_t_ns,
            step: self.snapshot.step,
            following: self.follow,
            indexing: !st.done,
        }
    }

    /// Pauses or resumes.
    pub fn set_paused(&mut self, paused: bool) {
        self.clock.set_paused(paused);
    }

    /// Pauses or resumes.
    pub fn toggle_pause(&mut self) {
        self.set_paused(!self.paused());
    }

    /// Sets the speed (clamped to [`MIN_SPEED`](super::MIN_SPEED)..=[`MAX_SPEED`](super::MAX_SPEED)).
    pub fn set_speed(&mut self, speed: f64) {
        self.clock.set_speed(speed);
    }

    /// Doubles the speed.
    pub fn faster(&mut self) {
        self.set_speed(self.speed() * 2.0);
    }

    /// Halves the speed.
    pub fn slower(&mut self) {
        self.set_speed(self.speed() / 2.0);
    }

    fn io(&self, e: std::io::Error) -> JsonlError {
        JsonlError::io(&self.path, e)
    }

    /// Starts over from a checkpoint.
    fn reposition(&mut self, cp: Checkpoint) -> Result<(), JsonlError> {
        let reader = index::reader_at(&self.path, cp.at, cp.run.clone(), self.follow).map_err(|e| self.io(e))?;
        self.reader = Some(reader);
        self.peeked = None;
        self.pos = cp.pos;
        self.snapshot = (*cp.snapshot).clone();
        self.recent.clear();
        self.clock.restart();
        Ok(())
    }

    fn peek(&mut self) -> Result<Option<&Event>, JsonlError> {
        if self.peeked.is_none() {
            if let Some(r) = &mut self.reader {
                match r.poll() {
                    Ok(Next::Event { event, .. }) => self.peeked = Some(*event),
                    // A followed file has nothing more yet, or this tick read its share.
                    Ok(Next::Pending) => {}
                    Ok(Next::End) => self.reader = None,
                    Err(e) => {
                        self.reader = None;
                        return Err(JsonlError::io(&self.path, e));
                    }
                }
            }
        }
        Ok(self.peeked.as_ref())
    }

    /// Reads without a bound (seeks), or at most [`TICK_BYTES`] (ticks).
    fn budget(&mut self, bytes: Option<u64>) {
        if let Some(r) = &mut self.reader {
            r.set_budget(bytes);
        }
    }

    /// A followed file that started over: the replay starts over with it.
    fn restarted(&mut self) -> Result<bool, JsonlError> {
        let generation = self.index.lock().generation;
        if generation == self.generation {
            return Ok(false);
        }
        self.generation = generation;
        self.reposition(Checkpoint::start())?;
        Ok(true)
    }

    /// Applies the next event, if any.
    fn advance(&mut self, out: Option<&mut Vec<Event>>) -> Result<bool, JsonlError> {
        self.peek()?;
        let Some(e) = self.peeked.take() else { return Ok(false) };
        self.snapshot.apply(&e);
        self.pos += 1;
        if self.recent.len() == RECENT_KEPT {
            self.recent.pop_front();
        }
        if let Some(out) = out {
            out.push(e.clone());
        }
        self.recent.push_back(e);
        Ok(true)
    }

    /// Moves to `target` events applied: forward by reading on, backward (or far forward) from
    /// the nearest checkpoint.
    fn go_to(&mut self, target: usize) -> Result<Played, JsonlError> {
        if self.restarted()? {
            return Ok(Played::Reset);
        }
        self.budget(None);
        if target == self.pos {
            return Ok(Played::None);
        }
        let cp = {
            let st = self.index.lock();
            let i = st.checkpoints.partition_point(|c| c.pos <= target);
            st.checkpoints.get(i.wrapping_sub(1)).cloned()
        };
        let from_checkpoint = cp.filter(|c| target < self.pos || c.pos > self.pos);
        let jumped = from_checkpoint.is_some();
        if let Some(cp) = from_checkpoint {
            self.reposition(cp)?;
        }
        let start = self.pos;
        let mut out = Vec::new();
        while self.pos < target {
            let keep = (!jumped && self.pos - start < RECENT_KEPT).then_some(&mut out);
            if !self.advance(keep)? {
                break;
            }
        }
        if jumped || out.len() < self.pos - start {
            return Ok(Played::Reset);
        }
        Ok(if out.is_empty() { Played::None } else { Played::Advanced(out) })
    }

    /// Applies every event that is due at wall time `now`, at the current speed.
    pub fn tick(&mut self, now: Instant) -> Result<Played, JsonlError> {
        if self.restarted()? {
            return Ok(Played::Reset);
        }
        self.budget(Some(TICK_BYTES));
        // Paused, nothing is read ahead.
        if self.clock.paused() {
            self.clock.restart();
            return Ok(Played::None);
        }
        let Some(first_t) = self.peek()?.map(|e| e.t_ns) else {
            self.clock.restart();
            return Ok(Played::None);
        };
        let from = if self.pos == 0 { first_t } else { self.t_ns() };
        let Some(due) = self.clock.due(now, from) else { return Ok(Played::None) };
        let mut out = Vec::new();
        while out.len() < MAX_PER_TICK && self.peek()?.is_some_and(|e| e.t_ns <= due) {
            self.advance(Some(&mut out))?;
        }
        Ok(if out.is_empty() { Played::None } else { Played::Advanced(out) })
    }

    /// Moves by `n` events (negative: back). Pauses, as stepping implies.
    pub fn step_events(&mut self, n: i64) -> Result<Played, JsonlError> {
        self.set_paused(true);
        // Past the end stops at the end; the total may not be known yet while indexing.
        let target = (self.pos as i64).saturating_add(n).max(0) as usize;
        self.go_to(target)
    }

    /// Moves to the start of the next (or, with `n < 0`, an earlier) training step.
    pub fn step_training(&mut self, n: i64) -> Result<Played, JsonlError> {
        self.set_paused(true);
        let target = {
            let st = self.index.lock();
            let starts = &st.step_starts;
            if n >= 0 {
                let i = starts.partition_point(|s| s.pos <= self.pos);
                starts.get(i + (n.max(1) as usize - 1)).map_or(st.total.max(self.pos), |s| s.pos)
            } else {
                let i = starts.partition_point(|s| s.pos < self.pos);
                i.checked_sub(n.unsigned_abs() as usize).map_or(0, |k| starts[k].pos)
            }
        };
        self.go_to(target)
    }

    /// Jumps to a position (number of events applied).
    pub fn seek(&mut self, position: usize) -> Result<Played, JsonlError> {
        self.go_to(position)
    }

    /// Jumps to a fraction of the events known so far (0.0 = start, 1.0 = end).
    pub fn seek_fraction(&mut self, fraction: f64) -> Result<Played, JsonlError> {
        let f = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
        let target = (self.len() as f64 * f).round() as usize;
        self.go_to(target)
    }

    /// Jumps to the first event at or after `t_ns`.
    pub fn seek_time(&mut self, t_ns: u64) -> Result<Played, JsonlError> {
        self.restarted()?;
        self.budget(None);
        let cp = {
            let st = self.index.lock();
            let i = st.checkpoints.partition_point(|c| c.t_ns < t_ns);
            st.checkpoints.get(i.wrapping_sub(1)).cloned()
        };
        if let Some(cp) = cp {
            if cp.pos > self.pos || self.t_ns() >= t_ns {
                self.reposition(cp)?;
            }
        }
        while self.peek()?.is_some_and(|e| e.t_ns < t_ns) {
            self.advance(None)?;
        }
        Ok(Played::Reset)
    }

    /// Jumps to the start.
    pub fn to_start(&mut self) -> Result<Played, JsonlError> {
        self.go_to(0)
    }

    /// Jumps to the end (of what is indexed so far).
    pub fn to_end(&mut self) -> Result<Played, JsonlError> {
        let end = self.len();
        self.go_to(end)
    }
}
