//! The scheduler: makes blocks resident before they run, prefetches along the itinerary,
//! finalises copies when their events complete (never blocking the host in the steady state),
//! and evicts by next-use distance × size to stay within the budget and the watermarks.
//!
//! Under a [`Conductor`], each copy first takes a transfer slot and holds it until the copy is
//! seen complete. A demand load and the early load of the next block on the itinerary (needed
//! moments later in any case) ask with REQUIRED priority and are never refused; blocks further
//! ahead ask with SPECULATIVE priority, and a refusal just leaves them for a later prefetch.
//!
//! Memory safety across streams (design.md section 4, option b): each load copies into a
//! fresh buffer from libtorch's allocator, ordered after the compute stream's queued work (so
//! memory the allocator recycled is no longer read), the compute stream waits on the copy's
//! event before the block is used, and the copy's [`Pending`] keeps the buffer alive until the
//! copy completed. Evicting drops the buffer: the allocator reuses it in compute-stream order.

use super::file::FileSource;
use super::policy::{rank_victims, Itinerary};
use super::pool::{PinnedPool, Slab};
use super::registry::BlockSpec;
use super::residency::Residency;
use super::WeightConfig;
use crate::conductor::{Conductor, KnobValues, Knobs, SlotToken};
use crate::device::{CopyStream, Device, HostBuffer, Pending};
use crate::error::{Error, Result};
use crate::events::{
    BlockId, BlockState, Bus, Direction, EventKind, EvictionReason, Owner, Priority, TransferId,
    WeightStepMetrics,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::{COptimizer, Kind, Tensor};

/// Why a block is being loaded: it decides the slot priority, whether the load may wait for
/// a staging slab, and which blocks it may displace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// Needed now: the step stalls until it lands.
    Demand,
    /// The next block on the itinerary: needed for certain, loaded early.
    Next,
    /// Further ahead: worth loading only if nothing more urgent wants the slot.
    Ahead,
}

impl Load {
    fn priority(self) -> Priority {
        match self {
            Load::Demand | Load::Next => Priority::Required,
            Load::Ahead => Priority::Speculative,
        }
    }
}

/// Where to find the bytes of a resident block's parameters by storage pointer.
#[derive(Debug, Clone)]
pub(crate) struct IndexEntry {
    pub block: BlockId,
    /// (byte offset, bytes, dtype) of each parameter.
    pub params: Vec<(usize, usize, Kind)>,
}

/// Storage pointer of a resident block's device buffer → its layout. Behind its own lock so
/// the pack hook never waits for the scheduler.
pub(crate) type PtrIndex = Arc<Mutex<HashMap<u64, IndexEntry>>>;

/// The canonical host copy of a module-backed block: one host buffer (pinned on CUDA) and a
/// CPU tensor viewing each parameter in it. Field order matters: the views drop first.
pub(crate) struct HostCopy {
    pub views: Vec<Tensor>,
    pub buf: HostBuffer,
}

pub(crate) enum Source {
    Host(HostCopy),
    File(FileSource),
}

/// A copy whose block is already usable (the compute stream waits on it), kept only to report
/// its completion and to hold its staging slab until then. The destination buffer is not held:
/// the allocator reuses it in compute-stream order, after the copy.
struct Retired {
    done: crate::device::Event,
    id: TransferId,
    bytes: u64,
    issued: Instant,
    slot: SlotToken,
    _slab: Option<Slab>,
}

struct Inflight {
    pending: Pending,
    id: TransferId,
    bytes: u64,
    issued: Instant,
    /// The Conductor's transfer slot, given back when the copy is seen complete.
    slot: SlotToken,
    /// The staging slab the copy reads (file-backed blocks), returned when it completes.
    _slab: Option<Slab>,
}

pub(crate) struct BlockData {
    pub spec: BlockSpec,
    /// The model's parameters (shared TensorImpls: `set_data` re-points every handle).
    pub vars: Vec<Tensor>,
    pub source: Source,
    device_buf: Option<Tensor>,
    device_ptr: u64,
    inflight: Option<Inflight>,
    /// Sets the device gradients of the trainable parameters to none (libtorch's
    /// `zero_grad(set_to_none)`), so flushed gradients free their memory.
    grad_release: Option<COptimizer>,
}

