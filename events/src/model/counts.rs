//! A step's detail events counted by label ([`StepCounts`]), and the distributions of their
//! durations ([`Buckets`]).
//!
//! The views and the exporters break totals down by label (evictions by reason, copies by
//! direction and owner, the Conductor's refusals by reason, ...) and keep histograms of copy and
//! stall durations. A summary-level file has no detail events, so the bus counts each step's
//! into one `step_counts` aggregate when the step closes, with the same [`StepCounts::count`]
//! the snapshot applies to detail events: a replay of either file level, and the live run, reach
//! the same breakdowns and the same histograms.

use super::{
    BlockId, BlockState, DenyReason, Direction, Event, EventKind, EvictionReason, KeepReason, Owner, PackDecision,
    PoolKind, Priority, ReservationMode, ReservationOutcome,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Upper bounds of the buckets for copy durations, in seconds: 20 µs to 2 s.
pub const COPY_SECONDS_BOUNDS: &[f64] = &[
    2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.0,
];
/// Upper bounds of the buckets for stalls of the compute stream, in seconds: 10 µs to 1 s.
pub const STALL_SECONDS_BOUNDS: &[f64] = &[1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0];

/// Observations one [`StepCounts`] may hold in all its distributions; a snapshot refuses an
/// aggregate with more (a file someone else wrote), so nothing downstream loops over them
/// unbounded. A real step holds a few thousand.
pub const MAX_STEP_OBSERVATIONS: u64 = 1 << 22;

/// A distribution over fixed bucket bounds (Prometheus' `le` buckets: a value lands in the first
/// bucket whose bound is at least the value, past the last one in the overflow bucket). Each
/// bucket keeps its count and the sum of its values, so the exporters can record a bucket's
/// values again without holding them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Buckets {
    /// Values in each bucket, one more than the bounds (the last for values past every bound).
    pub counts: Vec<u64>,
    /// The sum of the values in each bucket.
    pub sums: Vec<f64>,
}

impl Buckets {
    /// Records `v` (finite, not negative; anything else is not a duration and is left out).
    pub fn record(&mut self, bounds: &[f64], v: f64) {
        if !(v.is_finite() && v >= 0.0) {
            return;
        }
        self.fit(bounds);
        let i = bounds.iter().position(|b| v <= *b).unwrap_or(bounds.len());
        self.counts[i] = self.counts[i].saturating_add(1);
        self.sums[i] += v;
    }

    fn fit(&mut self, bounds: &[f64]) {
        if self.counts.len() != bounds.len() + 1 {
            self.counts.resize(bounds.len() + 1, 0);
        }
        if self.sums.len() != bounds.len() + 1 {
            self.sums.resize(bounds.len() + 1, 0.0);
        }
    }

    /// Whether the buckets match `bounds` (a file may say anything).
    pub fn fits(&self, bounds: &[f64]) -> bool {
        self.counts.len() == bounds.len() + 1 && self.sums.len() == bounds.len() + 1
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().fold(0u64, |t, n| t.saturating_add(*n))
    }

    /// Adds `o` into `self`.
    pub fn add(&mut self, bounds: &[f64], o: &Buckets) {
        if o.counts.is_empty() {
            return;
        }
        self.fit(bounds);
        for (i, (n, s)) in o.counts.iter().zip(&o.sums).enumerate().take(bounds.len() + 1) {
            self.counts[i] = self.counts[i].saturating_add(*n);
            self.sums[i] += s;
        }
    }

    /// Each non-empty bucket as (count, a value that stands for its values): their mean,
    /// within the bucket's bounds (rounding can put a mean of values on a bound past it), so
    /// recording it `count` times fills the same bucket with the same sum.
    pub fn representatives<'a>(&'a self, bounds: &'a [f64]) -> impl Iterator<Item = (u64, f64)> + 'a {
        self.counts.iter().zip(&self.sums).enumerate().filter(|(_, (n, _))| **n > 0).map(move |(i, (n, s))| {
            let lo = if i == 0 { f64::NEG_INFINITY } else { bounds.get(i - 1).copied().unwrap_or(f64::INFINITY) };
            let hi = bounds.get(i).copied().unwrap_or(f64::INFINITY);
            let mean = s / *n as f64;
            let v = if mean > lo && mean <= hi {
                mean
            } else if hi.is_finite() {
                hi
            } else {
                lo.max(0.0) * 2.0 + 1.0
            };
            (*n, v)
        })
    }
}

/// Completed copies of one direction and owner.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CopyCount {
    pub count: u64,
    pub bytes: u64,
}

