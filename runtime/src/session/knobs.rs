//! The copy and pool settings a finding may name, set on the builder over the plan's choice:
//! loads and restores in flight (`max_inflight_h2d`), spills in flight (`max_inflight_d2h`),
//! restores ahead of backward (`restore_lookahead`) and the activation pool's slabs per size
//! class (`slabs_per_class`). Each has a demo flag of the same name (`--max-inflight-h2d`); the
//! plan's reasons say which were set and what the plan would have chosen.

use super::{Plan, StagehandBuilder};
use crate::error::{Error, Result};

/// Restores ahead of backward by default (the handle's choice; the activation runtime's own
/// default is smaller, for loops without a plan).
pub const DEFAULT_RESTORE_LOOKAHEAD: u32 = 8;

/// Settings given on the builder; `None` leaves the plan's choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Knobs {
    pub max_inflight_h2d: Option<u32>,
    pub max_inflight_d2h: Option<u32>,
    pub restore_lookahead: Option<u32>,
    pub slabs_per_class: Option<u32>,
}

impl Knobs {
    /// Refuses settings that cannot work (no copy in flight would never copy).
    pub fn check(&self) -> Result<()> {
        for (field, v) in [("max_inflight_h2d", self.max_inflight_h2d), ("max_inflight_d2h", self.max_inflight_d2h)] {
            if v == Some(0) {
                return Err(Error::Config {
                    field,
                    value: "0".into(),
                    expected: "at least 1 copy in flight".into(),
                });
            }
        }
        Ok(())
    }

    /// Puts the settings into the plan: the copies in flight and the Conductor's transfer slots
    /// that follow from them, with a reason line for each.
    pub fn apply(&self, plan: &mut Plan) {
        let mut set = Vec::new();
        if let Some(n) = self.max_inflight_h2d {
            set.push(format!(
                "max_inflight_h2d {n} (the plan's {} weight loads and {} restores)",
                plan.max_inflight_h2d, plan.max_inflight_restores
            ));
            plan.max_inflight_h2d = n;
            plan.max_inflight_restores = n;
            plan.h2d_slots = 2 * n;
        }
        if let Some(n) = self.max_inflight_d2h {
            set.push(format!("max_inflight_d2h {n} (the plan's {} spills)", plan.max_inflight_spills));
            plan.max_inflight_spills = n;
            plan.d2h_slots = n.saturating_add(8);
        }
        if let Some(n) = self.restore_lookahead {
            set.push(format!("restore_lookahead {n} (the default {DEFAULT_RESTORE_LOOKAHEAD})"));
        }
        if let Some(n) = self.slabs_per_class {
            set.push(format!("slabs_per_class at least {n} (the traced pool's own count otherwise)"));
        }
        if !set.is_empty() {
            plan.reasons.push(format!("set on the builder: {}", set.join("; ")));
        }
    }

    /// Restores ahead of backward.
    pub fn restore_lookahead(&self) -> u32 {
        self.restore_lookahead.unwrap_or(DEFAULT_RESTORE_LOOKAHEAD)
    }
}

impl StagehandBuilder {
    /// Copies host-to-device in flight at once, for each runtime: weight loads landing, and
    /// restores of spilled activations ahead of need (default: the plan's, the prefetch window
    /// and 4). More overlap the copies with compute; each holds device memory while it lands.
    /// The Conductor's host-to-device slots follow.
    pub fn max_inflight_h2d(mut self, copies: u32) -> Self {
        self.knobs.max_inflight_h2d = Some(copies);
        self
    }

    /// Spills (device to host) in flight at once before the training thread waits for the
    /// oldest (default: the plan's, 64). The Conductor's device-to-host slots follow.
    pub fn max_inflight_d2h(mut self, copies: u32) -> Self {
        self.knobs.max_inflight_d2h = Some(copies);
        self
    }

    /// Spilled tensors restored ahead of backward's need (default 8), within the plan's room
    /// for restores.
    pub fn restore_lookahead(mut self, tensors: u32) -> Self {
        self.knobs.restore_lookahead = Some(tensors);
        self
    }

    /// The least slabs each size class of the activations' pinned pool has (default: as many as
    /// the traced step held at once, which is the pool's own size). More slabs mean fewer
    /// spills through pageable memory, for more pinned host memory.
    pub fn slabs_per_class(mut self, slabs: u32) -> Self {
        self.knobs.slabs_per_class = Some(slabs);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_replace_the_plans_and_say_so() {
        let mut plan = Plan { max_inflight_h2d: 2, max_inflight_restores: 4, max_inflight_spills: 64, ..Plan::default() };
        let k = Knobs { max_inflight_h2d: Some(3), max_inflight_d2h: Some(5), ..Knobs::default() };
        k.apply(&mut plan);
        assert_eq!((plan.max_inflight_h2d, plan.max_inflight_restores, plan.h2d_slots), (3, 3, 6));
        assert_eq!((plan.max_inflight_spills, plan.d2h_slots), (5, 13));
        let last = plan.reasons.last().expect("a reason");
        assert!(last.contains("max_inflight_h2d 3 (the plan's 2 weight loads and 4 restores)"), "{last}");
        assert!(Knobs { max_inflight_d2h: Some(0), ..Knobs::default() }.check().is_err());
        let mut untouched = Plan::default();
        Knobs::default().apply(&mut untouched);
        assert_eq!(untouched, Plan::default(), "nothing set, nothing changed");
    }
}
