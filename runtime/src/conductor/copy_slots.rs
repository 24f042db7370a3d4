//! H2D and D2H transfer slot pools.
//!
//! A runtime takes a slot before each copy. The effective limit of a pool is the smaller of
//! its configured slot count and the policy's `max_inflight_*` hint. Speculative and
//! background requests can be refused: first when a policy rule suppresses speculative work
//! (`PhaseRuleSuppressedSpeculative`), then when the pool is full (`H2dSlotsExhausted`,
//! `D2hSlotsExhausted`). CRITICAL and REQUIRED requests are never refused: when the pool is
//! full they are granted over the limit and counted. The Conductor never makes the training
//! thread wait for a slot, because a wait there is a stall, and the slot it would wait for may
//! be held by the same thread.
//!
//! Every request is also a contention check: a request that finds its pool full extends the
//! run of consecutive full checks, one that finds room ends it. Rule 3 reads that run.

use crate::events::model::{DenyReason, Direction, Priority};

/// Whether a priority may be refused a slot.
pub fn is_speculative(priority: Priority) -> bool {
    match priority {
        Priority::Critical | Priority::Required => false,
        Priority::Speculative | Priority::Background => true,
    }
}

/// The answer to a slot request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotDecision {
    /// A slot is taken; `inflight` counts it. `over_limit` when a required copy was let
    /// through a full pool.
    Granted { inflight: u32, over_limit: bool },
    /// Refused, with why.
    Denied(DenyReason),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Pool {
    slots: u32,
    inflight: u32,
}

/// Slot counts of one step (the Conductor resets them at step begin).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TransferCounts {
    pub grants: u64,
    pub denials: u64,
    pub over_limit_grants: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
}

/// The two slot pools and the contention counter (collectives take no slot: their pool never
/// fills).
#[derive(Debug)]
pub struct TransferManager {
    h2d: Pool,
    d2h: Pool,
    collective: Pool,
    consecutive_full: u32,
    counts: TransferCounts,
}

impl TransferManager {
    /// Pools of `h2d_slots` and `d2h_slots`, all free.
    pub fn new(h2d_slots: u32, d2h_slots: u32) -> TransferManager {
        TransferManager {
            h2d: Pool {
                slots: h2d_slots,
                inflight: 0,
            },
            d2h: Pool {
                slots: d2h_slots,
                inflight: 0,
            },
            collective: Pool {
                slots: u32::MAX,
                inflight: 0,
            },
            consecutive_full: 0,
            counts: TransferCounts::default(),
        }
    }

    fn pool_mut(&mut self, dir: Direction) -> &mut Pool {
        match dir {
            Direction::H2d => &mut self.h2d,
            Direction::D2h => &mut self.d2h,
            Direction::Collective => &mut self.collective,
        }
    }

    /// Whether a request in `dir` would find its pool full (`limit_hint` as for
    /// [`TransferManager::acquire`]); changes nothing.
    pub fn is_full(&self, dir: Direction, limit_hint: Option<u32>) -> bool {
        let pool = match dir {
            Direction::H2d => self.h2d,
            Direction::D2h => self.d2h,
            Direction::Collective => self.collective,
        };
        pool.inflight >= limit_hint.map_or(pool.slots, |h| h.min(pool.slots))
    }

    /// Copies in flight in `dir`.
    pub fn inflight(&self, dir: Direction) -> u32 {
        match dir {
            Direction::H2d => self.h2d.inflight,
            Direction::D2h => self.d2h.inflight,
            Direction::Collective => self.collective.inflight,
        }
    }

    /// Consecutive requests that found their pool full.
    pub fn consecutive_full(&self) -> u32 {
        self.consecutive_full
    }

    /// Starts a new run of contention checks (after rule 3 fired, and at step begin).
    pub fn reset_contention(&mut self) {
        self.consecutive_full = 0;
    }

    /// The counts since the last [`TransferManager::reset_counts`].
    pub fn counts(&self) -> TransferCounts {
        self.counts
    }

    /// Zeroes the counts (step begin).
    pub fn reset_counts(&mut self) {
        self.counts = TransferCounts::default();
    }

    /// Decides a request. `limit_hint` is the policy's `max_inflight_*` for `dir`.
    pub fn acquire(
        &mut self,
        dir: Direction,
        priority: Priority,
        limit_hint: Option<u32>,
        suppress_speculative: bool,
    ) -> SlotDecision {
        let pool = *self.pool_mut(dir);
        let limit = limit_hint.map_or(pool.slots, |h| h.min(pool.slots));
        let full = pool.inflight >= limit;
        if full {
            self.consecutive_full = self.consecutive_full.saturating_add(1);
        } else {
            self.consecutive_full = 0;
        }
        if is_speculative(priority) {
            if suppress_speculative {
                self.counts.denials += 1;
                return SlotDecision::Denied(DenyReason::PhaseRuleSuppressedSpeculative);
            }
            if full {
                self.counts.denials += 1;
                return SlotDecision::Denied(match dir {
                    Direction::H2d => DenyReason::H2dSlotsExhausted,
                    Direction::D2h | Direction::Collective => DenyReason::D2hSlotsExhausted,
                });
            }
        }
        let p = self.pool_mut(dir);
        p.inflight += 1;
        let inflight = p.inflight;
        self.counts.grants += 1;
        if full {
            self.counts.over_limit_grants += 1;
        }
        SlotDecision::Granted {
            inflight,
            over_limit: full,
        }
    }

