//! The event model: every decision the runtimes make, as one serde-tagged enum.
//!
//! This file is the one place where the wire format is defined. Each event is an [`Event`]
//! envelope (schema version, sequence number, monotonic time, step, phase) around an
//! [`EventKind`]. On the wire (JSONL, SSE, WebSocket) an event is one JSON object whose `kind`
//! field names the variant, e.g.
//!
//! ```json
//! {"v":1,"seq":42,"t_ns":1200345,"step":3,"phase":"forward",
//!  "kind":"residency","block":5,"name":"blocks.5","from":"prefetching","to":"gpu_ready","refcount":0}
//! ```
//!
//! `t_ns` counts nanoseconds on a monotonic clock from the run's start; the `run_started` event
//! carries the wall-clock anchor (`wall_clock_unix_ms`) that turns it into a date.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Version of the event schema. Bumped when a field changes meaning or is removed; adding an
/// optional field or a new event kind does not bump it (readers skip kinds they do not know).
pub const SCHEMA_VERSION: u32 = 2;

/// The oldest schema version readers accept. Version 1 files carried the limits inside every
/// `vram_sample`; version 2 publishes them once per owner as `limits_set`.
pub const MIN_SCHEMA_VERSION: u32 = 1;

macro_rules! id_newtype {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
        #[serde(transparent)]
        pub struct $name(pub $inner);
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_newtype!(
    /// A managed weight block, numbered in registration order.
    #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
    BlockId(u32)
);
id_newtype!(
    /// A tensor saved by autograd and seen by the activation runtime, unique within a run.
    TensorId(u64)
);
id_newtype!(
    /// A slab of a pinned pool (index within its pool, or within its size class).
    SlabId(u32)
);
id_newtype!(
    /// One copy between host and device, unique within a run.
    #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
    TransferId(u64)
);
id_newtype!(
    /// A Conductor reservation, unique within a run.
    ReservationId(u64)
);

/// The phase of a training step that an event belongs to.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Outside any step (set-up, between steps, shutdown).
    #[default]
    Idle,
    StepBegin,
    Forward,
    Backward,
    Optimizer,
    StepEnd,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 6] = [
        Phase::Idle,
        Phase::StepBegin,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::StepEnd,
    ];

    /// The name used on the wire and in labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::StepBegin => "step_begin",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::StepEnd => "step_end",
        }
    }

    /// Compact encoding for the bus's lock-free step context.
    pub(crate) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_u8(v: u8) -> Phase {
        Phase::ALL.get(v as usize).copied().unwrap_or(Phase::Idle)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Residency of a weight block (the seed's six states).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Only the canonical host copy (or the file) holds the weights.
    #[default]
    Unloaded,
    /// Staged into a pinned slab, ready to copy.
    HostStaged,
    /// An H2D copy is in flight.
    Prefetching,
    /// On the device and usable.
    GpuReady,
    /// Being saved back to the host (trainable weights, gradients).
    Evicting,
    /// Device memory being released without a copy back (frozen weights).
    GpuFreeing,
}

impl BlockState {
    /// Every state, in lifecycle order.
    pub const ALL: [BlockState; 6] = [
        BlockState::Unloaded,
        BlockState::HostStaged,
        BlockState::Prefetching,
        BlockState::GpuReady,
        BlockState::Evicting,
        BlockState::GpuFreeing,
    ];

    /// The name used on the wire and in labels.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::Unloaded => "unloaded",
            BlockState::HostStaged => "host_staged",
            BlockState::Prefetching => "prefetching",
            BlockState::GpuReady => "gpu_ready",
            BlockState::Evicting => "evicting",
            BlockState::GpuFreeing => "gpu_freeing",
        }
    }

    /// Whether the transition `self -> to` is one of the eight valid edges.
    pub fn can_transition_to(self, to: BlockState) -> bool {
        use BlockState::*;
        matches!(
            (self, to),
            (Unloaded, HostStaged)
                | (HostStaged, Prefetching)
                | (Prefetching, GpuReady)
                | (GpuReady, Evicting)
                | (GpuReady, GpuFreeing)
                | (Evicting, HostStaged)
                | (Evicting, Unloaded)
                | (GpuFreeing, Unloaded)
        )
    }
}

