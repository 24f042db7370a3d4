//! The device layer: copy streams, events, pinned host buffers and async copies.
//!
//! Two backends behind one API:
//! - **CUDA** (cudarc, loaded dynamically, no toolkit needed): non-blocking copy streams on the
//!   primary context that libtorch also uses, pinned host memory allocated with flags 0 (not
//!   write-combined, so the CPU reads D2H results quickly), async copies on raw device pointers
//!   taken from tensors, and the compute stream (libtorch's legacy default stream) made to wait
//!   on copy events without blocking the host.
//! - **Host**: the same work done synchronously on a machine without CUDA. "VRAM" is an
//!   accounted budget ([`Device::account`]), copies are `memcpy`, events are complete at once.
//!
//! Ordering rules (design.md section 4): a copy that writes or reads a tensor from libtorch's
//! allocator must be ordered after the compute stream's work on it ([`CopyStream::h2d`] and
//! [`CopyStream::d2h`] do this by default), the compute stream must wait on the copy's event
//! before using the result ([`Device::compute_wait`]), and the tensor must stay alive until the
//! copy has completed ([`Pending`] keeps it).

mod buffer;
mod cuda;

pub use buffer::HostBuffer;

use crate::error::{Error, Result};
use crate::events::{DeviceInfo, DeviceKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tch::Tensor;

/// A reading of device memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReading {
    /// Bytes allocated (CUDA: the caching allocator's allocated bytes; host: accounted bytes).
    pub allocated: u64,
    /// Bytes reserved from the driver (host: equal to allocated).
    pub reserved: u64,
    /// Peak of `allocated` since the last [`Device::reset_peak`].
    pub peak: u64,
}

#[derive(Debug)]
struct HostState {
    budget: u64,
    allocated: AtomicU64,
    peak: AtomicU64,
}

#[derive(Debug)]
enum Backend {
    Cuda(cuda::CudaBackend),
    Host(HostState),
}

/// A compute device: a CUDA GPU, or the host device that simulates one.
#[derive(Debug, Clone)]
pub struct Device {
    backend: Arc<Backend>,
}

