//! VRAM and pinned host budgets.
//!
//! `available = cap - (measured use + outstanding grants)`, where the cap is the soft cap for
//! HARD, SOFT and FLOOR and the hard cap for BURST (pinned memory has one cap and no measured
//! use: only grants count). Below CRITICAL each priority keeps back a reserve for the levels
//! above it (`priority_reserve_mb` times 1, 2, 3 for REQUIRED, SPECULATIVE, BACKGROUND), so
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
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Soft cap 1000 MiB, hard cap 1200 MiB, pinned 500 MiB, reserve unit 10 MiB.
    fn budget() -> BudgetManager {
        let config = ConductorConfig::builder()
            .vram_soft_cap_mb(1000)
            .vram_hard_cap_mb(1200)
            .pinned_cap_mb(500)
            .priority_reserve_mb(10)
            .build()
            .expect("valid");
        BudgetManager::new(&config)
    }

    fn vram(bytes: u64, mode: ReservationMode, priority: Priority) -> ReservationRequest {
        ReservationRequest::new(Owner::Weights, Resource::Vram, bytes)
            .mode(mode)
            .priority(priority)
    }

    #[test]
    fn hard_is_all_or_nothing_under_the_soft_cap() {
        let mut b = budget();
        let ok = b.request(&vram(500 * MIB, ReservationMode::Hard, Priority::Critical), 400 * MIB);
        assert_eq!((ok.outcome, ok.granted_bytes), (ReservationOutcome::Granted, 500 * MIB));
        let no = b.request(&vram(200 * MIB, ReservationMode::Hard, Priority::Critical), 400 * MIB);
        assert_eq!(no.outcome, ReservationOutcome::Denied);
        assert_eq!(no.reason, Some(DenyReason::InsufficientHeadroom));
        assert_eq!(no.granted_bytes, 0);
        assert_eq!(no.id, None);
        assert_eq!(b.counts(), BudgetCounts { grants: 1, partials: 0, denials: 1 });
    }

    #[test]
    fn soft_grants_what_is_available() {
        let mut b = budget();
        let d = b.request(&vram(300 * MIB, ReservationMode::Soft, Priority::Critical), 800 * MIB);
        assert_eq!(d.outcome, ReservationOutcome::Partial);
        assert_eq!(d.granted_bytes, 200 * MIB);
        assert_eq!(b.outstanding(Resource::Vram), 200 * MIB);
        let none = b.request(&vram(MIB, ReservationMode::Soft, Priority::Critical), 800 * MIB);
        assert_eq!(none.reason, Some(DenyReason::InsufficientHeadroom));
        assert_eq!(b.counts(), BudgetCounts { grants: 0, partials: 1, denials: 1 });
    }

    #[test]
    fn burst_may_pass_the_soft_cap_up_to_the_hard_cap() {
        let mut b = budget();
        let hard = b.request(&vram(150 * MIB, ReservationMode::Hard, Priority::Critical), 950 * MIB);
        assert_eq!(hard.outcome, ReservationOutcome::Denied);
        let burst =
            b.request(&vram(150 * MIB, ReservationMode::Burst, Priority::Critical), 950 * MIB);
        assert_eq!(burst.outcome, ReservationOutcome::Granted);
        let over =
            b.request(&vram(150 * MIB, ReservationMode::Burst, Priority::Critical), 950 * MIB);
        assert_eq!(over.reason, Some(DenyReason::InsufficientHeadroom), "hard cap reached");
    }

    #[test]
    fn floor_is_all_or_nothing_and_ignores_the_priority_reserve() {
        let mut b = budget();
        // 25 MiB left: a BACKGROUND hard request must leave 30 MiB, a floor need not.
        let hard = b.request(
            &vram(20 * MIB, ReservationMode::Hard, Priority::Background),
            975 * MIB,
        );
        assert_eq!(hard.reason, Some(DenyReason::PriorityReserve));
        let floor = b.request(
            &vram(20 * MIB, ReservationMode::Floor, Priority::Background),
            975 * MIB,
        );
        assert_eq!(floor.outcome, ReservationOutcome::Granted);
        let floor2 = b.request(
            &vram(20 * MIB, ReservationMode::Floor, Priority::Background),
            975 * MIB,
        );
        assert_eq!(floor2.reason, Some(DenyReason::InsufficientHeadroom), "no partial");
        assert_eq!(floor2.granted_bytes, 0);
    }

    #[test]
    fn ceiling_records_a_cap_and_grants_nothing() {
        let mut b = budget();
        let c = b.request(
            &ReservationRequest::new(Owner::Activations, Resource::PinnedHost, 100 * MIB)
                .mode(ReservationMode::Ceiling),
            0,
        );
        assert_eq!((c.outcome, c.granted_bytes), (ReservationOutcome::CapRecorded, 0));
        assert_eq!(b.outstanding(Resource::PinnedHost), 0);
        let pinned = |bytes, mode| {
            ReservationRequest::new(Owner::Activations, Resource::PinnedHost, bytes)
                .mode(mode)
                .priority(Priority::Critical)
        };
        let over = b.request(&pinned(150 * MIB, ReservationMode::Hard), 0);
        assert_eq!(over.reason, Some(DenyReason::OverCeiling));
        let soft = b.request(&pinned(150 * MIB, ReservationMode::Soft), 0);
        assert_eq!((soft.outcome, soft.granted_bytes), (ReservationOutcome::Partial, 100 * MIB));
        let more = b.request(&pinned(MIB, ReservationMode::Soft), 0);
        assert_eq!(more.reason, Some(DenyReason::OverCeiling));
        // Another owner is not bound by the activations' ceiling.
        let other = b.request(
            &ReservationRequest::new(Owner::Weights, Resource::PinnedHost, 150 * MIB)
                .priority(Priority::Critical),
            0,
        );
        assert_eq!(other.outcome, ReservationOutcome::Granted);
    }

    #[test]
    fn lower_priorities_are_denied_first_as_headroom_shrinks() {
        // 25 MiB of headroom, 10 MiB requests, reserve unit 10 MiB:
        // CRITICAL keeps back 0, REQUIRED 10, SPECULATIVE 20, BACKGROUND 30.
        let order = [
            Priority::Critical,
            Priority::Required,
            Priority::Speculative,
            Priority::Background,
        ];
        let granted: Vec<bool> = order
            .iter()
            .map(|p| {
                let mut b = budget();
                b.request(&vram(10 * MIB, ReservationMode::Hard, *p), 975 * MIB)
                    .is_granted()
            })
            .collect();
        assert_eq!(granted, vec![true, true, false, false]);
        // The order of the enum is the order of precedence.
        assert!(Priority::Critical < Priority::Required);
        assert!(Priority::Speculative < Priority::Background);
        let mut b = budget();
        let d = b.request(&vram(10 * MIB, ReservationMode::Hard, Priority::Speculative), 975 * MIB);
        assert_eq!(d.reason, Some(DenyReason::PriorityReserve));
        // SOFT at SPECULATIVE gets what is left above its reserve.
        let s = b.request(&vram(10 * MIB, ReservationMode::Soft, Priority::Speculative), 975 * MIB);
        assert_eq!((s.outcome, s.granted_bytes), (ReservationOutcome::Partial, 5 * MIB));
    }

    #[test]
    fn phase_scoped_reservations_end_with_their_phase() {
        let mut b = budget();
        let fwd = b.request(
            &vram(10 * MIB, ReservationMode::Hard, Priority::Required).scoped_to(Phase::Forward),
            0,
        );
        let step = b.request(&vram(20 * MIB, ReservationMode::Hard, Priority::Required), 0);
        assert_eq!(b.end_phase(Phase::Backward), vec![]);
        let released = b.end_phase(Phase::Forward);
        assert_eq!(released, vec![(fwd.id.expect("held"), 10 * MIB)]);
        assert_eq!(b.outstanding(Resource::Vram), 20 * MIB);
        assert_eq!(b.release(fwd.id.expect("held")), None, "already released");
        assert_eq!(b.release(step.id.expect("held")), Some(20 * MIB));
        assert_eq!(b.held_count(), 0);
    }

    #[test]
    fn outstanding_grants_and_measured_use_both_count() {
        let mut b = budget();
        assert_eq!(b.headroom(Resource::Vram, 600 * MIB), 400 * MIB);
        b.request(&vram(100 * MIB, ReservationMode::Hard, Priority::Critical), 600 * MIB);
        assert_eq!(b.headroom(Resource::Vram, 600 * MIB), 300 * MIB);
        assert_eq!(b.headroom(Resource::PinnedHost, 600 * MIB), 500 * MIB);
        assert_eq!(b.release_all().len(), 1);
        assert_eq!(b.headroom(Resource::Vram, 600 * MIB), 400 * MIB);
    }
}
