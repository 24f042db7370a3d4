//! JSONL telemetry: one event per line.
//!
//! The sink writes whole lines only: events are serialized into a buffer and each batch is
//! written with one `write_all` that ends on a line boundary, so a killed process leaves a file
//! whose lines are complete except, at worst, the last. The reader replays such a file as the
//! same stream of events, skipping and counting truncated or corrupt lines, and can follow a file
//! that is still being written.

use super::bus::EventSink;
use super::model::Event;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
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

/// How the sink treats an existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Refuse an existing file (no telemetry is ever overwritten).
    CreateNew,
    /// Append to an existing file, as the seed did.
    Append,
}

/// Writes every event it sees as one JSON line.
#[derive(Debug)]
pub struct JsonlSink {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    written: u64,
    failed: Option<String>,
}

impl JsonlSink {
    /// Opens `path` for writing; parent folders are created.
    pub fn open(path: impl AsRef<Path>, mode: OpenMode) -> Result<JsonlSink, JsonlError> {
        let path = path.as_ref().to_path_buf();
        let io_err = |source| JsonlError::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io_err)?;
        }
        let mut opts = OpenOptions::new();
        match mode {
            OpenMode::CreateNew => opts.write(true).create_new(true),
            OpenMode::Append => opts.append(true).create(true),
        };
        let file = opts.open(&path).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                JsonlError::Exists(path.clone())
            } else {
                io_err(e)
            }
        })?;
        Ok(JsonlSink {
            path,
            file,
            buf: Vec::with_capacity(64 * 1024),
            written: 0,
            failed: None,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Events written so far.
    pub fn written(&self) -> u64 {
        self.written
    }
}

impl EventSink for JsonlSink {
    fn on_event(&mut self, event: &Event) {
        if serde_json::to_writer(&mut self.buf, event).is_ok() {
            self.buf.push(b'\n');
            self.written += 1;
        }
        if self.buf.len() >= 1 << 20 {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        if let Err(e) = self.file.write_all(&self.buf) {
            // Report once; training goes on without telemetry rather than failing.
            if self.failed.is_none() {
                eprintln!(
                    "stagehand: writing telemetry to '{}' failed: {e}",
                    self.path.display()
                );
                self.failed = Some(e.to_string());
            }
        }
        self.buf.clear();
    }
}

impl Drop for JsonlSink {
    fn drop(&mut self) {
        EventSink::flush(self);
    }
}

/// Why a line was skipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Not valid JSON (a truncated or corrupted line).
    Corrupt,
    /// Valid JSON with an event kind this version does not know.
    UnknownKind,
    /// Written by a newer schema version.
    NewerSchema,
    /// The last line has no newline: cut off while being written.
    Truncated,
}

/// One skipped line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// 1-based line number.
    pub line: u64,
    pub reason: SkipReason,
    /// Parser message, shortened.
    pub detail: String,
}

/// What reading a file found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadReport {
    pub lines: u64,
    pub events: u64,
    pub blank: u64,
    /// The first skipped lines (at most [`MAX_SKIPPED_KEPT`]); `skipped_total` counts all.
    pub skipped: Vec<Skipped>,
    pub skipped_total: u64,
}

/// Skipped lines kept in a report; the count goes on beyond it.
pub const MAX_SKIPPED_KEPT: usize = 100;

impl ReadReport {
    fn skip(&mut self, line: u64, reason: SkipReason, detail: String) {
        self.skipped_total += 1;
        if self.skipped.len() < MAX_SKIPPED_KEPT {
            let detail: String = detail.chars().take(160).collect();
            self.skipped.push(Skipped {
                line,
                reason,
                detail,
            });
        }
    }

    /// Skipped lines of one reason.
    pub fn count(&self, reason: SkipReason) -> usize {
        self.skipped.iter().filter(|s| s.reason == reason).count()
    }

    /// "read 1200 events from 1203 lines; skipped 3 (2 corrupt, 1 truncated)".
    pub fn summary(&self) -> String {
        let mut s = format!("read {} events from {} lines", self.events, self.lines);
        if self.skipped_total > 0 {
            let parts: Vec<String> = [
                (SkipReason::Corrupt, "corrupt"),
                (SkipReason::Truncated, "truncated"),
                (SkipReason::UnknownKind, "of unknown kind"),
                (SkipReason::NewerSchema, "of a newer schema"),
            ]
            .iter()
            .filter_map(|(r, name)| {
                let n = self.count(r.clone());
                (n > 0).then(|| format!("{n} {name}"))
            })
            .collect();
            s.push_str(&format!(
                "; skipped {} ({})",
                self.skipped_total,
                parts.join(", ")
            ));
        }
        s
    }
}

/// Parses one line. `Ok(None)` for a blank line.
pub fn parse_line(line: &str) -> Result<Option<Event>, (SkipReason, String)> {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    match serde_json::from_str::<Event>(trimmed) {
        Ok(e) if e.v > super::model::SCHEMA_VERSION => Err((
            SkipReason::NewerSchema,
            format!("schema version {} (this reader knows {})", e.v, super::model::SCHEMA_VERSION),
        )),
        Ok(e) => Ok(Some(e)),
        Err(err) => {
            // Tell a known-good line of an unknown kind from garbage.
            match serde_json::from_str::<serde_json::Value>(trimmed) {
                Ok(v) if v.get("kind").and_then(|k| k.as_str()).is_some() => Err((
                    SkipReason::UnknownKind,
                    format!(
                        "kind '{}': {err}",
                        v["kind"].as_str().unwrap_or_default()
                    ),
                )),
                _ => Err((SkipReason::Corrupt, err.to_string())),
            }
        }
    }
}

