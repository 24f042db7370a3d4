//! The page's panels of state: the run header, VRAM against its limits, residency, pools,
//! copies, activations and the Conductor. Each is built from the snapshot, bounded, rounded.

use super::figures::{bytes_axis, decimal_axis, ms, round, Axis};
use serde::Serialize;
use stagehand_events::snapshot::PoolView;
use stagehand_events::{wire_name, BlockState, Concern, DenyReason, Direction, Owner, Phase, Snapshot};

/// Points of the VRAM chart at most (the snapshot keeps more; peaks survive the thinning).
pub const VRAM_POINTS: usize = 300;
/// Blocks shown in the residency grid at most.
pub const MAX_BLOCKS: usize = 1024;
/// Size classes shown per pool at most.
const MAX_CLASSES: usize = 64;
/// Characters of a name kept.
const MAX_NAME: usize = 80;
/// Denials listed.
const DENIALS: usize = 6;
/// Steps laid end to end in the phase timeline.
const TIMELINE_STEPS: usize = 3;

fn name(s: &str) -> String {
    s.chars().take(MAX_NAME).collect()
}

/// Characters of a sentence kept (a replayed file may say anything).
const MAX_SENTENCE: usize = 600;

fn name_long(s: &str) -> String {
    s.chars().take(MAX_SENTENCE).collect()
}

/// What is running, and where the stream is.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Header {
    pub run_id: Option<String>,
    pub model: Option<String>,
    pub device: Option<String>,
    pub host_simulated: bool,
    pub ended: bool,
    pub step: u64,
    pub phase: Phase,
    pub last_seq: u64,
    pub events_applied: u64,
    pub dropped_events: u64,
    pub telemetry_lost: u64,
}

pub(crate) fn header(s: &Snapshot) -> Header {
    Header {
        run_id: s.run.as_ref().map(|r| name(&r.run_id)),
        model: s.run.as_ref().map(|r| name(&r.model)),
        device: s.run.as_ref().map(|r| name(&r.device.name)),
        host_simulated: s.run.as_ref().is_some_and(|r| r.device.host_simulated()),
        ended: s.ended,
        step: s.step,
        phase: s.phase,
        last_seq: s.last_seq,
        events_applied: s.events_applied,
        dropped_events: s.dropped_events,
        telemetry_lost: s.telemetry_lost,
    }
}

/// Device memory against its limits, with its recent history.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct VramPanel {
    /// The latest reading.
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// The run's peak ([`Snapshot::vram_peak_bytes`]), once there is a reading.
    pub peak_allocated_bytes: Option<u64>,
    /// The newest finished step and its own peak (its `train.vram_peak_bytes`).
    pub last_step: Option<u64>,
    pub last_step_peak_bytes: Option<u64>,
    /// The last move of the spill watermarks, in words ("after step 1: ...").
    pub watermarks_moved: Option<String>,
    pub high_watermark_bytes: Option<u64>,
    pub low_watermark_bytes: Option<u64>,
    pub budget_bytes: Option<u64>,
    /// Seconds since the run started.
    pub t_s: Vec<f64>,
    pub allocated: Vec<u64>,
    pub reserved: Vec<u64>,
    pub axis: Axis,
}

