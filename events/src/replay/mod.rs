//! Replay of recorded events: at recorded speed, faster or slower, paused and stepped by event
//! or by training step, with seeking both ways.
//!
//! [`Replay`] is a pure controller over a list of events in memory and the [`Snapshot`] after
//! the first `position` of them; the caller gives it the time. [`FileReplay`] does the same for a
//! telemetry file of any size: it shows the start at once, indexes the file in the background
//! (byte offsets and snapshot checkpoints) and reads only what a position needs. The terminal UI drives one directly; the
//! web server drives one into a [`Hub`](super::bus::Hub) so that its subscribers cannot tell a
//! replay from a live run.

mod clock;
pub mod file;
mod index;

pub use file::{FileReplay, IndexObserver, Played};

use clock::Clock;
use super::model::{Event, EventKind, Phase};
use super::snapshot::Snapshot;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::time::Instant;

/// Snapshots kept every this many events, so seeking back is quick on long files.
const CHECKPOINT_EVERY: usize = 4096;
/// Slowest and fastest playback.
pub const MIN_SPEED: f64 = 0.0625;
pub const MAX_SPEED: f64 = 1024.0;

/// What an operation did to the replayed stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Nothing moved.
    None,
    /// These events (indices into the replay's list) were applied, in order.
    Advanced(Range<usize>),
    /// The position moved back (or jumped): consumers must resync from [`Replay::snapshot`].
    Reset,
}

/// Where a replay is, for status lines and the API (whose schema calls it `ReplayState`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = ReplayState))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayStatus {
    /// Events applied (the event index the replay is at).
    pub position: usize,
    /// Events in the file.
    pub total: usize,
    pub paused: bool,
    /// Playback speed in force (1 = as recorded).
    pub speed: f64,
    /// Replay time, ns since the run started, and the file's last event's time.
    pub t_ns: u64,
    pub end_t_ns: u64,
    /// The training step at the position.
    pub step: u64,
    /// Whether more events are expected (a file still being written).
    pub following: bool,
    /// The file is still being indexed: `total` and `end_t_ns` are what is known so far.
    #[serde(default)]
    pub indexing: bool,
}

/// A replay of a list of events.
#[derive(Debug)]
pub struct Replay {
    events: Vec<Event>,
    pos: usize,
    snapshot: Snapshot,
    checkpoints: Vec<(usize, Snapshot)>,
    clock: Clock,
    following: bool,
}

impl Replay {
    /// A replay positioned before the first event, playing at recorded speed.
    pub fn new(events: Vec<Event>) -> Replay {
        Replay {
            events,
            pos: 0,
            snapshot: Snapshot::new(),
            checkpoints: vec![(0, Snapshot::new())],
            clock: Clock::default(),
            following: false,
        }
    }

    /// The state after the events applied so far.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// All events of the replay.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Events applied so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Events in all.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when there are no events.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Whether the replay is paused.
    pub fn paused(&self) -> bool {
        self.clock.paused()
    }

    /// Playback speed (1.0 = recorded).
    pub fn speed(&self) -> f64 {
        self.clock.speed()
    }

    /// Whether new events are expected (a followed file).
    pub fn set_following(&mut self, on: bool) {
        self.following = on;
    }

    /// Replay time: the time of the last applied event.
    pub fn t_ns(&self) -> u64 {
        self.pos
            .checked_sub(1)
            .map_or(0, |i| self.events[i].t_ns)
    }

    /// Where the replay is.
    pub fn status(&self) -> ReplayStatus {
        ReplayStatus {
            position: self.pos,
            total: self.events.len(),
            paused: self.clock.paused(),
            speed: self.clock.speed(),
            t_ns: self.t_ns(),
            end_t_ns: self.events.last().map_or(0, |e| e.t_ns),
            step: self.snapshot.step,
            following: self.following,
            indexing: false,
        }
    }

    /// Adds events read since (following a growing file).
    pub fn append(&mut self, more: Vec<Event>) {
        self.events.extend(more);
    }

    fn apply_to(&mut self, target: usize) -> Change {
        let target = target.min(self.events.len());
        if target == self.pos {
            return Change::None;
        }
        if target < self.pos {
            let (cp_pos, cp) = self
                .checkpoints
                .iter()
                .rev()
                .find(|(p, _)| *p <= target)
                .cloned()
                .unwrap_or((0, Snapshot::new()));
            self.snapshot = cp;
            self.pos = cp_pos;
            self.forward_to(target);
            self.clock.restart();
            return Change::Reset;
        }
        let start = self.pos;
        self.forward_to(target);
        Change::Advanced(start..target)
    }

    fn forward_to(&mut self, target: usize) {
        while self.pos < target {
            self.snapshot.apply(&self.events[self.pos]);
            self.pos += 1;
            if self.pos % CHECKPOINT_EVERY == 0
                && self.checkpoints.last().is_some_and(|(p, _)| *p < self.pos)
            {
                self.checkpoints.push((self.pos, self.snapshot.clone()));
            }
        }
    }

    /// Applies every event that is due at wall time `now`, at the current speed.
    pub fn tick(&mut self, now: Instant) -> Change {
        if self.pos >= self.events.len() {
            self.clock.restart();
            return Change::None;
        }
        // The clock starts at the first event rather than at zero.
        let from = if self.pos == 0 { self.events[0].t_ns } else { self.t_ns() };
        let Some(due) = self.clock.due(now, from) else { return Change::None };
        let mut target = self.pos;
        while target < self.events.len() && self.events[target].t_ns <= due {
            target += 1;
        }
        self.apply_to(target)
    }

    /// Pauses or resumes.
    pub fn toggle_pause(&mut self) {
        self.set_paused(!self.paused());
    }

