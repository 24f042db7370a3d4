//! Weight blocks: registration, residency, prefetch and eviction, the itinerary, and the weight
//! runtime's totals.

use super::super::model::*;
use super::tally::WeightCounts;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    apply_event(s, e);
    if matches!(
        e.kind,
        EventKind::PrefetchHit { .. } | EventKind::PrefetchMiss { .. } | EventKind::Eviction { .. }
    ) {
        refresh(s);
    }
}

fn apply_event(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::BlockRegistered {
            block,
            name,
            bytes,
            exec_order,
            file_backed,
            trainable,
        } => {
            let view = BlockView {
                id: *block,
                name: clip(name),
                bytes: *bytes,
                exec_order: *exec_order,
                file_backed: *file_backed,
                trainable: *trainable,
                last: "registered".into(),
                last_seq: e.seq,
                ..Default::default()
            };
            register(s, view);
        }
        EventKind::ItineraryLearned { order } => {
            if order.len() > MAX_LIST {
                return s.refuse(Refusal::ListTooLong);
            }
            s.itinerary.order = order.clone();
        }
        EventKind::ItineraryChanged { order, .. } => {
            if order.len() > MAX_LIST {
                return s.refuse(Refusal::ListTooLong);
            }
            s.itinerary.order = order.clone();
            s.itinerary_changes = s.itinerary_changes.saturating_add(1);
        }
        EventKind::Residency {
            block,
            from,
            to,
            refcount,
        } => {
            let (to, refcount, seq) = (*to, *refcount, e.seq);
            let last = format!("{from} -> {to}");
            let Some(b) = block_mut(s, *block) else {
                return s.refuse(Refusal::UnknownBlock);
            };
            let old = b.state;
            b.state = to;
            b.refcount = refcount;
            b.last = last;
            b.last_seq = seq;
            count_state(s, old, -1);
            count_state(s, to, 1);
        }
        // An evaluation's uses belong to no training step: its own totals come in `evaluation`.
        EventKind::PrefetchHit { block } => {
            if e.phase != Phase::Eval {
                let t = tally(s, e.step);
                t.prefetch_hits = t.prefetch_hits.saturating_add(1);
            }
            mark(s, *block, e.seq, "prefetch hit".into());
        }
        EventKind::PrefetchMiss { block, stall_ms } => {
            if e.phase != Phase::Eval {
                let t = tally(s, e.step);
                t.prefetch_misses = t.prefetch_misses.saturating_add(1);
                t.stall_count = t.stall_count.saturating_add(1);
                t.stall_time_ms += stall_ms;
            }
            mark(s, *block, e.seq, format!("miss, stalled {stall_ms:.2} ms"));
        }
        EventKind::Eviction { block, reason, .. } => {
            // An evaluation's uses belong to no training step: its own totals come in
            // `evaluation`.
            if e.phase != Phase::Eval {
                let t = tally(s, e.step);
                t.evictions = t.evictions.saturating_add(1);
            }
            // The score is in the event (its details); the view keeps what fits a column.
            let last = format!("evicted: {}", wire_name(reason));
            mark(s, *block, e.seq, last);
        }
        EventKind::PrefetchWindow {
            cursor,
            backward,
            window,
        } => {
            if window.len() > MAX_LIST {
                return s.refuse(Refusal::ListTooLong);
            }
            s.itinerary.cursor = *cursor;
            s.itinerary.backward = *backward;
            s.itinerary.window = window.clone();
        }
        EventKind::Protection { block, protected } => match block_mut(s, *block) {
            Some(b) => b.protected = *protected,
            None => s.refuse(Refusal::UnknownBlock),
        },
        EventKind::WeightStep(m) => {
            s.tallies.weights.aggregate(e.step, &WeightCounts::from(m));
            refresh(s);
            s.weights.last_step = Some(m.clone());
            s.step_record_mut(e.step).weights = Some(m.clone());
        }
        _ => {}
    }
}

/// Adds (or replaces) a block: O(log n) whatever the order of ids.
fn register(s: &mut Snapshot, view: BlockView) {
    match s.block_pos(view.id) {
        Some(i) => {
            let old = s.blocks[i].state;
            count_state(s, old, -1);
            s.blocks[i] = view;
        }
        None => {
            if s.blocks.len() >= MAX_BLOCKS {
                return s.refuse(Refusal::TooManyBlocks);
            }
            s.push_block(view);
        }
    }
    count_state(s, BlockState::Unloaded, 1);
}

fn block_mut(s: &mut Snapshot, id: BlockId) -> Option<&mut BlockView> {
    let i = s.block_pos(id)?;
    Some(&mut s.blocks[i])
}

/// Records what happened to a block last (an unknown block is refused and counted).
fn mark(s: &mut Snapshot, id: BlockId, seq: u64, last: String) {
    match block_mut(s, id) {
        Some(b) => {
            b.last = last;
            b.last_seq = seq;
        }
        None => s.refuse(Refusal::UnknownBlock),
    }
}

fn count_state(s: &mut Snapshot, state: BlockState, delta: i32) {
    let n = s.residency.entry(state).or_insert(0);
    *n = if delta < 0 { n.saturating_sub(1) } else { n.saturating_add(1) };
    if *n == 0 {
        s.residency.remove(&state);
    }
}

/// The open detail counts of `step` (the displayed totals follow through [`refresh`]).
pub(super) fn tally(s: &mut Snapshot, step: u64) -> &mut WeightCounts {
    s.tallies.weights.detail(step)
}

/// Copies the tally's total into the displayed totals.
pub(super) fn refresh(s: &mut Snapshot) {
    let t = s.tallies.weights.total();
    let w = &mut s.weights;
    w.prefetch_hits = t.prefetch_hits;
    w.prefetch_misses = t.prefetch_misses;
    w.stall_count = t.stall_count;
    w.stall_time_ms = t.stall_time_ms;
    w.evictions = t.evictions;
    w.h2d_bytes = t.h2d_bytes;
    w.d2h_bytes = t.d2h_bytes;
}
