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
}

/// A copy stream.
pub(crate) trait StreamBackend: Send + Sync + fmt::Debug {
    fn wait(&self, event: &StreamEvent) -> Result<()>;
    /// A timed event after the work queued so far.
    fn record(&self) -> Result<StreamEvent>;
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