/// One size class of a pinned pool: slabs taken and requests that found none.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClassCount {
    pub acquired: u64,
    pub exhausted: u64,
}

/// One pinned pool's slabs taken and missed by class, and what went to pageable memory.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PoolCount {
    /// By class index (as `[class, counts]` pairs on the wire).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty", with = "pairs")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Vec<serde_json::Value>>))]
    pub classes: BTreeMap<u32, ClassCount>,
    #[serde(default)]
    pub pageable_fallbacks: u64,
    #[serde(default)]
    pub pageable_bytes: u64,
    /// Milliseconds spent waiting for a slab.
    #[serde(default)]
    pub wait_ms: f64,
}

/// One block's loads (arrivals on the device) and evictions.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BlockCount {
    #[serde(default)]
    pub loads: u64,
    #[serde(default)]
    pub evictions: u64,
}

/// One step's detail events, counted by label ([`EventKind::StepCounts`]). Only what is not in
/// a runtime's own per-step aggregate: the totals (prefetch hits, spilled tensors, ...) come from
/// `weight_step`, `activation_step`, `conductor_step` and `transfer_step`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct StepCounts {
    /// Evictions by reason.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub evictions: BTreeMap<EvictionReason, u64>,
    /// Each block's loads and evictions (blocks with none are absent; as `[block, counts]`
    /// pairs on the wire).
    #[serde(skip_serializing_if = "BTreeMap::is_empty", with = "pairs")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Vec<serde_json::Value>>))]
    pub blocks: BTreeMap<BlockId, BlockCount>,
    /// Completed copies by direction, then owner.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub copies: BTreeMap<Direction, BTreeMap<Owner, CopyCount>>,
    /// Durations of the timed copies by direction, in seconds ([`COPY_SECONDS_BOUNDS`]).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub copy_seconds: BTreeMap<Direction, Buckets>,
    /// The compute stream's stalls by what it waited for (`weights`: a block not prefetched;
    /// `activations`: a restore), in seconds ([`STALL_SECONDS_BOUNDS`]).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub stall_seconds: BTreeMap<Owner, Buckets>,
    /// Saved tensors by the pack hook's decision.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub packed: BTreeMap<PackDecision, u64>,
    /// Kept saved tensors by why they were kept.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kept: BTreeMap<KeepReason, u64>,
    /// Spills whose copy the training thread waited for at once (over the in-flight caps).
    #[serde(skip_serializing_if = "is_zero")]
    pub finalized_inline: u64,
    /// The pinned pools.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub pools: BTreeMap<PoolKind, PoolCount>,
    /// Reservation requests by outcome, then mode.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub reservations: BTreeMap<ReservationOutcome, BTreeMap<ReservationMode, u64>>,
    /// Reservation requests by priority.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub priorities: BTreeMap<Priority, u64>,
    /// Reservations refused, by reason.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub reservation_denials: BTreeMap<DenyReason, u64>,
    /// Transfer slots refused, by reason.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub slot_denials: BTreeMap<DenyReason, u64>,
    /// Transfer slots granted.
    #[serde(skip_serializing_if = "is_zero")]
    pub slot_grants: u64,
    /// What the step left behind when it closed (not a count: it is not summed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub end: Option<StepEndState>,
}

/// The runtimes' state when a step closed: where each block is, what is reserved, what is in
/// flight, what the pools hold, where the prefetcher is. A summary file keeps no detail
/// events, so its replay takes this state at each step's close; live, it is the state the
/// views already have.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct StepEndState {
    /// Blocks not unloaded, or protected, or in use (as `[block, state]` pairs on the wire).
    #[serde(with = "pairs")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Vec<serde_json::Value>>))]
    pub blocks: BTreeMap<BlockId, BlockEnd>,
    pub active_reservations: u64,
    pub active_bytes: u64,
    /// Copies issued and not completed, host-to-device then device-to-host.
    pub transfers_inflight: (u32, u32),
    /// The Conductor's transfer slots in use, host-to-device then device-to-host.
    pub slots_inflight: (u32, u32),
    /// Each pool's classes: slabs in use and the most in use at once.
    pub pools: BTreeMap<PoolKind, Vec<(u32, u32)>>,
    pub cursor: u32,
    pub backward: bool,
    pub window: Vec<BlockId>,
}

/// One block when a step closed.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BlockEnd {
    pub state: BlockState,
    #[serde(default)]
    pub refcount: u32,
    #[serde(default)]
    pub protected: bool,
}