pub(crate) fn vram(s: &Snapshot) -> VramPanel {
    let (high, low) = s.spill_watermarks().unzip();
    let budget = s.vram_budget_bytes();
    let h = &s.vram_history;
    let bucket = h.len().div_ceil(VRAM_POINTS).max(1);
    let (mut t_s, mut allocated, mut reserved) = (Vec::new(), Vec::new(), Vec::new());
    for i in (0..h.len()).step_by(bucket) {
        let part = h.range(i..(i + bucket).min(h.len()));
        let (mut t, mut a, mut r) = (0, 0, 0);
        for p in part {
            t = p.t_ns;
            a = a.max(p.allocated_bytes);
            r = r.max(p.reserved_bytes);
        }
        t_s.push(round(t as f64 / 1e9, 3));
        allocated.push(a);
        reserved.push(r);
    }
    let top = [
        allocated.iter().max().copied().unwrap_or(0),
        reserved.iter().max().copied().unwrap_or(0),
        high.unwrap_or(0),
        budget.unwrap_or(0),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let last = s.last_finished_step().and_then(|r| r.train.as_ref().map(|t| (r.step, t.vram_peak_bytes)));
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    VramPanel {
        allocated_bytes: s.vram.map(|v| v.allocated_bytes),
        reserved_bytes: s.vram.map(|v| v.reserved_bytes),
        peak_allocated_bytes: s.vram.map(|_| s.vram_peak_bytes),
        last_step: last.map(|l| l.0),
        last_step_peak_bytes: last.map(|l| l.1),
        watermarks_moved: s.last_watermark_move.as_ref().map(|m| {
            name_long(&format!(
                "after step {}: {}/{} -> {}/{} (high/low): {}",
                m.step,
                mib(m.from_high_bytes),
                mib(m.from_low_bytes),
                mib(m.high_bytes),
                mib(m.low_bytes),
                m.reason
            ))
        }),
        high_watermark_bytes: high,
        low_watermark_bytes: low,
        budget_bytes: budget,
        t_s,
        allocated,
        reserved,
        axis: bytes_axis(top),
    }
}

/// One weight block in the grid.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct BlockCell {
    pub id: u32,
    pub name: String,
    pub state: BlockState,
    pub bytes: u64,
    pub loads: u64,
    pub evictions: u64,
    pub protected: bool,
}

/// How many blocks are in one residency state.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StateCount {
    pub state: BlockState,
    pub blocks: u32,
}

/// Weight blocks by residency state, and how the prefetcher does.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ResidencyPanel {
    pub blocks: Vec<BlockCell>,
    /// Blocks beyond [`MAX_BLOCKS`], not in `blocks`.
    pub more_blocks: usize,
    pub counts: Vec<StateCount>,
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// Percent, once there was a hit or a miss.
    pub hit_rate: Option<f64>,
    pub evictions: u64,
}

pub(crate) fn residency(s: &Snapshot) -> ResidencyPanel {
    let counts = s.residency_counts();
    let w = &s.weights;
    let n = w.prefetch_hits + w.prefetch_misses;
    ResidencyPanel {
        blocks: s
            .blocks
            .iter()
            .take(MAX_BLOCKS)
            .map(|b| BlockCell {
                id: b.id.0,
                name: name(&b.name),
                state: b.state,
                bytes: b.bytes,
                loads: b.loads,
                evictions: b.evictions,
                protected: b.protected,
            })
            .collect(),
        more_blocks: s.blocks.len().saturating_sub(MAX_BLOCKS),
        counts: BlockState::ALL
            .iter()
            .map(|st| StateCount {
                state: *st,
                blocks: counts.get(st).copied().unwrap_or(0),
            })
            .collect(),
        prefetch_hits: w.prefetch_hits,
        prefetch_misses: w.prefetch_misses,
        hit_rate: (n > 0).then(|| round(100.0 * w.prefetch_hits as f64 / n as f64, 1)),
        evictions: w.evictions,
    }
}

/// One size class of a pinned pool.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ClassFigures {
    pub slab_bytes: u64,
    pub slabs: u32,
    pub in_use: u32,
    pub peak_in_use: u32,
}

/// A pinned pool's slabs in use (or, for weights that load straight from their pinned host
/// copies, what those hold).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct PoolPanel {
    pub name: &'static str,
    pub pinned: bool,
    pub classes: Vec<ClassFigures>,
    pub pageable_fallbacks: u64,
    /// Said instead of slabs when the pool does not exist: how the weights reach the device.
    pub note: Option<String>,
}

