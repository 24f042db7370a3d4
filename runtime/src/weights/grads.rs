//! The gradient sink: as soon as backward has left a trainable streamed block, its device
//! gradients leave for the host on their own copy stream (ordered after the kernels that produced
//! them) and the device memory is given back; the host optimizer can step the block once every
//! copy of it has landed.
//!
//! A parameter's first gradient in an accumulation window is copied straight into its host
//! buffer; a later one (gradient accumulation over micro-batches) is added to the sum so far:
//! on the device by default, the sum brought back from that buffer (`super::accumulate`) and
//! copied home again, or, with `host_gradient_sums`, copied to a spare buffer and added on the
//! host by a worker (`super::host_sum`).

use super::accumulate::DeviceSum;
use super::block::Block;
use super::host_sum::HostSum;
use crate::conductor::SlotToken;
use crate::device::{HostBuffer, HostPool, Order};
use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::guards::GuardSlot;
use crate::transfer::{Copier, Transfer};
use crate::weights::stepper::Ready;
use tch::Kind;

#[derive(Debug)]
struct GradCopy {
    block: BlockId,
    /// Index into the block's `grads`.
    grad: usize,
    transfer: Transfer<HostBuffer>,
    /// `None`: the copy writes the parameter's host gradient (its sum). `Some`: a later gradient
    /// of the window going to a spare buffer, to be added into the sum once landed (its dtype
    /// and elements).
    incoming: Option<(Kind, i64)>,
}

/// Gradient copies in flight.
#[derive(Debug)]
pub(crate) struct GradSink {
    copier: Copier,
    inflight: Vec<GradCopy>,
    /// The run's numeric guards, which check each gradient before it leaves.
    guards: GuardSlot,
    /// Later gradients of an accumulation window summed on the host (`Some`), or on the device.
    host: Option<HostSum>,
    sum: DeviceSum,
    /// What a `reap` met and could not report (the host sums' worker failed).
    error: Option<Error>,
    /// The most gradient bytes one block sent at once: the host sums' spare buffers are bounded
    /// by a few of them.
    largest_flush: u64,
}

/// How many of the largest block's gradients the spare buffers of host sums may hold: the
/// copies in flight and the adds queued behind the one running.
const SPARE_BLOCKS: u64 = 3;

impl GradSink {
    /// A sink copying on `copier`; `host_sum_threads`: later gradients of a window are added on
    /// the host with that many threads (`None`: on the device).
    pub(crate) fn new(copier: Copier, guards: GuardSlot, host_sum_threads: Option<usize>) -> Result<GradSink> {
        Ok(GradSink {
            sum: DeviceSum::new(copier.sibling()?),
            copier,
            inflight: Vec::new(),
            guards,
            host: host_sum_threads.map(HostSum::new),
            error: None,
            largest_flush: 0,
        })
    }