/// A map keyed by numbers, as a list of `[key, value]` pairs: an event's fields pass through
/// serde's buffering (the envelope flattens the kind), where a JSON object's keys stay strings
/// and no longer read as numbers.
mod pairs {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer, K: Serialize, V: Serialize>(m: &BTreeMap<K, V>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter())
    }

    pub fn deserialize<'de, D, K, V>(d: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        D: Deserializer<'de>,
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
    {
        Ok(Vec::<(K, V)>::deserialize(d)?.into_iter().collect())
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn bump<K: Ord>(m: &mut BTreeMap<K, u64>, k: K, by: u64) {
    let n = m.entry(k).or_insert(0);
    *n = n.saturating_add(by);
}

fn add_map<K: Ord + Copy>(into: &mut BTreeMap<K, u64>, from: &BTreeMap<K, u64>) {
    for (k, n) in from {
        bump(into, *k, *n);
    }
}

impl StepCounts {
    /// Counts `e` if it is a detail event these counts keep; returns whether it was.
    pub fn count(&mut self, e: &Event) -> bool {
        match &e.kind {
            EventKind::Residency { block, to: BlockState::GpuReady, .. } => {
                let b = self.blocks.entry(*block).or_default();
                b.loads = b.loads.saturating_add(1);
            }
            EventKind::Eviction { block, reason, .. } => {
                bump(&mut self.evictions, *reason, 1);
                let b = self.blocks.entry(*block).or_default();
                b.evictions = b.evictions.saturating_add(1);
            }
            EventKind::PrefetchMiss { stall_ms, .. } => {
                self.stall_seconds.entry(Owner::Weights).or_default().record(STALL_SECONDS_BOUNDS, stall_ms.max(0.0) / 1e3);
            }
            EventKind::Restored { stall_ms, .. } => {
                // Only restores the compute stream waited for (NaN included in "not").
                if *stall_ms <= 0.0 || stall_ms.is_nan() {
                    return false;
                }
                self.stall_seconds.entry(Owner::Activations).or_default().record(STALL_SECONDS_BOUNDS, stall_ms / 1e3);
            }
            EventKind::TransferCompleted { dir, owner, bytes, duration_ms, .. } => {
                let c = self.copies.entry(*dir).or_default().entry(*owner).or_default();
                c.count = c.count.saturating_add(1);
                c.bytes = c.bytes.saturating_add(*bytes);
                // Only timed copies carry a duration (see `TransferCompleted`).
                if let Some(ms) = duration_ms {
                    self.copy_seconds.entry(*dir).or_default().record(COPY_SECONDS_BOUNDS, ms / 1e3);
                }
            }
            EventKind::Pack { decision, reason, .. } => {
                bump(&mut self.packed, *decision, 1);
                if let (PackDecision::Kept, Some(r)) = (decision, reason) {
                    bump(&mut self.kept, *r, 1);
                }
            }
            EventKind::SpillFinalized { inline: true, .. } => {
                self.finalized_inline = self.finalized_inline.saturating_add(1);
            }
            EventKind::SlabAcquired { pool, class, waited_ms, .. } => {
                let p = self.pools.entry(*pool).or_default();
                let c = p.classes.entry(*class).or_default();
                c.acquired = c.acquired.saturating_add(1);
                if waited_ms.is_finite() {
                    p.wait_ms += waited_ms;
                }
            }
            EventKind::PoolExhausted { pool, class, .. } => {
                let c = self.pools.entry(*pool).or_default().classes.entry(*class).or_default();
                c.exhausted = c.exhausted.saturating_add(1);
            }
            EventKind::PageableFallback { pool, bytes } => {
                let p = self.pools.entry(*pool).or_default();
                p.pageable_fallbacks = p.pageable_fallbacks.saturating_add(1);
                p.pageable_bytes = p.pageable_bytes.saturating_add(*bytes);
            }
            EventKind::Reservation { mode, priority, outcome, reason, .. } => {
                bump(self.reservations.entry(*outcome).or_default(), *mode, 1);
                bump(&mut self.priorities, *priority, 1);
                if let Some(r) = reason {
                    bump(&mut self.reservation_denials, *r, 1);
                }
            }
            EventKind::SlotDenied { reason, .. } => bump(&mut self.slot_denials, *reason, 1),
            EventKind::SlotGranted { .. } => self.slot_grants = self.slot_grants.saturating_add(1),
            _ => return false,
        }
        true
    }

    /// Whether [`count`](Self::count) counts `e` (without counting it).
    pub fn counts(e: &Event) -> bool {
        match &e.kind {
            EventKind::Restored { stall_ms, .. } => *stall_ms > 0.0,
            EventKind::Residency { to, .. } => *to == BlockState::GpuReady,
            EventKind::SpillFinalized { inline, .. } => *inline,
            EventKind::Eviction { .. }
            | EventKind::PrefetchMiss { .. }
            | EventKind::TransferCompleted { .. }
            | EventKind::Pack { .. }
            | EventKind::SlabAcquired { .. }
            | EventKind::PoolExhausted { .. }
            | EventKind::PageableFallback { .. }
            | EventKind::Reservation { .. }
            | EventKind::SlotDenied { .. }
            | EventKind::SlotGranted { .. } => true,
            _ => false,
        }
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        StepCounts { end: None, ..self.clone() } == StepCounts::default()
    }

    /// Adds `o` into `self` (saturating: the numbers may come from a hostile file).
    pub fn add(&mut self, o: &StepCounts) {
        add_map(&mut self.evictions, &o.evictions);
        for (b, c) in &o.blocks {
            let e = self.blocks.entry(*b).or_default();
            e.loads = e.loads.saturating_add(c.loads);
            e.evictions = e.evictions.saturating_add(c.evictions);
        }
        for (d, owners) in &o.copies {
            let into = self.copies.entry(*d).or_default();
            for (owner, c) in owners {
                let e = into.entry(*owner).or_default();
                e.count = e.count.saturating_add(c.count);
                e.bytes = e.bytes.saturating_add(c.bytes);
            }
        }
        for (d, b) in &o.copy_seconds {
            self.copy_seconds.entry(*d).or_default().add(COPY_SECONDS_BOUNDS, b);
        }
        for (src, b) in &o.stall_seconds {
            self.stall_seconds.entry(*src).or_default().add(STALL_SECONDS_BOUNDS, b);
        }
        add_map(&mut self.packed, &o.packed);
        add_map(&mut self.kept, &o.kept);
        self.finalized_inline = self.finalized_inline.saturating_add(o.finalized_inline);
        for (k, p) in &o.pools {
            let e = self.pools.entry(*k).or_default();
            for (class, c) in &p.classes {
                let x = e.classes.entry(*class).or_default();
                x.acquired = x.acquired.saturating_add(c.acquired);
                x.exhausted = x.exhausted.saturating_add(c.exhausted);
            }
            e.pageable_fallbacks = e.pageable_fallbacks.saturating_add(p.pageable_fallbacks);
            e.pageable_bytes = e.pageable_bytes.saturating_add(p.pageable_bytes);
            e.wait_ms += p.wait_ms;
        }
        for (oc, modes) in &o.reservations {
            add_map(self.reservations.entry(*oc).or_default(), modes);
        }
        add_map(&mut self.priorities, &o.priorities);
        add_map(&mut self.reservation_denials, &o.reservation_denials);
        add_map(&mut self.slot_denials, &o.slot_denials);
        self.slot_grants = self.slot_grants.saturating_add(o.slot_grants);
    }

    /// Whether the distributions fit their bounds and hold at most [`MAX_STEP_OBSERVATIONS`]
    /// values (the rest of a hostile aggregate is only numbers, which saturate).
    pub fn is_bounded(&self) -> bool {
        let copy = self.copy_seconds.values().map(|b| (b, COPY_SECONDS_BOUNDS));
        let stall = self.stall_seconds.values().map(|b| (b, STALL_SECONDS_BOUNDS));
        let mut total = 0u64;
        for (b, bounds) in copy.chain(stall) {
            if !b.counts.is_empty() && !b.fits(bounds) {
                return false;
            }
            total = total.saturating_add(b.count());
        }
        total <= MAX_STEP_OBSERVATIONS
    }

    /// Reservation requests that ended with `outcome`.
    pub fn reservations_with(&self, outcome: ReservationOutcome) -> u64 {
        self.reservations.get(&outcome).map_or(0, |m| m.values().fold(0u64, |t, n| t.saturating_add(*n)))
    }

    /// Reservation requests that were granted (in full or in part).
    pub fn reservation_grants(&self) -> u64 {
        [ReservationOutcome::Granted, ReservationOutcome::Partial]
            .iter()
            .filter_map(|o| self.reservations.get(o))
            .flat_map(|m| m.values())
            .fold(0u64, |t, n| t.saturating_add(*n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Phase, TransferId};

    fn at(kind: EventKind) -> Event {
        Event::new(1, 1, 1, Phase::Forward, kind)
    }

    #[test]
    fn a_value_lands_in_the_first_bucket_whose_bound_holds_it() {
        let bounds = [1.0, 2.0];
        let mut b = Buckets::default();
        for v in [0.5, 1.0, 1.5, 3.0, f64::NAN, -1.0] {
            b.record(&bounds, v);
        }
        assert_eq!(b.counts, [2, 1, 1]);
        assert_eq!(b.sums, [1.5, 1.5, 3.0]);
        // A bucket's mean stands for its values and stays inside it.
        let reps: Vec<(u64, f64)> = b.representatives(&bounds).collect();
        assert_eq!(reps, [(2, 0.75), (1, 1.5), (1, 3.0)]);
        let edge = Buckets { counts: vec![0, 3, 0], sums: vec![0.0, 6.000000000000001, 0.0] };
        assert_eq!(edge.representatives(&bounds).collect::<Vec<_>>(), [(3, 2.0)], "a mean past its bound");
    }

    #[test]
    fn counts_are_kept_by_label_and_add_up() {
        let mut c = StepCounts::default();
        let copy = |dir, owner, ms| {
            at(EventKind::TransferCompleted { id: TransferId(1), dir, owner, bytes: 10, duration_ms: ms })
        };
        assert!(c.count(&copy(Direction::H2d, Owner::Weights, Some(1.0))));
        assert!(c.count(&copy(Direction::H2d, Owner::Weights, None)));
        assert!(c.count(&copy(Direction::D2h, Owner::Activations, Some(0.01))));
        assert!(c.count(&at(EventKind::SlotDenied {
            dir: Direction::H2d,
            owner: Owner::Weights,
            speculative: true,
            reason: DenyReason::H2dSlotsExhausted
        })));
        assert!(!c.count(&at(EventKind::PrefetchHit { block: BlockId(0) })), "in weight_step already");
        // `counts` says what `count` does, for every kind the synthetic run has.
        for e in crate::synthetic::events(crate::synthetic::SyntheticRun::finished(2)) {
            assert_eq!(StepCounts::counts(&e), StepCounts::default().count(&e), "{e:?}");
        }
        assert!(!c.count(&at(EventKind::Restored { tensor: super::super::TensorId(1), bytes: 1, predicted: true, stall_ms: 0.0 })));
        assert_eq!(c.copies[&Direction::H2d][&Owner::Weights], CopyCount { count: 2, bytes: 20 });
        assert_eq!(c.copy_seconds[&Direction::H2d].count(), 1, "only the timed copy");
        let mut sum = StepCounts::default();
        sum.add(&c);
        sum.add(&c);
        assert_eq!(sum.copies[&Direction::D2h][&Owner::Activations].count, 2);
        assert_eq!(sum.slot_denials[&DenyReason::H2dSlotsExhausted], 2);
        assert_eq!(sum.copy_seconds[&Direction::H2d].counts[5], 2, "1 ms is the sixth bound");
        assert!(sum.is_bounded());
        sum.count(&at(EventKind::Eviction { block: BlockId(3), reason: EvictionReason::Budget, score: 1.0, bytes: 1 }));
        sum.count(&at(EventKind::SlabAcquired {
            pool: PoolKind::Activations,
            class: 2,
            slab: super::super::SlabId(0),
            bytes: 1,
            waited_ms: 0.5,
        }));
        // Through the envelope, which flattens the kind (number keys must survive it).
        let e = Event::new(1, 1, 1, Phase::Idle, EventKind::StepCounts(Box::new(sum.clone())));
        let json = serde_json::to_string(&e).expect("serializes");
        let back: Event = serde_json::from_str(&json).expect("reads back");
        assert_eq!(back.kind, EventKind::StepCounts(Box::new(sum)));
    }

    #[test]
    fn a_hostile_aggregate_is_not_bounded() {
        let mut c = StepCounts::default();
        c.copy_seconds.insert(Direction::H2d, Buckets { counts: vec![1; 3], sums: vec![0.0; 3] });
        assert!(!c.is_bounded(), "buckets that do not fit the bounds");
        let mut n = vec![0; COPY_SECONDS_BOUNDS.len() + 1];
        n[0] = MAX_STEP_OBSERVATIONS + 1;
        c.copy_seconds.insert(Direction::H2d, Buckets { counts: n, sums: vec![0.0; COPY_SECONDS_BOUNDS.len() + 1] });
        assert!(!c.is_bounded(), "too many observations");
    }
}
