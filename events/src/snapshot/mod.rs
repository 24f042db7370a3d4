//! The current picture of a run, kept by one pure reducer: [`Snapshot::apply`].
//!
//! Every consumer (the terminal UI, the web page, the exporters, replay) holds or receives a
//! `Snapshot` and advances it with the same `apply`, so they cannot disagree. `apply` reads only
//! the event: no clock, no I/O, so a replayed file yields exactly the snapshot the live run had.
//!
//! Events may come from a file someone else wrote, so `apply` trusts no number in them: ids and
//! counts are bounded (an event past a bound is refused and counted in [`Snapshot::refused`]),
//! sums saturate, stored text is clipped, and structures stay small when ids are large (blocks
//! are kept in registration order and found through an index by id, never indexed by the id
//! itself). The work of one `apply` is O(log blocks) plus the size of the event.
//!
//! `apply` is split by domain: `run` (lifecycle, phases, steps, health), `weights`, `activations`,
//! `transfers`, `pools`, `conductor`, `memory`. Totals that have a per-step aggregate are kept by
//! the tallies in `tally`, and breakdowns by label by `counts` (from the `step_counts` aggregate
//! where a file has no detail), so a summary-level file shows the same figures as a full one.
//!
//! A step is *finished* ([`Snapshot::is_finished`]) once its time breakdown arrived (the last
//! thing a step publishes), a later step began, or the run went idle or ended. Whatever judges
//! or shows "the last step" (findings, the owners chart, the exporters' gauges) reads the newest
//! finished one ([`Snapshot::last_finished_step`]): the step in progress has no figures yet.

mod activations;
mod conductor;
mod counts;
pub mod lanes;
mod memory;
mod pools;
mod run;
pub mod tally;
mod transfers;
mod views;
mod weights;

#[cfg(test)]
mod tests;

pub use lanes::{Lane, LaneMemory};
pub use tally::Tallies;
pub use views::*;

use super::model::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};

/// Blocks a snapshot keeps; registrations beyond are refused ([`Refusal::TooManyBlocks`]).
pub const MAX_BLOCKS: usize = 1 << 16;
/// Size classes a pool may have; a class index at or past it is refused.
pub const MAX_POOL_CLASSES: usize = 64;
/// Longest list (itinerary, prefetch window) a snapshot stores.
pub const MAX_LIST: usize = MAX_BLOCKS;
/// Longest text (a block's name, a warning) a snapshot stores, in bytes; longer text is clipped.
pub const MAX_TEXT: usize = 1024;
/// Distinct keys of maps keyed by event text (non-finite reports by tensor); more fold into
/// `"other"`.
pub const MAX_TEXT_KEYS: usize = 32;

/// Why the reducer refused an event (the event is counted, its content ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// A block registration beyond [`MAX_BLOCKS`].
    TooManyBlocks,
    /// An event about a block that was never registered.
    UnknownBlock,
    /// A pool size class at or past [`MAX_POOL_CLASSES`].
    PoolClassOutOfRange,
    /// An itinerary, window or class list longer than [`MAX_LIST`] or [`MAX_POOL_CLASSES`].
    ListTooLong,
    /// A `step_counts` aggregate whose distributions do not fit their bounds or hold more than
    /// [`MAX_STEP_OBSERVATIONS`] values.
    UnboundedAggregate,
    /// An event of a device beyond [`lanes::MAX_LANES`] lanes.
    TooManyDevices,
}

impl Refusal {
    /// The name used as a key in [`Snapshot::refused`].
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::TooManyBlocks => "too_many_blocks",
            Refusal::UnknownBlock => "unknown_block",
            Refusal::PoolClassOutOfRange => "pool_class_out_of_range",
            Refusal::ListTooLong => "list_too_long",
            Refusal::UnboundedAggregate => "unbounded_aggregate",
            Refusal::TooManyDevices => "too_many_devices",
        }
    }
}

