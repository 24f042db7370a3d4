//! Copies between host and device on a copy stream. A [`Pending`] owns the host memory of its
//! copy until the copy has completed and then hands it back, so the memory can be neither freed
//! nor read (for a device-to-host copy) while the DMA engine still works on it.

use super::backend::StreamBackend;
use super::{Device, StreamEvent, HostMemory, HostTarget};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tch::Tensor;

/// What a copy waits for before it starts.
#[derive(Debug, Clone, Copy)]
pub enum Order<'a> {
    /// Everything queued on the compute stream so far: required for a tensor from libtorch's
    /// allocator, whose memory the compute stream may have used or may still be producing.
    AfterCompute,
    /// Only this event: the last use of a device slab the runtime owns, so a prefetch overlaps
    /// the compute still queued before it.
    After(&'a StreamEvent),
    /// Nothing: a device slab the runtime owns that no kernel has used yet.
    Now,
}

/// A copy that failed to start, with the host memory it was given.
#[derive(Debug)]
pub struct Failed<H> {
    pub error: Error,
    pub host: H,
}

impl<H> std::fmt::Display for Failed<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<H: std::fmt::Debug> std::error::Error for Failed<H> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<H> From<Failed<H>> for Error {
    fn from(f: Failed<H>) -> Error {
        f.error
    }
}

/// A copy in flight. It owns the host memory `H` (returned by [`wait`](Self::wait) and
/// [`try_finish`](Self::try_finish)) and keeps the device tensor alive until the copy completed.
/// Dropping an unfinished copy blocks until it completes, so the memory it touches is never
/// freed under it. A timed copy (one in [`CopyStream::timed_every`]) has a start event and a
/// timed `done`, and reports its duration; the others report none.
#[derive(Debug)]
#[must_use = "a pending copy must be finished or kept until it completes"]
pub struct Pending<H: HostMemory> {
    start: Option<StreamEvent>,
    done: StreamEvent,
    bytes: usize,
    device: Option<Tensor>,
    host: Option<H>,
}

impl<H: HostMemory> Pending<H> {
    /// The event recorded on the copy stream after the copy.
    pub fn done(&self) -> &StreamEvent {
        &self.done
    }

    /// Bytes copied.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the copy finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    /// The copy's duration in milliseconds, measured between events on its stream, once it
    /// completed (GPU timing on CUDA, host timing on the host device); `None` before that and
    /// for a copy that is not timed.
    pub fn elapsed_ms(&self) -> Option<f64> {
        self.start.as_ref()?.elapsed_ms(&self.done)
    }

    /// Stops keeping the device tensor alive; the host memory stays owned until the copy
    /// completes.
    ///
    /// # Safety
    /// The copy may still be reading or writing the device memory. The caller guarantees that
    /// memory is not reused before the copy completes: either the compute stream already waits
    /// on [`done`](Self::done) (libtorch's allocator then reuses it in compute-stream order,
    /// after the copy), or something else keeps the storage alive until then (a slot the
    /// runtime owns).
    pub unsafe fn release_device(&mut self) {
        self.device = None;
    }

    /// Blocks until the copy finished; returns the host memory and, for a timed copy, its
    /// duration in ms.
    pub fn wait(mut self) -> Result<(H, Option<f64>)> {
        self.done.synchronize()?;
        let ms = self.elapsed_ms();
        self.device = None;
        let host = self.host.take().ok_or_else(|| Error::internal("a pending copy lost its host memory"))?;
        Ok((host, ms))
    }

    /// The host memory and the duration (a timed copy's), if the copy finished; the copy
    /// itself otherwise.
    pub fn try_finish(mut self) -> std::result::Result<(H, Option<f64>), Pending<H>> {
        if !self.is_complete() {
            return Err(self);
        }
        let ms = self.elapsed_ms();
        self.device = None;
        // The memory is taken only here and in `wait`, both of which consume the copy.
        match self.host.take() {
            Some(host) => Ok((host, ms)),
            None => Err(self),
        }
    }
}

impl<H: HostMemory> Drop for Pending<H> {
    fn drop(&mut self) {
        // Safety net: never free memory a copy still touches.
        if (self.host.is_some() || self.device.is_some()) && !self.done.is_complete() {
            let _ = self.done.synchronize();
        }
    }
}

/// How long the compute stream sat idle waiting for a copy: see
/// [`Device::compute_wait_timed`].
#[derive(Debug, Clone)]
pub struct WaitProbe {
    before: StreamEvent,
    after: StreamEvent,
}

impl WaitProbe {
    pub(super) fn new(before: StreamEvent, after: StreamEvent) -> WaitProbe {
        WaitProbe { before, after }
    }

    /// Milliseconds the compute stream spent between the events around its wait (the wait; the
    /// µs it took to pass the wait when the copy had landed first), once both completed.
    pub fn stall_ms(&self) -> Option<f64> {
        self.before.elapsed_ms(&self.after).map(|ms| ms.max(0.0))
    }

    /// Whether both events completed (the probe can be read).
    pub fn is_complete(&self) -> bool {
        self.before.is_complete() && self.after.is_complete()
    }
}

