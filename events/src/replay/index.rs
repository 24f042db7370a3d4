//! The index of a telemetry file, built on a background thread while the replay already shows
//! the file's start: where each checkpoint's line starts in the file, the snapshot at that point,
//! and where each training step begins.
//!
//! A checkpoint is taken every [`CHECKPOINT_BYTES`] of decoded input at first, so reaching any
//! position means applying at most one interval of events. The snapshots are bounded in bytes
//! ([`CHECKPOINT_BUDGET`], measured as their JSON size): when they would take more, every other
//! checkpoint is dropped and the interval doubles, so a run with a large snapshot gets fewer
//! checkpoints, not more memory. The step starts are bounded the same way in count.
//!
//! A followed file (one still being written) is indexed as it grows; when it is truncated and
//! rewritten, or replaced, the index starts over with a new generation.

use super::super::jsonl::follow::Watch;
use super::super::jsonl::{Continuation, JsonlError, Next, Position, ReadReport, Reader, Restart, RunSource};
use super::super::model::{Event, EventKind, Phase};
use super::super::snapshot::Snapshot;
use super::file::IndexObserver;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Decoded bytes between two checkpoints at first (small in tests, to exercise many of them).
pub const CHECKPOINT_BYTES: u64 = if cfg!(test) { 32 << 10 } else { 8 << 20 };
/// Bytes the checkpoints' snapshots may take in all, measured as JSON (small in tests).
pub const CHECKPOINT_BUDGET: u64 = if cfg!(test) { 4 << 20 } else { 64 << 20 };
/// Step starts kept at most; beyond, every other one is dropped and only every second step is
/// recorded from then on (then every fourth, ...).
pub const MAX_STEP_STARTS: usize = if cfg!(test) { 1 << 10 } else { 1 << 20 };
/// How often a followed file that was read to its end is looked at again.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// The state after the first `pos` events, and where event `pos` starts.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub pos: usize,
    pub at: Position,
    /// Time of the last event applied (0 at the start).
    pub t_ns: u64,
    pub snapshot: Arc<Snapshot>,
    /// What a reader starting here must know of the run (for a rotated run's later segments).
    pub run: Continuation,
    /// The snapshot's size, as its JSON.
    pub bytes: u64,
}

impl Checkpoint {
    /// The start of the file.
    pub fn start() -> Checkpoint {
        Checkpoint {
            pos: 0,
            at: Position::default(),
            t_ns: 0,
            snapshot: Arc::new(Snapshot::new()),
            run: Continuation::default(),
            bytes: 0,
        }
    }
}

/// A `phase_changed` to `step_begin`: the step it begins, and the position just after it (so
/// that the step shows as current there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStart {
    pub step: u64,
    pub pos: usize,
}

/// What the indexer found so far.
#[derive(Debug)]
pub struct IndexState {
    pub total: usize,
    pub end_t_ns: u64,
    pub checkpoints: Vec<Checkpoint>,
    /// Where each training step begins, in file order (every `step_stride`-th once thinned).
    pub step_starts: Vec<StepStart>,
    pub report: ReadReport,
    /// Bytes of the file indexed so far.
    pub bytes_read: u64,
    pub done: bool,
    pub error: Option<String>,
    /// Bumped each time a followed file started over; positions of another generation are void.
    pub generation: u64,
    /// Why a followed file started over, each time it did.
    pub restarts: Vec<Restart>,
}

impl Default for IndexState {
    fn default() -> Self {
        IndexState {
            total: 0,
            end_t_ns: 0,
            checkpoints: vec![Checkpoint::start()],
            step_starts: Vec::new(),
            report: ReadReport::default(),
            bytes_read: 0,
            done: false,
            error: None,
            generation: 0,
            restarts: Vec::new(),
        }
    }
}

/// The shared index: filled by the indexer, read by the replay.
#[derive(Debug, Default)]
pub struct Index {
    state: Mutex<IndexState>,
    changed: Condvar,
    cancel: AtomicBool,
}

