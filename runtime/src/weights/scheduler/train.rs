//! Trainable streamed blocks: gradients go to the host as backward leaves each block, the host
//! optimizer's steps gate loads of the blocks they change, and resident blocks stay on the device
//! to be trained there.

use super::super::block::{ParamGrad, Source};
use super::{Scheduler, StepState};
use crate::error::{Error, Result};
use crate::events::{BlockId, BlockState, Direction, Owner, Priority};
use crate::weights::stepper::{Job, JobMaker, Ready, Stepper};
use std::sync::Arc;
use tch::Tensor;

/// What the host optimizer gets for one trainable parameter of a streamed block.
#[derive(Debug)]
pub(crate) struct HostParam {
    /// Its index in the block.
    pub index: usize,
    /// The value the optimizer updates: the float32 master, or the host copy itself.
    pub value: Tensor,
    /// Its host gradient buffer (in the dtype it streams in).
    pub grad: Tensor,
    /// The 16-bit host copy the next load streams, which the optimizer writes after updating
    /// the master (`None`: `value` is that copy).
    pub copy: Option<Tensor>,
    /// In a data-parallel group, the piece of the parameter this rank steps (offset in the
    /// parameter, elements): `value`, `grad` and `copy` are 1-D slices of it.
    pub piece: Option<(i64, i64)>,
}

impl Scheduler {
    /// Sends `id`'s device gradients to the host (a no-op for frozen or resident blocks, or when
    /// it has none).
    pub(crate) fn flush_grads(&mut self, id: BlockId) -> Result<()> {
        let b = &self.blocks[id.0 as usize];
        if b.grads.is_empty() || b.resident {
            return Ok(());
        }
        // Nothing on the device to send: no copy would touch the host buffers, so a host step
        // still running on them is no reason to wait (after backward every block is flushed,
        // most of them already sent and stepping).
        if !b.grads.iter().any(|g| b.vars[g.param].grad().defined()) {
            return Ok(());
        }
        // The host optimizer may still read the buffers the copies would overwrite (its step of
        // this block from the last step): what the wait costs is the compute stream's idle time.
        if let Some(s) = self.stepper.clone() {
            if s.is_pending(id) {
                let probe = self.device.idle_probe()?;
                s.wait(id)?;
                self.update_waits.push(probe.end(&self.device)?);
            }
        }
        if self.rank.is_some() {
            return self.flush_shard(id);
        }
        let conductor = self.conductor.clone();
        let slot = || conductor.acquire_slot(Direction::D2h, Owner::Weights, Priority::Required).ok();
        let moved = self.grads.flush(id, &mut self.blocks[id.0 as usize], &self.pool, slot)?;
        self.metrics.d2h_bytes += moved;
        self.metrics.count_grad_sums(self.grads.take_sum_bytes());
        if let Some(cap) = self.cfg.max_inflight_grad_bytes {
            self.grads.bound(&mut self.blocks, cap)?;
        }
        Ok(())
    }

    /// After backward: every trained block still holding device gradients sends them home (the
    /// last block backward used, and blocks backward never loads, such as an embedding).
    pub(crate) fn after_backward(&mut self) -> Result<()> {
        self.check_live()?;
        for i in 0..self.blocks.len() {
            self.flush_grads(BlockId(i as u32))?;
        }
        Ok(())
    }

    /// Waits until every gradient copy has landed: the host gradients are complete.
    pub(crate) fn collect_grads(&mut self) -> Result<()> {
        self.check_live()?;
        self.after_backward()?;
        self.wait_all_grads()?;
        self.reap();
        Ok(())
    }

    /// Starts a new accumulation window: device gradients of streamed blocks are dropped and the
    /// next gradient of each parameter replaces its host gradient (never evicts a block). Host
    /// steps still running go on: each job holds its own copy of which gradients it steps, and a
    /// block's next gradients wait for its step before they overwrite its buffers
    /// (`flush_grads`), so the next forward and backward overlap the last step's host steps.
    pub(crate) fn zero_grads(&mut self) -> Result<()> {
        self.check_live()?;
        self.wait_all_grads()?;
        for b in &mut self.blocks {
            if b.resident {
                continue;
            }
            if let Some(r) = &mut b.grad_release {
                r.zero_grad()?;
            }
            for g in &mut b.grads {
                g.received = false;
            }
            if let Some(s) = &mut b.shard {
                s.received = false;
            }
        }
        Ok(())
    }

    /// Attaches the host optimizer's worker: loads of a block wait for its pending step.
    pub(crate) fn attach_stepper(&mut self, s: Arc<Stepper>) -> Result<()> {
        if self.stepper.is_some() {
            return Err(Error::misuse("attaching a host optimizer", "one optimizer per weight runtime"));
        }
        self.stepper = Some(s);
        Ok(())
    }

