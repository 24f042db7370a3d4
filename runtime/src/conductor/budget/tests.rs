use super::*;

const MIB: u64 = 1 << 20;

/// Soft cap 1000 MiB, hard cap 1200 MiB, pinned 500 MiB, reserve unit 10 MiB.
fn budget() -> BudgetManager {
    let config = ConductorConfig::builder()
        .vram_soft_cap_mib(1000)
        .vram_hard_cap_mib(1200)
        .pinned_cap_mib(500)
        .priority_reserve_mib(10)
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
