//! The device room: loads into slots, prefetch along the itinerary, finalisation on the copy's
//! event, and eviction (Belady's choice, [`super::super::evictor`]).

use super::super::block::{Placement, Source};
use super::super::evictor;
use super::super::loads::LoadSource;
use super::super::slots::Slots;
use super::{IndexEntry, Load, Scheduler};
use crate::device::Order;
use crate::error::{Error, Result};
use crate::conductor::ReservationRequest;
use crate::events::{BlockId, BlockState, Direction, EventKind, EvictionReason, Owner, Priority, ReservationMode, Resource};
use std::time::Instant;

/// Where a load copies a block's host bytes in its device bytes `buf`: all of them, or for a
/// quantized block its payload's place at their end (dequantized in place at `finalize`).
fn landing(buf: &tch::Tensor, spec: &super::super::registry::BlockSpec) -> Result<tch::Tensor> {
    match &spec.quant {
        Some(q) => Ok(buf.f_narrow(0, q.offset as i64, q.bytes as i64)?),
        None => Ok(buf.shallow_clone()),
    }
}

impl Load {
    fn priority(self) -> Priority {
        match self {
            Load::Demand | Load::Next => Priority::Required,
            Load::Ahead => Priority::Speculative,
        }
    }
}

/// At most this many evictions to make room for one load: more means a bug, not a full room.
const MAX_EVICTIONS_PER_LOAD: usize = 4096;

/// Finished copies a block use reports at most (see `Loads::reap_some`): more than the copies
/// a use issues, so reporting keeps up, few enough that a step's first use issues its copies
/// without first reporting the whole previous step's.
const REPORTS_PER_USE: usize = 2;

impl Scheduler {
    /// The room for streamed blocks, made on first use from the registered blocks: slots of the
    /// largest streamed block, as many as the weights' budget holds after resident blocks.
    pub(super) fn room(&mut self) -> Result<&mut Slots> {
        if self.slots.is_none() {
            let streamed = || self.blocks.iter().filter(|b| !b.resident);
            let largest = streamed().map(|b| b.spec.bytes).max().unwrap_or(0).max(1);
            let resident: u64 = self.blocks.iter().filter(|b| b.resident).map(|b| b.spec.bytes as u64).sum();
            let budget = self.cfg.weight_budget();
            let room = budget.saturating_sub(resident);
            let count = super::super::slots::room_slots(budget, resident, largest as u64, streamed().count().max(1));
            let count = usize::try_from(count).unwrap_or(usize::MAX);
            if count == 0 {
                return Err(Error::TooLarge {
                    what: "the largest streamed block".into(),
                    needed: largest as u64,
                    limit: format!(
                        "the weights' device room is {room} bytes ({budget} from {}, less {resident} for resident blocks)",
                        self.cfg.room_source()
                    ),
                });
            }
            // The room is asked of the Conductor before it is allocated (the allocator counts it
            // afterwards, so the reservation ends once the memory is held). Nothing runs
            // without it: critical, so no reserve is kept back from it.
            let bytes = (largest * count) as u64;
            let ask = ReservationRequest::new(Owner::Weights, Resource::Vram, bytes)
                .mode(ReservationMode::Hard)
                .priority(Priority::Critical);
            let decision = self.conductor.reserve(ask);
            if !decision.is_granted() {
                return Err(Error::TooLarge {
                    what: "the weights' device room".into(),
                    needed: bytes,
                    limit: format!(
                        "the Conductor refused it ({}); {} bytes are allocated on the device",
                        decision.reason.map_or("no reason", |r| r.as_str()),
                        self.device.memory().allocated
                    ),
                });
            }
            let made = Slots::new(&self.device, largest, count);
            if let Some(id) = decision.id {
                self.conductor.release(id);
            }
            self.slots = Some(made?);
        }
        self.slots.as_mut().ok_or_else(|| Error::internal("the device room was not made"))
    }