pub(crate) struct Scheduler {
    pub device: Device,
    stream: CopyStream,
    pub bus: Bus,
    pub cfg: WeightConfig,
    /// Shared with the Conductor's adapter; read on every use, never cached.
    pub knobs: Arc<Knobs>,
    /// Grants the transfer slots (disabled: every copy proceeds at no cost).
    pub conductor: Conductor,
    pub blocks: Vec<BlockData>,
    pub residency: Residency,
    pub itinerary: Option<Itinerary>,
    pub learned: bool,
    trace: Vec<BlockId>,
    pub pos: Option<usize>,
    pub backward: bool,
    backward_seen: bool,
    pub resident_bytes: usize,
    retired: Vec<Retired>,
    pub pool: Option<PinnedPool>,
    pub metrics: WeightStepMetrics,
    pub last_metrics: WeightStepMetrics,
    pub step: u64,
    pub step_open: bool,
    pub auto_step: bool,
    entered: Vec<BlockId>,
    next_transfer: u64,
    index: PtrIndex,
    pub shut_down: bool,
}

fn torch<T>(r: std::result::Result<T, tch::TchError>) -> Result<T> {
    r.map_err(Error::from)
}

impl Scheduler {
    pub fn new(device: Device, cfg: WeightConfig, bus: Bus, index: PtrIndex) -> Result<Scheduler> {
        cfg.validate()?;
        let stream = device.copy_stream()?;
        bus.publish(EventKind::LimitsSet {
            owner: Owner::Weights,
            budget_bytes: cfg.weight_budget(),
            high_watermark_bytes: Some(cfg.vram_high_watermark_bytes),
            low_watermark_bytes: Some(cfg.vram_low_watermark_bytes),
        });
        let knobs = Knobs::new(KnobValues {
            max_inflight_h2d: cfg.max_inflight_h2d,
            // Gradients go to the host one synchronous copy at a time.
            max_inflight_d2h: 1,
            prefetch_window: cfg.prefetch_window,
            suppress_speculative: false,
        });
        Ok(Scheduler {
            device,
            stream,
            bus,
            cfg,
            knobs,
            conductor: Conductor::disabled(),
            blocks: Vec::new(),
            residency: Residency::new(),
            itinerary: None,
            learned: false,
            trace: Vec::new(),
            pos: None,
            backward: false,
            backward_seen: false,
            resident_bytes: 0,
            retired: Vec::new(),
            pool: None,
            metrics: WeightStepMetrics::default(),
            last_metrics: WeightStepMetrics::default(),
            step: 0,
            step_open: false,
            auto_step: false,
            entered: Vec::new(),
            next_transfer: 0,
            index,
            shut_down: false,
        })
    }

    fn check_live(&self) -> Result<()> {
        if self.shut_down {
            return Err(Error::Shutdown("weight runtime"));
        }
        Ok(())
    }

    pub fn block(&self, id: BlockId) -> Result<&BlockData> {
        self.blocks
            .get(id.0 as usize)
            .ok_or_else(|| Error::UnknownBlock(id.to_string()))
    }

