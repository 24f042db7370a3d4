//! The JSONL file sink: whole lines, whole batches, nothing lost unreported.
//!
//! Events are serialized into a buffer and written as one batch (one zstd frame when
//! compressing). A batch that fails part way (a full disk) is rolled back to the last complete
//! line with `set_len`, so a reader never meets a broken line mid-file; its events are counted
//! as lost, and the count reaches every consumer as a `telemetry_lost` event (see
//! [`EventSink::notices`]). Where the output cannot be rolled back (a pipe, a device), the next
//! batch starts on a fresh line so only the broken line is damaged.
//!
//! With rotation the file closes at a size bound and the next segment opens
//! (`run.jsonl`, `run.0001.jsonl`, ...), each starting with the run's [`Preamble`] so that it
//! reads alone.

use super::super::bus::EventSink;
use super::super::model::{Event, EventKind};
use super::super::preamble::Preamble;
use super::rotation::segment_path;
use super::{zst, JsonlError};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How the sink treats an existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Refuse an existing file (no telemetry is ever overwritten).
    CreateNew,
    /// Append to an existing file (a run resumed into the same telemetry).
    Append,
}

/// Where a sink writes.
pub trait SinkTarget: Send {
    /// Writes all of `buf`; on error some prefix of it may have been written.
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Cuts the output back to its first `len` bytes, or fails where that is impossible.
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        let _ = len;
        Err(io::Error::new(io::ErrorKind::Unsupported, "this output cannot be rolled back"))
    }
}

impl SinkTarget for File {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        Write::write_all(self, buf)
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        // Opened for appending: the next write goes to the new end.
        self.set_len(len)
    }
}

/// Bytes buffered before a write, whatever the batching says (a compressed batch is one frame:
/// far below [`zst::MAX_FRAME_DECODED`]).
const MAX_BUFFER: usize = 1 << 20;
/// A plain file is written at the end of a batch once this much is buffered or ...
const PLAIN_BATCH_BYTES: usize = 64 * 1024;
/// ... once the oldest buffered event waited this long (followers see a live file promptly).
const PLAIN_BATCH_AGE: Duration = Duration::from_millis(100);
/// A compressed file writes larger frames, less often (compression works on whole frames).
const ZSTD_BATCH_BYTES: usize = 512 * 1024;
const ZSTD_BATCH_AGE: Duration = Duration::from_secs(1);

/// Writes every event it sees as one JSON line.
pub struct JsonlSink {
    /// The first segment's path (the one the user named), or a label for other targets.
    path: PathBuf,
    target: Box<dyn SinkTarget>,
    compress: bool,
    rotate_bytes: Option<u64>,
    segment: u32,
    /// Serialized lines not yet written, and how many events they hold.
    buf: Vec<u8>,
    buffered: u64,
    oldest: Option<Instant>,
    /// Bytes of the current segment known to end on a complete line.
    committed: u64,
    /// Events written to the current segment (what a frame record says came before its frame).
    segment_events: u64,
    /// Bytes of the current segment's preamble: a segment holding no more is never rotated (a
    /// bound smaller than the preamble would otherwise open a segment per batch).
    floor: u64,
    /// A write failed and could not be rolled back: start the next batch on a fresh line.
    broken_tail: bool,
    written: u64,
    lost: u64,
    reported_lost: u64,
    last_error: Option<String>,
    preamble: Preamble,
    paths: Vec<PathBuf>,
}

impl std::fmt::Debug for JsonlSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonlSink")
            .field("path", &self.path)
            .field("written", &self.written)
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

/// Opens `path` for a sink. A path that exists and is not a regular file (a device such as
/// `/dev/full`, a pipe) is opened for writing as it is; a regular file is refused or appended to
/// as `mode` says. Errors say what happened to which path.
fn open_file(path: &Path, mode: OpenMode) -> Result<(File, u64), JsonlError> {
    let io_err = |e| JsonlError::io(path, e);
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            let f = OpenOptions::new().write(true).open(path).map_err(io_err)?;
            return Ok((f, 0));
        }
        Ok(_) if mode == OpenMode::CreateNew => return Err(JsonlError::Exists(path.to_path_buf())),
        _ => {}
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err)?;
    }
    let mut opts = OpenOptions::new();
    opts.append(true);
    match mode {
        OpenMode::CreateNew => opts.create_new(true),
        OpenMode::Append => opts.create(true),
    };
    let file = opts.open(path).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            JsonlError::Exists(path.to_path_buf())
        } else {
            io_err(e)
        }
    })?;
    let len = file.metadata().map_err(io_err)?.len();
    Ok((file, len))
}

impl JsonlSink {
    /// Opens `path` for writing plain JSONL; parent folders are created.
    pub fn open(path: impl AsRef<Path>, mode: OpenMode) -> Result<JsonlSink, JsonlError> {
        JsonlSink::open_with(path, mode, false, None)
    }

    /// Opens `path`, compressing with zstd when `compress`, rotating to a new numbered segment
    /// when a segment reaches `rotate_bytes`.
    pub fn open_with(
        path: impl AsRef<Path>,
        mode: OpenMode,
        compress: bool,
        rotate_bytes: Option<u64>,
    ) -> Result<JsonlSink, JsonlError> {
        let path = path.as_ref().to_path_buf();
        let (file, len) = open_file(&path, mode)?;
        let mut sink = JsonlSink::to_target(Box::new(file), path.clone(), compress);
        sink.committed = len;
        sink.rotate_bytes = rotate_bytes.filter(|b| *b > 0);
        sink.paths = vec![path];
        Ok(sink)
    }

