//! The value types events carry: phases, residency states, owners, reasons, modes.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The phase of a training step that an event belongs to.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, PartialOrd, Ord, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Phase {
    /// Outside any step (set-up, between steps, shutdown).
    #[default]
    Idle,
    StepBegin,
    Forward,
    Backward,
    Optimizer,
    StepEnd,
    /// Between training steps, forwards outside a step: evaluation, sampling, inference through
    /// the handle. Its events belong to the last training step (`step`), and it never counts as
    /// a step.
    Eval,
}

impl Phase {
    /// Every phase, in step order (evaluation, outside steps, last).
    pub const ALL: [Phase; 7] = [
        Phase::Idle,
        Phase::StepBegin,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::StepEnd,
        Phase::Eval,
    ];

    /// The name used on the wire and in labels (derived from the variant, as serde's).
    pub fn as_str(self) -> &'static str {
        self.into()
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

/// Residency of a weight block: where its weights are, and what is moving them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, PartialOrd, Ord, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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

    /// The name used on the wire and in labels (derived from the variant, as serde's).
    pub fn as_str(self) -> &'static str {
        self.into()
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Direction {
    /// Host to device.
    H2d,
    /// Device to host.
    D2h,
    /// Between the devices of a data-parallel group: a collective (a reduce-scatter of a
    /// block's gradients, an all-reduce), measured on the device that queued it.
    Collective,
}

impl Direction {
    /// The name used on the wire and in labels (derived from the variant, as serde's).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Which runtime an event, a copy or a reservation belongs to.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Owner {
    Weights,
    Activations,
    Conductor,
    Trainer,
    /// The device as a whole (the one budget a run is given).
    Device,
}

impl Owner {
    /// The name used on the wire and in labels (derived from the variant, as serde's).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// The kind of device a run uses.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum PoolKind {
    /// The uniform-slab pinned pool of the weight runtime.
    Weights,
    /// The size-class pinned pool of the activation runtime.
    Activations,
}

/// What the pack hook decided for one saved tensor.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum PackDecision {
    /// Stays on the device; `reason` says why.
    Kept,
    /// Copied to a pinned host buffer and released on the device.
    Spilled,
    /// A managed weight, stored as a handle to its block.
    WeightHandle,
    /// Another save of a tensor already handled in this step.
    Duplicate,
    /// Not stored: computed again in backward from its recompute scope's sources.
    Recomputed,
}

/// Why a saved tensor was kept on the device.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
    /// Every pinned slab that fits it is in use and the pageable fallback is off.
    PoolExhausted,
    /// Spilling is paused (`max_inflight_d2h` is 0, as the Conductor sets it in OPTIMIZER).
    SpillsPaused,
    /// Chosen to spill with its block's batch, but released before the batch was copied: it
    /// never left the device.
    ReleasedBeforeCopy,
    /// Of an element kind tch cannot name (flash attention on CUDA saves its RNG seed and offset
    /// as unsigned 64-bit scalars): kept as it is.
    UnnamedKind,
}

/// How a Conductor reservation may be granted.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Priority {
    Critical,
    Required,
    Speculative,
    Background,
}

/// The resource a reservation is for.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Resource {
    Vram,
    PinnedHost,
}

/// How a reservation request ended.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum ReservationOutcome {
    Granted,
    Partial,
    Denied,
    /// A ceiling was recorded; nothing was granted.
    CapRecorded,
}

/// Why the Conductor refused a reservation or a transfer slot.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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
    /// Every reason, in declaration order.
    pub const ALL: [DenyReason; 7] = [
        DenyReason::InsufficientHeadroom,
        DenyReason::PriorityReserve,
        DenyReason::OverCeiling,
        DenyReason::H2dSlotsExhausted,
        DenyReason::D2hSlotsExhausted,
        DenyReason::PhaseRuleSuppressedSpeculative,
        DenyReason::Shutdown,
    ];

    /// The name used on the wire and in labels (derived from the variant, as serde's).
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// What the refusal means, in a sentence a user reads beside it.
    pub fn meaning(self) -> &'static str {
        match self {
            DenyReason::InsufficientHeadroom => {
                "not enough room under the VRAM cap for the request's mode: work that can wait (a prefetch, a restore ahead of need) waits until memory frees"
            }
            DenyReason::PriorityReserve => {
                "near the cap, room is kept back for higher priorities (a 64th of the budget per level on the handle): a speculative request, a prefetch or a restore ahead of need, waits so that what the step needs now always finds room"
            }
            DenyReason::OverCeiling => "the owner asked beyond a ceiling it recorded for itself (an upper bound it set as a hint)",
            DenyReason::H2dSlotsExhausted => {
                "every host-to-device transfer slot was taken: a speculative copy waits for one to free (required copies are never refused)"
            }
            DenyReason::D2hSlotsExhausted => {
                "every device-to-host transfer slot was taken: a speculative copy waits for one to free (required copies are never refused)"
            }
            DenyReason::PhaseRuleSuppressedSpeculative => {
                "the optimizer phase holds speculative copies back so they do not compete with the optimizer's own memory traffic; they resume at the next step"
            }
            DenyReason::Shutdown => "the Conductor was shut down (the run ended)",
        }
    }

    /// Whether the refusal is a problem ([`Concern`]).
    pub fn concern(self) -> Concern {
        match self {
            DenyReason::InsufficientHeadroom | DenyReason::H2dSlotsExhausted | DenyReason::D2hSlotsExhausted => {
                Concern::IfStallsFollow
            }
            DenyReason::PriorityReserve
            | DenyReason::OverCeiling
            | DenyReason::PhaseRuleSuppressedSpeculative
            | DenyReason::Shutdown => Concern::ByDesign,
        }
    }
}

/// Whether a Conductor refusal is bad. None is an error by itself: the Conductor refuses only
/// work that can wait (speculative copies, reservations that may be partial), never a copy the
/// step needs now.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Concern {
    /// Not bad: the Conductor holding back work that can wait, as designed. Nothing to do.
    ByDesign,
    /// Not bad by itself; bad only when the step then stalls on what was held back (the
    /// findings `weight_stalls`, `restore_stalls`, `prefetch_late` say so, with the knob).
    IfStallsFollow,
}

impl Concern {
    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Whether it is bad, in words.
    pub fn verdict(self) -> &'static str {
        match self {
            Concern::ByDesign => "not bad: by design",
            Concern::IfStallsFollow => "bad only if stalls follow",
        }
    }
}

/// The Conductor's policy rules: why it changed the hints it gives the runtimes.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, strum::IntoStaticStr, strum::VariantNames, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
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

impl Hints {
    /// The limit on copies in flight in `dir` (`None`: the transfer pool's own size).
    pub fn max_inflight(&self, dir: Direction) -> Option<u32> {
        match dir {
            Direction::H2d => self.max_inflight_h2d,
            Direction::D2h => self.max_inflight_d2h,
            // Collectives take no transfer slot.
            Direction::Collective => None,
        }
    }
}

/// One size class of a pool, as configured.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolClass {
    pub slab_bytes: u64,
    pub slabs: u32,
}