    /// Reports landed copies and gives gradient buffers back.
    pub(super) fn reap(&mut self) {
        self.loads.reap(&self.loader);
        self.grads.reap(&mut self.blocks);
        if let Some(r) = &mut self.rank {
            r.reduce.reap(&mut self.blocks);
        }
    }

    /// Makes `id` usable now: a hit when it is on the device or landing, a counted miss (a demand
    /// load) when it is not.
    pub(super) fn ensure_ready(&mut self, id: BlockId) -> Result<()> {
        self.loads.reap_some(&self.loader, REPORTS_PER_USE);
        self.grads.reap(&mut self.blocks);
        match self.residency.state(id)? {
            BlockState::GpuReady => self.hit(id),
            BlockState::Prefetching => {
                // A hit even if the copy is still landing: the compute stream waits on its event
                // (measured), the host does not.
                self.finalize(id, true)?;
                self.hit(id);
            }
            BlockState::Unloaded => {
                let t0 = Instant::now();
                self.load(id, Load::Demand, None)?;
                self.finalize(id, true)?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let m = &mut self.metrics;
                m.prefetch_misses += 1;
                m.stall_count += 1;
                m.stall_time_ms += ms;
                self.bus.publish(EventKind::PrefetchMiss { block: id, stall_ms: ms });
            }
            s => {
                return Err(Error::internal(format!(
                    "block {id} is in transient state '{s}' when needed"
                )))
            }
        }
        Ok(())
    }

    fn hit(&mut self, id: BlockId) {
        self.metrics.prefetch_hits += 1;
        self.bus.publish(EventKind::PrefetchHit { block: id });
    }

    /// Issues loads for the blocks ahead on the itinerary that are not on the device. The window
    /// counts positions: looking past blocks already on the device to start later loads
    /// earlier was measured (forward only, room for 4 of 16 blocks) to evict the blocks a cyclic
    /// itinerary keeps across steps, 15 loads a step instead of 14, with no gain forward and
    /// backward (docs/benchmarks.md).
    ///
    /// In the forward, the first block of the window that needs a load is loaded even when the
    /// host optimizer is still stepping it: once the block entered now has queued its kernels
    /// (at its `leave`, so the device has work while the thread waits), the thread waits for
    /// that step (counted as waiting for the optimizer, which it is) and issues the load, which
    /// then overlaps the blocks before it instead of stalling the block's use. At a step's start
    /// that is the first streamed block: the last step's backward ends on it, so its host step
    /// is the last to start, and skipping it here made it a miss in almost every step. Blocks
    /// further ahead, and blocks in the backward, are skipped while their step runs.
    pub(super) fn prefetch(&mut self) -> Result<()> {
        let k = self.knobs.prefetch_window() as usize;
        if k == 0 || self.route.itinerary().is_none() {
            return Ok(());
        }
        let window = self.route.window(k);
        let (cursor, backward) = (self.route.pos().unwrap_or(0) as u32, self.route.backward());
        self.bus.publish_with(|| EventKind::PrefetchWindow {
            cursor,
            backward,
            window: window.iter().map(|w| w.0).collect(),
        });
        let step_end = self.route.to_step_end();
        let mut first_to_load = true;
        for (i, &(b, distance)) in window.iter().enumerate() {
            if self.residency.state(b)? != BlockState::Unloaded || self.blocks[b.0 as usize].resident {
                continue;
            }
            // A trained block loaded across the step's end would be stale: the optimizer step
            // about to run changes its host copy.
            if distance > step_end
                && self.update_expected
                && !self.blocks[b.0 as usize].grads.is_empty()
                && !self.submitted.contains(&b)
            {
                continue;
            }
            let first = std::mem::replace(&mut first_to_load, false);
            if self.update_pending(b) {
                if first && !backward {
                    self.after_leave = Some(b);
                }
                continue;
            }
            let why = if i == 0 { Load::Next } else { Load::Ahead };
            if !self.load(b, why, Some(distance))? {
                break;
            }
        }
        Ok(())
    }

