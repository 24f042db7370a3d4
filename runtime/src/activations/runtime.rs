//! The activation runtime: its lifecycle (step begin/end), the hook guard, region guards and
//! the state shared with the saved-tensor store.

use super::config::{ActivationConfig, MB};
use super::policy::SpillPolicy;
use super::pool::{PoolStats, SpillPool};
use super::record::{Record, RecordState, Records};
use super::store::ActivationStore;
use super::transfer::Transfers;
use super::Telemetry;
use crate::conductor::{ActivationAdapter, Conductor, KnobValues, Knobs};
use crate::device::Device;
use crate::error::Result;
use crate::events::{ActivationStepMetrics, Bus, EventKind, Owner};
use crate::saved::{WeightResolver, WeightSave};
use crate::torch::{SavedTensorHooks, TensorIdentity};
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// What the first step learned about one region group of the forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupProfile {
    /// The region that opened the group.
    pub name: String,
    /// Bytes of the tensors in the group that could be spilled.
    pub bytes: u64,
    /// How many such tensors.
    pub tensors: u32,
}

/// Mutable state of the runtime, behind one lock: pack runs on the forward thread, unpack and
/// release possibly on an autograd worker thread.
pub(super) struct Inner {
    pub records: Records,
    pub pool: SpillPool,
    pub transfers: Transfers,
    pub policy: SpillPolicy,
    /// Open regions, outermost first.
    pub regions: Vec<String>,
    /// Index of the open top-level group in this step's forward.
    pub group: Option<u32>,
    pub groups_opened: u32,
    /// Groups of this step's forward, being learned.
    pub learning: Vec<GroupProfile>,
    /// Groups learned from an earlier step.
    pub profile: Vec<GroupProfile>,
    /// Backward has begun (an unpack happened) in this step.
    pub in_backward: bool,
    pub metrics: ActivationStepMetrics,
    pub last: Option<ActivationStepMetrics>,
    pub next_tensor: u64,
    /// Device bytes held by restores issued ahead of need and not yet unpacked.
    pub predicted_bytes: u64,
    /// Storage addresses of registered model parameters.
    pub parameters: HashSet<u64>,
    /// Grants the transfer slots (disabled: every copy proceeds at no cost).
    pub conductor: Conductor,
}

/// Everything the store and the runtime share.
pub(super) struct Shared {
    pub device: Device,
    pub config: ActivationConfig,
    pub telemetry: Telemetry,
    /// The in-flight caps, restore lookahead and speculation switch, shared with the
    /// Conductor's adapter and read at every decision.
    pub knobs: Arc<Knobs>,
    pub resolver: Option<Arc<dyn WeightResolver>>,
    pub inner: Mutex<Inner>,
}

impl Shared {
    /// The state; a panic elsewhere while holding the lock leaves it usable (every mutation is
    /// a single field update or a record move).
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the bytes a record adds to the device's accounted memory (host device: what makes
    /// the simulated watermark move; on CUDA the allocator counts real bytes).
    pub(super) fn set_device_bytes(&self, rec: &mut Record, bytes: u64) {
        let delta = bytes as i64 - rec.device_bytes as i64;
        if delta != 0 {
            self.device.account(delta);
        }
        rec.device_bytes = bytes;
    }

    /// Frees what a record holds (copies waited for, buffers back to the pool); returns its
    /// weight save for the resolver, to be released outside the lock.
    pub(super) fn retire(&self, g: &mut Inner, idx: usize) -> Option<WeightSave> {
        if g.records.get(idx).is_some_and(|r| r.state == RecordState::Spilling) {
            if let Err(e) = self.finalize_spill(g, idx, false) {
                self.warn(format!("finalizing a spill at release: {e}"));
            }
        }
        if g.records.get(idx).is_some_and(|r| r.state == RecordState::Restoring) {
            if let Err(e) = self.complete_restore(g, idx) {
                self.warn(format!("completing a restore at release: {e}"));
            }
        }
        g.transfers.inflight_d2h.retain(|&i| i != idx);
        g.transfers.inflight_h2d.retain(|&i| i != idx);
        let mut rec = g.records.take(idx)?;
        if let Some(p) = rec.copy.take() {
            // Only reached when a copy failed above: never free memory a copy may still touch.
            let _ = p.wait();
        }
        self.set_device_bytes(&mut rec, 0);
        if rec.predicted {
            g.predicted_bytes = g.predicted_bytes.saturating_sub(rec.bytes);
        }
        if let Some(lease) = rec.lease.take() {
            g.pool.release(lease);
        }
        rec.weight.take()
    }

    pub(super) fn warn(&self, message: String) {
        self.telemetry.publish_with(|| EventKind::Warning {
            source: Owner::Activations,
            message,
        });
    }