impl fmt::Display for BlockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Direction of a copy across PCIe.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Host to device.
    H2d,
    /// Device to host.
    D2h,
}

impl Direction {
    /// The name used on the wire and in labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::H2d => "h2d",
            Direction::D2h => "d2h",
        }
    }
}

/// Which runtime an event, a copy or a reservation belongs to.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    Weights,
    Activations,
    Conductor,
    Trainer,
    /// The device as a whole (the one budget a run is given).
    Device,
}

impl Owner {
    /// The name used on the wire and in labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Owner::Weights => "weights",
            Owner::Activations => "activations",
            Owner::Conductor => "conductor",
            Owner::Trainer => "trainer",
            Owner::Device => "device",
        }
    }
}

/// The kind of device a run uses.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// A CUDA GPU: real VRAM, real copy streams.
    Cuda,
    /// The host device: VRAM is an accounted budget in host memory, copies are synchronous.
    #[default]
    Host,
}

/// The device a run uses, as dashboards label it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DeviceInfo {
    pub kind: DeviceKind,
    /// CUDA ordinal (0 on the host device).
    pub index: u32,
    /// "NVIDIA H200", or "host (simulated)".
    pub name: String,
    /// Device memory in bytes (the simulated budget on the host device).
    pub total_bytes: u64,
}

impl DeviceInfo {
    /// True when VRAM and copies are simulated on the host.
    pub fn host_simulated(&self) -> bool {
        self.kind == DeviceKind::Host
    }
}

/// Why a block was evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionReason {
    /// VRAM reached the high watermark; evicting until under the low one.
    Watermark,
    /// The weight budget (slots on the device) was full and a block had to make room.
    Budget,
    /// The user asked for it.
    Explicit,
    /// The run is shutting down.
    Shutdown,
}

/// Which pool an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// The uniform-slab pinned pool of the weight runtime.
    Weights,
    /// The size-class pinned pool of the activation runtime.
    Activations,
}

/// What the pack hook decided for one saved tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackDecision {
    /// Stays on the device; `reason` says why.
    Kept,
    /// Copied to a pinned host buffer and released on the device.
    Spilled,
    /// A managed weight, stored as a handle to its block.
    WeightHandle,
    /// Another save of a tensor already handled in this step.
    Duplicate,
}

/// Why a saved tensor was kept on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepReason {
    /// VRAM is under the watermark (or hysteresis says stop spilling).
    UnderWatermark,
    /// Smaller than the minimum size to spill.
    TooSmall,
    /// Not on a CUDA device (host tensors on a GPU run).
    NotOnDevice,
    /// Outside every region that allows spilling.
    OutsideRegion,
    /// The spill fraction for this step is used up.
    FractionReached,
    /// Among the last groups of the forward, which backward needs first.
    TailOfForward,
    /// A parameter of the model (not managed by the weight runtime).
    Parameter,
    /// Larger than every size class and the pageable fallback is off.
    TooLarge,
    /// Spilling is paused (`max_inflight_d2h` is 0, as the Conductor sets it in OPTIMIZER).
    SpillsPaused,
}

/// Conductor reservation modes (seed section 16.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationMode {
    /// All or nothing under the soft cap.
    Hard,
    /// A partial grant of what is available.
    Soft,
    /// May exceed the soft cap, up to the hard cap.
    Burst,
    /// A guaranteed minimum, all or nothing.
    Floor,
    /// An upper-bound hint: records a cap, grants nothing.
    Ceiling,
}

/// Conductor priorities, highest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Critical,
    Required,
    Speculative,
    Background,
}

/// The resource a reservation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    Vram,
    PinnedHost,
}

/// How a reservation request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReservationOutcome {
    Granted,
    Partial,
    Denied,
    /// A ceiling was recorded; nothing was granted.
    CapRecorded,
}

/// Why the Conductor refused a reservation or a transfer slot.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenyReason {
    /// Not enough headroom under the cap for this mode.
    InsufficientHeadroom,
    /// Below the reserve kept for higher priorities.
    PriorityReserve,
    /// Over a ceiling recorded for this owner.
    OverCeiling,
    /// Every H2D slot is taken.
    H2dSlotsExhausted,
    /// Every D2H slot is taken.
    D2hSlotsExhausted,
    /// A policy rule suppresses speculative work in this phase.
    PhaseRuleSuppressedSpeculative,
    /// The Conductor is shut down.
    Shutdown,
}