    /// Issues the H2D copy of an unloaded block into a slot. `false` when a prefetch was held
    /// back (the copy engine is busy, the Conductor refused a slot, no slot may be freed for it,
    /// no staging slab is free, or its host copy is being updated).
    pub(super) fn load(&mut self, id: BlockId, why: Load, distance: Option<usize>) -> Result<bool> {
        let demand = why == Load::Demand;
        if self.update_pending(id) {
            if !demand {
                return Ok(false);
            }
            self.wait_update(id)?;
        }
        if self.blocks[id.0 as usize].resident {
            return self.load_resident(id);
        }
        if !demand && self.loads.landing_count() >= self.knobs.max_inflight_h2d().max(1) as usize {
            return Ok(false);
        }
        // A prefetch that could not be given a slot of the room asks the Conductor for nothing.
        if !demand && !self.may_free_slot(id, distance, why)? {
            return Ok(false);
        }
        // Copies not reported yet hold their Conductor slots (and staging slabs, which a file-
        // backed load waits for): report them all before asking when that may free one.
        if self.loads.has_retired()
            && (self.conductor.slots_full(Direction::H2d) || matches!(self.blocks[id.0 as usize].source, Source::File(_)))
        {
            self.loads.reap(&self.loader);
        }
        // Refusals are published by the Conductor; a required request is never refused.
        let Ok(slot_token) = self.conductor.acquire_slot(Direction::H2d, Owner::Weights, why.priority()) else {
            return Ok(false);
        };
        // File-backed blocks stage through a pinned slab first (before anything changes, so a
        // prefetch that finds no slab leaves the block as it was).
        let src = match &self.blocks[id.0 as usize].source {
            Source::Host(h) => LoadSource::Host(h.buf.clone()),
            Source::Quantized(q) => LoadSource::Host(q.buf.clone()),
            Source::Released => return Err(Error::Shutdown("weight runtime")),
            Source::File(f) => {
                let pool = self.staging.as_ref().ok_or_else(|| Error::internal("a file-backed block without a staging pool"))?;
                let bytes = self.blocks[id.0 as usize].spec.bytes;
                let lease = if demand {
                    pool.acquire_wait(bytes, None)?
                } else {
                    pool.acquire_wait(bytes, Some(std::time::Duration::ZERO))?
                };
                let Some(mut lease) = lease else { return Ok(false) };
                f.stage(&self.blocks[id.0 as usize].spec, lease.as_mut_slice())?;
                LoadSource::Staged(lease)
            }
        };
        let Some(slot) = self.free_slot(id, why, distance)? else {
            return Ok(false);
        };
        self.residency.transition(id, BlockState::HostStaged, &self.bus)?;
        let bytes = self.blocks[id.0 as usize].spec.bytes;
        let room = self.room()?;
        let wait_for = room.assign(slot, id)?;
        let view = room.view(slot, bytes)?;
        let dst = landing(&view, &self.blocks[id.0 as usize].spec)?;
        let order = match &wait_for {
            Some(e) => Order::After(e),
            None => Order::Now,
        };
        let name = self.blocks[id.0 as usize].spec.name.clone();
        let t = self
            .loader
            .h2d(&dst, src, 0, order, Some(slot_token), || format!("block {name}"))
            .map_err(Error::from)?;
        self.residency.transition(id, BlockState::Prefetching, &self.bus)?;
        self.blocks[id.0 as usize].placement = Some(Placement::Slot(slot));
        self.loads.start(id, t);
        self.count_load(id);
        Ok(true)
    }

    /// Adds a load of `id` to the step's metrics (its model's share too).
    fn count_load(&mut self, id: BlockId) {
        let b = &self.blocks[id.0 as usize];
        let bytes = b.spec.transfer_bytes() as u64;
        self.metrics.h2d_bytes += bytes;
        if let Some(m) = self.model_steps.get_mut(b.model as usize) {
            m.h2d_bytes += bytes;
            m.loads += 1;
        }
    }

