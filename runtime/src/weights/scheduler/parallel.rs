//! A data-parallel rank's part of the scheduler: blocks registered against the group's one host
//! copy (`super::super::shared`), gradients reduced over the group as backward leaves each block
//! (`super::super::reduce`), and the host steps of this rank's shards counted on the group's
//! board, which every rank's loads wait for.
//!
//! The ranks must queue their collectives in the same order. The scheduler reduces a block's
//! gradients only where that order is the model's own: when backward leaves the block (the
//! itinerary, the same on every rank) and after backward (in block order); an eviction, whose
//! timing differs from rank to rank, leaves the gradients on the device for those points.

use super::super::block::{Block, Source};
use super::super::reduce::ReduceSink;
use super::super::registry::BlockSpec;
use super::super::shared::SharedModel;
use super::Scheduler;
use crate::collective::Membership;
use crate::error::{Error, Result};
use crate::events::{BlockId, Direction, Owner, Priority};
use crate::weights::stepper::{Job, Stepper};
use crate::transfer::Copier;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// What a rank's scheduler holds of its group.
pub(crate) struct Rank {
    pub member: Membership,
    pub model: Arc<SharedModel>,
    pub reduce: ReduceSink,
    /// Host steps of each block this rank queued so far.
    pub submitted: HashMap<BlockId, u64>,
}

/// A host step that counts itself on the group's board once it ran, and stops the group when
/// it fails (the other ranks would otherwise wait for it).
struct Counted {
    job: Box<dyn Job>,
    block: BlockId,
    member: Membership,
    model: Arc<SharedModel>,
}

impl Job for Counted {
    fn run(&mut self, pool: Option<&rayon::ThreadPool>) -> Result<()> {
        match self.job.run(pool) {
            Ok(()) => {
                self.model.board().finished(self.block);
                Ok(())
            }
            Err(e) => Err(self.member.fail(format!("the host optimizer's step of block {}: {e}", self.block))),
        }
    }

    fn wait_ready(&mut self) -> Result<()> {
        self.job.wait_ready()
    }

    fn is_ready(&self) -> bool {
        self.job.is_ready()
    }
}

impl Scheduler {
    /// Makes this runtime rank `member.rank` of a data-parallel group whose host copy of the
    /// model is `model`. Only before any block is registered.
    pub(crate) fn join(&mut self, member: Membership, model: Arc<SharedModel>) -> Result<()> {
        if !self.blocks.is_empty() || self.rank.is_some() {
            return Err(Error::misuse("joining a data-parallel group", "join before the model's blocks are registered, once"));
        }
        let copier = Copier::new(&self.device, self.bus.clone(), Owner::Weights)?;
        self.rank = Some(Rank { reduce: ReduceSink::new(member.collective.clone(), copier, self.guards.clone())?, member, model, submitted: HashMap::new() });
        Ok(())
    }

    /// This rank's place in its group, if it is in one.
    pub(crate) fn membership(&self) -> Option<&Membership> {
        self.rank.as_ref().map(|r| &r.member)
    }

    /// A new block `id`: its own host copy on one device; in a group, rank 0's (published by
    /// rank 0 when it makes it) with a shard of the gradients for this rank.
    pub(super) fn make_block(&self, id: BlockId, spec: BlockSpec, params: Vec<(String, Tensor)>) -> Result<Block> {
        let Some(r) = &self.rank else {
            return Block::from_module(spec, params, &self.device, &self.pool);
        };
        let (rank, world) = (r.member.rank, r.member.world);
        if spec.quant.is_some() {
            // Rank 0 publishes full-width host copies only: each rank would quantize its own.
            return Err(Error::Config {
                field: "quantize",
                value: format!("block '{}' in a data-parallel group of {world}", spec.name),
                expected: "quantized frozen blocks on one device (a group streams one full-width host copy)".into(),
            });
        }
        let shared = if rank == 0 { None } else { Some(r.model.attach(rank, id, &spec)?) };
        let b = Block::for_rank(spec, params, &self.device, &self.pool, shared, (rank, world))?;
        if rank == 0 {
            if let Source::Host(h) = &b.source {
                r.model.publish(id, &b.spec, h)?;
            }
        }
        Ok(b)
    }

    /// In a group: reduces `id`'s device gradients over the ranks and sends this rank's shard
    /// home. `super::train::Scheduler::flush_grads` calls it once it has found device gradients
    /// to send and waited for this rank's host step of the block from the last step (which may
    /// still read the shard buffer).
    pub(super) fn flush_shard(&mut self, id: BlockId) -> Result<()> {
        let conductor = self.conductor.clone();
        let slot = || conductor.acquire_slot(Direction::D2h, Owner::Weights, Priority::Required).ok();
        let cap = self.cfg.max_inflight_grad_bytes;
        let Some(r) = self.rank.as_mut() else { return Err(Error::internal("a shard flush outside a group")) };
        let moved = r.reduce.flush(id, &mut self.blocks[id.0 as usize], slot)?;
        self.metrics.d2h_bytes += moved;
        self.metrics.count_grad_sums(r.reduce.take_sum_bytes());
        if let Some(cap) = cap {
            r.reduce.bound(&mut self.blocks, cap)?;
        }
        Ok(())
    }

