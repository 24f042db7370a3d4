//! A deterministic synthetic run: every kind of event a real run emits, with realistic shapes
//! (blocks streaming through their residency states, copies, pool slabs, spills and restores,
//! Conductor reservations, denials and hints, VRAM samples, per-step metrics, a warning and a
//! bus drop), and no wall-clock values, without libtorch.
//!
//! For every consumer's tests (snapshot, stagehand-top, metrics, traces, the HTTP server, the
//! web page), for trying the dashboards without a model (`stagehand-top --demo`), and for
//! benchmarks. [`events`] gives the run as recorded events (what a telemetry file holds);
//! [`publish`] plays it onto a live [`Bus`] with pauses between steps, so a live consumer sees it
//! unfold.

// The runtime's metric structs gain fields over time; `..Default::default()` keeps this
// generator building when they do.
#![allow(clippy::needless_update)]

use super::bus::Bus;
use super::model::*;
use super::snapshot::tally::{ActivationCounts, ConductorCounts, WeightCounts};
use super::steps::close_steps;
use std::time::Duration;

/// Shape of a synthetic run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticRun {
    /// Managed weight blocks.
    pub blocks: u32,
    /// Complete training steps.
    pub steps: u64,
    /// End with a partial step that leaves blocks in each of the six residency states (a run
    /// caught mid-step) instead of a `run_ended` event.
    pub end_mid_step: bool,
}

impl SyntheticRun {
    /// A run of `steps` steps over 12 blocks that ends with `run_ended`.
    pub fn finished(steps: u64) -> SyntheticRun {
        SyntheticRun { blocks: 12, steps, end_mid_step: false }
    }
}

impl Default for SyntheticRun {
    fn default() -> Self {
        SyntheticRun {
            blocks: 8,
            steps: 3,
            end_mid_step: true,
        }
    }
}

const MIB: u64 = 1 << 20;
const BLOCK_BYTES: u64 = 48 * MIB;
const BUDGET: u64 = 1024 * MIB;
const HIGH: u64 = 900 * MIB;
const LOW: u64 = 700 * MIB;
const WEIGHT_SLABS: u32 = 4;

struct Gen {
    seq: u64,
    t_ns: u64,
    step: u64,
    phase: Phase,
    out: Vec<Event>,
    transfer: u64,
    tensor: u64,
    reservation: u64,
    vram: u64,
    peak: u64,
    state: Vec<BlockState>,
}

impl Gen {
    fn push(&mut self, kind: EventKind) {
        self.seq += 1;
        self.t_ns += 37_000;
        self.out
            .push(Event::new(self.seq, self.t_ns, self.step, self.phase, kind));
    }

    fn wait_us(&mut self, us: u64) {
        self.t_ns += us * 1000;
    }

    fn phase(&mut self, to: Phase, duration_s: f64) {
        let from = self.phase;
        self.phase = to;
        self.push(EventKind::PhaseChanged {
            from,
            to,
            duration_s,
        });
    }

    fn residency(&mut self, b: u32, to: BlockState, refcount: u32) {
        let from = self.state[b as usize];
        self.state[b as usize] = to;
        self.push(EventKind::Residency {
            block: BlockId(b),
            from,
            to,
            refcount,
        });
    }

    fn sample(&mut self) {
        self.peak = self.peak.max(self.vram);
        self.push(EventKind::VramSample {
            allocated_bytes: self.vram,
            reserved_bytes: self.vram + 64 * MIB,
            peak_allocated_bytes: self.peak,
        });
        // Who holds it: the resident blocks, kept and restored activations, the rest.
        let weights = self.state.iter().filter(|s| **s == BlockState::GpuReady).count() as u64 * BLOCK_BYTES;
        let kept = (self.vram.saturating_sub(weights)) / 2;
        self.push(EventKind::VramOwners(
            VramByOwner {
                allocated_bytes: self.vram,
                weights_bytes: weights.min(self.vram),
                activations_kept_bytes: kept,
                activations_restored_bytes: kept / 4,
                copies_in_flight_bytes: 0,
                other_bytes: 0,
            }
            .with_other(),
        ));
    }

