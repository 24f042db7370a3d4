//! The policy bridge: the heuristic rules that turn the phase and the memory situation into hints
//! for the runtimes.
//!
//! Hints are recomputed at every phase boundary, and again when the transfer manager's run
//! of full checks passes the contention threshold. Three rules, applied in order:
//!
//! 1. **Backward pressure**: in BACKWARD with VRAM use above `backward_pressure_fraction` of
//!    the soft cap: `suppress_speculative`, `prefetch_window_cap = 1`.
//! 2. **Optimizer protection**: in OPTIMIZER: `suppress_speculative`, `max_inflight_h2d = 1`.
//! 3. **Contention**: slots full on more than `contention_checks` consecutive checks:
//!    `prefetch_window_cap` one lower (from the runtime's window when uncapped), floor 1.
//!
//! **Monotonic within a step**: every rule only tightens (caps take the minimum, suppression
//! is an OR), so `prefetch_window_cap` never increases and `suppress_speculative` never goes
//! back to false. [`PolicyBridge::reset`] at STEP_BEGIN returns to the runtimes' configured
//! values (no caps, nothing suppressed).

use crate::events::model::{Hints, Phase, PolicyRule};

/// What the rules look at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyInputs {
    /// The phase just entered (or the current one, for a contention check).
    pub phase: Phase,
    /// Live VRAM use in bytes.
    pub vram_used: u64,
    /// Consecutive full slot checks so far.
    pub consecutive_full: u32,
}

/// Computes the hints for the runtimes.
#[derive(Debug, Clone)]
pub struct PolicyBridge {
    soft_cap: u64,
    pressure_fraction: f64,
    contention_checks: u32,
    baseline_window: u32,
    hints: Hints,
}

/// The tighter of two optional caps (`None` is no cap).
fn tighter(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (Some(x), None) | (None, Some(x)) => Some(x),
        (None, None) => None,
    }
}

/// `current` tightened by `proposal`.
pub fn tighten(current: Hints, proposal: Hints) -> Hints {
    Hints {
        max_inflight_h2d: tighter(current.max_inflight_h2d, proposal.max_inflight_h2d),
        max_inflight_d2h: tighter(current.max_inflight_d2h, proposal.max_inflight_d2h),
        prefetch_window_cap: tighter(current.prefetch_window_cap, proposal.prefetch_window_cap),
        suppress_speculative: current.suppress_speculative || proposal.suppress_speculative,
    }
}

impl PolicyBridge {
    /// A bridge with no hints in force. `baseline_window` is where rule 3 starts when the
    /// window is not capped yet.
    pub fn new(
        soft_cap: u64,
        pressure_fraction: f64,
        contention_checks: u32,
        baseline_window: u32,
    ) -> PolicyBridge {
        PolicyBridge {
            soft_cap,
            pressure_fraction,
            contention_checks,
            baseline_window: baseline_window.max(1),
            hints: Hints::default(),
        }
    }

    /// The hints in force.
    pub fn hints(&self) -> Hints {
        self.hints
    }

    /// Sets where rule 3 starts (the weight runtime's configured window).
    pub fn set_baseline_window(&mut self, window: u32) {
        self.baseline_window = window.max(1);
    }

    /// Whether a contention check count fires rule 3.
    pub fn contention_fires(&self, consecutive_full: u32) -> bool {
        consecutive_full > self.contention_checks
    }

    /// STEP_BEGIN: back to the configured values. Returns the change, if there was one.
    pub fn reset(&mut self) -> Option<(PolicyRule, Hints)> {
        let changed = self.hints != Hints::default();
        self.hints = Hints::default();
        changed.then_some((PolicyRule::Reset, self.hints))
    }