/// The picture of a run after some prefix of its events.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Snapshot {
    pub run: Option<RunInfo>,
    pub ended: bool,
    /// Sequence number of the last event applied (0 before any).
    pub last_seq: u64,
    pub events_applied: u64,
    /// Events the bus dropped because consumers fell behind.
    pub dropped_events: u64,
    /// Time of the last event, ns since the run started.
    pub t_ns: u64,
    pub step: u64,
    pub phase: Phase,
    pub phase_started_ns: u64,
    /// The latest reading of device memory.
    pub vram: Option<VramReading>,
    /// The run's peak: the most allocated at any moment so far (the largest step peak and
    /// reading). The one "peak VRAM" every surface shows for the run; a step's own is its
    /// `train.vram_peak_bytes`.
    #[serde(default)]
    pub vram_peak_bytes: u64,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<VramReading>))]
    pub vram_history: VecDeque<VramReading>,
    /// Each owner's limits, as last published.
    #[serde(default)]
    pub limits: BTreeMap<Owner, OwnerLimits>,
    /// Times the spill watermarks moved away from the plan's, and the last move.
    #[serde(default)]
    pub watermark_moves: u64,
    #[serde(default)]
    pub last_watermark_move: Option<WatermarkMove>,
    /// The latest reading of device memory by owner.
    #[serde(default)]
    pub vram_owners: Option<OwnersReading>,
    /// Readings by owner, for the chart of where VRAM went over recent steps.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<OwnersReading>))]
    pub vram_owners_history: VecDeque<OwnersReading>,
    /// Times the itinerary was traced again because a step ran another order.
    #[serde(default)]
    pub itinerary_changes: u64,
    /// Device allocations that failed.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<OomRecord>))]
    pub out_of_memory: VecDeque<OomRecord>,
    /// Non-finite values seen (by what held them: output, gradient, loss).
    #[serde(default)]
    pub non_finite: BTreeMap<String, u64>,
    /// The first block named by a non-finite report, if any.
    #[serde(default)]
    pub first_non_finite_block: Option<BlockId>,
    /// Flight-recorder files written (newest last).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    pub flight_records: VecDeque<String>,
    /// Events the telemetry sinks failed to write (a full disk, a closed pipe).
    #[serde(default)]
    pub telemetry_lost: u64,
    /// Registered blocks in registration order (which is id order for the runtimes, whose ids
    /// count registrations); ids need not be dense.
    pub blocks: Vec<BlockView>,
    /// Where each id is in `blocks`: derived data, rebuilt after deserializing.
    #[serde(skip)]
    block_index: BlockIndex,
    /// Number of blocks in each residency state (states with none are absent).
    #[serde(default)]
    pub residency: BTreeMap<BlockState, u32>,
    pub itinerary: ItineraryView,
    pub weight_pool: Option<PoolView>,
    pub activation_pool: Option<PoolView>,
    pub transfers: TransfersView,
    pub weights: WeightTotals,
    pub activations: ActivationTotals,
    pub conductor: ConductorView,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<PhaseSpan>))]
    pub phase_spans: VecDeque<PhaseSpan>,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<StepRecord>))]
    pub steps: VecDeque<StepRecord>,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<WarningRecord>))]
    pub warnings: VecDeque<WarningRecord>,
    pub event_counts: BTreeMap<String, u64>,
    /// Events whose content the reducer refused, by [`Refusal`] name.
    #[serde(default)]
    pub refused: BTreeMap<String, u64>,
    /// The reducer's bookkeeping for totals (see the `tally` module).
    #[serde(default)]
    pub tallies: Tallies,
    /// A data-parallel run's devices, each its lane (see the `lanes` module); empty for a run
    /// on one device.
    #[serde(default)]
    pub lanes: BTreeMap<u32, Lane>,
    /// The device the other domains follow in a data-parallel run: the first one seen.
    #[serde(default)]
    pub first_device: Option<u32>,
}

/// Position of each block id in `Snapshot::blocks`. Compares equal to any other index: it is
/// derived from `blocks`, which the comparison already covers.
#[derive(Debug, Clone, Default)]
struct BlockIndex(BTreeMap<BlockId, usize>);

impl PartialEq for BlockIndex {
    fn eq(&self, _: &BlockIndex) -> bool {
        true
    }
}

