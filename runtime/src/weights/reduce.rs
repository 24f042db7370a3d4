//! The gradient reduction of a data-parallel rank, the counterpart of `grads` (one device's
//! gradient sink): as soon as backward has left a trained block, its device gradients are
//! packed into one bucket, the group reduce-scatters the bucket (NCCL on CUDA, on a side stream,
//! so backward goes on meanwhile), and this rank's shard of the sum is copied to its pinned
//! host buffer: each shard crosses PCIe once, and the host optimizer steps it there.
//!
//! Device memory: the bucket and the shard are libtorch tensors used on other streams than the
//! compute stream that made them, so each is kept alive until the last operation reading or
//! writing it completed (the collective holds both, the copy holds the shard), and the copy of
//! the shard waits for the collective's event. A later gradient of the same accumulation window
//! (micro-batches, a weight used twice) is reduced the same way, and the shard's sum so far comes
//! back from its host buffer to be added to it on the device (`super::accumulate`) before the
//! sum is copied home.

use super::accumulate::DeviceSum;
use super::block::Block;
use crate::collective::{Collective, InFlight};
use crate::conductor::SlotToken;
use crate::device::{HostBuffer, Order};
use crate::error::{Error, Result};
use crate::events::{BlockId, Owner};
use crate::guards::GuardSlot;
use crate::transfer::{Copier, Transfer};
use std::sync::Arc;
use tch::Tensor;

/// One block's reduction in flight.
#[derive(Debug)]
struct Bucket {
    block: BlockId,
    /// The collective (it holds the bucket and the shard until it completed).
    op: Option<InFlight>,
    /// The shard's copy to the host buffer (it holds the shard until it completed).
    copy: Option<Transfer<HostBuffer>>,
}

impl Bucket {
    fn device_bytes(&self) -> u64 {
        self.op.as_ref().map_or(0, InFlight::bytes) + self.copy.as_ref().map_or(0, Transfer::bytes)
    }
}

/// A rank's gradient reductions in flight.
#[derive(Debug)]
pub(crate) struct ReduceSink {
    collective: Arc<Collective>,
    copier: Copier,
    /// The run's numeric guards, which check each gradient before it is reduced.
    guards: GuardSlot,
    inflight: Vec<Bucket>,
    /// Milliseconds the collectives of this step ran on the device (the timed ones), and bytes.
    collective_ms: f64,
    collective_bytes: u64,
    /// Later shards of an accumulation window, summed on the device.
    sum: DeviceSum,
}

impl ReduceSink {
    pub(crate) fn new(collective: Arc<Collective>, copier: Copier, guards: GuardSlot) -> Result<ReduceSink> {
        let sum = DeviceSum::new(copier.sibling()?);
        Ok(ReduceSink { collective, copier, guards, inflight: Vec::new(), collective_ms: 0.0, collective_bytes: 0, sum })
    }

    /// Reduces `block`'s device gradients over the group and sends this rank's shard of the sum
    /// home; frees the device gradients. Returns the bytes that left the device (the shard), 0
    /// when the block has no gradient.
    pub(crate) fn flush(&mut self, id: BlockId, block: &mut Block, slot: impl FnOnce() -> Option<SlotToken>) -> Result<u64> {
        let Some(shard) = &block.shard else {
            return Err(Error::internal(format!("block {id} trains without a shard of its gradients")));
        };
        let layout = shard.layout.clone();
        let grads: Vec<Option<Tensor>> = layout
            .params
            .iter()
            .map(|&(p, _, _)| {
                let g = block.vars[p].grad();
                g.defined().then_some(g)
            })
            .collect();
        if grads.iter().all(Option::is_none) {
            return Ok(0);
        }
        let device = self.copier.device().clone();
        for g in grads.iter().flatten() {
            self.guards.observe_gradient(Some(id), g);
        }
        let defined: Vec<bool> = grads.iter().map(Option::is_some).collect();
        let bucket = layout.pack(&grads, device.tch_device())?;
        drop(grads);
        // The bucket holds them now: the device gradients go.
        if let Some(release) = &mut block.grad_release {
            release.zero_grad()?;
        }
        let out = Tensor::f_empty([layout.shard], (layout.kind, device.tch_device()))?;
        let name = block.spec.name.clone();
        let op = self.collective.reduce_scatter(bucket, out.shallow_clone(), Owner::Weights, &format!("block '{name}' gradients"))?;
        self.collective_bytes += op.bytes();
        let fresh = !block.shard.as_ref().is_some_and(|s| s.received);
        let bytes = layout.shard_bytes() as u64;
        let order = if fresh {
            Order::After(op.done())
        } else {
            // Accumulation: the sum so far, landed, comes back and takes in the reduced shard on
            // the compute stream (after the collective), and the sum goes home.
            self.wait_block(id, block)?;
            device.compute_wait(op.done())?;
            let buf = block.shard.as_ref().and_then(|s| s.buf.as_ref());
            let buf = buf.ok_or_else(|| Error::internal(format!("block {id}: its gradient shard's buffer is missing")))?;
            self.sum.add_host_sums(&[(buf, &out)], &format!("block '{name}' gradient shard"))?;
            Order::AfterCompute
        };
        let buf = self.take_buffer(id, block)?;
        let copy = match self.copier.d2h(buf, 0, &out, order, slot(), || format!("block '{name}' gradient shard")) {
            Ok(t) => Some(t),
            Err(failed) => {
                if let Some(s) = &mut block.shard {
                    s.buf = Some(failed.host);
                }
                return Err(failed.error);
            }
        };
        if let Some(s) = &mut block.shard {
            s.received = true;
        }
        // Parameters that had a gradient in this reduction have one in the window.
        for (&(p, _, _), &had) in layout.params.iter().zip(&defined) {
            if let Some(g) = block.grads.iter_mut().find(|g| g.param == p) {
                g.received |= had;
            }
        }
        self.inflight.push(Bucket { block: id, op: Some(op), copy });
        Ok(bytes)
    }

