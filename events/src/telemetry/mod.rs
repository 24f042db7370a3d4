//! One call to attach telemetry to a run: the file (at a [`Level`], plain or zstd, rotated by
//! size) and the flight recorder.
//!
//! ```no_run
//! use stagehand_events::telemetry::{self, Level, TelemetryConfig};
//! use stagehand_events::Bus;
//!
//! let bus = Bus::new();
//! let t = telemetry::attach(&bus, TelemetryConfig {
//!     level: Level::Summary,
//!     path: Some("runs/today.jsonl.zst".into()),
//!     compress: true,
//!     rotate_bytes: Some(1 << 30),
//!     ..Default::default()
//! })?;
//! // ... train ...
//! let dump = t.dump("looked odd")?; // the last steps in full detail, for the HTTP API
//! t.flush();
//! println!("{} events lost, files: {:?}, dump: {}", t.lost(), t.paths(), dump.display());
//! # Ok::<(), stagehand_events::telemetry::TelemetryError>(())
//! ```

pub mod flight;
pub mod level;

pub use flight::{Dump, FlightConfig, FlightRecorder};
pub use level::{Level, LevelFilter};

use super::bus::{Bus, EventSink, FlightError};
use super::jsonl::{JsonlError, JsonlSink, OpenMode};
use super::model::{Event, EventKind};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Errors of attaching telemetry and of dumps.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The file could not be opened or written.
    #[error(transparent)]
    Jsonl(#[from] JsonlError),
    /// A level other than `off` needs a path.
    #[error("telemetry level '{0}' needs a file path")]
    NoPath(&'static str),
    /// The flight recorder is off (or the bus is disabled).
    #[error("the flight recorder is off")]
    RecorderOff,
    /// A dump on request was written too recently.
    #[error("a flight record was requested less than the minimum interval ago; not writing '{0}'")]
    RateLimited(String),
}

impl From<TelemetryError> for FlightError {
    fn from(e: TelemetryError) -> FlightError {
        match e {
            TelemetryError::RateLimited(reason) => FlightError::RateLimited(reason),
            other => FlightError::Write(Box::new(other)),
        }
    }
}

/// Everything [`attach`] needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct TelemetryConfig {
    /// What the file keeps.
    pub level: Level,
    /// The file (the first segment when rotating). Required unless the level is `off`.
    pub path: Option<PathBuf>,
    /// Compress with zstd (name the file `.jsonl.zst`).
    pub compress: bool,
    /// Close a segment at this size and open the next, numbered one.
    pub rotate_bytes: Option<u64>,
    /// Append to an existing file instead of refusing it.
    pub append: bool,
    /// The flight recorder.
    pub flight_recorder: FlightConfig,
}

/// What the handle and the sink on the dispatcher share.
#[derive(Debug, Default)]
struct Shared {
    lost: AtomicU64,
    written: AtomicU64,
    paths: Mutex<Vec<PathBuf>>,
    recorder: Option<Mutex<FlightRecorder>>,
    /// Dumps written so far, and the last one (the handle names it in an out-of-memory error).
    dumps: AtomicU64,
    last_dump: Mutex<Option<flight::Dump>>,
    /// `flight_recorded` events of dumps requested through the hub, for the sink to report.
    pending: Mutex<Vec<EventKind>>,
}

impl Shared {
    fn recorder(&self) -> Option<MutexGuard<'_, FlightRecorder>> {
        // A panic while holding the ring leaves it usable: it is plain data.
        self.recorder.as_ref().map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn written(&self, d: &flight::Dump) {
        *self.last_dump.lock().unwrap_or_else(|p| p.into_inner()) = Some(d.clone());
        self.dumps.fetch_add(1, Ordering::Relaxed);
    }

    /// Writes a flight record now, when the rate limit for requests allows.
    fn dump_now(&self, reason: &str) -> Result<flight::Dump, TelemetryError> {
        let reason = flight::sanitize_reason(reason);
        let mut r = self.recorder().ok_or(TelemetryError::RecorderOff)?;
        if !r.request_allowed() {
            return Err(TelemetryError::RateLimited(reason));
        }
        let d = r.dump(&reason)?;
        drop(r);
        self.written(&d);
        Ok(d)
    }
}

/// The sink [`attach`] adds to the hub: the level filter in front of the file, and the flight
/// recorder beside it.
struct TelemetrySink {
    filter: LevelFilter,
    file: Option<JsonlSink>,
    shared: Arc<Shared>,
    notices: Vec<EventKind>,
}

impl TelemetrySink {
    fn publish_counts(&self) {
        if let Some(f) = &self.file {
            self.shared.lost.store(f.lost(), Ordering::Relaxed);
            self.shared.written.store(f.written(), Ordering::Relaxed);
            let mut paths = self.shared.paths.lock().unwrap_or_else(|p| p.into_inner());
            if paths.len() != f.paths().len() {
                *paths = f.paths().to_vec();
            }
        }
    }
}