    /// At a step's end, once the optimizer has queued the host steps: loads the first streamed
    /// block of the next forward, after its host step. No block runs before it in the next step,
    /// so nothing could prefetch it there (the window that wraps over the step's end leaves a
    /// trained block alone until its step is queued): it was a miss in every step. The wait is
    /// the optimizer's, counted in this step; the copy overlaps the device finishing this step
    /// and the host's work between steps.
    pub(super) fn preload_next_step(&mut self) -> Result<()> {
        if self.knobs.prefetch_window() == 0 || self.slots.is_none() {
            return Ok(());
        }
        let Some(first) = self
            .route
            .itinerary()
            .and_then(|it| it.forward().iter().copied().find(|b| !self.blocks[b.0 as usize].resident))
        else {
            return Ok(());
        };
        if self.residency.state(first)? != BlockState::Unloaded {
            return Ok(());
        }
        // A frozen block is prefetched by the window wrapping over the step's end (inference
        // loops keep their schedule); a trained one only once this step queued its host step.
        let trained = !self.blocks[first.0 as usize].grads.is_empty();
        if !trained || (self.update_expected && !self.submitted.contains(&first)) {
            return Ok(());
        }
        if self.update_pending(first) {
            self.wait_update(first)?;
        }
        let distance = self.route.distance(first);
        self.load(first, Load::Next, Some(distance)).map(|_| ())
    }

    /// Waits for the loads in flight (made usable) and reports every finished copy, so that
    /// nothing of the weights is reported after the run's end.
    pub(crate) fn settle(&mut self) -> Result<()> {
        let landing: Vec<BlockId> =
            (0..self.blocks.len() as u32).map(BlockId).filter(|&b| self.loads.is_landing(b)).collect();
        for b in landing {
            self.finalize(b, false)?;
        }
        self.reap();
        Ok(())
    }

    /// The load [`prefetch`](Self::prefetch) left for the end of a forward use: waits for the
    /// block's host step, then loads it as the next block.
    pub(super) fn load_after_leave(&mut self) -> Result<()> {
        let Some(b) = self.after_leave.take() else { return Ok(()) };
        if self.residency.state(b)? != BlockState::Unloaded || self.blocks[b.0 as usize].resident {
            return Ok(());
        }
        self.wait_update(b)?;
        let distance = self.route.distance(b);
        self.load(b, Load::Next, Some(distance)).map(|_| ())
    }

    /// Waits for the host optimizer's pending step of `id` (in a data-parallel group, every
    /// rank's step of it); what the wait costs is the compute stream's idle time during it,
    /// counted as waiting for the optimizer.
    fn wait_update(&mut self, id: BlockId) -> Result<()> {
        let Some(s) = self.stepper.clone() else { return Ok(()) };
        let probe = self.device.idle_probe()?;
        s.wait(id)?;
        self.wait_group_update(id)?;
        self.update_waits.push(probe.end(&self.device)?);
        Ok(())
    }

    /// A block the plan keeps resident: loaded once into its own device buffer.
    fn load_resident(&mut self, id: BlockId) -> Result<bool> {
        let b = &self.blocks[id.0 as usize];
        let buf = self.device.alloc_slab(b.spec.bytes)?;
        let src = match &b.source {
            Source::Host(h) => LoadSource::Host(h.buf.clone()),
            Source::Quantized(q) => LoadSource::Host(q.buf.clone()),
            Source::Released => return Err(Error::Shutdown("weight runtime")),
            Source::File(_) => {
                return Err(Error::Config {
                    field: "resident",
                    value: format!("'{}'", b.spec.name),
                    expected: "a block with a host copy (file-backed blocks stream)".into(),
                })
            }
        };
        let name = b.spec.name.clone();
        let slot = self.conductor.acquire_slot(Direction::H2d, Owner::Weights, Priority::Required).ok();
        self.residency.transition(id, BlockState::HostStaged, &self.bus)?;
        let dst = landing(&buf, &self.blocks[id.0 as usize].spec)?;
        let t = self
            .loader
            .h2d(&dst, src, 0, Order::AfterCompute, slot, || format!("block {name} (resident)"))
            .map_err(Error::from)?;
        self.residency.transition(id, BlockState::Prefetching, &self.bus)?;
        self.count_load(id);
        self.blocks[id.0 as usize].placement = Some(Placement::Own(buf));
        self.loads.start(id, t);
        Ok(true)
    }

