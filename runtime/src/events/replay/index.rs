//! The index of a telemetry file, built on a background thread while the replay already shows
//! the file's start: where each checkpoint's line starts in the file, the snapshot at that point,
//! and where each training step begins.
//!
//! A checkpoint is taken every [`CHECKPOINT_BYTES`] of decoded input, so a 1 GB file has about
//! 128 of them and reaching any position means applying at most one interval of events. In a
//! compressed file a position is a frame's offset plus the decoded bytes to skip inside it; the
//! sink writes small frames, so the skip is short (a foreign file of one huge frame still works,
//! only slower to seek).

use super::super::jsonl::read::{LineBuf, ReadReport};
use super::super::jsonl::SkipReason;
use super::super::jsonl::{zst, JsonlError};
use super::super::model::{Event, EventKind, Phase};
use super::super::snapshot::Snapshot;
use super::file::IndexObserver;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Decoded bytes between two checkpoints (small in tests, to exercise many of them).
pub const CHECKPOINT_BYTES: u64 = if cfg!(test) { 32 << 10 } else { 8 << 20 };

/// Where a line starts: decode from `raw` (a frame start, or the line itself in a plain file)
/// and skip `skip` decoded bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    pub raw: u64,
    pub skip: u64,
}

/// The state after the first `pos` events, and where event `pos` starts.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub pos: usize,
    pub at: Position,
    /// Time of the last event applied (0 at the start).
    pub t_ns: u64,
    pub snapshot: Arc<Snapshot>,
}

/// A `phase_changed` to `step_begin`: the step it begins, and the position just after it (so
/// that the step shows as current there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStart {
    pub step: u64,
    pub pos: usize,
}

/// What the indexer found so far.
#[derive(Debug, Default)]
pub struct IndexState {
    pub total: usize,
    pub end_t_ns: u64,
    pub checkpoints: Vec<Checkpoint>,
    /// Where each training step begins, in file order.
    pub step_starts: Vec<StepStart>,
    pub report: ReadReport,
    /// Bytes of the file indexed so far (of a compressed file: up to the frame being read).
    pub bytes_read: u64,
    pub done: bool,
    pub error: Option<String>,
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