    /// The host values and gradients of a trained streamed block (for building its optimizer).
    pub(crate) fn host_params(&self, id: BlockId) -> Result<Vec<HostParam>> {
        if self.rank.is_some() {
            return self.shard_params(id);
        }
        let b = self.block(id)?;
        let Source::Host(h) = &b.source else {
            return Err(Error::internal(format!("trained block {id} has no host copy")));
        };
        Ok(b.grads
            .iter()
            .map(|g: &ParamGrad| {
                let view = h.views[g.param].shallow_clone();
                match &h.masters[g.param] {
                    Some(m) => HostParam { index: g.param, value: m.shallow_clone(), grad: g.view.shallow_clone(), copy: Some(view), piece: None },
                    None => HostParam { index: g.param, value: view, grad: g.view.shallow_clone(), copy: None, piece: None },
                }
            })
            .collect())
    }

    /// Trained blocks stepped on the host (streamed) and trained parameters kept on the device
    /// (resident blocks), as (streamed ids, device variables).
    pub(crate) fn trained(&self) -> (Vec<BlockId>, Vec<Tensor>) {
        let mut host = Vec::new();
        let mut device = Vec::new();
        for b in &self.blocks {
            if !b.trainable() {
                continue;
            }
            if b.resident {
                for (p, v) in b.spec.params.iter().zip(&b.vars) {
                    if p.trainable {
                        device.push(v.shallow_clone());
                    }
                }
            } else {
                host.push(b.spec.id);
            }
        }
        (host, device)
    }

    /// Queues the host optimizer's step of every trained streamed block, in the order the next
    /// forward needs them, after their gradients landed. `job(block, received)` makes the step,
    /// given which parameters received a gradient in this window. A block still on the device
    /// from this step is evicted first: its device copy would be stale.
    pub(crate) fn submit_updates(
        &mut self,
        mut job: impl FnMut(BlockId, &[bool], Vec<Ready>) -> Result<Box<dyn Job>>,
    ) -> Result<()> {
        self.check_live()?;
        let stepper = self
            .stepper
            .clone()
            .ok_or_else(|| Error::internal("host updates without an attached optimizer"))?;
        self.after_backward()?;
        let order: Vec<BlockId> = match self.route.itinerary() {
            Some(it) => {
                let mut seen = Vec::new();
                for &b in it.order() {
                    if !seen.contains(&b) {
                        seen.push(b);
                    }
                }
                seen
            }
            None => Vec::new(),
        };
        let mut ids: Vec<BlockId> = self
            .blocks
            .iter()
            .filter(|b| !b.grads.is_empty() && !b.resident && !self.submitted.contains(&b.spec.id))
            .map(|b| b.spec.id)
            .collect();
        ids.sort_by_key(|b| order.iter().position(|o| o == b).unwrap_or(usize::MAX));
        for (priority, id) in ids.into_iter().enumerate() {
            self.wait_grads(id)?;
            match self.residency.state(id)? {
                BlockState::Prefetching => {
                    self.finalize(id, false)?;
                    self.evict(id, crate::events::EvictionReason::Explicit, 0.0)?;
                }
                BlockState::GpuReady if self.residency.can_evict(id) => {
                    self.evict(id, crate::events::EvictionReason::Explicit, 0.0)?;
                }
                BlockState::Unloaded => {}
                s => {
                    return Err(Error::misuse(
                        format!("stepping block '{}' (state '{s}')", self.blocks[id.0 as usize].spec.name),
                        "no block in use while the optimizer steps",
                    ))
                }
            }
            self.loads.reap(&self.loader);
            match &self.blocks[id.0 as usize].source {
                // Proof that no copy reads the host weights the step is about to change.
                Source::Host(h) if self.rank.is_none() && Arc::strong_count(&h.buf) != 1 => {
                    return Err(Error::internal(format!("block {id}: a copy still reads its host weights")));
                }
                // In a group the copy is every rank's: the other ranks' loads of it for this
                // step completed before their backward through it, which this rank's shard of
                // its gradients waited for (the reduce-scatter needs every rank's part); its
                // own loads still landing are waited for by the step.
                _ => {}
            }
            let received: Vec<bool> = self.blocks[id.0 as usize].grads.iter().map(|g| g.received).collect();
            let ready = if self.rank.is_some() { self.loads.pending_events(id).into_iter().map(Ready::Copy).collect() } else { Vec::new() };
            let j = job(id, &received, ready)?;
            self.submit_job(&stepper, id, priority as u64, j);
            self.submitted.insert(id);
            self.metrics.host_steps += 1;
        }
        self.update_expected = false;
        self.eager = None;
        if let StepState::Open { stepped, .. } = &mut self.state {
            *stepped = true;
        }
        Ok(())
    }

    /// Whether the open step queued a host step (the optimizer's call, or a block's as backward
    /// left it): from then on the model's values are changing. False between steps.
    pub(crate) fn updates_queued(&self) -> bool {
        match self.state {
            StepState::Open { stepped, .. } => stepped || !self.submitted.is_empty(),
            _ => false,
        }
    }

