//! Reading telemetry: a streaming [`Reader`] over any byte stream, one line at a time, with a
//! bound on line length, and a [`ReadReport`] that counts every skipped line by reason.
//!
//! Memory does not depend on the input's size: the reader holds one line (at most
//! [`MAX_LINE_BYTES`]); a longer line is skipped and counted without being buffered whole, so
//! even `/dev/zero` reads in constant memory.

use super::super::model::{Event, EventKind, MIN_SCHEMA_VERSION, SCHEMA_VERSION};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{self, BufRead};

/// Longest line the reader accepts, in bytes (the longest real event is a few KiB).
pub const MAX_LINE_BYTES: usize = 4 << 20;
/// Skipped lines kept as examples in a report; the counts by reason are always complete.
pub const MAX_SKIPPED_KEPT: usize = 100;
/// Characters of a parser message kept in an example.
const DETAIL_CHARS: usize = 160;

/// Why a line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Not valid JSON, or JSON that is not an object.
    Malformed,
    /// An object without a `v` (schema version) field.
    MissingVersion,
    /// A `v` that is not a whole number.
    InvalidVersion,
    /// A `v` outside [`MIN_SCHEMA_VERSION`]`..=`[`SCHEMA_VERSION`].
    UnsupportedVersion,
    /// A `kind` this version does not know (or no `kind`).
    UnknownKind,
    /// A known kind whose fields do not fit: an unknown phase or enum value, a missing field, a
    /// number out of range.
    InvalidValue,
    /// Longer than [`MAX_LINE_BYTES`].
    LineTooLong,
    /// Bytes that are not UTF-8.
    NotUtf8,
    /// The last line has no newline and does not parse: cut off while being written.
    Truncated,
}

impl SkipReason {
    /// Every reason, in report order.
    pub const ALL: [SkipReason; 9] = [
        SkipReason::Malformed,
        SkipReason::MissingVersion,
        SkipReason::InvalidVersion,
        SkipReason::UnsupportedVersion,
        SkipReason::UnknownKind,
        SkipReason::InvalidValue,
        SkipReason::LineTooLong,
        SkipReason::NotUtf8,
        SkipReason::Truncated,
    ];

    /// How a summary names lines skipped for this reason.
    pub fn describe(self) -> &'static str {
        match self {
            SkipReason::Malformed => "malformed",
            SkipReason::MissingVersion => "without a schema version",
            SkipReason::InvalidVersion => "with an invalid schema version",
            SkipReason::UnsupportedVersion => "of an unsupported schema version",
            SkipReason::UnknownKind => "of unknown kind",
            SkipReason::InvalidValue => "with an invalid value",
            SkipReason::LineTooLong => "too long",
            SkipReason::NotUtf8 => "not UTF-8",
            SkipReason::Truncated => "truncated",
        }
    }
}

/// One skipped line, as an example.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// 1-based line number.
    pub line: u64,
    pub reason: SkipReason,
    /// Parser message, shortened.
    pub detail: String,
}

/// What reading found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadReport {
    pub lines: u64,
    pub events: u64,
    pub blank: u64,
    /// The first skipped lines, as examples (at most [`MAX_SKIPPED_KEPT`]).
    pub skipped: Vec<Skipped>,
    /// Every skipped line.
    pub skipped_total: u64,
    /// Every skipped line, by reason.
    #[serde(default)]
    pub skipped_by_reason: BTreeMap<SkipReason, u64>,
}

impl ReadReport {
    /// Counts line `line` as skipped for `reason` (readers outside this module, which vet events
    /// further, count their refusals here too).
    pub fn skip(&mut self, line: u64, reason: SkipReason, detail: String) {
        self.skipped_total = self.skipped_total.saturating_add(1);
        let n = self.skipped_by_reason.entry(reason).or_insert(0);
        *n = n.saturating_add(1);
        if self.skipped.len() < MAX_SKIPPED_KEPT {
            self.skipped.push(Skipped {
                line,
                reason,
                detail: detail.chars().take(DETAIL_CHARS).collect(),
            });
        }
    }

    /// Skipped lines of one reason (all of them, not only the examples).
    pub fn count(&self, reason: SkipReason) -> u64 {
        self.skipped_by_reason.get(&reason).copied().unwrap_or(0)
    }

    /// Adds another report's counts (a file read in parts). Line numbers of the other report's
    /// examples are taken as they are.
    pub fn merge(&mut self, other: &ReadReport) {
        self.lines = self.lines.saturating_add(other.lines);
        self.events = self.events.saturating_add(other.events);
        self.blank = self.blank.saturating_add(other.blank);
        self.skipped_total = self.skipped_total.saturating_add(other.skipped_total);
        for (r, n) in &other.skipped_by_reason {
            let m = self.skipped_by_reason.entry(*r).or_insert(0);
            *m = m.saturating_add(*n);
        }
        let room = MAX_SKIPPED_KEPT.saturating_sub(self.skipped.len());
        self.skipped.extend(other.skipped.iter().take(room).cloned());
    }