    pub(super) fn vram_sample(&self) {
        self.telemetry.publish_with(|| {
            let m = self.device.memory();
            EventKind::VramSample {
                allocated_bytes: m.allocated,
                reserved_bytes: m.reserved,
                peak_allocated_bytes: m.peak,
            }
        });
    }
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
        let telemetry = Telemetry::new(bus, config.telemetry_enabled);
        telemetry.publish_with(|| EventKind::LimitsSet {
            owner: Owner::Activations,
            budget_bytes: device.info().total_bytes,
            high_watermark_bytes: Some(config.high_watermark_bytes),
            low_watermark_bytes: Some(config.low_watermark_bytes),
        });
        let pool = SpillPool::new(
            &device,
            &config.class_sizes_bytes,
            &config.slabs_per_class,
            config.pageable_fallback,
            telemetry.clone(),
        )?;
        let transfers = Transfers {
            d2h: device.copy_stream()?,
            h2d: device.copy_stream()?,
            inflight_d2h: VecDeque::new(),
            inflight_h2d: VecDeque::new(),
        };
        let inner = Inner {
            records: Records::default(),
            pool,
            transfers,
            policy: SpillPolicy::new(
                config.high_watermark_bytes,
                config.low_watermark_bytes,
                config.min_spill_bytes,
                config.spill_fraction,
            ),
            regions: Vec::new(),
            group: None,
            groups_opened: 0,
            learning: Vec::new(),
            profile: Vec::new(),
            in_backward: false,
            metrics: ActivationStepMetrics::default(),
            last: None,
            next_tensor: 0,
            predicted_bytes: 0,
            parameters: HashSet::new(),
            conductor: Conductor::disabled(),
        };
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
                telemetry,
                resolver,
                inner: Mutex::new(inner),
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
        self.shared.lock().conductor = conductor.clone();
        Ok(())
    }

    /// Leaves the Conductor: knobs back to their values at attach, copies no longer take
    /// slots. A no-op when none is attached.
    pub fn detach_conductor(&self) {
        let c = std::mem::replace(&mut self.shared.lock().conductor, Conductor::disabled());
        c.detach(ActivationAdapter::NAME);
    }

    /// Declares model parameters: saves of them (or views, like `W.t()`) are kept, since
    /// spilling a tensor that stays resident frees nothing.
    pub fn register_parameters<'a>(&self, params: impl IntoIterator<Item = &'a Tensor>) {
        let mut g = self.shared.lock();
        for p in params {
            g.parameters.insert(TensorIdentity::of(p).storage_ptr);
        }
    }

    /// Starts step `step`: counters to zero, spilling off, the device's peak restarted.
    pub fn step_begin(&self, step: u64) {
        let weights = {
            let mut g = self.shared.lock();
            // Records left by a step that never ended are released now.
            if g.records.live() > 0 {
                self.shared.warn(format!(
                    "step {step} began with {} saved tensors of a step that never ended; releasing them",
                    g.records.live()
                ));
            }
            let left: Vec<usize> = (0..g.records.len()).collect();
            let saves: Vec<WeightSave> = left.into_iter().filter_map(|i| self.shared.retire(&mut g, i)).collect();
            g.records.drain();
            g.metrics = ActivationStepMetrics::default();
            g.policy.reset_step();
            g.in_backward = false;
            g.group = None;
            g.groups_opened = 0;
            g.learning.clear();
            g.predicted_bytes = 0;
            saves
        };
        self.release_weights(weights);
        self.shared.device.reset_peak();
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
        let mut g = self.shared.lock();
        if g.regions.is_empty() && !g.in_backward {
            g.group = Some(g.groups_opened);
            g.groups_opened += 1;
            g.learning.push(GroupProfile {
                name: name.to_string(),
                bytes: 0,
                tensors: 0,
            });
        }
        g.regions.push(name.to_string());
        RegionGuard {
            shared: self.shared.clone(),
        }
    }

    /// Ends the step: waits for copies, publishes `ActivationStep`, learns the group profile,
    /// releases every record, and returns the step's metrics.
    pub fn step_end(&self) -> Result<ActivationStepMetrics> {
        let (metrics, weights, result) = {
            let mut g = self.shared.lock();
            let mut result = self.shared.finalize_all_spills(&mut g);
            if result.is_ok() {
                result = self.shared.reap_restores(&mut g, true);
            }
            let left: Vec<usize> = (0..g.records.len()).collect();
            let saves: Vec<WeightSave> = left.into_iter().filter_map(|i| self.shared.retire(&mut g, i)).collect();
            g.records.drain();
            g.metrics.vram_peak_mb = self.shared.device.memory().peak as f64 / MB as f64;
            if !g.learning.is_empty() {
                if !g.profile.is_empty() && g.profile.len() != g.learning.len() {
                    self.shared.warn(format!(
                        "the forward had {} region groups, the learned profile {}; relearning",
                        g.learning.len(),
                        g.profile.len()
                    ));
                }
                if g.profile.len() != g.learning.len() {
                    g.profile = std::mem::take(&mut g.learning);
                }
            }
            g.learning.clear();
            g.in_backward = false;
            let m = g.metrics.clone();
            g.last = Some(m.clone());
            (m, saves, result)
        };
        self.release_weights(weights);
        self.shared.vram_sample();
        let m = metrics.clone();
        self.shared.telemetry.publish_with(|| EventKind::ActivationStep(m));
        result.map(|()| metrics)
    }

    /// Counters of the step in progress.
    pub fn metrics(&self) -> ActivationStepMetrics {
        self.shared.lock().metrics.clone()
    }

    /// Metrics of the last ended step.
    pub fn last_step_metrics(&self) -> Option<ActivationStepMetrics> {
        self.shared.lock().last.clone()
    }

    /// The region groups learned from the first step (empty before).
    pub fn profile(&self) -> Vec<GroupProfile> {
        self.shared.lock().profile.clone()
    }

    /// Saved tensors the runtime still holds records for.
    pub fn live_records(&self) -> usize {
        self.shared.lock().records.live()
    }

    /// Occupancy of the pool.
    pub fn pool_stats(&self) -> PoolStats {
        self.shared.lock().pool.stats()
    }

    /// Whether the hysteresis flag is on.
    pub fn is_spilling(&self) -> bool {
        self.shared.lock().policy.is_spilling()
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
        let mut g = self.shared.lock();
        g.regions.pop();
        if g.regions.is_empty() {
            g.group = None;
        }
    }
}
