//! Run totals that come out the same from a full telemetry file and from a summary one.
//!
//! A total such as "prefetch hits" can be counted from detail events (`prefetch_hit`) or from the
//! per-step aggregates (`weight_step`). A full file has both, a summary file only the aggregates.
//! So each domain keeps a [`Tally`]: the sum of finished steps' aggregates (`committed`) plus the
//! detail counts of the step in progress (`open`). When a step's aggregate arrives it *replaces*
//! that step's open detail counts, so nothing is counted twice, and both kinds of file reach the
//! same totals by the same float additions. A step whose aggregate never comes (a runtime that is
//! not attached, a run cut off mid-step) keeps its detail counts.

use super::super::model::*;
use serde::{Deserialize, Serialize};

/// Counts that add up step by step.
pub trait StepSum: Default + Clone {
    /// Adds `other` into `self` (saturating: the numbers may come from a hostile file).
    fn add(&mut self, other: &Self);
}

/// One domain's totals: finished steps plus the step in progress.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Tally<T> {
    /// Sum of the steps already closed.
    pub committed: T,
    /// The step whose detail is being counted.
    pub open_step: u64,
    /// Detail counts of `open_step`, until its aggregate replaces them.
    pub open: T,
    /// What was last added to `committed` (a step's aggregate, or the detail of a step that
    /// got none), and how many additions there were: exporters that count finished steps
    /// read it, so they add the same numbers in the same order live and in a replay.
    #[serde(default)]
    pub last: T,
    #[serde(default)]
    pub commits: u64,
    /// The step whose aggregate came last: its later detail (a copy reported after the step's
    /// figures, at the run's end) is in that aggregate, or in the next one the bus adds for the
    /// step, and is not counted again.
    #[serde(default)]
    pub closed: Option<u64>,
    /// Where such detail goes (never read).
    #[serde(skip)]
    discard: Scratch<T>,
}

/// Counts thrown away: equal to any other, so two tallies compare by what they keep.
#[derive(Debug, Clone, Default)]
struct Scratch<T>(T);

impl<T> PartialEq for Scratch<T> {
    fn eq(&self, _: &Scratch<T>) -> bool {
        true
    }
}

impl<T: StepSum> Tally<T> {
    /// The counts of `step`'s detail events, to add one to. A detail event of another step
    /// closes the open one as it stands (no aggregate came for it).
    pub fn detail(&mut self, step: u64) -> &mut T {
        if self.is_closed(step) {
            self.discard = Scratch::default();
            return &mut self.discard.0;
        }
        if step != self.open_step {
            let open = std::mem::take(&mut self.open);
            self.commit(open);
            self.open_step = step;
        }
        &mut self.open
    }

    /// `step`'s aggregate: it replaces that step's detail counts, which are returned (empty
    /// when the open step is another).
    pub fn aggregate(&mut self, step: u64, agg: &T) -> T {
        let replaced = if step == self.open_step { std::mem::take(&mut self.open) } else { T::default() };
        self.commit(agg.clone());
        self.closed = Some(step);
        replaced
    }

    /// Whether `step`'s aggregate came and its detail is no longer counted.
    pub fn is_closed(&self, step: u64) -> bool {
        self.closed == Some(step)
    }

    fn commit(&mut self, add: T) {
        self.committed.add(&add);
        self.last = add;
        self.commits = self.commits.wrapping_add(1);
    }

    /// Committed plus open.
    pub fn total(&self) -> T {
        let mut t = self.committed.clone();
        t.add(&self.open);
        t
    }
}

/// Weight runtime counts (the summable part of [`WeightStepMetrics`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct WeightCounts {
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    pub stall_count: u64,
    pub stall_time_ms: f64,
    pub evictions: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Blocks the host optimizer stepped, and those of them it was given while backward ran:
    /// from the steps' aggregates only (a `host_step` event does not say when it was queued
    /// relative to backward).
    #[serde(default)]
    pub host_steps: u64,
    #[serde(default)]
    pub host_steps_overlapped: u64,
}

