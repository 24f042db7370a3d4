//! Bringing spilled tensors back: on demand in unpack (a stall, counted and timed), and ahead of
//! need by the predictive restorer.
//!
//! Backward needs saved tensors in about the reverse of the order forward saved them, so when
//! unpack serves record `i`, the restorer issues restores for the next spilled records below `i`
//! (up to the lookahead), within the in-flight cap and a device allowance, so they are on the
//! device when their unpack comes. A restore's destination is a fresh allocator tensor, so the
//! copy is ordered after the compute stream, and the compute stream waits on the copy's event
//! (measured) before the tensor is handed to autograd.

use super::ctx::Ctx;
use super::record::{RecordState, Records};
use super::sizing::SizeProfile;
use crate::conductor::{ReservationRequest, SlotToken};
use crate::device::{Device, Order, WaitProbe};
use crate::error::{Error, Result};
use crate::events::{Bus, Direction, EventKind, Owner, Priority, ReservationMode, Resource};
use crate::transfer::Copier;
use std::collections::VecDeque;
use std::time::Instant;
use tch::Tensor;

/// How far below the served record the restorer looks for spilled ones (bounds the work per
/// unpack when long runs of kept records sit between spills).
const SCAN_LIMIT: usize = 512;

/// Limits of one round of prediction.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ahead {
    /// Spilled tensors to restore ahead.
    pub lookahead: usize,
    /// Restores in flight at most.
    pub cap: usize,
    /// Device bytes restores ahead of need may hold.
    pub allowance: u64,
}

/// What restoring did in one call, for the step's metrics.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Restored {
    pub count: u64,
    pub bytes: u64,
    pub stall_ms: f64,
    pub stalls: u64,
}

impl std::ops::AddAssign for Restored {
    fn add_assign(&mut self, o: Restored) {
        self.count += o.count;
        self.bytes += o.bytes;
        self.stall_ms += o.stall_ms;
        self.stalls += o.stalls;
    }
}

/// The H2D stream and the records restoring on it, oldest first.
#[derive(Debug)]
pub(super) struct Restorer {
    copier: Copier,
    inflight: VecDeque<usize>,
    /// Device bytes held by restores issued ahead of need and not yet unpacked.
    predicted_bytes: u64,
    /// The compute stream's waits for restores it needed before they landed.
    probes: Vec<WaitProbe>,
    /// Restores whose bytes were checked against their spill's checksum.
    pub(super) verified: u64,
}

impl Restorer {
    pub(super) fn new(device: &Device, bus: Bus) -> Result<Restorer> {
        Ok(Restorer {
            copier: Copier::new(device, bus, Owner::Activations)?,
            inflight: VecDeque::new(),
            predicted_bytes: 0,
            verified: 0,
            probes: Vec::new(),
        })
    }

    /// A new step: nothing predicted.
    pub(super) fn reset(&mut self) {
        self.predicted_bytes = 0;
    }

    /// The compute stream's waits for restores so far, in ms, as far as they can be read now.
    pub(super) fn take_wait_ms(&mut self) -> f64 {
        let mut total = 0.0;
        self.probes.retain(|p| match p.stall_ms() {
            Some(ms) => {
                total += ms;
                false
            }
            None => true,
        });
        total
    }

