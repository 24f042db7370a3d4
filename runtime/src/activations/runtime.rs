//! The activation runtime's API: its lifecycle (step begin/end), the hook guard, region guards.

use super::config::ActivationConfig;
use super::policy::SpillPolicy;
use super::restorer::Restorer;
use super::sizing::GroupProfile;
use super::spills::SpillQueue;
use super::state::{Shared, State};
use super::store::ActivationStore;
use crate::conductor::{ActivationAdapter, Conductor, KnobValues, Knobs};
use crate::device::{Device, HostPool};
use crate::error::Result;
use crate::events::{ActivationStepMetrics, Bus, EventKind, Owner, PoolKind};
use crate::pinned::{PoolStats, SlabPool};
use crate::saved::{WeightResolver, WeightSave};
use crate::torch::{SavedTensorHooks, TensorIdentity};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// The spill arena's first chunk: a model that spills little pins little.
const ARENA_FIRST_CHUNK: usize = 16 << 20;
/// Its largest chunk: chunks grow with what it pinned up to this; pinning runs at 5.8 GiB/s in
/// 16 MiB pieces, 13.8 GiB/s in 256 MiB ones (H200 host, `copies` bench, 2026-11-27).
const ARENA_MAX_CHUNK: usize = 256 << 20;

/// Device bytes the runtime holds, by kind (for the VRAM-by-owner breakdown).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// Saved tensors kept on the device.
    pub kept: u64,
    /// Spilled tensors brought back (or landing) and waiting for backward.
    pub restored: u64,
    /// Spills whose copies are still in flight or waiting for their batch's copy (their device
    /// memory is not yet free).
    pub spilling: u64,
}

