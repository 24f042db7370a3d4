//! Bringing spilled tensors back: on demand in unpack (a stall, counted and timed), and ahead of
//! need by the predictive restorer.
//!
//! Backward needs saved tensors in about the reverse of the order forward saved them, so when
//! unpack serves record `i`, the restorer issues restores for the next spilled records below `i`
//! (up to `restore_lookahead`), within the in-flight cap and a device allowance, so they are on
//! the device when their unpack comes. A restore's destination is a fresh allocator tensor, so
//! the copy is ordered after the compute stream (rule (b) of design.md section 4) and the compute
//! stream waits on the copy's event before the tensor is handed to autograd.
//!
//! Under a Conductor every restore takes an H2D slot: on demand and for the first spilled
//! tensor ahead (needed for certain, just early) with REQUIRED priority, further ahead with
//! SPECULATIVE priority; a refused one ends this round of prediction. The knobs bound the
//! prediction: `prefetch_window` tensors ahead (1 while `suppress_speculative`), at most
//! `max_inflight_h2d` restores in flight.

use super::record::RecordState;
use super::runtime::{Inner, Shared};
use super::transfer::transfer_id;
use crate::conductor::SlotToken;
use crate::error::{Error, Result};
use crate::events::{Direction, EventKind, Owner, Priority};
use std::time::{Duration, Instant};
use tch::Tensor;

/// How far below the served record the restorer looks for spilled ones (bounds the work per
/// unpack when long runs of kept records sit between spills).
const SCAN_LIMIT: usize = 512;

impl Shared {
    /// Starts the H2D copy of a spilled record into a new device tensor, holding `slot` (the
    /// Conductor's, if any) until the copy completes.
    pub(super) fn issue_restore(
        &self,
        g: &mut Inner,
        idx: usize,
        predicted: bool,
        slot: Option<SlotToken>,
    ) -> Result<()> {
        let Inner {
            records,
            pool,
            transfers,
            ..
        } = g;
        let rec = records
            .get_mut(idx)
            .ok_or_else(|| Error::State(format!("saved tensor record {idx} is gone")))?;
        rec.transition(RecordState::Restoring)?;
        let meta = rec
            .meta
            .clone()
            .ok_or_else(|| Error::State(format!("spilled tensor {} has no metadata", rec.id)))?;
        let lease = rec
            .lease
            .as_ref()
            .ok_or_else(|| Error::State(format!("spilled tensor {} has no host buffer", rec.id)))?;
        let (buf, off) = pool.buffer(lease)?;
        if let Some(expected) = rec.crc {
            let range = buf.range(off, rec.bytes as usize)?;
            let found = crc32fast::hash(&buf.as_slice()[range]);
            if found != expected {
                let msg = format!(
                    "checksum mismatch restoring saved tensor {}: spilled {expected:08x}, host buffer now {found:08x}",
                    rec.id
                );
                self.telemetry.publish_with(|| EventKind::Warning {
                    source: Owner::Activations,
                    message: msg.clone(),
                });
                return Err(Error::State(msg));
            }
        }
        let started = Instant::now();
        let dst = Tensor::f_empty(&meta.sizes, (meta.kind, self.device.tch_device()))?;
        let pending = transfers.h2d.h2d(&dst, buf, off, None)?;
        rec.tensor = Some(dst);
        rec.copy = Some(pending);
        rec.slot = slot;
        rec.predicted = predicted;
        rec.restored_ahead = predicted;
        rec.stall_since = (!predicted).then_some(started);
        let (id, bytes) = (rec.id, rec.bytes);
        self.set_device_bytes(rec, bytes);
        transfers.inflight_h2d.push_back(idx);
        if predicted {
            g.predicted_bytes += bytes;
            g.metrics.activations_predicted += 1;
        } else {
            g.metrics.stall_count += 1;
        }
        self.telemetry.publish_with(|| EventKind::TransferIssued {
            id: transfer_id(id.0, Direction::H2d),
            dir: Direction::H2d,
            owner: Owner::Activations,
            bytes,
            subject: format!("tensor {id}"),
        });
        Ok(())
    }