/// A dedicated, non-blocking copy stream.
#[derive(Debug)]
pub struct CopyStream {
    device: Device,
    stream: Box<dyn StreamBackend>,
    /// Copies issued, for choosing the timed ones.
    issued: AtomicU64,
    /// The next copy is timed whatever its number.
    time_next: AtomicBool,
}

impl CopyStream {
    pub(super) fn new(device: Device, stream: Box<dyn StreamBackend>) -> CopyStream {
        CopyStream { device, stream, issued: AtomicU64::new(0), time_next: AtomicBool::new(false) }
    }

    /// One copy in this many reports its duration (1 on the host device; on CUDA a timed event
    /// on the copy stream holds up the next copy, so copies are timed by sample).
    pub fn timed_every(&self) -> u64 {
        self.stream.timed_every().max(1)
    }

    /// Times the next copy issued on this stream, whatever its number: for a copy whose
    /// duration is itself a figure (a restore the compute stream stalls on).
    pub fn time_next(&self) {
        self.time_next.store(true, Ordering::Relaxed);
    }

    /// The device this stream copies to and from.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Makes this stream wait for `event`.
    pub fn wait(&self, event: &StreamEvent) -> Result<()> {
        self.stream.wait(event)
    }

    /// Records an event on this stream (without timing on CUDA).
    pub fn record(&self) -> Result<StreamEvent> {
        self.stream.record(false)
    }

    /// Queues one copy with `issue` between its events: a start and a timed end for a timed
    /// copy (the first, then one in [`timed_every`](Self::timed_every), and one asked for by
    /// [`time_next`](Self::time_next)), an end without timing for the others.
    fn queue(&self, order: Order<'_>, issue: impl FnOnce() -> Result<()>) -> Result<(Option<StreamEvent>, StreamEvent)> {
        self.order(order)?;
        let sampled = self.issued.fetch_add(1, Ordering::Relaxed) % self.timed_every() == 0;
        let timed = self.time_next.swap(false, Ordering::Relaxed) || sampled;
        let start = if timed { Some(self.stream.record(true)?) } else { None };
        issue()?;
        Ok((start, self.stream.record(timed)?))
    }

    /// Blocks until everything on this stream finished.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }

    fn order(&self, order: Order<'_>) -> Result<()> {
        match order {
            Order::AfterCompute => self.stream.wait(&self.device.record_compute()?),
            Order::After(e) => self.stream.wait(e),
            Order::Now => Ok(()),
        }
    }

    /// Copies `src[offset .. offset + dst's bytes]` into the contiguous device tensor `dst`.
    pub fn h2d<H: HostMemory>(
        &self,
        dst: &Tensor,
        src: H,
        offset: usize,
        order: Order<'_>,
    ) -> std::result::Result<Pending<H>, Failed<H>> {
        let checked = self
            .device
            .check_tensor(dst, "h2d destination")
            .and_then(|bytes| range(src.host_len(), offset, bytes).map(|_| bytes));
        let bytes = match checked {
            Ok(b) => b,
            Err(error) => return Err(Failed { error, host: src }),
        };
        let issued = self.queue(order, || {
            // SAFETY: `dst` is a live contiguous tensor of `bytes` bytes on this device, kept
            // alive by the Pending; `src` holds `offset + bytes` bytes (checked) and is owned by
            // the Pending until the copy completed.
            unsafe { self.stream.h2d(dst.data_ptr() as u64, src.host_ptr().add(offset), bytes) }
        });
        match issued {
            Ok((start, done)) => Ok(Pending {
                start,
                done,
                bytes,
                device: Some(dst.shallow_clone()),
                host: Some(src),
            }),
            Err(error) => Err(Failed { error, host: src }),
        }
    }

    /// Copies the contiguous device tensor `src` into `dst[offset ..]`.
    pub fn d2h<H: HostTarget>(
        &self,
        mut dst: H,
        offset: usize,
        src: &Tensor,
        order: Order<'_>,
    ) -> std::result::Result<Pending<H>, Failed<H>> {
        let checked = self
            .device
            .check_tensor(src, "d2h source")
            .and_then(|bytes| range(dst.host_len(), offset, bytes).map(|_| bytes));
        let bytes = match checked {
            Ok(b) => b,
            Err(error) => return Err(Failed { error, host: dst }),
        };
        let issued = self.queue(order, || {
            // SAFETY: `src` is a live contiguous tensor of `bytes` bytes kept alive by the
            // Pending; `dst` holds `offset + bytes` bytes (checked) and is owned exclusively by
            // the Pending, so nothing reads it until the copy completed.
            unsafe { self.stream.d2h(dst.host_ptr_mut().add(offset), src.data_ptr() as u64, bytes) }
        });
        match issued {
            Ok((start, done)) => Ok(Pending {
                start,
                done,
                bytes,
                device: Some(src.shallow_clone()),
                host: Some(dst),
            }),
            Err(error) => Err(Failed { error, host: dst }),
        }
    }
}

fn range(len: usize, offset: usize, bytes: usize) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::TooLarge {
            what: "copy".into(),
            needed: bytes as u64,
            limit: format!("the host memory has {len} bytes from offset {offset}"),
        }),
    }
}
