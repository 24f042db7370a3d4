//! The event model: every decision the runtimes make, as one serde-tagged enum.
//!
//! This module is the one place where the wire format is defined: the envelope and the kinds
//! here, the value types in `values`, the per-step metrics in `metrics`. Each event is an [`Event`]
//! envelope (schema version, sequence number, monotonic time, step, phase) around an
//! [`EventKind`]; what held the device at an out-of-memory is in `holdings`. On the wire (JSONL,
//! SSE, WebSocket) an event is one JSON object whose `kind` field names the variant, e.g.
//!
//! ```json
//! {"v":1,"seq":42,"t_ns":1200345,"step":3,"phase":"forward",
//!  "kind":"residency","block":5,"name":"blocks.5","from":"prefetching","to":"gpu_ready","refcount":0}
//! ```
//!
//! `t_ns` counts nanoseconds on a monotonic clock from the run's start; the `run_started` event
//! carries the wall-clock anchor (`wall_clock_unix_ms`) that turns it into a date. In a
//! data-parallel run each event also carries `"dev"`, the device whose lane it belongs to (with
//! that lane's step and phase).

mod counts;
mod holdings;
mod metrics;
mod models;
mod quant;
mod values;

pub use counts::*;
pub use holdings::*;
pub use metrics::*;
pub use models::*;
pub use quant::*;
pub use values::*;

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
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    TransferId(u64)
);
id_newtype!(
    /// A Conductor reservation, unique within a run.
    ReservationId(u64)
);

/// Every event the runtimes, the Conductor and the trainer emit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
    /// The host optimizer stepped a streamed block (in a data-parallel group, this device's
    /// shard of it), on its own thread while training went on; published as the step ended, so
    /// it carries the training step and phase of that moment. It was queued `queued_ms` before
    /// it started, waited `waited_ms` for its gradients (and any load still reading the block)
    /// to land, and updated the block's master values, optimizer state and streamed copy in
    /// `ran_ms`.
    HostStep { block: BlockId, queued_ms: f64, waited_ms: f64, ran_ms: f64 },
    /// A frozen block was quantized: its host copy and its loads are its quantized payload, and
    /// what that cost in accuracy.
    Quantized(QuantizationReport),
    /// A model of a handle that runs several (a trained one and frozen ones: a teacher, a
    /// reference) and its blocks; published again with every block it gains later. Its blocks
    /// share the one budget, pinned pool, room and Conductor with the other models'.
    ModelRegistered {
        model: String,
        blocks: Vec<BlockId>,
        frozen: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quantized: Option<QuantFormat>,
    },
    /// Device memory and residency by model (with `vram_owners`, when a handle runs several).
    ModelMemory { models: Vec<ModelMemory> },

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
    /// A copy completed. `duration_ms` is the copy's time on its stream, measured between
    /// events around it, for the timed copies only: on CUDA one copy in 16 per stream (a timed
    /// event on a copy stream holds up the next copy), on the host device every copy. Absent
    /// for the others, never estimated.
    TransferCompleted {
        id: TransferId,
        dir: Direction,
        owner: Owner,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        duration_ms: Option<f64>,
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
    /// `peak_allocated_bytes` is the most allocated since the step began (the device's peak
    /// counter is reset as each step begins; before the first step, since the run began), so
    /// a step's last reading carries that step's peak. The run's peak is the largest of them
    /// ([`Snapshot::vram_peak_bytes`](crate::Snapshot)).
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
    /// Device memory by owner at one moment (the step's start and the end of each phase).
    VramOwners(VramByOwner),
    /// The spill watermarks moved during the run: why, from what, to what.
    /// The handle moves them after the first step (from what it measured above its
    /// watermark) and lowers them after a step that came near the budget or went over it.
    WatermarksMoved {
        /// The watermarks before the move, high then low.
        from_high_bytes: u64,
        from_low_bytes: u64,
        /// The watermarks now.
        high_bytes: u64,
        low_bytes: u64,
        /// Why, in a sentence.
        reason: String,
    },
    /// A device allocation failed: what held the device at that moment, and what was next.
    OutOfMemory {
        requested_bytes: u64,
        owners: VramByOwner,
        /// What the runtime was doing ("loading block 'blocks.3'", "restoring tensor 812").
        doing: String,
        /// The flight-recorder file written for it, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dump: Option<String>,
        /// What held the device in detail: blocks and their states, activations, copies,
        /// reservations, and the allocator's message (absent from older files).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        held: Option<Box<DeviceHoldings>>,
    },

    // ---- per-step metrics ----------------------------------------------------------------
    WeightStep(WeightStepMetrics),
    ActivationStep(ActivationStepMetrics),
    ConductorStep(ConductorStepMetrics),
    TrainStep(TrainStepMetrics),
    /// Where the step's time went.
    StepTime(StepTimeBreakdown),
    /// Forwards run outside training steps (phase `eval`), summed when the evaluation ended.
    Evaluation(EvaluationMetrics),
    /// The step's copies by direction. The bus adds it when a step closes (the next step
    /// begins, the run goes idle or ends), summed from the step's `transfer_completed` events,
    /// so that a summary-level file still carries the run's transfer totals.
    TransferStep(TransferStepMetrics),
    /// The step's detail events counted by label (see [`StepCounts`]). The bus adds it beside
    /// `transfer_step` when a step closes, so a summary-level file replays every breakdown and
    /// histogram the views and exporters keep.
    StepCounts(Box<StepCounts>),

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
    /// The `kind` tag of this event, as on the wire. Derived from the variant's name with
    /// the same snake_case rule serde applies (a test checks the two agree for every kind).
    pub fn name(&self) -> &'static str {
        self.into()
    }

    /// Every `kind` tag, in declaration order.
    pub fn names() -> &'static [&'static str] {
        <EventKind as strum::VariantNames>::VARIANTS
    }

    /// The block this event is about, if any (for filters).
    pub fn block(&self) -> Option<BlockId> {
        match self {
            EventKind::BlockRegistered { block, .. }
            | EventKind::Residency { block, .. }
            | EventKind::PrefetchHit { block }
            | EventKind::PrefetchMiss { block, .. }
            | EventKind::Eviction { block, .. }
            | EventKind::Protection { block, .. }
            | EventKind::HostStep { block, .. } => Some(*block),
            EventKind::Quantized(r) => Some(r.block),
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
    /// The device the event comes from, in a data-parallel run (each GPU its own lane, with its
    /// own step and phase); absent in a run on one device and in older files. On the wire it is
    /// `dev` (`run_started` has a `device` of its own, the run's description).
    #[serde(default, rename = "dev", skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
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
            device: None,
            kind,
        }
    }

    /// The event, from `device`'s lane.
    pub fn on_device(mut self, device: Option<u32>) -> Event {
        self.device = device;
        self
    }
}

#[cfg(test)]
mod tests;
