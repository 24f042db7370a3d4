//! The view types a [`Snapshot`](super::Snapshot) is made of, and the bounds on its histories.

use super::super::model::*;
use serde::{Deserialize, Serialize};
use super::tally::ActivationCounts;
use std::collections::{BTreeMap, VecDeque};

/// VRAM samples kept for history charts.
pub const VRAM_HISTORY: usize = 600;
/// Steps kept in the per-step history.
pub const STEP_HISTORY: usize = 512;
/// Recent transfers kept for the transfers view.
pub const RECENT_TRANSFERS: usize = 64;
/// Warnings kept.
pub const RECENT_WARNINGS: usize = 64;
/// Phase spans kept for the Conductor timeline.
pub const PHASE_SPANS: usize = 96;
/// Denials kept for the Conductor view.
pub const RECENT_DENIALS: usize = 32;
/// Readings of VRAM by owner kept for history charts.
pub const OWNERS_HISTORY: usize = 256;
/// Out-of-memory reports and flight-recorder files kept.
pub const RECENT_INCIDENTS: usize = 16;

/// What the `run_started` event said.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RunInfo {
    pub run_id: String,
    pub wall_clock_unix_ms: u64,
    pub device: DeviceInfo,
    pub model: String,
    pub versions: BTreeMap<String, String>,
    pub config: serde_json::Value,
}

/// One reading of device memory.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct VramReading {
    pub t_ns: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
}

/// The limits one owner published ([`EventKind::LimitsSet`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct OwnerLimits {
    pub budget_bytes: u64,
    pub high_watermark_bytes: Option<u64>,
    pub low_watermark_bytes: Option<u64>,
}

/// A move of the spill watermarks away from the plan's ([`EventKind::WatermarksMoved`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WatermarkMove {
    /// The step after which they moved.
    pub step: u64,
    pub from_high_bytes: u64,
    pub from_low_bytes: u64,
    pub high_bytes: u64,
    pub low_bytes: u64,
    pub reason: String,
}

/// Device memory by owner at one moment of a step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct OwnersReading {
    pub t_ns: u64,
    pub step: u64,
    pub phase: Phase,
    pub owners: VramByOwner,
}

/// A device allocation that failed, as reported.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OomRecord {
    pub seq: u64,
    pub step: u64,
    pub phase: Phase,
    pub requested_bytes: u64,
    pub owners: VramByOwner,
    pub doing: String,
    pub dump: Option<String>,
}

/// One managed weight block.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct BlockView {
    pub id: BlockId,
    pub name: String,
    pub bytes: u64,
    pub exec_order: u32,
    pub file_backed: bool,
    pub trainable: bool,
    pub state: BlockState,
    pub refcount: u32,
    pub protected: bool,
    pub loads: u64,
    pub evictions: u64,
    /// What happened to it last, e.g. "prefetching -> gpu_ready".
    pub last: String,
    pub last_seq: u64,
}

/// Where the weight scheduler is in its itinerary.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ItineraryView {
    pub order: Vec<BlockId>,
    pub cursor: u32,
    pub backward: bool,
    pub window: Vec<BlockId>,
}

/// One size class of a pool (the weight pool has one).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ClassView {
    pub slab_bytes: u64,
    pub slabs: u32,
    pub in_use: u32,
    pub peak_in_use: u32,
    pub hits: u64,
    pub exhausted: u64,
}

/// A pinned pool.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PoolView {
    pub pinned: bool,
    pub classes: Vec<ClassView>,
    pub pageable_fallbacks: u64,
    pub pageable_bytes: u64,
    pub total_wait_ms: f64,
}

impl PoolView {
    /// Bytes the pool holds in all.
    pub fn capacity_bytes(&self) -> u64 {
        self.classes
            .iter()
            .fold(0u64, |t, c| t.saturating_add(c.slab_bytes.saturating_mul(c.slabs as u64)))
    }
    /// Bytes in slabs that are taken.
    pub fn in_use_bytes(&self) -> u64 {
        self.classes
            .iter()
            .fold(0u64, |t, c| t.saturating_add(c.slab_bytes.saturating_mul(c.in_use as u64)))
    }
}

/// One direction of PCIe traffic.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DirectionView {
    pub inflight: u32,
    pub count: u64,
    pub bytes: u64,
    /// Bytes of the copies that were not timed.
    #[serde(default)]
    pub untimed_bytes: u64,
    /// Sum of the timed copies' durations, for mean throughput.
    pub busy_ms: f64,
    /// Throughput of the last timed copy, GB/s.
    pub last_gbps: f64,
}