    /// Gives a slot back; returns the copies still in flight in `dir`.
    pub fn release(&mut self, dir: Direction) -> u32 {
        let p = self.pool_mut(dir);
        p.inflight = p.inflight.saturating_sub(1);
        p.inflight
    }

    /// Records a finished copy's bytes.
    pub fn record_completion(&mut self, dir: Direction, bytes: u64) {
        match dir {
            Direction::H2d => self.counts.h2d_bytes += bytes,
            Direction::D2h => self.counts.d2h_bytes += bytes,
            Direction::Collective => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_separate_and_speculative_requests_see_exhaustion() {
        let mut t = TransferManager::new(2, 1);
        for i in 1..=2 {
            assert_eq!(
                t.acquire(Direction::H2d, Priority::Speculative, None, false),
                SlotDecision::Granted {
                    inflight: i,
                    over_limit: false
                }
            );
        }
        assert_eq!(
            t.acquire(Direction::H2d, Priority::Speculative, None, false),
            SlotDecision::Denied(DenyReason::H2dSlotsExhausted)
        );
        assert!(matches!(
            t.acquire(Direction::D2h, Priority::Background, None, false),
            SlotDecision::Granted { inflight: 1, .. }
        ));
        assert_eq!(
            t.acquire(Direction::D2h, Priority::Background, None, false),
            SlotDecision::Denied(DenyReason::D2hSlotsExhausted)
        );
        assert_eq!(t.release(Direction::H2d), 1);
        assert!(matches!(
            t.acquire(Direction::H2d, Priority::Speculative, None, false),
            SlotDecision::Granted { inflight: 2, .. }
        ));
        assert_eq!(t.counts().denials, 2);
    }

    #[test]
    fn required_copies_pass_a_full_pool_and_are_counted() {
        let mut t = TransferManager::new(1, 1);
        t.acquire(Direction::H2d, Priority::Required, None, false);
        for (i, p) in [Priority::Required, Priority::Critical].into_iter().enumerate() {
            assert_eq!(
                t.acquire(Direction::H2d, p, None, true),
                SlotDecision::Granted {
                    inflight: 2 + i as u32,
                    over_limit: true
                },
                "required work is never refused, not even under suppression"
            );
        }
        assert_eq!(t.counts().over_limit_grants, 2);
        assert_eq!(t.counts().denials, 0);
    }

    #[test]
    fn suppression_refuses_speculative_work_before_looking_at_slots() {
        let mut t = TransferManager::new(4, 4);
        assert_eq!(
            t.acquire(Direction::H2d, Priority::Speculative, None, true),
            SlotDecision::Denied(DenyReason::PhaseRuleSuppressedSpeculative)
        );
        assert_eq!(t.inflight(Direction::H2d), 0);
    }

    #[test]
    fn the_hint_lowers_the_limit_but_never_raises_it() {
        let mut t = TransferManager::new(2, 2);
        t.acquire(Direction::H2d, Priority::Speculative, Some(1), false);
        assert_eq!(
            t.acquire(Direction::H2d, Priority::Speculative, Some(1), false),
            SlotDecision::Denied(DenyReason::H2dSlotsExhausted)
        );
        t.acquire(Direction::H2d, Priority::Speculative, Some(8), false);
        assert_eq!(
            t.acquire(Direction::H2d, Priority::Speculative, Some(8), false),
            SlotDecision::Denied(DenyReason::H2dSlotsExhausted)
        );
    }

    #[test]
    fn consecutive_full_checks_count_and_reset_on_room() {
        let mut t = TransferManager::new(1, 1);
        t.acquire(Direction::H2d, Priority::Required, None, false);
        for n in 1..=4 {
            t.acquire(Direction::H2d, Priority::Speculative, None, false);
            assert_eq!(t.consecutive_full(), n);
        }
        t.acquire(Direction::D2h, Priority::Speculative, None, false);
        assert_eq!(t.consecutive_full(), 0, "the D2H pool had room");
    }

    #[test]
    fn completions_add_bytes_per_direction() {
        let mut t = TransferManager::new(1, 1);
        t.record_completion(Direction::H2d, 10);
        t.record_completion(Direction::D2h, 3);
        t.record_completion(Direction::H2d, 5);
        let c = t.counts();
        assert_eq!((c.h2d_bytes, c.d2h_bytes), (15, 3));
        t.reset_counts();
        assert_eq!(t.counts(), TransferCounts::default());
    }
}