    fn limits(&mut self) {
        for (owner, budget, high, low) in [
            (Owner::Device, BUDGET, None, None),
            (Owner::Weights, BLOCK_BYTES * 4, None, None),
            (Owner::Activations, BUDGET, Some(HIGH), Some(LOW)),
            (Owner::Conductor, BUDGET, Some(BUDGET + BUDGET / 10), None),
        ] {
            self.push(EventKind::LimitsSet {
                owner,
                budget_bytes: budget,
                high_watermark_bytes: high,
                low_watermark_bytes: low,
            });
        }
    }

    fn copy(&mut self, dir: Direction, owner: Owner, bytes: u64, subject: String, us: u64) {
        self.transfer += 1;
        let id = TransferId(self.transfer);
        self.push(EventKind::TransferIssued {
            id,
            dir,
            owner,
            bytes,
            subject,
        });
        self.wait_us(us);
        self.push(EventKind::TransferCompleted {
            id,
            dir,
            owner,
            bytes,
            duration_ms: us as f64 / 1000.0,
        });
    }

    /// Unloaded -> HostStaged -> Prefetching -> GpuReady, with its slab and its copy.
    fn load(&mut self, b: u32, slab: u32, miss: bool) {
        self.push(EventKind::SlotGranted {
            dir: Direction::H2d,
            owner: Owner::Weights,
            speculative: !miss,
            inflight: 1,
        });
        self.push(EventKind::SlabAcquired {
            pool: PoolKind::Weights,
            class: 0,
            slab: SlabId(slab),
            bytes: BLOCK_BYTES,
            waited_ms: 0.0,
        });
        self.residency(b, BlockState::HostStaged, 0);
        self.residency(b, BlockState::Prefetching, 0);
        // Copies run at about 20 GB/s, a little slower for the first block of a step.
        let us = if miss { 3_400 } else { 2_500 + (b as u64 % 3) * 100 };
        self.copy(Direction::H2d, Owner::Weights, BLOCK_BYTES, format!("blocks.{b}"), us);
        self.vram += BLOCK_BYTES;
        self.residency(b, BlockState::GpuReady, 1);
        self.push(EventKind::SlabReleased {
            pool: PoolKind::Weights,
            class: 0,
            slab: SlabId(slab),
        });
        self.push(EventKind::SlotReleased {
            dir: Direction::H2d,
            owner: Owner::Weights,
            inflight: 0,
        });
        if miss {
            self.push(EventKind::PrefetchMiss {
                block: BlockId(b),
                stall_ms: 3.4,
            });
        } else {
            self.push(EventKind::PrefetchHit { block: BlockId(b) });
        }
        self.sample();
    }

    /// Frees a frozen block, or saves a trainable one back to the host.
    fn evict(&mut self, b: u32, trainable: bool, reason: EvictionReason) {
        self.push(EventKind::Eviction {
            block: BlockId(b),
            reason,
            score: (b as f64 + 1.0) * BLOCK_BYTES as f64,
            bytes: BLOCK_BYTES,
        });
        if trainable {
            self.residency(b, BlockState::Evicting, 0);
            self.copy(Direction::D2h, Owner::Weights, BLOCK_BYTES, format!("blocks.{b}"), 2_700);
            self.residency(b, BlockState::Unloaded, 0);
        } else {
            self.residency(b, BlockState::GpuFreeing, 0);
            self.residency(b, BlockState::Unloaded, 0);
        }
        self.vram = self.vram.saturating_sub(BLOCK_BYTES);
        self.sample();
    }

    fn reserve(
        &mut self,
        owner: Owner,
        mode: ReservationMode,
        priority: Priority,
        requested: u64,
        outcome: ReservationOutcome,
        reason: Option<DenyReason>,
    ) -> ReservationId {
        self.reservation += 1;
        let granted = match outcome {
            ReservationOutcome::Granted => requested,
            ReservationOutcome::Partial => requested / 2,
            _ => 0,
        };
        let id = ReservationId(self.reservation);
        self.push(EventKind::Reservation {
            id,
            owner,
            resource: Resource::Vram,
            mode,
            priority,
            requested_bytes: requested,
            granted_bytes: granted,
            outcome,
            reason,
            scope: Some(self.phase),
        });
        id
    }
}