impl BlockIndex {
    fn build(blocks: &[BlockView]) -> BlockIndex {
        BlockIndex(blocks.iter().enumerate().map(|(i, b)| (b.id, i)).collect())
    }
    /// Whether the index describes `blocks` (it does unless the snapshot was deserialized).
    fn covers(&self, blocks: &[BlockView]) -> bool {
        self.0.len() == blocks.len()
    }
    fn get(&self, id: BlockId) -> Option<usize> {
        self.0.get(&id).copied()
    }
    fn insert(&mut self, id: BlockId, pos: usize) {
        self.0.insert(id, pos);
    }
}

pub(super) fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    while q.len() >= cap {
        q.pop_front();
    }
    q.push_back(item);
}

pub(super) fn bump(map: &mut BTreeMap<String, u64>, key: &str) {
    match map.get_mut(key) {
        Some(n) => *n = n.saturating_add(1),
        None => {
            map.insert(key.to_owned(), 1);
        }
    }
}

/// Like [`bump`] for keys taken from event text: at most [`MAX_TEXT_KEYS`] distinct keys.
pub(super) fn bump_text(map: &mut BTreeMap<String, u64>, key: &str) {
    let key = if map.contains_key(key) || map.len() < MAX_TEXT_KEYS {
        clip(key)
    } else {
        "other".to_owned()
    };
    bump(map, &key);
}