pub(crate) fn pools(s: &Snapshot) -> Vec<PoolPanel> {
    let panel = |name, p: &PoolView| PoolPanel {
        name,
        pinned: p.pinned,
        classes: p
            .classes
            .iter()
            .take(MAX_CLASSES)
            .map(|c| ClassFigures {
                slab_bytes: c.slab_bytes,
                slabs: c.slabs,
                in_use: c.in_use,
                peak_in_use: c.peak_in_use,
            })
            .collect(),
        pageable_fallbacks: p.pageable_fallbacks,
        note: None,
    };
    let mut out: Vec<PoolPanel> = [("weights", &s.weight_pool), ("activations", &s.activation_pool)]
        .into_iter()
        .filter_map(|(n, p)| p.as_ref().map(|p| panel(n, p)))
        .collect();
    if s.weight_pool.is_none() {
        if let Some(note) = stagehand_events::insight::weights_without_pool(s) {
            out.insert(0, PoolPanel { name: "weights", pinned: true, classes: Vec::new(), pageable_fallbacks: 0, note: Some(note) });
        }
    }
    out
}

/// One direction of PCIe traffic.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct DirectionFigures {
    pub inflight: u32,
    pub count: u64,
    pub bytes: u64,
    /// GB/s over every completed copy, once there is one.
    pub mean_gbps: Option<f64>,
    pub last_gbps: Option<f64>,
}

/// Copies both ways, recent throughput, and the Conductor's transfer slots.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct TransfersPanel {
    pub h2d: DirectionFigures,
    pub d2h: DirectionFigures,
    /// Recent copies: when they completed (s), and their GB/s in their direction.
    pub t_s: Vec<f64>,
    pub h2d_gbps: Vec<Option<f64>>,
    pub d2h_gbps: Vec<Option<f64>>,
    pub axis: Axis,
    pub slot_grants: u64,
    pub slot_denials: u64,
    pub conductor_h2d_inflight: u32,
    pub conductor_d2h_inflight: u32,
}

pub(crate) fn transfers(s: &Snapshot) -> TransfersPanel {
    let t = &s.transfers;
    let dir = |d: Direction| {
        let v = t.dir(d);
        DirectionFigures {
            inflight: v.inflight,
            count: v.count,
            bytes: v.bytes,
            mean_gbps: (v.busy_ms > 0.0).then(|| round(v.mean_gbps(), 2)),
            last_gbps: (v.last_gbps > 0.0).then(|| round(v.last_gbps, 2)),
        }
    };
    let timed: Vec<_> = t.recent.iter().filter(|r| r.gbps().is_some()).collect();
    let gbps = |r: &&stagehand_events::snapshot::TransferRecord, d| {
        (r.dir == d).then(|| r.gbps().map(|g| round(g, 2))).flatten()
    };
    let h2d_gbps: Vec<_> = timed.iter().map(|r| gbps(r, Direction::H2d)).collect();
    let d2h_gbps: Vec<_> = timed.iter().map(|r| gbps(r, Direction::D2h)).collect();
    let top = h2d_gbps.iter().chain(&d2h_gbps).flatten().copied().fold(0.0, f64::max);
    let c = &s.conductor;
    TransfersPanel {
        h2d: dir(Direction::H2d),
        d2h: dir(Direction::D2h),
        t_s: timed.iter().map(|r| round(r.t_ns as f64 / 1e9, 3)).collect(),
        h2d_gbps,
        d2h_gbps,
        axis: decimal_axis(top, "GB/s"),
        slot_grants: c.slot_grants,
        slot_denials: c.slot_denials,
        conductor_h2d_inflight: c.h2d_inflight,
        conductor_d2h_inflight: c.d2h_inflight,
    }
}

/// Saved tensors: kept, spilled, restored.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ActivationsPanel {
    pub saved: u64,
    pub kept: u64,
    pub spilled: u64,
    pub restored: u64,
    pub predicted: u64,
    pub spill_bytes: u64,
    pub restore_bytes: u64,
    /// Saved tensors recomputed in backward instead of stored, and their bytes.
    pub recomputed: u64,
    pub recompute_bytes: u64,
    pub stall_ms: f64,
    pub spilling: bool,
}

