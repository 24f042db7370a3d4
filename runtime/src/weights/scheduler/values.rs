//! Managed parameters' values outside a step: read for checkpoints and snapshots (never a
//! placeholder), written when a checkpoint is loaded, and written back from the device before a
//! resident block's device copy goes (a resident block trains on the device, so its device copy
//! is the canonical one while it is there).

use super::super::block::{Placement, Source};
use super::{Scheduler, StepState};
use crate::error::{Error, Result};
use crate::events::{BlockId, BlockState, EvictionReason};
use crate::torch::VariableId;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

impl Scheduler {
    /// Handles of each managed variable the runtime holds: the block's own, the one its
    /// gradient release holds (trainable parameters) and those noted by the runtime's optimizer.
    pub(crate) fn held_references(&self) -> HashMap<VariableId, usize> {
        let mut held = HashMap::new();
        for b in &self.blocks {
            for (p, var) in b.spec.params.iter().zip(&b.vars) {
                let id = VariableId::of(var);
                let grad_release = usize::from(p.trainable && b.grad_release.is_some());
                held.insert(id, 1 + grad_release + self.noted.get(&id).copied().unwrap_or(0));
            }
        }
        held
    }

    /// Notes `n` more (or fewer) handles of a managed variable held by the runtime's optimizer.
    pub(crate) fn note_references(&mut self, id: VariableId, n: isize) {
        let e = self.noted.entry(id).or_default();
        *e = e.saturating_add_signed(n);
    }

    /// The canonical value of parameter `i` of `id`, after any pending host optimizer step of
    /// the block, sharing memory where it can (see `Block::value`). Valid until the next step
    /// or load. Also after shutdown (the host copy then holds every block's final values).
    pub(crate) fn param_value(&self, id: BlockId, i: usize) -> Result<Tensor> {
        self.check_whole()?;
        self.wait_host_copy(id)?;
        self.block(id)?.value(i)
    }