    /// Starts the H2D copy of a spilled record into a new device tensor.
    pub(super) fn issue(
        &mut self,
        records: &mut Records,
        idx: usize,
        predicted: bool,
        slot: Option<SlotToken>,
        ctx: &Ctx<'_>,
    ) -> Result<()> {
        let rec = records.get_mut(idx).ok_or_else(|| Error::internal(format!("saved tensor record {idx} is gone")))?;
        // Checked before anything changes: a refused restore leaves the record spilled.
        if let (Some(spilled), Some(host)) = (rec.crc, rec.host.as_ref()) {
            let found = crc32c::crc32c(host.as_slice());
            self.verified += 1;
            if found != spilled {
                let e = Error::SpillCorrupted {
                    tensor: rec.id,
                    region: rec.region.clone(),
                    spilled,
                    found,
                };
                ctx.bus.publish_with(|| EventKind::Warning {
                    source: Owner::Activations,
                    message: e.to_string(),
                });
                return Err(e);
            }
        }
        rec.transition(RecordState::Restoring)?;
        let meta = rec.meta.clone().ok_or_else(|| Error::internal(format!("spilled tensor {} has no metadata", rec.id)))?;
        let host = rec.host.take().ok_or_else(|| Error::internal(format!("spilled tensor {} has no host bytes", rec.id)))?;
        let started = Instant::now();
        let dst = Tensor::f_empty(&meta.sizes, (meta.kind, ctx.device.tch_device()))?;
        let id = rec.id;
        if !predicted {
            // The compute stream stalls for this copy: its duration is the stall's.
            self.copier.time_next();
        }
        let t = match self.copier.h2d(&dst, host, 0, Order::AfterCompute, slot, || format!("tensor {id}")) {
            Ok(t) => t,
            Err(failed) => {
                rec.host = Some(failed.host);
                return Err(failed.error);
            }
        };
        rec.restore = Some(t);
        rec.tensor = Some(dst);
        rec.predicted = predicted;
        rec.restored_ahead = predicted;
        rec.stall_since = (!predicted).then_some(started);
        let bytes = rec.bytes;
        rec.set_device_bytes(bytes, ctx.device);
        self.inflight.push_back(idx);
        if predicted {
            self.predicted_bytes += bytes;
        }
        Ok(())
    }

    /// Completes a restore: its copy waited for, its host bytes given up (the slab goes back to
    /// the pool with the last tensor copied into it).
    fn complete(&mut self, records: &mut Records, sizes: &mut SizeProfile, idx: usize, ctx: &Ctx<'_>) -> Result<Restored> {
        self.inflight.retain(|&i| i != idx);
        let Some(rec) = records.get_mut(idx) else { return Ok(Restored::default()) };
        let Some(t) = rec.restore.take() else { return Ok(Restored::default()) };
        let (lease, elapsed) = self.copier.wait(t)?;
        // Its host memory is free again once the last tensor copied into it is back: the pool's
        // trace counts what is held at once, not what a step spilled in all.
        if lease.is_last() {
            sizes.released(lease.requested_bytes() as u64);
        }
        drop(lease);
        rec.transition(RecordState::Restored)?;
        // A stall lasts as long as the copy the compute stream waited for (the GPU's timing); on
        // the host device copies are synchronous, so the wall clock measures it.
        let stall_ms = match rec.stall_since.take() {
            Some(_) if ctx.device.is_cuda() => elapsed.ok_or_else(|| Error::internal(format!("the stalled restore of tensor {} was not timed", rec.id)))?.max(0.0),
            Some(since) => since.elapsed().as_secs_f64() * 1e3,
            None => 0.0,
        };
        let (id, bytes, predicted) = (rec.id, rec.bytes, rec.restored_ahead);
        ctx.bus.publish_with(|| EventKind::Restored {
            tensor: id,
            bytes,
            predicted,
            stall_ms,
        });
        Ok(Restored {
            count: 1,
            bytes,
            stall_ms,
            stalls: u64::from(!predicted),
        })
    }

    /// Completes the restores whose copies finished (all of them, waiting, with `all`).
    pub(super) fn reap(&mut self, records: &mut Records, sizes: &mut SizeProfile, ctx: &Ctx<'_>, all: bool) -> Result<Restored> {
        let done: Vec<usize> = self
            .inflight
            .iter()
            .copied()
            .filter(|&i| all || records.get(i).and_then(|r| r.restore.as_ref()).is_none_or(|t| t.is_complete()))
            .collect();
        let mut out = Restored::default();
        for i in done {
            out += self.complete(records, sizes, i, ctx)?;
        }
        Ok(out)
    }

