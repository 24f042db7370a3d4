//! Weight copies in flight: a load per block still landing, and the copies of blocks already in
//! use whose completion has not been seen yet (their host memory stays owned until then).

use crate::device::{HostBuffer, HostMemory, WaitProbe};
use crate::error::Result;
use crate::events::BlockId;
use crate::pinned::Lease;
use crate::transfer::{Copier, Transfer};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// What a load reads: the block's canonical host copy, or a pinned slab a file-backed block was
/// staged into.
#[derive(Debug)]
pub(crate) enum LoadSource {
    Host(Arc<HostBuffer>),
    Staged(Lease),
}

// SAFETY: both variants own (a reference to) memory that does not move and that nobody writes
// while the load reads it: the host copy is written only when no clone of its `Arc` is held by
// a load, and a lease is exclusive.
unsafe impl HostMemory for LoadSource {
    fn host_ptr(&self) -> *const u8 {
        match self {
            LoadSource::Host(b) => b.host_ptr(),
            LoadSource::Staged(l) => l.host_ptr(),
        }
    }
    fn host_len(&self) -> usize {
        match self {
            LoadSource::Host(b) => b.host_len(),
            LoadSource::Staged(l) => l.host_len(),
        }
    }
}

/// Loads in flight.
#[derive(Debug, Default)]
pub(crate) struct Loads {
    landing: HashMap<BlockId, Transfer<LoadSource>>,
    /// Copies of blocks the compute stream already waits on, reported once complete, in the
    /// order their blocks were used.
    retired: VecDeque<(BlockId, Transfer<LoadSource>)>,
    /// How long the compute stream waited for each load it needed before it landed.
    probes: Vec<WaitProbe>,
}

impl Loads {
    /// Blocks whose load is still landing.
    pub(crate) fn landing_count(&self) -> usize {
        self.landing.len()
    }

    /// Whether `block`'s load is still landing.
    pub(crate) fn is_landing(&self, block: BlockId) -> bool {
        self.landing.contains_key(&block)
    }

    pub(crate) fn start(&mut self, block: BlockId, t: Transfer<LoadSource>) {
        self.landing.insert(block, t);
    }

    /// Takes `block`'s load: reported now if it completed, otherwise the compute stream is made
    /// to wait for it (measured by a probe) and it is kept until it completes.
    pub(crate) fn finish(&mut self, copier: &Copier, block: BlockId, wait_on_compute: bool) -> Result<()> {
        let Some(t) = self.landing.remove(&block) else { return Ok(()) };
        match copier.finish(t) {
            Ok(_) => Ok(()),
            Err(mut t) => {
                if wait_on_compute {
                    self.probes.push(copier.device().compute_wait_timed(t.done())?);
                }
                // SAFETY: the destination is a view of a slot (or block buffer) the weight
                // runtime keeps allocated for as long as the block is placed there, so dropping
                // the view returns no memory to the allocator while the copy writes it.
                unsafe { t.release_device() };
                self.retired.push_back((block, t));
                Ok(())
            }
        }
    }

    /// Reports the retired copies that completed.
    pub(crate) fn reap(&mut self, copier: &Copier) {
        let retired = std::mem::take(&mut self.retired);
        for (b, t) in retired {
            if let Err(t) = copier.finish(t) {
                self.retired.push_back((b, t));
            }
        }
    }

    /// Reports at most `max` retired copies that completed, oldest first, stopping at the first
    /// still in flight (the copies of one stream complete in the order they were queued, so
    /// the ones after it are mostly in flight too; any that are not wait for a later call).
    /// The share of reporting a block use pays: after the host waited for the device, every
    /// copy of the step before has completed, and reporting them all (a few us each with
    /// telemetry on) before the step's first copy is issued left the copy engine idle for as
    /// long.
    pub(crate) fn reap_some(&mut self, copier: &Copier, max: usize) {
        for _ in 0..max {
            let Some((b, t)) = self.retired.pop_front() else { return };
            if let Err(t) = copier.finish(t) {
                self.retired.push_front((b, t));
                return;
            }
        }
    }

    /// Whether copies wait to be reported (their Conductor slots and staging slabs are held
    /// until then).
    pub(crate) fn has_retired(&self) -> bool {
        !self.retired.is_empty()
    }

    /// Waits for every copy (shutdown).
    pub(crate) fn drain(&mut self, copier: &Copier) -> Result<()> {
        for (_, t) in self.landing.drain() {
            copier.wait(t)?;
        }
        for (_, t) in self.retired.drain(..) {
            copier.wait(t)?;
        }
        Ok(())
    }

    /// The completion events of `block`'s copies not yet seen complete (its host memory is read
    /// until they complete).
    pub(crate) fn pending_events(&self, block: BlockId) -> Vec<crate::device::StreamEvent> {
        let landing = self.landing.get(&block).map(|t| t.done().clone());
        self.retired
            .iter()
            .filter(|(b, _)| *b == block)
            .map(|(_, t)| t.done().clone())
            .chain(landing)
            .collect()
    }

    /// Copies not yet seen complete: (landing, retired).
    pub(crate) fn in_flight(&self) -> (usize, usize) {
        (self.landing.len(), self.retired.len())
    }

    /// Bytes of loads in flight (their slots hold no usable block yet).
    pub(crate) fn landing_bytes(&self) -> u64 {
        self.landing.values().map(|t| t.bytes()).sum()
    }

    /// The compute stream's waits for loads this step, in ms, as far as they can be read now;
    /// those not yet readable stay for the next call.
    pub(crate) fn take_wait_ms(&mut self, all: bool) -> f64 {
        let mut total = 0.0;
        self.probes.retain(|p| match p.stall_ms() {
            Some(ms) => {
                total += ms;
                false
            }
            None => !all,
        });
        total
    }
}