impl DenyReason {
    /// The name used on the wire and in labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DenyReason::InsufficientHeadroom => "insufficient_headroom",
            DenyReason::PriorityReserve => "priority_reserve",
            DenyReason::OverCeiling => "over_ceiling",
            DenyReason::H2dSlotsExhausted => "h2d_slots_exhausted",
            DenyReason::D2hSlotsExhausted => "d2h_slots_exhausted",
            DenyReason::PhaseRuleSuppressedSpeculative => "phase_rule_suppressed_speculative",
            DenyReason::Shutdown => "shutdown",
        }
    }
}

/// The Conductor's policy rules (seed section 16.7).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyRule {
    /// Step begin: every hint back to the runtimes' configured values.
    Reset,
    /// Backward with VRAM pressure above 80% of the soft cap.
    BackwardPressure,
    /// Optimizer phase: no speculative work, one H2D in flight.
    OptimizerProtection,
    /// Transfer slots full on more than three consecutive checks.
    Contention,
}

/// Limits the Conductor asks the runtimes to respect.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Hints {
    pub max_inflight_h2d: Option<u32>,
    pub max_inflight_d2h: Option<u32>,
    pub prefetch_window_cap: Option<u32>,
    pub suppress_speculative: bool,
}

/// One size class of a pool, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolClass {
    pub slab_bytes: u64,
    pub slabs: u32,
}

/// Weight runtime metrics of one step (the seed's `StepMetrics` fields).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct WeightStepMetrics {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub evictions: u64,
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// prefetch_hits / (hits + misses), 0 when there were none.
    pub hit_rate: f64,
    pub vram_used_mb: f64,
    pub vram_reserved_mb: f64,
    pub host_pool_free: u32,
    pub host_pool_in_use: u32,
}

/// Activation runtime metrics of one step (the seed's field names).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ActivationStepMetrics {
    pub activations_saved: u64,
    pub activations_kept: u64,
    pub activations_spilled: u64,
    pub activations_restored: u64,
    /// Restores issued ahead of need by the predictive restorer.
    pub activations_predicted: u64,
    pub weight_handles: u64,
    pub spill_bytes: u64,
    pub restore_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub pool_hits: u64,
    pub pool_misses: u64,
    pub vram_peak_mb: f64,
}

/// Conductor metrics of one step (the seed's field names).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ConductorStepMetrics {
    pub vram_allocated_mb: f64,
    pub vram_headroom_mb: f64,
    pub pinned_granted_mb: f64,
    pub h2d_inflight: u32,
    pub d2h_inflight: u32,
    pub grant_count: u64,
    pub deny_count: u64,
    pub partial_count: u64,
    /// Seconds spent in each phase of the step.
    pub phase_durations: PhaseDurations,
    /// Each attached runtime's knobs at the end of the step, by adapter name
    /// (`stagehand: {max_inflight, prefetch_window}`, `activation_stagehand: {max_d2h, max_h2d}`).
    #[serde(default)]
    pub runtime_snapshots: std::collections::BTreeMap<String, serde_json::Value>,
    /// Transfer slots granted in the step (over-limit grants included).
    #[serde(default)]
    pub slot_grant_count: u64,
    /// Transfer slots refused in the step.
    #[serde(default)]
    pub slot_deny_count: u64,
    /// Required copies let through a full slot pool in the step.
    #[serde(default)]
    pub slot_over_limit_count: u64,
    /// Bytes reported by completed H2D slot tokens in the step.
    #[serde(default)]
    pub h2d_bytes: u64,
    /// Bytes reported by completed D2H slot tokens in the step.
    #[serde(default)]
    pub d2h_bytes: u64,
}

/// Seconds spent in each phase of one step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct PhaseDurations {
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
}

/// What the trainer reports at the end of each step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TrainStepMetrics {
    pub loss: f64,
    /// Wall time of the whole step in seconds.
    pub step_time_s: f64,
    /// Tokens (or samples) processed in the step.
    pub tokens: u64,
    /// Peak bytes allocated on the device during the step.
    pub vram_peak_bytes: u64,
}