    /// Whether `id`'s host copy is being changed: a host step of it queued and not run, this
    /// rank's or, in a group, any rank's.
    pub(super) fn update_pending(&self, id: BlockId) -> bool {
        let own = self.stepper.as_ref().is_some_and(|s| s.is_pending(id));
        match &self.rank {
            Some(r) => own || r.model.board().pending(id, r.submitted.get(&id).copied().unwrap_or(0)),
            None => own,
        }
    }

    /// Waits until no host step changes `id`'s host copy (every rank's, in a group), to read or
    /// write its values (checkpoints).
    pub(super) fn wait_host_copy(&self, id: BlockId) -> Result<()> {
        if let Some(s) = &self.stepper {
            s.wait(id)?;
        }
        self.wait_group_update(id)
    }

    /// In a group: waits until every rank's host step of `id` queued so far has run.
    pub(super) fn wait_group_update(&self, id: BlockId) -> Result<()> {
        if let Some(r) = &self.rank {
            r.model.board().wait(r.member.rank, id, r.submitted.get(&id).copied().unwrap_or(0))?;
        }
        Ok(())
    }

    /// Waits until every host step queued so far has run (every rank's, in a group).
    pub(super) fn wait_all_updates(&self) -> Result<()> {
        if let Some(s) = &self.stepper {
            s.wait_all()?;
        }
        if let Some(r) = &self.rank {
            for (&id, &n) in &r.submitted {
                r.model.board().wait(r.member.rank, id, n)?;
            }
        }
        Ok(())
    }

    /// Queues `id`'s host step on `stepper`; in a group, counted on the board when it ran.
    pub(super) fn submit_job(&mut self, stepper: &Stepper, id: BlockId, priority: u64, job: Box<dyn Job>) {
        let job = match &mut self.rank {
            Some(r) => {
                *r.submitted.entry(id).or_default() += 1;
                Box::new(Counted { job, block: id, member: r.member.clone(), model: r.model.clone() }) as Box<dyn Job>
            }
            None => job,
        };
        stepper.submit(id, priority, job);
    }

    /// The copies and collectives a host step of `id` must see complete: its gradients
    /// landing (one device), or its shard landing (a group).
    pub(super) fn grads_ready(&self, id: BlockId) -> Vec<crate::weights::stepper::Ready> {
        match &self.rank {
            Some(r) => r.reduce.pending_events(id).into_iter().map(crate::weights::stepper::Ready::Copy).collect(),
            None => self.grads.ready(id),
        }
    }

    /// Waits until `id`'s gradients (or its shard) have landed.
    pub(super) fn wait_grads(&mut self, id: BlockId) -> Result<()> {
        match &mut self.rank {
            Some(r) => r.reduce.wait_block(id, &mut self.blocks[id.0 as usize]),
            None => self.grads.wait_block(id, &mut self.blocks[id.0 as usize]),
        }
    }

    /// Waits until every gradient (or shard) has landed.
    pub(super) fn wait_all_grads(&mut self) -> Result<()> {
        if let Some(r) = &mut self.rank {
            r.reduce.wait_all(&mut self.blocks)?;
        }
        self.grads.wait_all(&mut self.blocks)
    }

    /// The collectives of the step so far: their time on the device (ms) and bytes.
    pub(super) fn take_collective_totals(&mut self) -> (f64, u64) {
        self.rank.as_mut().map_or((0.0, 0), |r| r.reduce.take_totals())
    }

    /// In a group: the host values and gradients of this rank's pieces of a trained streamed
    /// block (each a 1-D slice of a parameter, in the parameter's order), for its optimizer.
    pub(super) fn shard_params(&self, id: BlockId) -> Result<Vec<super::train::HostParam>> {
        let b = self.block(id)?;
        let (Source::Host(h), Some(shard)) = (&b.source, &b.shard) else {
            return Err(Error::internal(format!("trained block {id} has no host copy or no shard")));
        };
        let mut out = Vec::new();
        for g in &b.grads {
            let Some((at, _, n)) = shard.layout.piece(g.param) else { continue };
            let slice = |t: &Tensor| -> Result<Tensor> { Ok(t.f_reshape([-1])?.f_narrow(0, at, n)?) };
            let view = slice(&h.views[g.param])?;
            out.push(match &h.masters[g.param] {
                Some(m) => super::train::HostParam { index: g.param, value: slice(m)?, grad: g.view.shallow_clone(), copy: Some(view), piece: Some((at, n)) },
                None => super::train::HostParam { index: g.param, value: view, grad: g.view.shallow_clone(), copy: None, piece: Some((at, n)) },
            });
        }
        Ok(out)
    }
}
