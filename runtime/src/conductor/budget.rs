//! VRAM and pinned host budgets.
//!
//! `available = cap - (measured use + outstanding grants)`, where the cap is the soft cap for
//! HARD, SOFT and FLOOR and the hard cap for BURST (pinned memory has one cap and no measured
//! use: only grants count). Below CRITICAL each priority keeps back a reserve for the levels
//! above it (`priority_reserve_mib` times 1, 2, 3 for REQUIRED, SPECULATIVE, BACKGROUND), so
//! as headroom shrinks the lowest priorities are denied first. FLOOR is a guaranteed minimum
//! and ignores the reserve. A CEILING records an upper bound on what its owner may hold of a
//! resource and grants nothing. Existing grants are never preempted.

use super::config::ConductorConfig;
use crate::events::model::{
    DenyReason, Owner, Phase, Priority, ReservationHolding, ReservationId, ReservationMode, ReservationOutcome,
    Resource,
};

/// A reservation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationRequest {
    pub owner: Owner,
    pub resource: Resource,
    pub bytes: u64,
    pub mode: ReservationMode,
    pub priority: Priority,
    /// Released automatically when this phase ends (next time the step leaves it).
    pub scope: Option<Phase>,
}

impl ReservationRequest {
    /// A SOFT, REQUIRED, unscoped request; adjust with the setters.
    pub fn new(owner: Owner, resource: Resource, bytes: u64) -> ReservationRequest {
        ReservationRequest {
            owner,
            resource,
            bytes,
            mode: ReservationMode::Soft,
            priority: Priority::Required,
            scope: None,
        }
    }

    /// Sets the mode.
    pub fn mode(mut self, mode: ReservationMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the priority.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Releases the reservation when `phase` ends.
    pub fn scoped_to(mut self, phase: Phase) -> Self {
        self.scope = Some(phase);
        self
    }
}

/// The answer to a reservation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationDecision {
    /// The reservation to release later; `None` when nothing is held (denied, or a disabled
    /// Conductor that grants everything without tracking it).
    pub id: Option<ReservationId>,
    pub outcome: ReservationOutcome,
    pub granted_bytes: u64,
    pub reason: Option<DenyReason>,
}

impl ReservationDecision {
    /// What a disabled Conductor answers: everything, untracked.
    pub fn proceed(bytes: u64) -> ReservationDecision {
        ReservationDecision {
            id: None,
            outcome: ReservationOutcome::Granted,
            granted_bytes: bytes,
            reason: None,
        }
    }

    fn denied(reason: DenyReason) -> ReservationDecision {
        ReservationDecision {
            id: None,
            outcome: ReservationOutcome::Denied,
            granted_bytes: 0,
            reason: Some(reason),
        }
    }

    /// True when some bytes were granted (in full or in part).
    pub fn is_granted(&self) -> bool {
        matches!(
            self.outcome,
            ReservationOutcome::Granted | ReservationOutcome::Partial
        )
    }
}

/// A grant that is still held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    id: ReservationId,
    owner: Owner,
    resource: Resource,
    bytes: u64,
    scope: Option<Phase>,
}

/// A recorded ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ceiling {
    owner: Owner,
    resource: Resource,
    bytes: u64,
    scope: Option<Phase>,
}

/// Grant, partial and denial counts (per step; the Conductor resets them at step begin).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetCounts {
    pub grants: u64,
    pub partials: u64,
    pub denials: u64,
}

/// Tracks reservations against the caps. Pure bookkeeping: the caller passes the measured
/// VRAM use and publishes the events.
#[derive(Debug)]
pub struct BudgetManager {
    vram_soft_cap: u64,
    vram_hard_cap: u64,
    pinned_cap: u64,
    reserve_unit: u64,
    next_id: u64,
    held: Vec<Held>,
    ceilings: Vec<Ceiling>,
    counts: BudgetCounts,
}

/// How many reserve units a priority leaves for the levels above it.
fn reserve_rank(p: Priority) -> u64 {
    match p {
        Priority::Critical => 0,
        Priority::Required => 1,
        Priority::Speculative => 2,
        Priority::Background => 3,
    }
}

impl BudgetManager {
    /// A budget with the config's caps and nothing held.
    pub fn new(config: &ConductorConfig) -> BudgetManager {
        BudgetManager {
            vram_soft_cap: config.vram_soft_cap_bytes(),
            vram_hard_cap: config.vram_hard_cap_bytes(),
            pinned_cap: config.pinned_cap_bytes(),
            reserve_unit: config.priority_reserve_bytes(),
            next_id: 0,
            held: Vec::new(),
            ceilings: Vec::new(),
            counts: BudgetCounts::default(),
        }
    }

    /// Bytes granted and still held on `resource`.
    pub fn outstanding(&self, resource: Resource) -> u64 {
        self.held
            .iter()
            .filter(|h| h.resource == resource)
            .map(|h| h.bytes)
            .sum()
    }

    /// Reservations still held.
    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// Each reservation still held (for out-of-memory reports).
    pub fn held(&self) -> Vec<ReservationHolding> {
        self.held
            .iter()
            .map(|h| ReservationHolding {
                id: h.id,
                owner: h.owner,
                resource: h.resource,
                bytes: h.bytes,
            })
            .collect()
    }

    /// Headroom under the soft cap (the pinned cap for pinned memory).
    pub fn headroom(&self, resource: Resource, measured: u64) -> u64 {
        let (cap, measured) = match resource {
            Resource::Vram => (self.vram_soft_cap, measured),
            Resource::PinnedHost => (self.pinned_cap, 0),
        };
        cap.saturating_sub(measured.saturating_add(self.outstanding(resource)))
    }