impl StepSum for WeightCounts {
    fn add(&mut self, o: &Self) {
        self.prefetch_hits = self.prefetch_hits.saturating_add(o.prefetch_hits);
        self.prefetch_misses = self.prefetch_misses.saturating_add(o.prefetch_misses);
        self.stall_count = self.stall_count.saturating_add(o.stall_count);
        self.stall_time_ms += o.stall_time_ms;
        self.evictions = self.evictions.saturating_add(o.evictions);
        self.h2d_bytes = self.h2d_bytes.saturating_add(o.h2d_bytes);
        self.d2h_bytes = self.d2h_bytes.saturating_add(o.d2h_bytes);
        self.host_steps = self.host_steps.saturating_add(o.host_steps);
        self.host_steps_overlapped = self.host_steps_overlapped.saturating_add(o.host_steps_overlapped);
    }
}

impl From<&WeightStepMetrics> for WeightCounts {
    fn from(m: &WeightStepMetrics) -> Self {
        WeightCounts {
            prefetch_hits: m.prefetch_hits,
            prefetch_misses: m.prefetch_misses,
            stall_count: m.stall_count,
            stall_time_ms: m.stall_time_ms,
            evictions: m.evictions,
            h2d_bytes: m.h2d_bytes,
            d2h_bytes: m.d2h_bytes,
            host_steps: m.host_steps,
            host_steps_overlapped: m.host_steps_during_backward(),
        }
    }
}

/// Activation runtime counts (the summable part of [`ActivationStepMetrics`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ActivationCounts {
    pub saved: u64,
    pub kept: u64,
    pub spilled: u64,
    pub weight_handles: u64,
    pub restored: u64,
    pub predicted: u64,
    pub spill_bytes: u64,
    pub restore_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub pool_hits: u64,
    pub pool_misses: u64,
    #[serde(default)]
    pub recomputed: u64,
    #[serde(default)]
    pub recompute_bytes: u64,
}

impl StepSum for ActivationCounts {
    fn add(&mut self, o: &Self) {
        self.saved = self.saved.saturating_add(o.saved);
        self.kept = self.kept.saturating_add(o.kept);
        self.spilled = self.spilled.saturating_add(o.spilled);
        self.weight_handles = self.weight_handles.saturating_add(o.weight_handles);
        self.restored = self.restored.saturating_add(o.restored);
        self.predicted = self.predicted.saturating_add(o.predicted);
        self.spill_bytes = self.spill_bytes.saturating_add(o.spill_bytes);
        self.restore_bytes = self.restore_bytes.saturating_add(o.restore_bytes);
        self.stall_time_ms += o.stall_time_ms;
        self.stall_count = self.stall_count.saturating_add(o.stall_count);
        self.pool_hits = self.pool_hits.saturating_add(o.pool_hits);
        self.pool_misses = self.pool_misses.saturating_add(o.pool_misses);
        self.recomputed = self.recomputed.saturating_add(o.recomputed);
        self.recompute_bytes = self.recompute_bytes.saturating_add(o.recompute_bytes);
    }
}

impl From<&ActivationStepMetrics> for ActivationCounts {
    fn from(m: &ActivationStepMetrics) -> Self {
        ActivationCounts {
            saved: m.activations_saved,
            kept: m.activations_kept,
            spilled: m.activations_spilled,
            weight_handles: m.weight_handles,
            restored: m.activations_restored,
            predicted: m.activations_predicted,
            spill_bytes: m.spill_bytes,
            restore_bytes: m.restore_bytes,
            stall_time_ms: m.stall_time_ms,
            stall_count: m.stall_count,
            pool_hits: m.pool_hits,
            pool_misses: m.pool_misses,
            recomputed: m.activations_recomputed,
            recompute_bytes: m.recompute_bytes,
        }
    }
}

/// Conductor counts (the summable part of [`ConductorStepMetrics`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ConductorCounts {
    pub grants: u64,
    pub partials: u64,
    pub denials: u64,
    pub slot_grants: u64,
    pub slot_denials: u64,
}

impl StepSum for ConductorCounts {
    fn add(&mut self, o: &Self) {
        self.grants = self.grants.saturating_add(o.grants);
        self.partials = self.partials.saturating_add(o.partials);
        self.denials = self.denials.saturating_add(o.denials);
        self.slot_grants = self.slot_grants.saturating_add(o.slot_grants);
        self.slot_denials = self.slot_denials.saturating_add(o.slot_denials);
    }
}

impl From<&ConductorStepMetrics> for ConductorCounts {
    fn from(m: &ConductorStepMetrics) -> Self {
        ConductorCounts {
            grants: m.grant_count,
            partials: m.partial_count,
            denials: m.deny_count,
            slot_grants: m.slot_grant_count,
            slot_denials: m.slot_deny_count,
        }
    }
}

