//! The flight recorder: the last few steps in full detail, kept in memory and written to a file
//! of their own when something goes wrong.
//!
//! A summary-level telemetry file says *that* step 812 stalled; the dump says which block, which
//! copy and which slab. Dumps are triggered by a host stall over a threshold (`prefetch_miss` or
//! `restored` with a long `stall_ms`), an exhausted pool or a pageable fallback, an
//! `out_of_memory`, a `non_finite`, and on request ([`super::Telemetry::dump`]). Each reason dumps
//! at most once per interval of run time, so a persistently bad run does not write a file a step.
//! A dump is an ordinary JSONL file: it starts with the run's preamble and opens in every reader.

use super::super::bus::EventSink;
use super::super::jsonl::{JsonlError, JsonlSink, OpenMode};
use super::super::model::{Event, EventKind};
use super::super::preamble::Preamble;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

/// Steps the recorder keeps by default (the current one and the two before).
pub const DEFAULT_STEPS: u64 = 3;
/// Events the recorder keeps at most, whatever the steps (about 300 bytes each in memory).
pub const DEFAULT_MAX_EVENTS: usize = 100_000;
/// A host stall at least this long triggers a dump.
pub const DEFAULT_STALL_MS: f64 = 100.0;
/// Least run time between two dumps of the same reason.
pub const DEFAULT_MIN_INTERVAL_S: f64 = 300.0;
/// Taken dump numbers passed over at most before giving up (the open then says why).
const MAX_NAME_TRIES: u32 = 1000;
/// The rate-limit key shared by every dump on request.
const REQUEST: &str = " request";

/// How the flight recorder behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FlightConfig {
    /// Whether to keep a ring at all.
    pub enabled: bool,
    /// Steps kept (the current one included).
    pub steps: u64,
    /// Events kept at most.
    pub max_events: usize,
    /// Host stall that triggers a dump, ms.
    pub stall_ms: f64,
    /// Least run time between two dumps of the same reason, s.
    pub min_interval_s: f64,
    /// Where dumps go (default: beside the telemetry file, or the current folder).
    pub dir: Option<PathBuf>,
}

impl Default for FlightConfig {
    fn default() -> Self {
        FlightConfig {
            enabled: true,
            steps: DEFAULT_STEPS,
            max_events: DEFAULT_MAX_EVENTS,
            stall_ms: DEFAULT_STALL_MS,
            min_interval_s: DEFAULT_MIN_INTERVAL_S,
            dir: None,
        }
    }
}

/// The ring and its triggers.
#[derive(Debug)]
pub struct FlightRecorder {
    config: FlightConfig,
    /// Names dump files: `<stem>.flight-0001-<reason>.jsonl`.
    stem: String,
    dir: PathBuf,
    ring: VecDeque<Event>,
    preamble: Preamble,
    step: u64,
    /// Run time of each reason's last dump.
    last_dump_ns: BTreeMap<String, u64>,
    dumps: u32,
    now_ns: u64,
}

/// A dump written: where, why, and how many events it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Dump {
    pub path: PathBuf,
    pub reason: String,
    pub events: u64,
}

impl Dump {
    /// The event that announces it.
    pub fn event(&self) -> EventKind {
        EventKind::FlightRecorded {
            reason: self.reason.clone(),
            path: self.path.display().to_string(),
            events: self.events,
        }
    }
}

/// A reason as it may appear in a file name: lowercase letters, digits, `_` and `-`, at most 32.
pub fn sanitize_reason(reason: &str) -> String {
    let s: String = reason
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
        .take(32)
        .collect();
    if s.is_empty() {
        "request".into()
    } else {
        s
    }
}

impl FlightRecorder {
    /// A recorder writing dumps named after `stem` into `dir`.
    pub fn new(config: FlightConfig, dir: PathBuf, stem: String) -> FlightRecorder {
        let dir = config.dir.clone().unwrap_or(dir);
        FlightRecorder {
            config,
            stem,
            dir,
            ring: VecDeque::new(),
            preamble: Preamble::new(),
            step: 0,
            last_dump_ns: BTreeMap::new(),
            dumps: 0,
            now_ns: 0,
        }
    }

