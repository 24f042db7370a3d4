//! Per-tensor records of one step: what was saved, where its bytes are, and its state.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::TensorId;
use crate::pinned::LeasePart;
use crate::saved::WeightSave;
use crate::torch::{StorageWatch, TensorIdentity};
use crate::transfer::Transfer;
use std::collections::HashMap;
use std::time::Instant;
use tch::{Kind, Tensor};

/// Where a saved tensor is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Stays on the device; the record holds it.
    Kept,
    /// A managed weight, held as a handle to its block.
    WeightHandle,
    /// To be spilled with the other small tensors of its region in one copy; the record holds
    /// the tensor until that copy starts ([`super::spills`]).
    Batched,
    /// Its D2H copy is in flight; the device tensor is held until the copy completes.
    Spilling,
    /// Its bytes are on the host only.
    Spilled,
    /// Its H2D copy is in flight.
    Restoring,
    /// Back on the device.
    Restored,
    /// Not stored: computed again in backward by its recompute scope ([`super::recompute`]).
    Recompute,
}

impl RecordState {
    /// Whether `self -> to` is a valid edge.
    pub fn can_transition_to(self, to: RecordState) -> bool {
        use RecordState::*;
        matches!(
            (self, to),
            (Batched, Spilling) | (Batched, Kept) | (Spilling, Spilled) | (Spilled, Restoring) | (Restoring, Restored)
        )
    }
}

/// Shape and type of a spilled tensor, to rebuild it exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub kind: Kind,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    /// Whether the saved tensor was contiguous (otherwise restore re-creates its strides).
    pub contiguous: bool,
}

/// Which of its recompute scope's tensors a recomputed record is (the scopes are
/// `recompute::Scopes`).
#[derive(Debug, Clone)]
pub(crate) struct Member {
    /// The scope, by its index in the step.
    pub(super) frame: usize,
    pub(super) slot: Slot,
}

/// Which tensor of its scope a member is.
#[derive(Debug, Clone)]
pub(crate) enum Slot {
    /// The `i`-th tensor autograd saved inside the scope.
    Saved(usize),
    /// A view of the scope's output, saved after the scope closed.
    Output { sizes: Vec<i64>, strides: Vec<i64>, offset: i64 },
}

/// One saved tensor (several autograd handles may share it when it was saved several times).
#[derive(Debug)]
pub struct Record {
    pub id: TensorId,
    pub state: RecordState,
    /// Bytes of the tensor's data.
    pub bytes: u64,
    /// Autograd handles still pointing here.
    pub refs: u32,
    /// The identity used for dedupe.
    pub identity: Option<TensorIdentity>,
    /// For a spilled tensor, whose storage the record no longer holds: whether that storage is
    /// still alive, so the identity still names it (dead, its address may be reused).
    pub watch: Option<StorageWatch>,
    /// The kept tensor, the batched one waiting for its copy, or the restored tensor (the
    /// destination of the restore while it lands).
    pub tensor: Option<Tensor>,
    pub weight: Option<WeightSave>,
    pub meta: Option<TensorMeta>,
    /// The spilled bytes on the host once the spill's copy landed (its copy, in flight, is the
    /// spill queue's), while no restore owns them.
    pub host: Option<LeasePart>,
    /// The restore's copy while it lands (it owns the bytes).
    pub restore: Option<Transfer<LeasePart>>,
    /// CRC32C of the spilled bytes once their copy landed (checksums on).
    pub crc: Option<u32>,
    /// The region the tensor was saved in, kept with the checksum to name it in a mismatch
    /// (and by a batched tensor, for its pack decision when its batch is copied).
    pub region: Option<String>,
    /// Bytes this record adds to the device's accounted memory (host device).
    pub device_bytes: u64,
    /// Restored ahead of need and not yet unpacked (its bytes count against the allowance).
    pub predicted: bool,
    /// The restore was issued ahead of need (kept for the completion event).
    pub restored_ahead: bool,
    /// Restored on demand: when the restore began (a stall).
    pub stall_since: Option<Instant>,
    /// Unpacked at least once.
    pub unpacked: bool,
    /// For a recomputed tensor: its scope and which of the scope's tensors it is.
    pub recompute: Option<Member>,
}

impl Record {
    /// A record in `state` with nothing attached.
    pub fn new(id: TensorId, state: RecordState, bytes: u64) -> Record {
        Record {
            id,
            state,
            bytes,
            refs: 1,
            identity: None,
            watch: None,
            tensor: None,
            weight: None,
            meta: None,
            host: None,
            restore: None,
            crc: None,
            region: None,
            device_bytes: 0,
            predicted: false,
            restored_ahead: false,
            stall_since: None,
            unpacked: false,
            recompute: None,
        }
    }

    /// Moves to `to`, refusing edges that are not in the state machine.
    pub fn transition(&mut self, to: RecordState) -> Result<()> {
        if !self.state.can_transition_to(to) {
            return Err(Error::internal(format!(
                "saved tensor {} cannot go from {:?} to {:?}",
                self.id, self.state, to
            )));
        }
        self.state = to;
        Ok(())
    }
}

