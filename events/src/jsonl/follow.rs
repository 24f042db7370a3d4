//! Following a telemetry file that is still being written, like `tail -f`.
//!
//! Each [`Follower::poll`] reads what was appended since the last one (linear in the file's
//! size however it grows) and returns the events of the lines completed since; a partial last
//! line waits for its newline (bounded by the line limit), and a compressed file's incomplete
//! last frame for its end. Reading goes through the same [`Reader`] as every other reader, so
//! a damaged frame, a flood of blank lines or a file that is no telemetry are handled alike.
//!
//! A file that shrank, whose first bytes changed (truncated and rewritten), or whose path now
//! names another file (replaced) is not merged with what came before: the poll says
//! [`Restart`] and the follower starts over on the new content. A rotated run is followed across
//! its segments (`run.jsonl`, `run.0001.jsonl`, ...); a segment missing between two others, or
//! one of another run, is an error that names it.

use super::super::model::Event;
use super::read::{Next, ReadReport, Reader};
use super::source::{read_full, Position, RunSource};
use super::JsonlError;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Bytes of a segment's start remembered to notice a rewrite.
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

/// The file being read, as it was when first seen, to notice it being rewritten or replaced.
#[derive(Debug)]
pub(crate) struct Watch {
    path: PathBuf,
    identity: Option<(u64, u64)>,
    head: Vec<u8>,
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

fn read_head(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let mut head = vec![0u8; HEAD];
    let n = read_full(&mut f, &mut head)?;
    head.truncate(n);
    Ok(head)
}

impl Watch {
    pub(crate) fn new(path: &Path) -> Watch {
        let identity = std::fs::metadata(path).ok().as_ref().and_then(identity);
        Watch { path: path.to_path_buf(), identity, head: read_head(path).unwrap_or_default() }
    }

    /// The file watched.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file under the path is no longer the one read, or was rewritten; `read` is
    /// how many of its bytes were read so far.
    pub(crate) fn changed(&mut self, read: u64) -> Option<Restart> {
        let meta = std::fs::metadata(&self.path).ok();
        let now = meta.as_ref().and_then(identity);
        if now.is_some() && now != self.identity {
            return Some(Restart::Replaced);
        }
        let len = meta.map_or(0, |m| m.len());
        if len < read {
            return Some(Restart::Truncated);
        }
        let head = read_head(&self.path).unwrap_or_default();
        let common = head.len().min(self.head.len());
        if head[..common] != self.head[..common] {
            return Some(Restart::Truncated);
        }
        if head.len() > self.head.len() {
            self.head = head;
        }
        None
    }
}

/// Follows a growing telemetry file.
#[derive(Debug)]
pub struct Follower {
    base: PathBuf,
    reader: Reader<RunSource>,
    watch: Watch,
    /// The last poll read everything there was.
    caught_up: bool,
}

impl Follower {
    /// Starts following `path` from its beginning.
    pub fn open(path: impl AsRef<Path>) -> Result<Follower, JsonlError> {
        let base = path.as_ref().to_path_buf();
        let reader = Follower::reader(&base)?;
        Ok(Follower { watch: Watch::new(&base), base, reader, caught_up: false })
    }

    fn reader(base: &Path) -> Result<Reader<RunSource>, JsonlError> {
        let src = RunSource::open(base, Position::default(), true).map_err(|e| JsonlError::io(base, e))?;
        Ok(Reader::from_source(src))
    }

    /// What has been read so far (since the last restart).
    pub fn report(&self) -> &ReadReport {
        self.reader.report()
    }

    /// The file being read now (a later segment of a rotated run, after the first).
    pub fn current_path(&self) -> &Path {
        self.reader.source().current_path()
    }

    /// Bytes read so far over every segment (since the last restart), for a progress line.
    pub fn bytes_read(&self) -> u64 {
        self.reader.raw_read()
    }

    /// Whether the last poll read everything written so far (no later segment waits either).
    pub fn caught_up(&self) -> bool {
        self.caught_up
    }

    /// Events from lines completed since the last poll, and whether the file started over.
    pub fn poll(&mut self) -> Result<Polled, JsonlError> {
        self.poll_limited(u64::MAX)
    }

    /// Like [`poll`](Self::poll), reading at most about `max_bytes` of decoded input, so that a
    /// large file already on disk comes in parts; poll again until
    /// [`caught_up`](Self::caught_up).
    pub fn poll_limited(&mut self, max_bytes: u64) -> Result<Polled, JsonlError> {
        let mut out = Polled::default();
        if self.current_path() != self.watch.path {
            self.watch = Watch::new(self.reader.source().current_path());
        }
        let read = self.reader.source().current_raw_read();
        if let Some(why) = self.watch.changed(read) {
            self.reader = Follower::reader(&self.base)?;
            self.watch = Watch::new(&self.base);
            out.restarted = Some(why);
        }
        self.reader.set_budget(Some(max_bytes.max(1)));
        self.caught_up = false;
        loop {
            let path = self.reader.source().current_path().to_path_buf();
            match self.reader.poll().map_err(|e| JsonlError::io(&path, e))? {
                Next::Event { event, .. } => out.events.push(*event),
                Next::Pending => {
                    self.caught_up = !self.reader.out_of_budget();
                    break;
                }
                Next::End => {
                    self.caught_up = true;
                    break;
                }
            }
        }
        Ok(out)
    }
}