    /// A sink writing to any target (`label` names it in reports and `telemetry_lost` events).
    pub fn to_target(target: Box<dyn SinkTarget>, label: impl Into<PathBuf>, compress: bool) -> JsonlSink {
        JsonlSink {
            path: label.into(),
            target,
            compress,
            rotate_bytes: None,
            segment: 0,
            buf: Vec::with_capacity(64 * 1024),
            buffered: 0,
            oldest: None,
            committed: 0,
            segment_events: 0,
            floor: 0,
            broken_tail: false,
            written: 0,
            lost: 0,
            reported_lost: 0,
            last_error: None,
            preamble: Preamble::new(),
            paths: Vec::new(),
        }
    }

    /// The file being written (the first segment when rotating).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every file written so far (the segments, when rotating).
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Events written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Events lost so far: serialized but not written because a write failed.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// The last write error, if any.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    fn write_batch(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.buffered);
        self.oldest = None;
        if self.broken_tail {
            self.buf.insert(0, b'\n');
        }
        let data = if self.compress {
            match zst::compress_frame(&self.buf, events, self.segment_events) {
                Ok(frame) => frame,
                Err(e) => {
                    self.buf.clear();
                    return self.fail(events, &e);
                }
            }
        } else {
            std::mem::take(&mut self.buf)
        };
        self.buf.clear();
        match self.target.write_all(&data) {
            Ok(()) => {
                self.committed += data.len() as u64;
                self.written += events;
                self.segment_events += events;
                self.broken_tail = false;
            }
            Err(e) => {
                // Roll back to the last complete line; if that is impossible the next batch
                // starts with a newline so that only this line is damaged.
                self.broken_tail = self.target.truncate(self.committed).is_err();
                self.fail(events, &e);
            }
        }
        if self.compress {
            return;
        }
        // Reuse the allocation for the next batch.
        self.buf = data;
        self.buf.clear();
    }

    fn fail(&mut self, events: u64, e: &io::Error) {
        self.lost = self.lost.saturating_add(events);
        let msg = e.to_string();
        if self.last_error.is_none() {
            eprintln!(
                "stagehand: writing telemetry to '{}' failed: {msg}; counting lost events",
                self.path.display()
            );
        }
        self.last_error = Some(msg);
    }

    /// Closes the segment at the size bound and opens the next one with the preamble.
    fn maybe_rotate(&mut self) {
        let Some(limit) = self.rotate_bytes else { return };
        if self.committed < limit || self.committed <= self.floor || self.paths.is_empty() {
            return;
        }
        let next = segment_path(&self.path, self.segment + 1);
        match open_file(&next, OpenMode::CreateNew) {
            Ok((file, _)) => {
                self.segment += 1;
                self.target = Box::new(file);
                self.committed = 0;
                self.segment_events = 0;
                self.broken_tail = false;
                self.paths.push(next);
                // Whatever is buffered goes after the preamble, which is written at once so
                // that the segment reads alone.
                let pending = std::mem::take(&mut self.buf);
                let pending_events = std::mem::take(&mut self.buffered);
                for e in self.preamble.events() {
                    self.push_line(&e);
                    // Frames stay small whatever the preamble (a reader decodes them in a
                    // bounded window).
                    if self.buf.len() >= MAX_BUFFER {
                        self.write_batch();
                    }
                }
                self.write_batch();
                self.floor = self.committed;
                self.buf = pending;
                self.buffered = pending_events;
            }
            Err(e) => {
                // Keep writing the full segment rather than lose events.
                self.rotate_bytes = None;
                self.last_error = Some(e.to_string());
                eprintln!("stagehand: cannot rotate telemetry: {e}; the current file keeps growing");
            }
        }
    }

    fn push_line(&mut self, e: &Event) {
        if serde_json::to_writer(&mut self.buf, e).is_ok() {
            self.buf.push(b'\n');
            self.buffered += 1;
            self.oldest.get_or_insert_with(Instant::now);
        }
    }

    fn due(&self) -> bool {
        let (bytes, age) = if self.compress {
            (ZSTD_BATCH_BYTES, ZSTD_BATCH_AGE)
        } else {
            (PLAIN_BATCH_BYTES, PLAIN_BATCH_AGE)
        };
        self.buf.len() >= bytes || self.oldest.is_some_and(|t| t.elapsed() >= age)
    }
}

impl EventSink for JsonlSink {
    fn on_event(&mut self, event: &Event) {
        self.preamble.observe(event);
        self.push_line(event);
        if self.buf.len() >= MAX_BUFFER {
            self.write_batch();
            self.maybe_rotate();
        }
    }

    fn flush(&mut self) {
        self.write_batch();
        self.maybe_rotate();
    }

    fn batch_end(&mut self) {
        if self.due() {
            self.flush();
        }
    }

    fn notices(&mut self) -> Vec<EventKind> {
        if self.lost == self.reported_lost {
            return Vec::new();
        }
        let lost = self.lost - self.reported_lost;
        self.reported_lost = self.lost;
        vec![EventKind::TelemetryLost {
            sink: self.path.display().to_string(),
            lost,
            total: self.lost,
            reason: self.last_error.clone().unwrap_or_default(),
        }]
    }
}

impl Drop for JsonlSink {
    fn drop(&mut self) {
        EventSink::flush(self);
    }
}