/// Where one step's wall time went. The parts `compute_ms` .. `other_ms` add up to `step_ms`.
///
/// The compute stream's waits are measured on the GPU: before the compute stream is made to wait
/// on a copy, a timed event is recorded on it, and the time from that event to the copy's own
/// completion event is how long the compute stream sat idle for the copy (0 when the copy had
/// landed first). On the host device copies are synchronous and those waits are host stalls.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct StepTimeBreakdown {
    /// Wall time of the whole step.
    pub step_ms: f64,
    /// Forward and backward time not spent in any of the waits below.
    pub compute_ms: f64,
    /// The compute stream waiting on host-to-device copies (weights, restores) still landing.
    pub h2d_wait_ms: f64,
    /// The compute stream (or the host) waiting on device-to-host copies (spills, gradients).
    pub d2h_wait_ms: f64,
    /// The host blocked loading weight blocks that were not prefetched (misses).
    pub weight_stall_ms: f64,
    /// The host blocked restoring spilled activations on demand.
    pub restore_stall_ms: f64,
    /// The optimizer phase (host and device optimizer steps).
    pub optimizer_ms: f64,
    /// Everything else (step set-up, loss read-back, telemetry).
    pub other_ms: f64,
}

/// Device memory by owner at one moment. `other_bytes` is what the allocator holds beyond the
/// runtimes' own figures (the model's unmanaged tensors, workspaces, gradients, fragmentation).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct VramByOwner {
    pub allocated_bytes: u64,
    /// Resident weight blocks (ready or being evicted).
    pub weights_bytes: u64,
    /// Saved activations kept on the device.
    pub activations_kept_bytes: u64,
    /// Spilled activations brought back and waiting for backward.
    pub activations_restored_bytes: u64,
    /// Destinations of copies still in flight (weights landing, restores landing, spills leaving).
    pub copies_in_flight_bytes: u64,
    pub other_bytes: u64,
}

impl VramByOwner {
    /// Fills `other_bytes` from `allocated_bytes` and the owned parts.
    pub fn with_other(mut self) -> VramByOwner {
        let owned = self.weights_bytes
            + self.activations_kept_bytes
            + self.activations_restored_bytes
            + self.copies_in_flight_bytes;
        self.other_bytes = self.allocated_bytes.saturating_sub(owned);
        self
    }
}

