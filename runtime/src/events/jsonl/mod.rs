//! JSONL telemetry: one event per line, plain or zstd-compressed (`.jsonl.zst`).
//!
//! - [`JsonlSink`] writes whole lines only and never leaves a broken line in the middle of a
//!   file: a failed write is rolled back to the last complete line, and what is lost is counted.
//! - [`Reader`] streams events from any byte stream in constant memory; [`open`] opens a plain or
//!   compressed file (told apart by its first bytes, not its name); [`read_file`] reads a whole
//!   file into memory for small inputs.
//! - [`Follower`] follows a file that is still being written, like `tail -f`, and says when the
//!   file was truncated or replaced under it.

mod follow;
pub(crate) mod read;
mod sink;
pub mod zst;

pub use follow::{Follower, Polled, Restart};
pub use read::{parse_line, read_from, ReadReport, Reader, SkipReason, Skipped, MAX_LINE_BYTES, MAX_SKIPPED_KEPT};
pub use sink::{segment_path, segments, JsonlSink, OpenMode, SinkTarget};

use super::model::Event;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Errors of the JSONL sink and reader.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    /// The file exists and the sink was not asked to append.
    #[error("telemetry file '{0}' already exists; choose another path or open it for appending")]
    Exists(PathBuf),
    /// Opening, reading or writing failed.
    #[error("telemetry file '{path}': {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl JsonlError {
    pub(crate) fn io(path: &Path, source: io::Error) -> JsonlError {
        JsonlError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A file's bytes, decompressed when it is zstd.
pub type FileStream = Box<dyn BufRead + Send>;

/// Opens a telemetry file for reading, plain or zstd-compressed (recognised by its magic
/// number), as a streaming [`Reader`].
/// In a compressed file a damaged frame is skipped and an incomplete last frame (a writer killed
/// mid-frame) ends the events; each counts as one truncated line, and the rest reads.
pub fn open(path: impl AsRef<Path>) -> Result<Reader<FileStream>, JsonlError> {
    let path = path.as_ref();
    let (stream, damage) = open_stream(path).map_err(|e| JsonlError::io(path, e))?;
    Ok(Reader::with_damage(stream, damage))
}

/// The decompressed bytes of a file, and where a compressed one reports damage.
pub(crate) fn open_stream(path: &Path) -> io::Result<(FileStream, Option<zst::Damage>)> {
    let mut file = BufReader::with_capacity(256 * 1024, File::open(path)?);
    if zst::is_zstd(file.fill_buf()?) {
        let (d, damage) = zst::Frames::new(file);
        Ok((Box::new(BufReader::with_capacity(256 * 1024, d)), Some(damage)))
    } else {
        Ok((Box::new(file), None))
    }
}

/// Reads a whole file into memory: every event that parses, and a report of what was skipped.
/// For large files stream with [`open`] instead.
pub fn read_file(path: impl AsRef<Path>) -> Result<(Vec<Event>, ReadReport), JsonlError> {
    let path = path.as_ref();
    let mut reader = open(path)?;
    let mut events = Vec::new();
    for e in &mut reader {
        events.push(e.map_err(|e| JsonlError::io(path, e))?);
    }
    Ok((events, reader.into_report()))
}

#[cfg(test)]
mod tests;
