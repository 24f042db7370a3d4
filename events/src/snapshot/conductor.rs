//! The Conductor: reservations, transfer slots, policy hints. Its totals (grants, partial
//! grants, refusals, slots) are counts of its events (`counts`), so they cover what happens
//! before the first step too; `conductor_step` keeps the Conductor's own per-step figures.

use super::super::model::*;
use super::tally::ConductorCounts;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::Reservation {
            owner,
            mode,
            granted_bytes,
            outcome,
            reason,
            ..
        } => {
            // Totals, and by mode, priority and reason: counts (`counts`).
            let c = &mut s.conductor;
            if matches!(outcome, ReservationOutcome::Granted | ReservationOutcome::Partial) {
                c.active_reservations = c.active_reservations.saturating_add(1);
                c.active_bytes = c.active_bytes.saturating_add(*granted_bytes);
            }
            if let Some(r) = reason {
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
        }
        EventKind::ReservationReleased { bytes, .. } => {
            let c = &mut s.conductor;
            c.active_reservations = c.active_reservations.saturating_sub(1);
            c.active_bytes = c.active_bytes.saturating_sub(*bytes);
        }
        EventKind::SlotGranted { dir, inflight, .. } => set_inflight(&mut s.conductor, *dir, *inflight),
        EventKind::SlotReleased { dir, inflight, .. } => {
            set_inflight(&mut s.conductor, *dir, *inflight)
        }
        EventKind::SlotDenied {
            dir,
            owner,
            speculative,
            reason,
        } => {
            let c = &mut s.conductor;
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
        }
        EventKind::HintsChanged { hints, rule } => {
            let c = &mut s.conductor;
            c.hints = *hints;
            c.hints_rule = Some(*rule);
            c.hint_changes = c.hint_changes.saturating_add(1);
        }
        EventKind::ConductorStep(m) => {
            s.tallies.conductor.aggregate(e.step, &ConductorCounts::from(m));
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