/// Every event the runtimes, the Conductor and the trainer emit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    // ---- run lifecycle -------------------------------------------------------------------
    /// First event of a run: the wall-clock anchor and what is running.
    RunStarted {
        run_id: String,
        /// Wall clock at `t_ns == 0`, milliseconds since the Unix epoch.
        wall_clock_unix_ms: u64,
        device: DeviceInfo,
        /// Free-form description of the model ("gpt d=256 L=8").
        model: String,
        /// Versions of stagehand, libtorch, the driver.
        versions: std::collections::BTreeMap<String, String>,
        /// The configuration the run was started with.
        config: serde_json::Value,
    },
    /// Last event of a run.
    RunEnded { steps: u64 },
    /// A phase boundary. `duration_s` is how long the phase being left lasted.
    PhaseChanged { from: Phase, to: Phase, duration_s: f64 },

    // ---- weights -------------------------------------------------------------------------
    /// A block joined the registry.
    BlockRegistered {
        block: BlockId,
        name: String,
        bytes: u64,
        exec_order: u32,
        file_backed: bool,
        trainable: bool,
    },
    /// The itinerary (execution order) was learned or changed.
    ItineraryLearned { order: Vec<BlockId> },
    /// A step ran its blocks in another order than the itinerary: it was traced again.
    ItineraryChanged {
        order: Vec<BlockId>,
        /// Position of the first block that differs from the previous itinerary.
        first_difference: u32,
        /// Blocks new to the itinerary, and blocks no longer in it.
        added: Vec<BlockId>,
        removed: Vec<BlockId>,
    },
    /// A residency transition.
    Residency {
        block: BlockId,
        from: BlockState,
        to: BlockState,
        refcount: u32,
    },
    /// A block was needed and was already on the device.
    PrefetchHit { block: BlockId },
    /// A block was needed and was not ready: the compute stream waited `stall_ms`.
    PrefetchMiss { block: BlockId, stall_ms: f64 },
    /// A block was chosen for eviction.
    Eviction {
        block: BlockId,
        reason: EvictionReason,
        /// Next-use distance times size: the farther and larger, the higher.
        score: f64,
        bytes: u64,
    },
    /// The prefetch window moved: the blocks being prefetched ahead of `cursor`.
    PrefetchWindow {
        cursor: u32,
        backward: bool,
        window: Vec<BlockId>,
    },
    /// `keep_resident` protection added or removed.
    Protection { block: BlockId, protected: bool },

    // ---- copies --------------------------------------------------------------------------
    /// A copy was issued on a copy stream.
    TransferIssued {
        id: TransferId,
        dir: Direction,
        owner: Owner,
        bytes: u64,
        /// The block or tensor the copy is for.
        subject: String,
    },
    /// A copy completed; `duration_ms` runs from issue to observed completion.
    TransferCompleted {
        id: TransferId,
        dir: Direction,
        owner: Owner,
        bytes: u64,
        duration_ms: f64,
    },

    // ---- pools ---------------------------------------------------------------------------
    /// A pool was created (all of its memory is allocated at once).
    PoolConfigured {
        pool: PoolKind,
        classes: Vec<PoolClass>,
        pinned: bool,
    },
    /// A slab was taken. `class` is the size-class index (0 for the weight pool).
    SlabAcquired {
        pool: PoolKind,
        class: u32,
        slab: SlabId,
        bytes: u64,
        waited_ms: f64,
    },
    /// A slab went back to its class.
    SlabReleased { pool: PoolKind, class: u32, slab: SlabId },
    /// No slab was free in the class (or any larger one).
    PoolExhausted { pool: PoolKind, class: u32, requested_bytes: u64 },
    /// A buffer was allocated outside the pool, in pageable memory.
    PageableFallback { pool: PoolKind, bytes: u64 },

    // ---- activations ---------------------------------------------------------------------
    /// What the pack hook did with a saved tensor.
    Pack {
        tensor: TensorId,
        decision: PackDecision,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<KeepReason>,
        bytes: u64,
        /// Size class of the pinned buffer, for spills.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        class: Option<u32>,
        /// Whether the pinned pool had a buffer, for spills.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pool_hit: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        region: Option<String>,
    },
    /// A spill's D2H copy completed and the device tensor was released.
    SpillFinalized { tensor: TensorId, bytes: u64, inline: bool },
    /// A spilled tensor is back on the device.
    Restored {
        tensor: TensorId,
        bytes: u64,
        /// Restored ahead of need by the predictive restorer.
        predicted: bool,
        stall_ms: f64,
    },
    /// Spilling switched on (VRAM at the high watermark) or off (under the low one).
    SpillingToggled { on: bool, vram_allocated_bytes: u64 },

    // ---- conductor -----------------------------------------------------------------------
    /// A reservation request and its outcome.
    Reservation {
        id: ReservationId,
        owner: Owner,
        resource: Resource,
        mode: ReservationMode,
        priority: Priority,
        requested_bytes: u64,
        granted_bytes: u64,
        outcome: ReservationOutcome,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<DenyReason>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scope: Option<Phase>,
    },
    /// A reservation ended (released, or its phase ended).
    ReservationReleased { id: ReservationId, bytes: u64 },
    /// A transfer slot was granted.
    SlotGranted {
        dir: Direction,
        owner: Owner,
        speculative: bool,
        inflight: u32,
    },
    /// A transfer slot was refused.
    SlotDenied {
        dir: Direction,
        owner: Owner,
        speculative: bool,
        reason: DenyReason,
    },
    /// A transfer slot was given back.
    SlotReleased { dir: Direction, owner: Owner, inflight: u32 },
    /// The policy bridge changed the hints.
    HintsChanged { hints: Hints, rule: PolicyRule },

    // ---- memory --------------------------------------------------------------------------
    /// A reading of device memory (readings only: limits are [`EventKind::LimitsSet`]).
    VramSample {
        allocated_bytes: u64,
        reserved_bytes: u64,
        peak_allocated_bytes: u64,
    },
    /// The limits one owner holds itself to, published when set: the device's whole budget
    /// (`device`), the weights' room (`weights`), the spill watermarks (`activations`), the
    /// Conductor's soft cap with its hard cap as the high mark (`conductor`).
    LimitsSet {
        owner: Owner,
        budget_bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        high_watermark_bytes: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        low_watermark_bytes: Option<u64>,
    },
    /// Device memory by owner (at phase boundaries and at the step's peak).
    VramOwners(VramByOwner),
    /// A device allocation failed: what held the device at that moment, and what was next.
    OutOfMemory {
        requested_bytes: u64,
        owners: VramByOwner,
        /// What the runtime was doing ("loading block 'blocks.3'", "restoring tensor 812").
        doing: String,
        /// The flight-recorder file written for it, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dump: Option<String>,
    },

    // ---- per-step metrics ----------------------------------------------------------------
    WeightStep(WeightStepMetrics),
    ActivationStep(ActivationStepMetrics),
    ConductorStep(ConductorStepMetrics),
    TrainStep(TrainStepMetrics),
    /// Where the step's time went.
    StepTime(StepTimeBreakdown),

    // ---- health --------------------------------------------------------------------------
    /// Something a user should know about.
    Warning { source: Owner, message: String },
    /// The bus dropped events because consumers fell behind; `total` counts all drops so far.
    EventsDropped { total: u64 },
    /// A telemetry sink failed to write `lost` events (a full disk, a closed pipe); `total`
    /// counts every event that sink lost so far.
    TelemetryLost { sink: String, lost: u64, total: u64, reason: String },
    /// A non-finite value (NaN or infinity) in a block's output or gradient, or in the loss.
    NonFinite {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block: Option<BlockId>,
        /// What held it: "output", "gradient" or "loss".
        tensor: String,
    },
    /// The flight recorder wrote its ring of recent full-detail events to a file.
    FlightRecorded { reason: String, path: String, events: u64 },
}