    /// Completes a restore: its copy done, its host buffer back to the pool.
    pub(super) fn complete_restore(&self, g: &mut Inner, idx: usize) -> Result<()> {
        g.transfers.inflight_h2d.retain(|&i| i != idx);
        let Inner { records, pool, .. } = g;
        let Some(rec) = records.get_mut(idx) else {
            return Ok(());
        };
        if rec.state != RecordState::Restoring {
            return Ok(());
        }
        let elapsed = match rec.copy.take() {
            Some(p) => {
                let ms = p.elapsed_ms();
                p.wait()?;
                ms
            }
            None => 0.0,
        };
        if let Some(slot) = rec.slot.take() {
            slot.complete(rec.bytes, Duration::from_secs_f64(elapsed.max(0.0) / 1e3));
        }
        rec.transition(RecordState::Restored)?;
        if let Some(lease) = rec.lease.take() {
            pool.release(lease);
        }
        // A stall lasts as long as the copy the compute stream waited for (the GPU's event
        // timing); on the host device copies are synchronous, so the wall clock measures it.
        let stall_ms = match rec.stall_since.take() {
            Some(_) if self.device.is_cuda() => elapsed.max(0.0),
            Some(since) => since.elapsed().as_secs_f64() * 1e3,
            None => 0.0,
        };
        let (id, bytes, predicted) = (rec.id, rec.bytes, rec.restored_ahead);
        g.metrics.activations_restored += 1;
        g.metrics.restore_bytes += bytes;
        g.metrics.stall_time_ms += stall_ms;
        self.telemetry.publish_with(|| EventKind::TransferCompleted {
            id: transfer_id(id.0, Direction::H2d),
            dir: Direction::H2d,
            owner: Owner::Activations,
            bytes,
            duration_ms: elapsed,
        });
        self.telemetry.publish_with(|| EventKind::Restored {
            tensor: id,
            bytes,
            predicted,
            stall_ms,
        });
        Ok(())
    }

    /// Completes the restores whose copies finished (all of them, waiting, with `wait_all`).
    pub(super) fn reap_restores(&self, g: &mut Inner, wait_all: bool) -> Result<()> {
        let done: Vec<usize> = g
            .transfers
            .inflight_h2d
            .iter()
            .copied()
            .filter(|&i| {
                wait_all
                    || g.records
                        .get(i)
                        .and_then(|r| r.copy.as_ref())
                        .is_none_or(|p| p.is_complete())
            })
            .collect();
        for i in done {
            self.complete_restore(g, i)?;
        }
        Ok(())
    }

    /// The restored tensor of record `idx`, ready for the compute stream, with the saved
    /// tensor's sizes and strides.
    pub(super) fn serve_restored(&self, g: &mut Inner, idx: usize) -> Result<Tensor> {
        let rec = g
            .records
            .get_mut(idx)
            .ok_or_else(|| Error::State(format!("saved tensor record {idx} is gone")))?;
        if let Some(p) = &rec.copy {
            // The GPU waits, not the host: the CPU keeps queueing backward kernels.
            self.device.compute_wait(&p.done)?;
        }
        let t = rec
            .tensor
            .as_ref()
            .ok_or_else(|| Error::State(format!("restored tensor {} is missing", rec.id)))?
            .shallow_clone();
        let meta = rec
            .meta
            .as_ref()
            .ok_or_else(|| Error::State(format!("spilled tensor {} has no metadata", rec.id)))?;
        let out = if meta.contiguous {
            t
        } else {
            let mut s = Tensor::f_empty_strided(&meta.sizes, &meta.strides, (meta.kind, self.device.tch_device()))?;
            s.f_copy_(&t)?;
            s
        };
        rec.unpacked = true;
        if rec.predicted {
            rec.predicted = false;
            g.predicted_bytes = g.predicted_bytes.saturating_sub(rec.bytes);
        }
        Ok(out)
    }

    /// Issues restores for the spilled records backward will need after record `idx`.
    pub(super) fn predict_from(&self, g: &mut Inner, idx: usize) -> Result<()> {
        let mut lookahead = self.knobs.prefetch_window() as usize;
        if self.knobs.suppress_speculative() {
            lookahead = lookahead.min(1);
        }
        if lookahead == 0 {
            return Ok(());
        }
        self.reap_restores(g, false)?;
        let cap = self.knobs.max_inflight_h2d() as usize;
        let mut ahead = 0;
        for j in (idx.saturating_sub(SCAN_LIMIT)..idx).rev() {
            if ahead >= lookahead {
                break;
            }
            let Some(rec) = g.records.get(j) else { continue };
            match rec.state {
                RecordState::Spilling | RecordState::Spilled => {
                    let bytes = rec.bytes;
                    // In order or not at all: skipping one to restore a later one would
                    // spend the allowance on a tensor needed after the one that will stall.
                    if g.transfers.inflight_h2d.len() >= cap
                        || g.predicted_bytes + bytes > self.config.restore_allowance_bytes
                    {
                        break;
                    }
                    let state = rec.state;
                    let priority = if ahead == 0 { Priority::Required } else { Priority::Speculative };
                    // A refusal is published by the Conductor; the next unpack tries again.
                    let Ok(slot) = g.conductor.acquire_slot(Direction::H2d, Owner::Activations, priority) else {
                        break;
                    };
                    if state == RecordState::Spilling {
                        self.finalize_spill(g, j, false)?;
                    }
                    self.issue_restore(g, j, true, Some(slot))?;
                    ahead += 1;
                }
                RecordState::Restoring | RecordState::Restored if !rec.unpacked => ahead += 1,
                _ => {}
            }
        }
        Ok(())
    }
}