impl Device {
    /// CUDA device `ordinal`; a clear "no CUDA device" error on a machine without one.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        if !crate::torch::init() {
            return Err(Error::NoCuda(
                crate::torch::cuda_load_error()
                    .unwrap_or_else(|| "libtorch reports no CUDA device".into()),
            ));
        }
        Ok(Device {
            backend: Arc::new(Backend::Cuda(cuda::CudaBackend::new(ordinal)?)),
        })
    }

    /// The host device, with `budget_bytes` of simulated VRAM.
    pub fn host(budget_bytes: u64) -> Device {
        Device {
            backend: Arc::new(Backend::Host(HostState {
                budget: budget_bytes,
                allocated: AtomicU64::new(0),
                peak: AtomicU64::new(0),
            })),
        }
    }

    /// CUDA device 0 when present, otherwise the host device with `host_budget_bytes`.
    pub fn auto(host_budget_bytes: u64) -> Device {
        Device::cuda(0).unwrap_or_else(|_| Device::host(host_budget_bytes))
    }

    /// Whether this is a real CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(*self.backend, Backend::Cuda(_))
    }

    /// The tch device that tensors of this device live on.
    pub fn tch_device(&self) -> tch::Device {
        match &*self.backend {
            Backend::Cuda(c) => tch::Device::Cuda(c.ordinal()),
            Backend::Host(_) => tch::Device::Cpu,
        }
    }

    /// What dashboards show about this device.
    pub fn info(&self) -> DeviceInfo {
        match &*self.backend {
            Backend::Cuda(c) => DeviceInfo {
                kind: DeviceKind::Cuda,
                index: c.ordinal() as u32,
                name: c.name(),
                total_bytes: c.total_bytes(),
            },
            Backend::Host(h) => DeviceInfo {
                kind: DeviceKind::Host,
                index: 0,
                name: "host (simulated)".into(),
                total_bytes: h.budget,
            },
        }
    }

    /// Current, reserved and peak device memory.
    pub fn memory(&self) -> MemoryReading {
        match &*self.backend {
            Backend::Cuda(c) => c.memory(),
            Backend::Host(h) => {
                let a = h.allocated.load(Ordering::Relaxed);
                MemoryReading {
                    allocated: a,
                    reserved: a,
                    peak: h.peak.load(Ordering::Relaxed),
                }
            }
        }
    }

    /// Restarts the peak from the current value.
    pub fn reset_peak(&self) {
        match &*self.backend {
            Backend::Cuda(c) => c.reset_peak(),
            Backend::Host(h) => h
                .peak
                .store(h.allocated.load(Ordering::Relaxed), Ordering::Relaxed),
        }
    }

    /// On the host device, adds `delta` bytes to the simulated VRAM (runtimes report what they
    /// hold "on the device"). On CUDA the allocator counts real bytes, so this does nothing.
    pub fn account(&self, delta: i64) {
        if let Backend::Host(h) = &*self.backend {
            let now = if delta >= 0 {
                h.allocated.fetch_add(delta as u64, Ordering::Relaxed) + delta as u64
            } else {
                let d = delta.unsigned_abs();
                let prev = h
                    .allocated
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                        Some(v.saturating_sub(d))
                    })
                    .unwrap_or(0);
                prev.saturating_sub(d)
            };
            h.peak.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// Allocates a host buffer for copies: pinned on CUDA (allocate once, never on a hot path),
    /// plain aligned memory on the host device.
    pub fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        match &*self.backend {
            Backend::Cuda(c) => c.alloc_pinned(bytes),
            Backend::Host(_) => Ok(HostBuffer::pageable(bytes)),
        }
    }

    /// A new non-blocking copy stream.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        Ok(CopyStream {
            device: self.clone(),
            cuda: match &*self.backend {
                Backend::Cuda(c) => Some(c.new_stream()?),
                Backend::Host(_) => None,
            },
        })
    }

    /// An event recorded on the compute stream (libtorch's current, legacy default stream).
    pub fn record_compute(&self) -> Result<Event> {
        match &*self.backend {
            Backend::Cuda(c) => Ok(Event {
                cuda: Some(Arc::new(c.record_compute()?)),
            }),
            Backend::Host(_) => Ok(Event::complete()),
        }
    }

    /// Makes the compute stream wait for `event` (no host synchronisation).
    pub fn compute_wait(&self, event: &Event) -> Result<()> {
        match (&*self.backend, &event.cuda) {
            (Backend::Cuda(c), Some(e)) => c.compute_wait(e),
            _ => Ok(()),
        }
    }

    /// Blocks the host until the compute stream is idle (tests and shutdown only).
    pub fn synchronize(&self) -> Result<()> {
        match &*self.backend {
            Backend::Cuda(c) => c.synchronize(),
            Backend::Host(_) => Ok(()),
        }
    }

    fn check_tensor(&self, t: &Tensor, what: &str) -> Result<usize> {
        if t.device() != self.tch_device() {
            return Err(Error::State(format!(
                "{what} is on {:?}, expected {:?}",
                t.device(),
                self.tch_device()
            )));
        }
        if !t.is_contiguous() {
            return Err(Error::State(format!("{what} must be contiguous")));
        }
        Ok(t.numel() * t.kind().elt_size_in_bytes())
    }
}

/// A completion marker for work on a stream. On the host device it is always complete.
#[derive(Debug, Clone)]
pub struct Event {
    cuda: Option<Arc<cudarc::driver::CudaEvent>>,
}

impl Event {
    /// An event that is already complete.
    pub fn complete() -> Event {
        Event { cuda: None }
    }