    /// Inference mode: pins all but two slots' worth of streamed blocks, spread along the cyclic
    /// itinerary ([`evictor::spread_pins`]), once the itinerary and the room are known; chosen
    /// again when either changes, lifting the previous plan's pins. Each pin is published as a
    /// protection.
    pub(super) fn plan_pins(&mut self) -> Result<()> {
        if !self.cfg.inference_mode || !self.cfg.cyclic_pins {
            return Ok(());
        }
        let (Some(order), Some(count)) = (self.streamed_order(), self.slots.as_ref().map(|s| s.count())) else { return Ok(()) };
        if self.pins.as_ref().is_some_and(|p| p.order == order && p.slots == count) {
            return Ok(());
        }
        if let Some(old) = self.pins.take() {
            for b in old.pinned {
                self.residency.set_protected(b, false, &self.bus)?;
            }
        }
        let mut pinned = Vec::new();
        for b in evictor::spread_pins(&order, count) {
            if !self.residency.get(b)?.protected {
                self.residency.set_protected(b, true, &self.bus)?;
                pinned.push(b);
            }
        }
        self.pins = Some(super::Pins { order, slots: count, pinned });
        Ok(())
    }

    /// A demand load found every slot pinned or in use (blocks held at once beyond what the
    /// plan left streaming): lifts one pin not in use, published, and has the plan chosen again
    /// at the step's end. `false` when no pin can go.
    fn lift_a_pin(&mut self, id: BlockId) -> Result<bool> {
        let Some(pins) = &self.pins else { return Ok(false) };
        let free = pins.pinned.iter().copied().find(|&b| {
            b != id && self.residency.get(b).is_ok_and(|e| e.state == BlockState::GpuReady && e.refcount == 0)
        });
        let Some(b) = free else { return Ok(false) };
        self.residency.set_protected(b, false, &self.bus)?;
        if let Some(p) = &mut self.pins {
            p.pinned.retain(|&x| x != b);
            // No room has 0 slots: the plan no longer matches and is made again at step end.
            p.slots = 0;
        }
        Ok(true)
    }

    /// Whether a prefetch of `id` (`why`) would find a slot of the room: one is free, or a
    /// loaded block is used later than `id` (so evicting it for `id` never moves more bytes).
    fn may_free_slot(&mut self, id: BlockId, distance: Option<usize>, why: Load) -> Result<bool> {
        if self.room()?.free().is_some() {
            return Ok(true);
        }
        Ok(self.victim(id, distance.or(Some(self.route.distance(id))), why == Load::Ahead).is_some())
    }

    /// The loaded block to evict to make room for `id` (`incoming`: its next use, `None` for a
    /// demand load, which may evict anything not in use).
    ///
    /// In a step of several passes (micro-batches), a load further ahead than the next block
    /// (`ahead`) waits, `None`, when the block in use now is needed later than the victim would
    /// be: once its use ends it is Belady's choice, and displacing the victim now would cost
    /// the victim another load later. At the next block the load is the next one and takes the
    /// slot freed then, still a block ahead of its use. Seen with a frozen model before a
    /// trained one: each teacher block just used is needed a pass later, the student's blocks
    /// within the pass, and prefetching the teacher's next block while one of its blocks ran
    /// evicted a student block that the same pass loaded again (two-models bench on the host
    /// device, two micro-batches: 1.125x the minimum, now 1.000x). A step of one pass never
    /// finds the block in use the better victim (forward, the blocks before it are needed
    /// later in backward; backward, the blocks after it later in the next step), and a
    /// forward-only cycle, where it always would, keeps its lead.
    fn victim(&self, id: BlockId, incoming: Option<usize>, ahead: bool) -> Option<evictor::Victim> {
        let candidates: Vec<BlockId> =
            self.loaded.iter().copied().filter(|&b| b != id && self.residency.can_evict(b)).collect();
        let v = evictor::choose(self.route.itinerary(), self.route.pos(), &candidates, incoming)?;
        if ahead && self.route.passes() > 1 && self.route.following() && self.current_goes_later_than(id, v.distance) {
            return None;
        }
        Some(v)
    }