    /// "read 1200 events from 1203 lines; skipped 3 (2 malformed, 1 truncated)".
    pub fn summary(&self) -> String {
        let mut s = format!("read {} events from {} lines", self.events, self.lines);
        if self.skipped_total > 0 {
            let parts: Vec<String> = SkipReason::ALL
                .iter()
                .filter_map(|r| {
                    let n = self.count(*r);
                    (n > 0).then(|| format!("{n} {}", r.describe()))
                })
                .collect();
            s.push_str(&format!("; skipped {} ({})", self.skipped_total, parts.join(", ")));
        }
        s
    }

    /// Accounts for one line's outcome.
    pub(crate) fn record(&mut self, outcome: LineOutcome) -> Option<Event> {
        self.lines = self.lines.saturating_add(1);
        match outcome {
            LineOutcome::Event(e) => {
                self.events = self.events.saturating_add(1);
                Some(*e)
            }
            LineOutcome::Blank => {
                self.blank = self.blank.saturating_add(1);
                None
            }
            LineOutcome::Skip(reason, detail) => {
                self.skip(self.lines, reason, detail);
                None
            }
        }
    }
}

/// What one line turned out to be.
#[derive(Debug)]
pub(crate) enum LineOutcome {
    Event(Box<Event>),
    Blank,
    Skip(SkipReason, String),
}

/// Parses one line. `Ok(None)` for a blank line.
pub fn parse_line(line: &str) -> Result<Option<Event>, (SkipReason, String)> {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    match serde_json::from_str::<Event>(trimmed) {
        Ok(e) if !(MIN_SCHEMA_VERSION..=SCHEMA_VERSION).contains(&e.v) => Err((
            SkipReason::UnsupportedVersion,
            format!(
                "schema version {} (this reader knows {MIN_SCHEMA_VERSION} to {SCHEMA_VERSION})",
                e.v
            ),
        )),
        Ok(e) => Ok(Some(e)),
        Err(err) => Err(classify(trimmed, err)),
    }
}

/// Why a line that did not parse as an event did not (the slow path, for bad lines only).
fn classify(text: &str, err: serde_json::Error) -> (SkipReason, String) {
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(_) => return (SkipReason::Malformed, err.to_string()),
    };
    let Some(obj) = value.as_object() else {
        return (SkipReason::Malformed, "not a JSON object".into());
    };
    match obj.get("v") {
        None => return (SkipReason::MissingVersion, "no 'v' field".into()),
        Some(v) => match v.as_u64() {
            None => return (SkipReason::InvalidVersion, format!("'v' is {v}, expected a whole number")),
            Some(n) if !(MIN_SCHEMA_VERSION as u64..=SCHEMA_VERSION as u64).contains(&n) => {
                return (
                    SkipReason::UnsupportedVersion,
                    format!("schema version {n} (this reader knows {MIN_SCHEMA_VERSION} to {SCHEMA_VERSION})"),
                )
            }
            Some(_) => {}
        },
    }
    match obj.get("kind").and_then(|k| k.as_str()) {
        None => (SkipReason::UnknownKind, "no 'kind' field".into()),
        Some(k) if !EventKind::names().contains(&k) => {
            (SkipReason::UnknownKind, format!("kind '{}'", k.chars().take(64).collect::<String>()))
        }
        Some(_) => (SkipReason::InvalidValue, err.to_string()),
    }
}

/// Parses one line's bytes.
pub(crate) fn parse_bytes(raw: &[u8], complete: bool) -> LineOutcome {
    let text = match std::str::from_utf8(raw) {
        Ok(t) => t,
        Err(e) => return LineOutcome::Skip(SkipReason::NotUtf8, e.to_string()),
    };
    match parse_line(text) {
        Ok(Some(e)) => LineOutcome::Event(Box::new(e)),
        Ok(None) => LineOutcome::Blank,
        Err((_, detail)) if !complete => LineOutcome::Skip(SkipReason::Truncated, detail),
        Err((reason, detail)) => LineOutcome::Skip(reason, detail),
    }
}

/// One line being gathered from a byte stream, bounded by [`MAX_LINE_BYTES`].
#[derive(Debug, Default)]
pub(crate) struct LineBuf {
    line: Vec<u8>,
    /// The line grew past the bound: its bytes are dropped until its newline.
    too_long: bool,
    /// Bytes of the current line seen so far (kept or dropped).
    seen: usize,
}

/// A line the [`LineBuf`] completed.
pub(crate) enum Gathered<'a> {
    Line(&'a [u8]),
    TooLong(usize),
}

impl LineBuf {
    /// Takes bytes from `data` up to and including the first newline. Returns how many bytes
    /// it took and whether that ended a line.
    pub(crate) fn feed(&mut self, data: &[u8]) -> (usize, bool) {
        let (take, ends) = match memchr::memchr(b'\n', data) {
            Some(i) => (i + 1, true),
            None => (data.len(), false),
        };
        self.seen = self.seen.saturating_add(take);
        if !self.too_long {
            if self.line.len() + take > MAX_LINE_BYTES + 1 {
                self.too_long = true;
                self.line = Vec::new();
            } else {
                self.line.extend_from_slice(&data[..take]);
            }
        }
        (take, ends)
    }