    /// Whether the work before the event has finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.cuda.as_ref().is_none_or(|e| e.is_complete())
    }

    /// Blocks the host until the event completes.
    pub fn synchronize(&self) -> Result<()> {
        match &self.cuda {
            Some(e) => e.synchronize().map_err(|e| Error::Cuda(e.to_string())),
            None => Ok(()),
        }
    }

    /// Milliseconds between `self` and a later `end` (both recorded with timing; 0 on host).
    pub fn elapsed_ms(&self, end: &Event) -> f64 {
        match (&self.cuda, &end.cuda) {
            (Some(a), Some(b)) => a.elapsed_ms(b).map(|v| v as f64).unwrap_or(0.0),
            _ => 0.0,
        }
    }
}

/// A copy in flight, with what it reads kept alive until it completes.
#[derive(Debug)]
#[must_use = "a pending copy must be waited on or kept until complete"]
pub struct Pending {
    /// Recorded on the copy stream after the copy.
    pub done: Event,
    /// Recorded on the copy stream before the copy (for timing).
    pub start: Event,
    /// Bytes copied.
    pub bytes: usize,
    keep_alive: Option<Tensor>,
}

impl Pending {
    /// A copy that already finished (the host device copies synchronously).
    fn finished(bytes: usize) -> Pending {
        Pending {
            done: Event::complete(),
            start: Event::complete(),
            bytes,
            keep_alive: None,
        }
    }

    /// Whether the copy finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    /// Blocks until the copy finished, then releases what it kept alive.
    pub fn wait(mut self) -> Result<()> {
        self.done.synchronize()?;
        self.keep_alive = None;
        Ok(())
    }

    /// Stops keeping the copied tensor alive and returns the completion event, without waiting.
    /// Sound only for a copy whose *destination* the compute stream already waits on (via
    /// [`Device::compute_wait`] on `done`): the caching allocator then reuses that memory in
    /// compute-stream order, after the copy. A copy's host source must still outlive `done`.
    pub fn release_after_compute_wait(mut self) -> Event {
        self.keep_alive = None;
        self.done.clone()
    }

    /// Copy duration in milliseconds, once complete (0 on the host device).
    pub fn elapsed_ms(&self) -> f64 {
        self.start.elapsed_ms(&self.done)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Safety net: never free a tensor a copy still reads.
        if self.keep_alive.is_some() && !self.done.is_complete() {
            let _ = self.done.synchronize();
        }
    }
}

/// A dedicated, non-blocking copy stream.
#[derive(Debug)]
pub struct CopyStream {
    device: Device,
    cuda: Option<Arc<cudarc::driver::CudaStream>>,
}

