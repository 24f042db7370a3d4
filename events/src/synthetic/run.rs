//! The run itself: set-up, each step's forward, backward and optimizer, and the ending.

// The runtime's metric structs gain fields over time; `..Default::default()` keeps this
// generator building when they do.
#![allow(clippy::needless_update)]

use super::super::model::*;
use super::super::steps::close_steps;
use super::gen::*;
use super::SyntheticRun;

/// The events of `run`, in order, numbered from 1.
pub(super) fn generate(run: SyntheticRun) -> Vec<Event> {
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
            vram_used_mib: (g.vram / MIB) as f64,
            vram_reserved_mib: (g.vram / MIB + 64) as f64,
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
            activations_recomputed: a.recomputed,
            recompute_bytes: a.recompute_bytes,
            vram_peak_mib: (g.peak / MIB) as f64,
            ..Default::default()
        }));
        g.push(EventKind::ConductorStep(ConductorStepMetrics {
            vram_allocated_mib: (g.vram / MIB) as f64,
            vram_headroom_mib: ((BUDGET - g.vram.min(BUDGET)) / MIB) as f64,
            pinned_granted_mib: 0.0,
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

