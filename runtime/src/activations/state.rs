//! The activation runtime's state and what happens to one saved tensor: pack (forward), unpack
//! and release (backward), and the step's beginning and end.
//!
//! Pack runs on the forward thread; unpack and release possibly on an autograd worker thread, so
//! all of it sits behind one lock in [`Shared`]. The spill queue and the restorer own their copies
//! in flight; the records own the tensors and host slabs.
//!
//! The file is long because pack, unpack, release and the step's end share that lock and its
//! invariants; spreading them over files would hide which of them hold it.

use super::config::{ActivationConfig, MIB};
use super::ctx::Ctx;
use super::policy::{region_matches, PackFacts, SpillPolicy, Verdict};
use super::recompute::{Membership, Recomputation, Scopes};
use super::record::{Record, RecordState, Records, TensorMeta};
use super::restorer::{Ahead, Restorer};
use super::sizing::{GroupProfile, SizeProfile};
use super::spills::SpillQueue;
use crate::conductor::{Conductor, Knobs};
use crate::device::{Device, IdleSpans};
use crate::error::{Error, Result};
use crate::events::{
    ActivationStepMetrics, BlockId, Bus, Direction, EventKind, KeepReason, Owner, PackDecision, PoolKind, Priority, TensorId,
};
use crate::pinned::{Lease, PoolStats, SlabPool};
use crate::saved::{WeightResolver, WeightSave};
use crate::torch::{Recompute, TensorIdentity};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tch::Tensor;

/// Mutable state, behind the runtime's one lock.
pub(super) struct State {
    records: Records,
    pool: SlabPool,
    spills: SpillQueue,
    restorer: Restorer,
    policy: SpillPolicy,
    /// Open regions, outermost first.
    regions: Vec<String>,
    /// Index of the open top-level group in this step's forward.
    group: Option<u32>,
    groups_opened: u32,
    /// Groups of this step's forward, being learned, and those learned from an earlier step.
    learning: Vec<GroupProfile>,
    profile: Vec<GroupProfile>,
    /// Backward has begun (an unpack happened) in this step.
    in_backward: bool,
    metrics: ActivationStepMetrics,
    last: Option<ActivationStepMetrics>,
    next_tensor: u64,
    /// Storage addresses of registered model parameters.
    parameters: HashSet<u64>,
    /// Grants the transfer slots (disabled: every copy proceeds at no cost).
    conductor: Conductor,
    /// Spilled sizes and how many of each were held at once, for sizing the pool.
    sizes: SizeProfile,
    /// The pool was sized from a traced step.
    pool_traced: bool,
    /// The arena's pinning time when the step began.
    pin_ms_before: f64,
    /// The step's pool misses a rebuild within it already sized the pool for (a rebuild between
    /// micro-batches).
    pool_misses_sized: u64,
    /// Bytes the spill watermarks were lowered by since the trace: the pool holds that much more.
    pool_extra: u64,
    /// The region the weight runtime said the forward was in at the last pack.
    auto_region: Option<Arc<str>>,
    /// This step's host waits for spills, read as the compute stream's idle time at its end.
    d2h_waits: IdleSpans,
    /// Reasons for refused spills already warned about in this step.
    refusals_warned: HashSet<KeepReason>,
    /// This step's recompute scopes.
    scopes: Scopes,
    /// Hook time spent in work that is not this runtime's: recomputing scopes (the model's
    /// forward run again, reported as `recompute_ms`) and the weight runtime's backward uses
    /// (in its own `host_ms`). Left out of the hooks' `host_ms`, so that the figures add up.
    foreign_ms: f64,
}

/// A tensor being packed to spill, with what is known of it.
struct Packing<'t> {
    t: &'t Tensor,
    identity: TensorIdentity,
    bytes: u64,
    id: TensorId,
    /// The region it is saved in.
    region: Option<String>,
}

impl State {
    /// The state before the first step: the pool, the copy queues and the policy given,
    /// nothing saved, no Conductor.
    pub(super) fn new(pool: SlabPool, spills: SpillQueue, restorer: Restorer, policy: SpillPolicy) -> State {
        State {
            records: Records::default(),
            pool,
            spills,
            restorer,
            policy,
            regions: Vec::new(),
            group: None,
            groups_opened: 0,
            learning: Vec::new(),
            profile: Vec::new(),
            in_backward: false,
            metrics: ActivationStepMetrics::default(),
            last: None,
            next_tensor: 0,
            parameters: HashSet::new(),
            conductor: Conductor::disabled(),
            sizes: SizeProfile::default(),
            pool_traced: false,
            pool_misses_sized: 0,
            pin_ms_before: 0.0,
            pool_extra: 0,
            auto_region: None,
            d2h_waits: Default::default(),
            refusals_warned: Default::default(),
            scopes: Default::default(),
            foreign_ms: 0.0,
        }
    }

    pub(super) fn records(&self) -> &Records {
        &self.records
    }

    /// A model parameter's storage: saves of it are kept.
    pub(super) fn register_parameter(&mut self, storage_ptr: u64) {
        self.parameters.insert(storage_ptr);
    }

    /// Puts the runtime under `conductor`; returns the one it was under.
    pub(super) fn replace_conductor(&mut self, conductor: Conductor) -> Conductor {
        std::mem::replace(&mut self.conductor, conductor)
    }

    /// A step begins (its records already retired): counters to zero, spilling off, the
    /// forward's groups learned anew.
    pub(super) fn reset_step(&mut self) {
        self.metrics = ActivationStepMetrics::default();
        self.pin_ms_before = self.pool.arena().stats().pin_ms;
        self.pool_misses_sized = 0;
        self.policy.reset_step();
        self.in_backward = false;
        self.group = None;
        self.groups_opened = 0;
        self.learning.clear();
        self.restorer.reset();
        self.sizes.clear_step();
        self.auto_region = None;
        self.refusals_warned.clear();
        self.foreign_ms = 0.0;
    }