pub(crate) fn activations(s: &Snapshot) -> ActivationsPanel {
    let a = &s.activations;
    ActivationsPanel {
        saved: a.counts.saved,
        kept: a.counts.kept,
        spilled: a.counts.spilled,
        restored: a.counts.restored,
        predicted: a.counts.predicted,
        spill_bytes: a.counts.spill_bytes,
        restore_bytes: a.counts.restore_bytes,
        recomputed: a.counts.recomputed,
        recompute_bytes: a.counts.recompute_bytes,
        stall_ms: ms(a.counts.stall_time_ms),
        spilling: a.spilling,
    }
}

/// One phase of a recent step.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct PhaseSlice {
    pub step: u64,
    pub phase: Phase,
    pub ms: f64,
}

/// A refusal of the Conductor's.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct DenialLine {
    pub step: u64,
    pub phase: Phase,
    pub owner: Owner,
    pub what: String,
    pub reason: String,
    /// Whether it is bad (`by_design`, `if_stalls_follow`).
    pub concern: Concern,
}

/// Refusals of one reason over the run, with what they mean and whether they are bad.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct DenialReason {
    pub reason: String,
    pub count: u64,
    pub meaning: String,
    pub concern: Concern,
    /// Whether it is bad, in words ("not bad: by design").
    pub verdict: String,
}

/// Reservations, hints, phases and denials.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ConductorPanel {
    pub grants: u64,
    pub partials: u64,
    pub denials: u64,
    pub active_reservations: u64,
    pub active_bytes: u64,
    /// The hints in force, in words ("none" when there are none).
    pub hints: String,
    /// The last steps' phases, oldest first.
    pub timeline: Vec<PhaseSlice>,
    pub recent_denials: Vec<DenialLine>,
    /// Every reason refusals had over the run, most frequent first.
    pub denial_reasons: Vec<DenialReason>,
}