/// The events of a synthetic run, in order, numbered from 1.
pub fn events(run: SyntheticRun) -> Vec<Event> {
    let blocks = run.blocks.max(2);
    let mut g = Gen {
        seq: 0,
        t_ns: 0,
        step: 0,
        phase: Phase::Idle,
        out: Vec::new(),
        transfer: 0,
        tensor: 0,
        reservation: 0,
        vram: 96 * MIB,
        peak: 0,
        state: vec![BlockState::Unloaded; blocks as usize],
    };
    g.push(EventKind::RunStarted {
        run_id: "synthetic-0001".into(),
        wall_clock_unix_ms: 0,
        device: DeviceInfo {
            kind: DeviceKind::Host,
            index: 0,
            name: "host (simulated)".into(),
            total_bytes: 2048 * MIB,
        },
        model: format!("gpt d=512 L={blocks}"),
        versions: [("stagehand".to_string(), "0.1.0".to_string())].into(),
        config: serde_json::json!({ "budget_mb": 1024, "prefetch_window": 2 }),
    });
    g.limits();
    g.push(EventKind::PoolConfigured {
        pool: PoolKind::Weights,
        classes: vec![PoolClass {
            slab_bytes: BLOCK_BYTES,
            slabs: WEIGHT_SLABS,
        }],
        pinned: true,
    });
    g.push(EventKind::PoolConfigured {
        pool: PoolKind::Activations,
        classes: vec![
            PoolClass { slab_bytes: MIB, slabs: 16 },
            PoolClass { slab_bytes: 4 * MIB, slabs: 8 },
            PoolClass { slab_bytes: 16 * MIB, slabs: 4 },
        ],
        pinned: true,
    });
    for b in 0..blocks {
        g.push(EventKind::BlockRegistered {
            block: BlockId(b),
            name: format!("blocks.{b}"),
            bytes: BLOCK_BYTES,
            exec_order: b,
            file_backed: b % 2 == 0,
            trainable: b % 4 == 3,
        });
    }
    g.push(EventKind::ItineraryLearned {
        order: (0..blocks).map(BlockId).collect(),
    });
    g.sample();

    // How many blocks fit: the rest stream through.
    let resident_cap = 4u32.min(blocks);
    for step in 1..=run.steps {
        g.step = step;
        g.phase(Phase::StepBegin, 0.0);
        g.push(EventKind::HintsChanged {
            hints: Hints::default(),
            rule: PolicyRule::Reset,
        });
        g.phase(Phase::Forward, 0.001);
        let mut resident: Vec<u32> = (0..blocks)
            .filter(|b| g.state[*b as usize] == BlockState::GpuReady)
            .collect();
        for b in 0..blocks {
            g.push(EventKind::PrefetchWindow {
                cursor: b,
                backward: false,
                window: (b + 1..(b + 3).min(blocks)).map(BlockId).collect(),
            });
            if g.state[b as usize] == BlockState::GpuReady {
                g.push(EventKind::PrefetchHit { block: BlockId(b) });
            } else {
                if resident.len() as u32 >= resident_cap {
                    let victim = resident.remove(0);
                    g.evict(victim, victim % 4 == 3, EvictionReason::Budget);
                }
                g.load(b, b % WEIGHT_SLABS, b == 0 && step == 1);
                resident.push(b);
            }
            // Two saved tensors per block: one kept, one spilled.
            g.tensor += 1;
            g.push(EventKind::Pack {
                tensor: TensorId(g.tensor),
                decision: PackDecision::Kept,
                reason: Some(if b + 1 == blocks {
                    KeepReason::TailOfForward
                } else {
                    KeepReason::TooSmall
                }),
                bytes: 256 * 1024,
                class: None,
                pool_hit: None,
                region: Some(format!("blocks.{b}")),
            });
            g.tensor += 1;
            let class = b % 3;
            let hit = !(step == 2 && b == 5);
            g.push(EventKind::Pack {
                tensor: TensorId(g.tensor),
                decision: PackDecision::Spilled,
                reason: None,
                bytes: (1 << (20 + 2 * class)) - 4096,
                class: Some(class),
                pool_hit: Some(hit),
                region: Some(format!("blocks.{b}")),
            });
            if hit {
                g.push(EventKind::SlabAcquired {
                    pool: PoolKind::Activations,
                    class,
                    slab: SlabId(b / 3),
                    bytes: 1 << (20 + 2 * class),
                    waited_ms: 0.0,
                });
            } else {
                g.push(EventKind::PoolExhausted {
                    pool: PoolKind::Activations,
                    class,
                    requested_bytes: 16 * MIB - 4096,
                });
                g.push(EventKind::PageableFallback {
                    pool: PoolKind::Activations,
                    bytes: 16 * MIB - 4096,
                });
            }
            g.copy(
                Direction::D2h,
                Owner::Activations,
                (1 << (20 + 2 * class)) - 4096,
                format!("tensor {}", g.tensor),
                90 + 300 * class as u64,
            );
            g.push(EventKind::SpillFinalized {
                tensor: TensorId(g.tensor),
                bytes: (1 << (20 + 2 * class)) - 4096,
                inline: b % 4 == 0,
            });
            if b == blocks / 2 {
                g.push(EventKind::SpillingToggled {
                    on: true,
                    vram_allocated_bytes: g.vram,
                });
            }
        }
        g.phase(Phase::Backward, 0.030);
        g.push(EventKind::HintsChanged {
            hints: Hints {
                max_inflight_h2d: Some(1),
                max_inflight_d2h: Some(2),
                prefetch_window_cap: Some(1),
                suppress_speculative: false,
            },
            rule: PolicyRule::BackwardPressure,
        });
        let r1 = g.reserve(
            Owner::Activations,
            ReservationMode::Hard,
            Priority::Required,
            64 * MIB,
            ReservationOutcome::Granted,
            None,
        );
        g.reserve(
            Owner::Weights,
            ReservationMode::Soft,
            Priority::Speculative,
            256 * MIB,
            ReservationOutcome::Partial,
            None,
        );
        g.reserve(
            Owner::Weights,
            ReservationMode::Burst,
            Priority::Speculative,
            512 * MIB,
            ReservationOutcome::Denied,
            Some(DenyReason::InsufficientHeadroom),
        );
        for b in (0..blocks).rev() {
            g.push(EventKind::PrefetchWindow {
                cursor: b,
                backward: true,
                window: (b.saturating_sub(1)..b).map(BlockId).collect(),
            });
            let class = b % 3;
            g.copy(
                Direction::H2d,
                Owner::Activations,
                (1 << (20 + 2 * class)) - 4096,
                format!("tensor {}", 2 * (b as u64 + 1)),
                80 + 250 * class as u64,
            );
            g.push(EventKind::Restored {
                tensor: TensorId(g.tensor - 2 * (blocks - 1 - b) as u64),
                bytes: (1 << (20 + 2 * class)) - 4096,
                predicted: b % 3 != 0,
                stall_ms: if b % 3 == 0 { 0.25 } else { 0.0 },
            });
            if !(step == 2 && b == 5) {
                g.push(EventKind::SlabReleased {
                    pool: PoolKind::Activations,
                    class,
                    slab: SlabId(b / 3),
                });
            }
        }
        g.push(EventKind::SpillingToggled {
            on: false,
            vram_allocated_bytes: g.vram,
        });
        g.push(EventKind::ReservationReleased {
            id: r1,
            bytes: 64 * MIB,
        });
        g.phase(Phase::Optimizer, 0.041);
        g.push(EventKind::HintsChanged {
            hints: Hints {
                max_inflight_h2d: Some(1),
                max_inflight_d2h: None,
                prefetch_window_cap: None,
                suppress_speculative: true,
            },
            rule: PolicyRule::OptimizerProtection,
        });
        g.push(EventKind::SlotDenied {
            dir: Direction::H2d,
            owner: Owner::Weights,
            speculative: true,
            reason: DenyReason::PhaseRuleSuppressedSpeculative,
        });
        g.reserve(
            Owner::Trainer,
            ReservationMode::Floor,
            Priority::Critical,
            128 * MIB,
            ReservationOutcome::Granted,
            None,
        );
        g.reserve(
            Owner::Weights,
            ReservationMode::Ceiling,
            Priority::Background,
            512 * MIB,
            ReservationOutcome::CapRecorded,
            None,
        );
        if step == 2 {
            g.push(EventKind::Warning {
                source: Owner::Activations,
                message: "pinned pool class 2 exhausted; fell back to pageable memory".into(),
            });
            g.push(EventKind::EventsDropped { total: 17 });
            g.push(EventKind::SlotDenied {
                dir: Direction::D2h,
                owner: Owner::Activations,
                speculative: false,
                reason: DenyReason::D2hSlotsExhausted,
            });
            g.push(EventKind::HintsChanged {
                hints: Hints {
                    max_inflight_h2d: Some(1),
                    max_inflight_d2h: Some(1),
                    prefetch_window_cap: None,
                    suppress_speculative: true,
                },
                rule: PolicyRule::Contention,
            });
        }
        g.wait_us(9_000);
        g.phase(Phase::StepEnd, 0.012);
        // The aggregates are the sums of the step's detail events, as a runtime's are, so a
        // summary-level file (aggregates only) and a full one reach the same totals.
        let (w, a, c) = step_counts(&g.out, step);
        let looked = w.prefetch_hits + w.prefetch_misses;
        g.push(EventKind::WeightStep(WeightStepMetrics {
            h2d_bytes: w.h2d_bytes,
            d2h_bytes: w.d2h_bytes,
            stall_time_ms: w.stall_time_ms,
            stall_count: w.stall_count,
            evictions: w.evictions,
            prefetch_hits: w.prefetch_hits,
            prefetch_misses: w.prefetch_misses,
            hit_rate: if looked == 0 { 0.0 } else { w.prefetch_hits as f64 / looked as f64 },
            vram_used_mb: (g.vram / MIB) as f64,
            vram_reserved_mb: (g.vram / MIB + 64) as f64,
            host_pool_free: WEIGHT_SLABS,
            host_pool_in_use: 0,
            ..Default::default()
        }));
        g.push(EventKind::ActivationStep(ActivationStepMetrics {
            activations_saved: a.saved,
            activations_kept: a.kept,
            activations_spilled: a.spilled,
            activations_restored: a.restored,
            activations_predicted: a.predicted,
            weight_handles: a.weight_handles,
            spill_bytes: a.spill_bytes,
            restore_bytes: a.restore_bytes,
            stall_time_ms: a.stall_time_ms,
            stall_count: a.stall_count,
            pool_hits: a.pool_hits,
            pool_misses: a.pool_misses,
            vram_peak_mb: (g.peak / MIB) as f64,
            ..Default::default()
        }));
        g.push(EventKind::ConductorStep(ConductorStepMetrics {
            vram_allocated_mb: (g.vram / MIB) as f64,
            vram_headroom_mb: ((BUDGET - g.vram.min(BUDGET)) / MIB) as f64,
            pinned_granted_mb: 0.0,
            h2d_inflight: 0,
            d2h_inflight: 0,
            grant_count: c.grants,
            deny_count: c.denials,
            partial_count: c.partials,
            slot_grant_count: c.slot_grants,
            slot_deny_count: c.slot_denials,
            phase_durations: PhaseDurations {
                forward: 0.030,
                backward: 0.041,
                optimizer: 0.012,
            },
            ..Default::default()
        }));
        g.push(EventKind::TrainStep(TrainStepMetrics {
            loss: 4.0 / (step as f64 + 1.0),
            step_time_s: 0.085 + 0.001 * step as f64,
            tokens: 16_384,
            vram_peak_bytes: g.peak,
            ..Default::default()
        }));
        let step_ms = 85.0 + step as f64;
        g.push(EventKind::StepTime(StepTimeBreakdown {
            step_ms,
            compute_ms: step_ms - 25.0,
            h2d_wait_ms: 4.0,
            d2h_wait_ms: 1.5,
            weight_stall_ms: if step == 1 { 3.4 } else { 0.0 },
            restore_stall_ms: 0.25 * blocks.div_ceil(3) as f64,
            optimizer_ms: 12.0,
            other_ms: 25.0 - 17.5 - if step == 1 { 3.4 } else { 0.0 } - 0.25 * blocks.div_ceil(3) as f64,
        }));
        g.phase(Phase::Idle, 0.0);
    }

    if run.end_mid_step {
        // A run caught mid-step: leave one block in each residency state.
        g.step = run.steps + 1;
        g.phase(Phase::StepBegin, 0.0);
        g.phase(Phase::Forward, 0.001);
        let ready: Vec<u32> = (0..blocks)
            .filter(|b| g.state[*b as usize] == BlockState::GpuReady)
            .collect();
        // Leave the first two ready blocks mid-eviction: one mid-save, one mid-free.
        for (&b, (score, to)) in ready.iter().zip([(1.0e8, BlockState::Evicting), (0.9e8, BlockState::GpuFreeing)]) {
            g.push(EventKind::Eviction {
                block: BlockId(b),
                reason: EvictionReason::Watermark,
                score,
                bytes: BLOCK_BYTES,
            });
            g.residency(b, to, 0);
        }
        let unloaded: Vec<u32> = (0..blocks)
            .filter(|b| g.state[*b as usize] == BlockState::Unloaded)
            .collect();
        if let Some(&b) = unloaded.first() {
            g.load(b, 0, false);
            g.push(EventKind::Protection {
                block: BlockId(b),
                protected: true,
            });
        }
        if let Some(&b) = unloaded.get(1) {
            g.push(EventKind::SlabAcquired {
                pool: PoolKind::Weights,
                class: 0,
                slab: SlabId(1),
                bytes: BLOCK_BYTES,
                waited_ms: 0.4,
            });
            g.residency(b, BlockState::HostStaged, 0);
            g.residency(b, BlockState::Prefetching, 0);
            g.transfer += 1;
            let id = TransferId(g.transfer);
            g.push(EventKind::TransferIssued {
                id,
                dir: Direction::H2d,
                owner: Owner::Weights,
                bytes: BLOCK_BYTES,
                subject: format!("blocks.{b}"),
            });
        }
        if let Some(&b) = unloaded.get(2) {
            g.push(EventKind::SlabAcquired {
                pool: PoolKind::Weights,
                class: 0,
                slab: SlabId(2),
                bytes: BLOCK_BYTES,
                waited_ms: 0.0,
            });
            g.residency(b, BlockState::HostStaged, 0);
        }
        g.push(EventKind::PrefetchWindow {
            cursor: unloaded.first().copied().unwrap_or(0),
            backward: false,
            window: unloaded.iter().skip(1).take(2).copied().map(BlockId).collect(),
        });
        g.vram = HIGH + 20 * MIB;
        g.sample();
    } else {
        g.push(EventKind::RunEnded { steps: run.steps });
    }
    close_steps(g.out)
}