    /// Applies the three rules; returns each change with the rule that caused it and the
    /// hints after it, in order.
    pub fn evaluate(&mut self, inputs: PolicyInputs) -> Vec<(PolicyRule, Hints)> {
        let mut changes = Vec::new();
        let pressure =
            inputs.vram_used as f64 > self.pressure_fraction * self.soft_cap as f64;
        let mut apply = |rule: PolicyRule, proposal: Hints, hints: &mut Hints| {
            let next = tighten(*hints, proposal);
            if next != *hints {
                *hints = next;
                changes.push((rule, next));
            }
        };
        let mut hints = self.hints;
        match inputs.phase {
            Phase::Backward if pressure => apply(
                PolicyRule::BackwardPressure,
                Hints {
                    suppress_speculative: true,
                    prefetch_window_cap: Some(1),
                    ..Hints::default()
                },
                &mut hints,
            ),
            Phase::Optimizer => apply(
                PolicyRule::OptimizerProtection,
                Hints {
                    suppress_speculative: true,
                    max_inflight_h2d: Some(1),
                    ..Hints::default()
                },
                &mut hints,
            ),
            Phase::Idle
            | Phase::StepBegin
            | Phase::Forward
            | Phase::Backward
            | Phase::StepEnd
            | Phase::Eval => {}
        }
        if self.contention_fires(inputs.consecutive_full) {
            let from = hints.prefetch_window_cap.unwrap_or(self.baseline_window);
            apply(
                PolicyRule::Contention,
                Hints {
                    prefetch_window_cap: Some(from.saturating_sub(1).max(1)),
                    ..Hints::default()
                },
                &mut hints,
            );
        }
        self.hints = hints;
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn bridge() -> PolicyBridge {
        PolicyBridge::new(10 * GIB, 0.8, 3, 3)
    }

    fn at(phase: Phase, vram_used: u64, consecutive_full: u32) -> PolicyInputs {
        PolicyInputs {
            phase,
            vram_used,
            consecutive_full,
        }
    }

    #[test]
    fn backward_pressure_fires_only_above_the_threshold_in_backward() {
        let mut p = bridge();
        assert!(p.evaluate(at(Phase::Backward, 8 * GIB, 0)).is_empty(), "exactly 80%");
        assert!(p.evaluate(at(Phase::Forward, 9 * GIB, 0)).is_empty(), "not backward");
        let changes = p.evaluate(at(Phase::Backward, 9 * GIB, 0));
        assert_eq!(changes.len(), 1);
        let (rule, hints) = changes[0];
        assert_eq!(rule, PolicyRule::BackwardPressure);
        assert!(hints.suppress_speculative);
        assert_eq!(hints.prefetch_window_cap, Some(1));
        assert_eq!(hints.max_inflight_h2d, None);
    }

    #[test]
    fn optimizer_protection_limits_h2d_and_suppresses() {
        let mut p = bridge();
        let changes = p.evaluate(at(Phase::Optimizer, 0, 0));
        assert_eq!(
            changes,
            vec![(
                PolicyRule::OptimizerProtection,
                Hints {
                    max_inflight_h2d: Some(1),
                    suppress_speculative: true,
                    ..Hints::default()
                }
            )]
        );
        assert!(p.evaluate(at(Phase::Optimizer, 0, 0)).is_empty(), "no change, no event");
    }

    #[test]
    fn contention_shrinks_the_window_step_by_step_to_one() {
        let mut p = bridge();
        assert!(p.evaluate(at(Phase::Forward, 0, 3)).is_empty(), "needs more than 3");
        let mut caps = Vec::new();
        for _ in 0..4 {
            for (rule, h) in p.evaluate(at(Phase::Forward, 0, 4)) {
                assert_eq!(rule, PolicyRule::Contention);
                caps.push(h.prefetch_window_cap);
            }
        }
        assert_eq!(caps, vec![Some(2), Some(1)]);
    }

    #[test]
    fn hints_only_tighten_within_a_step_and_reset_at_step_begin() {
        let mut p = bridge();
        let mut last = p.hints();
        let phases = [
            (Phase::Forward, 0, 5),
            (Phase::Backward, 9 * GIB, 0),
            (Phase::Backward, 0, 0),
            (Phase::Forward, 0, 0),
            (Phase::Backward, 0, 9),
            (Phase::Optimizer, 0, 0),
            (Phase::StepEnd, 0, 0),
        ];
        for inputs in phases.map(|(ph, v, c)| at(ph, v, c)) {
            p.evaluate(inputs);
            let now = p.hints();
            let window = |h: Hints| h.prefetch_window_cap.unwrap_or(u32::MAX);
            let h2d = |h: Hints| h.max_inflight_h2d.unwrap_or(u32::MAX);
            assert!(window(now) <= window(last), "{inputs:?}: window grew");
            assert!(h2d(now) <= h2d(last), "{inputs:?}: h2d grew");
            assert!(
                now.suppress_speculative || !last.suppress_speculative,
                "{inputs:?}: suppression reverted"
            );
            last = now;
        }
        assert!(last.suppress_speculative);
        assert_eq!(last.prefetch_window_cap, Some(1));
        assert_eq!(p.reset(), Some((PolicyRule::Reset, Hints::default())));
        assert_eq!(p.hints(), Hints::default());
        assert_eq!(p.reset(), None, "already at the configured values");
    }

    #[test]
    fn one_boundary_can_fire_two_rules_in_order() {
        let mut p = bridge();
        let rules: Vec<PolicyRule> = p
            .evaluate(at(Phase::Optimizer, 0, 4))
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        assert_eq!(
            rules,
            vec![PolicyRule::OptimizerProtection, PolicyRule::Contention]
        );
    }
}