    /// Whether the block in use now, a streamed one other than `id` that its use's end makes
    /// evictable, is next needed more than `distance` positions from here (along the itinerary,
    /// which the step follows).
    fn current_goes_later_than(&self, id: BlockId, distance: usize) -> bool {
        let (Some(cur), Some(it), Some(pos)) = (self.route.current(), self.route.itinerary(), self.route.pos()) else {
            return false;
        };
        if cur == id || self.blocks[cur.0 as usize].resident || !self.loaded.contains(&cur) {
            return false;
        }
        if self.residency.get(cur).map_or(true, |e| e.protected || e.state != BlockState::GpuReady) {
            return false;
        }
        let next = it.distance(pos + 1, cur).map_or(usize::MAX, |d| d + 1);
        next > distance
    }

    /// A free slot for `id`, evicting the block used farthest ahead if needed. A prefetch only
    /// displaces a block needed later than itself; a demand load lets landed prefetches finish
    /// and takes what it must.
    fn free_slot(&mut self, id: BlockId, why: Load, distance: Option<usize>) -> Result<Option<usize>> {
        let demand = why == Load::Demand;
        for _ in 0..MAX_EVICTIONS_PER_LOAD {
            if let Some(i) = self.room()?.free() {
                return Ok(Some(i));
            }
            let incoming = if demand { None } else { distance.or(Some(self.route.distance(id))) };
            match self.victim(id, incoming, why == Load::Ahead) {
                Some(v) => self.evict(v.block, EvictionReason::Budget, v.distance as f64)?,
                None if !demand => return Ok(None),
                None => {
                    // Every slot holds a block in use or still landing: loads that are landing
                    // can be made ready (and so evictable) without the compute stream.
                    let landing: Vec<BlockId> = (0..self.blocks.len() as u32)
                        .map(BlockId)
                        .filter(|&b| b != id && self.loads.is_landing(b) && !self.blocks[b.0 as usize].resident)
                        .collect();
                    if landing.is_empty() && self.lift_a_pin(id)? {
                        continue;
                    }
                    if landing.is_empty() {
                        let name = self.blocks[id.0 as usize].spec.name.clone();
                        let room = self.room()?;
                        let (needed, count) = (room.slot_bytes() as u64, room.count());
                        return Err(Error::TooLarge {
                            what: format!("block '{name}'"),
                            needed,
                            limit: format!(
                                "all {count} slots of the weights' device room hold blocks in use; raise the weights' room ({})",
                                self.cfg.room_source()
                            ),
                        });
                    }
                    for b in landing {
                        self.finalize(b, false)?;
                    }
                }
            }
        }
        Err(Error::internal(format!("no slot freed for block {id} after {MAX_EVICTIONS_PER_LOAD} evictions")))
    }

