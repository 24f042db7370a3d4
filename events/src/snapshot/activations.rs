//! Saved activations: what the pack hook decided, spills, restores, and their totals.

use super::super::model::*;
use super::tally::ActivationCounts;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::Pack {
            decision,
            bytes,
            pool_hit,
            ..
        } => {
            let t = s.tallies.activations.detail(e.step);
            t.saved = t.saved.saturating_add(1);
            match decision {
                PackDecision::Kept => t.kept = t.kept.saturating_add(1),
                PackDecision::Spilled => {
                    t.spilled = t.spilled.saturating_add(1);
                    t.spill_bytes = t.spill_bytes.saturating_add(*bytes);
                    match pool_hit {
                        Some(true) => t.pool_hits = t.pool_hits.saturating_add(1),
                        Some(false) => t.pool_misses = t.pool_misses.saturating_add(1),
                        None => {}
                    }
                }
                PackDecision::WeightHandle => t.weight_handles = t.weight_handles.saturating_add(1),
                PackDecision::Recomputed => {
                    t.recomputed = t.recomputed.saturating_add(1);
                    t.recompute_bytes = t.recompute_bytes.saturating_add(*bytes);
                }
                PackDecision::Duplicate => {}
            }
            // Kept by reason and duplicates: counts (`counts`).
            refresh(s);
        }
        EventKind::Restored {
            bytes,
            predicted,
            stall_ms,
            ..
        } => {
            let t = s.tallies.activations.detail(e.step);
            t.restored = t.restored.saturating_add(1);
            t.restore_bytes = t.restore_bytes.saturating_add(*bytes);
            if *predicted {
                t.predicted = t.predicted.saturating_add(1);
            }
            if *stall_ms > 0.0 {
                t.stall_count = t.stall_count.saturating_add(1);
                t.stall_time_ms += stall_ms;
            }
            refresh(s);
        }
        EventKind::SpillingToggled { on, .. } => s.activations.spilling = *on,
        EventKind::ActivationStep(m) => {
            s.tallies.activations.aggregate(e.step, &ActivationCounts::from(m));
            refresh(s);
            s.activations.last_step = Some(m.clone());
            s.step_record_mut(e.step).activations = Some(m.clone());
        }
        _ => {}
    }
}

fn refresh(s: &mut Snapshot) {
    s.activations.counts = s.tallies.activations.total();
}