/// The detail counts of `step` in `out`, summed as the runtimes sum their step metrics.
fn step_counts(out: &[Event], step: u64) -> (WeightCounts, ActivationCounts, ConductorCounts) {
    let mut w = WeightCounts::default();
    let mut a = ActivationCounts::default();
    let mut c = ConductorCounts::default();
    for e in out.iter().rev().take_while(|e| e.step == step) {
        match &e.kind {
            EventKind::PrefetchHit { .. } => w.prefetch_hits += 1,
            EventKind::PrefetchMiss { stall_ms, .. } => {
                w.prefetch_misses += 1;
                w.stall_count += 1;
                w.stall_time_ms += stall_ms;
            }
            EventKind::Eviction { .. } => w.evictions += 1,
            EventKind::TransferCompleted { owner: Owner::Weights, dir, bytes, .. } => match dir {
                Direction::H2d => w.h2d_bytes += bytes,
                Direction::D2h => w.d2h_bytes += bytes,
            },
            EventKind::Pack { decision, bytes, pool_hit, .. } => {
                a.saved += 1;
                match decision {
                    PackDecision::Kept => a.kept += 1,
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
                    PackDecision::Duplicate => {}
                }
            }
            EventKind::Restored { bytes, predicted, stall_ms, .. } => {
                a.restored += 1;
                a.restore_bytes += bytes;
                a.predicted += u64::from(*predicted);
                if *stall_ms > 0.0 {
                    a.stall_count += 1;
                    a.stall_time_ms += stall_ms;
                }
            }
            EventKind::Reservation { outcome, .. } => match outcome {
                ReservationOutcome::Granted => c.grants += 1,
                ReservationOutcome::Partial => c.partials += 1,
                ReservationOutcome::Denied => c.denials += 1,
                ReservationOutcome::CapRecorded => {}
            },
            EventKind::SlotGranted { .. } => c.slot_grants += 1,
            EventKind::SlotDenied { .. } => c.slot_denials += 1,
            _ => {}
        }
    }
    (w, a, c)
}

