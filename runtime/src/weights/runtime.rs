//! `WeightRuntime`: the block-mode API (explicit blocks and steps) that layer mode builds on.
//!
//! The file is long because it is the documented public surface: one method per user action,
//! each a thin call into the scheduler.

use super::file::FileSource;
use super::handles::WeightStore;
use super::itinerary::Itinerary;
use super::registry::{group_by_pattern, BlockSpec};
use super::scheduler::{PtrIndex, Scheduler};
use super::WeightConfig;
use crate::conductor::{Conductor, Knobs, WeightAdapter};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::guards::GuardSlot;
use crate::device::HostPool;
use crate::events::{BlockId, BlockState, Bus, EvictionReason, ModelMemory, QuantizationReport, WeightStepMetrics};
use crate::precision::QuantFormat;
use super::scheduler::ModelEntry;
use crate::saved::{WeightResolver, WeightSave};
use crate::torch::SavedTensorHooks;
use regex::Regex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// The VarStore a runtime's blocks came from, so that optimizers and checkpoints see the whole
/// model (the variables the runtime does not manage, each variable's name and group).
#[derive(Clone)]
pub(crate) struct Origin {
    pub vars: Arc<Mutex<tch::nn::Variables>>,
    /// Registers blocks still pending (layer mode registers them when the model first runs).
    pub seal: Option<Arc<dyn Fn() -> Result<()> + Send + Sync>>,
}

impl Origin {
    /// Registers pending blocks, if any.
    pub(crate) fn seal(&self) -> Result<()> {
        match &self.seal {
            Some(f) => f(),
            None => Ok(()),
        }
    }
}

pub(crate) struct Inner {
    sched: Mutex<Scheduler>,
    origin: Mutex<Option<Origin>>,
    /// The block the forward runs now (read by the activation store on every pack, so it
    /// sits outside the scheduler's lock).
    current: Mutex<Option<Arc<str>>>,
    /// The block whose `before_block` failed last in this step (for out-of-memory reports).
    failed: Mutex<Option<BlockId>>,
    /// Makes the memory plan before the first block use (the handle's), and whether it ran.
    planner: Mutex<Option<Planner>>,
    planned: AtomicBool,
    index: PtrIndex,
    knobs: Arc<Knobs>,
    /// The numeric guards' slot, shared with the scheduler's gradient sinks: the managed layers
    /// check their outputs with it (one atomic load while no guards are armed).
    guards: GuardSlot,
    device: Device,
    bus: Bus,
}

/// Makes the memory plan that sizes a runtime's room (set by the `Stagehand` handle).
pub(crate) type Planner = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// The weight runtime. Cheap to clone; clones share one runtime.
#[derive(Clone)]
pub struct WeightRuntime {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WeightRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightRuntime").finish_non_exhaustive()
    }
}

/// A block in use: resident until the guard drops (which calls `after_block`), also when the
/// code using it unwinds, or until [`release`](Self::release).
#[must_use = "the block is released when the guard drops"]
#[derive(Debug)]
pub struct BlockGuard {
    rt: WeightRuntime,
    id: BlockId,
    released: bool,
}

impl BlockGuard {
    /// The block held.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Releases the block now, with `after_block`'s error (dropping the guard drops it).
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.rt.after_block(self.id)
    }
}

impl Drop for BlockGuard {
    fn drop(&mut self) {
        // The guard only exists after a successful `before_block`, so the refcount is >= 1.
        if !self.released {
            let _ = self.rt.after_block(self.id);
        }
    }
}

