//! A synthetic run: the events a small weight-streaming training loop emits, without libtorch.
//!
//! For tests of every consumer (metrics, traces, the HTTP server, the web page), for trying the
//! dashboards on a machine without a model, and for benchmarks. The sequence follows the real
//! protocol: valid residency edges, slabs acquired before copies and released after, copies
//! issued then completed, phases in step order, per-step metrics at step end. Deterministic for
//! a given [`SyntheticConfig::seed`].

use stagehand::events::model::*;
use stagehand::events::Bus;
use std::collections::BTreeMap;
use std::time::Duration;

/// Size of the synthetic model's blocks unless told otherwise (8 MiB).
pub const DEFAULT_BLOCK_BYTES: u64 = 8 << 20;

/// What the synthetic run looks like.
#[derive(Debug, Clone)]
pub struct SyntheticConfig {
    /// Weight blocks of the model.
    pub blocks: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks kept on the device at once.
    pub resident: u32,
    /// Seed of the pseudo-random choices (misses, spills, denials).
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            blocks: 12,
            block_bytes: DEFAULT_BLOCK_BYTES,
            resident: 4,
            seed: 7,
        }
    }
}

/// One thing the run does: enter a phase, or emit an event after `dt_ns` of work.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// Move to `phase` of `step` (the bus computes the phase duration).
    Phase(u64, Phase),
    /// An event, `dt_ns` after the previous item.
    Event(u64, EventKind),
}

/// The generator.
#[derive(Debug)]
pub struct SyntheticRun {
    cfg: SyntheticConfig,
    state: Vec<BlockState>,
    rng: u64,
    next_transfer: u64,
    next_tensor: u64,
    next_reservation: u64,
    allocated: u64,
    peak: u64,
    /// Spilled tensors not yet restored: (tensor, bytes, size class, from the pool).
    spilled: Vec<(TensorId, u64, u32, bool)>,
    act_slabs_in_use: u32,
    /// Bytes of activations kept on the device in this step's forward, freed by its backward.
    kept_bytes: u64,
    items: Vec<Item>,
}

const ACT_CLASSES: [u64; 3] = [1 << 20, 4 << 20, 16 << 20];

impl SyntheticRun {
    /// A run with this configuration.
    pub fn new(cfg: SyntheticConfig) -> SyntheticRun {
        SyntheticRun {
            state: vec![BlockState::Unloaded; cfg.blocks as usize],
            rng: cfg.seed.wrapping_mul(6364136223846793005).wrapping_add(1),
            cfg,
            next_transfer: 0,
            next_tensor: 0,
            next_reservation: 0,
            allocated: 64 << 20,
            peak: 64 << 20,
            spilled: Vec::new(),
            act_slabs_in_use: 0,
            kept_bytes: 0,
            items: Vec::new(),
        }
    }

