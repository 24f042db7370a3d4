//! A replayed telemetry file fed into its own [`Hub`], so that every client of the server
//! (the web page, `stagehand-top`, `/metrics`) sees it exactly as it would a live run. The file
//! is read on demand through the runtime's indexed [`FileReplay`], so the server's memory does
//! not grow with the file.

mod source;

use serde::Deserialize;
use stagehand_events::jsonl::JsonlError;
use source::Source;
use stagehand_events::replay::{FileReplay, MAX_SPEED, MIN_SPEED};
use stagehand_events::{Event, Hub, Replay, ReplayStatus};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often the driver advances playback.
const TICK: Duration = Duration::from_millis(20);

/// Where to seek: exactly one of the fields.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SeekRequest {
    /// Events applied after the seek (0 = the start): the event index.
    pub position: Option<usize>,
    /// Fraction of the file, 0.0 to 1.0.
    pub fraction: Option<f64>,
    /// Replay time in ns since the run started.
    pub t_ns: Option<u64>,
    /// The start of this training step.
    pub step: Option<u64>,
}

/// Stepping: `events` events or `steps` training steps, forward (positive) or back; not zero,
/// and no more than the file holds.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    pub events: Option<i64>,
    pub steps: Option<i64>,
}

/// A new playback speed.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SpeedRequest {
    /// 1.0 = recorded speed; between [`MIN_SPEED`] and [`MAX_SPEED`].
    pub speed: f64,
}

/// Why a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The request makes no sense; the message says why.
    #[error("{0}")]
    Bad(String),
    /// The replayed file could not be read again (moved, truncated, unreadable).
    #[error("cannot read the replayed file: {0}")]
    Unreadable(#[from] JsonlError),
}

fn bad(message: String) -> ControlError {
    ControlError::Bad(message)
}

/// The replay controller, shared by the tick task and the API's control routes.
#[derive(Debug)]
pub struct ReplayDriver {
    source: Mutex<Source>,
}

impl ReplayDriver {
    /// A driver over the telemetry file at `path` (plain or zstd), paused at its start. It
    /// returns at once and indexes the file in the background; it holds a bounded number of
    /// events whatever the file's size ([`ReplayDriver::events_held`]).
    pub fn open(path: impl AsRef<Path>) -> Result<ReplayDriver, JsonlError> {
        Ok(ReplayDriver::from_file(FileReplay::open(path)?))
    }

    /// A driver over a file replay opened by the caller (with an
    /// [`IndexObserver`](stagehand_events::replay::IndexObserver), say), paused where it is.
    pub fn from_file(mut replay: FileReplay) -> ReplayDriver {
        replay.set_paused(true);
        ReplayDriver::with(Source::File(replay))
    }

    /// A driver over events already in memory, paused at the start (programs and tests that
    /// built their events; a file goes through [`ReplayDriver::open`], which streams).
    pub fn new(events: Vec<Event>) -> ReplayDriver {
        let mut replay = Replay::new(events);
        replay.set_paused(true);
        ReplayDriver::with(Source::Events(replay))
    }