/// The events of a synthetic run as JSONL text, one event a line.
pub fn jsonl(run: SyntheticRun) -> String {
    let mut s = String::new();
    for e in events(run) {
        // An Event always serializes: every field is plain data.
        if let Ok(line) = serde_json::to_string(&e) {
            s.push_str(&line);
            s.push('\n');
        }
    }
    s
}

/// Plays the run onto `bus` as a training loop would publish it: phase changes through
/// [`Bus::enter_phase`] (the bus times them), everything else through [`Bus::publish`], with
/// the bus's own sequence numbers and clock, sleeping `pause` after each step. Returns the
/// number of events consumers will see (the `transfer_step` aggregates are added by the bus).
pub fn publish(run: SyntheticRun, bus: &Bus, pause: Duration) -> u64 {
    let mut n = 0;
    for e in events(run) {
        match e.kind {
            EventKind::PhaseChanged { to, .. } => {
                bus.enter_phase(e.step, to);
                if to == Phase::Idle && !pause.is_zero() {
                    std::thread::sleep(pause);
                }
            }
            // The bus sums each step's copies itself (and they count: consumers see them).
            EventKind::TransferStep(_) => {}
            mut kind => {
                // The run starts now, on the bus's wall clock.
                if let EventKind::RunStarted { wall_clock_unix_ms, .. } = &mut kind {
                    *wall_clock_unix_ms = bus.wall_clock_unix_ms();
                }
                bus.publish(kind);
            }
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Snapshot;

    #[test]
    fn every_residency_transition_is_valid_and_all_six_states_show_at_the_end() {
        let ev = events(SyntheticRun::default());
        for e in &ev {
            if let EventKind::Residency { from, to, .. } = e.kind {
                assert!(from.can_transition_to(to), "seq {}: {from} -> {to}", e.seq);
            }
        }
        let s = Snapshot::from_events(&ev);
        let counts = s.residency_counts();
        for st in BlockState::ALL {
            assert!(counts.get(&st).copied().unwrap_or(0) > 0, "no block {st}: {counts:?}");
        }
        assert_eq!(s.dropped_events, 17);
        assert_eq!(s.warnings.len(), 1);
    }

    #[test]
    fn sequence_and_time_only_grow() {
        let ev = events(SyntheticRun {
            blocks: 12,
            steps: 5,
            end_mid_step: false,
        });
        for w in ev.windows(2) {
            assert_eq!(w[1].seq, w[0].seq + 1);
            assert!(w[1].t_ns >= w[0].t_ns);
        }
        assert!(matches!(ev.last().map(|e| &e.kind), Some(EventKind::RunEnded { steps: 5 })));
    }

    #[test]
    fn a_finished_run_leaves_nothing_in_flight() {
        let ev = events(SyntheticRun { blocks: 12, steps: 3, end_mid_step: false });
        let snap = Snapshot::from_events(&ev);
        assert!(snap.ended);
        assert_eq!(snap.steps.len(), 3);
        assert_eq!((snap.transfers.h2d.inflight, snap.transfers.d2h.inflight), (0, 0));
        assert!(snap.activations.spilled > 0 && snap.activations.restored == snap.activations.spilled);
        assert!(snap.weights.prefetch_hits > 0 && snap.weights.prefetch_misses > 0);
    }

    #[test]
    fn publishing_on_a_bus_gives_the_same_run() {
        let run = SyntheticRun { blocks: 6, steps: 2, end_mid_step: false };
        #[derive(Clone, Default)]
        struct Keep(std::sync::Arc<std::sync::Mutex<Vec<Event>>>);
        impl crate::events::EventSink for Keep {
            fn on_event(&mut self, e: &Event) {
                self.0.lock().expect("keep").push(e.clone());
            }
        }
        let keep = Keep::default();
        let bus = Bus::new();
        bus.hub().expect("enabled bus").add_sink(Box::new(keep.clone()));
        let n = publish(run, &bus, Duration::ZERO);
        bus.flush();
        let live = keep.0.lock().expect("keep").clone();
        let recorded = events(run);
        assert_eq!(n as usize, recorded.len());
        assert_eq!(live.len(), recorded.len());
        for (l, r) in live.iter().zip(&recorded) {
            assert_eq!((l.step, l.phase), (r.step, r.phase), "seq {}", r.seq);
            match (&l.kind, &r.kind) {
                (EventKind::PhaseChanged { from: lf, to: lt, .. }, EventKind::PhaseChanged { from: rf, to: rt, .. }) => {
                    assert_eq!((lf, lt), (rf, rt));
                }
                (EventKind::RunStarted { model: lm, .. }, EventKind::RunStarted { model: rm, .. }) => {
                    assert_eq!(lm, rm);
                }
                (a, b) => assert_eq!(a, b),
            }
        }
    }
}