    /// The restored tensor of record `idx`, ready for the compute stream, with the saved
    /// tensor's sizes and strides.
    pub(super) fn serve(&mut self, records: &mut Records, idx: usize, ctx: &Ctx<'_>) -> Result<Tensor> {
        let rec = records.get_mut(idx).ok_or_else(|| Error::internal(format!("saved tensor record {idx} is gone")))?;
        if let Some(t) = &rec.restore {
            // The GPU waits, not the host: the CPU keeps queueing backward kernels.
            self.probes.push(ctx.device.compute_wait_timed(t.done())?);
        }
        let t = rec
            .tensor
            .as_ref()
            .ok_or_else(|| Error::internal(format!("restored tensor {} is missing", rec.id)))?
            .shallow_clone();
        let meta = rec.meta.as_ref().ok_or_else(|| Error::internal(format!("spilled tensor {} has no metadata", rec.id)))?;
        let out = if meta.contiguous {
            t
        } else {
            let mut s = Tensor::f_empty_strided(&meta.sizes, &meta.strides, (meta.kind, ctx.device.tch_device()))?;
            s.f_copy_(&t)?;
            s
        };
        rec.unpacked = true;
        if rec.predicted {
            rec.predicted = false;
            self.predicted_bytes = self.predicted_bytes.saturating_sub(rec.bytes);
        }
        Ok(out)
    }

    /// A record is going away: its prediction no longer holds device bytes.
    pub(super) fn forget(&mut self, predicted: bool, bytes: u64) {
        if predicted {
            self.predicted_bytes = self.predicted_bytes.saturating_sub(bytes);
        }
    }

    /// Issues restores for the spilled records backward will need after record `idx`, in order
    /// (skipping one to restore a later one would spend the allowance on a tensor needed after
    /// the one that would then stall). Records still spilling are finalized first by `finalize`.
    pub(super) fn predict_from(
        &mut self,
        records: &mut Records,
        idx: usize,
        ahead: Ahead,
        ctx: &Ctx<'_>,
        mut finalize: impl FnMut(&mut Records, usize) -> Result<bool>,
    ) -> Result<u64> {
        if ahead.lookahead == 0 {
            return Ok(0);
        }
        let mut issued = 0u64;
        let mut n = 0;
        for j in (idx.saturating_sub(SCAN_LIMIT)..idx).rev() {
            if n >= ahead.lookahead {
                break;
            }
            let Some(rec) = records.get(j) else { continue };
            match rec.state {
                RecordState::Spilling | RecordState::Spilled => {
                    let bytes = rec.bytes;
                    if self.inflight.len() >= ahead.cap || self.predicted_bytes + bytes > ahead.allowance {
                        break;
                    }
                    // A spill still landing ends the prediction (`finalize` says whether it
                    // could finalize without waiting).
                    if rec.state == RecordState::Spilling && !finalize(records, j)? {
                        break;
                    }
                    let priority = if n == 0 { Priority::Required } else { Priority::Speculative };
                    // Device memory for a restore ahead of need is asked of the Conductor first
                    // (released once the restore holds it, when the allocator counts it);
                    // a refusal is published by the Conductor and the next unpack tries again.
                    let ask = ReservationRequest::new(Owner::Activations, Resource::Vram, bytes)
                        .mode(ReservationMode::Hard)
                        .priority(priority);
                    let decision = ctx.conductor.reserve(ask);
                    if !decision.is_granted() {
                        break;
                    }
                    let Ok(slot) = ctx.conductor.acquire_slot(Direction::H2d, Owner::Activations, priority) else {
                        if let Some(id) = decision.id {
                            ctx.conductor.release(id);
                        }
                        break;
                    };
                    let issued_ok = self.issue(records, j, true, Some(slot), ctx);
                    if let Some(id) = decision.id {
                        ctx.conductor.release(id);
                    }
                    issued_ok?;
                    issued += 1;
                    n += 1;
                }
                RecordState::Restoring | RecordState::Restored if !rec.unpacked => n += 1,
                _ => {}
            }
        }
        Ok(issued)
    }
}