    /// Opens region `name` (nested in those open); a top-level one of the forward opens a group.
    pub(super) fn open_region(&mut self, name: &str) {
        if self.regions.is_empty() && !self.in_backward {
            self.group = Some(self.groups_opened);
            self.groups_opened += 1;
            self.learning.push(GroupProfile {
                name: name.to_string(),
                bytes: 0,
                tensors: 0,
            });
        }
        self.regions.push(name.to_string());
    }

    /// Closes the innermost open region.
    pub(super) fn close_region(&mut self) {
        self.regions.pop();
        if self.regions.is_empty() {
            self.group = None;
        }
    }

    /// Counters of the step in progress.
    pub(super) fn metrics(&self) -> &ActivationStepMetrics {
        &self.metrics
    }

    /// Metrics of the last ended step.
    pub(super) fn last_metrics(&self) -> Option<&ActivationStepMetrics> {
        self.last.as_ref()
    }

    /// Spills checksummed as they landed, and restores checked against their checksum.
    pub(super) fn checksums(&self) -> (u64, u64) {
        (self.spills.checksummed.load(std::sync::atomic::Ordering::Relaxed), self.restorer.verified)
    }

    pub(super) fn policy(&self) -> &SpillPolicy {
        &self.policy
    }

    /// The region groups learned from the first step.
    pub(super) fn profile(&self) -> &[GroupProfile] {
        &self.profile
    }

    pub(super) fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Whether the pool was never sized from a trace, or this step's spills missed it since it
    /// was last sized (the step's end, or between its micro-batches, sizes it then).
    fn pool_unsized(&self) -> bool {
        !self.pool_traced || self.metrics.pool_misses > self.pool_misses_sized
    }

    pub(super) fn pool_bytes(&self) -> u64 {
        self.pool.arena().stats().pinned_bytes
    }

    /// The records and the spill queue, for a test that reaches between them.
    #[cfg(test)]
    pub(super) fn records_and_spills(&mut self) -> (&mut Records, &mut SpillQueue) {
        (&mut self.records, &mut self.spills)
    }
}

/// What became of a tensor the policy asked to spill.
enum Spill {
    /// Its copy started; the autograd handle.
    Started(u64),
    /// No host memory could take it; why it stays on the device.
    Refused(KeepReason),
}

/// Everything the store and the runtime share.
pub(super) struct Shared {
    pub device: Device,
    pub config: ActivationConfig,
    pub bus: Bus,
    /// The in-flight caps, restore lookahead and speculation switch, shared with the
    /// Conductor's adapter and read at every decision.
    pub knobs: Arc<Knobs>,
    pub resolver: Option<Arc<dyn WeightResolver>>,
    pub state: Mutex<State>,
}

/// Takes batched record `idx`'s tensor for its copy (the record is spilling from now on), with
/// its bytes.
fn take_batched(records: &mut Records, idx: usize) -> Result<(Tensor, u64)> {
    let rec = records.get_mut(idx).ok_or_else(|| Error::internal(format!("batched record {idx} is gone")))?;
    let t = rec.tensor.take().ok_or_else(|| Error::internal(format!("batched tensor {} is missing", rec.id)))?;
    rec.transition(RecordState::Spilling)?;
    Ok((t, rec.bytes))
}

pub(super) fn current_region(g: &State) -> Option<String> {
    if g.regions.is_empty() {
        g.auto_region.as_deref().map(str::to_owned)
    } else {
        Some(g.regions.join("."))
    }
}

