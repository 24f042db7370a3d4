//! Breakdowns by label (evictions by reason, each block's loads, the Conductor's requests by
//! mode and refusals by reason, kept tensors by reason, the pools' slabs by class): counted from
//! detail events with [`StepCounts::count`], and from a step's `step_counts` aggregate when the
//! file has no detail. The aggregate replaces the step's detail counts, as the [`tally`](super::tally)
//! does for totals, so both file levels reach the same figures.

use super::super::model::*;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::StepCounts(agg) => {
            if !agg.is_bounded() {
                return s.refuse(Refusal::UnboundedAggregate);
            }
            let replaced = s.tallies.counts.aggregate(e.step, agg);
            fold(s, agg, true);
            fold(s, &replaced, false);
            if let Some(end) = &agg.end {
                s.set_end_state(end);
            }
            refresh_pools(s);
        }
        // Detail of a step after its aggregate: in it, or in the next the bus adds for the step.
        _ if s.tallies.counts.is_closed(e.step) => {}
        _ => {
            let mut one = StepCounts::default();
            if one.count(e) {
                s.tallies.counts.detail(e.step).add(&one);
                fold(s, &one, true);
                if !one.pools.is_empty() {
                    refresh_pools(s);
                }
            }
        }
    }
}

/// Adds `c` to the views (or takes it away: the detail an aggregate replaces). Whole numbers
/// only, so adding a step's detail and later its aggregate less that detail is exact.
fn fold(s: &mut Snapshot, c: &StepCounts, add: bool) {
    let f = |x: &mut u64, n: u64| *x = if add { x.saturating_add(n) } else { x.saturating_sub(n) };
    let named = |m: &mut BTreeMap<String, u64>, key: String, n: u64| f(m.entry(key).or_insert(0), n);
    for (id, b) in &c.blocks {
        if let Some(i) = s.block_pos(*id) {
            f(&mut s.blocks[i].loads, b.loads);
            f(&mut s.blocks[i].evictions, b.evictions);
        }
    }
    let con = &mut s.conductor;
    // The Conductor's totals count its events (`conductor_step` repeats them per step, but has
    // none for what happens before the first step, such as the weights' room being reserved).
    f(&mut con.grants, c.reservations_with(ReservationOutcome::Granted));
    f(&mut con.partials, c.reservations_with(ReservationOutcome::Partial));
    f(&mut con.denials, c.reservations_with(ReservationOutcome::Denied));
    f(&mut con.slot_grants, c.slot_grants);
    f(&mut con.slot_denials, c.slot_denials.values().fold(0u64, |t, n| t.saturating_add(*n)));
    for (outcome, modes) in &c.reservations {
        for (mode, n) in modes {
            named(&mut con.by_mode, wire_name(mode), *n);
            if *outcome == ReservationOutcome::CapRecorded {
                f(&mut con.ceilings, *n);
            }
        }
    }
    for (p, n) in &c.priorities {
        named(&mut con.by_priority, wire_name(p), *n);
    }
    for (r, n) in c.reservation_denials.iter().chain(&c.slot_denials) {
        named(&mut con.denials_by_reason, r.as_str().to_owned(), *n);
    }
    let a = &mut s.activations;
    for (r, n) in &c.kept {
        named(&mut a.kept_by_reason, wire_name(r), *n);
    }
    if let Some(n) = c.packed.get(&PackDecision::Duplicate) {
        f(&mut a.duplicates, *n);
    }
    f(&mut a.finalized_inline, c.finalized_inline);
}

pub(super) fn pool_view(s: &mut Snapshot, pool: PoolKind) -> &mut PoolView {
    let slot = match pool {
        PoolKind::Weights => &mut s.weight_pool,
        PoolKind::Activations => &mut s.activation_pool,
    };
    slot.get_or_insert_with(PoolView::default)
}

