//! A replayed telemetry file fed into its own [`Hub`], so that every client of the server
//! (the web page, `stagehand-top`, `/metrics`) sees it exactly as it would a live run.

use serde::Deserialize;
use stagehand::events::replay::{Change, MAX_SPEED, MIN_SPEED};
use stagehand::events::{Event, EventKind, Hub, Phase, Replay, ReplayStatus};
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

/// A control request that makes no sense, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadControl(pub String);

fn is_step_begin(e: &Event) -> bool {
    matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. })
}

/// The position just after `step` began (so the step shows as current), if the file has it.
fn step_start(events: &[Event], step: u64) -> Option<usize> {
    events
        .iter()
        .position(|e| e.step == step && is_step_begin(e))
        .map(|i| i + 1)
}

/// The first and last steps the file begins.
fn step_range(events: &[Event]) -> (Option<u64>, Option<u64>) {
    let mut steps = events.iter().filter(|e| is_step_begin(e)).map(|e| e.step);
    let first = steps.next();
    (first, steps.next_back().or(first))
}

/// The [`Replay`] controller, shared by the tick task and the API's control routes.
#[derive(Debug)]
pub struct ReplayDriver {
    replay: Mutex<Replay>,
}

impl ReplayDriver {
    /// A driver over these events, paused at the start.
    pub fn new(events: Vec<Event>) -> ReplayDriver {
        let mut replay = Replay::new(events);
        replay.set_paused(true);
        ReplayDriver {
            replay: Mutex::new(replay),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Replay> {
        self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the replay is.
    pub fn status(&self) -> ReplayStatus {
        self.lock().status()
    }

    /// Pushes what an operation changed into the hub.
    fn publish(replay: &Replay, change: Change, hub: &Hub) {
        match change {
            Change::None => {}
            Change::Advanced(range) => {
                for e in &replay.events()[range] {
                    hub.ingest(e.clone());
                }
                hub.flush();
            }
            Change::Reset => hub.reset(replay.snapshot().clone(), &replay.events()[..replay.position()]),
        }
    }

    /// Plays or pauses.
    pub fn set_paused(&self, paused: bool) -> ReplayStatus {
        let mut r = self.lock();
        r.set_paused(paused);
        r.status()
    }

    /// Sets the speed.
    pub fn set_speed(&self, req: &SpeedRequest) -> Result<ReplayStatus, BadControl> {
        if !req.speed.is_finite() || req.speed < MIN_SPEED || req.speed > MAX_SPEED {
            return Err(BadControl(format!(
                "speed {} is out of range: expected {MIN_SPEED} to {MAX_SPEED}",
                req.speed
            )));
        }
        let mut r = self.lock();
        r.set_speed(req.speed);
        Ok(r.status())
    }

    /// Seeks and tells the hub.
    pub fn seek(&self, req: &SeekRequest, hub: &Hub) -> Result<ReplayStatus, BadControl> {
        let mut r = self.lock();
        let change = match (req.position, req.fraction, req.t_ns, req.step) {
            (Some(p), None, None, None) => {
                if p > r.len() {
                    return Err(BadControl(format!(
                        "position {p} is past the end: expected 0 to {}",
                        r.len()
                    )));
                }
                r.seek(p)
            }
            (None, Some(f), None, None) => {
                if !(0.0..=1.0).contains(&f) {
                    return Err(BadControl(format!("fraction {f} is out of range: expected 0.0 to 1.0")));
                }
                r.seek_fraction(f)
            }
            (None, None, Some(t), None) => r.seek_time(t),
            (None, None, None, Some(step)) => {
                let target = step_start(r.events(), step).ok_or_else(|| {
                    let (first, last) = step_range(r.events());
                    BadControl(match (first, last) {
                        (Some(a), Some(b)) => format!("step {step} is not in the file: it holds steps {a} to {b}"),
                        _ => format!("step {step} is not in the file: it holds no steps"),
                    })
                })?;
                r.seek(target)
            }
            _ => {
                return Err(BadControl(
                    "expected exactly one of 'position', 'fraction', 't_ns', 'step'".into(),
                ))
            }
        };
        ReplayDriver::publish(&r, change, hub);
        Ok(r.status())
    }

    /// Steps by events or training steps and tells the hub.
    pub fn step(&self, req: &StepRequest, hub: &Hub) -> Result<ReplayStatus, BadControl> {
        let mut r = self.lock();
        let len = r.len() as i64;
        let check = |n: i64, what: &str| {
            if n == 0 || n.unsigned_abs() > len.unsigned_abs() {
                Err(BadControl(format!(
                    "{what} {n} is out of range: expected -{len} to {len}, not 0 (the file holds {len} events)"
                )))
            } else {
                Ok(n)
            }
        };
        let change = match (req.events, req.steps) {
            (Some(n), None) => r.step_events(check(n, "events")?),
            (None, Some(n)) => r.step_training(check(n, "steps")?),
            _ => return Err(BadControl("expected exactly one of 'events', 'steps'".into())),
        };
        ReplayDriver::publish(&r, change, hub);
        Ok(r.status())
    }

    /// Advances playback every [`TICK`] until `stop` turns true.
    pub async fn run(self: Arc<Self>, hub: Arc<Hub>, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    let mut r = self.lock();
                    let change = r.tick(Instant::now());
                    ReplayDriver::publish(&r, change, &hub);
                }
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }
}