impl EventKind {
    /// The `kind` tag of this event, as on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::RunStarted { .. } => "run_started",
            EventKind::RunEnded { .. } => "run_ended",
            EventKind::PhaseChanged { .. } => "phase_changed",
            EventKind::BlockRegistered { .. } => "block_registered",
            EventKind::ItineraryLearned { .. } => "itinerary_learned",
            EventKind::ItineraryChanged { .. } => "itinerary_changed",
            EventKind::Residency { .. } => "residency",
            EventKind::PrefetchHit { .. } => "prefetch_hit",
            EventKind::PrefetchMiss { .. } => "prefetch_miss",
            EventKind::Eviction { .. } => "eviction",
            EventKind::PrefetchWindow { .. } => "prefetch_window",
            EventKind::Protection { .. } => "protection",
            EventKind::TransferIssued { .. } => "transfer_issued",
            EventKind::TransferCompleted { .. } => "transfer_completed",
            EventKind::PoolConfigured { .. } => "pool_configured",
            EventKind::SlabAcquired { .. } => "slab_acquired",
            EventKind::SlabReleased { .. } => "slab_released",
            EventKind::PoolExhausted { .. } => "pool_exhausted",
            EventKind::PageableFallback { .. } => "pageable_fallback",
            EventKind::Pack { .. } => "pack",
            EventKind::SpillFinalized { .. } => "spill_finalized",
            EventKind::Restored { .. } => "restored",
            EventKind::SpillingToggled { .. } => "spilling_toggled",
            EventKind::Reservation { .. } => "reservation",
            EventKind::ReservationReleased { .. } => "reservation_released",
            EventKind::SlotGranted { .. } => "slot_granted",
            EventKind::SlotDenied { .. } => "slot_denied",
            EventKind::SlotReleased { .. } => "slot_released",
            EventKind::HintsChanged { .. } => "hints_changed",
            EventKind::VramSample { .. } => "vram_sample",
            EventKind::LimitsSet { .. } => "limits_set",
            EventKind::VramOwners(_) => "vram_owners",
            EventKind::OutOfMemory { .. } => "out_of_memory",
            EventKind::WeightStep(_) => "weight_step",
            EventKind::ActivationStep(_) => "activation_step",
            EventKind::ConductorStep(_) => "conductor_step",
            EventKind::TrainStep(_) => "train_step",
            EventKind::StepTime(_) => "step_time",
            EventKind::Warning { .. } => "warning",
            EventKind::EventsDropped { .. } => "events_dropped",
            EventKind::TelemetryLost { .. } => "telemetry_lost",
            EventKind::NonFinite { .. } => "non_finite",
            EventKind::FlightRecorded { .. } => "flight_recorded",
        }
    }

    /// The block this event is about, if any (for filters).
    pub fn block(&self) -> Option<BlockId> {
        match self {
            EventKind::BlockRegistered { block, .. }
            | EventKind::Residency { block, .. }
            | EventKind::PrefetchHit { block }
            | EventKind::PrefetchMiss { block, .. }
            | EventKind::Eviction { block, .. }
            | EventKind::Protection { block, .. } => Some(*block),
            _ => None,
        }
    }
}