impl WeightRuntime {
    /// An empty runtime on `device`; add blocks with [`register_block`](Self::register_block).
    pub fn new(device: Device, config: WeightConfig, bus: Bus) -> Result<WeightRuntime> {
        // The hook engine must be libtorch's engine before the first backward of the process,
        // and registering trainable blocks runs one (to give host leaves a gradient).
        crate::torch::hooks::install()?;
        let index: PtrIndex = Arc::default();
        let sched = Scheduler::new(device.clone(), config, bus.clone(), index.clone())?;
        let knobs = sched.knobs();
        let guards = sched.guards();
        Ok(WeightRuntime {
            inner: Arc::new(Inner {
                sched: Mutex::new(sched),
                origin: Mutex::new(None),
                current: Mutex::new(None),
                failed: Mutex::new(None),
                planner: Mutex::new(None),
                planned: AtomicBool::new(false),
                index,
                knobs,
                guards,
                device,
                bus,
            }),
        })
    }

    /// Block mode: every VarStore variable whose path has a prefix fully matching `pattern`
    /// (for example `^blocks\.\d+$`) joins that block; the other variables move to the device
    /// once and stay there. Create the VarStore on the CPU for models larger than VRAM.
    pub fn from_var_store(
        vs: &tch::nn::VarStore,
        pattern: &str,
        device: Device,
        config: WeightConfig,
        bus: Bus,
    ) -> Result<WeightRuntime> {
        let re = Regex::new(pattern).map_err(|e| Error::Config {
            field: "block_pattern",
            value: format!("'{pattern}'"),
            expected: format!("a regular expression ({e})"),
        })?;
        let (blocks, rest) = group_by_pattern(vs.variables(), &re);
        if blocks.is_empty() {
            return Err(Error::Config {
                field: "block_pattern",
                value: format!("'{pattern}'"),
                expected: "a pattern matching at least one VarStore path prefix".into(),
            });
        }
        let rt = WeightRuntime::new(device.clone(), config, bus)?;
        let dev = device.tch_device();
        for (_, mut t) in rest {
            if t.device() != dev {
                let moved = t.f_to_device(dev)?;
                t.set_data(&moved);
            }
        }
        for (name, params) in blocks {
            rt.register_block(&name, params)?;
        }
        rt.set_origin(Origin { vars: vs.variables_.clone(), seal: None });
        Ok(rt)
    }

    /// Sets what makes the memory plan before the first block use.
    pub(crate) fn set_planner(&self, planner: Planner) {
        *self.inner.planner.lock().unwrap_or_else(|p| p.into_inner()) = Some(planner);
    }

    /// Makes the memory plan if one is set and not made yet (a block used outside a step before
    /// the first step: the room is the plan's, never one sized without it).
    pub(crate) fn ensure_planned(&self) -> Result<()> {
        if self.inner.planned.load(Ordering::Acquire) {
            return Ok(());
        }
        let planner = self.inner.planner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(p) = planner {
            p()?;
        }
        self.inner.planned.store(true, Ordering::Release);
        Ok(())
    }

    /// Makes this runtime rank `member.rank` of a data-parallel group whose one host copy of the
    /// model is `model` (before any block is registered).
    pub(crate) fn join_group(&self, member: crate::collective::Membership, model: Arc<super::shared::SharedModel>) -> Result<()> {
        self.lock().join(member, model)
    }

    /// This runtime's place in its data-parallel group, if it is in one.
    pub(crate) fn membership(&self) -> Option<crate::collective::Membership> {
        self.lock().membership().cloned()
    }

    /// Records the VarStore the blocks come from.
    pub(crate) fn set_origin(&self, origin: Origin) {
        *self.inner.origin.lock().unwrap_or_else(|p| p.into_inner()) = Some(origin);
    }

