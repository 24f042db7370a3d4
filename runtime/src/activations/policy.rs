//! The keep-or-spill decision for one saved tensor: plain values in, a verdict out.
//!
//! Checks run cheapest and most certain first: parameters and tensors off the device are never
//! worth spilling, tiny ones cost more than they save, regions and the learned tail scope the
//! spilling, then the watermark hysteresis says whether memory needs it at all, and the fraction
//! caps how much of what remains is moved.

use crate::events::KeepReason;

/// What the runtime knows about a saved tensor when deciding.
#[derive(Debug, Clone, Copy)]
pub struct PackFacts {
    /// Bytes of the tensor's data.
    pub bytes: u64,
    /// On the runtime's device (on the host device every tensor is).
    pub on_device: bool,
    /// A model parameter (not managed by the weight runtime): spilling it frees nothing.
    pub parameter: bool,
    /// Inside a region where spilling is allowed.
    pub region_allowed: bool,
    /// In one of the last groups of the forward, which backward needs first.
    pub tail: bool,
    /// Allocated device bytes now.
    pub allocated: u64,
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep on the device, for this reason.
    Keep(KeepReason),
    /// Spill to the host.
    Spill,
}

/// Thresholds and the state the decision carries through a step.
#[derive(Debug, Clone)]
pub struct SpillPolicy {
    high: u64,
    low: u64,
    min_bytes: u64,
    fraction: f64,
    spilling: bool,
    eligible_bytes: u64,
    spilled_bytes: u64,
}

impl SpillPolicy {
    /// A policy with the given watermarks (high > low), minimum size and fraction.
    pub fn new(high: u64, low: u64, min_bytes: u64, fraction: f64) -> SpillPolicy {
        SpillPolicy {
            high,
            low,
            min_bytes,
            fraction,
            spilling: false,
            eligible_bytes: 0,
            spilled_bytes: 0,
        }
    }

    /// Starts a step: spilling off (memory is low at step start) and the fraction counters at 0.
    pub fn reset_step(&mut self) {
        self.spilling = false;
        self.eligible_bytes = 0;
        self.spilled_bytes = 0;
    }

    /// The watermarks, high then low.
    pub fn watermarks(&self) -> (u64, u64) {
        (self.high, self.low)
    }

    /// Moves both watermarks so that the high one is `high` (no lower than `floor`, nor than
    /// the gap), keeping their gap. Returns the new watermarks, or `None` when they did not move.
    pub fn move_to(&mut self, high: u64, floor: u64) -> Option<(u64, u64)> {
        let gap = self.high - self.low;
        let high = high.max(floor).max(gap + 1);
        if high == self.high {
            return None;
        }
        self.high = high;
        self.low = high - gap;
        Some((self.high, self.low))
    }

    /// Whether the hysteresis flag is on.
    pub fn is_spilling(&self) -> bool {
        self.spilling
    }

    /// Decides for one tensor. The second value is `Some(on)` when the hysteresis flag flipped.
    pub fn decide(&mut self, f: &PackFacts) -> (Verdict, Option<bool>) {
        let keep = |r| (Verdict::Keep(r), None);
        if f.parameter {
            return keep(KeepReason::Parameter);
        }
        if !f.on_device {
            return keep(KeepReason::NotOnDevice);
        }
        if f.bytes < self.min_bytes || f.bytes == 0 {
            return keep(KeepReason::TooSmall);
        }
        if !f.region_allowed {
            return keep(KeepReason::OutsideRegion);
        }
        if f.tail {
            return keep(KeepReason::TailOfForward);
        }
        // Hysteresis: on at >= high, off only once under low, so spilling does not flap
        // around a single threshold.
        let mut toggled = None;
        if !self.spilling && f.allocated >= self.high {
            self.spilling = true;
            toggled = Some(true);
        } else if self.spilling && f.allocated < self.low {
            self.spilling = false;
            toggled = Some(false);
        }
        if !self.spilling {
            return (Verdict::Keep(KeepReason::UnderWatermark), toggled);
        }
        // Fraction of the eligible bytes seen so far (an online rule: it holds at every point
        // of the forward, so it also bounds the first, unprofiled step).
        self.eligible_bytes += f.bytes;
        let budget = self.fraction * self.eligible_bytes as f64;
        if (self.spilled_bytes + f.bytes) as f64 > budget {
            return (Verdict::Keep(KeepReason::FractionReached), toggled);
        }
        self.spilled_bytes += f.bytes;
        (Verdict::Spill, toggled)
    }