    /// Makes `value` the canonical value of parameter `i` of `id` (a checkpoint being loaded).
    /// Only between steps. The shape and dtype must be the parameter's. A streamed block's host
    /// copy is written (a copy of it on the device is dropped first); a resident block on the
    /// device is written there and in its host copy; a file-backed block is frozen and its file
    /// is its value, so a different value is refused.
    pub(crate) fn set_param(&mut self, id: BlockId, i: usize, value: &Tensor) -> Result<()> {
        self.check_live()?;
        let name = {
            let b = self.block(id)?;
            let p = b
                .spec
                .params
                .get(i)
                .ok_or_else(|| Error::UnknownBlock(format!("{} parameter {i}", b.spec.name)))?;
            if value.size() != p.shape || value.kind() != p.declared {
                return Err(Error::misuse(
                    format!("loading '{}' as {:?} {:?}", p.name, value.kind(), value.size()),
                    format!("the parameter's dtype and shape, {:?} {:?}", p.declared, p.shape),
                ));
            }
            p.name.clone()
        };
        if matches!(self.state, StepState::Open { .. }) {
            return Err(Error::misuse(
                format!("loading '{name}' during step {}", self.step + 1),
                "load a checkpoint between steps",
            ));
        }
        self.wait_host_copy(id)?;
        let on_device = matches!(self.blocks[id.0 as usize].placement, Some(Placement::Own(_)));
        if let Source::File(f) = &self.blocks[id.0 as usize].source {
            let p = &self.blocks[id.0 as usize].spec.params[i];
            if f.read_param(i, p)?.f_to_kind(p.declared)?.equal(value) {
                return Ok(());
            }
            return Err(Error::misuse(
                format!("loading a new value into '{name}'"),
                format!(
                    "its value in the file it streams from ({}): a file-backed block is frozen; load a checkpoint with the file's values for it, or do not back that block with a file",
                    f.path()
                ),
            ));
        }
        if on_device {
            let var = self.blocks[id.0 as usize].vars[i].shallow_clone();
            tch::no_grad(|| var.detach().f_copy_(value))?;
        } else {
            match self.residency.state(id)? {
                BlockState::Unloaded => {}
                BlockState::Prefetching => {
                    self.finalize(id, false)?;
                    self.evict(id, EvictionReason::Explicit, 0.0)?;
                }
                BlockState::GpuReady if self.residency.can_evict(id) => self.evict(id, EvictionReason::Explicit, 0.0)?,
                s => {
                    return Err(Error::misuse(
                        format!("loading '{name}' while its block is '{s}'"),
                        "load a checkpoint while the model is not running",
                    ))
                }
            }
        }
        // In a group rank 0 writes the one host copy; the others only dropped their device
        // copies above.
        if self.rank.as_ref().is_some_and(|r| r.member.rank != 0) {
            return Ok(());
        }
        self.loads.reap(&self.loader);
        // In a group every rank's block holds the copy: the group loads a checkpoint between
        // two barriers, each rank's loads drained first (`crate::parallel`).
        let holders = if self.rank.is_some() { usize::MAX } else { 1 };
        let busy = match &self.blocks[id.0 as usize].source {
            Source::Host(h) => Arc::strong_count(&h.buf) > holders,
            Source::Quantized(q) => Arc::strong_count(&q.buf) > holders,
            _ => false,
        };
        if busy || self.rank.is_some() {
            // A copy still reads the host weights: let every load finish first.
            self.loads.drain(&self.loader)?;
        }
        if let Source::Quantized(q) = &self.blocks[id.0 as usize].source {
            // A frozen block stored quantized takes a new value quantized (a checkpoint loaded
            // into a quantized model), and says what that cost.
            if Arc::strong_count(&q.buf) != 1 {
                return Err(Error::internal(format!("block {id}: a copy still reads its host weights")));
            }
            let b = &self.blocks[id.0 as usize];
            let layout = b.spec.quant.as_ref().ok_or_else(|| Error::internal("a quantized block without its layout"))?;
            let error = super::super::quant::write_param(&b.spec, layout, i, value, &q.views[i])?;
            if let Source::Quantized(q) = &mut self.blocks[id.0 as usize].source {
                q.errors[i] = error;
            }
            self.published_report(id)?;
            return Ok(());
        }
        let Source::Host(h) = &self.blocks[id.0 as usize].source else {
            return Err(Error::internal(format!("block {id} has neither a file nor a host copy")));
        };
        if Arc::strong_count(&h.buf) > holders {
            return Err(Error::internal(format!("block {id}: a copy still reads its host weights")));
        }
        let view = h.views[i].shallow_clone();
        let master = h.masters[i].as_ref().map(Tensor::shallow_clone);
        tch::no_grad(|| -> Result<()> {
            // The master holds the value; the copy that streams is its rounding.
            if let Some(m) = &master {
                m.detach().f_copy_(value)?;
                view.detach().f_copy_(m)?;
            } else {
                view.detach().f_copy_(value)?;
            }
            Ok(())
        })
    }

    /// Copies a resident block's device values into its host copy, before its device copy goes
    /// (a trainable resident block trains on the device; without this its training is lost).
    pub(super) fn write_back(&mut self, id: BlockId) -> Result<()> {
        let b = &self.blocks[id.0 as usize];
        if !b.trainable() || !matches!(b.placement, Some(Placement::Own(_))) {
            return Ok(());
        }
        let Source::Host(h) = &b.source else {
            return Err(Error::internal(format!("resident block {id} has no host copy")));
        };
        tch::no_grad(|| -> Result<()> {
            for ((view, master), var) in h.views.iter().zip(&h.masters).zip(&b.vars) {
                view.detach().f_copy_(var)?;
                if let Some(m) = master {
                    m.detach().f_copy_(var)?;
                }
            }
            Ok(())
        })
    }

    /// The host gradients of `id` that arrived in this accumulation window, by parameter index
    /// (views of the host buffers; complete after `collect_grads`).
    pub(crate) fn received_grads(&self, id: BlockId) -> Result<Vec<(usize, Tensor)>> {
        let b = self.block(id)?;
        // In a group each parameter's piece of this rank's shard (landed with the shard's
        // buffer back; a parameter with no piece here has none).
        let landed = |g: &super::super::block::ParamGrad| match &b.shard {
            Some(s) => s.buf.is_some() && g.view.numel() > 0,
            None => g.buf.is_some(),
        };
        Ok(b.grads
            .iter()
            .filter(|g| g.received && landed(g) && !b.resident)
            .map(|g| (g.param, g.view.shallow_clone()))
            .collect())
    }
}
