//! The copy and pool settings a finding may name, set on the builder over the plan's choice:
//! loads and restores in flight (`max_inflight_h2d`), spills in flight (`max_inflight_d2h`),
//! restores ahead of backward (`restore_lookahead`), the activation pool's slabs per size
//! class (`slabs_per_class`) and the most pinned memory it may take (`activation_pool_limit`).
//! Each has a demo flag of the same name (`--max-inflight-h2d`; the limit's in MiB); the plan's
//! reasons say which were set and what the plan would have chosen.

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
    pub activation_pool_limit: Option<u64>,
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
        if self.activation_pool_limit == Some(0) {
            return Err(Error::Config {
                field: "activation_pool_limit",
                value: "0".into(),
                expected: "at least one byte of pinned memory for the activation pool".into(),
            });
        }
        Ok(())
    }

    /// Puts the settings into the plan: the copies in flight and the Conductor's transfer slots
    /// that follow from them, and the activation pool's limit, with a reason line for each. A
    /// pool limit over the host memory the plan leaves is refused.
    pub fn apply(&self, plan: &mut Plan) -> Result<()> {
        let mut set = Vec::new();
        if let Some(n) = self.activation_pool_limit {
            if plan.host_left_bytes > 0 && n > plan.host_left_bytes {
                return Err(Error::Config {
                    field: "activation_pool_limit",
                    value: format!("{n} bytes ({})", super::plan::mib(n)),
                    expected: format!(
                        "at most the host memory the model's weights, gradients, masters and optimizer state leave, {} ({} bytes)",
                        super::plan::mib(plan.host_left_bytes),
                        plan.host_left_bytes
                    ),
                });
            }
            set.push(format!(
                "activation_pool_limit {} (the plan's {})",
                super::plan::mib(n),
                super::plan::mib(plan.pool_limit_bytes)
            ));
            plan.pool_limit_bytes = n;
        }
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
        Ok(())
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

    /// The most pinned host memory the activations' pool may take (default: the plan's, half
    /// the host memory the model leaves, rounded down to a power of two). Spills beyond it go
    /// through pageable memory, synchronously. A model that stores many activations instead of
    /// recomputing them (`recompute_fraction` under 1) may need more; a limit over the host
    /// memory the model leaves is refused when the plan is made.
    pub fn activation_pool_limit_bytes(mut self, bytes: u64) -> Self {
        self.knobs.activation_pool_limit = Some(bytes);
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
        k.apply(&mut plan).expect("apply");
        assert_eq!((plan.max_inflight_h2d, plan.max_inflight_restores, plan.h2d_slots), (3, 3, 6));
        assert_eq!((plan.max_inflight_spills, plan.d2h_slots), (5, 13));
        let last = plan.reasons.last().expect("a reason");
        assert!(last.contains("max_inflight_h2d 3 (the plan's 2 weight loads and 4 restores)"), "{last}");
        assert!(Knobs { max_inflight_d2h: Some(0), ..Knobs::default() }.check().is_err());
        let mut untouched = Plan::default();
        Knobs::default().apply(&mut untouched).expect("apply");
        assert_eq!(untouched, Plan::default(), "nothing set, nothing changed");
    }

    #[test]
    fn a_pool_limit_replaces_the_plans_within_the_host_memory_left() {
        let gib = 1u64 << 30;
        let plan = Plan { pool_limit_bytes: 16 * gib, host_left_bytes: 60 * gib, ..Plan::default() };
        let k = Knobs { activation_pool_limit: Some(40 * gib), ..Knobs::default() };
        let mut p = plan.clone();
        k.apply(&mut p).expect("within the host memory left");
        assert_eq!(p.pool_limit_bytes, 40 * gib);
        let last = p.reasons.last().expect("a reason");
        assert!(last.contains("activation_pool_limit 40960.0 MiB (the plan's 16384.0 MiB)"), "{last}");
        // Over what the model leaves: refused, the plan untouched.
        let mut p = plan.clone();
        let e = Knobs { activation_pool_limit: Some(61 * gib), ..Knobs::default() }.apply(&mut p).expect_err("over");
        assert!(e.to_string().contains("activation_pool_limit") && e.to_string().contains("61440.0 MiB"), "{e}");
        assert_eq!(p, plan);
        // Where the host's memory is not known, the setting stands as given.
        let mut p = Plan { host_left_bytes: 0, ..plan };
        Knobs { activation_pool_limit: Some(u64::MAX), ..Knobs::default() }.apply(&mut p).expect("unknown host");
        assert_eq!(p.pool_limit_bytes, u64::MAX);
        assert!(Knobs { activation_pool_limit: Some(0), ..Knobs::default() }.check().is_err());
    }
}