pub(crate) fn conductor(s: &Snapshot) -> ConductorPanel {
    let c = &s.conductor;
    let h = &c.hints;
    let mut hints: Vec<String> = [
        h.max_inflight_h2d.map(|n| format!("H2D <= {n}")),
        h.max_inflight_d2h.map(|n| format!("D2H <= {n}")),
        h.prefetch_window_cap.map(|n| format!("window <= {n}")),
        h.suppress_speculative.then(|| "no speculative copies".to_owned()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if hints.is_empty() {
        hints.push("none".into());
    }
    let mut text = hints.join(", ");
    if let Some(rule) = c.hints_rule {
        text.push_str(&format!(" (rule {})", wire_name(&rule)));
    }
    let mut steps: Vec<u64> = s.phase_spans.iter().map(|p| p.step).collect();
    steps.dedup();
    let keep = &steps[steps.len().saturating_sub(TIMELINE_STEPS)..];
    ConductorPanel {
        grants: c.grants,
        partials: c.partials,
        denials: c.denials,
        active_reservations: c.active_reservations,
        active_bytes: c.active_bytes,
        hints: text,
        timeline: s
            .phase_spans
            .iter()
            .filter(|p| keep.contains(&p.step))
            .map(|p| PhaseSlice {
                step: p.step,
                phase: p.phase,
                ms: ms(p.end_ns.saturating_sub(p.start_ns) as f64 / 1e6),
            })
            .collect(),
        recent_denials: c
            .recent_denials
            .iter()
            .rev()
            .take(DENIALS)
            .map(|d| DenialLine {
                step: d.step,
                phase: d.phase,
                owner: d.owner,
                what: name(&d.what),
                reason: d.reason.as_str().to_owned(),
                concern: d.reason.concern(),
            })
            .collect(),
        denial_reasons: denial_reasons(s),
    }
}

/// The run's refusals by reason, explained.
pub(crate) fn denial_reasons(s: &Snapshot) -> Vec<DenialReason> {
    let mut out: Vec<DenialReason> = DenyReason::ALL
        .iter()
        .filter_map(|r| {
            let count = s.conductor.denials_by_reason.get(r.as_str()).copied().unwrap_or(0);
            (count > 0).then(|| DenialReason {
                reason: r.as_str().to_owned(),
                count,
                meaning: r.meaning().to_owned(),
                concern: r.concern(),
                verdict: r.concern().verdict().to_owned(),
            })
        })
        .collect();
    out.sort_by_key(|d| std::cmp::Reverse(d.count));
    out
}

/// One GPU of a data-parallel run (its lane): where it is and what its last step did.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GpuPanel {
    pub device: u32,
    pub step: u64,
    pub phase: Phase,
    pub loss: Option<f64>,
    /// The last step's time and its parts, ms.
    pub step_ms: Option<f64>,
    pub compute_ms: Option<f64>,
    pub h2d_wait_ms: Option<f64>,
    pub optimizer_ms: Option<f64>,
    /// Its gradient reductions' time on the device in the last step, ms, and their bytes.
    pub collective_ms: Option<f64>,
    pub collective_bytes: u64,
    /// The last step's copies.
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// The blocks its host optimizer stepped in the last step, and how many of them it was
    /// given while backward ran (0 and 0 where it stepped none).
    pub host_steps: u64,
    pub host_steps_during_backward: u64,
    pub allocated_bytes: Option<u64>,
    pub peak_bytes: Option<u64>,
    pub budget_bytes: Option<u64>,
}

/// The GPUs of a data-parallel run (none for a run on one device).
pub(crate) fn gpus(s: &Snapshot) -> Vec<GpuPanel> {
    s.lanes
        .values()
        .map(|l| {
            let t = l.last_time.as_ref();
            let w = l.last_weights.as_ref();
            GpuPanel {
                device: l.device,
                step: l.step,
                phase: l.phase,
                loss: l.last_train.as_ref().map(|m| m.loss).filter(|v| v.is_finite()),
                step_ms: t.map(|t| ms(t.step_ms)),
                compute_ms: t.map(|t| ms(t.compute_ms)),
                h2d_wait_ms: t.map(|t| ms(t.h2d_wait_ms)),
                optimizer_ms: t.map(|t| ms(t.optimizer_ms)),
                collective_ms: w.map(|w| ms(w.collective_ms)),
                collective_bytes: w.map_or(0, |w| w.collective_bytes),
                h2d_bytes: w.map_or(0, |w| w.h2d_bytes),
                d2h_bytes: w.map_or(0, |w| w.d2h_bytes),
                host_steps: w.map_or(0, |w| w.host_steps),
                host_steps_during_backward: w.map_or(0, |w| w.host_steps_during_backward()),
                allocated_bytes: l.vram.map(|v| v.allocated_bytes),
                peak_bytes: l.vram.map(|v| v.peak_allocated_bytes),
                budget_bytes: l.budget_bytes,
            }
        })
        .collect()
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use stagehand_events::{Event, EventKind, StepTimeBreakdown, TrainStepMetrics, WeightStepMetrics};

    #[test]
    fn each_gpu_of_a_data_parallel_run_is_a_row_and_one_device_has_none() {
        let on = |d: u32, seq: u64, kind: EventKind| Event::new(seq, seq, 1, Phase::Forward, kind).on_device(Some(d));
        let events = [
            on(0, 1, EventKind::TrainStep(TrainStepMetrics { loss: 2.5, ..Default::default() })),
            on(1, 2, EventKind::StepTime(StepTimeBreakdown { step_ms: 40.0, ..Default::default() })),
            on(1, 3, EventKind::WeightStep(WeightStepMetrics { collective_ms: 1.25, collective_bytes: 4096, host_steps: 27, host_steps_overlapped: 30, ..Default::default() })),
        ];
        let g = gpus(&Snapshot::from_events(&events));
        assert_eq!(g.iter().map(|g| g.device).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(g[0].loss, Some(2.5));
        assert_eq!((g[1].step_ms, g[1].collective_ms, g[1].collective_bytes), (Some(40.0), Some(1.25), 4096));
        // A lane claiming more blocks given during backward than stepped shows no more than stepped.
        assert_eq!((g[1].host_steps, g[1].host_steps_during_backward, g[0].host_steps), (27, 27, 0));
        let one = [Event::new(1, 1, 1, Phase::Forward, EventKind::TrainStep(TrainStepMetrics::default()))];
        assert!(gpus(&Snapshot::from_events(&one)).is_empty());
    }
}