/// The pools' counts are the tally's (finished steps plus the step in progress), not sums kept
/// in the view: a pool is configured again in the middle of a step (sized from what the first
/// step spilled), between that step's detail and its aggregate, and a view reset there would
/// differ between the file levels. Per class index, over the run.
pub(super) fn refresh_pools(s: &mut Snapshot) {
    for kind in [PoolKind::Weights, PoolKind::Activations] {
        let t = &s.tallies.counts;
        let (c, o) = (t.committed.pools.get(&kind), t.open.pools.get(&kind));
        if c.is_none() && o.is_none() {
            continue;
        }
        let (c, o) = (c.cloned().unwrap_or_default(), o.cloned().unwrap_or_default());
        let view = pool_view(s, kind);
        view.pageable_fallbacks = c.pageable_fallbacks.saturating_add(o.pageable_fallbacks);
        view.pageable_bytes = c.pageable_bytes.saturating_add(o.pageable_bytes);
        view.total_wait_ms = c.wait_ms + o.wait_ms;
        for (i, class) in view.classes.iter_mut().enumerate() {
            let at = |p: &PoolCount| p.classes.get(&(i as u32)).copied().unwrap_or_default();
            let (x, y) = (at(&c), at(&o));
            class.hits = x.acquired.saturating_add(y.acquired);
            class.exhausted = x.exhausted.saturating_add(y.exhausted);
        }
    }
}

impl Snapshot {
    /// The state a step leaves behind ([`StepEndState`]), as this snapshot has it.
    pub fn end_state(&self) -> StepEndState {
        let blocks = self
            .blocks
            .iter()
            .filter(|b| b.state != BlockState::Unloaded || b.refcount > 0 || b.protected)
            .map(|b| (b.id, BlockEnd { state: b.state, refcount: b.refcount, protected: b.protected }))
            .collect();
        let pool = |p: &Option<PoolView>| p.as_ref().map(|p| p.classes.iter().map(|c| (c.in_use, c.peak_in_use)).collect());
        let mut pools = BTreeMap::new();
        for (k, p) in [(PoolKind::Weights, &self.weight_pool), (PoolKind::Activations, &self.activation_pool)] {
            if let Some(classes) = pool(p) {
                pools.insert(k, classes);
            }
        }
        StepEndState {
            blocks,
            active_reservations: self.conductor.active_reservations,
            active_bytes: self.conductor.active_bytes,
            transfers_inflight: (self.transfers.h2d.inflight, self.transfers.d2h.inflight),
            slots_inflight: (self.conductor.h2d_inflight, self.conductor.d2h_inflight),
            pools,
            cursor: self.itinerary.cursor,
            backward: self.itinerary.backward,
            window: self.itinerary.window.clone(),
        }
    }

    /// Takes the state a step left behind (bounded like the events it stands for: unknown
    /// blocks and classes past a pool's are left out, a window past [`MAX_LIST`] refused).
    fn set_end_state(&mut self, end: &StepEndState) {
        for b in &mut self.blocks {
            let e = end.blocks.get(&b.id).copied().unwrap_or_default();
            b.state = e.state;
            b.refcount = e.refcount;
            b.protected = e.protected;
        }
        let mut counts = BTreeMap::new();
        for b in &self.blocks {
            *counts.entry(b.state).or_insert(0u32) += 1;
        }
        self.residency = counts;
        self.conductor.active_reservations = end.active_reservations;
        self.conductor.active_bytes = end.active_bytes;
        (self.transfers.h2d.inflight, self.transfers.d2h.inflight) = end.transfers_inflight;
        (self.conductor.h2d_inflight, self.conductor.d2h_inflight) = end.slots_inflight;
        for (k, classes) in &end.pools {
            let view = pool_view(self, *k);
            for (c, (in_use, peak)) in view.classes.iter_mut().zip(classes) {
                c.in_use = *in_use;
                c.peak_in_use = *peak;
            }
        }
        if end.window.len() > MAX_LIST {
            return self.refuse(Refusal::ListTooLong);
        }
        self.itinerary.cursor = end.cursor;
        self.itinerary.backward = end.backward;
        self.itinerary.window = end.window.clone();
    }
}