    /// Adds a module-backed block: copies its parameters into a new host buffer and leaves
    /// them pointing at empty device tensors until the block is first needed.
    pub fn register(&mut self, name: &str, params: Vec<(String, Tensor)>) -> Result<BlockId> {
        self.check_live()?;
        if self.blocks.iter().any(|b| b.spec.name == name) {
            return Err(Error::Config {
                field: "block",
                value: format!("'{name}'"),
                expected: "a name not registered yet".into(),
            });
        }
        let id = BlockId(self.blocks.len() as u32);
        let spec = BlockSpec::layout(id, name, &params)?;
        let slab = self.cfg.slab_bytes();
        if spec.bytes as u64 > slab {
            return Err(Error::TooLarge {
                what: format!("block '{name}'"),
                needed: spec.bytes as u64,
                limit: format!("a pinned slab has {slab} bytes (raise pinned_slab_bytes)"),
            });
        }
        let budget = self.cfg.weight_budget();
        if spec.bytes as u64 > budget {
            return Err(Error::TooLarge {
                what: format!("block '{name}'"),
                needed: spec.bytes as u64,
                limit: format!("the weight budget is {budget} bytes"),
            });
        }
        let buf = self.device.alloc_host(spec.bytes)?;
        let mut views = Vec::with_capacity(params.len());
        let mut grad_release = None;
        for (p, (_, var)) in spec.params.iter().zip(&params) {
            let strides = contiguous_strides(&p.shape);
            // SAFETY: the view covers `p.bytes` bytes at `p.offset` inside `buf`, which the
            // layout sized to hold every parameter; `HostCopy` drops the views before `buf`,
            // and the views never leave the runtime (the optimizer holds the runtime alive).
            let mut view = unsafe {
                Tensor::f_from_blob(
                    buf.as_slice().as_ptr().add(p.offset),
                    &p.shape,
                    &strides,
                    p.kind,
                    tch::Device::Cpu,
                )
            }?;
            tch::no_grad(|| view.f_copy_(var))?;
            if p.trainable {
                view = view.set_requires_grad(true);
                define_zero_grad(&view)?;
                let opt = grad_release.get_or_insert(torch(COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false))?);
                torch(opt.add_parameters(var, 0))?;
            }
            views.push(view);
        }
        let dev = self.device.tch_device();
        let mut vars = Vec::with_capacity(params.len());
        for (p, (_, var)) in spec.params.iter().zip(params) {
            let mut var = var;
            var.set_data(&placeholder(p.kind, &p.shape, dev)?);
            vars.push(var);
        }
        self.residency.add(name);
        let trainable = spec.trainable();
        self.bus.publish(EventKind::BlockRegistered {
            block: id,
            name: name.to_string(),
            bytes: spec.bytes as u64,
            exec_order: id.0,
            file_backed: false,
            trainable,
        });
        self.blocks.push(BlockData {
            spec,
            vars,
            source: Source::Host(HostCopy { views, buf }),
            device_buf: None,
            device_ptr: 0,
            inflight: None,
            grad_release,
        });
        Ok(id)
    }

    /// Switches a frozen, unloaded block to stream from a safetensors file.
    pub fn back_with_file(&mut self, id: BlockId, file: FileSource) -> Result<()> {
        self.check_live()?;
        if self.residency.state(id)? != BlockState::Unloaded {
            return Err(Error::State(format!("block {id} must be unloaded to switch to a file")));
        }
        if self.pool.is_none() {
            self.pool = Some(PinnedPool::new(
                &self.device,
                self.cfg.slab_bytes() as usize,
                self.cfg.num_slabs() as u32,
                self.bus.clone(),
            )?);
        }
        let b = &mut self.blocks[id.0 as usize];
        b.source = Source::File(file);
        Ok(())
    }

    fn view_param(buf: &Tensor, spec: &BlockSpec, i: usize) -> Result<Tensor> {
        let p = &spec.params[i];
        let t = torch(buf.f_narrow(0, p.offset as i64, p.bytes as i64))?;
        let t = torch(t.f_view_dtype(p.kind))?;
        torch(t.f_view(p.shape.as_slice()))
    }

    // ---- step lifecycle -------------------------------------------------------------------

    pub fn begin_step(&mut self) -> Result<()> {
        self.check_live()?;
        if self.step_open {
            return Err(Error::State(format!("step {} is already open", self.step)));
        }
        // Each step's gradients go to the host before the next adds to them, so host sums run
        // in micro-batch order exactly like autograd's own accumulation.
        for i in 0..self.blocks.len() {
            self.flush_grads(BlockId(i as u32))?;
        }
        self.step_open = true;
        self.metrics = WeightStepMetrics::default();
        self.backward = false;
        self.backward_seen = false;
        self.pos = None;
        self.entered.clear();
        Ok(())
    }

    pub fn end_step(&mut self) -> Result<()> {
        self.check_live()?;
        if !self.step_open {
            return Err(Error::State("end_step without an open step".into()));
        }
        self.reap()?;
        if !self.learned && !self.trace.is_empty() {
            let it = Itinerary::new(std::mem::take(&mut self.trace), !self.cfg.inference_mode);
            self.bus.publish(EventKind::ItineraryLearned {
                order: it.forward().to_vec(),
            });
            self.itinerary = Some(it);
            self.learned = true;
        }
        let mem = self.device.memory();
        let m = &mut self.metrics;
        let seen = m.prefetch_hits + m.prefetch_misses;
        m.hit_rate = if seen == 0 { 0.0 } else { m.prefetch_hits as f64 / seen as f64 };
        m.vram_used_mb = mem.allocated as f64 / (1u64 << 20) as f64;
        m.vram_reserved_mb = mem.reserved as f64 / (1u64 << 20) as f64;
        if let Some(p) = &self.pool {
            let s = p.stats();
            m.host_pool_free = s.free;
            m.host_pool_in_use = s.in_use;
        }
        self.bus.publish(EventKind::WeightStep(self.metrics.clone()));
        self.last_metrics = std::mem::take(&mut self.metrics);
        self.step += 1;
        self.step_open = false;
        Ok(())
    }

    // ---- block use ------------------------------------------------------------------------

    pub fn before_block(&mut self, id: BlockId) -> Result<()> {
        self.check_live()?;
        self.block(id)?;
        if self.auto_step {
            if !self.step_open {
                self.begin_step()?;
            } else if self.backward_seen || self.entered.first() == Some(&id) {
                self.end_step()?;
                self.begin_step()?;
            }
        }
        if !self.step_open {
            return Err(Error::State(format!(
                "block {id} used outside a step: call begin_step first"
            )));
        }
        if !self.learned && !self.trace.contains(&id) {
            self.trace.push(id);
        }
        if !self.entered.contains(&id) {
            self.entered.push(id);
        }
        self.backward = false;
        self.move_to(id);
        self.ensure_ready(id)?;
        self.residency.acquire(id, self.step)?;
        self.prefetch()?;
        self.watermark(id)
    }

    pub fn after_block(&mut self, id: BlockId) -> Result<()> {
        self.block(id)?;
        self.residency.release(id)?;
        if self.shut_down {
            return Ok(());
        }
        self.watermark(id)
    }

    /// A backward use (a saved weight being unpacked): resident, prefetch ahead in reverse.
    pub fn backward_use(&mut self, id: BlockId) -> Result<()> {
        self.check_live()?;
        self.block(id)?;
        self.backward = true;
        self.backward_seen = true;
        self.move_to(id);
        self.ensure_ready(id)?;
        self.prefetch()?;
        self.watermark(id)
    }

    fn move_to(&mut self, id: BlockId) {
        if let Some(it) = &self.itinerary {
            if let Some(p) = it.position(id, self.backward, self.pos) {
                self.pos = Some(p);
            }
        }
    }

    pub fn param_view(&self, id: BlockId, param: u32, rel_offset: i64, sizes: &[i64], strides: &[i64]) -> Result<Tensor> {
        let b = self.block(id)?;
        let p = b
            .spec
            .params
            .get(param as usize)
            .ok_or_else(|| Error::State(format!("block {id} has no parameter {param}")))?;
        let var = &b.vars[param as usize];
        torch(var.f_as_strided(sizes, strides, Some(p.elem_offset() + rel_offset)))
    }

    fn ensure_ready(&mut self, id: BlockId) -> Result<()> {
        self.reap()?;
        match self.residency.state(id)? {
            BlockState::GpuReady => {
                self.metrics.prefetch_hits += 1;
                self.bus.publish(EventKind::PrefetchHit { block: id });
            }
            BlockState::Prefetching => {
                // Prefetched ahead: a hit even if the copy is still landing. The compute stream
                // waits on the copy's event (no host stall); any GPU-side wait shows in step time.
                self.finalize(id)?;
                self.metrics.prefetch_hits += 1;
                self.bus.publish(EventKind::PrefetchHit { block: id });
            }
            BlockState::Unloaded => {
                let t0 = Instant::now();
                self.load(id, Load::Demand)?;
                self.finalize(id)?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                self.metrics.prefetch_misses += 1;
                self.metrics.stall_count += 1;
                self.metrics.stall_time_ms += ms;
                self.bus.publish(EventKind::PrefetchMiss { block: id, stall_ms: ms });
            }
            s => {
                return Err(Error::State(format!(
                    "block {id} is in transient state '{s}' when needed"
                )))
            }
        }
        Ok(())
    }

    /// Copies not yet seen complete: (blocks still prefetching, retired copies of ready or
    /// evicted blocks).
    pub fn copies_in_flight(&self) -> (usize, usize) {
        (self.inflight_count() as usize, self.retired.len())
    }

    fn inflight_count(&self) -> u32 {
        self.blocks.iter().filter(|b| b.inflight.is_some()).count() as u32
    }

    /// Issues the H2D copy of an unloaded block. `false` when a prefetch was held back (the
    /// copy engine is busy, the Conductor refused a slot, or nothing may make room).
    fn load(&mut self, id: BlockId, why: Load) -> Result<bool> {
        let demand = why == Load::Demand;
        let max = self.knobs.max_inflight_h2d().max(1);
        if !demand && self.inflight_count() >= max {
            return Ok(false);
        }
        // Refusals are published by the Conductor; a required request is never refused.
        let Ok(slot) = self
            .conductor
            .acquire_slot(Direction::H2d, Owner::Weights, why.priority())
        else {
            return Ok(false);
        };
        let bytes = self.blocks[id.0 as usize].spec.bytes;
        if !self.make_room(id, bytes, demand)? {
            return Ok(false);
        }
        // File-backed blocks stage through a slab first (taken before the state changes, so a
        // speculative load that finds the pool empty leaves the block untouched).
        let slab = match &self.blocks[id.0 as usize].source {
            Source::Host(_) => None,
            Source::File(f) => {
                let pool = self
                    .pool
                    .as_ref()
                    .ok_or_else(|| Error::State("file-backed block without a pool".into()))?;
                let mut slab = if demand {
                    pool.acquire(bytes, None)?
                } else {
                    match pool.try_acquire(bytes)? {
                        Some(s) => s,
                        None => return Ok(false),
                    }
                };
                f.stage(&self.blocks[id.0 as usize].spec, slab.buffer_mut())?;
                Some(slab)
            }
        };
        self.residency.transition(id, BlockState::HostStaged, &self.bus)?;
        let buf = torch(Tensor::f_empty([bytes as i64], (Kind::Uint8, self.device.tch_device())))?;
        self.device.account(bytes as i64);
        self.resident_bytes += bytes;
        let src = match (&slab, &self.blocks[id.0 as usize].source) {
            (Some(s), _) => s.buffer(),
            (None, Source::Host(h)) => &h.buf,
            (None, Source::File(_)) => {
                return Err(Error::State("file-backed block without a staged slab".into()))
            }
        };
        let pending = self.stream.h2d(&buf, src, 0, None)?;
        self.residency.transition(id, BlockState::Prefetching, &self.bus)?;
        self.next_transfer += 1;
        let tid = TransferId(self.next_transfer);
        self.bus.publish_with(|| EventKind::TransferIssued {
            id: tid,
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: bytes as u64,
            subject: format!("block {id}"),
        });
        self.metrics.h2d_bytes += bytes as u64;
        let b = &mut self.blocks[id.0 as usize];
        b.device_ptr = buf.data_ptr() as u64;
        b.device_buf = Some(buf);
        b.inflight = Some(Inflight {
            pending,
            id: tid,
            bytes: bytes as u64,
            issued: Instant::now(),
            slot,
            _slab: slab,
        });
        Ok(true)
    }

    /// Publishes a completed copy and gives its slot back.
    fn complete(&self, id: TransferId, bytes: u64, ms: f64, slot: SlotToken) {
        self.bus.publish(EventKind::TransferCompleted {
            id,
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes,
            duration_ms: ms,
        });
        slot.complete(bytes, Duration::from_secs_f64(ms.max(0.0) / 1e3));
    }

    /// Makes a prefetching block usable: the compute stream waits on its copy (no host wait),
    /// the parameters point into its device buffer.
    fn finalize(&mut self, id: BlockId) -> Result<()> {
        if let Some(f) = self.blocks[id.0 as usize].inflight.take() {
            if f.pending.is_complete() {
                let ms = match f.pending.elapsed_ms() {
                    ms if ms > 0.0 => ms,
                    _ => f.issued.elapsed().as_secs_f64() * 1e3,
                };
                self.complete(f.id, f.bytes, ms, f.slot);
            } else {
                self.device.compute_wait(&f.pending.done)?;
                let done = f.pending.release_after_compute_wait();
                self.retired.push(Retired {
                    done,
                    id: f.id,
                    bytes: f.bytes,
                    issued: f.issued,
                    slot: f.slot,
                    _slab: f._slab,
                });
            }
        }
        self.residency.transition(id, BlockState::GpuReady, &self.bus)?;
        let b = &mut self.blocks[id.0 as usize];
        let buf = b
            .device_buf
            .as_ref()
            .ok_or_else(|| Error::State(format!("block {id} is ready without a device buffer")))?;
        for i in 0..b.vars.len() {
            let v = Self::view_param(buf, &b.spec, i)?;
            b.vars[i].set_data(&v);
        }
        let entry = IndexEntry {
            block: id,
            params: b.spec.params.iter().map(|p| (p.offset, p.bytes, p.kind)).collect(),
        };
        let ptr = b.device_ptr;
        self.index.lock().unwrap_or_else(|p| p.into_inner()).insert(ptr, entry);
        Ok(())
    }

    /// Publishes completed copies and finalises blocks whose copy has landed.
    fn reap(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.retired.len() {
            if self.retired[i].done.is_complete() {
                let f = self.retired.swap_remove(i);
                let ms = f.issued.elapsed().as_secs_f64() * 1e3;
                self.complete(f.id, f.bytes, ms, f.slot);
            } else {
                i += 1;
            }
        }
        for i in 0..self.blocks.len() {
            let done = self.blocks[i]
                .inflight
                .as_ref()
                .is_some_and(|f| f.pending.is_complete());
            if done {
                self.finalize(BlockId(i as u32))?;
            }
        }
        Ok(())
    }

    /// Blocks that must not be evicted now: the one at the cursor and the prefetch window.
    fn window(&self) -> Vec<BlockId> {
        let (Some(it), Some(pos)) = (&self.itinerary, self.pos) else {
            return Vec::new();
        };
        let k = self.knobs.prefetch_window() as usize;
        let mut w = it.window(pos, k);
        w.push(it.at(pos));
        w
    }

    fn candidates(&self, keep: BlockId, window: &[BlockId], allow_window: bool) -> Vec<(BlockId, usize)> {
        self.blocks
            .iter()
            .map(|b| b.spec.id)
            .filter(|&b| b != keep && self.residency.can_evict(b))
            .filter(|b| allow_window || !window.contains(b))
            .map(|b| (b, self.blocks[b.0 as usize].spec.bytes))
            .collect()
    }

    fn distance(&self, id: BlockId) -> usize {
        match (&self.itinerary, self.pos) {
            (Some(it), Some(p)) => it.distance(p, id).unwrap_or(it.len()),
            _ => usize::MAX,
        }
    }

    /// Evicts until `bytes` more fit in the weight budget. A speculative load only displaces
    /// blocks needed later than itself; a demand load may take the window as a last resort.
    fn make_room(&mut self, id: BlockId, bytes: usize, demand: bool) -> Result<bool> {
        let budget = self.cfg.weight_budget() as usize;
        let my_distance = self.distance(id);
        while self.resident_bytes + bytes > budget {
            let window = self.window();
            let mut cands = self.candidates(id, &window, false);
            if !demand {
                cands.retain(|c| self.distance(c.0) > my_distance);
            } else if cands.is_empty() {
                cands = self.candidates(id, &window, true);
                if cands.is_empty() {
                    // Copies in flight hold budget too: let them land, then retry.
                    let flying: Vec<_> = (0..self.blocks.len() as u32)
                        .map(BlockId)
                        .filter(|&b| b != id && self.blocks[b.0 as usize].inflight.is_some())
                        .collect();
                    if !flying.is_empty() {
                        for b in flying {
                            self.finalize(b)?;
                        }
                        continue;
                    }
                }
            }
            let ranked = rank_victims(self.itinerary.as_ref(), self.pos, &cands);
            match ranked.first() {
                Some(&(victim, score)) => self.evict(victim, EvictionReason::Budget, score)?,
                None if demand => {
                    return Err(Error::TooLarge {
                        what: format!("block '{}'", self.blocks[id.0 as usize].spec.name),
                        needed: bytes as u64,
                        limit: format!(
                            "the weight budget is {budget} bytes and {} are held by blocks in use or protected",
                            self.resident_bytes
                        ),
                    })
                }
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// VRAM at or above the high watermark: evict until under the low one (hysteresis).
    fn watermark(&mut self, keep: BlockId) -> Result<()> {
        if self.device.memory().allocated < self.cfg.vram_high_watermark_bytes {
            return Ok(());
        }
        let window = self.window();
        let cands = self.candidates(keep, &window, false);
        for (victim, score) in rank_victims(self.itinerary.as_ref(), self.pos, &cands) {
            if self.device.memory().allocated < self.cfg.vram_low_watermark_bytes {
                break;
            }
            self.evict(victim, EvictionReason::Watermark, score)?;
        }
        Ok(())
    }

    fn prefetch(&mut self) -> Result<()> {
        if !self.learned {
            return Ok(());
        }
        let (Some(it), Some(pos)) = (&self.itinerary, self.pos) else {
            return Ok(());
        };
        let k = self.knobs.prefetch_window() as usize;
        if k == 0 {
            return Ok(());
        }
        let window = it.window(pos, k);
        let backward = self.backward;
        self.bus.publish_with(|| EventKind::PrefetchWindow {
            cursor: pos as u32,
            backward,
            window: window.clone(),
        });
        for (i, b) in window.into_iter().enumerate() {
            if self.device.memory().allocated >= self.cfg.vram_high_watermark_bytes {
                break;
            }
            let why = if i == 0 { Load::Next } else { Load::Ahead };
            if self.residency.state(b)? == BlockState::Unloaded && !self.load(b, why)? {
                break;
            }
        }
        Ok(())
    }

    /// Evicts one block: trainable blocks hand their gradients to the host first (Evicting),
    /// frozen ones just free (GpuFreeing). Parameters point at empty tensors afterwards.
    pub fn evict(&mut self, id: BlockId, reason: EvictionReason, score: f64) -> Result<()> {
        if !self.residency.can_evict(id) {
            let e = self.residency.get(id)?;
            return Err(Error::State(format!(
                "block {id} cannot be evicted (state '{}', refcount {}, protected {})",
                e.state, e.refcount, e.protected
            )));
        }
        let trainable = self.blocks[id.0 as usize].spec.trainable();
        if trainable {
            self.residency.transition(id, BlockState::Evicting, &self.bus)?;
            self.flush_grads(id)?;
        } else {
            self.residency.transition(id, BlockState::GpuFreeing, &self.bus)?;
        }
        let dev = self.device.tch_device();
        let b = &mut self.blocks[id.0 as usize];
        for (p, var) in b.spec.params.iter().zip(b.vars.iter_mut()) {
            var.set_data(&placeholder(p.kind, &p.shape, dev)?);
        }
        b.device_buf = None;
        let ptr = std::mem::take(&mut b.device_ptr);
        let bytes = b.spec.bytes;
        self.index.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr);
        self.device.account(-(bytes as i64));
        self.resident_bytes -= bytes;
        self.residency.transition(id, BlockState::Unloaded, &self.bus)?;
        self.metrics.evictions += 1;
        self.bus.publish(EventKind::Eviction {
            block: id,
            reason,
            score,
            bytes: bytes as u64,
        });
        Ok(())
    }

    /// Adds the device gradients of a trainable block into its host gradients and frees them.
    pub fn flush_grads(&mut self, id: BlockId) -> Result<()> {
        let b = &mut self.blocks[id.0 as usize];
        let Source::Host(h) = &b.source else { return Ok(()) };
        let Some(release) = &b.grad_release else { return Ok(()) };
        let mut moved = 0u64;
        let mut slot = None;
        let t0 = Instant::now();
        for (var, view) in b.vars.iter().zip(&h.views) {
            let g = var.grad();
            if !g.defined() {
                continue;
            }
            if slot.is_none() {
                // A synchronous copy the step waits for: required, so never refused.
                slot = self
                    .conductor
                    .acquire_slot(Direction::D2h, Owner::Weights, Priority::Required)
                    .ok();
            }
            let host = tch::no_grad(|| g.f_to_device(tch::Device::Cpu))?;
            let mut acc = view.grad();
            let _ = tch::no_grad(|| acc.f_add_(&host))?;
            moved += (g.numel() * g.kind().elt_size_in_bytes()) as u64;
        }
        if moved > 0 {
            torch(release.zero_grad())?;
            self.metrics.d2h_bytes += moved;
        }
        if let Some(s) = slot {
            s.complete(moved, t0.elapsed());
        }
        Ok(())
    }

    /// Before an optimizer step on the host: every gradient to the host, every trainable block
    /// off the device (its device copy goes stale), every copy reading host memory finished.
    pub fn collect_grads(&mut self) -> Result<()> {
        self.check_live()?;
        for i in 0..self.blocks.len() {
            let id = BlockId(i as u32);
            if !self.blocks[i].spec.trainable() {
                continue;
            }
            if self.residency.state(id)? == BlockState::Prefetching {
                self.finalize(id)?;
            }
            if self.residency.state(id)? == BlockState::GpuReady && self.residency.can_evict(id) {
                self.evict(id, EvictionReason::Explicit, 0.0)?;
            }
            self.flush_grads(id)?;
        }
        self.stream.synchronize()?;
        self.reap()
    }

    /// Zeroes the host gradients.
    pub fn zero_host_grads(&mut self) -> Result<()> {
        for b in &self.blocks {
            if let Source::Host(h) = &b.source {
                for v in h.views.iter().filter(|v| v.requires_grad()) {
                    let mut g = v.grad();
                    if g.defined() {
                        let _ = tch::no_grad(|| g.f_zero_())?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The host copy of one parameter (a fresh CPU tensor).
    pub fn host_param(&self, id: BlockId, i: usize) -> Result<Tensor> {
        let b = self.block(id)?;
        match &b.source {
            Source::Host(h) => Ok(tch::no_grad(|| h.views[i].f_detach_copy())?),
            Source::File(f) => f.read_param(i, &b.spec.params[i]),
        }
    }

    /// Evicts everything, leaves the parameters as CPU copies of the host data, shuts the pool.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.shut_down {
            return Ok(());
        }
        for i in 0..self.blocks.len() {
            let id = BlockId(i as u32);
            if self.residency.state(id)? == BlockState::Prefetching {
                self.finalize(id)?;
            }
            self.residency.set_protected(id, false, &self.bus)?;
            if self.residency.state(id)? == BlockState::GpuReady {
                self.evict(id, EvictionReason::Shutdown, 0.0)?;
            }
            self.flush_grads(id)?;
        }
        self.stream.synchronize()?;
        self.reap()?;
        self.retired.clear();
        for i in 0..self.blocks.len() {
            for j in 0..self.blocks[i].vars.len() {
                let t = self.host_param(BlockId(i as u32), j)?;
                self.blocks[i].vars[j].set_data(&t);
            }
        }
        if let Some(p) = &self.pool {
            p.shutdown();
        }
        self.shut_down = true;
        Ok(())
    }
}

/// What an evicted parameter points at: its full shape with every stride 0 over one element.
/// Keeping the shape matters: autograd's `AccumulateGrad` may still run for a parameter whose
/// block is evicted (an embedding's weight is never needed in backward), and it lays the new
/// gradient out after the parameter; with a 0-element placeholder it would fail (the seed's
/// device-mismatch bug, in another guise). An expanded tensor is not dense, so libtorch just
/// keeps a contiguous gradient, which the next flush moves to the host.
fn placeholder(kind: Kind, shape: &[i64], dev: tch::Device) -> Result<Tensor> {
    let one = torch(Tensor::f_zeros([1], (kind, dev)))?;
    let t = torch(one.f_view(vec![1i64; shape.len()].as_slice()))?;
    torch(t.f_expand(shape, false))
}

fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1].max(1);
    }
    s
}

/// Gives a host leaf a defined, zero gradient (libtorch exposes no setter; a backward through
/// `sum` writes ones, which are then zeroed). The optimizer reads it; flushes add into it.
fn define_zero_grad(t: &Tensor) -> Result<()> {
    tch::with_grad(|| -> Result<()> {
        let s = torch(t.f_sum(t.kind()))?;
        torch(s.f_backward())?;
        Ok(())
    })?;
    let mut g = t.grad();
    let _ = tch::no_grad(|| g.f_zero_())?;
    Ok(())
}
