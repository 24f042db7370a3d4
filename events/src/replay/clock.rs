//! The playback clock both replays share ([`Replay`](super::Replay) over a list of events,
//! [`FileReplay`](super::FileReplay) over a file): a speed, a pause switch, and the anchor that
//! turns wall time into replay time from where playback last (re)started.

use super::{MAX_SPEED, MIN_SPEED};
use std::time::Instant;

/// When recorded events are due, at a speed, paused or not.
#[derive(Debug, Clone)]
pub(super) struct Clock {
    speed: f64,
    paused: bool,
    /// Wall instant and replay time at which playback last (re)started.
    anchor: Option<(Instant, u64)>,
}

impl Default for Clock {
    /// Playing at recorded speed.
    fn default() -> Clock {
        Clock { speed: 1.0, paused: false, anchor: None }
    }
}

impl Clock {
    pub(super) fn paused(&self) -> bool {
        self.paused
    }

    /// Playback speed (1.0 = recorded).
    pub(super) fn speed(&self) -> f64 {
        self.speed
    }

    /// Pauses or resumes; playing restarts from the replay's time then.
    pub(super) fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
        self.anchor = None;
    }

    /// Sets the speed (clamped to [`MIN_SPEED`]..=[`MAX_SPEED`]; not a number is recorded
    /// speed).
    pub(super) fn set_speed(&mut self, speed: f64) {
        let speed = if speed.is_finite() { speed } else { 1.0 };
        self.speed = speed.clamp(MIN_SPEED, MAX_SPEED);
        self.anchor = None;
    }

    /// The replay jumped, or has nothing to play: the clock restarts at the next tick.
    pub(super) fn restart(&mut self) {
        self.anchor = None;
    }

    /// The replay time due at wall time `now`: from `from` (the replay's time now) when the
    /// clock (re)starts. `None` while paused.
    pub(super) fn due(&mut self, now: Instant, from: u64) -> Option<u64> {
        if self.paused {
            self.anchor = None;
            return None;
        }
        let (start, t0) = *self.anchor.get_or_insert((now, from));
        let elapsed = now.saturating_duration_since(start).as_nanos() as f64 * self.speed;
        Some(t0.saturating_add(elapsed as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn replay_time_runs_at_the_speed_from_where_it_started() {
        let mut c = Clock::default();
        let t = Instant::now();
        assert_eq!(c.due(t, 1_000), Some(1_000));
        assert_eq!(c.due(t + Duration::from_nanos(500), 9_999), Some(1_500), "the anchor holds");
        c.set_speed(4.0);
        assert_eq!(c.due(t + Duration::from_nanos(500), 1_500), Some(1_500), "a new speed restarts the clock");
        assert_eq!(c.due(t + Duration::from_nanos(600), 0), Some(1_900));
        c.set_paused(true);
        assert_eq!(c.due(t + Duration::from_nanos(700), 0), None);
        c.set_speed(f64::NAN);
        assert_eq!(c.speed(), 1.0);
        c.set_speed(1e9);
        assert_eq!(c.speed(), MAX_SPEED);
    }
}