    /// Blocks until the whole file is indexed.
    pub fn wait(&self) {
        let mut st = self.lock();
        while !st.done {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stops the indexer (the replay was dropped).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Whether a file is zstd-compressed.
pub fn is_compressed(path: &Path) -> io::Result<bool> {
    let mut head = [0u8; 4];
    let mut f = File::open(path)?;
    let n = f.read(&mut head)?;
    Ok(zst::is_zstd(&head[..n]))
}

/// A byte stream of the file's decoded content from `at`.
pub fn stream_at(path: &Path, compressed: bool, at: Position) -> io::Result<Box<dyn BufRead + Send>> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(at.raw))?;
    let f = BufReader::with_capacity(256 * 1024, f);
    let mut s: Box<dyn BufRead + Send> = if compressed {
        // Damaged frames are skipped as the index skipped them (it has counted them).
        Box::new(BufReader::with_capacity(256 * 1024, zst::Frames::new(f).0))
    } else {
        Box::new(f)
    };
    io::copy(&mut (&mut s).take(at.skip), &mut io::sink())?;
    Ok(s)
}

/// Starts indexing `path` on a thread of its own.
pub fn spawn(
    path: PathBuf,
    compressed: bool,
    observer: Option<Box<dyn IndexObserver>>,
) -> Result<Arc<Index>, JsonlError> {
    let index = Arc::new(Index::default());
    index.lock().checkpoints.push(Checkpoint {
        pos: 0,
        at: Position::default(),
        t_ns: 0,
        snapshot: Arc::new(Snapshot::new()),
    });
    let worker = index.clone();
    std::thread::Builder::new()
        .name("stagehand-replay-index".into())
        .spawn(move || {
            let mut ix = Indexer::new(&worker, observer);
            let result = if compressed { ix.compressed(&path) } else { ix.plain(&path) };
            let mut error = result.err().map(|e| e.to_string());
            if error.is_none() && ix.cancelled() {
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
    line: LineBuf,
    report: ReadReport,
    snapshot: Snapshot,
    pos: usize,
    end_t_ns: u64,
    /// Where the line being gathered started.
    line_at: Position,
    /// Where the next byte fed starts.
    next_at: Position,
    last_checkpoint: u64,
    decoded: u64,
    new_checkpoints: Vec<Checkpoint>,
    new_steps: Vec<StepStart>,
    observer: Option<Box<dyn IndexObserver>>,
}

impl<'a> Indexer<'a> {
    fn new(index: &'a Index, observer: Option<Box<dyn IndexObserver>>) -> Indexer<'a> {
        Indexer {
            index,
            observer,
            line: LineBuf::default(),
            report: ReadReport::default(),
            snapshot: Snapshot::new(),
            pos: 0,
            end_t_ns: 0,
            line_at: Position::default(),
            next_at: Position::default(),
            last_checkpoint: 0,
            decoded: 0,
            new_checkpoints: Vec::new(),
            new_steps: Vec::new(),
        }
    }

    fn cancelled(&self) -> bool {
        self.index.cancel.load(Ordering::Relaxed)
    }

    fn plain(&mut self, path: &Path) -> io::Result<()> {
        let mut f = BufReader::with_capacity(1 << 20, File::open(path)?);
        loop {
            let buf = f.fill_buf()?;
            if buf.is_empty() || self.cancelled() {
                break;
            }
            let n = buf.len();
            let chunk = buf.to_vec();
            f.consume(n);
            self.feed(&chunk, true);
        }
        self.finish();
        Ok(())
    }

    fn compressed(&mut self, path: &Path) -> io::Result<()> {
        let mut f = File::open(path)?;
        let mut raw: Vec<u8> = Vec::new();
        let mut raw_at = 0u64; // file offset of raw[0]
        let mut chunk = vec![0u8; 1 << 20];
        let mut eof = false;
        while !self.cancelled() {
            if let Some(n) = zst::frame_len(&raw) {
                let frame: Vec<u8> = raw.drain(..n).collect();
                self.next_at = Position { raw: raw_at, skip: 0 };
                let mut out = Vec::new();
                match zst::decode_frame(&frame, |b| out.extend_from_slice(b)) {
                    Ok(()) => self.feed(&out, false),
                    // A damaged frame is skipped and counted; the frames after it still read.
                    Err(e) => self.damaged(format!("a damaged compressed frame of {n} bytes at byte {raw_at}: {e}")),
                }
                raw_at += n as u64;
                continue;
            }
            if eof {
                if !raw.is_empty() {
                    self.damaged(format!("{} bytes of an incomplete compressed frame at the end", raw.len()));
                }
                break;
            }
            if raw.len() > zst::MAX_FRAME_BYTES {
                // A foreign file of one huge frame: decode the rest as a stream from its start.
                self.next_at = Position { raw: raw_at, skip: 0 };
                let rest = io::Cursor::new(std::mem::take(&mut raw)).chain(f);
                let mut d = zst::decoder(BufReader::new(rest))?;
                loop {
                    let k = d.read(&mut chunk)?;
                    if k == 0 || self.cancelled() {
                        break;
                    }
                    let data = chunk[..k].to_vec();
                    self.feed(&data, false);
                }
                break;
            }
            let k = f.read(&mut chunk)?;
            if k == 0 {
                eof = true;
            }
            raw.extend_from_slice(&chunk[..k]);
        }
        self.finish();
        Ok(())
    }

    /// Feeds decoded bytes starting at `self.next_at`. `plain`: positions are file offsets.
    fn feed(&mut self, mut data: &[u8], plain: bool) {
        while !data.is_empty() {
            if self.line.is_empty() {
                self.line_at = self.next_at;
            }
            let (took, ends) = self.line.feed(data);
            data = &data[took..];
            if plain {
                self.next_at.raw += took as u64;
            } else {
                self.next_at.skip += took as u64;
            }
            self.decoded += took as u64;
            if ends {
                let outcome = self.line.outcome(true);
                self.line.clear();
                if let Some(e) = self.report.record(outcome) {
                    self.event(e);
                }
            }
        }
    }

    fn damaged(&mut self, detail: String) {
        self.report.lines = self.report.lines.saturating_add(1);
        let n = self.report.lines;
        self.report.skip(n, SkipReason::Truncated, detail);
    }

    fn event(&mut self, e: Event) {
        if self.decoded - self.last_checkpoint >= CHECKPOINT_BYTES {
            self.last_checkpoint = self.decoded;
            self.new_checkpoints.push(Checkpoint {
                pos: self.pos,
                at: self.line_at,
                t_ns: self.end_t_ns,
                snapshot: Arc::new(self.snapshot.clone()),
            });
        }
        self.snapshot.apply(&e);
        self.pos += 1;
        self.end_t_ns = self.end_t_ns.max(e.t_ns);
        if matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. }) {
            self.new_steps.push(StepStart { step: e.step, pos: self.pos });
        }
        if let Some(o) = &mut self.observer {
            o.on_event(&e);
        }
        if self.pos % PUBLISH_EVERY == 0 {
            self.publish(false, None);
        }
    }

    fn finish(&mut self) {
        if !self.line.is_empty() {
            let outcome = self.line.outcome(false);
            self.line.clear();
            if let Some(e) = self.report.record(outcome) {
                self.event(e);
            }
        }
    }

    fn publish(&mut self, done: bool, error: Option<String>) {
        {
            let mut st = self.index.lock();
            st.total = self.pos;
            st.end_t_ns = self.end_t_ns;
            st.checkpoints.append(&mut self.new_checkpoints);
            st.step_starts.append(&mut self.new_steps);
            st.report = self.report.clone();
            st.bytes_read = st.bytes_read.max(self.next_at.raw);
            st.done = done;
            if error.is_some() {
                st.error = error;
            }
        }
        self.index.changed.notify_all();
    }
}
