//! Spill copies in flight, their cap, and inline finalize.
//!
//! A spill source is a tensor from libtorch's allocator, so it follows rule (b) of design.md
//! section 4: the D2H copy is ordered after the compute stream, and the tensor is held until
//! the copy completed. Finalizing a spill (drop the device tensor, checksum the bytes) happens
//! when the cap is reached, inline in pack: completed copies first, else the oldest is waited
//! for, so the cap bounds the copies in flight but never stops spilling under pressure.

use super::record::RecordState;
use super::runtime::{Inner, Shared};
use crate::device::CopyStream;
use crate::error::{Error, Result};
use crate::events::{Direction, EventKind, Owner, TransferId};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// The in-flight caps, as atomics so an arbiter (the Conductor's `Knobs`) can change them
/// between or during steps; the runtime reads them at every decision.
#[derive(Debug)]
pub struct TransferLimits {
    max_inflight_d2h: AtomicU32,
    max_inflight_h2d: AtomicU32,
    suppress_speculative: AtomicBool,
}

impl TransferLimits {
    /// Caps from the configuration.
    pub fn new(max_inflight_d2h: u32, max_inflight_h2d: u32) -> TransferLimits {
        TransferLimits {
            max_inflight_d2h: AtomicU32::new(max_inflight_d2h.max(1)),
            max_inflight_h2d: AtomicU32::new(max_inflight_h2d.max(1)),
            suppress_speculative: AtomicBool::new(false),
        }
    }
    /// Spill copies in flight before pack finalizes inline (at least 1).
    pub fn max_inflight_d2h(&self) -> usize {
        self.max_inflight_d2h.load(Ordering::Relaxed).max(1) as usize
    }
    /// Predictive restores in flight (at least 1).
    pub fn max_inflight_h2d(&self) -> usize {
        self.max_inflight_h2d.load(Ordering::Relaxed).max(1) as usize
    }
    /// Whether restores ahead of need are suppressed (on-demand restores still run).
    pub fn suppress_speculative(&self) -> bool {
        self.suppress_speculative.load(Ordering::Relaxed)
    }
    /// Sets the spill cap.
    pub fn set_max_inflight_d2h(&self, n: u32) {
        self.max_inflight_d2h.store(n.max(1), Ordering::Relaxed);
    }
    /// Sets the restore cap.
    pub fn set_max_inflight_h2d(&self, n: u32) {
        self.max_inflight_h2d.store(n.max(1), Ordering::Relaxed);
    }
    /// Suppresses or allows restores ahead of need.
    pub fn set_suppress_speculative(&self, on: bool) {
        self.suppress_speculative.store(on, Ordering::Relaxed);
    }
}

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

impl Shared {
    /// At the cap, finalizes completed spills, or waits for the oldest when none completed.
    pub(super) fn make_room_d2h(&self, g: &mut Inner) -> Result<()> {
        let cap = self.limits.max_inflight_d2h();
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
