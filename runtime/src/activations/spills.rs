//! Spills in flight. A spill source is a tensor from libtorch's allocator, so its D2H copy is
//! ordered after the compute stream and the tensor is held (by the copy) until the copy has
//! completed; only then is its device memory given back.
//!
//! Small tensors are not copied one by one: each copy costs the copy engine a fixed few
//! microseconds, a quarter of a 1 MiB copy's time. They gather in the open batch of their region
//! ([`Gathering`]), held on the device, until the region changes, the batch is full, or backward
//! begins; then one kernel gathers them into one device buffer and one copy moves it into one
//! slab, each tensor's bytes at its offset ([`LeasePart`]).
//!
//! The training thread never waits for a spill in the steady state: completed copies are
//! finalized whenever the runtime looks (every pack, every unpack), and it waits only when more
//! copies (or bytes) are in flight than the knobs allow (the oldest first), when backward needs a
//! tensor whose spill is still landing, and at the step's end. Each wait is measured as the
//! compute stream's idle time during it ([`crate::device::idle`]): that, not the host's wait, is
//! what the step loses.

use super::record::{RecordState, Records};
use crate::conductor::SlotToken;
use super::ctx::Ctx;
use crate::device::{Device, IdleSpan, Order};
use crate::error::{Error, Result};
use crate::events::{Bus, EventKind, TensorId};
use crate::pinned::{Lease, LeasePart};
use crate::transfer::{Copier, Transfer};
use std::collections::VecDeque;
use std::sync::Arc;
use tch::Tensor;

/// What finalizing spills did.
#[derive(Debug, Default)]
pub(super) struct Finalized {
    pub count: u64,
    /// The host's waits for copies, whose cost is the compute stream's idle time during them.
    pub waits: Vec<IdleSpan>,
}

/// One spill copy in flight: one tensor's, or a batch's.
#[derive(Debug)]
struct Flight {
    transfer: Transfer<Lease>,
    /// The records it carries, each with its bytes' offset in the slab.
    members: Vec<(usize, usize)>,
}

impl Flight {
    fn carries(&self, idx: usize) -> bool {
        self.members.iter().any(|&(i, _)| i == idx)
    }
}

/// The open batch: small tensors of one region waiting to be copied together.
#[derive(Debug, Default)]
pub(super) struct Gathering {
    /// Their records, in pack order.
    pub members: Vec<usize>,
    pub bytes: u64,
    pub region: Option<String>,
}

/// The D2H stream, the open batch, and the copies in flight on the stream, oldest first.
#[derive(Debug)]
pub(super) struct SpillQueue {
    copier: Copier,
    inflight: VecDeque<Flight>,
    gathering: Option<Gathering>,
    checksums: bool,
    /// Spills whose bytes were checksummed once they landed.
    pub(super) checksummed: std::sync::atomic::AtomicU64,
}

impl SpillQueue {
    pub(super) fn new(device: &Device, bus: Bus, checksums: bool) -> Result<SpillQueue> {
        Ok(SpillQueue {
            copier: Copier::new(device, bus, crate::events::Owner::Activations)?,
            inflight: VecDeque::new(),
            gathering: None,
            checksums,
            checksummed: Default::default(),
        })
    }

    /// Starts the copy of `src` (contiguous) into `lease` for record `idx`.
    pub(super) fn start(
        &mut self,
        records: &Records,
        idx: usize,
        lease: Lease,
        src: &Tensor,
        slot: Option<SlotToken>,
    ) -> Result<()> {
        let id = records.get(idx).ok_or_else(|| Error::internal(format!("record {idx} is gone")))?.id;
        self.launch(vec![(idx, 0)], lease, src, slot, || format!("tensor {id}"))
    }

    /// Starts the copy of a batch gathered into `src` (contiguous bytes) into `lease`; `members`
    /// are its records with their offsets in `src`.
    pub(super) fn start_batch(
        &mut self,
        members: Vec<(usize, usize)>,
        lease: Lease,
        src: &Tensor,
        slot: Option<SlotToken>,
        region: Option<&str>,
    ) -> Result<()> {
        let n = members.len();
        self.launch(members, lease, src, slot, || match region {
            Some(r) => format!("batch of {n} tensors of {r}"),
            None => format!("batch of {n} tensors"),
        })
    }

    /// Issues one copy of `src` into `lease`, after the compute stream's work so far, carrying
    /// `members`.
    fn launch(
        &mut self,
        members: Vec<(usize, usize)>,
        lease: Lease,
        src: &Tensor,
        slot: Option<SlotToken>,
        subject: impl FnOnce() -> String,
    ) -> Result<()> {
        let transfer = self.copier.d2h(lease, 0, src, Order::AfterCompute, slot, subject).map_err(Error::from)?;
        self.inflight.push_back(Flight { transfer, members });
        Ok(())
    }

    /// Whether the open batch can take `bytes` more of `region` within `max_bytes` (true when
    /// none is open).
    pub(super) fn admits(&self, region: Option<&str>, bytes: u64, max_bytes: u64) -> bool {
        self.gathering
            .as_ref()
            .is_none_or(|g| g.region.as_deref() == region && g.bytes.saturating_add(bytes) <= max_bytes)
    }