    /// A spill the policy chose could not happen (no buffer): take it off the fraction count.
    pub fn spill_refused(&mut self, bytes: u64) {
        self.spilled_bytes = self.spilled_bytes.saturating_sub(bytes);
    }
}

/// Whether a region pattern matches a dotted region path: the pattern must equal a run of
/// whole segments (`mlp` matches `blocks.3.mlp`, `blocks.3` matches `blocks.3.attn`, `lock`
/// matches nothing there).
pub fn region_matches(pattern: &str, path: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let s: Vec<&str> = path.split('.').collect();
    p.len() <= s.len() && s.windows(p.len()).any(|w| w == p.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(bytes: u64, allocated: u64) -> PackFacts {
        PackFacts {
            bytes,
            on_device: true,
            parameter: false,
            region_allowed: true,
            tail: false,
            allocated,
        }
    }

    #[test]
    fn hysteresis_turns_on_at_high_and_off_under_low() {
        let mut p = SpillPolicy::new(100, 50, 1, 1.0);
        assert_eq!(p.decide(&facts(10, 99)), (Verdict::Keep(KeepReason::UnderWatermark), None));
        assert_eq!(p.decide(&facts(10, 100)), (Verdict::Spill, Some(true)));
        // Between the watermarks: keeps spilling.
        assert_eq!(p.decide(&facts(10, 70)), (Verdict::Spill, None));
        assert_eq!(p.decide(&facts(10, 50)), (Verdict::Spill, None));
        assert_eq!(p.decide(&facts(10, 49)), (Verdict::Keep(KeepReason::UnderWatermark), Some(false)));
        // Between the watermarks again, now off: stays off.
        assert_eq!(p.decide(&facts(10, 80)), (Verdict::Keep(KeepReason::UnderWatermark), None));
        assert!(!p.is_spilling());
    }

    #[test]
    fn reasons_come_in_order() {
        let mut p = SpillPolicy::new(1, 0, 100, 1.0);
        let mut f = facts(1000, 10);
        f.parameter = true;
        f.on_device = false;
        assert_eq!(p.decide(&f).0, Verdict::Keep(KeepReason::Parameter));
        f.parameter = false;
        assert_eq!(p.decide(&f).0, Verdict::Keep(KeepReason::NotOnDevice));
        f.on_device = true;
        f.bytes = 99;
        assert_eq!(p.decide(&f).0, Verdict::Keep(KeepReason::TooSmall));
        f.bytes = 100;
        f.region_allowed = false;
        assert_eq!(p.decide(&f).0, Verdict::Keep(KeepReason::OutsideRegion));
        f.region_allowed = true;
        f.tail = true;
        assert_eq!(p.decide(&f).0, Verdict::Keep(KeepReason::TailOfForward));
        f.tail = false;
        assert_eq!(p.decide(&f).0, Verdict::Spill);
    }

    #[test]
    fn fraction_limits_spilled_bytes() {
        let mut p = SpillPolicy::new(1, 0, 1, 0.5);
        let spills = (0..10).filter(|_| p.decide(&facts(10, 5)).0 == Verdict::Spill).count();
        assert_eq!(spills, 5);
        let mut none = SpillPolicy::new(1, 0, 1, 0.0);
        assert_eq!(none.decide(&facts(10, 5)).0, Verdict::Keep(KeepReason::FractionReached));
        p.reset_step();
        assert!(!p.is_spilling());
    }

    #[test]
    fn region_patterns_match_whole_segments() {
        assert!(region_matches("mlp", "blocks.3.mlp"));
        assert!(region_matches("blocks.3", "blocks.3.attn"));
        assert!(region_matches("blocks.3.attn", "blocks.3.attn"));
        assert!(!region_matches("lock", "blocks.3.mlp"));
        assert!(!region_matches("blocks.3.attn.q", "blocks.3.attn"));
    }

    #[test]
    fn moving_keeps_the_gap_and_stops_at_the_floor() {
        let mut p = SpillPolicy::new(1000, 800, 1, 1.0);
        assert_eq!(p.move_to(900, 500), Some((900, 700)));
        assert_eq!(p.move_to(0, 500), Some((500, 300)), "not below the floor");
        assert_eq!(p.move_to(10, 500), None, "at the floor already");
        assert_eq!(p.watermarks(), (500, 300));
        assert_eq!(p.move_to(700, 500), Some((700, 500)), "raised");
        assert_eq!(p.move_to(700, 500), None, "already there");
        assert_eq!(p.move_to(100, 50), Some((201, 1)), "the low one stays above 0");
    }
}
