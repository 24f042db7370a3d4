//! JSONL telemetry: one event per line, plain or zstd-compressed (`.jsonl.zst`), in one file or
//! rotated into numbered segments.
//!
//! - [`JsonlSink`] writes whole lines only and never leaves a broken line in the middle of a
//!   file: a failed write is rolled back to the last complete line, and what is lost is counted.
//!   Compressed, each batch is a zstd frame with a record of its events ([`zst`]).
//! - [`Reader`] streams events from any [`ByteSource`] in bounded memory and time; [`open`]
//!   opens a file, plain or compressed (told apart by its first bytes, not its name), and reads a
//!   rotated run's segments as one file; [`read_file`] reads a whole file into memory for small
//!   inputs. A damaged compressed frame costs that frame, counted in events.
//! - [`Follower`] follows a file that is still being written, like `tail -f`, and says when the
//!   file was truncated or replaced under it.

pub(crate) mod follow;
pub(crate) mod read;
pub mod rotation;
mod sink;
pub mod source;
pub mod zst;

pub use follow::{Follower, Polled, Restart};
pub use read::{
    parse_line, read_from, Continuation, Next, ReadReport, Reader, SkipReason, Skipped, MAX_BARREN_BYTES, MAX_LINE_BYTES,
    MAX_SKIPPED_KEPT,
};
pub use rotation::{segment_path, segments};
pub use sink::{JsonlSink, OpenMode, SinkTarget};
pub use source::{ByteSource, Plain, Position, RunSource};

use super::model::Event;
use std::io;
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

/// Opens a telemetry file for reading, plain or zstd-compressed (recognised by its first
/// bytes), as a streaming [`Reader`]. A rotated run's later segments (`run.0001.jsonl`, ...)
/// follow its first as one file; a missing segment is an error that names it.
pub fn open(path: impl AsRef<Path>) -> Result<Reader<RunSource>, JsonlError> {
    let path = path.as_ref();
    let src = RunSource::open(path, Position::default(), false).map_err(|e| JsonlError::io(path, e))?;
    Ok(Reader::from_source(src))
}

/// Reads a whole file (every segment of a rotated run) into memory: every event that parses,
/// and a report of what was skipped. For large files stream with [`open`] instead.
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