    fn take_buffer(&mut self, id: BlockId, block: &mut Block) -> Result<HostBuffer> {
        if block.shard.as_ref().is_some_and(|s| s.buf.is_none()) {
            self.wait_block(id, block)?;
        }
        block
            .shard
            .as_mut()
            .and_then(|s| s.buf.take())
            .ok_or_else(|| Error::internal(format!("block {id}: its gradient shard's buffer is missing")))
    }

    /// Reports what completed: collectives (their time counted), and copies (their buffers
    /// back to their blocks).
    pub(crate) fn reap(&mut self, blocks: &mut [Block]) {
        let inflight = std::mem::take(&mut self.inflight);
        for mut b in inflight {
            if let Some(op) = b.op.take() {
                match self.collective.finish(op) {
                    Ok(ms) => self.count(ms),
                    Err(op) => b.op = Some(op),
                }
            }
            if let Some(t) = b.copy.take() {
                match self.copier.finish(t) {
                    Ok((buf, _)) => give_back(blocks.get_mut(b.block.0 as usize), buf),
                    Err(t) => b.copy = Some(t),
                }
            }
            if b.op.is_some() || b.copy.is_some() {
                self.inflight.push(b);
            }
        }
    }

    fn count(&mut self, ms: Option<f64>) {
        self.collective_ms += ms.unwrap_or(0.0);
    }

    fn land(&mut self, mut b: Bucket, block: Option<&mut Block>) -> Result<()> {
        if let Some(op) = b.op.take() {
            let ms = self.collective.wait(op)?;
            self.count(ms);
        }
        if let Some(t) = b.copy.take() {
            let (buf, _) = self.copier.wait(t)?;
            give_back(block, buf);
        }
        Ok(())
    }

    /// Bytes of gradient sums brought back to the device for accumulation since the last call.
    pub(crate) fn take_sum_bytes(&mut self) -> u64 {
        self.sum.take_read_bytes()
    }

    /// Waits for every reduction of `id`.
    pub(crate) fn wait_block(&mut self, id: BlockId, block: &mut Block) -> Result<()> {
        while let Some(i) = self.inflight.iter().position(|b| b.block == id) {
            let b = self.inflight.remove(i);
            self.land(b, Some(block))?;
        }
        Ok(())
    }

    /// Waits for every reduction (and the reads of sums so far before their copies).
    pub(crate) fn wait_all(&mut self, blocks: &mut [Block]) -> Result<()> {
        for b in std::mem::take(&mut self.inflight) {
            let id = b.block;
            self.land(b, blocks.get_mut(id.0 as usize))?;
        }
        self.sum.wait_all()
    }

    /// Keeps at most `cap` device bytes in flight (buckets and shards): what completed first,
    /// then, while more are in flight (and more than one reduction), waits for the oldest.
    pub(crate) fn bound(&mut self, blocks: &mut [Block], cap: u64) -> Result<()> {
        self.reap(blocks);
        while self.inflight.len() > 1 && self.in_flight_bytes() > cap {
            let b = self.inflight.remove(0);
            let id = b.block;
            self.land(b, blocks.get_mut(id.0 as usize))?;
        }
        Ok(())
    }

    /// The events the host step of `id` waits for: its shard's copies landing.
    pub(crate) fn pending_events(&self, id: BlockId) -> Vec<crate::device::StreamEvent> {
        self.inflight
            .iter()
            .filter(|b| b.block == id)
            .flat_map(|b| b.copy.as_ref().map(|t| t.done().clone()).into_iter().chain(b.op.as_ref().map(|o| o.done().clone())))
            .collect()
    }

    /// Reductions in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Device bytes the reductions in flight hold, and the accumulation's scratch slab.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.inflight.iter().map(Bucket::device_bytes).sum::<u64>() + self.sum.device_bytes()
    }

    /// The collectives' time on the device and bytes since the last call (one step's).
    pub(crate) fn take_totals(&mut self) -> (f64, u64) {
        (std::mem::take(&mut self.collective_ms), std::mem::take(&mut self.collective_bytes))
    }
}

fn give_back(block: Option<&mut Block>, buf: HostBuffer) {
    if let Some(s) = block.and_then(|b| b.shard.as_mut()) {
        s.buf = Some(buf);
    }
}
