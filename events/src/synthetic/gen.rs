//! The generator's state and its building blocks: loads, evictions, copies, reservations,
//! readings, and the per-step sums of the detail events.

use super::super::model::*;
use super::super::snapshot::tally::{ActivationCounts, ConductorCounts, WeightCounts};

pub(super) const MIB: u64 = 1 << 20;
pub(super) const BLOCK_BYTES: u64 = 48 * MIB;
pub(super) const BUDGET: u64 = 1024 * MIB;
pub(super) const HIGH: u64 = 900 * MIB;
pub(super) const LOW: u64 = 700 * MIB;
pub(super) const WEIGHT_SLABS: u32 = 4;

pub(super) struct Gen {
    pub(super) seq: u64,
    pub(super) t_ns: u64,
    pub(super) step: u64,
    pub(super) phase: Phase,
    pub(super) out: Vec<Event>,
    pub(super) transfer: u64,
    pub(super) tensor: u64,
    pub(super) reservation: u64,
    pub(super) vram: u64,
    pub(super) peak: u64,
    pub(super) state: Vec<BlockState>,
}

impl Gen {
    pub(super) fn push(&mut self, kind: EventKind) {
        self.seq += 1;
        self.t_ns += 37_000;
        self.out
            .push(Event::new(self.seq, self.t_ns, self.step, self.phase, kind));
    }

    pub(super) fn wait_us(&mut self, us: u64) {
        self.t_ns += us * 1000;
    }

    pub(super) fn phase(&mut self, to: Phase, duration_s: f64) {
        let from = self.phase;
        self.phase = to;
        self.push(EventKind::PhaseChanged {
            from,
            to,
            duration_s,
        });
    }

    pub(super) fn residency(&mut self, b: u32, to: BlockState, refcount: u32) {
        let from = self.state[b as usize];
        self.state[b as usize] = to;
        self.push(EventKind::Residency {
            block: BlockId(b),
            from,
            to,
            refcount,
        });
    }

    pub(super) fn sample(&mut self) {
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

    pub(super) fn limits(&mut self) {
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

    pub(super) fn copy(&mut self, dir: Direction, owner: Owner, bytes: u64, subject: String, us: u64) {
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
            duration_ms: Some(us as f64 / 1000.0),
        });
    }

    /// Unloaded -> HostStaged -> Prefetching -> GpuReady, with its slab and its copy.
    pub(super) fn load(&mut self, b: u32, slab: u32, miss: bool) {
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
    pub(super) fn evict(&mut self, b: u32, trainable: bool, reason: EvictionReason) {
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

    pub(super) fn reserve(
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

/// The detail counts of `step` in `out`, summed as the runtimes sum their step metrics.
pub(super) fn step_counts(out: &[Event], step: u64) -> (WeightCounts, ActivationCounts, ConductorCounts) {
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
                Direction::Collective => {}
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
                    PackDecision::Recomputed => {
                        a.recomputed += 1;
                        a.recompute_bytes += bytes;
                    }
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