impl Index {
    pub fn lock(&self) -> MutexGuard<'_, IndexState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until the whole file is indexed (a followed file: until it is read to its end).
    pub fn wait(&self) {
        let mut st = self.lock();
        while !st.done {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stops the indexer (the replay was dropped).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        self.changed.notify_all();
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// A reader of the file (the run, when rotated) from `at`.
pub fn reader_at(path: &Path, at: Position, run: Continuation, follow: bool) -> std::io::Result<Reader<RunSource>> {
    let src = RunSource::open(path, at, follow)?;
    Ok(Reader::resume(src, run))
}

/// Starts indexing `path` on a thread of its own; when `follow`, it goes on as the file grows.
pub fn spawn(path: PathBuf, follow: bool, observer: Option<Box<dyn IndexObserver>>) -> Result<Arc<Index>, JsonlError> {
    let index = Arc::new(Index::default());
    let worker = index.clone();
    std::thread::Builder::new()
        .name("stagehand-replay-index".into())
        .spawn(move || {
            let mut ix = Indexer::new(&worker, observer);
            let mut error = ix.run(&path, follow).err().map(|e| e.to_string());
            if error.is_none() && worker.cancelled() {
                error = Some("indexing stopped: the replay was closed".into());
            }
            // Before `done` is published, so that whoever waits for the index finds the
            // observer finished too.
            if let Some(o) = &mut ix.observer {
                o.finish(&ix.report, error.as_deref());
            }
            ix.publish(true, error);
        })
        .map_err(|e| JsonlError::io(Path::new("replay index thread"), e))?;
    Ok(index)
}

/// How many events the indexer hands over at a time.
const PUBLISH_EVERY: usize = 16_384;

struct Indexer<'a> {
    index: &'a Index,
    report: ReadReport,
    snapshot: Snapshot,
    pos: usize,
    end_t_ns: u64,
    interval: u64,
    last_checkpoint: u64,
    step_stride: u64,
    steps_seen: u64,
    bytes_read: u64,
    new_checkpoints: Vec<Checkpoint>,
    new_steps: Vec<StepStart>,
    observer: Option<Box<dyn IndexObserver>>,
}

/// Bytes written to it, for measuring a snapshot without keeping its JSON.
struct Counter(u64);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A snapshot's size as JSON (what the checkpoint budget counts).
#[cfg(test)]
pub fn json_size_of(s: &Snapshot) -> u64 {
    json_size(s)
}

fn json_size(s: &Snapshot) -> u64 {
    let mut c = Counter(0);
    // A snapshot always serializes; a failure only means it is measured as empty.
    let _ = serde_json::to_writer(&mut c, s);
    c.0
}

impl<'a> Indexer<'a> {
    fn new(index: &'a Index, observer: Option<Box<dyn IndexObserver>>) -> Indexer<'a> {
        Indexer {
            index,
            observer,
            report: ReadReport::default(),
            snapshot: Snapshot::new(),
            pos: 0,
            end_t_ns: 0,
            interval: CHECKPOINT_BYTES,
            last_checkpoint: 0,
            step_stride: 1,
            steps_seen: 0,
            bytes_read: 0,
            new_checkpoints: Vec::new(),
            new_steps: Vec::new(),
        }
    }

    /// Reads the file to its end (a followed file: until the replay is closed).
    fn run(&mut self, path: &Path, follow: bool) -> std::io::Result<()> {
        let mut reader = reader_at(path, Position::default(), Continuation::default(), follow)?;
        let mut watch = Watch::new(path);
        loop {
            if self.index.cancelled() {
                return Ok(());
            }
            let next = reader.poll();
            if !matches!(next, Ok(Next::Event { .. })) {
                self.report = reader.report().clone();
                self.bytes_read = reader.raw_read();
            }
            match next? {
                Next::Event { event, at, .. } => {
                    self.event(*event, at, reader.consumed(), reader.continuation());
                    if self.pos % PUBLISH_EVERY == 0 {
                        self.report = reader.report().clone();
                        self.bytes_read = reader.raw_read();
                        self.publish(false, None);
                    }
                }
                Next::End => {
                    self.publish(false, None);
                    return Ok(());
                }
                Next::Pending => {
                    // Read to its end for now: whoever waits for the whole file may go on.
                    self.publish(true, None);
                    self.wait_for_more();
                    if reader.source().current_path() != watch.path() {
                        watch = Watch::new(reader.source().current_path());
                    }
                    if let Some(why) = watch.changed(reader.source().current_raw_read()) {
                        reader = reader_at(path, Position::default(), Continuation::default(), follow)?;
                        watch = Watch::new(path);
                        self.start_over(why);
                    }
                }
            }
        }
    }

    fn wait_for_more(&self) {
        let st = self.index.lock();
        if !self.index.cancelled() {
            let _ = self.index.changed.wait_timeout(st, FOLLOW_EVERY);
        }
    }

    /// The followed file started over: so does the index, in a new generation.
    fn start_over(&mut self, why: Restart) {
        *self = Indexer { observer: self.observer.take(), ..Indexer::new(self.index, None) };
        let mut st = self.index.lock();
        let generation = st.generation + 1;
        let mut restarts = std::mem::take(&mut st.restarts);
        restarts.push(why);
        *st = IndexState { generation, restarts, ..IndexState::default() };
        drop(st);
        self.index.changed.notify_all();
    }

    fn event(&mut self, e: Event, at: Position, decoded: u64, run: &Continuation) {
        if decoded - self.last_checkpoint >= self.interval {
            self.last_checkpoint = decoded;
            self.checkpoint(at, run);
        }
        self.snapshot.apply(&e);
        self.pos += 1;
        self.end_t_ns = self.end_t_ns.max(e.t_ns);
        if matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. }) {
            self.steps_seen += 1;
            if self.steps_seen % self.step_stride == 0 {
                self.new_steps.push(StepStart { step: e.step, pos: self.pos });
            }
        }
        if let Some(o) = &mut self.observer {
            o.on_event(&e);
        }
    }

    /// A checkpoint before the event at `at`, within the budget.
    fn checkpoint(&mut self, at: Position, run: &Continuation) {
        let bytes = json_size(&self.snapshot);
        // One snapshot larger than half the budget is never kept: seeks read from an earlier
        // checkpoint instead.
        if bytes > CHECKPOINT_BUDGET / 2 {
            self.interval = self.interval.saturating_mul(2);
            return;
        }
        let held: u64 = {
            let st = self.index.lock();
            st.checkpoints.iter().map(|c| c.bytes).sum::<u64>()
        } + self.new_checkpoints.iter().map(|c| c.bytes).sum::<u64>();
        if held + bytes > CHECKPOINT_BUDGET {
            self.publish(false, None);
            let mut st = self.index.lock();
            thin(&mut st.checkpoints);
            drop(st);
            self.interval = self.interval.saturating_mul(2);
        }
        self.new_checkpoints.push(Checkpoint {
            pos: self.pos,
            at,
            t_ns: self.end_t_ns,
            snapshot: Arc::new(self.snapshot.clone()),
            run: run.clone(),
            bytes,
        });
    }

    fn publish(&mut self, done: bool, error: Option<String>) {
        {
            let mut st = self.index.lock();
            st.total = self.pos;
            st.end_t_ns = self.end_t_ns;
            st.checkpoints.append(&mut self.new_checkpoints);
            st.step_starts.append(&mut self.new_steps);
            if st.step_starts.len() > MAX_STEP_STARTS {
                thin(&mut st.step_starts);
                self.step_stride = self.step_stride.saturating_mul(2);
            }
            st.report = self.report.clone();
            st.bytes_read = st.bytes_read.max(self.bytes_read);
            st.done = done;
            if error.is_some() {
                st.error = error;
            }
        }
        self.index.changed.notify_all();
    }
}

/// Keeps the first entry and every other one after it.
fn thin<T>(v: &mut Vec<T>) {
    let mut i = 0;
    v.retain(|_| {
        let keep = i % 2 == 0;
        i += 1;
        keep
    });
}