    /// Pauses or resumes.
    pub fn set_paused(&mut self, paused: bool) {
        self.clock.set_paused(paused);
    }

    /// Sets the speed (clamped to [`MIN_SPEED`]..=[`MAX_SPEED`]).
    pub fn set_speed(&mut self, speed: f64) {
        self.clock.set_speed(speed);
    }

    /// Doubles the speed.
    pub fn faster(&mut self) {
        self.set_speed(self.speed() * 2.0);
    }

    /// Halves the speed.
    pub fn slower(&mut self) {
        self.set_speed(self.speed() / 2.0);
    }

    /// Moves by `n` events (negative: back). Pauses, as stepping implies.
    pub fn step_events(&mut self, n: i64) -> Change {
        self.set_paused(true);
        let target = (self.pos as i64 + n).clamp(0, self.events.len() as i64) as usize;
        self.apply_to(target)
    }

    /// Moves to the start of the next (or, with `n < 0`, an earlier) training step.
    pub fn step_training(&mut self, n: i64) -> Change {
        self.set_paused(true);
        let starts: Vec<usize> = self
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                matches!(
                    e.kind,
                    EventKind::PhaseChanged {
                        to: Phase::StepBegin,
                        ..
                    }
                )
            })
            // Position *after* the step-begin event, so the step shows as current.
            .map(|(i, _)| i + 1)
            .collect();
        let target = if n >= 0 {
            starts
                .iter()
                .filter(|p| **p > self.pos)
                .nth((n.max(1) - 1) as usize)
                .copied()
                .unwrap_or(self.events.len())
        } else {
            let earlier: Vec<usize> = starts.iter().copied().filter(|p| *p < self.pos).collect();
            let k = (-n) as usize;
            earlier
                .len()
                .checked_sub(k)
                .map_or(0, |i| earlier[i])
        };
        self.apply_to(target)
    }

    /// Jumps to a position (number of events applied).
    pub fn seek(&mut self, position: usize) -> Change {
        self.apply_to(position)
    }

    /// Jumps to a fraction of the file (0.0 = start, 1.0 = end).
    pub fn seek_fraction(&mut self, fraction: f64) -> Change {
        let f = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
        let target = (self.events.len() as f64 * f).round() as usize;
        self.apply_to(target)
    }

    /// Jumps to the first event at or after `t_ns`.
    pub fn seek_time(&mut self, t_ns: u64) -> Change {
        let target = self.events.partition_point(|e| e.t_ns < t_ns);
        self.apply_to(target)
    }

    /// Jumps to the start.
    pub fn to_start(&mut self) -> Change {
        self.apply_to(0)
    }

    /// Jumps to the end.
    pub fn to_end(&mut self) -> Change {
        self.apply_to(self.events.len())
    }
}

#[cfg(test)]
mod file_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::BlockId;
    use std::time::Duration;

    fn run(steps: u64, per_step: u64) -> Vec<Event> {
        let mut v = Vec::new();
        let mut seq = 0;
        for s in 1..=steps {
            seq += 1;
            v.push(Event::new(
                seq,
                seq * 1_000_000,
                s,
                Phase::StepBegin,
                EventKind::PhaseChanged {
                    from: Phase::StepEnd,
                    to: Phase::StepBegin,
                    duration_s: 0.0,
                },
            ));
            for _ in 0..per_step {
                seq += 1;
                v.push(Event::new(
                    seq,
                    seq * 1_000_000,
                    s,
                    Phase::Forward,
                    EventKind::PrefetchHit { block: BlockId(0) },
                ));
            }
        }
        v
    }

    #[test]
    fn plays_at_recorded_speed_and_faster() {
        let mut r = Replay::new(run(2, 9)); // events every 1 ms, 20 in all
        let t0 = Instant::now();
        assert_eq!(r.tick(t0), Change::Advanced(0..1));
        let c = r.tick(t0 + Duration::from_micros(4_500));
        assert_eq!(c, Change::Advanced(1..5));
        r.set_speed(4.0);
        let t1 = t0 + Duration::from_millis(10);
        r.tick(t1);
        r.tick(t1 + Duration::from_millis(1));
        assert_eq!(r.position(), 9);
    }

    #[test]
    fn seeking_back_rebuilds_the_same_snapshot() {
        let events = run(3, 3000);
        let mut r = Replay::new(events.clone());
        r.to_end();
        assert_eq!(r.snapshot(), &Snapshot::from_events(&events));
        assert_eq!(r.seek(5000), Change::Reset);
        assert_eq!(r.snapshot(), &Snapshot::from_events(&events[..5000]));
        assert_eq!(r.snapshot().weights.prefetch_hits, 4998);
    }

    #[test]
    fn steps_by_event_and_by_training_step() {
        let mut r = Replay::new(run(3, 4));
        assert_eq!(r.step_events(2), Change::Advanced(0..2));
        assert!(r.paused());
        r.step_training(1);
        assert_eq!((r.position(), r.snapshot().step), (6, 2));
        r.step_training(1);
        assert_eq!(r.snapshot().step, 3);
        assert_eq!(r.step_training(-1), Change::Reset);
        assert_eq!(r.position(), 6);
        r.step_events(-1);
        assert_eq!(r.position(), 5);
        r.to_end();
        assert_eq!(r.position(), 15);
        r.seek_fraction(0.0);
        assert_eq!(r.position(), 0);
    }

    #[test]
    fn paused_replay_does_not_move() {
        let mut r = Replay::new(run(1, 3));
        r.set_paused(true);
        assert_eq!(r.tick(Instant::now() + Duration::from_secs(5)), Change::None);
        r.set_speed(f64::NAN);
        assert_eq!(r.speed(), 1.0);
        r.set_speed(1e9);
        assert_eq!(r.speed(), MAX_SPEED);
    }
}
