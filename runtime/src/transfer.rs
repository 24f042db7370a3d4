//! One record for every copy between host and device, whichever runtime issues it: an id from
//! the device's single source (unique across runtimes), the Conductor's transfer slot held while
//! the copy flies, and the duration measured between events on the copy's own stream (in both
//! directions), published as `transfer_issued` and `transfer_completed`.

use crate::conductor::SlotToken;
use crate::device::{CopyStream, Device, StreamEvent, Failed, HostMemory, HostTarget, Order, Pending};
use crate::error::Result;
use crate::events::{Bus, Direction, EventKind, Owner, TransferId};
use tch::Tensor;

/// A copy in flight, as every runtime tracks it.
#[derive(Debug)]
#[must_use = "a transfer must be finished so its completion is reported and its slot returned"]
pub struct Transfer<H: HostMemory> {
    id: TransferId,
    dir: Direction,
    bytes: u64,
    pending: Pending<H>,
    slot: Option<SlotToken>,
}

impl<H: HostMemory> Transfer<H> {
    /// Bytes copied.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the copy finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.pending.is_complete()
    }

    /// The copy's completion event (for the compute stream to wait on).
    pub fn done(&self) -> &StreamEvent {
        self.pending.done()
    }

    /// Stops keeping the device tensor alive.
    ///
    /// # Safety
    /// As [`Pending::release_device`]: the device memory is not reused before the copy
    /// completes.
    pub unsafe fn release_device(&mut self) {
        // SAFETY: the caller upholds the same contract.
        unsafe { self.pending.release_device() };
    }
}

/// Issues copies on one stream for one owner and reports them.
#[derive(Debug)]
pub struct Copier {
    stream: CopyStream,
    bus: Bus,
    owner: Owner,
}

impl Copier {
    /// A copier with its own copy stream on `device`.
    pub fn new(device: &Device, bus: Bus, owner: Owner) -> Result<Copier> {
        Ok(Copier {
            stream: device.copy_stream()?,
            bus,
            owner,
        })
    }

    /// A copier of the same device, bus and owner on a copy stream of its own: copies that must
    /// not queue behind this one's.
    pub fn sibling(&self) -> Result<Copier> {
        Copier::new(self.device(), self.bus.clone(), self.owner)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.stream.device()
    }

    /// Times the next copy whatever its number: see [`CopyStream::time_next`].
    pub fn time_next(&self) {
        self.stream.time_next();
    }

    fn issued(&self, dir: Direction, bytes: u64, subject: impl FnOnce() -> String) -> TransferId {
        let id = self.stream.device().next_transfer_id();
        let owner = self.owner;
        self.bus.publish_with(|| EventKind::TransferIssued {
            id,
            dir,
            owner,
            bytes,
            subject: subject(),
        });
        id
    }

    /// Host-to-device: `src[offset ..]` into the contiguous device tensor `dst`.
    pub fn h2d<H: HostMemory>(
        &self,
        dst: &Tensor,
        src: H,
        offset: usize,
        order: Order<'_>,
        slot: Option<SlotToken>,
        subject: impl FnOnce() -> String,
    ) -> std::result::Result<Transfer<H>, Failed<H>> {
        let pending = self.stream.h2d(dst, src, offset, order)?;
        let bytes = pending.bytes() as u64;
        Ok(Transfer {
            id: self.issued(Direction::H2d, bytes, subject),
            dir: Direction::H2d,
            bytes,
            pending,
            slot,
        })
    }

    /// Device-to-host: the contiguous device tensor `src` into `dst[offset ..]`.
    pub fn d2h<H: HostTarget>(
        &self,
        dst: H,
        offset: usize,
        src: &Tensor,
        order: Order<'_>,
        slot: Option<SlotToken>,
        subject: impl FnOnce() -> String,
    ) -> std::result::Result<Transfer<H>, Failed<H>> {
        let pending = self.stream.d2h(dst, offset, src, order)?;
        let bytes = pending.bytes() as u64;
        Ok(Transfer {
            id: self.issued(Direction::D2h, bytes, subject),
            dir: Direction::D2h,
            bytes,
            pending,
            slot,
        })
    }

    fn completed(&self, id: TransferId, dir: Direction, bytes: u64, ms: Option<f64>, slot: Option<SlotToken>) {
        let owner = self.owner;
        self.bus.publish_with(|| EventKind::TransferCompleted {
            id,
            dir,
            owner,
            bytes,
            duration_ms: ms,
        });
        if let Some(s) = slot {
            s.complete(bytes);
        }
    }

    /// Reports a finished copy and returns its host memory and duration (ms, a timed copy's);
    /// the transfer itself while it is still in flight.
    pub fn finish<H: HostMemory>(&self, t: Transfer<H>) -> std::result::Result<(H, Option<f64>), Transfer<H>> {
        let Transfer {
            id,
            dir,
            bytes,
            pending,
            slot,
        } = t;
        match pending.try_finish() {
            Ok((host, ms)) => {
                self.completed(id, dir, bytes, ms, slot);
                Ok((host, ms))
            }
            Err(pending) => Err(Transfer {
                id,
                dir,
                bytes,
                pending,
                slot,
            }),
        }
    }

    /// Waits for a copy, reports it, and returns its host memory and duration (ms, a timed
    /// copy's).
    pub fn wait<H: HostMemory>(&self, t: Transfer<H>) -> Result<(H, Option<f64>)> {
        let (host, ms) = t.pending.wait()?;
        self.completed(t.id, t.dir, t.bytes, ms, t.slot);
        Ok((host, ms))
    }
}
