//! What a device backend provides: the host backend and the CUDA backend implement these traits
//! as peers, and [`super::Device`], [`super::CopyStream`] and [`super::StreamEvent`] dispatch to them.

use super::{StreamEvent, HostBuffer, MemoryReading};
use crate::error::Result;
use crate::events::DeviceInfo;
use std::any::Any;
use std::fmt;

/// A device: memory readings, host buffers for copies, streams, and the compute stream.
pub(crate) trait Backend: Send + Sync + fmt::Debug {
    fn tch_device(&self) -> tch::Device;
    fn info(&self) -> DeviceInfo;
    /// The CUDA compute capability (major, minor); `None` on the host device.
    fn compute_capability(&self) -> Option<(u32, u32)> {
        None
    }
    fn memory(&self) -> MemoryReading;
    fn reset_peak(&self);
    /// Simulated VRAM bookkeeping (the host backend); a no-op where an allocator counts.
    fn account(&self, delta: i64);
    /// Takes `bytes` of simulated VRAM for an allocation of the runtime's own, refusing what
    /// the budget cannot hold (the host backend); a no-op where an allocator counts and fails
    /// by itself. `what` names the allocation in the error.
    fn claim(&self, bytes: u64, what: &dyn Fn() -> String) -> Result<()>;
    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer>;
    fn new_stream(&self) -> Result<Box<dyn StreamBackend>>;
    /// A timed event on the compute stream.
    fn record_compute(&self) -> Result<StreamEvent>;
    fn compute_wait(&self, event: &StreamEvent) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    /// The CUDA context (the CUDA backend): for streams of libraries the runtime drives itself
    /// (NCCL's collectives).
    fn cuda_context(&self) -> Option<std::sync::Arc<cudarc::driver::CudaContext>> {
        None
    }
}

/// A copy stream.
pub(crate) trait StreamBackend: Send + Sync + fmt::Debug {
    fn wait(&self, event: &StreamEvent) -> Result<()>;
    /// An event after the work queued so far; only `timed` ones can be measured against each
    /// other.
    fn record(&self, timed: bool) -> Result<StreamEvent>;
    /// One copy in this many is timed. A timed event on a CUDA copy stream holds up the copy
    /// queued after it by about 1.3 µs (measured on an H200; an event without timing costs
    /// nothing measurable): two a copy came to 0.4 ms, 0.4% of the link, in a step streaming
    /// 146 weight units. The host device's events cost nothing, so it times every copy.
    fn timed_every(&self) -> u64;
    /// Copies `len` bytes from host `src` to device address `dst`.
    ///
    /// # Safety
    /// `dst` must be a live device allocation of at least `len` bytes and `src` valid for `len`
    /// bytes, both until the stream's next recorded event completes.
    unsafe fn h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// Copies `len` bytes from device address `src` to host `dst`.
    ///
    /// # Safety
    /// As [`h2d`](Self::h2d), and nothing may read `dst` until that event completes.
    unsafe fn d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
}

/// An event of one backend.
pub(crate) trait EventBackend: Send + Sync + fmt::Debug {
    fn is_complete(&self) -> bool;
    fn synchronize(&self) -> Result<()>;
    /// Milliseconds from `self` to `end` once both completed; `None` otherwise or when `end`
    /// belongs to another backend.
    fn elapsed_ms(&self, end: &dyn EventBackend) -> Option<f64>;
    fn as_any(&self) -> &dyn Any;
}