    fn rand(&mut self) -> f64 {
        self.rng = self
            .rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    fn ev(&mut self, dt_ns: u64, kind: EventKind) {
        self.items.push(Item::Event(dt_ns, kind));
    }

    fn budget(&self) -> u64 {
        self.cfg.block_bytes * (self.cfg.resident as u64 + 2) + (160 << 20)
    }

    fn vram(&mut self) {
        self.peak = self.peak.max(self.allocated);
        let budget = self.budget();
        let k = EventKind::VramSample {
            allocated_bytes: self.allocated,
            reserved_bytes: self.allocated + (32 << 20),
            peak_allocated_bytes: self.peak,
            high_watermark_bytes: budget * 85 / 100,
            low_watermark_bytes: budget * 70 / 100,
            budget_bytes: budget,
        };
        self.ev(20_000, k);
    }

    fn set_state(&mut self, b: u32, to: BlockState) {
        let from = self.state[b as usize];
        self.state[b as usize] = to;
        let refcount = u32::from(to == BlockState::GpuReady);
        self.ev(
            5_000,
            EventKind::Residency {
                block: BlockId(b),
                from,
                to,
                refcount,
            },
        );
    }

    fn copy(&mut self, dir: Direction, owner: Owner, bytes: u64, subject: String) {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.ev(0, EventKind::SlotGranted { dir, owner, speculative: false, inflight: 1 });
        self.ev(2_000, EventKind::TransferIssued { id, dir, owner, bytes, subject });
        // About 20 GB/s with some jitter.
        let ms = bytes as f64 / 20e6 * (0.8 + 0.4 * self.rand());
        self.ev((ms * 1e6) as u64, EventKind::TransferCompleted { id, dir, owner, bytes, duration_ms: ms });
        self.ev(1_000, EventKind::SlotReleased { dir, owner, inflight: 0 });
    }

    fn load(&mut self, b: u32) {
        if self.state[b as usize] == BlockState::GpuReady {
            self.ev(3_000, EventKind::PrefetchHit { block: BlockId(b) });
            return;
        }
        let bytes = self.cfg.block_bytes;
        self.ev(1_000, EventKind::SlabAcquired {
            pool: PoolKind::Weights, class: 0, slab: SlabId(b % self.cfg.resident.max(1)),
            bytes, waited_ms: 0.0,
        });
        self.set_state(b, BlockState::HostStaged);
        self.set_state(b, BlockState::Prefetching);
        self.copy(Direction::H2d, Owner::Weights, bytes, format!("blocks.{b}"));
        self.allocated += bytes;
        self.set_state(b, BlockState::GpuReady);
        self.ev(1_000, EventKind::SlabReleased { pool: PoolKind::Weights, class: 0, slab: SlabId(b % self.cfg.resident.max(1)) });
        if self.rand() < 0.2 {
            let stall_ms = 0.2 + 2.0 * self.rand();
            self.ev(10_000, EventKind::PrefetchMiss { block: BlockId(b), stall_ms });
        } else {
            self.ev(3_000, EventKind::PrefetchHit { block: BlockId(b) });
        }
    }

    fn evict(&mut self, b: u32) {
        if self.state[b as usize] != BlockState::GpuReady {
            return;
        }
        let bytes = self.cfg.block_bytes;
        let trainable = b.is_multiple_of(4);
        self.ev(2_000, EventKind::Eviction {
            block: BlockId(b), reason: EvictionReason::Budget, score: (b as f64 + 1.0) * bytes as f64, bytes,
        });
        if trainable {
            self.set_state(b, BlockState::Evicting);
            self.copy(Direction::D2h, Owner::Weights, bytes, format!("blocks.{b}"));
        } else {
            self.set_state(b, BlockState::GpuFreeing);
        }
        self.allocated = self.allocated.saturating_sub(bytes);
        self.set_state(b, BlockState::Unloaded);
    }

    fn pack(&mut self, step: u64) {
        let tensor = TensorId(self.next_tensor);
        self.next_tensor += 1;
        let class = (self.rand() * 3.0) as u32 % 3;
        let bytes = ACT_CLASSES[class as usize] * 3 / 4;
        if self.rand() < 0.45 {
            let pool_hit = self.act_slabs_in_use < 6;
            self.ev(2_000, EventKind::Pack {
                tensor, decision: PackDecision::Spilled, reason: None, bytes, class: Some(class),
                pool_hit: Some(pool_hit), region: Some(format!("layer.{}", step % 3)),
            });
            if pool_hit {
                self.act_slabs_in_use += 1;
                self.ev(500, EventKind::SlabAcquired {
                    pool: PoolKind::Activations, class, slab: SlabId(tensor.0 as u32 % 8), bytes, waited_ms: 0.0,
                });
            }
            self.copy(Direction::D2h, Owner::Activations, bytes, format!("tensor {}", tensor.0));
            self.ev(1_000, EventKind::SpillFinalized { tensor, bytes, inline: false });
            self.spilled.push((tensor, bytes, class, pool_hit));
        } else {
            self.allocated += bytes;
            self.kept_bytes += bytes;
            self.ev(2_000, EventKind::Pack {
                tensor, decision: PackDecision::Kept, reason: Some(KeepReason::UnderWatermark), bytes,
                class: None, pool_hit: None, region: None,
            });
        }
    }

    fn restore_all(&mut self) {
        let spilled = std::mem::take(&mut self.spilled);
        for (tensor, bytes, class, from_pool) in spilled.into_iter().rev() {
            self.copy(Direction::H2d, Owner::Activations, bytes, format!("tensor {}", tensor.0));
            let predicted = self.rand() < 0.7;
            let stall_ms = if predicted { 0.0 } else { 0.1 + self.rand() };
            self.ev(1_000, EventKind::Restored { tensor, bytes, predicted, stall_ms });
            if from_pool {
                self.act_slabs_in_use = self.act_slabs_in_use.saturating_sub(1);
                self.ev(500, EventKind::SlabReleased { pool: PoolKind::Activations, class, slab: SlabId(tensor.0 as u32 % 8) });
            }
        }
    }

    fn reserve(&mut self, step: u64, scope: Phase) {
        let id = ReservationId(self.next_reservation);
        self.next_reservation += 1;
        let requested = 32 << 20;
        let denied = self.rand() < 0.25;
        let (granted, outcome, reason) = if denied {
            (0, ReservationOutcome::Denied, Some(if step.is_multiple_of(2) {
                DenyReason::InsufficientHeadroom } else { DenyReason::PriorityReserve }))
        } else {
            (requested, ReservationOutcome::Granted, None)
        };
        self.ev(4_000, EventKind::Reservation {
            id, owner: Owner::Activations, resource: Resource::Vram, mode: ReservationMode::Soft,
            priority: Priority::Required, requested_bytes: requested, granted_bytes: granted,
            outcome, reason, scope: Some(scope),
        });
        if !denied {
            self.ev(50_000, EventKind::ReservationReleased { id, bytes: granted });
        }
    }

    /// The items of the run's preamble: `run_started`, block registration, pools.
    pub fn start(&mut self, run_id: &str, wall_clock_unix_ms: u64) -> Vec<Item> {
        let budget = self.budget();
        self.ev(0, EventKind::RunStarted {
            run_id: run_id.to_owned(),
            wall_clock_unix_ms,
            device: DeviceInfo { kind: DeviceKind::Host, index: 0, name: "host (simulated)".into(), total_bytes: budget },
            model: format!("synthetic gpt L={}", self.cfg.blocks),
            versions: BTreeMap::from([("stagehand".to_owned(), env!("CARGO_PKG_VERSION").to_owned())]),
            config: serde_json::json!({ "blocks": self.cfg.blocks, "block_bytes": self.cfg.block_bytes,
                                        "resident": self.cfg.resident }),
        });
        self.ev(1_000, EventKind::PoolConfigured {
            pool: PoolKind::Weights,
            classes: vec![PoolClass { slab_bytes: self.cfg.block_bytes, slabs: self.cfg.resident }],
            pinned: true,
        });
        self.ev(1_000, EventKind::PoolConfigured {
            pool: PoolKind::Activations,
            classes: ACT_CLASSES.iter().map(|&b| PoolClass { slab_bytes: b, slabs: 8 }).collect(),
            pinned: true,
        });
        for b in 0..self.cfg.blocks {
            self.ev(1_000, EventKind::BlockRegistered {
                block: BlockId(b), name: format!("blocks.{b}"), bytes: self.cfg.block_bytes,
                exec_order: b, file_backed: b % 3 == 0, trainable: b % 4 == 0,
            });
        }
        let order = (0..self.cfg.blocks).map(BlockId).collect();
        self.ev(1_000, EventKind::ItineraryLearned { order });
        self.vram();
        std::mem::take(&mut self.items)
    }

    /// The items of training step `step` (1-based), ending in `step_end`.
    pub fn step(&mut self, step: u64) -> Vec<Item> {
        let n = self.cfg.blocks;
        let resident = self.cfg.resident.max(1);
        self.items.push(Item::Phase(step, Phase::StepBegin));
        self.ev(10_000, EventKind::HintsChanged { hints: Hints::default(), rule: PolicyRule::Reset });
        self.vram();
        self.items.push(Item::Phase(step, Phase::Forward));
        for b in 0..n {
            self.ev(0, EventKind::PrefetchWindow { cursor: b, backward: false,
                window: (b..(b + 2).min(n)).map(BlockId).collect() });
            self.load(b);
            if b >= resident {
                self.evict(b - resident);
            }
            self.pack(step);
            self.vram();
        }
        self.items.push(Item::Phase(step, Phase::Backward));
        self.reserve(step, Phase::Backward);
        if self.rand() < 0.5 {
            self.ev(1_000, EventKind::SlotDenied { dir: Direction::H2d, owner: Owner::Weights,
                speculative: true, reason: DenyReason::H2dSlotsExhausted });
        }
        self.restore_all();
        for b in (0..n).rev() {
            self.ev(0, EventKind::PrefetchWindow { cursor: n - 1 - b, backward: true,
                window: (b.saturating_sub(2)..=b).rev().map(BlockId).collect() });
            self.load(b);
            if b + resident < n {
                self.evict(b + resident);
            }
            self.vram();
        }
        self.allocated = self.allocated.saturating_sub(std::mem::take(&mut self.kept_bytes));
        self.vram();
        self.items.push(Item::Phase(step, Phase::Optimizer));
        self.ev(0, EventKind::HintsChanged {
            hints: Hints { max_inflight_h2d: Some(1), suppress_speculative: true, ..Hints::default() },
            rule: PolicyRule::OptimizerProtection,
        });
        self.reserve(step, Phase::Optimizer);
        self.items.push(Item::Phase(step, Phase::StepEnd));
        let loss = 4.0 / (1.0 + step as f64 * 0.1) + 0.05 * self.rand();
        self.ev(5_000, EventKind::WeightStep(WeightStepMetrics {
            h2d_bytes: self.cfg.block_bytes * n as u64, vram_used_mb: self.allocated as f64 / 1048576.0,
            ..WeightStepMetrics::default()
        }));
        self.ev(5_000, EventKind::ActivationStep(ActivationStepMetrics {
            vram_peak_mb: self.peak as f64 / 1048576.0, ..ActivationStepMetrics::default()
        }));
        self.ev(5_000, EventKind::ConductorStep(ConductorStepMetrics {
            vram_allocated_mb: self.allocated as f64 / 1048576.0, ..ConductorStepMetrics::default()
        }));
        self.ev(5_000, EventKind::TrainStep(TrainStepMetrics {
            loss, step_time_s: 0.05, tokens: 4096, vram_peak_bytes: self.peak,
        }));
        std::mem::take(&mut self.items)
    }

    /// Publishes the preamble and `steps` steps on `bus`, sleeping `pause` between steps (so a
    /// live consumer sees the run unfold). Returns the number of steps published.
    pub fn publish(&mut self, bus: &Bus, steps: u64, pause: Duration) -> u64 {
        for item in self.start("synthetic", bus.wall_clock_unix_ms()) {
            publish_item(bus, item);
        }
        for s in 1..=steps {
            for item in self.step(s) {
                publish_item(bus, item);
            }
            bus.enter_phase(s, Phase::Idle);
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
        bus.publish(EventKind::RunEnded { steps });
        steps
    }

    /// The whole run as recorded events, on a virtual clock (what a telemetry file holds).
    pub fn events(&mut self, steps: u64) -> Vec<Event> {
        let mut out = Vec::new();
        let mut t = 0u64;
        let mut cur = (0u64, Phase::Idle, 0u64);
        let mut items = self.start("synthetic", 1_700_000_000_000);
        for s in 1..=steps {
            items.extend(self.step(s));
            items.push(Item::Phase(s, Phase::Idle));
        }
        for item in items {
            match item {
                Item::Phase(step, to) => {
                    t += 1_000;
                    let (_, from, since) = cur;
                    out.push(Event::new(0, t, step, to, EventKind::PhaseChanged {
                        from, to, duration_s: (t - since) as f64 / 1e9,
                    }));
                    cur = (step, to, t);
                }
                Item::Event(dt, kind) => {
                    t += dt.max(1);
                    out.push(Event::new(0, t, cur.0, cur.1, kind));
                }
            }
        }
        t += 1_000;
        out.push(Event::new(0, t, cur.0, Phase::Idle, EventKind::RunEnded { steps }));
        for (i, e) in out.iter_mut().enumerate() {
            e.seq = i as u64 + 1;
        }
        out
    }
}

fn publish_item(bus: &Bus, item: Item) {
    match item {
        Item::Phase(step, phase) => bus.enter_phase(step, phase),
        Item::Event(_, kind) => bus.publish(kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand::events::Snapshot;

    #[test]
    fn synthetic_run_follows_the_protocol() {
        let events = SyntheticRun::new(SyntheticConfig::default()).events(3);
        let mut state = [BlockState::Unloaded; 12];
        for e in &events {
            if let EventKind::Residency { block, from, to, .. } = &e.kind {
                assert_eq!(state[block.0 as usize], *from, "seq {}", e.seq);
                assert!(from.can_transition_to(*to), "{from} -> {to}");
                state[block.0 as usize] = *to;
            }
        }
        let snap = Snapshot::from_events(&events);
        assert!(snap.ended);
        assert_eq!(snap.steps.len(), 3);
        assert_eq!(snap.transfers.h2d.inflight, 0);
        assert!(snap.activations.spilled > 0 && snap.activations.restored == snap.activations.spilled);
        assert_eq!(snap.activation_pool.as_ref().map(|p| p.in_use_bytes()), Some(0));
        assert!(snap.weights.prefetch_hits > 0);
        assert!(events.windows(2).all(|w| w[0].t_ns < w[1].t_ns));
    }
}
