//! Device memory: readings, each owner's limits, memory by owner, and out-of-memory reports.

use super::super::model::*;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::VramSample {
            allocated_bytes,
            reserved_bytes,
            peak_allocated_bytes,
        } => {
            let r = VramReading {
                t_ns: e.t_ns,
                allocated_bytes: *allocated_bytes,
                reserved_bytes: *reserved_bytes,
                peak_allocated_bytes: *peak_allocated_bytes,
            };
            s.vram = Some(r);
            s.vram_peak_bytes = s.vram_peak_bytes.max(*peak_allocated_bytes).max(*allocated_bytes);
            push_bounded(&mut s.vram_history, r, VRAM_HISTORY);
        }
        EventKind::WatermarksMoved {
            from_high_bytes,
            from_low_bytes,
            high_bytes,
            low_bytes,
            reason,
        } => {
            s.watermark_moves = s.watermark_moves.saturating_add(1);
            s.last_watermark_move = Some(WatermarkMove {
                step: e.step,
                from_high_bytes: *from_high_bytes,
                from_low_bytes: *from_low_bytes,
                high_bytes: *high_bytes,
                low_bytes: *low_bytes,
                reason: clip(reason),
            });
        }
        EventKind::LimitsSet {
            owner,
            budget_bytes,
            high_watermark_bytes,
            low_watermark_bytes,
        } => {
            s.limits.insert(
                *owner,
                OwnerLimits {
                    budget_bytes: *budget_bytes,
                    high_watermark_bytes: *high_watermark_bytes,
                    low_watermark_bytes: *low_watermark_bytes,
                },
            );
        }
        EventKind::VramOwners(o) => {
            let r = OwnersReading {
                t_ns: e.t_ns,
                step: e.step,
                phase: e.phase,
                owners: *o,
            };
            s.vram_owners = Some(r);
            push_bounded(&mut s.vram_owners_history, r, OWNERS_HISTORY);
            if e.step > 0 {
                let rec = s.step_record_mut(e.step);
                // The first reading at the step's largest allocation.
                if rec.vram_at_peak.is_none_or(|p| o.allocated_bytes > p.allocated_bytes) {
                    rec.vram_at_peak = Some(*o);
                }
            }
        }
        EventKind::OutOfMemory {
            requested_bytes,
            owners,
            doing,
            dump,
            ..
        } => push_bounded(
            &mut s.out_of_memory,
            OomRecord {
                seq: e.seq,
                step: e.step,
                phase: e.phase,
                requested_bytes: *requested_bytes,
                owners: *owners,
                doing: clip(doing),
                dump: dump.as_deref().map(clip),
            },
            RECENT_INCIDENTS,
        ),
        _ => {}
    }
}
