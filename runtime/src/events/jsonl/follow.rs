//! Following a telemetry file that is still being written, like `tail -f`.
//!
//! Each [`Follower::poll`] reads what was appended since the last one, in chunks (linear in the
//! file's size however it grows), and returns the events of the lines completed since; a partial
//! last line waits for its newline (bounded by the line limit). Compressed files are decoded
//! frame by frame as frames complete.
//!
//! A file that shrank, whose first bytes changed (truncated and rewritten), or whose path now
//! names another file (replaced) is not merged with what came before: the poll says
//! [`Restart`] and the follower starts over on the new content. A rotated run is followed across
//! its segments (`run.jsonl`, `run.0001.jsonl`, ...), skipping the preamble each segment repeats.

use super::super::model::Event;
use super::super::preamble::Preamble;
use super::read::{LineBuf, ReadReport, SkipReason};
use super::sink::segment_path;
use super::{zst, JsonlError};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Bytes read from the file per system call.
const CHUNK: usize = 1 << 20;
/// Bytes of the file's start remembered to notice a rewrite.
const HEAD: usize = 256;

/// Why a follower started over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restart {
    /// The file shrank or its beginning changed: it was truncated and written again.
    Truncated,
    /// The path now names another file (deleted and created again, or moved away).
    Replaced,
}

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Polled {
    /// Set when the follower started over: `events` come from the new content, and whatever the
    /// consumer built from earlier events belongs to another run.
    pub restarted: Option<Restart>,
    /// Events of the lines completed since the last poll.
    pub events: Vec<Event>,
}

/// Follows a growing telemetry file.
#[derive(Debug)]
pub struct Follower {
    base: PathBuf,
    segment: u32,
    path: PathBuf,
    file: File,
    identity: Option<(u64, u64)>,
    offset: u64,
    head: Vec<u8>,
    compressed: Option<bool>,
    raw: Vec<u8>,
    line: LineBuf,
    report: ReadReport,
    /// Highest sequence number seen, to skip the preamble a continuation segment repeats.
    seen_seq: u64,
    skipping_preamble: bool,
    /// Bytes of the segments finished before the current one.
    done_bytes: u64,
    /// Bytes the current poll may still read.
    budget: u64,
}

fn identity(m: &std::fs::Metadata) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Some((m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = m;
        None
    }
}

impl Follower {
    /// Starts following `path` from its beginning.
    pub fn open(path: impl AsRef<Path>) -> Result<Follower, JsonlError> {
        let path = path.as_ref().to_path_buf();
        let (file, identity) = Follower::open_file(&path)?;
        Ok(Follower {
            base: path.clone(),
            segment: 0,
            path,
            file,
            identity,
            offset: 0,
            head: Vec::new(),
            compressed: None,
            raw: Vec::new(),
            line: LineBuf::default(),
            report: ReadReport::default(),
            seen_seq: 0,
            skipping_preamble: false,
            done_bytes: 0,
            budget: u64::MAX,
        })
    }

    fn open_file(path: &Path) -> Result<(File, Option<(u64, u64)>), JsonlError> {
        let file = File::open(path).map_err(|e| JsonlError::io(path, e))?;
        let id = file.metadata().ok().as_ref().and_then(identity);
        Ok((file, id))
    }

    /// What has been read so far (since the last restart).
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    /// The file being read now (a later segment of a rotated run, after the first).
    pub fn current_path(&self) -> &Path {
        &self.path
    }

    /// Bytes read so far over every segment (since the last restart), for a progress line.
    pub fn bytes_read(&self) -> u64 {
        self.done_bytes.saturating_add(self.offset)
    }

    /// Whether everything written so far has been read (no later segment waits either).
    pub fn caught_up(&self) -> bool {
        let len = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        self.offset >= len && !segment_path(&self.base, self.segment + 1).exists()
    }

    fn start_over(&mut self, segment: u32) -> Result<(), JsonlError> {
        let path = segment_path(&self.base, segment);
        let (file, id) = Follower::open_file(&path)?;
        self.segment = segment;
        self.path = path;
        self.file = file;
        self.identity = id;
        self.offset = 0;
        self.head.clear();
        self.compressed = None;
        self.raw.clear();
        self.line = LineBuf::default();
        Ok(())
    }

    /// Whether the file under the path is no longer the one being read, or was rewritten.
    fn restart_needed(&mut self, len: u64) -> Result<Option<Restart>, JsonlError> {
        let now = std::fs::metadata(&self.path).ok().as_ref().and_then(identity);
        if now.is_some() && now != self.identity {
            return Ok(Some(Restart::Replaced));
        }
        if len < self.offset {
            return Ok(Some(Restart::Truncated));
        }
        if !self.head.is_empty() {
            let mut now = vec![0u8; self.head.len()];
            self.file.seek(SeekFrom::Start(0)).map_err(|e| JsonlError::io(&self.path, e))?;
            let n = read_full(&mut self.file, &mut now).map_err(|e| JsonlError::io(&self.path, e))?;
            if now[..n] != self.head[..] {
                return Ok(Some(Restart::Truncated));
            }
        }
        Ok(None)
    }

    /// Events from lines completed since the last poll, and whether the file started over.
    pub fn poll(&mut self) -> Result<Polled, JsonlError> {
        self.poll_limited(u64::MAX)
    }

