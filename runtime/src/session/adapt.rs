//! Keeping later steps under the budget. The plan estimates what the allocator, temporaries
//! and copies in flight add on top of what the runtimes hold; a step whose peak still goes over
//! the budget moves the spill watermarks down by the excess (and a margin), so the next step
//! keeps fewer activations on the device. Each move is published as the activations' new
//! limits, with a warning that says why.

use super::Stagehand;
use crate::activations::ActivationRuntime;
use crate::events::{EventKind, Owner};

impl Stagehand {
    /// After step `step` peaked at `peak` allocated bytes: lowers the watermarks when that was
    /// over the budget. Says once when they cannot go lower.
    pub(super) fn keep_under_budget(&self, acts: &ActivationRuntime, step: u64, peak: u64, floor: u64) {
        let Some(over) = peak.checked_sub(self.budget).filter(|&o| o > 0) else { return };
        // A margin of 1/64 of the budget, so one move usually suffices.
        let by = over + self.budget / 64;
        let message = match acts.lower_watermarks(by, floor) {
            Some((high, low)) => format!(
                "step {step} peaked at {} MiB, {} MiB over the {} MiB budget: activations now spill above {} MiB until under {} MiB",
                peak >> 20,
                over.div_ceil(1 << 20),
                self.budget >> 20,
                high >> 20,
                low >> 20
            ),
            None if !std::mem::replace(&mut self.run().warned_floor, true) => format!(
                "step {step} peaked at {} MiB, over the {} MiB budget, and the spill watermarks are at their floor ({} MiB): raise the budget, or lower the batch",
                peak >> 20,
                self.budget >> 20,
                floor >> 20
            ),
            None => return,
        };
        self.bus.publish(EventKind::Warning { source: Owner::Activations, message });
    }
}