    /// Arms this step's backward: as it leaves each trained streamed block, that block's host
    /// step is queued at once (made by `maker`), so the host optimizer overlaps the rest of
    /// backward. Disarmed by the next `submit_updates`.
    pub(crate) fn arm_updates(&mut self, maker: JobMaker) -> Result<()> {
        self.check_live()?;
        if self.stepper.is_none() {
            return Err(Error::internal("arming host updates without an attached optimizer"));
        }
        self.eager = Some(maker);
        Ok(())
    }

    /// When armed: queues `id`'s host step now that backward has left it. Its gradients (their
    /// copies, and with host sums their adds) and any load still reading its host memory
    /// complete before the step runs (the worker waits for them, `Ready`); a copy on the device
    /// goes, since it is stale once the step ran.
    pub(super) fn eager_update(&mut self, id: BlockId) -> Result<()> {
        if self.eager.is_none() || self.submitted.contains(&id) {
            return Ok(());
        }
        let b = &self.blocks[id.0 as usize];
        if b.grads.is_empty() || b.resident {
            return Ok(());
        }
        // Autograd gives a parameter its gradient once it has summed every use of it: a weight
        // that backward still has to reach elsewhere (a head tied to the embedding, read first
        // by the head and last by the embedding) has none yet when backward leaves one of its
        // uses. Stepping the block now would step it without that gradient and lose the rest;
        // its step waits for the optimizer's own call instead.
        if b.grads.iter().any(|g| !g.received) || self.used_again_in_backward(id) {
            return Ok(());
        }
        match self.residency.state(id)? {
            BlockState::GpuReady if self.residency.can_evict(id) => {
                self.evict(id, crate::events::EvictionReason::Explicit, 0.0)?;
            }
            BlockState::Unloaded => {}
            // In use or landing: its step waits for the optimizer's own call.
            _ => return Ok(()),
        }
        let mut ready = self.grads_ready(id);
        ready.extend(self.loads.pending_events(id).into_iter().map(Ready::Copy));
        let received: Vec<bool> = self.blocks[id.0 as usize].grads.iter().map(|g| g.received).collect();
        let priority = self.forward_position(id);
        let stepper = self.stepper.clone().ok_or_else(|| Error::internal("armed without a stepper"))?;
        let job = match &mut self.eager {
            Some(make) => make(id, &received, ready)?,
            None => return Ok(()),
        };
        self.submit_job(&stepper, id, priority, job);
        self.submitted.insert(id);
        self.metrics.host_steps += 1;
        self.metrics.host_steps_overlapped += 1;
        Ok(())
    }

    /// Whether the itinerary's backward reads `id` again after the current position (a weight
    /// also read through a `detach`ed use, whose gradient is complete before its last read):
    /// stepping it now would let that read see the updated values.
    /// Unknown (true) while the step does not follow a learned itinerary.
    fn used_again_in_backward(&self, id: BlockId) -> bool {
        if !self.route.following() {
            return true;
        }
        let (Some(it), Some(pos)) = (self.route.itinerary(), self.route.pos()) else { return true };
        let start = it.forward().len();
        (pos.max(start) + 1..it.len()).any(|p| it.at(p) == id)
    }

    /// Where `id` first comes in the forward (the order its step is needed in).
    fn forward_position(&self, id: BlockId) -> u64 {
        self.route
            .itinerary()
            .and_then(|it| it.forward().iter().position(|&b| b == id))
            .unwrap_or(usize::MAX) as u64
    }

    /// Marks blocks to stay on the device for good (loaded once, trained on the device).
    pub(crate) fn set_resident(&mut self, ids: &[BlockId]) -> Result<()> {
        self.check_live()?;
        if self.slots.is_some() {
            return Err(Error::misuse("choosing resident blocks", "choose them before the first step"));
        }
        for &id in ids {
            let b = self.block(id)?;
            // In a group, trained blocks are stepped on the host, each rank its shard.
            if self.rank.is_some() && b.trainable() {
                return Err(Error::misuse(
                    format!("keeping trained block '{}' resident in a data-parallel group", b.spec.name),
                    "frozen blocks resident: the ranks' trained blocks stream from the one host copy, where the host optimizer steps them",
                ));
            }
            // A resident block trains on the device, where it has no float32 master.
            if let Some(p) = b.spec.params.iter().find(|p| p.has_master()) {
                return Err(Error::misuse(
                    format!("keeping block '{}' resident", b.spec.name),
                    format!(
                        "a block without trained 16-bit parameters ('{}' is {:?} with a float32 master on the host, stepped there): resident blocks train on the device",
                        p.name, p.kind
                    ),
                ));
            }
            self.blocks[id.0 as usize].resident = true;
            self.residency.set_protected(id, true, &self.bus)?;
        }
        Ok(())
    }
}
