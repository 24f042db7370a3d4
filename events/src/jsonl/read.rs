//! Reading telemetry: a streaming [`Reader`] over any [`ByteSource`], one line at a time, with a
//! bound on line length, and a [`ReadReport`] that counts every skipped line by reason and every
//! damaged place by the events it lost.
//!
//! Memory does not depend on the input's size: the reader holds one line (at most
//! [`MAX_LINE_BYTES`]); a longer line is skipped and counted without being buffered whole. Time
//! is bounded too: runs of blank lines are passed over at memory speed, and input that holds no
//! telemetry for [`MAX_BARREN_BYTES`] (`/dev/zero`, a flood of blank lines, a binary file) ends
//! the read with an error instead of being read to its end.
//!
//! Across the segments of a rotated run, the context each later segment repeats (its preamble)
//! is passed over, and a segment that belongs to another run is an error that names it.

use super::super::model::{Event, EventKind, MIN_SCHEMA_VERSION, SCHEMA_VERSION};
use super::super::preamble::Preamble;
use super::source::{ByteSource, Damage, Piece, Plain, Position};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{self, BufRead};
use std::path::PathBuf;

/// Longest line the reader accepts, in bytes (the longest real event is a few KiB).
pub const MAX_LINE_BYTES: usize = 4 << 20;
/// Skipped lines kept as examples in a report; the counts by reason are always complete.
pub const MAX_SKIPPED_KEPT: usize = 100;
/// Characters of a parser message kept in an example.
const DETAIL_CHARS: usize = 160;
/// Bytes of input without a line of telemetry after which a reader gives up: no telemetry file
/// has that much of anything else in a row (a line is at most [`MAX_LINE_BYTES`]).
pub const MAX_BARREN_BYTES: u64 = 64 << 20;

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
    /// Context events a later segment of a rotated run repeats (its preamble), passed over.
    #[serde(default)]
    pub repeated: u64,
    /// Damaged places in a compressed file: frames that did not decode or whose checksum did
    /// not match, and bytes that are no frame.
    #[serde(default)]
    pub damaged: u64,
    /// Events lost in damaged places, as the frames' records count them.
    #[serde(default)]
    pub damaged_events: u64,
    /// Damaged places whose events are not counted (no record: a file of another writer).
    #[serde(default)]
    pub damaged_uncounted: u64,
    /// The first damaged places, described (at most [`MAX_SKIPPED_KEPT`]).
    #[serde(default)]
    pub damage: Vec<String>,
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

    /// Counts a damaged place of a compressed file and the events it lost (`None`: not known).
    pub fn damaged_place(&mut self, lost: Option<u64>, detail: &str) {
        self.damaged = self.damaged.saturating_add(1);
        match lost {
            Some(n) => self.damaged_events = self.damaged_events.saturating_add(n),
            None => self.damaged_uncounted = self.damaged_uncounted.saturating_add(1),
        }
        if self.damage.len() < MAX_SKIPPED_KEPT {
            let lost = lost.map_or_else(|| "events not counted".to_owned(), |n| format!("{n} events lost"));
            self.damage.push(format!("{} ({lost})", detail.chars().take(DETAIL_CHARS * 2).collect::<String>()));
        }
    }

    /// Events that could not be read: each skipped line held one, each damaged frame the events
    /// its record counts (frames without a record are not in this count: see
    /// [`ReadReport::damaged_uncounted`]).
    pub fn lost_events(&self) -> u64 {
        self.skipped_total.saturating_add(self.damaged_events)
    }

    /// Adds another report's counts (a file read in parts). Line numbers of the other report's
    /// examples are taken as they are.
    pub fn merge(&mut self, other: &ReadReport) {
        self.lines = self.lines.saturating_add(other.lines);
        self.events = self.events.saturating_add(other.events);
        self.blank = self.blank.saturating_add(other.blank);
        self.repeated = self.repeated.saturating_add(other.repeated);
        self.damaged = self.damaged.saturating_add(other.damaged);
        self.damaged_events = self.damaged_events.saturating_add(other.damaged_events);
        self.damaged_uncounted = self.damaged_uncounted.saturating_add(other.damaged_uncounted);
        let room = MAX_SKIPPED_KEPT.saturating_sub(self.damage.len());
        self.damage.extend(other.damage.iter().take(room).cloned());
        self.skipped_total = self.skipped_total.saturating_add(other.skipped_total);
        for (r, n) in &other.skipped_by_reason {
            let m = self.skipped_by_reason.entry(*r).or_insert(0);
            *m = m.saturating_add(*n);
        }
        let room = MAX_SKIPPED_KEPT.saturating_sub(self.skipped.len());
        self.skipped.extend(other.skipped.iter().take(room).cloned());
    }

    /// "read 1200 events from 1203 lines; skipped 3 (2 malformed, 1 truncated); lost 405
    /// events in 1 damaged compressed frame; 12 blank lines": every event not read is in it.
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
        if self.damaged > 0 {
            let frames = |n: u64| if n == 1 { "frame" } else { "frames" };
            let counted = self.damaged - self.damaged_uncounted;
            if counted > 0 {
                s.push_str(&format!(
                    "; lost {} events in {counted} damaged compressed {}",
                    self.damaged_events,
                    frames(counted)
                ));
            }
            if self.damaged_uncounted > 0 {
                s.push_str(&format!(
                    "; {} damaged compressed {} without a record of their events (their events are lost, number unknown)",
                    self.damaged_uncounted,
                    frames(self.damaged_uncounted)
                ));
            }
        }
        if self.blank > 0 {
            s.push_str(&format!("; {} blank lines", self.blank));
        }
        s
    }

    /// Accounts for one line's outcome.
    pub(crate) fn record(&mut self, outcome: LineOutcome) -> Option<Box<Event>> {
        self.lines = self.lines.saturating_add(1);
        match outcome {
            LineOutcome::Event(e) => {
                self.events = self.events.saturating_add(1);
                Some(e)
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

/// What [`Reader::poll`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// An event, the position of its line's first byte and the position just after its line.
    Event { event: Box<Event>, at: Position, end: Position },
    /// A file being followed (or a reader out of budget) has nothing more for now.
    Pending,
    /// The end.
    End,
}

/// What a reader knows of the run so far, to tell a later segment's repeated context from new
/// events, and a segment of another run from one of this run.
#[derive(Debug, Clone, Default)]
pub struct Continuation {
    /// The run's `run_started`: its id and wall-clock anchor.
    pub run: Option<(String, u64)>,
    /// The highest sequence number read so far in this run.
    pub seen_seq: u64,
}

/// Reads events from a [`ByteSource`] one line at a time: an iterator of events (an I/O error,
/// or input that is not telemetry, ends it with an `Err`), with a report of everything skipped.
#[derive(Debug)]
pub struct Reader<S> {
    src: S,
    pub(super) line: LineBuf,
    /// Where the line being gathered started.
    line_at: Position,
    report: ReadReport,
    /// Decoded bytes consumed so far.
    consumed: u64,
    /// Bytes consumed since the last line of telemetry.
    barren: u64,
    /// Decoded bytes the reader may still consume before it says `Pending` (`None`: no bound).
    budget: Option<u64>,
    /// The compressed frame being read: its record's events, and the lines read from it.
    frame: Option<(Option<u64>, u64)>,
    /// Lines of the current segment so far, read or lost (`None` when the reader started
    /// inside a segment): compared with the frame records' counts, it turns damage without a
    /// record into a count of events.
    seg_lines: Option<u64>,
    /// Damaged places without a count since the last record.
    uncounted: u64,
    run: Continuation,
    /// A later segment began (its path): its first events are checked and its preamble passed
    /// over, until its first new event.
    segment_start: Option<PathBuf>,
    ended: bool,
}

impl<R: BufRead + Send> Reader<Plain<R>> {
    /// A reader of the plain JSONL in `inner`.
    pub fn new(inner: R) -> Reader<Plain<R>> {
        Reader::from_source(Plain::new(inner, 0))
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl<S: ByteSource> Reader<S> {
    /// A reader of `src` from its start.
    pub fn from_source(src: S) -> Reader<S> {
        Reader {
            src,
            line: LineBuf::default(),
            line_at: Position::default(),
            report: ReadReport::default(),
            consumed: 0,
            barren: 0,
            budget: None,
            frame: None,
            seg_lines: Some(0),
            uncounted: 0,
            run: Continuation::default(),
            segment_start: None,
            ended: false,
        }
    }

    /// A reader of `src`, which starts inside a run that `run` describes (a replay's seek).
    pub fn resume(src: S, run: Continuation) -> Reader<S> {
        let mut r = Reader::from_source(src);
        r.run = run;
        r.seg_lines = None;
        r
    }

    /// What has been read so far.
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    /// Consumes the reader, returning its report.
    pub fn into_report(self) -> ReadReport {
        self.report
    }

    /// Decoded bytes consumed so far.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// Raw bytes of the input read so far (for progress).
    pub fn raw_read(&self) -> u64 {
        self.src.raw_read()
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.src
    }

    /// What the reader knows of the run now.
    pub fn continuation(&self) -> &Continuation {
        &self.run
    }

    /// Lets [`Reader::poll`] consume at most `bytes` more decoded bytes before it returns
    /// `Pending` (`None`: no bound). A caller that must stay responsive reads in slices.
    pub fn set_budget(&mut self, bytes: Option<u64>) {
        self.budget = bytes;
    }

    /// Whether the last `Pending` was the budget's (rather than the input's) doing.
    pub fn out_of_budget(&self) -> bool {
        self.budget == Some(0)
    }

    fn spend(&mut self, n: usize) -> io::Result<()> {
        let n = n as u64;
        self.consumed += n;
        self.barren += n;
        if let Some(b) = &mut self.budget {
            *b = b.saturating_sub(n);
        }
        if self.barren > MAX_BARREN_BYTES {
            self.ended = true;
            return Err(invalid(format!(
                "no telemetry in {} bytes in a row (up to decoded byte {}): {} blank lines, {} lines that are not events; \
                 this is not a telemetry file, or not one any more, and the rest is not read",
                self.barren, self.consumed, self.report.blank, self.report.skipped_total
            )));
        }
        Ok(())
    }

    /// The next event, `Pending`, or the end. After an error the reader ends.
    pub fn poll(&mut self) -> io::Result<Next> {
        loop {
            if self.ended {
                return Ok(Next::End);
            }
            if self.budget == Some(0) {
                return Ok(Next::Pending);
            }
            let piece = match self.src.fill() {
                Ok(p) => p,
                Err(e) => {
                    self.ended = true;
                    return Err(e);
                }
            };
            match piece {
                Piece::Data { bytes, at, compressed } => {
                    if self.line.is_empty() {
                        // A run of blank lines goes at memory speed (a flood of them costs no
                        // more than their bytes).
                        let ws = bytes.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(bytes.len());
                        if let Some(last) = memchr::memrchr(b'\n', &bytes[..ws]) {
                            let n = memchr::memchr_iter(b'\n', &bytes[..=last]).count() as u64;
                            self.report.lines = self.report.lines.saturating_add(n);
                            self.report.blank = self.report.blank.saturating_add(n);
                            self.src.consume(last + 1);
                            self.spend(last + 1)?;
                            continue;
                        }
                        self.line_at = at;
                    }
                    let (took, ends) = self.line.feed(bytes);
                    let end = at.plus(took, compressed);
                    self.src.consume(took);
                    self.spend(took)?;
                    if ends {
                        let outcome = self.line.outcome(true);
                        self.line.clear();
                        if let Some(n) = self.line_done(outcome, end)? {
                            return Ok(n);
                        }
                    }
                }
                Piece::Frame { events } => self.frame = Some((events, 0)),
                Piece::Count { before } => self.count(before),
                Piece::Damage(d) => self.damaged(d),
                Piece::Segment { path, .. } => {
                    let last = self.end_of_segment()?;
                    self.segment_start = Some(path);
                    self.seg_lines = Some(0);
                    self.uncounted = 0;
                    if let Some(n) = last {
                        return Ok(n);
                    }
                }
                Piece::Pending => return Ok(Next::Pending),
                Piece::End => {
                    self.ended = true;
                    // A last partial line's event first; the end is said at the next call.
                    return Ok(self.end_of_segment()?.unwrap_or(Next::End));
                }
            }
        }
    }

    /// A partial last line of a finished segment is all there will be of it.
    fn end_of_segment(&mut self) -> io::Result<Option<Next>> {
        if self.line.is_empty() {
            return Ok(None);
        }
        let outcome = self.line.outcome(false);
        self.line.clear();
        let end = self.line_at;
        self.line_done(outcome, end)
    }

    /// Accounts for a completed line; an event is returned (unless it is a repeat of context).
    fn line_done(&mut self, outcome: LineOutcome, end: Position) -> io::Result<Option<Next>> {
        let telemetry = match &outcome {
            LineOutcome::Event(_) => true,
            LineOutcome::Blank => false,
            LineOutcome::Skip(r, _) => matches!(r, SkipReason::UnsupportedVersion | SkipReason::UnknownKind | SkipReason::InvalidValue),
        };
        if telemetry {
            self.barren = 0;
        }
        if !matches!(outcome, LineOutcome::Blank) {
            if let Some((_, lines)) = &mut self.frame {
                *lines += 1;
            }
            if let Some(n) = &mut self.seg_lines {
                *n += 1;
            }
        }
        let at = self.line_at;
        match self.report.record(outcome) {
            Some(e) => self.accept(e, at, end),
            None => Ok(None),
        }
    }

    /// Checks an event against the run (a later segment's first events), passing over the
    /// context a later segment repeats.
    fn accept(&mut self, e: Box<Event>, at: Position, end: Position) -> io::Result<Option<Next>> {
        if let Some(path) = &self.segment_start {
            let repeated = e.seq <= self.run.seen_seq && Preamble::is_context(&e.kind);
            if let EventKind::RunStarted { run_id, wall_clock_unix_ms, .. } = &e.kind {
                if let Some((id, wall)) = &self.run.run {
                    if (id, wall) != (run_id, wall_clock_unix_ms) {
                        self.ended = true;
                        return Err(invalid(format!(
                            "segment '{}' belongs to another run ('{}' started at {} ms, this run is '{}' started at {} ms): it is not read as part of this one",
                            path.display(),
                            run_id.chars().take(64).collect::<String>(),
                            wall_clock_unix_ms,
                            id.chars().take(64).collect::<String>(),
                            wall
                        )));
                    }
                }
            }
            if repeated {
                self.report.events = self.report.events.saturating_sub(1);
                self.report.repeated = self.report.repeated.saturating_add(1);
                return Ok(None);
            }
            if e.seq <= self.run.seen_seq {
                self.ended = true;
                return Err(invalid(format!(
                    "segment '{}' goes back to event {} after event {}: it belongs to another run and is not read as part of this one",
                    path.display(),
                    e.seq,
                    self.run.seen_seq
                )));
            }
            self.segment_start = None;
        }
        if let EventKind::RunStarted { run_id, wall_clock_unix_ms, .. } = &e.kind {
            // A new run (appended to the same file) numbers its events from the start again.
            self.run.run = Some((run_id.clone(), *wall_clock_unix_ms));
            self.run.seen_seq = e.seq;
        }
        self.run.seen_seq = self.run.seen_seq.max(e.seq);
        Ok(Some(Next::Event { event: e, at, end }))
    }

    /// A damaged place: the line it cut is part of it, and its events are counted as lost.
    fn damaged(&mut self, d: Damage) {
        self.line.clear();
        let read = match self.frame.take() {
            Some((_, lines)) if d.began => lines,
            _ => 0,
        };
        let lost = d.events.map(|n| n.saturating_sub(read));
        self.report.damaged_place(lost, &d.detail);
        match lost {
            Some(n) => {
                if let Some(s) = &mut self.seg_lines {
                    *s += n;
                }
            }
            None => self.uncounted += 1,
        }
    }

    /// A record's count of the events before its frame: what the reader has not seen of them
    /// was lost in the damage since the last record.
    fn count(&mut self, before: u64) {
        // A reader that started inside a segment has nothing to compare with.
        let Some(seen) = self.seg_lines else { return };
        if before > seen {
            let gap = before - seen;
            let r = &mut self.report;
            r.damaged_events = r.damaged_events.saturating_add(gap);
            if self.uncounted > 0 {
                r.damaged_uncounted = r.damaged_uncounted.saturating_sub(self.uncounted);
            } else {
                r.damaged = r.damaged.saturating_add(1);
            }
            if r.damage.len() < MAX_SKIPPED_KEPT {
                r.damage.push(format!("{gap} events lost before a frame that counts {before} before it"));
            }
        }
        // Behind the record (a file appended to by a new writer counts from 0 again): follow it.
        self.seg_lines = Some(before);
        self.uncounted = 0;
    }
}

impl<S: ByteSource> Iterator for Reader<S> {
    type Item = io::Result<Event>;

    fn next(&mut self) -> Option<io::Result<Event>> {
        // Without a budget nothing is pending but a followed file's end, which ends iterating.
        match self.poll() {
            Ok(Next::Event { event, .. }) => Some(Ok(*event)),
            Ok(Next::Pending | Next::End) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// Reads every event from a byte stream (see [`Reader`] to stream instead).
pub fn read_from(r: impl BufRead + Send) -> io::Result<(Vec<Event>, ReadReport)> {
    let mut reader = Reader::new(r);
    let mut events = Vec::new();
    for e in &mut reader {
        events.push(e?);
    }
    Ok((events, reader.into_report()))
}