    /// Keeps `e` in the ring; returns the reason for a dump when `e` is a trigger that is due.
    pub fn record(&mut self, e: &Event) -> Option<String> {
        if !self.config.enabled {
            return None;
        }
        self.preamble.observe(e);
        self.now_ns = self.now_ns.max(e.t_ns);
        self.step = self.step.max(e.step);
        let oldest = self.step.saturating_sub(self.config.steps.max(1) - 1);
        while self
            .ring
            .front()
            .is_some_and(|f| f.step < oldest || self.ring.len() >= self.config.max_events.max(1))
        {
            self.ring.pop_front();
        }
        self.ring.push_back(e.clone());
        let reason = self.trigger(&e.kind)?;
        // The first step traces the run and sizes the pinned pools from what it held: its
        // exhausted pools and pageable copies are expected, and a dump of them would only
        // alarm. Later steps that still run out dump as usual.
        if e.step <= 1 && matches!(e.kind, EventKind::PoolExhausted { .. } | EventKind::PageableFallback { .. }) {
            return None;
        }
        self.due(reason, e.t_ns).then(|| reason.to_owned())
    }

    fn trigger(&self, kind: &EventKind) -> Option<&'static str> {
        let stall = self.config.stall_ms;
        match kind {
            EventKind::PrefetchMiss { stall_ms, .. } | EventKind::Restored { stall_ms, .. }
                if *stall_ms >= stall =>
            {
                Some("host_stall")
            }
            EventKind::PoolExhausted { .. } => Some("pool_exhausted"),
            EventKind::PageableFallback { .. } => Some("pageable_fallback"),
            EventKind::OutOfMemory { .. } => Some("out_of_memory"),
            EventKind::NonFinite { .. } => Some("non_finite"),
            _ => None,
        }
    }

    /// Whether `reason` may dump at run time `t_ns` (and if so, remembers it).
    fn due(&mut self, reason: &str, t_ns: u64) -> bool {
        let interval = (self.config.min_interval_s.max(0.0) * 1e9) as u64;
        let ok = self
            .last_dump_ns
            .get(reason)
            .is_none_or(|last| t_ns.saturating_sub(*last) >= interval);
        if ok {
            self.last_dump_ns.insert(reason.to_owned(), t_ns);
        }
        ok
    }

    /// Whether a dump on request is allowed now. Requests share one limit whatever reason they
    /// give: a caller inventing reasons must not be able to write a file per request.
    pub fn request_allowed(&mut self) -> bool {
        let now = self.now_ns;
        self.due(REQUEST, now)
    }

    /// Writes the ring (after the preamble) to a new file.
    pub fn dump(&mut self, reason: &str) -> Result<Dump, JsonlError> {
        let reason = sanitize_reason(reason);
        // Numbers already taken (an earlier run under the same name) are passed over: a dump
        // never overwrites, and never fails for a name it could have avoided.
        let mut path;
        let mut tries = 0;
        loop {
            self.dumps += 1;
            path = self.dir.join(format!("{}.flight-{:04}-{reason}.jsonl", self.stem, self.dumps));
            tries += 1;
            if !path.exists() || tries >= MAX_NAME_TRIES {
                break;
            }
        }
        let mut sink = JsonlSink::open(&path, OpenMode::CreateNew)?;
        let first = self.ring.front().map_or(u64::MAX, |e| e.seq);
        let mut n = 0;
        for e in self.preamble.events().iter().filter(|e| e.seq < first) {
            sink.on_event(e);
            n += 1;
        }
        let last = self.ring.len().saturating_sub(1);
        for (i, e) in self.ring.iter().enumerate() {
            // The out-of-memory that triggered this dump names it, as the file keeps it too.
            let named = (i == last && reason == "out_of_memory").then(|| naming_dump(e, &path)).flatten();
            sink.on_event(named.as_ref().unwrap_or(e));
            n += 1;
        }
        sink.flush();
        if let Some(err) = sink.last_error() {
            return Err(JsonlError::io(&path, std::io::Error::other(err.to_owned())));
        }
        Ok(Dump { path, reason, events: n })
    }

    /// Events in the ring now.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    /// True when the ring is empty.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

/// `e` with `dump` set to `path` when it is an out-of-memory report that names no dump yet.
pub fn naming_dump(e: &Event, path: &Path) -> Option<Event> {
    match &e.kind {
        EventKind::OutOfMemory { dump: None, .. } => {
            let mut named = e.clone();
            if let EventKind::OutOfMemory { dump, .. } = &mut named.kind {
                *dump = Some(path.display().to_string());
            }
            Some(named)
        }
        _ => None,
    }
}

/// The folder and file stem dumps are named after, from the telemetry path.
pub fn dump_location(path: Option<&Path>) -> (PathBuf, String) {
    let Some(p) = path else { return (PathBuf::from("."), "stagehand".into()) };
    // Telemetry sent to a device (`/dev/null`, `/dev/full`) or a pipe: the records go to the
    // working directory rather than beside it.
    let special = std::fs::metadata(p).is_ok_and(|m| !m.is_file());
    let dir = match p.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) if !special => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.split(".jsonl").next().unwrap_or("stagehand").to_owned();
    (dir, if stem.is_empty() { "stagehand".into() } else { stem })
}
