//! The phase state machine of a training step.
//!
//! ```text
//! Idle ──▶ StepBegin ──▶ Forward ──▶ Backward ──▶ Optimizer ──▶ StepEnd ──▶ StepBegin ...
//!                           ▲            │  │                      ▲
//!                           └────────────┘  └──────────────────────┘
//!                        next micro-batch     accumulation step, no optimizer
//! ```
//!
//! Between steps (`Idle`, `StepEnd`) a run may evaluate (`Eval`: forwards outside a step), and
//! the next step begins from there. Any phase may go to `Idle` (shutdown). Everything else is
//! an [`Error::InvalidPhaseTransition`].

use super::error::{Error, Result};
use crate::events::model::{Phase, PhaseDurations};
use std::time::Instant;

/// Whether `from -> to` is a valid step transition.
pub fn can_transition(from: Phase, to: Phase) -> bool {
    use Phase::*;
    match (from, to) {
        (_, Idle) => from != Idle,
        (Idle, StepBegin) | (StepEnd, StepBegin) | (Eval, StepBegin) => true,
        (Idle, Eval) | (StepEnd, Eval) => true,
        (StepBegin, Forward) => true,
        (Forward, Backward) => true,
        (Backward, Forward) | (Backward, Optimizer) | (Backward, StepEnd) => true,
        (Optimizer, StepEnd) => true,
        (Idle, _) | (StepBegin, _) | (Forward, _) | (Backward, _) | (Optimizer, _) | (StepEnd, _) | (Eval, _) => {
            false
        }
    }
}

/// The phases that may follow `from`, for error messages.
fn expected_after(from: Phase) -> String {
    Phase::ALL
        .iter()
        .filter(|to| can_transition(from, **to))
        .map(|p| p.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a transition left behind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PhaseLeft {
    /// The phase that ended.
    pub phase: Phase,
    /// How long it lasted, in seconds.
    pub duration_s: f64,
}

/// Tracks the current step and phase and how long each phase of the step took.
#[derive(Debug)]
pub struct PhaseCoordinator {
    step: u64,
    phase: Phase,
    since: Instant,
    durations: PhaseDurations,
}

impl Default for PhaseCoordinator {
    fn default() -> Self {
        PhaseCoordinator::new()
    }
}

impl PhaseCoordinator {
    /// Idle, before the first step.
    pub fn new() -> PhaseCoordinator {
        PhaseCoordinator {
            step: 0,
            phase: Phase::Idle,
            since: Instant::now(),
            durations: PhaseDurations::default(),
        }
    }

    /// The current step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Seconds spent in forward, backward and optimizer so far in this step (micro-batches
    /// add up).
    pub fn durations(&self) -> PhaseDurations {
        self.durations
    }

    /// Moves to `to`; `step` is only taken on `StepBegin`. Rejects invalid orders without
    /// changing anything.
    pub fn transition(&mut self, step: Option<u64>, to: Phase) -> Result<PhaseLeft> {
        let from = self.phase;
        if !can_transition(from, to) {
            return Err(Error::InvalidPhaseTransition {
                step: step.unwrap_or(self.step),
                from,
                to,
                expected: expected_after(from),
            });
        }
        let now = Instant::now();
        let duration_s = now.duration_since(self.since).as_secs_f64();
        match from {
            Phase::Forward => self.durations.forward += duration_s,
            Phase::Backward => self.durations.backward += duration_s,
            Phase::Optimizer => self.durations.optimizer += duration_s,
            Phase::Idle | Phase::StepBegin | Phase::StepEnd | Phase::Eval => {}
        }
        if to == Phase::StepBegin {
            self.durations = PhaseDurations::default();
            if let Some(s) = step {
                self.step = s;
            }
        }
        self.phase = to;
        self.since = now;
        Ok(PhaseLeft {
            phase: from,
            duration_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_step_is_valid_and_the_next_one_too() {
        let mut pc = PhaseCoordinator::new();
        for (s, p) in [
            (Some(7), Phase::StepBegin),
            (None, Phase::Forward),
            (None, Phase::Backward),
            (None, Phase::Optimizer),
            (None, Phase::StepEnd),
            (Some(8), Phase::StepBegin),
        ] {
            pc.transition(s, p).expect("valid order");
        }
        assert_eq!((pc.step(), pc.phase()), (8, Phase::StepBegin));
    }

    #[test]
    fn out_of_order_phases_are_typed_errors_and_change_nothing() {
        let mut pc = PhaseCoordinator::new();
        let err = pc
            .transition(None, Phase::Forward)
            .expect_err("forward before step begin");
        match &err {
            Error::InvalidPhaseTransition {
                from, to, expected, ..
            } => {
                assert_eq!((*from, *to), (Phase::Idle, Phase::Forward));
                assert_eq!(expected, "step_begin, eval");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(pc.phase(), Phase::Idle);
        pc.transition(Some(1), Phase::StepBegin).expect("valid");
        pc.transition(None, Phase::Forward).expect("valid");
        assert!(pc.transition(None, Phase::Optimizer).is_err(), "skips backward");
        assert!(pc.transition(None, Phase::Forward).is_err(), "re-entry");
        assert!(pc.transition(None, Phase::StepBegin).is_err(), "step not ended");
        assert_eq!(pc.phase(), Phase::Forward);
    }

    #[test]
    fn accumulation_orders_are_allowed() {
        let mut pc = PhaseCoordinator::new();
        for p in [
            Phase::StepBegin,
            Phase::Forward,
            Phase::Backward,
            Phase::Forward,
            Phase::Backward,
            Phase::StepEnd,
        ] {
            pc.transition(Some(1), p).expect("valid");
        }
    }

    #[test]
    fn every_phase_can_shut_down_but_idle_cannot_reenter_idle() {
        for p in Phase::ALL {
            assert_eq!(can_transition(p, Phase::Idle), p != Phase::Idle);
        }
    }

    #[test]
    fn durations_reset_at_step_begin() {
        let mut pc = PhaseCoordinator::new();
        for p in [Phase::StepBegin, Phase::Forward, Phase::Backward] {
            pc.transition(Some(1), p).expect("valid");
        }
        let left = pc.transition(None, Phase::Optimizer).expect("valid");
        assert_eq!(left.phase, Phase::Backward);
        assert!(pc.durations().backward >= left.duration_s);
        pc.transition(None, Phase::StepEnd).expect("valid");
        pc.transition(Some(2), Phase::StepBegin).expect("valid");
        assert_eq!(pc.durations(), PhaseDurations::default());
    }
}
