//! The device room for streamed blocks: one device allocation made once and cut into equal
//! slots, each holding one block at a time.
//!
//! Owning the memory is what lets a prefetch overlap compute: a copy into a slot waits only for
//! the event recorded on the compute stream after the slot's previous block was last used, not
//! for everything the compute stream has queued (which is what a copy into a fresh allocator
//! tensor must wait for, since the allocator recycles memory in compute-stream order).

use crate::device::{Device, StreamEvent};
use crate::error::{Error, Result};
use crate::events::BlockId;
use tch::Tensor;

/// The slots of `slot_bytes` bytes a weights' device budget of `budget` bytes holds once the
/// `resident` bytes of blocks kept on the device for good are taken out, at most one per
/// streamed block. The one rule for the streaming room: the memory plan sizes the budget it
/// hands the weight runtime with it, and the runtime cuts its room with it.
pub(crate) fn room_slots(budget: u64, resident: u64, slot_bytes: u64, streamed: usize) -> u64 {
    (budget.saturating_sub(resident) / slot_bytes.max(1)).min(streamed as u64)
}

/// Equal device slots, each free or holding one block.
#[derive(Debug)]
pub(crate) struct Slots {
    /// The device the room is accounted on (the host device counts it as simulated VRAM until
    /// the room goes).
    device: Device,
    slab: Tensor,
    slot_bytes: usize,
    owner: Vec<Option<BlockId>>,
    /// Recorded on the compute stream after the last use of the slot's previous occupant.
    last_use: Vec<Option<StreamEvent>>,
}

impl Slots {
    /// `count` slots of `slot_bytes` bytes each, allocated on `device` now.
    pub(crate) fn new(device: &Device, slot_bytes: usize, count: usize) -> Result<Slots> {
        if count == 0 || slot_bytes == 0 {
            return Err(Error::internal("a slot room needs at least one slot of at least one byte"));
        }
        let total = slot_bytes.checked_mul(count).ok_or_else(|| Error::TooLarge {
            what: "weight room".into(),
            needed: u64::MAX,
            limit: "the address space is smaller".into(),
        })?;
        Ok(Slots {
            device: device.clone(),
            slab: device.alloc_slab_for(total, || format!("the weights' streaming room ({count} slots of {slot_bytes} bytes)"))?,
            slot_bytes,
            owner: vec![None; count],
            last_use: vec![None; count],
        })
    }

    /// Bytes of one slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub(crate) fn count(&self) -> usize {
        self.owner.len()
    }

    /// Bytes of the whole room.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.slot_bytes * self.owner.len()
    }

    /// A free slot, if any.
    pub(crate) fn free(&self) -> Option<usize> {
        self.owner.iter().position(Option::is_none)
    }

    /// Gives slot `i` to `block`; returns the event a copy into it must wait for.
    pub(crate) fn assign(&mut self, i: usize, block: BlockId) -> Result<Option<StreamEvent>> {
        match self.owner.get_mut(i) {
            Some(o @ None) => {
                *o = Some(block);
                Ok(self.last_use[i].take())
            }
            _ => Err(Error::internal(format!("slot {i} given to block {block} is not free"))),
        }
    }

    /// Frees slot `i`; `last_use` is recorded on the compute stream after the last kernel that
    /// may read the block leaving it.
    pub(crate) fn release(&mut self, i: usize, last_use: StreamEvent) -> Result<()> {
        match self.owner.get_mut(i) {
            Some(o @ Some(_)) => {
                *o = None;
                self.last_use[i] = Some(last_use);
                Ok(())
            }
            _ => Err(Error::internal(format!("slot {i} released while free"))),
        }
    }

    /// The device bytes of slot `i`, `len` of them from its start.
    pub(crate) fn view(&self, i: usize, len: usize) -> Result<Tensor> {
        if i >= self.owner.len() || len > self.slot_bytes {
            return Err(Error::internal(format!("slot {i} has no {len} bytes")));
        }
        Ok(self.slab.f_narrow(0, (i * self.slot_bytes) as i64, len as i64)?)
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // The room's memory goes with it: a runtime dropped (a finished model) gives the host
        // device's simulated VRAM back, as the allocator does on CUDA.
        self.device.account(-((self.slot_bytes * self.owner.len()) as i64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_once_and_remember_their_last_use() {
        let dev = Device::host(1 << 20);
        let mut s = Slots::new(&dev, 256, 3).expect("slots");
        assert_eq!((s.count(), s.bytes(), dev.memory().allocated), (3, 768, 768));
        assert_eq!(s.free(), Some(0));
        assert!(s.assign(0, BlockId(7)).expect("free slot").is_none(), "never used: no wait");
        assert!(s.assign(0, BlockId(8)).is_err(), "taken");
        assert_eq!(s.free(), Some(1));
        s.release(0, dev.record_compute().expect("event")).expect("release");
        assert!(s.assign(0, BlockId(8)).expect("free again").is_some(), "waits for the last use");
        assert_eq!(s.view(1, 100).expect("view").size(), [100]);
        assert!(s.view(1, 257).is_err());
        drop(s);
        assert_eq!(dev.memory().allocated, 0, "the room's memory goes with it");
    }
}
