//! The current picture of a run, kept by one pure reducer: [`Snapshot::apply`].
//!
//! Every consumer (the terminal UI, the web page, the exporters, replay) holds or receives a
//! `Snapshot` and advances it with the same `apply`, so they cannot disagree. `apply` reads only
//! the event: no clock, no I/O, so a replayed file yields exactly the snapshot the live run had.

use super::model::*;
use serde::{Deserialize, Serialize};
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
        self.classes.iter().map(|c| c.slab_bytes * c.slabs as u64).sum()
    }
    /// Bytes in slabs that are taken.
    pub fn in_use_bytes(&self) -> u64 {
        self.classes.iter().map(|c| c.slab_bytes * c.in_use as u64).sum()
    }
}

/// One direction of PCIe traffic.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DirectionView {
    pub inflight: u32,
    pub count: u64,
    pub bytes: u64,
    /// Sum of copy durations, for mean throughput.
    pub busy_ms: f64,
    /// Throughput of the last completed copy, GB/s.
    pub last_gbps: f64,
}

impl DirectionView {
    /// Mean throughput over all completed copies, GB/s.
    pub fn mean_gbps(&self) -> f64 {
        if self.busy_ms > 0.0 {
            self.bytes as f64 / (self.busy_ms * 1e6)
        } else {
            0.0
        }
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
    pub duration_ms: f64,
}

/// Copies in both directions.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TransfersView {
    pub h2d: DirectionView,
    pub d2h: DirectionView,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<TransferRecord>))]
    pub recent: VecDeque<TransferRecord>,
}

impl TransfersView {
    /// The view of one direction.
    pub fn dir(&self, d: Direction) -> &DirectionView {
        match d {
            Direction::H2d => &self.h2d,
            Direction::D2h => &self.d2h,
        }
    }
    fn dir_mut(&mut self, d: Direction) -> &mut DirectionView {
        match d {
            Direction::H2d => &mut self.h2d,
            Direction::D2h => &mut self.d2h,
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
    pub last_step: Option<WeightStepMetrics>,
}

impl WeightTotals {
    /// Hits over hits plus misses, 0 when there were none.
    pub fn hit_rate(&self) -> f64 {
        let n = self.prefetch_hits + self.prefetch_misses;
        if n == 0 {
            0.0
        } else {
            self.prefetch_hits as f64 / n as f64
        }
    }
}

/// Activation runtime totals over the run.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ActivationTotals {
    pub saved: u64,
    pub kept: u64,
    pub spilled: u64,
    pub weight_handles: u64,
    pub duplicates: u64,
    pub restored: u64,
    pub predicted: u64,
    pub finalized_inline: u64,
    pub spill_bytes: u64,
    pub restore_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub pool_hits: u64,
    pub pool_misses: u64,
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
    /// Device memory by owner at the step's peak (the largest allocation seen in the step).
    #[serde(default)]
    pub vram_at_peak: Option<VramByOwner>,
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
    pub vram: Option<VramReading>,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<VramReading>))]
    pub vram_history: VecDeque<VramReading>,
    /// Each owner's limits, as last published.
    #[serde(default)]
    pub limits: BTreeMap<Owner, OwnerLimits>,
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
    pub blocks: Vec<BlockView>,
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
}

fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(item);
}