    /// Makes a landing block usable: the compute stream waits on its copy when `on_compute`
    /// (no host wait), the variables point at its device bytes.
    pub(super) fn finalize(&mut self, id: BlockId, on_compute: bool) -> Result<()> {
        // A quantized block is dequantized on the compute stream, which must first wait for
        // its payload to land.
        let quantized = self.blocks[id.0 as usize].spec.quant.is_some();
        self.loads.finish(&self.loader, id, on_compute || quantized)?;
        self.residency.transition(id, BlockState::GpuReady, &self.bus)?;
        self.blocks[id.0 as usize].last_use = None;
        let bytes = self.blocks[id.0 as usize].spec.bytes;
        let slot = match &self.blocks[id.0 as usize].placement {
            Some(Placement::Slot(i)) => Some(*i),
            Some(Placement::Own(_)) => None,
            None => return Err(Error::internal(format!("block {id} is landing without a place"))),
        };
        let view = match (slot, &self.blocks[id.0 as usize].placement) {
            (Some(i), _) => self.room()?.view(i, bytes)?,
            (None, Some(Placement::Own(t))) => t.shallow_clone(),
            _ => return Err(Error::internal(format!("block {id} is landing without a place"))),
        };
        if quantized {
            super::super::quant::dequantize_block(&view, &self.blocks[id.0 as usize].spec)?;
            if let tch::Device::Cuda(o) = view.device() {
                if let Some(why) = crate::device::dequant::unreported_refusal(o) {
                    self.bus.publish(EventKind::Warning {
                        source: Owner::Weights,
                        message: format!(
                            "Stagehand's INT8 dequantization kernel could not load on cuda:{o} ({why}): quantized blocks dequantize with libtorch's kernels, to the same values, more slowly"
                        ),
                    });
                }
            }
        }
        let b = &mut self.blocks[id.0 as usize];
        b.point_at(&view)?;
        let entry = IndexEntry {
            block: id,
            len: bytes,
            params: b.spec.params.iter().map(|p| (p.offset, p.bytes, p.kind)).collect(),
        };
        if !b.resident {
            self.loaded.push(id);
        }
        self.index
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(view.data_ptr() as u64, entry);
        Ok(())
    }

    /// Evicts one block: trainable blocks send their gradients home first (Evicting), frozen
    /// ones just go (GpuFreeing). Its slot is free once the kernels queued so far are done.
    pub(crate) fn evict(&mut self, id: BlockId, reason: EvictionReason, score: f64) -> Result<()> {
        if !self.residency.can_evict(id) {
            let e = self.residency.get(id)?;
            let pinned = self.pins.as_ref().is_some_and(|p| p.pinned.contains(&id));
            return Err(Error::misuse(
                format!(
                    "evicting block {id} (state '{}', refcount {}, protected {}{})",
                    e.state,
                    e.refcount,
                    e.protected,
                    if pinned { ", pinned by inference mode's cyclic pins: keep_resident(&[id], false) lifts it" } else { "" }
                ),
                "an unused, unprotected block on the device",
            ));
        }
        if !self.blocks[id.0 as usize].grads.is_empty() {
            self.residency.transition(id, BlockState::Evicting, &self.bus)?;
            // In a group the ranks reduce in the model's order, not in an eviction's (whose
            // timing differs from rank to rank): the gradients wait on the device for it.
            if self.rank.is_none() {
                self.flush_grads(id)?;
            }
        } else {
            self.residency.transition(id, BlockState::GpuFreeing, &self.bus)?;
        }
        // The slot is free once the kernels of the block's latest use are done: the event
        // recorded when they were queued, or now when none was (a block loaded but not used).
        let last_use = match self.blocks[id.0 as usize].last_use.take() {
            Some(e) => e,
            None => self.device.record_compute()?,
        };
        // A resident block trained on the device: its values go home before its memory does.
        self.write_back(id)?;
        let b = &mut self.blocks[id.0 as usize];
        b.point_away();
        let bytes = b.spec.bytes;
        let placement = b.placement.take();
        let address = match &placement {
            Some(Placement::Slot(i)) => {
                let room = self.slots.as_mut().ok_or_else(|| Error::internal("a slot without a room"))?;
                let a = room.view(*i, bytes)?.data_ptr() as u64;
                room.release(*i, last_use)?;
                a
            }
            Some(Placement::Own(t)) => {
                self.device.account(-(bytes as i64));
                t.data_ptr() as u64
            }
            None => 0,
        };
        self.index.lock().unwrap_or_else(|p| p.into_inner()).remove(&address);
        self.loaded.retain(|&b| b != id);
        self.residency.transition(id, BlockState::Unloaded, &self.bus)?;
        self.metrics.evictions += 1;
        if let Some(m) = self.model_steps.get_mut(self.blocks[id.0 as usize].model as usize) {
            m.evictions += 1;
        }
        self.bus.publish(EventKind::Eviction {
            block: id,
            reason,
            score,
            bytes: bytes as u64,
        });
        Ok(())
    }
}
