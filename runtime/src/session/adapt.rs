//! Keeping steps under the budget. The first step keeps an eighth of the activations the plan allows
//! and measures what rides above its high watermark (the temporaries of the ops running at the
//! peak, restores ahead of backward, spills landing): that follows the widest layer rather than
//! the budget, so later steps take the plan's watermark only where the measured overhead still
//! fits under the budget less the margin, and a lower one otherwise.
//!
//! The plan estimates what the allocator, temporaries
//! and copies in flight add on top of what the runtimes hold; a step whose peak comes within a
//! margin of the budget (1/32 of it) or goes over moves the spill watermarks down by the excess
//! over budget less margin, so the next step keeps fewer activations on the device. The margin
//! is there because steps differ: the second allocates the optimizer's state, and copies in
//! flight and recomputations in backward overlap differently from step to step (measured on the
//! 1.21 B main job: steps at 4022 MiB with an occasional one about 80 MiB higher). Each move is
//! published as the activations' new limits and as `watermarks_moved`, which says why (the demo
//! prints it as a line); a step over the budget also gets a warning.

use super::{Plan, Stagehand};
use crate::activations::ActivationRuntime;
use crate::events::{EventKind, Owner};

/// The plan's figures the rule reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// The plan's high spill watermark: later steps keep at most this.
    planned: u64,
    /// The watermarks never go below it.
    floor: u64,
    /// Device bytes restores ahead of backward may hold.
    restore_allowance: u64,
}

impl Limits {
    pub(super) fn of(plan: &Plan) -> Limits {
        Limits {
            planned: plan.spill_high_bytes,
            floor: plan.spill_floor_bytes,
            restore_allowance: plan.restore_allowance_bytes,
        }
    }
}

impl Stagehand {
    /// After step `step` peaked at `peak` allocated bytes: after the first, sets the watermarks
    /// from what it measured above its own (the high one at most the plan's); after later ones,
    /// lowers them when the peak was within the margin of the budget or over it. Says once when
    /// they cannot go lower. Every move is published as `watermarks_moved`, with why.
    pub(super) fn keep_under_budget(&self, acts: &ActivationRuntime, step: u64, peak: u64, limits: Limits) {
        let Limits { planned, floor, restore_allowance } = limits;
        let margin = self.budget / 32;
        let target = self.budget - margin;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        if step == 1 {
            let before = acts.watermarks();
            let above = peak.saturating_sub(before.0);
            // The first step's restores ran while its pool was being sized (pageable copies,
            // slower than pinned ones), so fewer of them were on the device at its peak than
            // later steps hold: up to the whole allowance more (measured on an H200: fp32 GPT
            // steps 2 at 70 and 223 MiB more above the watermark than step 1, with allowances
            // of 175 and 390 MiB). Later steps are kept under the budget with that room.
            let to = planned.min(target.saturating_sub(above).saturating_sub(restore_allowance));
            if let Some(now) = acts.move_watermarks(to, floor) {
                let why = if to >= planned {
                    "the plan's watermark fits the budget".to_owned()
                } else {
                    format!(
                        "the plan's {:.1} MiB would not fit the {:.1} MiB budget less its margin of {:.1} MiB and the {:.1} MiB restores ahead of backward may hold",
                        mib(planned),
                        mib(self.budget),
                        mib(margin),
                        mib(restore_allowance)
                    )
                };
                self.watermarks_moved(before, now, format!(
                    "step 1 peaked at {:.1} MiB with {:.1} MiB above its spill watermark (temporaries, restores, spills landing): {why}",
                    mib(peak),
                    mib(above)
                ));
            }
            // Below the floor the watermarks stop at it, which the rule for later steps says.
            if to >= floor {
                // Under the budget the new limits are news enough (published by the move).
                if peak <= self.budget {
                    return;
                }
                let (high, low) = acts.watermarks();
                let message = format!(
                    "step 1 peaked at {} MiB, over the {} MiB budget, with {} MiB above its spill watermark (temporaries, restores, spills landing): activations now spill above {} MiB until under {} MiB (the plan's {} MiB would exceed the budget)",
                    peak >> 20,
                    self.budget >> 20,
                    above >> 20,
                    high >> 20,
                    low >> 20,
                    planned >> 20
                );
                self.bus.publish(EventKind::Warning { source: Owner::Activations, message });
                return;
            }
        }
        let Some(by) = peak.checked_sub(target).filter(|&o| o > 0) else { return };
        let before = acts.watermarks();
        let lowered = acts.lower_watermarks(by, floor);
        if let Some(now) = lowered {
            self.watermarks_moved(before, now, format!(
                "step {step} peaked at {:.1} MiB, {} the {:.1} MiB budget: activations spill earlier",
                mib(peak),
                if peak > self.budget { "over" } else { "within a 32nd of" },
                mib(self.budget)
            ));
        }
        let message = match lowered {
            // Within the margin is the plan working: the move is published, not warned.
            Some(_) if peak <= self.budget => return,
            Some((high, low)) => format!(
                "step {step} peaked at {} MiB, {} MiB over the {} MiB budget: activations now spill above {} MiB until under {} MiB",
                peak >> 20,
                (peak - self.budget).div_ceil(1 << 20),
                self.budget >> 20,
                high >> 20,
                low >> 20
            ),
            None if !std::mem::replace(&mut self.run().warned_floor, true) => format!(
                "step {step} peaked at {} MiB, at or near the {} MiB budget, and the spill watermarks are at their floor ({} MiB): raise the budget, or lower the batch",
                peak >> 20,
                self.budget >> 20,
                floor >> 20
            ),
            None => return,
        };
        self.bus.publish(EventKind::Warning { source: Owner::Activations, message });
    }

    fn watermarks_moved(&self, from: (u64, u64), to: (u64, u64), reason: String) {
        if from == to {
            return;
        }
        self.bus.publish(EventKind::WatermarksMoved {
            from_high_bytes: from.0,
            from_low_bytes: from.1,
            high_bytes: to.0,
            low_bytes: to.1,
            reason,
        });
    }
}