    /// Sends `block`'s device gradients to the host and frees them on the device (spare buffers
    /// for later gradients of the window are cut from `pool`). Returns the bytes that left the
    /// device.
    pub(crate) fn flush(
        &mut self,
        id: BlockId,
        block: &mut Block,
        pool: &HostPool,
        mut slot: impl FnMut() -> Option<SlotToken>,
    ) -> Result<u64> {
        self.kept_error()?;
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
                // Accumulation: the sum so far must have landed before it comes back (device
                // sums) or the worker takes it (host sums).
                self.wait_grad(id, gi, block)?;
            }
            outgoing.push((gi, g));
        }
        if self.host.is_none() {
            // Later gradients of the window first take in the sums so far, all the block's at once.
            let later = outgoing
                .iter()
                .filter(|(gi, _)| block.grads[*gi].received)
                .map(|(gi, g)| {
                    let buf = block.grads[*gi].buf.as_ref();
                    buf.map(|b| (b, g)).ok_or_else(|| Error::internal(format!("block {id}: a gradient's sum so far has no host buffer")))
                })
                .collect::<Result<Vec<(&HostBuffer, &tch::Tensor)>>>()?;
            self.sum.add_host_sums(&later, &format!("block '{}' gradients", block.spec.name))?;
        }
        self.largest_flush = self.largest_flush.max(outgoing.iter().map(|(_, g)| crate::torch::tensor_bytes(g)).sum());
        for (gi, g) in outgoing {
            let bytes = crate::torch::tensor_bytes(&g);
            let later = block.grads[gi].received && self.host.is_some();
            let buf = if later {
                self.hold_sum(id, gi, block)?;
                self.take_spare(bytes as usize, pool)?
            } else {
                self.take_buffer(id, gi, block)?
            };
            let name = &block.spec.params[block.grads[gi].param].name;
            match self.copier.d2h(buf, 0, &g, Order::AfterCompute, slot(), || format!("gradient {name}")) {
                Ok(transfer) => self.inflight.push(GradCopy {
                    block: id,
                    grad: gi,
                    transfer,
                    incoming: later.then(|| (g.kind(), g.numel() as i64)),
                }),
                Err(failed) => {
                    if later {
                        if let Some(h) = &mut self.host {
                            h.give_back((id, gi), failed.host);
                        }
                    } else {
                        block.grads[gi].buf = Some(failed.host);
                    }
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

    /// Gives `id`'s sum of gradient `gi` to the host worker for one more add (a later gradient
    /// on its way).
    fn hold_sum(&mut self, id: BlockId, gi: usize, block: &mut Block) -> Result<()> {
        let host = self.host.as_mut().ok_or_else(|| Error::internal("a host sum without its worker"))?;
        host.hold((id, gi), &mut block.grads[gi].buf)
    }

    /// A spare buffer for a later gradient of `bytes`; while the spares are at their bound, lands
    /// the oldest later gradient in flight so that its add can give one back.
    fn take_spare(&mut self, bytes: usize, pool: &HostPool) -> Result<HostBuffer> {
        let cap = SPARE_BLOCKS * self.largest_flush;
        let Some(mut host) = self.host.take() else {
            return Err(Error::internal("a host sum without its worker"));
        };
        let out = host.take_spare(bytes, cap, pool, |h| {
            let Some(i) = self.inflight.iter().position(|c| c.incoming.is_some()) else { return Ok(false) };
            let c = self.inflight.remove(i);
            let (buf, _) = self.copier.wait(c.transfer)?;
            Self::queue_add(h, (c.block, c.grad), buf, c.incoming)?;
            Ok(true)
        });
        self.host = Some(host);
        out
    }

    /// A landed later gradient: its add is queued.
    fn queue_add(host: &mut HostSum, key: (BlockId, usize), buf: HostBuffer, incoming: Option<(Kind, i64)>) -> Result<()> {
        let (kind, numel) = incoming.ok_or_else(|| Error::internal("a gradient's sum taken for an incoming one"))?;
        host.add(key, buf, kind, numel)
    }

    fn take_buffer(&mut self, id: BlockId, gi: usize, block: &mut Block) -> Result<HostBuffer> {
        if block.grads[gi].buf.is_none() {
            self.wait_grad(id, gi, block)?;
        }
        if block.grads[gi].buf.is_none() {
            if let Some(h) = &self.host {
                h.wait(|k| k == (id, gi))?;
            }
            self.take_home(Some(id), std::slice::from_mut(block), |_| 0)?;
        }
        block.grads[gi]
            .buf
            .take()
            .ok_or_else(|| Error::internal(format!("block {id}: gradient buffer {gi} is missing")))
    }

    /// Waits for the copy writing `id`'s host gradient `gi` (its sum), if one is in flight.
    fn wait_grad(&mut self, id: BlockId, gi: usize, block: &mut Block) -> Result<()> {
        if let Some(i) = self.inflight.iter().position(|c| c.block == id && c.grad == gi && c.incoming.is_none()) {
            let c = self.inflight.remove(i);
            let (buf, _) = self.copier.wait(c.transfer)?;
            block.grads[gi].buf = Some(buf);
        }
        Ok(())
    }

    /// Keeps at most `cap` device bytes of gradients in flight: completed copies first, then,
    /// while more are in flight (and more than one copy), waits for the oldest.
    pub(crate) fn bound(&mut self, blocks: &mut [Block], cap: u64) -> Result<()> {
        self.reap(blocks);
        self.kept_error()?;
        let mut held = self.in_flight_bytes();
        while self.inflight.len() > 1 && held > cap {
            let c = self.inflight.remove(0);
            held -= c.transfer.bytes();
            self.land(c, blocks, |b| b.0 as usize)?;
        }
        Ok(())
    }

    /// Waits for one copy and hands what landed on ([`landed`](Self::landed)).
    fn land(&mut self, c: GradCopy, blocks: &mut [Block], index: impl Fn(BlockId) -> usize) -> Result<()> {
        let (buf, _) = self.copier.wait(c.transfer)?;
        self.landed(c.block, c.grad, buf, c.incoming, blocks, index)
    }

    /// A copy landed: a sum goes back to its block (`blocks[index(block)]`), a later gradient
    /// to its add.
    fn landed(
        &mut self,
        id: BlockId,
        gi: usize,
        buf: HostBuffer,
        incoming: Option<(Kind, i64)>,
        blocks: &mut [Block],
        index: impl Fn(BlockId) -> usize,
    ) -> Result<()> {
        match (&mut self.host, incoming) {
            (Some(h), Some(_)) => Self::queue_add(h, (id, gi), buf, incoming),
            (None, Some(_)) => Err(Error::internal("a later gradient copied home without a host sum")),
            (_, None) => {
                if let Some(g) = blocks.get_mut(index(id)).and_then(|b| b.grads.get_mut(gi)) {
                    g.buf = Some(buf);
                }
                Ok(())
            }
        }
    }

    /// Puts the host sums whose adds are done back into their blocks (of `id`, or all).
    fn take_home(&mut self, id: Option<BlockId>, blocks: &mut [Block], index: impl Fn(BlockId) -> usize) -> Result<()> {
        let Some(h) = &mut self.host else { return Ok(()) };
        for ((b, gi), buf) in h.take_home(id)? {
            match blocks.get_mut(index(b)).and_then(|b| b.grads.get_mut(gi)) {
                Some(g) => g.buf = Some(buf),
                None => return Err(Error::internal(format!("block {b}: a host sum for a gradient it does not have"))),
            }
        }
        Ok(())
    }

    /// Returns the buffers of completed copies to their blocks, queues the adds of landed later
    /// gradients, and takes the finished sums home.
    /// An error here (the worker failed) is kept for the next call that can report it.
    pub(crate) fn reap(&mut self, blocks: &mut [Block]) {
        let inflight = std::mem::take(&mut self.inflight);
        for c in inflight {
            match self.copier.finish(c.transfer) {
                Ok((buf, _)) => {
                    if let Err(e) = self.landed(c.block, c.grad, buf, c.incoming, blocks, |b| b.0 as usize) {
                        self.error.get_or_insert(e);
                    }
                }
                Err(transfer) => self.inflight.push(GradCopy { transfer, ..c }),
            }
        }
        if let Err(e) = self.take_home(None, blocks, |b| b.0 as usize) {
            self.error.get_or_insert(e);
        }
    }

    /// The error a [`reap`](Self::reap) kept, once.
    fn kept_error(&mut self) -> Result<()> {
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What `id`'s host gradients wait for: its copies in flight, and the host adds of its later
    /// gradients (a later gradient's copy lands first, and its add is queued when a `reap`
    /// or a wait finds it landed).
    pub(crate) fn ready(&self, id: BlockId) -> Vec<Ready> {
        let copies = self.inflight.iter().filter(|c| c.block == id).map(|c| Ready::Copy(c.transfer.done().clone()));
        let adds = self.host.as_ref().and_then(|h| h.adds_done(id)).map(Ready::Adds);
        copies.chain(adds).collect()
    }

    /// Bytes of gradient sums brought back to the device for accumulation since the last call.
    pub(crate) fn take_sum_bytes(&mut self) -> u64 {
        self.sum.take_read_bytes()
    }

    /// Time the host's adds took and the gradient bytes they added since the last call.
    pub(crate) fn take_host_work(&self) -> (std::time::Duration, u64) {
        self.host.as_ref().map_or((std::time::Duration::ZERO, 0), HostSum::take_work)
    }

    /// Waits for every copy of `block` and the adds of its later gradients.
    pub(crate) fn wait_block(&mut self, id: BlockId, block: &mut Block) -> Result<()> {
        self.kept_error()?;
        while let Some(i) = self.inflight.iter().position(|c| c.block == id) {
            let c = self.inflight.remove(i);
            self.land(c, std::slice::from_mut(block), |_| 0)?;
        }
        if let Some(h) = &self.host {
            h.wait(|k| k.0 == id)?;
        }
        self.take_home(Some(id), std::slice::from_mut(block), |_| 0)
    }

    /// Waits for every copy, the reads of sums so far before them (device sums) and the adds of
    /// later gradients (host sums).
    pub(crate) fn wait_all(&mut self, blocks: &mut [Block]) -> Result<()> {
        self.kept_error()?;
        for c in std::mem::take(&mut self.inflight) {
            self.land(c, blocks, |b| b.0 as usize)?;
        }
        if let Some(h) = &self.host {
            h.wait(|_| true)?;
        }
        self.take_home(None, blocks, |b| b.0 as usize)?;
        self.sum.wait_all()
    }

    /// Gives the host sums' spare buffers back to the pool (the runtime shuts down).
    pub(crate) fn release_spares(&mut self) {
        if let Some(h) = &mut self.host {
            h.release_spares();
        }
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