    /// The counts since the last [`BudgetManager::reset_counts`].
    pub fn counts(&self) -> BudgetCounts {
        self.counts
    }

    /// Zeroes the counts (step begin).
    pub fn reset_counts(&mut self) {
        self.counts = BudgetCounts::default();
    }

    fn new_id(&mut self) -> ReservationId {
        self.next_id += 1;
        ReservationId(self.next_id)
    }

    /// Decides `req`. `vram_measured` is the live VRAM use (ignored for pinned memory).
    pub fn request(&mut self, req: &ReservationRequest, vram_measured: u64) -> ReservationDecision {
        let (cap, measured) = match (req.resource, req.mode) {
            (Resource::Vram, ReservationMode::Burst) => (self.vram_hard_cap, vram_measured),
            (Resource::Vram, _) => (self.vram_soft_cap, vram_measured),
            (Resource::PinnedHost, _) => (self.pinned_cap, 0),
        };
        let available =
            cap.saturating_sub(measured.saturating_add(self.outstanding(req.resource)));
        let reserve = match req.mode {
            ReservationMode::Floor => 0,
            _ => self.reserve_unit.saturating_mul(reserve_rank(req.priority)),
        };
        let usable = available.saturating_sub(reserve);
        let ceiling_room = self
            .ceilings
            .iter()
            .find(|c| c.owner == req.owner && c.resource == req.resource)
            .map(|c| {
                let held: u64 = self
                    .held
                    .iter()
                    .filter(|h| h.owner == req.owner && h.resource == req.resource)
                    .map(|h| h.bytes)
                    .sum();
                c.bytes.saturating_sub(held)
            })
            .unwrap_or(u64::MAX);

        let (outcome, granted, reason) = match req.mode {
            ReservationMode::Hard | ReservationMode::Burst | ReservationMode::Floor => {
                if req.bytes > ceiling_room {
                    (ReservationOutcome::Denied, 0, Some(DenyReason::OverCeiling))
                } else if req.bytes > available {
                    (
                        ReservationOutcome::Denied,
                        0,
                        Some(DenyReason::InsufficientHeadroom),
                    )
                } else if req.bytes > usable {
                    (ReservationOutcome::Denied, 0, Some(DenyReason::PriorityReserve))
                } else {
                    (ReservationOutcome::Granted, req.bytes, None)
                }
            }
            ReservationMode::Soft => {
                let grantable = usable.min(ceiling_room);
                if grantable >= req.bytes {
                    (ReservationOutcome::Granted, req.bytes, None)
                } else if grantable > 0 {
                    (ReservationOutcome::Partial, grantable, None)
                } else if ceiling_room == 0 {
                    (ReservationOutcome::Denied, 0, Some(DenyReason::OverCeiling))
                } else if available == 0 {
                    (
                        ReservationOutcome::Denied,
                        0,
                        Some(DenyReason::InsufficientHeadroom),
                    )
                } else {
                    (ReservationOutcome::Denied, 0, Some(DenyReason::PriorityReserve))
                }
            }
            ReservationMode::Ceiling => return self.record_ceiling(req),
        };
        match (outcome, reason) {
            (ReservationOutcome::Denied, Some(r)) => {
                self.counts.denials += 1;
                ReservationDecision::denied(r)
            }
            _ => {
                if outcome == ReservationOutcome::Partial {
                    self.counts.partials += 1;
                } else {
                    self.counts.grants += 1;
                }
                let id = self.new_id();
                self.held.push(Held {
                    id,
                    owner: req.owner,
                    resource: req.resource,
                    bytes: granted,
                    scope: req.scope,
                });
                ReservationDecision {
                    id: Some(id),
                    outcome,
                    granted_bytes: granted,
                    reason: None,
                }
            }
        }
    }

    fn record_ceiling(&mut self, req: &ReservationRequest) -> ReservationDecision {
        self.ceilings
            .retain(|c| !(c.owner == req.owner && c.resource == req.resource));
        self.ceilings.push(Ceiling {
            owner: req.owner,
            resource: req.resource,
            bytes: req.bytes,
            scope: req.scope,
        });
        ReservationDecision {
            id: Some(self.new_id()),
            outcome: ReservationOutcome::CapRecorded,
            granted_bytes: 0,
            reason: None,
        }
    }

    /// Releases a held reservation; `None` when it is not held (already released, or its
    /// phase ended).
    pub fn release(&mut self, id: ReservationId) -> Option<u64> {
        let i = self.held.iter().position(|h| h.id == id)?;
        Some(self.held.swap_remove(i).bytes)
    }

    /// Releases every reservation and ceiling scoped to `phase`; returns the released grants
    /// in the order they were made.
    pub fn end_phase(&mut self, phase: Phase) -> Vec<(ReservationId, u64)> {
        self.ceilings.retain(|c| c.scope != Some(phase));
        let mut released = Vec::new();
        self.held.retain(|h| {
            if h.scope == Some(phase) {
                released.push((h.id, h.bytes));
                false
            } else {
                true
            }
        });
        released
    }

    /// Releases everything (shutdown).
    pub fn release_all(&mut self) -> Vec<(ReservationId, u64)> {
        self.ceilings.clear();
        self.held.drain(..).map(|h| (h.id, h.bytes)).collect()
    }
}

#[cfg(test)]
mod tests;