/// `s` cut to at most [`MAX_TEXT`] bytes, on a character boundary.
pub(super) fn clip(s: &str) -> String {
    if s.len() <= MAX_TEXT {
        return s.to_owned();
    }
    let mut end = MAX_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

impl Snapshot {
    /// An empty snapshot, before any event.
    pub fn new() -> Snapshot {
        Snapshot::default()
    }

    /// Builds a snapshot from a sequence of events.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a Event>) -> Snapshot {
        let mut s = Snapshot::new();
        for e in events {
            s.apply(e);
        }
        s
    }

    /// The block with this id, if registered: O(log n) through the index (a linear search on a
    /// snapshot just deserialized, until its first `apply` rebuilds the index).
    pub fn block(&self, id: BlockId) -> Option<&BlockView> {
        if self.block_index.covers(&self.blocks) {
            return self.block_index.get(id).and_then(|i| self.blocks.get(i)).filter(|b| b.id == id);
        }
        self.blocks.iter().find(|b| b.id == id)
    }

    /// The position of block `id` in `blocks`, rebuilding the index if it is stale.
    pub(super) fn block_pos(&mut self, id: BlockId) -> Option<usize> {
        let found = |s: &Self| s.block_index.get(id).filter(|i| s.blocks.get(*i).is_some_and(|b| b.id == id));
        if self.block_index.covers(&self.blocks) {
            if let Some(i) = found(self) {
                return Some(i);
            }
            // Not registered, or `blocks` was changed from outside: make sure.
            if !self.block_index.0.contains_key(&id) {
                return None;
            }
        }
        self.block_index = BlockIndex::build(&self.blocks);
        found(self)
    }

    /// Appends a block that is not registered yet.
    pub(super) fn push_block(&mut self, view: BlockView) {
        self.block_index.insert(view.id, self.blocks.len());
        self.blocks.push(view);
    }

    /// Number of blocks in each residency state (kept as events arrive, not recounted).
    pub fn residency_counts(&self) -> BTreeMap<BlockState, u32> {
        self.residency.clone()
    }

    /// Events refused in all (see [`Snapshot::refused`]).
    pub fn refused_total(&self) -> u64 {
        self.refused.values().fold(0, |t, n| t.saturating_add(*n))
    }

    /// The record of `step`, if still in the history.
    pub fn step_record(&self, step: u64) -> Option<&StepRecord> {
        self.steps.iter().rev().find(|r| r.step == step)
    }

    pub(super) fn step_record_mut(&mut self, step: u64) -> &mut StepRecord {
        // Steps arrive in order, so the record is almost always the last one.
        let found = self.steps.iter().rposition(|r| r.step == step);
        match found {
            Some(i) => &mut self.steps[i],
            None => {
                push_bounded(
                    &mut self.steps,
                    StepRecord {
                        step,
                        ..Default::default()
                    },
                    STEP_HISTORY,
                );
                self.steps.back_mut().expect("a step record was just pushed")
            }
        }
    }

    pub(super) fn refuse(&mut self, why: Refusal) {
        bump(&mut self.refused, why.as_str());
    }

    /// Advances the snapshot by one event. Pure: the result depends only on `self` and `e`.
    pub fn apply(&mut self, e: &Event) {
        self.last_seq = self.last_seq.max(e.seq);
        self.events_applied = self.events_applied.saturating_add(1);
        self.t_ns = self.t_ns.max(e.t_ns);
        self.step = self.step.max(e.step);
        bump(&mut self.event_counts, e.kind.name());
        if let Some(d) = e.device {
            if !lanes::apply(self, d, e) {
                return;
            }
        }
        counts::apply(self, e);

        use EventKind::*;
        match &e.kind {
            RunStarted { .. } | RunEnded { .. } | PhaseChanged { .. } | TrainStep(_)
            | StepTime(_) | Warning { .. } | EventsDropped { .. } | TelemetryLost { .. }
            | NonFinite { .. } | FlightRecorded { .. } => run::apply(self, e),
            BlockRegistered { .. } | ItineraryLearned { .. } | ItineraryChanged { .. }
            | Residency { .. } | PrefetchHit { .. } | PrefetchMiss { .. } | Eviction { .. }
            | PrefetchWindow { .. } | Protection { .. } | HostStep { .. } | WeightStep(_) | Evaluation(_)
            | Quantized(_) | ModelRegistered { .. } | ModelMemory { .. } => weights::apply(self, e),
            TransferIssued { .. } | TransferCompleted { .. } | TransferStep(_) => {
                transfers::apply(self, e)
            }
            // Counted above, for every event.
            StepCounts(_) => {}
            PoolConfigured { .. } | SlabAcquired { .. } | SlabReleased { .. }
            | PoolExhausted { .. } | PageableFallback { .. } => pools::apply(self, e),
            Pack { .. } | SpillFinalized { .. } | Restored { .. } | SpillingToggled { .. }
            | ActivationStep(_) => activations::apply(self, e),
            Reservation { .. } | ReservationReleased { .. } | SlotGranted { .. }
            | SlotDenied { .. } | SlotReleased { .. } | HintsChanged { .. } | ConductorStep(_) => {
                conductor::apply(self, e)
            }
            VramSample { .. } | LimitsSet { .. } | VramOwners(_) | OutOfMemory { .. }
            | WatermarksMoved { .. } => memory::apply(self, e),
        }
    }

    /// The device budget: the `device` owner's limit, else the Conductor's soft cap, else the
    /// device's memory from `run_started`.
    pub fn vram_budget_bytes(&self) -> Option<u64> {
        self.limits
            .get(&Owner::Device)
            .or_else(|| self.limits.get(&Owner::Conductor))
            .map(|l| l.budget_bytes)
            .or_else(|| self.run.as_ref().map(|r| r.device.total_bytes).filter(|&b| b > 0))
    }

    /// The activation spill watermarks (high, low), once published.
    pub fn spill_watermarks(&self) -> Option<(u64, u64)> {
        let l = self.limits.get(&Owner::Activations)?;
        Some((l.high_watermark_bytes?, l.low_watermark_bytes?))
    }

    /// Whether the step of `r` is over: its time breakdown arrived (the last thing a step
    /// publishes), a later step began, or the run went idle or ended.
    pub fn is_finished(&self, r: &StepRecord) -> bool {
        r.time.is_some() || r.step < self.step || self.ended || self.phase == Phase::Idle
    }

    /// The newest finished step (see [`Snapshot::is_finished`]): what "the last step" means on
    /// every surface, live and in a replay.
    pub fn last_finished_step(&self) -> Option<&StepRecord> {
        self.steps.iter().rev().find(|r| r.step > 0 && self.is_finished(r))
    }

    /// The most recent step that has trainer metrics.
    pub fn last_train_step(&self) -> Option<(u64, &TrainStepMetrics)> {
        self.steps
            .iter()
            .rev()
            .find_map(|r| r.train.as_ref().map(|t| (r.step, t)))
    }
}
