//! Spills in flight. A spill source is a tensor from libtorch's allocator, so its D2H copy is
//! ordered after the compute stream and the tensor is held (by the copy) until the copy has
//! completed; only then is its device memory given back.
//!
//! The training thread never waits for a spill in the steady state: completed copies are
//! finalized whenever the runtime looks (every pack, every unpack), and it waits only when more
//! copies (or bytes) are in flight than the knobs allow (the oldest first), when backward needs a
//! tensor whose spill is still landing, and at the step's end. Each wait is measured as the
//! compute stream's idle time during it ([`crate::device::idle`]): that, not the host's wait, is
//! what the step loses.

use super::record::{RecordState, Records};
use crate::conductor::SlotToken;
use crate::device::{Device, IdleSpan, Order};
use crate::error::{Error, Result};
use crate::events::{Bus, EventKind, TensorId};
use crate::pinned::Lease;
use crate::transfer::Copier;
use std::collections::VecDeque;
use tch::Tensor;

/// What finalizing spills did.
#[derive(Debug, Default)]
pub(super) struct Finalized {
    pub count: u64,
    /// The host's waits for copies, whose cost is the compute stream's idle time during them.
    pub waits: Vec<IdleSpan>,
}

/// The D2H stream and the records spilling on it, oldest first.
#[derive(Debug)]
pub(super) struct SpillQueue {
    copier: Copier,
    inflight: VecDeque<usize>,
    checksums: bool,
}

impl SpillQueue {
    pub(super) fn new(device: &Device, bus: Bus, checksums: bool) -> Result<SpillQueue> {
        Ok(SpillQueue {
            copier: Copier::new(device, bus, crate::events::Owner::Activations)?,
            inflight: VecDeque::new(),
            checksums,
        })
    }

    /// Starts the copy of `src` (contiguous) into `lease` for record `idx`.
    pub(super) fn start(
        &mut self,
        records: &mut Records,
        idx: usize,
        lease: Lease,
        src: &Tensor,
        slot: Option<SlotToken>,
    ) -> Result<()> {
        let rec = records.get_mut(idx).ok_or_else(|| Error::internal(format!("record {idx} is gone")))?;
        let id = rec.id;
        let t = self
            .copier
            .d2h(lease, 0, src, Order::AfterCompute, slot, || format!("tensor {id}"))
            .map_err(Error::from)?;
        rec.spill = Some(t);
        self.inflight.push_back(idx);
        Ok(())
    }

    /// Finalizes the spills whose copies completed, oldest first; then, while more than `cap`
    /// are in flight or they hold more than `cap_bytes`, waits for the oldest.
    pub(super) fn poll(
        &mut self,
        records: &mut Records,
        device: &Device,
        bus: &Bus,
        cap: usize,
        cap_bytes: u64,
    ) -> Result<Finalized> {
        let mut done = Finalized::default();
        // The copies run in order on one stream: the first still in flight ends the look (a
        // query per copy in flight at every pack cost more host time than the copies' issue).
        while let Some(&idx) = self.inflight.front() {
            let complete = records
                .get(idx)
                .and_then(|r| r.spill.as_ref())
                .is_none_or(|t| t.is_complete());
            if !complete {
                break;
            }
            self.inflight.pop_front();
            self.finalize_one(records, idx, device, bus, false)?;
            done.count += 1;
        }
        let mut held: u64 = self.inflight.iter().filter_map(|&i| records.get(i)).map(|r| r.bytes).sum();
        while self.inflight.len() > cap || (self.inflight.len() > 1 && held > cap_bytes) {
            let Some(idx) = self.inflight.pop_front() else { break };
            held = held.saturating_sub(records.get(idx).map_or(0, |r| r.bytes));
            let probe = device.idle_probe()?;
            self.finalize_one(records, idx, device, bus, true)?;
            done.waits.push(probe.end(device)?);
            done.count += 1;
        }
        Ok(done)
    }

    /// Waits for every spill in flight (backward begins, or the step ends).
    pub(super) fn drain(&mut self, records: &mut Records, device: &Device, bus: &Bus) -> Result<Finalized> {
        let mut done = Finalized::default();
        if self.inflight.is_empty() {
            return Ok(done);
        }
        let probe = device.idle_probe()?;
        while let Some(idx) = self.inflight.pop_front() {
            self.finalize_one(records, idx, device, bus, true)?;
            done.count += 1;
        }
        done.waits.push(probe.end(device)?);
        Ok(done)
    }

    /// Waits for one record's spill (its unpack came before the spill was seen complete).
    pub(super) fn finalize(&mut self, records: &mut Records, idx: usize, device: &Device, bus: &Bus) -> Result<IdleSpan> {
        self.inflight.retain(|&i| i != idx);
        let probe = device.idle_probe()?;
        self.finalize_one(records, idx, device, bus, true)?;
        probe.end(device)
    }

    /// Finalizes one record's spill if its copy has landed; false (nothing done) while it is
    /// still in flight.
    pub(super) fn finalize_if_landed(&mut self, records: &mut Records, idx: usize, device: &Device, bus: &Bus) -> Result<bool> {
        let landed = records.get(idx).and_then(|r| r.spill.as_ref()).is_none_or(|t| t.is_complete());
        if landed {
            self.inflight.retain(|&i| i != idx);
            self.finalize_one(records, idx, device, bus, false)?;
        }
        Ok(landed)
    }

    fn finalize_one(&self, records: &mut Records, idx: usize, device: &Device, bus: &Bus, inline: bool) -> Result<()> {
        let Some(rec) = records.get_mut(idx) else { return Ok(()) };
        let Some(t) = rec.spill.take() else { return Ok(()) };
        // Waiting returns the lease once the copy has read the whole tensor: only then may the
        // device memory go back to the allocator (the copy held it until now).
        let (lease, _ms) = self.copier.wait(t)?;
        if self.checksums {
            rec.crc = Some(crc32c::crc32c(&lease.as_slice()[..rec.bytes as usize]));
        }
        rec.host = Some(lease);
        rec.set_device_bytes(0, device);
        rec.transition(RecordState::Spilled)?;
        let (id, bytes): (TensorId, u64) = (rec.id, rec.bytes);
        bus.publish_with(|| EventKind::SpillFinalized { tensor: id, bytes, inline });
        Ok(())
    }
}