    /// The line gathered so far (at a newline, or at the end of the input).
    pub(crate) fn gathered(&self) -> Gathered<'_> {
        if self.too_long {
            Gathered::TooLong(self.seen)
        } else {
            Gathered::Line(&self.line)
        }
    }

    /// True when nothing of a line has been gathered.
    pub(crate) fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Starts the next line.
    pub(crate) fn clear(&mut self) {
        self.line.clear();
        self.too_long = false;
        self.seen = 0;
        // A line near the bound leaves a large buffer behind: give it back.
        if self.line.capacity() > 1 << 20 {
            self.line = Vec::new();
        }
    }

    /// Bytes held (for tests of the memory bound).
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.line.capacity()
    }

    /// What the gathered line is. `complete`: it ended with a newline.
    pub(crate) fn outcome(&self, complete: bool) -> LineOutcome {
        match self.gathered() {
            Gathered::Line(raw) => parse_bytes(raw, complete),
            Gathered::TooLong(n) => LineOutcome::Skip(
                SkipReason::LineTooLong,
                format!("{n} bytes (at most {MAX_LINE_BYTES})"),
            ),
        }
    }
}

/// Reads events from a byte stream one line at a time: an iterator of events (an I/O error ends
/// it with an `Err`), with a report of everything skipped.
#[derive(Debug)]
pub struct Reader<R> {
    inner: R,
    pub(super) line: LineBuf,
    report: ReadReport,
    /// Bytes consumed from `inner` so far.
    offset: u64,
    /// Offset where the line being gathered started.
    line_start: u64,
    done: bool,
    /// Where a compressed stream reports that it ended damaged.
    damage: Option<super::zst::Damage>,
}

impl<R: BufRead> Reader<R> {
    /// A reader at the start of `inner`.
    pub fn new(inner: R) -> Reader<R> {
        Reader::at(inner, 0)
    }

    /// A reader of `inner`, which starts at `offset` bytes into its stream (after a seek).
    pub fn at(inner: R, offset: u64) -> Reader<R> {
        Reader {
            inner,
            line: LineBuf::default(),
            report: ReadReport::default(),
            offset,
            line_start: offset,
            done: false,
            damage: None,
        }
    }

    /// A reader of a decompressed stream whose damage (a skipped frame, an incomplete last frame)
    /// it reports as a truncated line each.
    pub(crate) fn with_damage(inner: R, damage: Option<super::zst::Damage>) -> Reader<R> {
        let mut r = Reader::new(inner);
        r.damage = damage;
        r
    }

    fn report_damage(&mut self) {
        let Some(d) = &self.damage else { return };
        let log = std::mem::take(&mut *d.lock().unwrap_or_else(|p| p.into_inner()));
        let more = (0..log.more).map(|_| "another damaged compressed frame".to_owned());
        for msg in log.messages.into_iter().chain(more) {
            self.report.lines = self.report.lines.saturating_add(1);
            let n = self.report.lines;
            self.report.skip(n, SkipReason::Truncated, msg);
        }
    }

    /// What has been read so far.
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    /// Consumes the reader, returning its report.
    pub fn into_report(self) -> ReadReport {
        self.report
    }

    /// Bytes of the stream consumed so far (the start of the next line).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The next event with the offset of its line's first byte, skipping (and counting) lines
    /// that are not events; `None` at the end.
    pub fn next_with_offset(&mut self) -> Option<io::Result<(u64, Event)>> {
        while !self.done {
            let (took, ends) = match self.inner.fill_buf() {
                Ok([]) => {
                    self.done = true;
                    if self.line.is_empty() {
                        self.report_damage();
                        return None;
                    }
                    (0, false)
                }
                Ok(buf) => self.line.feed(buf),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            };
            self.inner.consume(took);
            self.offset += took as u64;
            if !ends && !self.done {
                continue;
            }
            let start = self.line_start;
            let outcome = self.line.outcome(ends);
            self.line.clear();
            self.line_start = self.offset;
            let event = self.report.record(outcome);
            self.report_damage();
            if let Some(e) = event {
                return Some(Ok((start, e)));
            }
        }
        None
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = io::Result<Event>;

    fn next(&mut self) -> Option<io::Result<Event>> {
        self.next_with_offset().map(|r| r.map(|(_, e)| e))
    }
}

/// Reads every event from a byte stream (see [`Reader`] to stream instead).
pub fn read_from(r: impl BufRead) -> io::Result<(Vec<Event>, ReadReport)> {
    let mut reader = Reader::new(r);
    let mut events = Vec::new();
    for e in &mut reader {
        events.push(e?);
    }
    Ok((events, reader.into_report()))
}