/// The activation runtime. Cheap to clone (shared state).
#[derive(Clone)]
pub struct ActivationRuntime {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ActivationRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationRuntime")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl ActivationRuntime {
    /// Validates `config`, allocates the pool (pinned on CUDA) and the copy streams. With a
    /// `resolver`, managed weights are handed to the weight runtime instead of being kept.
    pub fn new(
        device: Device,
        config: ActivationConfig,
        bus: Bus,
        resolver: Option<Arc<dyn WeightResolver>>,
    ) -> Result<ActivationRuntime> {
        config.validate()?;
        let bus = if config.telemetry_enabled { bus } else { Bus::disabled() };
        bus.publish(EventKind::LimitsSet {
            owner: Owner::Activations,
            budget_bytes: device.info().total_bytes,
            high_watermark_bytes: Some(config.high_watermark_bytes),
            low_watermark_bytes: Some(config.low_watermark_bytes),
        });
        // The pool's slabs and its fallback buffers share one arena: a first step's fallbacks,
        // given back as their restores land, hold the memory the traced pool is cut from next.
        let arena = HostPool::growing(&device, ARENA_FIRST_CHUNK, ARENA_MAX_CHUNK);
        let pool = SlabPool::in_arena(
            &arena,
            PoolKind::Activations,
            &config.class_sizes_bytes,
            &config.slabs_per_class,
            config.pageable_fallback,
            bus.clone(),
        )?;
        // The first pool is provisional when a traced step will size the real one: spills that
        // find no slab there are expected, not worth a warning.
        pool.set_warn_on_fallback(!config.size_pool_from_trace);
        pool.limit_pinned(config.pinned_limit_bytes);
        let policy = SpillPolicy::new(
            config.high_watermark_bytes,
            config.low_watermark_bytes,
            config.min_spill_bytes,
            config.spill_fraction,
        );
        let state = State::new(
            pool,
            SpillQueue::new(&device, bus.clone(), config.debug_checksums)?,
            Restorer::new(&device, bus.clone())?,
            policy,
        );
        Ok(ActivationRuntime {
            shared: Arc::new(Shared {
                knobs: Knobs::new(KnobValues {
                    max_inflight_d2h: config.max_inflight_d2h,
                    max_inflight_h2d: config.max_inflight_h2d,
                    prefetch_window: config.restore_lookahead,
                    suppress_speculative: false,
                }),
                device,
                config,
                bus,
                resolver,
                state: Mutex::new(state),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ActivationConfig {
        &self.shared.config
    }

    /// The device this runtime spills from.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The tunables read at every decision, starting at the configured values:
    /// `max_inflight_d2h` (spills in flight before pack finalizes inline; 0 pauses spilling),
    /// `max_inflight_h2d` (restores ahead of need in flight), `prefetch_window` (how many
    /// spilled tensors to restore ahead) and `suppress_speculative` (restore only the next
    /// one ahead). An attached Conductor writes them at each phase boundary.
    pub fn knobs(&self) -> Arc<Knobs> {
        self.shared.knobs.clone()
    }

    /// Puts the runtime under `conductor`: its knobs follow the Conductor's hints (and return
    /// to their values now when it detaches), and every spill and restore takes a transfer
    /// slot first. Fails if an activation runtime is already attached to that Conductor.
    pub fn attach_conductor(&self, conductor: &Conductor) -> Result<()> {
        conductor.register(ActivationAdapter::new(self.knobs()))?;
        self.shared.lock().replace_conductor(conductor.clone());
        Ok(())
    }

    /// Leaves the Conductor: knobs back to their values at attach, copies no longer take
    /// slots. A no-op when none is attached.
    pub fn detach_conductor(&self) {
        let c = self.shared.lock().replace_conductor(Conductor::disabled());
        c.detach(ActivationAdapter::NAME);
    }

    /// Declares model parameters: saves of them (or views, like `W.t()`) are kept, since
    /// spilling a tensor that stays resident frees nothing.
    pub fn register_parameters<'a>(&self, params: impl IntoIterator<Item = &'a Tensor>) {
        let mut g = self.shared.lock();
        for p in params {
            g.register_parameter(TensorIdentity::of(p).storage_ptr);
        }
    }

    /// Starts step `step`: counters to zero, spilling off, the device's peak restarted.
    pub fn begin_step(&self, step: u64) {
        let weights = {
            let mut g = self.shared.lock();
            // Records left by a step that never ended are released now.
            let live = g.records().live();
            if live > 0 {
                self.shared.warn(format!(
                    "step {step} began with {live} saved tensors of a step that never ended; releasing them"
                ));
            }
            let saves = self.shared.retire_all(&mut g);
            g.reset_step();
            saves
        };
        self.release_weights(weights);
        self.shared.device.reset_peak();
    }

    /// Releases what a step that failed before it updated anything left (most of its saved
    /// tensors went as the failure unwound; copies in flight are finished first), without
    /// ending it: nothing is learned from a partial step. The next `begin_step` starts afresh.
    pub fn abandon_step(&self) {
        let weights = {
            let mut g = self.shared.lock();
            self.shared.retire_all(&mut g)
        };
        self.release_weights(weights);
    }

    /// Turns the saved-tensor hooks on for this thread until the guard drops.
    pub fn managed_forward(&self) -> Result<ManagedForward> {
        Ok(ManagedForward {
            _hooks: SavedTensorHooks::enable(Arc::new(self.store()))?,
        })
    }

    /// The saved-tensor store, for callers that install the hooks themselves.
    pub fn store(&self) -> ActivationStore {
        ActivationStore::new(self.shared.clone())
    }

    /// Opens a named region until the guard drops. Regions nest (`blocks.3` then `mlp` is
    /// `blocks.3.mlp`); each top-level region of the forward is one group for the learned
    /// tail rule.
    pub fn region(&self, name: &str) -> RegionGuard {
        self.shared.lock().open_region(name);
        RegionGuard {
            shared: self.shared.clone(),
        }
    }

    /// Between two micro-batches of a step (every saved tensor of the last one released): sizes
    /// the pool from the step so far if its spills fell back to pageable memory.
    pub fn between_micro_batches(&self) -> Result<()> {
        let mut g = self.shared.lock();
        self.shared.between_micro_batches(&mut g)
    }

    /// Ends the step: waits for copies, publishes `ActivationStep`, learns the group profile
    /// (and after a step that spilled, the pool's size), releases every record, and returns the
    /// step's metrics.
    pub fn end_step(&self) -> Result<ActivationStepMetrics> {
        let (metrics, weights, result) = {
            let mut g = self.shared.lock();
            self.shared.end_step(&mut g)
        };
        self.release_weights(weights);
        self.shared.vram_sample();
        let m = metrics.clone();
        self.shared.bus.publish_with(|| EventKind::ActivationStep(m));
        result.map(|()| metrics)
    }

    /// Counters of the step in progress.
    pub fn metrics(&self) -> ActivationStepMetrics {
        self.shared.lock().metrics().clone()
    }

    /// Spills checksummed as they landed, and restores checked against their checksum, over
    /// the run (both 0 unless `debug_checksums` is on).
    pub fn checksums(&self) -> (u64, u64) {
        self.shared.lock().checksums()
    }

    /// Metrics of the last ended step.
    pub fn last_step_metrics(&self) -> Option<ActivationStepMetrics> {
        self.shared.lock().last_metrics().cloned()
    }

    /// Lowers both spill watermarks by `by` bytes (the high one no lower than `floor`) and
    /// publishes the new limits; `None` when the high one is at the floor already. The handle
    /// does this after a step whose peak went over the budget.
    pub fn lower_watermarks(&self, by: u64, floor: u64) -> Option<(u64, u64)> {
        let (high, _) = self.watermarks();
        self.move_watermarks(high.saturating_sub(by), floor).filter(|&(moved, _)| moved < high)
    }

    /// Moves both spill watermarks, keeping their gap, so that the high one is `high` (no lower
    /// than `floor`), and publishes the new limits; `None` when they did not move. The handle
    /// does this after the first step, from what it measured above the watermark.
    pub fn move_watermarks(&self, high: u64, floor: u64) -> Option<(u64, u64)> {
        let moved = self.shared.move_watermarks(high, floor)?;
        self.shared.bus.publish(EventKind::LimitsSet {
            owner: Owner::Activations,
            budget_bytes: self.shared.device.info().total_bytes,
            high_watermark_bytes: Some(moved.0),
            low_watermark_bytes: Some(moved.1),
        });
        Some(moved)
    }

    /// The spill watermarks in force, high then low.
    pub fn watermarks(&self) -> (u64, u64) {
        self.shared.lock().policy().watermarks()
    }

    /// The region groups learned from the first step (empty before).
    pub fn profile(&self) -> Vec<GroupProfile> {
        self.shared.lock().profile().to_vec()
    }

    /// Saved tensors the runtime still holds records for.
    pub fn live_records(&self) -> usize {
        self.shared.lock().records().live()
    }

    /// Occupancy of the pool.
    pub fn pool_stats(&self) -> PoolStats {
        self.shared.lock().pool_stats()
    }

    /// Bytes the pool's arena holds: every slab, and what the fallbacks gave back for the next
    /// pool (pinned on CUDA): the host memory the runtime stages spills in.
    pub fn pool_bytes(&self) -> u64 {
        self.shared.lock().pool_bytes()
    }

    /// Whether the hysteresis flag is on.
    pub fn is_spilling(&self) -> bool {
        self.shared.lock().policy().is_spilling()
    }

    /// Device bytes held now: kept, restored (or landing) and still spilling.
    pub fn held_bytes(&self) -> HeldBytes {
        let g = self.shared.lock();
        let mut h = HeldBytes::default();
        for r in g.records().iter() {
            match r.state {
                super::record::RecordState::Kept if r.device_bytes > 0 => h.kept += r.bytes,
                super::record::RecordState::Restoring | super::record::RecordState::Restored => h.restored += r.bytes,
                super::record::RecordState::Spilling | super::record::RecordState::Batched => h.spilling += r.bytes,
                _ => {}
            }
        }
        h
    }

    fn release_weights(&self, saves: Vec<WeightSave>) {
        if let Some(r) = &self.shared.resolver {
            for s in &saves {
                r.release(s);
            }
        }
    }

    #[cfg(test)]
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// Saved-tensor hooks on for this thread while alive. Not `Send`.
#[derive(Debug)]
pub struct ManagedForward {
    _hooks: SavedTensorHooks,
}

/// A named region, open while alive.
pub struct RegionGuard {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RegionGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionGuard").finish_non_exhaustive()
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.shared.lock().close_region();
    }
}