/// The wire name of a unit-variant enum value (its serde tag), e.g. `"watermark"` for
/// [`EvictionReason::Watermark`]; empty for values that do not serialize to a string.
pub fn wire_name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The envelope every event travels in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Schema version ([`SCHEMA_VERSION`]).
    pub v: u32,
    /// Sequence number, assigned at publish; gaps mean dropped events.
    pub seq: u64,
    /// Nanoseconds since the run started, on a monotonic clock.
    pub t_ns: u64,
    /// The training step the event belongs to (0 before the first step).
    pub step: u64,
    /// The phase of that step.
    pub phase: Phase,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

impl Event {
    /// An event with the current schema version.
    pub fn new(seq: u64, t_ns: u64, step: u64, phase: Phase, kind: EventKind) -> Event {
        Event {
            v: SCHEMA_VERSION,
            seq,
            t_ns,
            step,
            phase,
            kind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_is_flat_and_tagged() {
        let e = Event::new(
            42,
            1_200_345,
            3,
            Phase::Forward,
            EventKind::Residency {
                block: BlockId(5),
                from: BlockState::Prefetching,
                to: BlockState::GpuReady,
                refcount: 0,
            },
        );
        let json = serde_json::to_value(&e).expect("serializes");
        assert_eq!(json["kind"], "residency");
        assert_eq!(json["to"], "gpu_ready");
        assert_eq!(json["block"], 5);
        assert_eq!(json["phase"], "forward");
        let back: Event = serde_json::from_value(json).expect("round-trips");
        assert_eq!(back, e);
        assert_eq!(back.kind.name(), "residency");
    }

    #[test]
    fn per_step_metrics_keep_the_seed_field_names() {
        let e = EventKind::ActivationStep(ActivationStepMetrics {
            activations_spilled: 7,
            ..Default::default()
        });
        let json = serde_json::to_value(&e).expect("serializes");
        for field in [
            "activations_saved",
            "activations_kept",
            "activations_spilled",
            "activations_restored",
            "spill_bytes",
            "restore_bytes",
            "stall_time_ms",
            "stall_count",
            "pool_hits",
            "pool_misses",
            "vram_peak_mb",
        ] {
            assert!(json.get(field).is_some(), "missing {field}");
        }
        assert_eq!(json["kind"], "activation_step");
    }

    #[test]
    fn every_kind_name_matches_its_serde_tag() {
        let kinds = vec![
            EventKind::RunEnded { steps: 1 },
            EventKind::WeightStep(WeightStepMetrics::default()),
            EventKind::EventsDropped { total: 3 },
            EventKind::HintsChanged {
                hints: Hints::default(),
                rule: PolicyRule::Contention,
            },
            EventKind::PageableFallback {
                pool: PoolKind::Activations,
                bytes: 1,
            },
        ];
        for k in kinds {
            let json = serde_json::to_value(&k).expect("serializes");
            assert_eq!(json["kind"], k.name());
        }
    }

    #[test]
    fn wire_names_are_serde_tags() {
        assert_eq!(wire_name(&EvictionReason::Watermark), "watermark");
        assert_eq!(wire_name(&KeepReason::TailOfForward), "tail_of_forward");
        assert_eq!(wire_name(&42u32), "");
    }

    #[test]
    fn residency_edges_are_the_seeds_eight() {
        let valid = BlockState::ALL
            .iter()
            .flat_map(|a| BlockState::ALL.iter().map(move |b| (*a, *b)))
            .filter(|(a, b)| a.can_transition_to(*b))
            .count();
        assert_eq!(valid, 8);
        assert!(!BlockState::GpuReady.can_transition_to(BlockState::GpuReady));
    }
}