impl CopyStream {
    /// The device this stream copies to and from.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Makes this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.cuda, &event.cuda) {
            (Some(s), Some(e)) => s.wait(e).map_err(|e| Error::Cuda(e.to_string())),
            _ => Ok(()),
        }
    }

    /// Records an event on this stream.
    pub fn record(&self) -> Result<Event> {
        match &self.cuda {
            Some(s) => Ok(Event {
                cuda: Some(Arc::new(cuda::record_timed(s)?)),
            }),
            None => Ok(Event::complete()),
        }
    }

    /// Copies `src[offset..offset + dst bytes]` into the device tensor `dst`. With `after`, the
    /// copy waits only for that event (a runtime-owned slab's last use); with `None` it waits for
    /// everything queued on the compute stream (safe for allocator tensors).
    pub fn h2d(
        &self,
        dst: &Tensor,
        src: &HostBuffer,
        offset: usize,
        after: Option<&Event>,
    ) -> Result<Pending> {
        let bytes = self.device.check_tensor(dst, "h2d destination")?;
        let range = src.range(offset, bytes)?;
        match &self.cuda {
            None => {
                // SAFETY: `dst` is a contiguous CPU tensor of exactly `bytes` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_slice()[range].as_ptr(),
                        dst.data_ptr() as *mut u8,
                        bytes,
                    )
                };
                Ok(Pending::finished(bytes))
            }
            Some(s) => self.issue(after, dst, bytes, || {
                // SAFETY: `dst` is a live contiguous device tensor of `bytes` bytes; `src` is a
                // pinned buffer that outlives the copy (callers keep slabs until `done`).
                unsafe { cuda::h2d(s, dst.data_ptr() as u64, &src.as_slice()[range]) }
            }),
        }
    }

    /// Copies the device tensor `src` into `dst[offset..]`, ordered after the compute stream
    /// (or after `after`). `src` is kept alive until the copy completes.
    pub fn d2h(
        &self,
        dst: &mut HostBuffer,
        offset: usize,
        src: &Tensor,
        after: Option<&Event>,
    ) -> Result<Pending> {
        let bytes = self.device.check_tensor(src, "d2h source")?;
        let range = dst.range(offset, bytes)?;
        match &self.cuda {
            None => {
                // SAFETY: `src` is a contiguous CPU tensor of exactly `bytes` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.data_ptr() as *const u8,
                        dst.as_mut_slice()[range].as_mut_ptr(),
                        bytes,
                    )
                };
                Ok(Pending::finished(bytes))
            }
            Some(s) => self.issue(after, src, bytes, || {
                // SAFETY: `src` stays alive (kept in the Pending) until the copy completes;
                // `dst` is pinned memory owned by the caller, who waits before reading it.
                unsafe { cuda::d2h(s, &mut dst.as_mut_slice()[range], src.data_ptr() as u64) }
            }),
        }
    }

    /// Orders a CUDA copy after `after` (or the compute stream), issues it between two timing
    /// events, and keeps `keep` alive until it completes.
    fn issue(
        &self,
        after: Option<&Event>,
        keep: &Tensor,
        bytes: usize,
        copy: impl FnOnce() -> Result<()>,
    ) -> Result<Pending> {
        self.order_after(after)?;
        let start = self.record()?;
        copy()?;
        let done = self.record()?;
        Ok(Pending {
            done,
            start,
            bytes,
            keep_alive: Some(keep.shallow_clone()),
        })
    }

    fn order_after(&self, after: Option<&Event>) -> Result<()> {
        match after {
            Some(e) => self.wait(e),
            None => self.wait(&self.device.record_compute()?),
        }
    }

    /// Blocks until everything on this stream finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.cuda {
            Some(s) => s.synchronize().map_err(|e| Error::Cuda(e.to_string())),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn host_device_copies_round_trip_and_account() {
        let dev = Device::host(1 << 20);
        assert!(!dev.is_cuda());
        assert!(dev.info().host_simulated());
        let stream = dev.copy_stream().expect("stream");
        let src = Tensor::arange(256, (Kind::Float, tch::Device::Cpu));
        let mut buf = dev.alloc_host(4096).expect("buffer");
        stream.d2h(&mut buf, 0, &src, None).expect("d2h").wait().expect("wait");
        let dst = Tensor::zeros([256], (Kind::Float, tch::Device::Cpu));
        stream.h2d(&dst, &buf, 0, None).expect("h2d").wait().expect("wait");
        assert!(dst.equal(&src));
        dev.account(1000);
        dev.account(-400);
        assert_eq!(dev.memory().allocated, 600);
        assert_eq!(dev.memory().peak, 1000);
        dev.reset_peak();
        assert_eq!(dev.memory().peak, 600);
    }

    #[test]
    fn copies_check_sizes_and_layout() {
        let dev = Device::host(0);
        let stream = dev.copy_stream().expect("stream");
        let buf = dev.alloc_host(16).expect("buffer");
        let big = Tensor::zeros([64], (Kind::Float, tch::Device::Cpu));
        let err = stream.h2d(&big, &buf, 0, None).expect_err("too small");
        assert!(err.to_string().contains("256 bytes"), "{err}");
        let t = Tensor::zeros([4, 4], (Kind::Float, tch::Device::Cpu)).tr();
        let mut buf = dev.alloc_host(1024).expect("buffer");
        assert!(stream.d2h(&mut buf, 0, &t, None).is_err(), "non-contiguous refused");
    }

    #[test]
    fn cuda_request_without_cuda_is_a_clear_error() {
        if crate::torch::init() {
            return; // a GPU machine: covered by the CUDA tests
        }
        let err = Device::cuda(0).expect_err("no CUDA here");
        assert!(err.to_string().starts_with("no CUDA device"), "{err}");
    }
}