    /// Like [`poll`](Self::poll), reading at most about `max_bytes` (whole chunks) of the file,
    /// so that a large file already on disk comes in parts; poll again until
    /// [`caught_up`](Self::caught_up).
    pub fn poll_limited(&mut self, max_bytes: u64) -> Result<Polled, JsonlError> {
        self.budget = max_bytes.max(1);
        let mut out = Polled::default();
        let len = self.file.metadata().map_err(|e| JsonlError::io(&self.path, e))?.len();
        if let Some(why) = self.restart_needed(len)? {
            self.start_over(0)?;
            self.report = ReadReport::default();
            self.done_bytes = 0;
            self.seen_seq = 0;
            self.skipping_preamble = false;
            out.restarted = Some(why);
            return self.read_new(out);
        }
        self.read_new(out)
    }

    fn read_new(&mut self, mut out: Polled) -> Result<Polled, JsonlError> {
        loop {
            let len = self.file.metadata().map_err(|e| JsonlError::io(&self.path, e))?.len();
            self.read_to(len, &mut out.events)?;
            if self.offset < len {
                // This poll's share is read; the rest comes with the next.
                return Ok(out);
            }
            // A rotated run goes on in the next segment once it exists; this one is complete.
            let next = segment_path(&self.base, self.segment + 1);
            if next.exists() {
                let len = self.file.metadata().map_err(|e| JsonlError::io(&self.path, e))?.len();
                self.read_to(len, &mut out.events)?;
                if self.offset < len {
                    return Ok(out);
                }
                self.end_of_segment(&mut out.events);
                self.done_bytes = self.done_bytes.saturating_add(self.offset);
                self.start_over(self.segment + 1)?;
                self.skipping_preamble = true;
                continue;
            }
            return Ok(out);
        }
    }

    /// A partial last line of a finished segment is all there will be of it.
    fn end_of_segment(&mut self, out: &mut Vec<Event>) {
        if !self.line.is_empty() {
            let outcome = self.line.outcome(false);
            self.line.clear();
            if let Some(e) = self.report.record(outcome) {
                self.emit(e, out);
            }
        }
    }

    fn read_to(&mut self, len: u64, out: &mut Vec<Event>) -> Result<(), JsonlError> {
        let io_err = |path: &Path, e| JsonlError::io(path, e);
        self.file.seek(SeekFrom::Start(self.offset)).map_err(|e| io_err(&self.path, e))?;
        let mut chunk = vec![0u8; CHUNK];
        while self.offset < len && self.budget > 0 {
            let want = ((len - self.offset) as usize).min(CHUNK);
            let n = read_full(&mut self.file, &mut chunk[..want]).map_err(|e| io_err(&self.path, e))?;
            if n == 0 {
                break;
            }
            if self.head.len() < HEAD {
                let room = HEAD - self.head.len();
                self.head.extend_from_slice(&chunk[..n.min(room)]);
            }
            self.offset += n as u64;
            self.budget = self.budget.saturating_sub(n as u64);
            let data = &chunk[..n];
            if self.compressed.is_none() && self.head.len() >= zst::MAGIC.len() {
                self.compressed = Some(zst::is_zstd(&self.head));
            }
            match self.compressed {
                Some(true) => self.feed_compressed(data, out)?,
                // Fewer than four bytes so far: plain until proven otherwise only if they
                // cannot start a zstd frame.
                None if zst::MAGIC.starts_with(&self.head) => self.raw.extend_from_slice(data),
                _ => {
                    if !self.raw.is_empty() {
                        let held = std::mem::take(&mut self.raw);
                        self.feed_lines(&held, out);
                    }
                    self.feed_lines(data, out)
                }
            }
        }
        Ok(())
    }

    fn feed_compressed(&mut self, data: &[u8], out: &mut Vec<Event>) -> Result<(), JsonlError> {
        self.raw.extend_from_slice(data);
        while let Some(n) = zst::frame_len(&self.raw) {
            let frame: Vec<u8> = self.raw.drain(..n).collect();
            let mut decoded = Vec::new();
            match zst::decode_frame(&frame, |b| decoded.extend_from_slice(b)) {
                Ok(()) => self.feed_lines(&decoded, out),
                // A damaged frame is skipped and counted; the frames after it still read.
                Err(e) => {
                    self.report.lines = self.report.lines.saturating_add(1);
                    let line = self.report.lines;
                    self.report.skip(line, SkipReason::Truncated, format!("a damaged compressed frame of {n} bytes: {e}"));
                }
            }
        }
        if self.raw.len() > zst::MAX_FRAME_BYTES {
            return Err(JsonlError::io(
                &self.path,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a zstd frame larger than {} bytes cannot be followed", zst::MAX_FRAME_BYTES),
                ),
            ));
        }
        Ok(())
    }

    fn feed_lines(&mut self, mut data: &[u8], out: &mut Vec<Event>) {
        while !data.is_empty() {
            let (took, ends) = self.line.feed(data);
            data = &data[took..];
            if ends {
                let outcome = self.line.outcome(true);
                self.line.clear();
                if let Some(e) = self.report.record(outcome) {
                    self.emit(e, out);
                }
            }
        }
    }

    fn emit(&mut self, e: Event, out: &mut Vec<Event>) {
        if self.skipping_preamble {
            if Preamble::is_context(&e.kind) && e.seq <= self.seen_seq {
                return;
            }
            self.skipping_preamble = false;
        }
        self.seen_seq = self.seen_seq.max(e.seq);
        out.push(e);
    }
}

/// Reads until `buf` is full or the end of the file.
fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
