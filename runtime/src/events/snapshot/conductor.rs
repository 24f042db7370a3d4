//! The Conductor: reservations, transfer slots, policy hints, and their totals.

use super::super::model::*;
use super::tally::ConductorCounts;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::Reservation {
            owner,
            mode,
            priority,
            granted_bytes,
            outcome,
            reason,
            ..
        } => {
            let t = s.tallies.conductor.detail(e.step);
            match outcome {
                ReservationOutcome::Granted => t.grants = t.grants.saturating_add(1),
                ReservationOutcome::Partial => t.partials = t.partials.saturating_add(1),
                ReservationOutcome::Denied => t.denials = t.denials.saturating_add(1),
                ReservationOutcome::CapRecorded => {}
            }
            let c = &mut s.conductor;
            bump(&mut c.by_mode, &wire_name(mode));
            bump(&mut c.by_priority, &wire_name(priority));
            if *outcome == ReservationOutcome::CapRecorded {
                c.ceilings = c.ceilings.saturating_add(1);
            }
            if matches!(outcome, ReservationOutcome::Granted | ReservationOutcome::Partial) {
                c.active_reservations = c.active_reservations.saturating_add(1);
                c.active_bytes = c.active_bytes.saturating_add(*granted_bytes);
            }
            if let Some(r) = reason {
                bump(&mut c.denials_by_reason, r.as_str());
                push_bounded(
                    &mut c.recent_denials,
                    DenialRecord {
                        seq: e.seq,
                        step: e.step,
                        phase: e.phase,
                        owner: *owner,
                        what: format!("{} reservation", wire_name(mode)),
                        reason: *r,
                    },
                    RECENT_DENIALS,
                );
            }
            refresh(s);
        }
        EventKind::ReservationReleased { bytes, .. } => {
            let c = &mut s.conductor;
            c.active_reservations = c.active_reservations.saturating_sub(1);
            c.active_bytes = c.active_bytes.saturating_sub(*bytes);
        }
        EventKind::SlotGranted { dir, inflight, .. } => {
            let t = s.tallies.conductor.detail(e.step);
            t.slot_grants = t.slot_grants.saturating_add(1);
            set_inflight(&mut s.conductor, *dir, *inflight);
            refresh(s);
        }
        EventKind::SlotReleased { dir, inflight, .. } => {
            set_inflight(&mut s.conductor, *dir, *inflight)
        }
        EventKind::SlotDenied {
            dir,
            owner,
            speculative,
            reason,
        } => {
            let t = s.tallies.conductor.detail(e.step);
            t.slot_denials = t.slot_denials.saturating_add(1);
            let c = &mut s.conductor;
            bump(&mut c.denials_by_reason, reason.as_str());
            push_bounded(
                &mut c.recent_denials,
                DenialRecord {
                    seq: e.seq,
                    step: e.step,
                    phase: e.phase,
                    owner: *owner,
                    what: format!(
                        "{} slot{}",
                        dir.as_str(),
                        if *speculative { " (speculative)" } else { "" }
                    ),
                    reason: *reason,
                },
                RECENT_DENIALS,
            );
            refresh(s);
        }
        EventKind::HintsChanged { hints, rule } => {
            let c = &mut s.conductor;
            c.hints = *hints;
            c.hints_rule = Some(*rule);
            c.hint_changes = c.hint_changes.saturating_add(1);
        }
        EventKind::ConductorStep(m) => {
            s.tallies.conductor.aggregate(e.step, &ConductorCounts::from(m));
            refresh(s);
            s.conductor.last_step = Some(m.clone());
            s.step_record_mut(e.step).conductor = Some(m.clone());
        }
        _ => {}
    }
}

fn set_inflight(c: &mut ConductorView, dir: Direction, inflight: u32) {
    match dir {
        Direction::H2d => c.h2d_inflight = inflight,
        Direction::D2h => c.d2h_inflight = inflight,
        // Collectives take no transfer slot.
        Direction::Collective => {}
    }
}

fn refresh(s: &mut Snapshot) {
    let t = s.tallies.conductor.total();
    let c = &mut s.conductor;
    c.grants = t.grants;
    c.partials = t.partials;
    c.denials = t.denials;
    c.slot_grants = t.slot_grants;
    c.slot_denials = t.slot_denials;
}