impl StepSum for CopyStats {
    fn add(&mut self, o: &Self) {
        self.count = self.count.saturating_add(o.count);
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.untimed_bytes = self.untimed_bytes.saturating_add(o.untimed_bytes);
        self.busy_ms += o.busy_ms;
        if o.busy_ms > 0.0 {
            self.last_gbps = o.last_gbps;
        }
    }
}

impl StepSum for TransferStepMetrics {
    fn add(&mut self, o: &Self) {
        self.h2d.add(&o.h2d);
        self.d2h.add(&o.d2h);
        self.collective.add(&o.collective);
    }
}

impl CopyStats {
    /// Adds one completed copy, with its duration when it was timed.
    pub fn record(&mut self, bytes: u64, duration_ms: Option<f64>) {
        let mut one = CopyStats {
            count: 1,
            bytes,
            untimed_bytes: 0,
            busy_ms: 0.0,
            last_gbps: self.last_gbps,
        };
        match (duration_ms, copy_gbps(bytes, duration_ms)) {
            (Some(ms), Some(gbps)) => {
                one.busy_ms = ms;
                one.last_gbps = gbps;
            }
            _ => one.untimed_bytes = bytes,
        }
        self.add(&one);
    }

    /// The measured rate, GB/s: the timed copies' bytes over their time (0 when none).
    pub fn mean_gbps(&self) -> f64 {
        copy_gbps(self.bytes.saturating_sub(self.untimed_bytes), Some(self.busy_ms)).unwrap_or(0.0)
    }
}

impl TransferStepMetrics {
    /// The stats of one direction.
    pub fn dir_mut(&mut self, d: Direction) -> &mut CopyStats {
        match d {
            Direction::H2d => &mut self.h2d,
            Direction::D2h => &mut self.d2h,
            Direction::Collective => &mut self.collective,
        }
    }

    /// True when no copy completed.
    pub fn is_empty(&self) -> bool {
        self.h2d.count == 0 && self.d2h.count == 0 && self.collective.count == 0
    }
}

impl StepSum for StepCounts {
    fn add(&mut self, o: &Self) {
        StepCounts::add(self, o);
    }
}

/// The tallies of every domain whose totals have a per-step aggregate.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Tallies {
    pub weights: Tally<WeightCounts>,
    pub activations: Tally<ActivationCounts>,
    /// The Conductor's own per-step figures (`conductor_step` only). The views' totals count
    /// its events instead (`counts`), which also covers what happens before the first step.
    pub conductor: Tally<ConductorCounts>,
    pub transfers: Tally<TransferStepMetrics>,
    /// Detail events counted by label ([`StepCounts`]).
    #[serde(default)]
    pub counts: Tally<StepCounts>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_that_were_not_timed_count_their_bytes_and_stay_out_of_the_rate() {
        let mut c = CopyStats::default();
        c.record(2_000_000, Some(1.0));
        c.record(6_000_000, None);
        c.record(1_000_000, Some(f64::NAN));
        assert_eq!((c.count, c.bytes, c.untimed_bytes), (3, 9_000_000, 7_000_000));
        assert_eq!(c.busy_ms, 1.0);
        assert!((c.mean_gbps() - 2.0).abs() < 1e-9, "{}", c.mean_gbps());
        assert!((c.last_gbps - 2.0).abs() < 1e-9, "the last timed copy's rate: {}", c.last_gbps);
        assert_eq!(CopyStats::default().mean_gbps(), 0.0);
    }

    #[test]
    fn an_aggregate_replaces_its_steps_detail_and_later_steps_keep_theirs() {
        let mut t = Tally::<ConductorCounts>::default();
        t.detail(1).grants += 1;
        t.detail(1).grants += 1;
        assert_eq!(t.total().grants, 2);
        t.aggregate(1, &ConductorCounts { grants: 5, ..Default::default() });
        assert_eq!(t.total().grants, 5, "the aggregate replaced the two detail grants");
        t.detail(2).grants += 1;
        assert_eq!(t.total().grants, 6);
        // Step 2 never got an aggregate: its detail stays when step 3 starts.
        t.detail(3).denials += 1;
        assert_eq!((t.total().grants, t.total().denials), (6, 1));
        // Detail of a step after its aggregate is in that aggregate already.
        t.aggregate(3, &ConductorCounts { denials: 1, ..Default::default() });
        t.detail(3).denials += 1;
        assert_eq!(t.total().denials, 1);
    }
}