impl Shared {
    /// The state; a panic elsewhere while holding the lock leaves it usable (every mutation is
    /// a single field update or a record move).
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The surroundings of a hook call made under `g`'s lock.
    pub(super) fn ctx(&self, g: &State) -> Ctx<'_> {
        Ctx {
            device: &self.device,
            bus: &self.bus,
            conductor: g.conductor.clone(),
            knobs: &self.knobs,
        }
    }

    pub(super) fn warn(&self, message: String) {
        self.bus.publish_with(|| EventKind::Warning {
            source: Owner::Activations,
            message,
        });
    }

    pub(super) fn vram_sample(&self) {
        self.bus.publish_with(|| {
            let m = self.device.memory();
            EventKind::VramSample {
                allocated_bytes: m.allocated,
                reserved_bytes: m.reserved,
                peak_allocated_bytes: m.peak,
            }
        });
    }

    fn spills_paused(&self) -> bool {
        self.knobs.max_inflight_d2h() == 0
    }

    /// Finalizes landed spills and keeps the in-flight count under the knob.
    fn poll_spills(&self, g: &mut State, ctx: &Ctx<'_>) -> Result<()> {
        let cap = ctx.knobs.max_inflight_d2h().max(1) as usize;
        let cap_bytes = self.config.max_inflight_spill_bytes.unwrap_or(u64::MAX);
        let State { records, spills, d2h_waits, .. } = g;
        let f = spills.poll(records, ctx, cap, cap_bytes)?;
        f.waits.into_iter().for_each(|w| d2h_waits.push(w));
        Ok(())
    }

    /// Adds host time spent in a hook call to the step's metrics.
    pub(super) fn add_host_ms(&self, ms: f64) {
        self.lock().metrics.host_ms += ms;
    }

    // ---- pack -----------------------------------------------------------------------------

    pub(super) fn pack(&self, tensor: Tensor) -> Result<u64> {
        // Ask the weight runtime first, outside our lock (it takes its own).
        if let Some(resolver) = &self.resolver {
            if let Some(save) = resolver.resolve(&tensor) {
                // Inside a recompute scope a streamed weight is one of the scope's tensors like
                // any other: the recomputation gets it, resident, from the scope's sources
                // (checked when the scope closes).
                let in_scope = self.lock().scopes.note_weight(&save);
                if in_scope {
                    resolver.release(&save);
                    return self.pack_tensor(tensor);
                }
                return Ok(self.pack_weight(save));
            }
        }
        self.pack_tensor(tensor)
    }

    fn pack_weight(&self, save: WeightSave) -> u64 {
        let mut g = self.lock();
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        let bytes = save.bytes;
        let mut rec = Record::new(id, RecordState::WeightHandle, bytes);
        rec.weight = Some(save);
        let (_, handle) = g.records.insert(rec);
        g.metrics.activations_saved += 1;
        g.metrics.weight_handles += 1;
        let region = current_region(&g);
        self.bus.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::WeightHandle,
            reason: None,
            bytes,
            class: None,
            pool_hit: None,
            region,
        });
        handle
    }

    fn pack_tensor(&self, t: Tensor) -> Result<u64> {
        if t.f_kind().is_err() {
            return Ok(self.keep_unnamed(t));
        }
        let identity = TensorIdentity::of(&t);
        let bytes = crate::torch::tensor_bytes(&t);
        let auto = self.resolver.as_ref().and_then(|r| r.current_region());
        let mut g = self.lock();
        let ctx = self.ctx(&g);
        self.follow_auto_region(&mut g, auto);
        self.poll_spills(&mut g, &ctx)?;
        if g.scopes.is_open() {
            if let Some(handle) = self.pack_recomputed(&mut g, &t, &identity, bytes) {
                return Ok(handle);
            }
        }
        if let Some(idx) = g.records.find_identity(&identity).filter(|&i| g.records.get(i).is_some_and(|r| !g.scopes.excludes(r))) {
            if let Some(handle) = self.duplicate(&mut g, idx, bytes) {
                return Ok(handle);
            }
        }
        if let Some(handle) = self.pack_recomputed(&mut g, &t, &identity, bytes) {
            return Ok(handle);
        }
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        // On the host device every tensor is "on the device" (there is no other one).
        let on_device = !self.device.is_cuda() || t.device() == self.device.tch_device();
        let parameter = g.parameters.contains(&identity.storage_ptr) || (t.is_leaf() && t.requires_grad());
        let region = current_region(&g);
        let region_allowed = self.config.regions.is_empty()
            || region
                .as_deref()
                .is_some_and(|path| self.config.regions.iter().any(|p| region_matches(p, path)));
        let tail = !g.in_backward && g.group.is_some_and(|gi| self.tail_from(&g).is_some_and(|from| gi as usize >= from));
        let spillable = on_device && !parameter && bytes >= self.config.min_spill_bytes && region_allowed;
        if spillable && !g.in_backward {
            if let Some(gi) = g.group {
                if let Some(p) = g.learning.get_mut(gi as usize) {
                    p.bytes += bytes;
                    p.tensors += 1;
                }
            }
        }
        let facts = PackFacts {
            bytes,
            on_device,
            parameter,
            region_allowed,
            tail,
            allocated: self.device.memory().allocated,
        };
        let (verdict, toggled) = g.policy.decide(&facts);
        if let Some(on) = toggled {
            self.bus.publish_with(|| EventKind::SpillingToggled {
                on,
                vram_allocated_bytes: facts.allocated,
            });
            self.vram_sample();
        }
        g.metrics.activations_saved += 1;
        let reason = match verdict {
            Verdict::Spill if self.spills_paused() => {
                g.policy.spill_refused(bytes);
                KeepReason::SpillsPaused
            }
            Verdict::Spill if self.batches(bytes) => {
                return self.gather(&mut g, &ctx, Packing { t: &t, identity, bytes, id, region });
            }
            Verdict::Spill => match self.spill(&mut g, &ctx, Packing { t: &t, identity: identity.clone(), bytes, id, region: region.clone() })? {
                Spill::Started(handle) => return Ok(handle),
                Spill::Refused(reason) => {
                    g.policy.spill_refused(bytes);
                    reason
                }
            },
            Verdict::Keep(reason) => reason,
        };
        let mut rec = Record::new(id, RecordState::Kept, bytes);
        // Detached: a kept output must not reference its own grad_fn (a cycle).
        rec.tensor = Some(t.detach());
        rec.identity = Some(identity);
        if on_device && !parameter {
            rec.set_device_bytes(bytes, &self.device);
        }
        let (_, handle) = g.records.insert(rec);
        self.count_kept(&mut g, id, bytes, reason, region);
        Ok(handle)
    }

    /// A saved tensor of a kind tch cannot name (flash attention on CUDA saves its RNG seed and
    /// offset as UInt64 scalars): kept where it is, as it is, neither deduplicated nor spilled.
    /// Its bytes are its storage's, or 8 an element (the widest such kind) for a view of less.
    fn keep_unnamed(&self, t: Tensor) -> u64 {
        let storage = crate::torch::hooks::storage_nbytes(&t);
        let mut g = self.lock();
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        let bytes = storage.min((t.numel() as u64).saturating_mul(8));
        let mut rec = Record::new(id, RecordState::Kept, bytes);
        rec.tensor = Some(t.detach());
        let (_, handle) = g.records.insert(rec);
        g.metrics.activations_saved += 1;
        let region = current_region(&g);
        self.count_kept(&mut g, id, bytes, KeepReason::UnnamedKind, region);
        handle
    }

    /// Counts a kept tensor in the step's metrics and publishes its pack decision.
    fn count_kept(&self, g: &mut State, id: TensorId, bytes: u64, reason: KeepReason, region: Option<String>) {
        g.metrics.activations_kept += 1;
        self.bus.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Kept,
            reason: Some(reason),
            bytes,
            class: None,
            pool_hit: None,
            region,
        });
    }

    /// Another save of record `idx`'s tensor: one more reference and handle to it (`None` when
    /// the record is gone).
    fn duplicate(&self, g: &mut State, idx: usize, bytes: u64) -> Option<u64> {
        let rec = g.records.get_mut(idx)?;
        rec.refs += 1;
        let id = rec.id;
        let handle = g.records.new_handle(idx);
        let region = current_region(g);
        self.bus.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Duplicate,
            reason: None,
            bytes,
            class: None,
            pool_hit: None,
            region,
        });
        Some(handle)
    }

    /// Whether a spill of `bytes` waits for its region's batch instead of being copied alone.
    fn batches(&self, bytes: u64) -> bool {
        bytes < self.config.batch_spills_below_bytes
    }

    /// The record of a tensor about to spill (or batched, holding it), and the region it was
    /// saved in.
    fn spill_record(&self, p: Packing<'_>, state: RecordState) -> (Record, Option<String>) {
        let Packing { t, identity, bytes, id, region } = p;
        let contiguous = t.is_contiguous();
        let mut rec = Record::new(id, state, bytes);
        rec.meta = Some(TensorMeta {
            kind: t.kind(),
            sizes: t.size(),
            strides: t.stride(),
            contiguous,
        });
        if self.config.debug_checksums {
            rec.region.clone_from(&region);
        }
        // A contiguous copy made to spill is not the saved storage: dedupe only against that
        // one, and only while it lives (the spill drops the record's reference to it).
        if contiguous {
            rec.identity = Some(identity);
            rec.watch = crate::torch::StorageWatch::of(t);
        }
        rec.set_device_bytes(bytes, &self.device);
        (rec, region)
    }

    /// Starts the D2H copy of `t` into a pool slab and records it as spilling; refused when no
    /// host memory could take it (the pageable fallback is off), with why.
    fn spill(&self, g: &mut State, ctx: &Ctx<'_>, p: Packing<'_>) -> Result<Spill> {
        let acquired = match g.pool.acquire(p.bytes as usize) {
            Ok(l) => l,
            Err(Error::TooLarge { .. }) => return Ok(Spill::Refused(self.refuse(g, p.id, p.bytes))),
            Err(e) => return Err(e),
        };
        let t = p.t;
        let (rec, region) = self.spill_record(p, RecordState::Spilling);
        let (idx, handle) = g.records.insert(rec);
        self.start_spill(g, ctx, idx, t, acquired, region)?;
        Ok(Spill::Started(handle))
    }

    /// Starts the copy of record `idx`'s tensor `t` into `lease` and counts the spill.
    fn start_spill(&self, g: &mut State, ctx: &Ctx<'_>, idx: usize, t: &Tensor, (lease, hit): (Lease, bool), region: Option<String>) -> Result<()> {
        // Required: a spill the policy asked for relieves memory now, so it is never refused.
        let slot = ctx.conductor.acquire_slot(Direction::D2h, Owner::Activations, Priority::Required).ok();
        let src = t.detach();
        let src = if src.is_contiguous() { src } else { src.f_contiguous()? };
        let took = Took::of(&lease, hit);
        let (id, bytes) = g.records.get(idx).map(|r| (r.id, r.bytes)).ok_or_else(|| Error::internal(format!("record {idx} is gone")))?;
        let sized = lease.requested_bytes() as u64;
        g.spills.start(&g.records, idx, lease, &src, slot)?;
        g.sizes.spilled(sized);
        self.count_spill(g, id, bytes, took, region);
        Ok(())
    }

    /// Counts a started spill in the step's metrics and publishes its pack decision.
    fn count_spill(&self, g: &mut State, id: TensorId, bytes: u64, took: Took, region: Option<String>) {
        let Took { class, hit, pinned } = took;
        let m = &mut g.metrics;
        m.activations_spilled += 1;
        m.spill_bytes += bytes;
        if hit {
            m.pool_hits += 1;
        } else {
            m.pool_misses += 1;
            if !pinned {
                m.pageable_bytes += bytes;
            }
        }
        self.bus.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Spilled,
            reason: None,
            bytes,
            class,
            pool_hit: Some(hit),
            region,
        });
    }

    /// Adds `t` to the open batch of its top-level region (a block, with the regions nested in
    /// it), copying the batch first when `t` belongs to another one or would overfill it; the
    /// record holds `t` until the batch's copy starts.
    fn gather(&self, g: &mut State, ctx: &Ctx<'_>, p: Packing<'_>) -> Result<u64> {
        let outer = g.regions.first().cloned().or_else(|| g.auto_region.as_deref().map(str::to_owned));
        let (t, bytes) = (p.t, p.bytes);
        if !g.spills.admits(outer.as_deref(), bytes, self.config.spill_batch_bytes) {
            self.flush_batch(g, ctx)?;
        }
        let (mut rec, region) = self.spill_record(p, RecordState::Batched);
        rec.tensor = Some(t.detach());
        // Its own region, for its pack decision when the batch is copied.
        rec.region = region;
        let (idx, handle) = g.records.insert(rec);
        g.spills.gather(idx, bytes, outer);
        Ok(handle)
    }

    /// Copies the open batch: one kernel gathers its tensors into one device buffer, one copy
    /// moves that into one slab. A batch of one is copied as a single spill; a batch no slab can
    /// take is spilled tensor by tensor (each kept when the pool refuses it too).
    pub(super) fn flush_batch(&self, g: &mut State, ctx: &Ctx<'_>) -> Result<()> {
        let Some(batch) = g.spills.close_batch() else { return Ok(()) };
        let acquired = if batch.members.len() > 1 {
            match g.pool.acquire(batch.bytes as usize) {
                Ok(l) => Some(l),
                Err(Error::TooLarge { .. }) => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        let Some((lease, hit)) = acquired else {
            for &idx in &batch.members {
                self.spill_member(g, ctx, idx)?;
            }
            return Ok(());
        };
        let mut parts = Vec::with_capacity(batch.members.len());
        let mut members = Vec::with_capacity(batch.members.len());
        let mut offset = 0usize;
        for &idx in &batch.members {
            let (t, bytes) = take_batched(&mut g.records, idx)?;
            parts.push(t.f_reshape([-1])?.f_view_dtype(tch::Kind::Uint8)?);
            members.push((idx, offset));
            offset += bytes as usize;
        }
        let gathered = Tensor::f_cat(&parts, 0)?;
        // The batched tensors' memory goes back to the allocator now: the gather, queued on the
        // compute stream, is ordered before any later use of it.
        drop(parts);
        let slot = ctx.conductor.acquire_slot(Direction::D2h, Owner::Activations, Priority::Required).ok();
        let took = Took::of(&lease, hit);
        let sized = lease.requested_bytes() as u64;
        g.spills.start_batch(members, lease, &gathered, slot, batch.region.as_deref())?;
        g.sizes.spilled(sized);
        for &idx in &batch.members {
            if let Some((id, bytes, region)) = g.records.get(idx).map(|r| (r.id, r.bytes, r.region.clone())) {
                self.count_spill(g, id, bytes, took, region);
            }
        }
        Ok(())
    }

    /// Spills batched record `idx` on its own, or keeps it when no host memory takes it.
    fn spill_member(&self, g: &mut State, ctx: &Ctx<'_>, idx: usize) -> Result<()> {
        let (id, bytes, region) = g
            .records
            .get(idx)
            .map(|r| (r.id, r.bytes, r.region.clone()))
            .ok_or_else(|| Error::internal(format!("batched record {idx} is gone")))?;
        match g.pool.acquire(bytes as usize) {
            Ok(acquired) => {
                let (t, _) = take_batched(&mut g.records, idx)?;
                self.start_spill(g, ctx, idx, &t, acquired, region)
            }
            Err(Error::TooLarge { .. }) => {
                let reason = self.refuse(g, id, bytes);
                g.policy.spill_refused(bytes);
                if let Some(rec) = g.records.get_mut(idx) {
                    rec.transition(RecordState::Kept)?;
                }
                self.count_kept(g, id, bytes, reason, region);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Why the pool (its fallback off) refused `bytes`, warned once per cause and step: a
    /// tensor larger than every slab needs a larger class, an exhausted pool more slabs.
    fn refuse(&self, g: &mut State, id: TensorId, bytes: u64) -> KeepReason {
        let largest = g.pool.largest_slab() as u64;
        let reason = if bytes > largest { KeepReason::TooLarge } else { KeepReason::PoolExhausted };
        if g.refusals_warned.insert(reason) {
            self.warn(match reason {
                KeepReason::TooLarge => format!(
                    "saved tensor {id} ({bytes} bytes) stays on the device: it is larger than the largest pinned slab ({largest} bytes) and the pageable fallback is off; add a larger size class or turn the fallback on (this step's later ones are counted as `too_large`, not warned)"
                ),
                _ => format!(
                    "saved tensor {id} ({bytes} bytes) stays on the device: no pinned slab is free and the pageable fallback is off; give the pool more slabs or turn the fallback on (this step's later ones are counted as `pool_exhausted`, not warned)"
                ),
            });
        }
        reason
    }

    /// The first group of the learned tail: the last `keep_tail_groups` groups of the profile, as
    /// many of them as fit together in `tail_max_bytes`.
    fn tail_from(&self, g: &State) -> Option<usize> {
        let n = g.profile.len();
        let mut kept = 0usize;
        let mut bytes = 0u64;
        for p in g.profile.iter().rev().take(self.config.keep_tail_groups as usize) {
            bytes = bytes.saturating_add(p.bytes);
            if self.config.tail_max_bytes.is_some_and(|max| bytes > max) {
                break;
            }
            kept += 1;
        }
        (kept > 0).then(|| n - kept)
    }

    /// Without explicit regions, the block the weight runtime runs is the region, and each new
    /// block of the forward opens a group (for the learned-tail rule).
    fn follow_auto_region(&self, g: &mut State, auto: Option<Arc<str>>) {
        if !g.regions.is_empty() || g.in_backward || auto.is_none() || auto == g.auto_region {
            if g.regions.is_empty() && !g.in_backward && auto.is_some() {
                g.auto_region = auto;
            }
            return;
        }
        if let Some(name) = &auto {
            g.group = Some(g.groups_opened);
            g.groups_opened += 1;
            g.learning.push(GroupProfile {
                name: name.to_string(),
                bytes: 0,
                tensors: 0,
            });
        }
        g.auto_region = auto;
    }

    // ---- unpack and release ---------------------------------------------------------------

    pub(super) fn unpack(&self, handle: u64) -> Result<Tensor> {
        let mut g = self.lock();
        let idx = g.records.index_of(handle).ok_or_else(|| {
            Error::misuse(
                format!("unpacking saved tensor handle {handle}"),
                "a handle of the current step (this one was released, or its step already ended)",
            )
        })?;
        let ctx = self.ctx(&g);
        if !g.in_backward {
            // Backward has begun. Spills still landing are not waited for here (that would stop
            // the host until the GPU has finished the whole forward): they are finalized as they
            // land, and a tensor backward needs first is waited for on its own.
            g.in_backward = true;
        }
        // Backward needs the batched tensors soon: their copy starts now.
        self.flush_batch(&mut g, &ctx)?;
        self.poll_spills(&mut g, &ctx)?;
        let state = g
            .records
            .get(idx)
            .map(|r| r.state)
            .ok_or_else(|| Error::internal(format!("saved tensor handle {handle} has no record")))?;
        if state == RecordState::Recompute {
            drop(g);
            return self.unpack_recomputed(idx);
        }
        let out = match state {
            RecordState::WeightHandle | RecordState::Recompute | RecordState::Batched => None,
            RecordState::Kept => g.records.get(idx).and_then(|r| r.tensor.as_ref()).map(|t| t.shallow_clone()),
            RecordState::Spilling | RecordState::Spilled | RecordState::Restoring | RecordState::Restored => {
                if state == RecordState::Spilling {
                    let State { records, spills, d2h_waits, .. } = &mut *g;
                    d2h_waits.push(spills.finalize(records, idx, &ctx)?);
                }
                if matches!(state, RecordState::Spilling | RecordState::Spilled) {
                    let slot = ctx.conductor.acquire_slot(Direction::H2d, Owner::Activations, Priority::Required).ok();
                    let State { records, restorer, .. } = &mut *g;
                    restorer.issue(records, idx, false, slot, &ctx)?;
                }
                let State { records, restorer, .. } = &mut *g;
                let t = restorer.serve(records, idx, &ctx)?;
                self.reap_restores(&mut g, &ctx, false)?;
                Some(t)
            }
        };
        self.predict_from(&mut g, &ctx, idx)?;
        match out {
            Some(t) => Ok(t),
            None if state == RecordState::WeightHandle => {
                let save = g
                    .records
                    .get(idx)
                    .and_then(|r| r.weight.clone())
                    .ok_or_else(|| Error::internal(format!("weight handle {handle} has no save")))?;
                drop(g);
                let resolver = self
                    .resolver
                    .as_ref()
                    .ok_or_else(|| Error::internal("a weight handle without a weight resolver"))?;
                let t0 = Instant::now();
                let t = resolver.materialize(&save).map_err(Error::Saved);
                self.lock().foreign_ms += t0.elapsed().as_secs_f64() * 1e3;
                t
            }
            None => Err(Error::internal(format!("kept tensor of handle {handle} is missing"))),
        }
    }

    fn reap_restores(&self, g: &mut State, ctx: &Ctx<'_>, all: bool) -> Result<()> {
        let State { records, restorer, metrics, sizes, .. } = g;
        let r = restorer.reap(records, sizes, ctx, all)?;
        metrics.activations_restored += r.count;
        metrics.restore_bytes += r.bytes;
        metrics.stall_time_ms += r.stall_ms;
        metrics.stall_count += r.stalls;
        Ok(())
    }

    fn predict_from(&self, g: &mut State, ctx: &Ctx<'_>, idx: usize) -> Result<()> {
        let mut lookahead = ctx.knobs.prefetch_window() as usize;
        if ctx.knobs.suppress_speculative() {
            lookahead = lookahead.min(1);
        }
        if lookahead == 0 {
            return Ok(());
        }
        self.reap_restores(g, ctx, false)?;
        let ahead = Ahead {
            lookahead,
            cap: ctx.knobs.max_inflight_h2d().max(1) as usize,
            allowance: self.config.restore_allowance_bytes,
        };
        let State {
            records,
            restorer,
            spills,
            metrics,
            ..
        } = g;
        // A prediction never waits for a spill still landing: it stops there, and the next
        // unpack predicts again.
        let issued = restorer.predict_from(records, idx, ahead, ctx, |records, j| spills.finalize_if_landed(records, j, ctx))?;
        metrics.activations_predicted += issued;
        Ok(())
    }

    pub(super) fn release(&self, handle: u64) {
        let (save, sources) = {
            let mut g = self.lock();
            // An unknown handle belongs to a step that already ended: nothing left to free.
            let Some(idx) = g.records.remove_handle(handle) else { return };
            let last = match g.records.get_mut(idx) {
                Some(rec) => {
                    rec.refs = rec.refs.saturating_sub(1);
                    rec.refs == 0
                }
                None => false,
            };
            if !last {
                return;
            }
            let ctx = self.ctx(&g);
            let save = self.retire(&mut g, &ctx, idx);
            (save, g.scopes.take_releases())
        };
        if let (Some(save), Some(r)) = (save, &self.resolver) {
            r.release(&save);
        }
        // The sources of a recompute scope whose last tensor went.
        for h in sources {
            self.release(h);
        }
    }

    /// Frees what a record holds (copies waited for, slabs back to the pool); returns its weight
    /// save for the resolver, to be released outside the lock.
    pub(super) fn retire(&self, g: &mut State, ctx: &Ctx<'_>, idx: usize) -> Option<WeightSave> {
        let state = g.records.get(idx).map(|r| r.state);
        if state == Some(RecordState::Spilling) {
            let State { records, spills, d2h_waits, .. } = &mut *g;
            match spills.finalize(records, idx, ctx) {
                Ok(w) => d2h_waits.push(w),
                Err(e) => self.warn(format!("finalizing a spill at release: {e}")),
            }
        }
        if state == Some(RecordState::Restoring) || g.records.get(idx).is_some_and(|r| r.restore.is_some()) {
            if let Err(e) = self.reap_restores(g, ctx, true) {
                self.warn(format!("completing a restore at release: {e}"));
            }
        }
        if state == Some(RecordState::Batched) {
            // Released before its batch was copied: it stayed on the device, so it counts as
            // kept, and its bytes go back to the policy's share.
            if let Some((id, bytes, region)) = g.records.get(idx).map(|r| (r.id, r.bytes, r.region.clone())) {
                g.spills.leave_batch(idx, bytes);
                g.policy.spill_refused(bytes);
                self.count_kept(g, id, bytes, KeepReason::ReleasedBeforeCopy, region);
            }
        }
        let mut rec = g.records.take(idx)?;
        if let Some(member) = &rec.recompute {
            g.scopes.member_gone(member);
        }
        if let Some(part) = rec.host.as_ref().filter(|p| p.is_last()) {
            g.sizes.released(part.requested_bytes() as u64);
        }
        rec.set_device_bytes(0, ctx.device);
        g.restorer.forget(rec.predicted, rec.bytes);
        rec.weight.take()
    }

    // ---- recompute scopes (what a save or an unpack is, `Scopes`; the packing, here) ---------

    pub(super) fn open_recompute(&self) -> Result<bool> {
        Ok(self.lock().scopes.open(self.config.recompute_fraction))
    }

    pub(super) fn close_recompute(&self, closing: Option<Recompute<'_>>) -> Result<()> {
        let (frame, weights) = self.lock().scopes.close()?;
        let Some(c) = closing else { return Ok(()) };
        // A streamed weight need not be resident when backward recomputes: the function must
        // get it from its sources (saved as weight handles, made resident by the unpack).
        if let Some(resolver) = &self.resolver {
            let given: Vec<(BlockId, u32)> = c
                .sources
                .iter()
                .filter_map(|s| resolver.resolve(s).map(|w| (w.block, w.param)))
                .collect();
            if let Some((block, param)) = weights.iter().find(|w| !given.contains(w)) {
                return Err(Error::misuse(
                    format!("saving streamed weight {param} of block {block} inside a recompute scope"),
                    "the weights a recompute function uses among its sources (`recompute(&[&x, &w], |s| ..)`), so that backward's recomputation gets them resident; or the layer applied outside `recompute`",
                ));
            }
        }
        // The sources are saved the usual way, after the scope: backward reaches them before
        // the scope's tensors, so the restorer brings them back ahead of the recomputation.
        self.lock().scopes.set_closing(Some(frame));
        let mut sources = Vec::with_capacity(c.sources.len());
        let mut packed = Ok(());
        for s in c.sources {
            match self.pack(s.detach()) {
                Ok(handle) => sources.push((handle, s.requires_grad())),
                Err(e) => {
                    packed = Err(e);
                    break;
                }
            }
        }
        self.lock().scopes.set_closing(None);
        packed?;
        self.lock().scopes.finish(frame, &c, sources)
    }

    /// A tensor saved inside the open scope, or a view of a closed scope's output: its record,
    /// holding nothing. `None` for every other tensor.
    fn pack_recomputed(&self, g: &mut State, t: &Tensor, identity: &TensorIdentity, bytes: u64) -> Option<u64> {
        let member = match g.scopes.member_for(&g.records, t, identity) {
            Membership::Duplicate(idx) => return self.duplicate(g, idx, bytes),
            Membership::Member(m) => m,
            Membership::Outside => return None,
        };
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        let mut rec = Record::new(id, RecordState::Recompute, bytes);
        rec.identity = Some(identity.clone());
        rec.watch = crate::torch::StorageWatch::of(t);
        rec.recompute = Some(member);
        let (_, handle) = g.records.insert(rec);
        let m = &mut g.metrics;
        m.activations_saved += 1;
        m.activations_recomputed += 1;
        m.recompute_bytes += bytes;
        self.bus.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Recomputed,
            reason: None,
            bytes,
            class: None,
            pool_hit: None,
            region: current_region(g),
        });
        Some(handle)
    }

    /// Serves a recomputed record, recomputing its scope on the scope's first unpack.
    fn unpack_recomputed(&self, idx: usize) -> Result<Tensor> {
        let (member, f, sources, stop_after) = {
            let mut g = self.lock();
            let rec = g
                .records
                .get_mut(idx)
                .ok_or_else(|| Error::internal(format!("recomputed record {idx} is gone")))?;
            rec.unpacked = true;
            let member = rec.recompute.clone().ok_or_else(|| Error::internal("a recomputed record without its scope"))?;
            match g.scopes.lookup(&member, self.config.recompute_early_stop)? {
                Recomputation::Served(t) => return Ok(t),
                Recomputation::Needed { f, sources, stop_after } => (member, f, sources, stop_after),
            }
        };
        let mut args = Vec::with_capacity(sources.len());
        for (handle, requires_grad) in sources {
            args.push(self.unpack(handle)?.detach().set_requires_grad(requires_grad));
        }
        let t0 = Instant::now();
        let captured = crate::torch::capture::capture_saved(|| f.call(&args), stop_after).map_err(Error::Saved)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut g = self.lock();
        g.metrics.recompute_ms += ms;
        g.metrics.scopes_recomputed += 1;
        g.metrics.scopes_stopped_early += u64::from(captured.output.is_none());
        g.foreign_ms += ms;
        g.scopes.store(&member, captured.output, captured.saved)
    }

    // ---- step boundaries ------------------------------------------------------------------

    /// Releases every record (a step that never ended, or the end of a step); returns the weight
    /// saves to release outside the lock.
    pub(super) fn retire_all(&self, g: &mut State) -> Vec<WeightSave> {
        let ctx = self.ctx(g);
        let left: Vec<usize> = (0..g.records.len()).collect();
        let saves = left.into_iter().filter_map(|i| self.retire(g, &ctx, i)).collect();
        g.records.drain();
        if g.scopes.clear() {
            self.warn("a recompute scope was still open at the step's end; its tensors were dropped".into());
        }
        saves
    }

    /// Ends the step's copies and learning; returns the step's metrics, the weight saves to
    /// release, and the first error met.
    pub(super) fn end_step(&self, g: &mut State) -> (ActivationStepMetrics, Vec<WeightSave>, Result<()>) {
        // Hook time less the hooks' own waits for copies and the work done in them for others
        // (recomputation, the weights' backward uses): what the hooks cost the thread.
        g.metrics.host_ms = (g.metrics.host_ms - g.d2h_waits.host_ms() - g.foreign_ms).max(0.0);
        let ctx = self.ctx(g);
        let mut result = {
            let State { records, spills, d2h_waits, .. } = &mut *g;
            spills.drain(records, &ctx).map(|f| f.waits.into_iter().for_each(|w| d2h_waits.push(w)))
        };
        if result.is_ok() {
            result = self.reap_restores(g, &ctx, true);
        }
        let saves = self.retire_all(g);
        g.metrics.h2d_wait_ms += g.restorer.take_wait_ms();
        match g.d2h_waits.take_ms() {
            Ok(ms) => g.metrics.d2h_wait_ms += ms,
            Err(e) if result.is_ok() => result = Err(e),
            Err(_) => {}
        }
        g.metrics.vram_peak_mib = self.device.memory().peak as f64 / MIB as f64;
        if !g.learning.is_empty() {
            if !g.profile.is_empty() && g.profile.len() != g.learning.len() {
                self.warn(format!(
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
        if result.is_ok() {
            result = self.resize_pool_from_trace(g);
        }
        // The arena is the same across the pools it serves: its pinning time since the step began.
        g.metrics.pin_ms = (g.pool.arena().stats().pin_ms - g.pin_ms_before).max(0.0);
        let m = g.metrics.clone();
        g.last = Some(m.clone());
        (m, saves, result)
    }

    /// After a step that spilled (the first, or one that had to use pageable memory), makes the
    /// pool hold exactly what that step held at once, so later steps never fall back.
    fn resize_pool_from_trace(&self, g: &mut State) -> Result<()> {
        if !self.config.size_pool_from_trace || g.sizes.is_empty() {
            g.sizes.clear_step();
            return Ok(());
        }
        if g.pool_unsized() {
            self.rebuild_pool(g)?;
        }
        g.sizes.clear_step();
        Ok(())
    }

    /// Between two micro-batches of a step, with no saved tensor left: when this step's spills
    /// found no slab (the first step's provisional pool), the pool is rebuilt from what they held
    /// at once so far, so the step's later micro-batches spill into pinned slabs instead of
    /// copying through pageable memory, each as slowly as the first.
    pub(super) fn between_micro_batches(&self, g: &mut State) -> Result<()> {
        if !self.config.size_pool_from_trace || g.sizes.is_empty() || g.records.live() > 0 {
            return Ok(());
        }
        if g.pool_unsized() {
            // Tried once for these misses, rebuilt or (over the pinned limit) not.
            g.pool_misses_sized = g.metrics.pool_misses;
            self.rebuild_pool(g)?;
        }
        Ok(())
    }

    /// Moves both spill watermarks (see `ActivationRuntime::move_watermarks`); a traced pool
    /// grows for watermarks that moved down. `None` when they did not move.
    pub(super) fn move_watermarks(&self, high: u64, floor: u64) -> Option<(u64, u64)> {
        let mut g = self.lock();
        let (before, _) = g.policy.watermarks();
        let moved = g.policy.move_to(high, floor)?;
        if moved.0 < before {
            // Up to that many more bytes spill in later steps: a traced pool grows to hold
            // them now, so they find slabs instead of pageable memory.
            g.pool_extra = g.pool_extra.saturating_add(before - moved.0);
            if g.pool_traced && g.records.live() == 0 {
                if let Err(e) = self.rebuild_pool(&mut g) {
                    drop(g);
                    self.warn(format!("growing the activation pool for the lower watermarks: {e}"));
                }
            }
        } else {
            g.pool_extra = g.pool_extra.saturating_sub(moved.0 - before);
        }
        Some(moved)
    }

    /// Rebuilds the pool from the traced sizes and the bytes the watermarks moved since, within
    /// the pinned limit (over it, the pool stays as it is, with a warning). Between steps only:
    /// no lease may be live.
    pub(super) fn rebuild_pool(&self, g: &mut State) -> Result<()> {
        let current = g.pool.stats();
        let (classes, mut slabs) = g.sizes.plan_with(self.config.max_pool_classes as usize, g.pool_extra);
        for n in &mut slabs {
            *n = (*n).max(self.config.min_slabs_per_class);
        }
        let total: u64 = classes.iter().zip(&slabs).map(|(c, n)| c * *n as u64).sum();
        if let Some(limit) = self.config.pinned_limit_bytes.filter(|&l| total > l) {
            self.warn(format!(
                "the traced step held {total} bytes of spills at once, more than the pinned limit {limit}; keeping the pool ({} slabs)",
                current.total.iter().sum::<u32>()
            ));
            return Ok(());
        }
        // The old pool's slabs go back to the arena first, so the new one is cut from them.
        let arena = g.pool.arena().clone();
        let vacant = g.pool.vacant();
        drop(std::mem::replace(&mut g.pool, vacant));
        g.pool = SlabPool::in_arena(
            &arena,
            PoolKind::Activations,
            &classes,
            &slabs,
            self.config.pageable_fallback,
            self.bus.clone(),
        )?;
        g.pool.limit_pinned(self.config.pinned_limit_bytes);
        g.pool_traced = true;
        Ok(())
    }
}

/// Where a spill's host memory came from, for its counters and its pack decision.
#[derive(Debug, Clone, Copy)]
struct Took {
    /// The pool's size class (`None` outside the pool).
    class: Option<u32>,
    /// A slab of the pool.
    hit: bool,
    /// Page-locked (on CUDA: a slab, or a buffer pinned for it when no slab was free, whose copy
    /// stays asynchronous; a miss that is not went through pageable memory).
    pinned: bool,
}

impl Took {
    fn of(lease: &Lease, hit: bool) -> Took {
        Took { class: lease.class(), hit, pinned: lease.is_pinned() }
    }
}