impl Record {
    /// Sets the bytes this record adds to the device's accounted memory (the host device's
    /// simulated VRAM moves with it; on CUDA the allocator counts real bytes).
    pub fn set_device_bytes(&mut self, bytes: u64, device: &Device) {
        let delta = bytes as i64 - self.device_bytes as i64;
        if delta != 0 {
            device.account(delta);
        }
        self.device_bytes = bytes;
    }
}

/// The records of the current step, in pack order (backward needs them in reverse).
#[derive(Debug, Default)]
pub struct Records {
    slots: Vec<Option<Record>>,
    handles: HashMap<u64, usize>,
    by_identity: HashMap<TensorIdentity, usize>,
    next_handle: u64,
}

impl Records {
    /// Adds a record; returns its index (pack order) and a new handle for it.
    pub fn insert(&mut self, record: Record) -> (usize, u64) {
        let idx = self.slots.len();
        if let Some(id) = &record.identity {
            self.by_identity.insert(id.clone(), idx);
        }
        self.slots.push(Some(record));
        (idx, self.new_handle(idx))
    }

    /// Another handle for record `idx` (a duplicate save).
    pub fn new_handle(&mut self, idx: usize) -> u64 {
        // Handles are never reused within a runtime, so a stale handle cannot alias a record.
        self.next_handle += 1;
        self.handles.insert(self.next_handle, idx);
        self.next_handle
    }

    /// The live record with this identity, whose storage is still the one it names.
    pub fn find_identity(&self, identity: &TensorIdentity) -> Option<usize> {
        let idx = self.by_identity.get(identity).copied()?;
        let rec = self.get(idx)?;
        match &rec.watch {
            Some(w) if !w.alive() => None,
            _ => Some(idx),
        }
    }

    /// Stops deduping against `idx` (its storage is no longer held, so its address may be
    /// reused by an unrelated tensor).
    pub fn forget_identity(&mut self, idx: usize) {
        if let Some(id) = self.get_mut(idx).and_then(|r| r.identity.take()) {
            if self.by_identity.get(&id) == Some(&idx) {
                self.by_identity.remove(&id);
            }
        }
    }

    /// The record index of a handle.
    pub fn index_of(&self, handle: u64) -> Option<usize> {
        self.handles.get(&handle).copied()
    }

    /// Drops a handle; returns its record index.
    pub fn remove_handle(&mut self, handle: u64) -> Option<usize> {
        self.handles.remove(&handle)
    }

    /// The record at `idx`, if still live.
    pub fn get(&self, idx: usize) -> Option<&Record> {
        self.slots.get(idx).and_then(Option::as_ref)
    }

    /// The record at `idx`, writable.
    pub fn get_mut(&mut self, idx: usize) -> Option<&mut Record> {
        self.slots.get_mut(idx).and_then(Option::as_mut)
    }

    /// Removes the record at `idx`.
    pub fn take(&mut self, idx: usize) -> Option<Record> {
        self.forget_identity(idx);
        self.slots.get_mut(idx).and_then(Option::take)
    }

    /// Number of records made this step (live or not).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The live records, in pack order.
    pub fn iter(&self) -> impl Iterator<Item = &Record> {
        self.slots.iter().flatten()
    }

    /// Live records.
    pub fn live(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Forgets every record and handle (step end); returns the live records.
    pub fn drain(&mut self) -> Vec<Record> {
        self.handles.clear();
        self.by_identity.clear();
        self.slots.drain(..).flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_spill_edges_are_valid() {
        let mut r = Record::new(TensorId(1), RecordState::Spilling, 8);
        r.transition(RecordState::Spilled).expect("finalize");
        r.transition(RecordState::Restoring).expect("restore");
        r.transition(RecordState::Restored).expect("complete");
        let err = r.transition(RecordState::Spilled).expect_err("no way back");
        assert!(err.to_string().contains("Restored"), "{err}");
        let mut k = Record::new(TensorId(2), RecordState::Kept, 8);
        assert!(k.transition(RecordState::Spilled).is_err());
        // A batched tensor is copied with its batch, or kept when no host memory takes it.
        for to in [RecordState::Spilling, RecordState::Kept] {
            Record::new(TensorId(3), RecordState::Batched, 8).transition(to).expect("batched");
        }
        assert!(Record::new(TensorId(4), RecordState::Batched, 8).transition(RecordState::Spilled).is_err());
    }

    #[test]
    fn handles_are_unique_and_identities_forgettable() {
        let mut recs = Records::default();
        let t = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
        let mut r = Record::new(TensorId(1), RecordState::Kept, 16);
        r.identity = Some(TensorIdentity::of(&t));
        let (idx, h1) = recs.insert(r);
        let h2 = recs.new_handle(idx);
        assert_ne!(h1, h2);
        assert_eq!(recs.find_identity(&TensorIdentity::of(&t)), Some(idx));
        recs.forget_identity(idx);
        assert_eq!(recs.find_identity(&TensorIdentity::of(&t)), None);
        assert_eq!(recs.remove_handle(h1), Some(idx));
        assert_eq!(recs.index_of(h1), None);
        assert_eq!(recs.drain().len(), 1);
        assert_eq!(recs.live(), 0);
    }
}