    /// Adds record `idx` to the open batch (opening one for `region`).
    pub(super) fn gather(&mut self, idx: usize, bytes: u64, region: Option<String>) {
        let g = self.gathering.get_or_insert_with(|| Gathering {
            region,
            ..Gathering::default()
        });
        g.members.push(idx);
        g.bytes += bytes;
    }

    /// Closes the open batch, to be copied.
    pub(super) fn close_batch(&mut self) -> Option<Gathering> {
        self.gathering.take()
    }

    /// Takes record `idx` (of `bytes`) out of the open batch: it was released before its copy.
    pub(super) fn leave_batch(&mut self, idx: usize, bytes: u64) {
        if let Some(g) = &mut self.gathering {
            g.members.retain(|&i| i != idx);
            g.bytes = g.bytes.saturating_sub(bytes);
            if g.members.is_empty() {
                self.gathering = None;
            }
        }
    }

    /// Finalizes the spills whose copies completed, oldest first; then, while more than `cap`
    /// are in flight or they hold more than `cap_bytes`, waits for the oldest.
    pub(super) fn poll(
        &mut self,
        records: &mut Records,
        ctx: &Ctx<'_>,
        cap: usize,
        cap_bytes: u64,
    ) -> Result<Finalized> {
        let mut done = Finalized::default();
        // The copies run in order on one stream: the first still in flight ends the look (a
        // query per copy in flight at every pack cost more host time than the copies' issue).
        while self.inflight.front().is_some_and(|f| f.transfer.is_complete()) {
            let Some(f) = self.inflight.pop_front() else { break };
            done.count += self.finalize_flight(records, f, ctx, false)?;
        }
        let mut held: u64 = self.inflight.iter().map(|f| f.transfer.bytes()).sum();
        while self.inflight.len() > cap || (self.inflight.len() > 1 && held > cap_bytes) {
            let Some(f) = self.inflight.pop_front() else { break };
            held = held.saturating_sub(f.transfer.bytes());
            let probe = ctx.device.idle_probe()?;
            done.count += self.finalize_flight(records, f, ctx, true)?;
            done.waits.push(probe.end(ctx.device)?);
        }
        Ok(done)
    }

    /// Waits for every spill in flight (backward begins, or the step ends).
    pub(super) fn drain(&mut self, records: &mut Records, ctx: &Ctx<'_>) -> Result<Finalized> {
        let mut done = Finalized::default();
        if self.inflight.is_empty() {
            return Ok(done);
        }
        let probe = ctx.device.idle_probe()?;
        while let Some(f) = self.inflight.pop_front() {
            done.count += self.finalize_flight(records, f, ctx, true)?;
        }
        done.waits.push(probe.end(ctx.device)?);
        Ok(done)
    }

    /// Waits for the copy carrying record `idx` (its unpack came before the spill was seen
    /// complete, or it is released).
    pub(super) fn finalize(&mut self, records: &mut Records, idx: usize, ctx: &Ctx<'_>) -> Result<IdleSpan> {
        let probe = ctx.device.idle_probe()?;
        if let Some(pos) = self.inflight.iter().position(|f| f.carries(idx)) {
            if let Some(f) = self.inflight.remove(pos) {
                self.finalize_flight(records, f, ctx, true)?;
            }
        }
        probe.end(ctx.device)
    }

    /// Finalizes the copy carrying record `idx` if it has landed; false (nothing done) while it
    /// is still in flight.
    pub(super) fn finalize_if_landed(&mut self, records: &mut Records, idx: usize, ctx: &Ctx<'_>) -> Result<bool> {
        let Some(pos) = self.inflight.iter().position(|f| f.carries(idx)) else { return Ok(true) };
        if !self.inflight[pos].transfer.is_complete() {
            return Ok(false);
        }
        if let Some(f) = self.inflight.remove(pos) {
            self.finalize_flight(records, f, ctx, false)?;
        }
        Ok(true)
    }

    /// Waits for a copy and hands each record it carries its bytes on the host; returns how many.
    fn finalize_flight(&self, records: &mut Records, f: Flight, ctx: &Ctx<'_>, inline: bool) -> Result<u64> {
        // Waiting returns the lease once the copy has read the whole source: only then may the
        // device memory go back to the allocator (the copy held it until now).
        let (lease, _ms) = self.copier.wait(f.transfer)?;
        let lease = Arc::new(lease);
        let mut count = 0;
        for (idx, offset) in f.members {
            let Some(rec) = records.get_mut(idx) else { continue };
            let part = LeasePart::new(lease.clone(), offset, rec.bytes as usize)?;
            if self.checksums {
                rec.crc = Some(crc32c::crc32c(part.as_slice()));
                self.checksummed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            rec.host = Some(part);
            rec.set_device_bytes(0, ctx.device);
            rec.transition(RecordState::Spilled)?;
            let (id, bytes): (TensorId, u64) = (rec.id, rec.bytes);
            ctx.bus.publish_with(|| EventKind::SpillFinalized { tensor: id, bytes, inline });
            count += 1;
        }
        Ok(count)
    }
}