    /// The VarStore the blocks come from, when the runtime was made from one.
    pub(crate) fn origin(&self) -> Option<Origin> {
        self.inner.origin.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A number that identifies this runtime (shared by its clones).
    pub fn identity(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Scheduler> {
        self.inner.sched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a block made of `params` (path, variable); the variables are copied to host memory
    /// and freed on the device until the block is needed.
    pub fn register_block(&self, name: &str, params: Vec<(String, Tensor)>) -> Result<BlockId> {
        self.lock().register(name, params)
    }

    /// Makes an unloaded frozen block stream from a safetensors file: `key_prefix + path` of
    /// each parameter must be in the file with the same dtype and shape. The host copy is freed.
    ///
    /// The file is read at every load of the block, so it must stay as it is for the whole run:
    /// a file shortened, rewritten or touched under the run makes the load fail with
    /// [`Error::WeightsFileChanged`] (see [`file`](super::file) for what is checked). A new file
    /// renamed over the path is safe: the run keeps reading the one it opened.
    /// Its bytes are checked as [`WeightConfig::file_check`] says.
    pub fn back_with_file(&self, id: BlockId, path: &std::path::Path, key_prefix: &str) -> Result<()> {
        let mut s = self.lock();
        let spec = s.block(id)?.spec.clone();
        let f = FileSource::open_checked(path, &spec, key_prefix, s.file_check())?;
        s.back_with_file(id, f)
    }

    /// The id of the block named `name`.
    pub fn block_id(&self, name: &str) -> Result<BlockId> {
        self.lock().block_id(name)
    }

    /// Every block's description, in registration order.
    pub fn blocks(&self) -> Vec<BlockSpec> {
        self.lock().specs()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Where this runtime's numeric guards are armed and read (see [`crate::guards`]).
    pub fn guards(&self) -> &GuardSlot {
        &self.inner.guards
    }

    /// The bus events go to.
    pub fn bus(&self) -> &Bus {
        &self.inner.bus
    }

    /// Starts a step (block mode).
    pub fn begin_step(&self) -> Result<()> {
        *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.lock().begin_step()
    }

    /// Starts one of a step's passes over the model (a micro-batch), saying whether the
    /// optimizer steps after it. Before the last pass the weights do not change at the pass's
    /// end, so the blocks the next pass starts with are prefetched across it like any others.
    /// Without this call every pass is taken as the step's last.
    pub fn begin_pass(&self, last: bool) -> Result<()> {
        self.lock().begin_pass(last)
    }

    /// The block that [`before_block`](Self::before_block) last failed to make resident in this
    /// step, if any: what the runtime was about to do when an allocation failed.
    pub fn failed_block(&self) -> Option<BlockId> {
        *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends an evaluation under way (forwards outside a step), publishing its totals; a no-op
    /// when none is. The next step does it too.
    pub fn end_evaluation(&self) -> Result<()> {
        self.lock().end_evaluation()
    }

    /// While forwards run outside a step (an evaluation): hooks that keep the saved weights of
    /// a forward with gradients on as handles, whose backward is an error (its blocks' slots
    /// hold other blocks by then); `None` during a step.
    pub(crate) fn evaluation_hooks(&self) -> Result<Option<SavedTensorHooks>> {
        if !self.lock().evaluating() {
            return Ok(None);
        }
        let resolver: Arc<dyn WeightResolver> = Arc::new(Evaluated(self.clone()));
        Ok(Some(SavedTensorHooks::enable(Arc::new(WeightStore::new(resolver)))?))
    }

    /// The open step failed with `cause`. If it had begun updating the model (a host step
    /// queued, or `or_updating`: the caller's optimizer phase began), the model is part stepped:
    /// every later use of the runtime, and every read of its values (a checkpoint), is an error
    /// that says which step failed and how. Returns whether the model is part stepped.
    pub fn fail_step(&self, or_updating: bool, cause: impl FnOnce() -> String) -> bool {
        let mut s = self.lock();
        s.tear_if_updating(or_updating, cause);
        s.is_torn()
    }

    /// Closes the open step after it failed before it updated anything (see
    /// [`Stagehand::train_step`](crate::Stagehand::train_step)): nothing learned, nothing
    /// stepped, the gradients it sent home dropped.
    pub fn abandon_step(&self) -> Result<()> {
        self.lock().abandon_step()
    }

    /// Whether the open step queued a host step: from then on the model's values are changing.
    pub(crate) fn updates_queued(&self) -> bool {
        self.lock().updates_queued()
    }

    /// Ends the step: learns the itinerary after step 0, publishes the step's metrics.
    pub fn end_step(&self) -> Result<()> {
        self.lock().end_step()
    }

    /// Allocates the device room for streamed blocks now instead of at the first load (the
    /// handle does this once its plan is made).
    pub fn make_room(&self) -> Result<()> {
        self.lock().make_room()
    }

    /// Loads every block kept resident that is not on the device yet (the handle does this
    /// before each step's forward, so the activations the forward keeps never take their
    /// memory). On failure, [`failed_block`](Self::failed_block) names the block that did not fit.
    pub fn load_residents(&self) -> Result<()> {
        let r = self.lock().load_residents();
        r.map_err(|(id, e)| {
            if id.is_some() {
                *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner()) = id;
            }
            e
        })
    }

    /// Makes `id` resident (a prefetch hit or a counted stall), holds it, prefetches ahead.
    pub fn before_block(&self, id: BlockId) -> Result<()> {
        let name = {
            let mut s = self.lock();
            if let Err(e) = s.enter(id) {
                *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
                return Err(e);
            }
            s.block_name(id)?
        };
        *self.inner.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(name);
        Ok(())
    }

    /// Releases `id` after its forward.
    pub fn after_block(&self, id: BlockId) -> Result<()> {
        self.lock().leave(id)?;
        *self.inner.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }

    /// Holds `id` resident until the guard drops.
    pub fn block(&self, id: BlockId) -> Result<BlockGuard> {
        self.before_block(id)?;
        Ok(BlockGuard {
            rt: self.clone(),
            id,
            released: false,
        })
    }

    /// Runs `f` with `id` resident.
    pub fn run_block<T>(&self, id: BlockId, f: impl FnOnce() -> T) -> Result<T> {
        let _g = self.block(id)?;
        Ok(f())
    }

    /// Protects blocks from eviction (`on`) or lifts the protection.
    pub fn keep_resident(&self, ids: &[BlockId], on: bool) -> Result<()> {
        let mut s = self.lock();
        for &id in ids {
            s.protect(id, on)?;
        }
        Ok(())
    }

    /// Keeps these blocks on the device for good, each in its own device buffer outside the
    /// streaming room: loaded once, never evicted, and (when trainable) trained on the device.
    /// Choose them before the first step.
    pub fn set_resident(&self, ids: &[BlockId]) -> Result<()> {
        self.lock().set_resident(ids)
    }

    /// Evicts an unused resident block now.
    pub fn evict(&self, id: BlockId) -> Result<()> {
        self.lock().evict(id, EvictionReason::Explicit, 0.0)
    }

    /// Turns the saved-tensor hooks on for this thread with a store that keeps managed weights
    /// as handles (so eviction frees them) and everything else as it is. Keep the guard alive
    /// over forward (backward needs nothing). The activation runtime uses
    /// [`resolver`](Self::resolver) instead.
    pub fn hooks(&self) -> Result<SavedTensorHooks> {
        SavedTensorHooks::enable(Arc::new(WeightStore::new(self.resolver())))
    }

    /// This runtime as the resolver the saved-tensor stores call.
    pub fn resolver(&self) -> Arc<dyn WeightResolver> {
        Arc::new(self.clone())
    }

    /// The residency state of `id`.
    pub fn state(&self, id: BlockId) -> Result<BlockState> {
        self.lock().residency().state(id)
    }

    /// The refcount of `id`.
    pub fn refcount(&self, id: BlockId) -> Result<u32> {
        Ok(self.lock().residency().get(id)?.refcount)
    }

    /// The itinerary, once a step has been traced.
    pub fn itinerary(&self) -> Option<Itinerary> {
        self.lock().itinerary()
    }

    /// Device bytes held by blocks on the device.
    pub fn resident_bytes(&self) -> usize {
        self.lock().resident_bytes()
    }

    /// Device bytes held by copies still in flight (loads landing, gradients leaving).
    pub fn in_flight_bytes(&self) -> u64 {
        self.lock().in_flight_bytes()
    }

    /// Copies not yet seen complete: (loads landing, landed loads not yet reported plus
    /// gradient copies).
    pub fn copies_in_flight(&self) -> (usize, usize) {
        self.lock().copies_in_flight()
    }

    /// Metrics of the open step so far.
    pub fn current_metrics(&self) -> WeightStepMetrics {
        self.lock().metrics()
    }

    /// Metrics of the last finished step.
    pub fn last_step_metrics(&self) -> WeightStepMetrics {
        self.lock().last_metrics()
    }

    /// Steps finished so far.
    pub fn step(&self) -> u64 {
        self.lock().step()
    }

    /// The tunables read on every use: `prefetch_window` (blocks loaded ahead) and
    /// `max_inflight_h2d` (copies in flight before prefetch holds back), starting at the
    /// configured values. Write them to retune a running runtime; an attached Conductor
    /// writes them at each phase boundary.
    pub fn knobs(&self) -> Arc<Knobs> {
        self.inner.knobs.clone()
    }

    /// Puts the runtime under `conductor`: its knobs follow the Conductor's hints (and return
    /// to their values now when it detaches), and every copy takes a transfer slot first.
    /// Fails if a weight runtime is already attached to that Conductor.
    ///
    /// ```no_run
    /// use stagehand::activations::{ActivationConfig, ActivationRuntime};
    /// use stagehand::conductor::{Conductor, ConductorConfig};
    /// use stagehand::{device::Device, events::Bus};
    /// use stagehand::weights::{WeightConfig, WeightRuntime};
    ///
    /// # fn main() -> stagehand::Result<()> {
    /// let (device, bus) = (Device::auto(8 << 30), Bus::new());
    /// let weights = WeightRuntime::new(device.clone(), WeightConfig::default(), bus.clone())?;
    /// let acts = ActivationRuntime::new(
    ///     device.clone(), ActivationConfig::default(), bus.clone(), Some(weights.resolver()))?;
    /// let dev = device.clone();
    /// let config = ConductorConfig::builder().vram_soft_cap_mib(7_000).vram_hard_cap_mib(7_800).build()?;
    /// let conductor = Conductor::new(config, bus.clone(), move || dev.memory().allocated)?;
    /// weights.attach_conductor(&conductor)?;
    /// acts.attach_conductor(&conductor)?;
    /// for step in 1..=3 {
    ///     conductor.begin_step(step)?;
    ///     acts.begin_step(step);
    ///     conductor.enter_forward()?;
    ///     // ... forward under `acts.managed_forward()`, blocks through `weights.block(id)`
    ///     conductor.enter_backward()?;
    ///     // ... backward
    ///     acts.end_step()?;
    ///     conductor.enter_optimizer()?;
    ///     // ... optimizer step
    ///     conductor.end_step()?;
    /// }
    /// conductor.shutdown();
    /// # Ok(())
    /// # }
    /// ```
    pub fn attach_conductor(&self, conductor: &Conductor) -> Result<()> {
        conductor.register(WeightAdapter::new(self.knobs()))?;
        self.lock().set_conductor(conductor.clone());
        Ok(())
    }

    /// Leaves the Conductor: knobs back to their values at attach, copies no longer take
    /// slots. A no-op when none is attached.
    pub fn detach_conductor(&self) {
        let c = self.lock().set_conductor(Conductor::disabled());
        c.detach(WeightAdapter::NAME);
    }

    /// Sets the weights' device room (`origin` says where the number came from, for errors) and
    /// the prefetch knobs. Only before the first step.
    pub fn configure(&self, room_bytes: u64, origin: impl Into<String>, prefetch_window: u32, max_inflight_h2d: u32) -> Result<()> {
        self.lock().configure(room_bytes, origin.into(), prefetch_window, max_inflight_h2d)
    }

    /// Device bytes the weights hold: the streaming room once made, and resident blocks.
    pub fn device_bytes(&self) -> u64 {
        self.lock().device_bytes()
    }

    /// Most device bytes of gradients in flight to the host (`None`: no bound); see
    /// [`WeightConfig::max_inflight_grad_bytes`].
    pub fn set_max_inflight_grad_bytes(&self, bytes: Option<u64>) {
        self.lock().set_max_inflight_grad_bytes(bytes);
    }

    /// Where later gradients of an accumulation window are added: on the host (`true`) or on
    /// the device (`false`, the default); see [`WeightConfig::host_gradient_sums`]. Only between
    /// accumulation windows, before any gradient of one was sent.
    pub fn set_host_gradient_sums(&self, on: bool) -> Result<()> {
        self.lock().set_host_gradient_sums(on)
    }

    /// Measures the compute stream's time inside the weights' hooks from now on: each step's
    /// `hook_gpu_ms` (two events a hook; off by default).
    pub fn set_measure_hook_gpu_time(&self, on: bool) {
        self.lock().set_measure_hook_gpu(on);
    }

    /// Steps begin when the first block runs again or after a backward (layer mode).
    pub fn set_auto_step(&self, on: bool) {
        self.lock().set_auto_step(on);
    }

    /// Ends an open step (layer mode's last step, which no later forward closes).
    pub fn finish(&self) -> Result<()> {
        self.lock().finish()
    }

    /// Waits for the loads in flight and reports every finished copy (a run's end: nothing of
    /// the weights is reported after it).
    pub fn settle(&self) -> Result<()> {
        self.lock().settle()
    }

    /// After a backward: every trained streamed block still holding device gradients sends them
    /// to the host (asynchronously).
    pub fn after_backward(&self) -> Result<()> {
        self.lock().after_backward()
    }

    /// Waits until every gradient has reached host memory.
    pub fn collect_grads(&self) -> Result<()> {
        self.lock().collect_grads()
    }

    /// Starts a new gradient accumulation window (libtorch's `zero_grad(set_to_none)` for
    /// streamed blocks). Never evicts a block.
    pub fn zero_grads(&self) -> Result<()> {
        self.lock().zero_grads()
    }

    /// The canonical value of parameter `param` of `id` as a fresh CPU tensor, after any pending
    /// host optimizer step: the host copy of a streamed block, the device copy of a resident one
    /// (which trains there), the file of a file-backed one. Never a placeholder.
    pub fn host_param(&self, id: BlockId, param: usize) -> Result<Tensor> {
        self.lock().host_param(id, param)
    }

    /// The canonical value of parameter `param` of `id` sharing the runtime's memory where it
    /// can (the host copy of a streamed block, the device copy of a resident one); valid until
    /// the next step or load. For checkpoints.
    pub(crate) fn param_value(&self, id: BlockId, param: usize) -> Result<Tensor> {
        self.lock().param_value(id, param)
    }

    /// Makes `value` the value of parameter `param` of `id` (loading a checkpoint): only between
    /// steps, with the parameter's dtype and shape. Fails for a file-backed block unless the
    /// value is the file's.
    pub fn set_param(&self, id: BlockId, param: usize, value: &Tensor) -> Result<()> {
        self.lock().set_param(id, param, value)
    }

    /// Handles of each managed variable the runtime itself holds (see
    /// `Scheduler::held_references`).
    pub(crate) fn held_references(&self) -> std::collections::HashMap<crate::torch::VariableId, usize> {
        self.lock().held_references()
    }

    /// Closes the runtime when the handle that owns it goes: host steps finish; later calls are
    /// errors that say the handle is gone. Idempotent; a no-op after `shutdown`.
    pub(crate) fn close(&self) -> Result<()> {
        self.lock().close()
    }

    /// Views of the host gradients of `id` that arrived in this accumulation window.
    pub(crate) fn received_grads(&self, id: BlockId) -> Result<Vec<(usize, Tensor)>> {
        self.lock().received_grads(id)
    }

    /// The host gradient of parameter `param` of `id` as of the last gradient copy (a fresh CPU
    /// tensor), or `None` when the parameter is frozen, resident, or got no gradient in this
    /// accumulation window. Call [`collect_grads`](Self::collect_grads) first.
    pub fn host_grad(&self, id: BlockId, param: usize) -> Result<Option<Tensor>> {
        let s = self.lock();
        let b = s.block(id)?;
        match b.grads.iter().find(|g| g.param == param) {
            Some(g) if g.received && g.buf.is_some() => Ok(Some(g.view.f_detach_copy()?)),
            _ => Ok(None),
        }
    }

    /// Evicts everything and leaves each parameter as a CPU copy of its weights; later calls
    /// fail with `Shutdown`; the pool wakes its waiters. Idempotent.
    pub fn shutdown(&self) -> Result<()> {
        self.lock().shutdown(false)
    }

    /// [`shutdown`](Self::shutdown), and the blocks' host copies and gradient buffers go back to
    /// the host pool, which is returned for the next model: its blocks are cut from the same
    /// pinned memory, nothing freed and pinned again ([`HostPool`]). The runtime's values stay
    /// in the variables (CPU copies); an optimizer made over this runtime is finished (save
    /// its state first).
    pub fn shutdown_keep_pool(&self) -> Result<HostPool> {
        let mut s = self.lock();
        s.shutdown(true)?;
        Ok(s.pool().clone())
    }

    /// The host pool the blocks' host copies are cut from.
    pub fn host_pool(&self) -> HostPool {
        self.lock().pool().clone()
    }

    /// Cuts the blocks' host copies from `pool` (one handed over by a finished model's
    /// [`shutdown_keep_pool`](Self::shutdown_keep_pool), or shared with another runtime on the
    /// same device). Only before the first block is registered.
    pub fn set_host_pool(&self, pool: HostPool) -> Result<()> {
        self.lock().set_pool(pool)
    }

    /// Stores frozen block `id` quantized in `format` (INT8 or FP8 E4M3 in groups with a scale
    /// each: see [`quant`](super::quant)), from its host copy or its file: its host copy and each
    /// load become its quantized payload, dequantized on the device just before use. Before the
    /// block is first loaded. A block that trains is refused, as is one with nothing worth
    /// quantizing. Publishes and returns the block's quantization error.
    pub fn quantize(&self, id: BlockId, format: QuantFormat) -> Result<QuantizationReport> {
        self.lock().quantize(id, format)
    }

    /// Stores frozen block `id` quantized from the safetensors file at `path` (`key_prefix +
    /// path` of each parameter): a file [`save_quantized`](Self::save_quantized) wrote is taken
    /// as it is, in its own format; a full-width file (bf16, fp16, fp32) is quantized in
    /// `format` as it is read. The values replace the block's (a block quantized already keeps
    /// its format and groups, and the file must match them).
    pub fn quantize_from_file(&self, id: BlockId, path: &std::path::Path, key_prefix: &str, format: QuantFormat) -> Result<QuantizationReport> {
        self.lock().quantize_from_file(id, path, key_prefix, format)
    }

    /// Writes every quantized block's payload (elements, scales, errors) to a safetensors file
    /// that [`quantize_from_file`](Self::quantize_from_file) reads back without quantizing again.
    pub fn save_quantized(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.lock().save_quantized(path.as_ref())
    }

    /// Every quantized block's report (its format, bytes and error), in block order.
    pub fn quantization_reports(&self) -> Vec<QuantizationReport> {
        self.lock().quantization_reports()
    }

    /// The index of model `entry.name` among the runtime's models, declaring it if new.
    pub(crate) fn declare_model(&self, entry: ModelEntry) -> Result<u32> {
        self.lock().model(entry)
    }

    /// Registers a block of model `model` (see [`register_block`](Self::register_block)).
    pub(crate) fn register_block_in(&self, name: &str, params: Vec<(String, Tensor)>, model: u32) -> Result<BlockId> {
        self.lock().register_in(name, params, model)
    }

    /// Publishes each model and its blocks (when the runtime streams several).
    pub(crate) fn announce_models(&self) {
        self.lock().announce_models()
    }

    /// Device memory and residency by model.
    pub fn model_memory(&self) -> Vec<ModelMemory> {
        self.lock().model_memory()
    }

    /// Every model's name and whether it is frozen, by index (the main model first).
    pub(crate) fn model_entries(&self) -> Vec<(String, bool)> {
        self.lock().models().iter().map(|m| (m.name.clone(), m.frozen)).collect()
    }

    /// Each block's model name, in block order.
    pub fn block_models(&self) -> Vec<String> {
        self.lock().block_models()
    }
}

/// The weights an evaluation's forward saved: handles, so no graph keeps a view of a slot that
/// later holds another block; a backward through them is an error, never a read of another
/// block's bytes.
struct Evaluated(WeightRuntime);

impl WeightResolver for Evaluated {
    fn resolve(&self, tensor: &Tensor) -> Option<WeightSave> {
        self.0.resolve(tensor)
    }

    fn materialize(&self, save: &WeightSave) -> std::result::Result<Tensor, crate::error::HookError> {
        let name = self.0.blocks().get(save.block.0 as usize).map(|b| b.name.clone()).unwrap_or_default();
        Err(Error::misuse(
            format!("backward through a forward that ran outside a training step (it read block '{name}')"),
            "gradients from forwards run in Stagehand::train_step (with the handle; WeightRuntime::begin_step in block mode): a forward outside a step evaluates",
        )
        .into())
    }

    fn release(&self, save: &WeightSave) {
        self.0.release(save)
    }

    fn current_region(&self) -> Option<Arc<str>> {
        self.0.current_region()
    }
}

impl WeightResolver for WeightRuntime {
    fn resolve(&self, tensor: &Tensor) -> Option<WeightSave> {
        let address = tensor.data_ptr() as u64;
        if address == 0 {
            return None;
        }
        let index = self.inner.index.lock().unwrap_or_else(|p| p.into_inner());
        let (&start, entry) = index.range(..=address).next_back()?;
        let offset = usize::try_from(address - start).ok()?;
        if offset >= entry.len {
            return None;
        }
        let (param, &(poffset, _, kind)) = entry
            .params
            .iter()
            .enumerate()
            .find(|(_, (o, b, _))| offset >= *o && offset < o + (*b).max(1))?;
        // `f_kind`: libtorch saves tensors of kinds tch cannot name (flash attention's UInt64 RNG
        // state), which are no weight's.
        if tensor.f_kind().ok() != Some(kind) {
            return None;
        }
        let elt = kind.elt_size_in_bytes();
        Some(WeightSave {
            block: entry.block,
            param: param as u32,
            storage_offset: ((offset - poffset) / elt) as i64,
            sizes: tensor.size(),
            strides: tensor.stride(),
            bytes: (tensor.numel() * elt) as u64,
        })
    }

    fn materialize(&self, save: &WeightSave) -> std::result::Result<Tensor, crate::error::HookError> {
        let mut s = self.lock();
        s.backward_use(save.block)?;
        Ok(s.param_view(save.block, save.param, save.storage_offset, &save.sizes, &save.strides)?)
    }

    fn release(&self, _save: &WeightSave) {
        // Nothing is held per save: the handle is plain data and residency is decided by the
        // itinerary, not by how many saved views exist.
    }

    fn current_region(&self) -> Option<Arc<str>> {
        self.inner.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