impl DirectionView {
    /// Mean throughput of the timed copies, GB/s.
    pub fn mean_gbps(&self) -> f64 {
        copy_gbps(self.bytes.saturating_sub(self.untimed_bytes), Some(self.busy_ms)).unwrap_or(0.0)
    }
}

/// A completed copy.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferRecord {
    pub seq: u64,
    pub t_ns: u64,
    pub id: TransferId,
    pub dir: Direction,
    pub owner: Owner,
    pub bytes: u64,
    /// The copy's duration, when it was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
}

impl TransferRecord {
    /// The copy's rate, GB/s, when it was timed (and took measurable time).
    pub fn gbps(&self) -> Option<f64> {
        copy_gbps(self.bytes, self.duration_ms)
    }
}

/// Copies in both directions.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TransfersView {
    pub h2d: DirectionView,
    pub d2h: DirectionView,
    /// Collectives between the devices of a data-parallel group.
    #[serde(default)]
    pub collective: DirectionView,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<TransferRecord>))]
    pub recent: VecDeque<TransferRecord>,
}

impl TransfersView {
    /// The view of one direction.
    pub fn dir(&self, d: Direction) -> &DirectionView {
        match d {
            Direction::H2d => &self.h2d,
            Direction::D2h => &self.d2h,
            Direction::Collective => &self.collective,
        }
    }
    pub(super) fn dir_mut(&mut self, d: Direction) -> &mut DirectionView {
        match d {
            Direction::H2d => &mut self.h2d,
            Direction::D2h => &mut self.d2h,
            Direction::Collective => &mut self.collective,
        }
    }
}

/// Weight runtime totals over the run.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct WeightTotals {
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    pub stall_time_ms: f64,
    pub evictions: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// Misses that stalled the compute stream.
    #[serde(default)]
    pub stall_count: u64,
    pub last_step: Option<WeightStepMetrics>,
}

impl WeightTotals {
    /// Hits over hits plus misses, 0 when there were none.
    pub fn hit_rate(&self) -> f64 {
        let n = self.prefetch_hits.saturating_add(self.prefetch_misses);
        if n == 0 {
            0.0
        } else {
            self.prefetch_hits as f64 / n as f64
        }
    }
}

/// Activation runtime totals over the run: the counts every step adds to (the type the tally
/// sums, flattened, so the JSON keeps one level), and what only the run as a whole has.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ActivationTotals {
    #[serde(flatten)]
    pub counts: ActivationCounts,
    pub duplicates: u64,
    pub finalized_inline: u64,
    pub kept_by_reason: BTreeMap<String, u64>,
    pub spilling: bool,
    pub last_step: Option<ActivationStepMetrics>,
}

/// A denial, for the Conductor view.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenialRecord {
    pub seq: u64,
    pub step: u64,
    pub phase: Phase,
    pub owner: Owner,
    pub what: String,
    pub reason: DenyReason,
}

/// The Conductor's state.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ConductorView {
    pub hints: Hints,
    pub hints_rule: Option<PolicyRule>,
    pub hint_changes: u64,
    pub grants: u64,
    pub partials: u64,
    pub denials: u64,
    pub ceilings: u64,
    pub by_mode: BTreeMap<String, u64>,
    pub by_priority: BTreeMap<String, u64>,
    pub denials_by_reason: BTreeMap<String, u64>,
    pub active_reservations: u64,
    pub active_bytes: u64,
    pub slot_grants: u64,
    pub slot_denials: u64,
    pub h2d_inflight: u32,
    pub d2h_inflight: u32,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<DenialRecord>))]
    pub recent_denials: VecDeque<DenialRecord>,
    pub last_step: Option<ConductorStepMetrics>,
}

/// A phase of a step, with its span.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseSpan {
    pub step: u64,
    pub phase: Phase,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// Everything known about one step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StepRecord {
    pub step: u64,
    pub train: Option<TrainStepMetrics>,
    pub weights: Option<WeightStepMetrics>,
    pub activations: Option<ActivationStepMetrics>,
    pub conductor: Option<ConductorStepMetrics>,
    #[serde(default)]
    pub time: Option<StepTimeBreakdown>,
    /// Device memory by owner at the step's fullest reading (the one with the most allocated,
    /// the first of equals): where the step's memory went when it was highest among the
    /// readings. The step's true peak, between readings, is `train.vram_peak_bytes`.
    #[serde(default)]
    pub vram_at_peak: Option<VramByOwner>,
    /// The step's copies by direction.
    #[serde(default)]
    pub transfers: Option<TransferStepMetrics>,
}

/// A warning, for the log.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarningRecord {
    pub seq: u64,
    pub t_ns: u64,
    pub step: u64,
    pub source: Owner,
    pub message: String,
}