/// Reads a whole file: every event that parses, and a report of what was skipped.
pub fn read_file(path: impl AsRef<Path>) -> Result<(Vec<Event>, ReadReport), JsonlError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| JsonlError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    read_from(BufReader::new(file)).map_err(|source| JsonlError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads events from any reader (see [`read_file`]).
pub fn read_from(mut r: impl BufRead) -> io::Result<(Vec<Event>, ReadReport)> {
    let mut events = Vec::new();
    let mut report = ReadReport::default();
    let mut raw = Vec::new();
    loop {
        raw.clear();
        let n = r.read_until(b'\n', &mut raw)?;
        if n == 0 {
            break;
        }
        report.lines += 1;
        let complete = raw.last() == Some(&b'\n');
        let line = String::from_utf8_lossy(&raw);
        match parse_line(&line) {
            Ok(Some(e)) => {
                report.events += 1;
                events.push(e);
            }
            Ok(None) => report.blank += 1,
            Err((reason, detail)) => {
                let reason = if complete { reason } else { SkipReason::Truncated };
                report.skip(report.lines, reason, detail);
            }
        }
    }
    Ok((events, report))
}

/// Follows a file that is still being written, like `tail -f`: each call to
/// [`Follower::poll`] returns the events of the lines completed since the last call. A partial
/// last line is held back until its newline arrives.
#[derive(Debug)]
pub struct Follower {
    path: PathBuf,
    file: File,
    offset: u64,
    pending: Vec<u8>,
    report: ReadReport,
}

impl Follower {
    /// Starts following `path` from its beginning.
    pub fn open(path: impl AsRef<Path>) -> Result<Follower, JsonlError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| JsonlError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(Follower {
            path,
            file,
            offset: 0,
            pending: Vec::new(),
            report: ReadReport::default(),
        })
    }

    /// What has been read so far.
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    /// Events from lines completed since the last poll.
    pub fn poll(&mut self) -> Result<Vec<Event>, JsonlError> {
        let io_err = |source| JsonlError::Io {
            path: self.path.clone(),
            source,
        };
        let len = self.file.metadata().map_err(io_err)?.len();
        if len < self.offset {
            // Truncated and rewritten: start over.
            self.offset = 0;
            self.pending.clear();
        }
        self.file.seek(SeekFrom::Start(self.offset)).map_err(io_err)?;
        let mut chunk = Vec::new();
        (&mut self.file)
            .take(len - self.offset)
            .read_to_end(&mut chunk)
            .map_err(io_err)?;
        self.offset += chunk.len() as u64;
        self.pending.extend_from_slice(&chunk);
        let mut events = Vec::new();
        while let Some(nl) = self.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=nl).collect();
            self.report.lines += 1;
            match parse_line(&String::from_utf8_lossy(&line)) {
                Ok(Some(e)) => {
                    self.report.events += 1;
                    events.push(e);
                }
                Ok(None) => self.report.blank += 1,
                Err((reason, detail)) => {
                    let n = self.report.lines;
                    self.report.skip(n, reason, detail)
                }
            }
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::model::{BlockId, EventKind, Phase};

    fn event(seq: u64) -> Event {
        Event::new(seq, seq * 10, 1, Phase::Forward, EventKind::PrefetchHit { block: BlockId(seq as u32) })
    }

    #[test]
    fn sink_then_reader_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/telemetry.jsonl");
        {
            let mut sink = JsonlSink::open(&path, OpenMode::CreateNew).expect("opens");
            for i in 1..=100 {
                sink.on_event(&event(i));
            }
            sink.flush();
        }
        let (events, report) = read_file(&path).expect("reads");
        assert_eq!(events.len(), 100);
        assert_eq!(events[41], event(42));
        assert_eq!(report.skipped_total, 0);
    }

    #[test]
    fn existing_file_is_never_overwritten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, "keep me\n").expect("write");
        let err = JsonlSink::open(&path, OpenMode::CreateNew).expect_err("refuses");
        assert!(err.to_string().contains("already exists"), "{err}");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "keep me\n");
        let mut sink = JsonlSink::open(&path, OpenMode::Append).expect("appends");
        sink.on_event(&event(1));
        drop(sink);
        assert_eq!(read_file(&path).expect("reads").0.len(), 1);
    }

    #[test]
    fn corrupt_truncated_and_unknown_lines_are_skipped_and_counted() {
        let good = serde_json::to_string(&event(1)).expect("json");
        let good2 = serde_json::to_string(&event(2)).expect("json");
        let text = format!(
            "{good}\n{{\"not an event\n\n{{\"v\":1,\"seq\":9,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"from_the_future\"}}\n{good2}\n{}",
            &good[..good.len() / 2]
        );
        let (events, report) = read_from(io::Cursor::new(text)).expect("reads");
        assert_eq!(events.len(), 2);
        assert_eq!(report.count(SkipReason::Corrupt), 1);
        assert_eq!(report.count(SkipReason::UnknownKind), 1);
        assert_eq!(report.count(SkipReason::Truncated), 1);
        assert_eq!(report.skipped[0].line, 2);
        assert_eq!(report.blank, 1);
        assert!(report.summary().contains("skipped 3"), "{}", report.summary());
    }

    #[test]
    fn follower_holds_partial_lines_until_complete() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("live.jsonl");
        let line = serde_json::to_string(&event(1)).expect("json");
        std::fs::write(&path, format!("{line}\n{}", &line[..10])).expect("write");
        let mut f = Follower::open(&path).expect("opens");
        assert_eq!(f.poll().expect("poll").len(), 1);
        let mut file = OpenOptions::new().append(true).open(&path).expect("open");
        writeln!(file, "{}", &line[10..]).expect("append");
        let more = f.poll().expect("poll");
        assert_eq!(more, vec![event(1)]);
        assert_eq!(f.report().skipped_total, 0);
    }
}
