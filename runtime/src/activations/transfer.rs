//! Spill copies in flight, their cap, and inline finalize.
//!
//! A spill source is a tensor from libtorch's allocator, so it follows rule (b) of design.md
//! section 4: the D2H copy is ordered after the compute stream, and the tensor is held until
//! the copy completed. Finalizing a spill (drop the device tensor, checksum the bytes) happens
//! when the cap is reached, inline in pack: completed copies first, else the oldest is waited
//! for, so the cap bounds the copies in flight but never stops spilling under pressure.
//!
//! The cap is the `max_inflight_d2h` knob, shared with the Conductor's adapter and read at
//! every decision; 0 pauses spilling (pack keeps tensors, reason `spills_paused`). Each spill
//! takes a REQUIRED D2H slot from the Conductor and gives it back as soon as its copy is seen
//! complete, which may be long before the spill is finalized.

use super::record::RecordState;
use super::runtime::{Inner, Shared};
use crate::device::CopyStream;
use crate::error::{Error, Result};
use crate::events::{Direction, EventKind, Owner, TransferId};
use std::collections::VecDeque;
use std::time::Duration;

/// The two copy streams and what is in flight on them (record indices, oldest first).
#[derive(Debug)]
pub(super) struct Transfers {
    pub d2h: CopyStream,
    pub h2d: CopyStream,
    pub inflight_d2h: VecDeque<usize>,
    pub inflight_h2d: VecDeque<usize>,
}

/// Transfer ids derived from the tensor id: unique within a run, no extra counter.
pub(super) fn transfer_id(tensor: u64, dir: Direction) -> TransferId {
    TransferId(tensor * 2 + u64::from(dir == Direction::H2d))
}

/// Gives back the slot of a copy once it is seen complete (or was never tracked).
pub(super) fn release_slot_if_done(rec: &mut super::record::Record) {
    let done = rec.copy.as_ref().is_none_or(|p| p.is_complete());
    if done {
        if let Some(slot) = rec.slot.take() {
            let ms = rec.copy.as_ref().map_or(0.0, |p| p.elapsed_ms()).max(0.0);
            slot.complete(rec.bytes, Duration::from_secs_f64(ms / 1e3));
        }
    }
}

impl Shared {
    /// Whether pack may start spills (the `max_inflight_d2h` knob is not 0).
    pub(super) fn spills_paused(&self) -> bool {
        self.knobs.max_inflight_d2h() == 0
    }

    /// Gives back the slots of spills whose copies completed, then, at the cap, finalizes
    /// completed spills, or waits for the oldest when none completed.
    pub(super) fn make_room_d2h(&self, g: &mut Inner) -> Result<()> {
        for &i in &g.transfers.inflight_d2h {
            if let Some(rec) = g.records.get_mut(i) {
                release_slot_if_done(rec);
            }
        }
        let cap = self.knobs.max_inflight_d2h().max(1) as usize;
        if g.transfers.inflight_d2h.len() < cap {
            return Ok(());
        }
        let done: Vec<usize> = g
            .transfers
            .inflight_d2h
            .iter()
            .copied()
            .filter(|&i| {
                g.records
                    .get(i)
                    .and_then(|r| r.copy.as_ref())
                    .is_none_or(|p| p.is_complete())
            })
            .collect();
        if done.is_empty() {
            if let Some(&oldest) = g.transfers.inflight_d2h.front() {
                self.finalize_spill(g, oldest, true)?;
            }
        } else {
            for i in done {
                self.finalize_spill(g, i, true)?;
            }
        }
        Ok(())
    }

    /// Waits for a spill's copy, drops the device tensor and records its checksum.
    pub(super) fn finalize_spill(&self, g: &mut Inner, idx: usize, inline: bool) -> Result<()> {
        g.transfers.inflight_d2h.retain(|&i| i != idx);
        let Inner { records, pool, .. } = g;
        let Some(rec) = records.get_mut(idx) else {
            return Ok(());
        };
        if rec.state != RecordState::Spilling {
            return Ok(());
        }
        let (elapsed, bytes, id) = match rec.copy.take() {
            Some(p) => {
                let ms = p.elapsed_ms();
                p.wait()?;
                (ms, rec.bytes, rec.id)
            }
            None => (0.0, rec.bytes, rec.id),
        };
        if let Some(slot) = rec.slot.take() {
            slot.complete(bytes, Duration::from_secs_f64(elapsed.max(0.0) / 1e3));
        }
        // Only now may the device memory go back to the allocator: the copy has read it.
        rec.tensor = None;
        self.set_device_bytes(rec, 0);
        if self.config.debug_checksums {
            let lease = rec
                .lease
                .as_ref()
                .ok_or_else(|| Error::State(format!("spilled tensor {id} has no host buffer")))?;
            let (buf, off) = pool.buffer(lease)?;
            let range = buf.range(off, bytes as usize)?;
            rec.crc = Some(crc32fast::hash(&buf.as_slice()[range]));
        }
        rec.transition(RecordState::Spilled)?;
        // The storage is no longer held, so its address may be reused by another tensor.
        records.forget_identity(idx);
        self.telemetry
            .publish_with(|| EventKind::SpillFinalized { tensor: id, bytes, inline });
        self.telemetry.publish_with(|| EventKind::TransferCompleted {
            id: transfer_id(id.0, Direction::D2h),
            dir: Direction::D2h,
            owner: Owner::Activations,
            bytes,
            duration_ms: elapsed,
        });
        Ok(())
    }

    /// Finalizes every spill in flight (backward begins, or the step ends).
    pub(super) fn finalize_all_spills(&self, g: &mut Inner) -> Result<()> {
        while let Some(&idx) = g.transfers.inflight_d2h.front() {
            self.finalize_spill(g, idx, false)?;
        }
        Ok(())
    }
}