fn bump(map: &mut BTreeMap<String, u64>, key: &str) {
    *map.entry(key.to_owned()).or_insert(0) += 1;
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

    /// The block with this id, if registered.
    pub fn block(&self, id: BlockId) -> Option<&BlockView> {
        self.blocks.get(id.0 as usize).filter(|b| b.id == id)
    }

    /// Number of blocks in each residency state.
    pub fn residency_counts(&self) -> BTreeMap<BlockState, u32> {
        let mut m = BTreeMap::new();
        for b in &self.blocks {
            *m.entry(b.state).or_insert(0) += 1;
        }
        m
    }

    /// The record of `step`, if still in the history.
    pub fn step_record(&self, step: u64) -> Option<&StepRecord> {
        self.steps.iter().rev().find(|r| r.step == step)
    }

    fn step_record_mut(&mut self, step: u64) -> &mut StepRecord {
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
                self.steps.back_mut().expect("just pushed a step record")
            }
        }
    }

    fn block_mut(&mut self, id: BlockId) -> Option<&mut BlockView> {
        self.blocks.get_mut(id.0 as usize).filter(|b| b.id == id)
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut PoolView {
        let slot = match pool {
            PoolKind::Weights => &mut self.weight_pool,
            PoolKind::Activations => &mut self.activation_pool,
        };
        slot.get_or_insert_with(PoolView::default)
    }

    fn class_mut(&mut self, pool: PoolKind, class: u32) -> &mut ClassView {
        let p = self.pool_mut(pool);
        let i = class as usize;
        if p.classes.len() <= i {
            p.classes.resize(i + 1, ClassView::default());
        }
        &mut p.classes[i]
    }

    /// Advances the snapshot by one event. Pure: the result depends only on `self` and `e`.
    pub fn apply(&mut self, e: &Event) {
        self.last_seq = self.last_seq.max(e.seq);
        self.events_applied += 1;
        self.t_ns = self.t_ns.max(e.t_ns);
        if e.step > self.step {
            self.step = e.step;
        }
        bump(&mut self.event_counts, e.kind.name());

        match &e.kind {
            EventKind::RunStarted {
                run_id,
                wall_clock_unix_ms,
                device,
                model,
                versions,
                config,
            } => {
                self.run = Some(RunInfo {
                    run_id: run_id.clone(),
                    wall_clock_unix_ms: *wall_clock_unix_ms,
                    device: device.clone(),
                    model: model.clone(),
                    versions: versions.clone(),
                    config: config.clone(),
                });
                self.ended = false;
            }
            EventKind::RunEnded { .. } => self.ended = true,
            EventKind::PhaseChanged { from, to, .. } => {
                if *from != Phase::Idle && *from != *to {
                    push_bounded(
                        &mut self.phase_spans,
                        PhaseSpan {
                            step: e.step,
                            phase: *from,
                            start_ns: self.phase_started_ns,
                            end_ns: e.t_ns,
                        },
                        PHASE_SPANS,
                    );
                }
                self.phase = *to;
                self.phase_started_ns = e.t_ns;
                self.step = e.step;
                if *to == Phase::StepBegin {
                    self.step_record_mut(e.step);
                }
            }
            EventKind::BlockRegistered {
                block,
                name,
                bytes,
                exec_order,
                file_backed,
                trainable,
            } => {
                let i = block.0 as usize;
                if self.blocks.len() <= i {
                    self.blocks.resize_with(i + 1, BlockView::default);
                }
                self.blocks[i] = BlockView {
                    id: *block,
                    name: name.clone(),
                    bytes: *bytes,
                    exec_order: *exec_order,
                    file_backed: *file_backed,
                    trainable: *trainable,
                    last: "registered".into(),
                    last_seq: e.seq,
                    ..Default::default()
                };
                for (i, b) in self.blocks.iter_mut().enumerate() {
                    b.id = BlockId(i as u32);
                }
            }
            EventKind::ItineraryLearned { order } => self.itinerary.order = order.clone(),
            EventKind::Residency {
                block,
                from,
                to,
                refcount,
            } => {
                let seq = e.seq;
                if let Some(b) = self.block_mut(*block) {
                    b.state = *to;
                    b.refcount = *refcount;
                    b.last = format!("{from} -> {to}");
                    b.last_seq = seq;
                    if *to == BlockState::GpuReady {
                        b.loads += 1;
                    }
                }
            }
            EventKind::PrefetchHit { block } => {
                self.weights.prefetch_hits += 1;
                let seq = e.seq;
                if let Some(b) = self.block_mut(*block) {
                    b.last = "prefetch hit".into();
                    b.last_seq = seq;
                }
            }
            EventKind::PrefetchMiss { block, stall_ms } => {
                self.weights.prefetch_misses += 1;
                self.weights.stall_time_ms += stall_ms;
                let seq = e.seq;
                if let Some(b) = self.block_mut(*block) {
                    b.last = format!("miss, stalled {stall_ms:.2} ms");
                    b.last_seq = seq;
                }
            }
            EventKind::Eviction {
                block,
                reason,
                score,
                ..
            } => {
                self.weights.evictions += 1;
                let seq = e.seq;
                if let Some(b) = self.block_mut(*block) {
                    b.evictions += 1;
                    b.last = format!("evicted ({}, score {score:.3e})", wire_name(reason));
                    b.last_seq = seq;
                }
            }
            EventKind::PrefetchWindow {
                cursor,
                backward,
                window,
            } => {
                self.itinerary.cursor = *cursor;
                self.itinerary.backward = *backward;
                self.itinerary.window = window.clone();
            }
            EventKind::Protection { block, protected } => {
                if let Some(b) = self.block_mut(*block) {
                    b.protected = *protected;
                }
            }
            EventKind::TransferIssued { dir, .. } => {
                self.transfers.dir_mut(*dir).inflight += 1;
            }
            EventKind::TransferCompleted {
                id,
                dir,
                owner,
                bytes,
                duration_ms,
            } => {
                let d = self.transfers.dir_mut(*dir);
                d.inflight = d.inflight.saturating_sub(1);
                d.count += 1;
                d.bytes += bytes;
                d.busy_ms += duration_ms;
                if *duration_ms > 0.0 {
                    d.last_gbps = *bytes as f64 / (duration_ms * 1e6);
                }
                match (owner, dir) {
                    (Owner::Weights, Direction::H2d) => self.weights.h2d_bytes += bytes,
                    (Owner::Weights, Direction::D2h) => self.weights.d2h_bytes += bytes,
                    _ => {}
                }
                push_bounded(
                    &mut self.transfers.recent,
                    TransferRecord {
                        seq: e.seq,
                        t_ns: e.t_ns,
                        id: *id,
                        dir: *dir,
                        owner: *owner,
                        bytes: *bytes,
                        duration_ms: *duration_ms,
                    },
                    RECENT_TRANSFERS,
                );
            }
            EventKind::PoolConfigured {
                pool,
                classes,
                pinned,
            } => {
                let p = self.pool_mut(*pool);
                *p = PoolView {
                    pinned: *pinned,
                    classes: classes
                        .iter()
                        .map(|c| ClassView {
                            slab_bytes: c.slab_bytes,
                            slabs: c.slabs,
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                };
            }
            EventKind::SlabAcquired {
                pool,
                class,
                waited_ms,
                ..
            } => {
                let c = self.class_mut(*pool, *class);
                c.in_use += 1;
                c.hits += 1;
                c.peak_in_use = c.peak_in_use.max(c.in_use);
                self.pool_mut(*pool).total_wait_ms += waited_ms;
            }
            EventKind::SlabReleased { pool, class, .. } => {
                let c = self.class_mut(*pool, *class);
                c.in_use = c.in_use.saturating_sub(1);
            }
            EventKind::PoolExhausted { pool, class, .. } => {
                self.class_mut(*pool, *class).exhausted += 1;
            }
            EventKind::PageableFallback { pool, bytes } => {
                let p = self.pool_mut(*pool);
                p.pageable_fallbacks += 1;
                p.pageable_bytes += bytes;
            }
            EventKind::Pack {
                decision,
                reason,
                bytes,
                pool_hit,
                ..
            } => {
                let a = &mut self.activations;
                a.saved += 1;
                match decision {
                    PackDecision::Kept => {
                        a.kept += 1;
                        if let Some(r) = reason {
                            bump(&mut a.kept_by_reason, &wire_name(r));
                        }
                    }
                    PackDecision::Spilled => {
                        a.spilled += 1;
                        a.spill_bytes += bytes;
                        match pool_hit {
                            Some(true) => a.pool_hits += 1,
                            Some(false) => a.pool_misses += 1,
                            None => {}
                        }
                    }
                    PackDecision::WeightHandle => a.weight_handles += 1,
                    PackDecision::Duplicate => a.duplicates += 1,
                }
            }
            EventKind::SpillFinalized { inline, .. } => {
                if *inline {
                    self.activations.finalized_inline += 1;
                }
            }
            EventKind::Restored {
                bytes,
                predicted,
                stall_ms,
                ..
            } => {
                let a = &mut self.activations;
                a.restored += 1;
                a.restore_bytes += bytes;
                if *predicted {
                    a.predicted += 1;
                }
                if *stall_ms > 0.0 {
                    a.stall_count += 1;
                    a.stall_time_ms += stall_ms;
                }
            }
            EventKind::SpillingToggled { on, .. } => self.activations.spilling = *on,
            EventKind::Reservation {
                owner,
                mode,
                priority,
                granted_bytes,
                outcome,
                reason,
                ..
            } => {
                let c = &mut self.conductor;
                bump(&mut c.by_mode, &wire_name(mode));
                bump(&mut c.by_priority, &wire_name(priority));
                match outcome {
                    ReservationOutcome::Granted => c.grants += 1,
                    ReservationOutcome::Partial => c.partials += 1,
                    ReservationOutcome::Denied => c.denials += 1,
                    ReservationOutcome::CapRecorded => c.ceilings += 1,
                }
                if matches!(
                    outcome,
                    ReservationOutcome::Granted | ReservationOutcome::Partial
                ) {
                    c.active_reservations += 1;
                    c.active_bytes += granted_bytes;
                }
                if let Some(r) = reason {
                    bump(&mut c.denials_by_reason, r.as_str());
                    push_bounded(
                        &mut c.recent_denials,
                        DenialRecord {
                            seq: e.seq,
                            step: e.step,
                            phase: e.phase,
                            owner: *owner,
                            what: format!("{} reservation", wire_name(mode)),
                            reason: *r,
                        },
                        RECENT_DENIALS,
                    );
                }
            }
            EventKind::ReservationReleased { bytes, .. } => {
                let c = &mut self.conductor;
                c.active_reservations = c.active_reservations.saturating_sub(1);
                c.active_bytes = c.active_bytes.saturating_sub(*bytes);
            }
            EventKind::SlotGranted { dir, inflight, .. } => {
                let c = &mut self.conductor;
                c.slot_grants += 1;
                match dir {
                    Direction::H2d => c.h2d_inflight = *inflight,
                    Direction::D2h => c.d2h_inflight = *inflight,
                }
            }
            EventKind::SlotReleased { dir, inflight, .. } => {
                let c = &mut self.conductor;
                match dir {
                    Direction::H2d => c.h2d_inflight = *inflight,
                    Direction::D2h => c.d2h_inflight = *inflight,
                }
            }
            EventKind::SlotDenied {
                dir,
                owner,
                speculative,
                reason,
            } => {
                let c = &mut self.conductor;
                c.slot_denials += 1;
                bump(&mut c.denials_by_reason, reason.as_str());
                push_bounded(
                    &mut c.recent_denials,
                    DenialRecord {
                        seq: e.seq,
                        step: e.step,
                        phase: e.phase,
                        owner: *owner,
                        what: format!(
                            "{} slot{}",
                            dir.as_str(),
                            if *speculative { " (speculative)" } else { "" }
                        ),
                        reason: *reason,
                    },
                    RECENT_DENIALS,
                );
            }
            EventKind::HintsChanged { hints, rule } => {
                let c = &mut self.conductor;
                c.hints = *hints;
                c.hints_rule = Some(*rule);
                c.hint_changes += 1;
            }
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
                self.vram = Some(r);
                push_bounded(&mut self.vram_history, r, VRAM_HISTORY);
            }
            EventKind::LimitsSet {
                owner,
                budget_bytes,
                high_watermark_bytes,
                low_watermark_bytes,
            } => {
                self.limits.insert(
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
                self.vram_owners = Some(r);
                push_bounded(&mut self.vram_owners_history, r, OWNERS_HISTORY);
                if e.step > 0 {
                    let rec = self.step_record_mut(e.step);
                    if rec.vram_at_peak.is_none_or(|p| o.allocated_bytes >= p.allocated_bytes) {
                        rec.vram_at_peak = Some(*o);
                    }
                }
            }
            EventKind::OutOfMemory {
                requested_bytes,
                owners,
                doing,
                dump,
            } => push_bounded(
                &mut self.out_of_memory,
                OomRecord {
                    seq: e.seq,
                    step: e.step,
                    phase: e.phase,
                    requested_bytes: *requested_bytes,
                    owners: *owners,
                    doing: doing.clone(),
                    dump: dump.clone(),
                },
                RECENT_INCIDENTS,
            ),
            EventKind::StepTime(t) => {
                self.step_record_mut(e.step).time = Some(*t);
            }
            EventKind::ItineraryChanged { order, .. } => {
                self.itinerary.order = order.clone();
                self.itinerary_changes += 1;
            }
            EventKind::TelemetryLost { lost, .. } => {
                self.telemetry_lost = self.telemetry_lost.saturating_add(*lost);
            }
            EventKind::NonFinite { block, tensor } => {
                bump(&mut self.non_finite, tensor);
                if self.first_non_finite_block.is_none() {
                    self.first_non_finite_block = *block;
                }
            }
            EventKind::FlightRecorded { path, .. } => {
                push_bounded(&mut self.flight_records, path.clone(), RECENT_INCIDENTS);
            }
            EventKind::WeightStep(m) => {
                self.weights.last_step = Some(m.clone());
                self.step_record_mut(e.step).weights = Some(m.clone());
            }
            EventKind::ActivationStep(m) => {
                self.activations.last_step = Some(m.clone());
                self.step_record_mut(e.step).activations = Some(m.clone());
            }
            EventKind::ConductorStep(m) => {
                self.conductor.last_step = Some(m.clone());
                self.step_record_mut(e.step).conductor = Some(m.clone());
            }
            EventKind::TrainStep(m) => {
                self.step_record_mut(e.step).train = Some(m.clone());
            }
            EventKind::Warning { source, message } => push_bounded(
                &mut self.warnings,
                WarningRecord {
                    seq: e.seq,
                    t_ns: e.t_ns,
                    step: e.step,
                    source: *source,
                    message: message.clone(),
                },
                RECENT_WARNINGS,
            ),
            EventKind::EventsDropped { total } => {
                self.dropped_events = self.dropped_events.max(*total)
            }
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

    /// The most recent step that has trainer metrics.
    pub fn last_train_step(&self) -> Option<(u64, &TrainStepMetrics)> {
        self.steps
            .iter()
            .rev()
            .find_map(|r| r.train.as_ref().map(|t| (r.step, t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, step: u64, kind: EventKind) -> Event {
        Event::new(seq, seq * 1000, step, Phase::Forward, kind)
    }

    #[test]
    fn blocks_follow_residency_and_counts_add_up() {
        let mut s = Snapshot::new();
        for i in 0..3 {
            s.apply(&ev(
                i + 1,
                0,
                EventKind::BlockRegistered {
                    block: BlockId(i as u32),
                    name: format!("blocks.{i}"),
                    bytes: 100,
                    exec_order: i as u32,
                    file_backed: false,
                    trainable: false,
                },
            ));
        }
        s.apply(&ev(
            4,
            1,
            EventKind::Residency {
                block: BlockId(1),
                from: BlockState::Unloaded,
                to: BlockState::HostStaged,
                refcount: 0,
            },
        ));
        s.apply(&ev(5, 1, EventKind::PrefetchHit { block: BlockId(1) }));
        s.apply(&ev(
            6,
            1,
            EventKind::PrefetchMiss {
                block: BlockId(2),
                stall_ms: 1.5,
            },
        ));
        assert_eq!(s.blocks.len(), 3);
        assert_eq!(s.block(BlockId(1)).map(|b| b.state), Some(BlockState::HostStaged));
        assert_eq!(s.residency_counts()[&BlockState::Unloaded], 2);
        assert_eq!(s.weights.hit_rate(), 0.5);
        assert_eq!(s.weights.stall_time_ms, 1.5);
        assert_eq!(s.last_seq, 6);
        assert_eq!(s.step, 1);
        assert_eq!(s.event_counts["block_registered"], 3);
    }

    #[test]
    fn pools_track_slabs_by_class() {
        let mut s = Snapshot::new();
        s.apply(&ev(
            1,
            0,
            EventKind::PoolConfigured {
                pool: PoolKind::Activations,
                classes: vec![
                    PoolClass { slab_bytes: 1 << 20, slabs: 4 },
                    PoolClass { slab_bytes: 4 << 20, slabs: 2 },
                ],
                pinned: true,
            },
        ));
        for seq in 2..4 {
            s.apply(&ev(
                seq,
                0,
                EventKind::SlabAcquired {
                    pool: PoolKind::Activations,
                    class: 1,
                    slab: SlabId(seq as u32),
                    bytes: 3 << 20,
                    waited_ms: 0.0,
                },
            ));
        }
        s.apply(&ev(
            4,
            0,
            EventKind::SlabReleased {
                pool: PoolKind::Activations,
                class: 1,
                slab: SlabId(2),
            },
        ));
        let p = s.activation_pool.as_ref().expect("pool configured");
        assert_eq!(p.classes[1].in_use, 1);
        assert_eq!(p.classes[1].peak_in_use, 2);
        assert_eq!(p.capacity_bytes(), (4 << 20) + (8 << 20));
    }

    #[test]
    fn phase_changes_build_spans_and_step_records() {
        let mut s = Snapshot::new();
        let mut seq = 0;
        let mut phase = |s: &mut Snapshot, t: u64, from, to| {
            seq += 1;
            s.apply(&Event::new(
                seq,
                t,
                7,
                to,
                EventKind::PhaseChanged {
                    from,
                    to,
                    duration_s: 0.0,
                },
            ));
        };
        phase(&mut s, 10, Phase::Idle, Phase::StepBegin);
        phase(&mut s, 20, Phase::StepBegin, Phase::Forward);
        phase(&mut s, 50, Phase::Forward, Phase::Backward);
        assert_eq!(s.phase, Phase::Backward);
        assert_eq!(s.phase_spans.len(), 2);
        let fwd = &s.phase_spans[1];
        assert_eq!((fwd.phase, fwd.start_ns, fwd.end_ns), (Phase::Forward, 20, 50));
        assert!(s.step_record(7).is_some());
    }

    #[test]
    fn apply_is_deterministic() {
        let events: Vec<Event> = (1..50)
            .map(|i| {
                ev(
                    i,
                    i / 10,
                    EventKind::VramSample {
                        allocated_bytes: i * 10,
                        reserved_bytes: i * 20,
                        peak_allocated_bytes: i * 10,
                    },
                )
            })
            .collect();
        assert_eq!(Snapshot::from_events(&events), Snapshot::from_events(&events));
        assert_eq!(Snapshot::from_events(&events).vram_history.len(), 49);
    }
}