impl EventSink for TelemetrySink {
    fn on_event(&mut self, event: &Event) {
        let due = self.shared.recorder().and_then(|mut r| {
            let reason = r.record(event)?;
            Some(r.dump(&reason))
        });
        let mut named = None;
        match due {
            Some(Ok(d)) => {
                self.shared.written(&d);
                named = flight::naming_dump(event, &d.path);
                self.notices.push(d.event());
            }
            Some(Err(e)) => self.notices.push(EventKind::Warning {
                source: super::model::Owner::Device,
                message: format!("the flight recorder could not write its dump: {e}"),
            }),
            None => {}
        }
        if let Some(f) = &mut self.file {
            if self.filter.keeps(event) {
                f.on_event(named.as_ref().unwrap_or(event));
            }
        }
    }

    fn flush(&mut self) {
        if let Some(f) = &mut self.file {
            f.flush();
        }
        self.publish_counts();
    }

    fn batch_end(&mut self) {
        if let Some(f) = &mut self.file {
            f.batch_end();
        }
        self.publish_counts();
    }

    fn notices(&mut self) -> Vec<EventKind> {
        let mut out = std::mem::take(&mut self.notices);
        out.append(&mut self.shared.pending.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(f) = &mut self.file {
            out.extend(f.notices());
        }
        out
    }
}

/// The handle of attached telemetry.
#[derive(Debug, Clone)]
pub struct Telemetry {
    bus: Bus,
    level: Level,
    shared: Arc<Shared>,
}

/// Attaches telemetry to `bus`'s hub: a file at `config.level` and the flight recorder. With a
/// disabled bus, or level `off` and the recorder off, nothing is attached.
pub fn attach(bus: &Bus, config: TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    let file = match (config.level, &config.path) {
        (Level::Off, _) => None,
        (level, None) => return Err(TelemetryError::NoPath(level.as_str())),
        (_, Some(path)) => {
            let mode = if config.append { OpenMode::Append } else { OpenMode::CreateNew };
            Some(JsonlSink::open_with(path, mode, config.compress, config.rotate_bytes)?)
        }
    };
    let (dir, stem) = flight::dump_location(config.path.as_deref());
    let recorder = (config.flight_recorder.enabled && bus.is_enabled())
        .then(|| Mutex::new(FlightRecorder::new(config.flight_recorder.clone(), dir, stem)));
    let shared = Arc::new(Shared {
        paths: Mutex::new(file.as_ref().map(|f| f.paths().to_vec()).unwrap_or_default()),
        recorder,
        ..Default::default()
    });
    if let Some(hub) = bus.hub() {
        if file.is_some() || shared.recorder.is_some() {
            hub.add_sink(Box::new(TelemetrySink {
                filter: LevelFilter::new(config.level),
                file,
                shared: shared.clone(),
                notices: Vec::new(),
            }));
        }
        if shared.recorder.is_some() {
            // The hub holds the recorder's state, not the bus: no cycle keeps the bus alive.
            let s = shared.clone();
            hub.set_flight_request(Arc::new(move |reason| {
                let d = s.dump_now(reason)?;
                s.pending.lock().unwrap_or_else(|p| p.into_inner()).push(d.event());
                Ok(d.path)
            }));
        }
    }
    Ok(Telemetry {
        bus: bus.clone(),
        level: config.level,
        shared,
    })
}

impl Telemetry {
    /// The level the file is written at.
    pub fn level(&self) -> Level {
        self.level
    }

    /// Events the file failed to write (as of the last batch).
    pub fn lost(&self) -> u64 {
        self.shared.lost.load(Ordering::Relaxed)
    }

    /// Events written to the file (as of the last batch).
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::Relaxed)
    }

    /// The telemetry files written so far (the segments, when rotating).
    pub fn paths(&self) -> Vec<PathBuf> {
        self.shared.paths.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Delivers everything published so far and writes it out.
    pub fn flush(&self) {
        self.bus.flush();
    }

    /// Writes the flight recorder's ring to a new file now and returns its path (announced on
    /// the bus as `flight_recorded`). `reason` names the file. Requests may dump once per
    /// minimum interval of run time, whatever reason they give, so a page that calls this in a
    /// loop cannot fill the disk.
    pub fn dump(&self, reason: &str) -> Result<PathBuf, TelemetryError> {
        // Everything published before the request is in the ring first.
        self.bus.flush();
        let d = self.shared.dump_now(reason)?;
        self.bus.publish(d.event());
        Ok(d.path)
    }

    /// Flight records written so far (on request and by triggers).
    pub fn dumps_written(&self) -> u64 {
        self.shared.dumps.load(Ordering::Relaxed)
    }

    /// The flight record written last, if any.
    pub fn last_dump(&self) -> Option<flight::Dump> {
        self.shared.last_dump.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether the flight recorder is on.
    pub fn recording(&self) -> bool {
        self.shared.recorder.is_some()
    }
}

#[cfg(test)]
mod tests;
