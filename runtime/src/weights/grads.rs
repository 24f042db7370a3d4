//! The gradient sink: as soon as backward has left a trainable streamed block, its device
//! gradients leave for the host on their own copy stream (ordered after the kernels that produced
//! them) and the device memory is given back; the host optimizer can step the block once every
//! copy of it has landed.
//!
//! A parameter's first gradient in an accumulation window is copied straight into its host
//! buffer; a later one (gradient accumulation over micro-batches) is added to it on the host, in
//! the order autograd would have added them on the device.

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
}

impl GradSink {
    pub(crate) fn new(copier: Copier, guards: GuardSlot) -> GradSink {
        GradSink {
            copier,
            inflight: Vec::new(),
            guards,
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
        for gi in 0..block.grads.len() {
            let param = block.grads[gi].param;
            let g = block.vars[param].grad();
            if !g.defined() {
                continue;
            }
            self.guards.observe_gradient(Some(id), &g);
            let g = if g.is_contiguous() { g } else { g.f_contiguous()? };
            let bytes = crate::torch::tensor_bytes(&g);
            let fresh = !block.grads[gi].received;
            if fresh {
                let buf = self.take_buffer(id, gi, block)?;
                let name = &block.spec.params[param].name;
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
            } else {
                // Accumulation: the host sum must include the copy still landing first.
                self.wait_grad(id, gi, block)?;
                let host = g.f_to_device(tch::Device::Cpu)?;
                let _ = tch::no_grad(|| block.grads[gi].view.f_add_(&host))?;
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

    /// Waits for every copy.
    pub(crate) fn wait_all(&mut self, blocks: &mut [Block]) -> Result<()> {
        for c in std::mem::take(&mut self.inflight) {
            self.land(c, blocks)?;
        }
        Ok(())
    }

    /// Copies in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Device bytes the copies in flight still hold.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.inflight.iter().map(|c| c.transfer.bytes()).sum()
    }
}
