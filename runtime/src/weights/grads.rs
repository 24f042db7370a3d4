//! The gradient sink: as soon as backward has left a trainable streamed block, its device
//! gradients leave for the host on their own copy stream (ordered after the kernels that produced
//! them) and the device memory is given back; the host optimizer can step the block once every
//! copy of it has landed.
//!
//! A parameter's first gradient in an accumulation window is copied straight into its host
//! buffer; a later one (gradient accumulation over micro-batches) is added on the device to the
//! sum so far, brought back from that buffer (`super::accumulate`), and the sum copied home.

use super::accumulate::DeviceSum;
use super::block::Block;
use crate::conductor::SlotToken;
use crate::device::{HostBuffer, Order};
use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::guards::GuardSlot;
use crate::transfer::{Copier, Transfer};

#[derive(Debug)]
struct GradCopy {
    block: BlockId,
    /// Index into the block's `grads`.
    grad: usize,
    transfer: Transfer<HostBuffer>,
}

/// Gradient copies in flight.
#[derive(Debug)]
pub(crate) struct GradSink {
    copier: Copier,
    inflight: Vec<GradCopy>,
    /// The run's numeric guards, which check each gradient before it leaves.
    guards: GuardSlot,
    /// Later gradients of an accumulation window, summed on the device.
    sum: DeviceSum,
}

impl GradSink {
    pub(crate) fn new(copier: Copier, guards: GuardSlot) -> GradSink {
        GradSink {
            copier,
            inflight: Vec::new(),
            guards,
            sum: DeviceSum::default(),
        }
    }

    /// Sends `block`'s device gradients to the host and frees them on the device. Returns the
    /// bytes that left the device.
    pub(crate) fn flush(
        &mut self,
        id: BlockId,
        block: &mut Block,
        mut slot: impl FnMut() -> Option<SlotToken>,
    ) -> Result<u64> {
        let mut moved = 0u64;
        let mut outgoing = Vec::new();
        for gi in 0..block.grads.len() {
            let g = block.vars[block.grads[gi].param].grad();
            if !g.defined() {
                continue;
            }
            self.guards.observe_gradient(Some(id), &g);
            let g = if g.is_contiguous() { g } else { g.f_contiguous()? };
            if block.grads[gi].received {
                // Accumulation: the sum so far must have landed before it comes back.
                self.wait_grad(id, gi, block)?;
            }
            outgoing.push((gi, g));
        }
        // Later gradients of the window first take in the sums so far, all the block's at once.
        let later = outgoing
            .iter()
            .filter(|(gi, _)| block.grads[*gi].received)
            .map(|(gi, g)| {
                let buf = block.grads[*gi].buf.as_ref();
                buf.map(|b| (b, g)).ok_or_else(|| Error::internal(format!("block {id}: a gradient's sum so far has no host buffer")))
            })
            .collect::<Result<Vec<(&HostBuffer, &tch::Tensor)>>>()?;
        self.sum.add_host_sums(&self.copier, &later, &format!("block '{}' gradients", block.spec.name))?;
        drop(later);
        for (gi, g) in outgoing {
            let bytes = crate::torch::tensor_bytes(&g);
            let buf = self.take_buffer(id, gi, block)?;
            let name = &block.spec.params[block.grads[gi].param].name;
            match self.copier.d2h(buf, 0, &g, Order::AfterCompute, slot(), || format!("gradient {name}")) {
                Ok(transfer) => self.inflight.push(GradCopy {
                    block: id,
                    grad: gi,
                    transfer,
                }),
                Err(failed) => {
                    block.grads[gi].buf = Some(failed.host);
                    return Err(failed.error);
                }
            }
            block.grads[gi].received = true;
            moved += bytes;
        }
        if moved > 0 {
            if let Some(release) = &mut block.grad_release {
                release.zero_grad()?;
            }
        }
        Ok(moved)
    }

    fn take_buffer(&mut self, id: BlockId, gi: usize, block: &mut Block) -> Result<HostBuffer> {
        if block.grads[gi].buf.is_none() {
            self.wait_grad(id, gi, block)?;
        }
        block.grads[gi]
            .buf
            .take()
            .ok_or_else(|| Error::internal(format!("block {id}: gradient buffer {gi} is missing")))
    }

    fn wait_grad(&mut self, id: BlockId, gi: usize, block: &mut Block) -> Result<()> {
        if let Some(i) = self.inflight.iter().position(|c| c.block == id && c.grad == gi) {
            let c = self.inflight.swap_remove(i);
            let (buf, _) = self.copier.wait(c.transfer)?;
            block.grads[gi].buf = Some(buf);
        }
        Ok(())
    }

    /// Keeps at most `cap` device bytes of gradients in flight: completed copies first, then,
    /// while more are in flight (and more than one copy), waits for the oldest.
    pub(crate) fn bound(&mut self, blocks: &mut [Block], cap: u64) -> Result<()> {
        self.reap(blocks);
        let mut held = self.in_flight_bytes();
        while self.inflight.len() > 1 && held > cap {
            let c = self.inflight.remove(0);
            held -= c.transfer.bytes();
            self.land(c, blocks)?;
        }
        Ok(())
    }

    /// Waits for one copy and gives its host buffer back to its block.
    fn land(&self, c: GradCopy, blocks: &mut [Block]) -> Result<()> {
        let (buf, _) = self.copier.wait(c.transfer)?;
        if let Some(g) = blocks.get_mut(c.block.0 as usize).and_then(|b| b.grads.get_mut(c.grad)) {
            g.buf = Some(buf);
        }
        Ok(())
    }

    /// Returns the buffers of completed copies to their blocks.
    pub(crate) fn reap(&mut self, blocks: &mut [Block]) {
        let inflight = std::mem::take(&mut self.inflight);
        for c in inflight {
            match self.copier.finish(c.transfer) {
                Ok((buf, _)) => {
                    if let Some(g) = blocks.get_mut(c.block.0 as usize).and_then(|b| b.grads.get_mut(c.grad)) {
                        g.buf = Some(buf);
                    }
                }
                Err(transfer) => self.inflight.push(GradCopy { transfer, ..c }),
            }
        }
    }

    /// The completion events of `block`'s gradient copies in flight.
    pub(crate) fn pending_events(&self, id: BlockId) -> Vec<crate::device::StreamEvent> {
        self.inflight
            .iter()
            .filter(|c| c.block == id)
            .map(|c| c.transfer.done().clone())
            .collect()
    }

    /// Bytes of gradient sums brought back to the device for accumulation since the last call.
    pub(crate) fn take_sum_bytes(&mut self) -> u64 {
        self.sum.take_read_bytes()
    }

    /// Waits for every copy of `block`.
    pub(crate) fn wait_block(&mut self, id: BlockId, block: &mut Block) -> Result<()> {
        while let Some(i) = self.inflight.iter().position(|c| c.block == id) {
            let c = self.inflight.swap_remove(i);
            let (buf, _) = self.copier.wait(c.transfer)?;
            if let Some(g) = block.grads.get_mut(c.grad) {
                g.buf = Some(buf);
            }
        }
        Ok(())
    }

    /// Waits for every copy (and the reads of sums so far before them).
    pub(crate) fn wait_all(&mut self, blocks: &mut [Block]) -> Result<()> {
        for c in std::mem::take(&mut self.inflight) {
            self.land(c, blocks)?;
        }
        self.sum.wait_all(&self.copier)
    }

    /// Copies in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Device bytes the copies in flight still hold, and the accumulation's scratch slab.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.inflight.iter().map(|c| c.transfer.bytes()).sum::<u64>() + self.sum.device_bytes()
    }
}