    fn with(source: Source) -> ReplayDriver {
        ReplayDriver {
            source: Mutex::new(source),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Source> {
        self.source.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the replay is.
    pub fn status(&self) -> ReplayStatus {
        self.lock().status()
    }

    /// Events the driver holds in memory: for a file, the recent ones only (at most
    /// [`RECENT_KEPT`](stagehand_events::replay::file::RECENT_KEPT) and one read ahead), whatever the file's size; for events given to
    /// [`ReplayDriver::new`], all of them.
    pub fn events_held(&self) -> usize {
        self.lock().events_held()
    }

    /// Blocks until a replayed file is fully indexed (at once for events in memory), for
    /// programs that want the total before they serve.
    pub fn wait_indexed(&self) {
        if let Source::File(r) = &*self.lock() {
            r.wait_indexed();
        }
    }

    /// Plays or pauses.
    pub fn set_paused(&self, paused: bool) -> ReplayStatus {
        let mut r = self.lock();
        r.set_paused(paused);
        r.status()
    }

    /// Sets the speed.
    pub fn set_speed(&self, req: &SpeedRequest) -> Result<ReplayStatus, ControlError> {
        if !req.speed.is_finite() || req.speed < MIN_SPEED || req.speed > MAX_SPEED {
            return Err(bad(format!(
                "speed {} is out of range: expected {MIN_SPEED} to {MAX_SPEED}",
                req.speed
            )));
        }
        let mut r = self.lock();
        r.set_speed(req.speed);
        Ok(r.status())
    }

    /// Seeks and tells the hub.
    pub fn seek(&self, req: &SeekRequest, hub: &Hub) -> Result<ReplayStatus, ControlError> {
        let mut r = self.lock();
        let played = match (req.position, req.fraction, req.t_ns, req.step) {
            (Some(p), None, None, None) => {
                let len = r.len_for(p);
                if p > len {
                    return Err(bad(format!("position {p} is past the end: expected 0 to {len}")));
                }
                r.apply(|f| f.seek(p), |m| m.seek(p))?
            }
            (None, Some(f), None, None) => {
                if !(0.0..=1.0).contains(&f) {
                    return Err(bad(format!("fraction {f} is out of range: expected 0.0 to 1.0")));
                }
                r.apply(|x| x.seek_fraction(f), |m| m.seek_fraction(f))?
            }
            (None, None, Some(t), None) => r.apply(|f| f.seek_time(t), |m| m.seek_time(t))?,
            (None, None, None, Some(step)) => {
                let target = r.step_start(step).map_err(|range| {
                    bad(match range {
                        Some((a, b)) => format!("step {step} is not in the file: it holds steps {a} to {b}"),
                        None => format!("step {step} is not in the file: it holds no steps"),
                    })
                })?;
                r.apply(|f| f.seek(target), |m| m.seek(target))?
            }
            _ => {
                return Err(bad(
                    "expected exactly one of 'position', 'fraction', 't_ns', 'step'".into(),
                ))
            }
        };
        r.publish(played, hub)?;
        Ok(r.status())
    }

    /// Steps by events or training steps and tells the hub.
    pub fn step(&self, req: &StepRequest, hub: &Hub) -> Result<ReplayStatus, ControlError> {
        let mut r = self.lock();
        let wanted = req.events.or(req.steps).map_or(0, |n| n.unsigned_abs());
        let len = r.len_for(usize::try_from(wanted).unwrap_or(usize::MAX)) as i64;
        let check = |n: i64, what: &str| {
            if n == 0 || n.unsigned_abs() > len.unsigned_abs() {
                Err(bad(format!(
                    "{what} {n} is out of range: expected -{len} to {len}, not 0 (the file holds {len} events)"
                )))
            } else {
                Ok(n)
            }
        };
        let played = match (req.events, req.steps) {
            (Some(n), None) => {
                let n = check(n, "events")?;
                r.apply(|f| f.step_events(n), |m| m.step_events(n))?
            }
            (None, Some(n)) => {
                let n = check(n, "steps")?;
                r.apply(|f| f.step_training(n), |m| m.step_training(n))?
            }
            _ => return Err(bad("expected exactly one of 'events', 'steps'".into())),
        };
        r.publish(played, hub)?;
        Ok(r.status())
    }

    /// Advances playback every `TICK` until `stop` turns true. A file that can no longer be
    /// read pauses the replay, with the reason on stderr (there is no caller to return it to).
    pub async fn run(self: Arc<Self>, hub: Arc<Hub>, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    let mut r = self.lock();
                    let now = Instant::now();
                    let done = r
                        .apply(|f| f.tick(now), |m| m.tick(now))
                        .and_then(|played| r.publish(played, &hub));
                    if let Err(e) = done {
                        eprintln!("stagehand-web: replay paused: cannot read the replayed file: {e}");
                        r.set_paused(true);
                    }
                }
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }
}
