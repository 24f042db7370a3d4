//! The CUDA backend: cudarc on the primary context that libtorch uses, so device pointers are
//! interchangeable between the two.

use super::backend::{Backend, EventBackend, StreamBackend};
use super::{StreamEvent, HostBuffer, MemoryReading};
use crate::error::{Error, Result};
use crate::events::{DeviceInfo, DeviceKind};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use std::any::Any;
use std::sync::Arc;

fn cuda_err(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |source| Error::Cuda { what, source }
}

#[derive(Debug)]
pub(super) struct CudaBackend {
    ctx: Arc<CudaContext>,
    name: String,
    total: u64,
}

impl CudaBackend {
    pub(super) fn new(ordinal: usize) -> Result<CudaBackend> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the CUDA context"))?;
        let name = ctx.name().unwrap_or_else(|_| format!("cuda:{ordinal}"));
        let total = ctx.total_mem().map(|v| v as u64).unwrap_or(0);
        Ok(CudaBackend { ctx, name, total })
    }

    /// A new event; only `timed` ones can be measured against each other (an event without
    /// timing costs a copy stream nothing, see `StreamBackend::timed_every`).
    fn event(ctx: &Arc<CudaContext>, timed: bool) -> Result<CudaEvent> {
        let flags = if timed { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        ctx.new_event(Some(flags)).map_err(cuda_err("creating an event"))
    }
}

fn cuda_event(e: &StreamEvent) -> Option<&CudaEventBackend> {
    e.0.as_any().downcast_ref::<CudaEventBackend>()
}

impl Backend for CudaBackend {
    fn tch_device(&self) -> tch::Device {
        tch::Device::Cuda(self.ctx.ordinal())
    }

    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Cuda,
            index: self.ctx.ordinal() as u32,
            name: self.name.clone(),
            total_bytes: self.total,
        }
    }

    fn compute_capability(&self) -> Option<(u32, u32)> {
        let (major, minor) = self.ctx.compute_capability().ok()?;
        Some((u32::try_from(major).ok()?, u32::try_from(minor).ok()?))
    }

    fn memory(&self) -> MemoryReading {
        match crate::torch::alloc::cuda_stats(self.ctx.ordinal()) {
            Ok(Some(s)) => MemoryReading {
                allocated: s.allocated,
                reserved: s.reserved,
                peak: s.allocated_peak,
            },
            _ => MemoryReading::default(),
        }
    }

    fn reset_peak(&self) {
        let _ = crate::torch::alloc::cuda_reset_peak(self.ctx.ordinal());
    }

    fn account(&self, _delta: i64) {}

    fn claim(&self, _bytes: u64, _what: &dyn Fn() -> String) -> Result<()> {
        // libtorch's allocator refuses for itself, with its own out-of-memory error.
        Ok(())
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        if bytes >= super::pinning::MIN_BYTES {
            // Where registering is refused (a driver or host that does not allow it), the
            // allocation below pins the same memory, only more slowly.
            if let Ok(mem) = super::pinning::Registered::new(bytes, self.ctx.clone()) {
                return Ok(HostBuffer::registered(mem, bytes));
            }
        }
        self.ctx.bind_to_thread().map_err(cuda_err("binding the context"))?;
        // Flags 0: cacheable pinned memory. The cudarc default is write-combined, which is slow
        // for the CPU to read after a D2H copy.
        // SAFETY: a plain allocation; ownership passes to the HostBuffer, which frees it.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(cuda_err("allocating pinned host memory"))?;
        // SAFETY: `ptr` was just allocated by cuMemHostAlloc in `ctx` with `bytes` bytes.
        Ok(unsafe { HostBuffer::pinned(ptr as *mut u8, bytes, self.ctx.clone()) })
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        // Non-blocking with respect to the legacy default stream libtorch computes on.
        let stream = self.ctx.new_stream().map_err(cuda_err("creating a copy stream"))?;
        Ok(Box::new(CudaStreamBackend { stream }))
    }

    fn record_compute(&self) -> Result<StreamEvent> {
        let ev = Self::event(&self.ctx, true)?;
        // SAFETY: the null stream is libtorch's (legacy default) compute stream; the event is live.
        unsafe { result::event::record(ev.cu_event(), std::ptr::null_mut()) }
            .map_err(cuda_err("recording on the compute stream"))?;
        Ok(StreamEvent(Arc::new(CudaEventBackend(ev))))
    }

    fn compute_wait(&self, event: &StreamEvent) -> Result<()> {
        let Some(e) = cuda_event(event) else { return Ok(()) };
        // SAFETY: both the null stream and the event are valid.
        unsafe {
            result::stream::wait_event(
                std::ptr::null_mut(),
                e.0.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("making the compute stream wait"))
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(cuda_err("synchronizing"))
    }

    fn cuda_context(&self) -> Option<Arc<CudaContext>> {
        Some(self.ctx.clone())
    }
}

/// A non-blocking stream for work another library queues (NCCL's collectives), ordered against
/// the compute stream and the copy streams with events like theirs.
#[derive(Debug)]
pub(crate) struct SideStream {
    stream: Arc<CudaStream>,
}

impl SideStream {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<SideStream> {
        Ok(SideStream { stream: ctx.new_stream().map_err(cuda_err("creating a side stream"))? })
    }

    /// The raw stream handle (a `cudaStream_t`) to give the library.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Makes the stream wait for `event` (no host synchronisation).
    pub(crate) fn wait(&self, event: &StreamEvent) -> Result<()> {
        match cuda_event(event) {
            Some(e) => self.stream.wait(&e.0).map_err(cuda_err("making a side stream wait")),
            None => Ok(()),
        }
    }

    /// An event after the work queued so far (`timed` ones can be measured against each other).
    pub(crate) fn record(&self, timed: bool) -> Result<StreamEvent> {
        let ev = CudaBackend::event(self.stream.context(), timed)?;
        ev.record(&self.stream).map_err(cuda_err("recording on a side stream"))?;
        Ok(StreamEvent(Arc::new(CudaEventBackend(ev))))
    }

    /// Makes the stream's context current on the calling thread (a library call uses the
    /// thread's current device).
    pub(crate) fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(cuda_err("binding the context"))
    }
}

/// One copy in this many on a CUDA copy stream is timed (see `StreamBackend::timed_every`): at
/// 16, timing costs the link about 0.16 µs a copy on average and a step of 146 copies still
/// measures nine.
const TIMED_COPY_EVERY: u64 = 16;

#[derive(Debug)]
struct CudaStreamBackend {
    stream: Arc<CudaStream>,
}

impl StreamBackend for CudaStreamBackend {
    fn wait(&self, event: &StreamEvent) -> Result<()> {
        match cuda_event(event) {
            Some(e) => self.stream.wait(&e.0).map_err(cuda_err("making a copy stream wait")),
            None => Ok(()),
        }
    }

    fn record(&self, timed: bool) -> Result<StreamEvent> {
        let ctx = self.stream.context();
        let ev = CudaBackend::event(ctx, timed)?;
        ev.record(&self.stream).map_err(cuda_err("recording an event"))?;
        Ok(StreamEvent(Arc::new(CudaEventBackend(ev))))
    }

    fn timed_every(&self) -> u64 {
        TIMED_COPY_EVERY
    }

    unsafe fn h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: guaranteed by the caller (valid ranges until the copy completes).
        let src = unsafe { std::slice::from_raw_parts(src, len) };
        // SAFETY: as above.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err("issuing an H2D copy"))
    }

    unsafe fn d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: guaranteed by the caller (valid ranges, `dst` unread until the copy completes).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err("issuing a D2H copy"))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("synchronizing a copy stream"))
    }
}

#[derive(Debug)]
struct CudaEventBackend(CudaEvent);

impl EventBackend for CudaEventBackend {
    fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    fn synchronize(&self) -> Result<()> {
        self.0.synchronize().map_err(cuda_err("waiting for an event"))
    }

    fn elapsed_ms(&self, end: &dyn EventBackend) -> Option<f64> {
        let end = end.as_any().downcast_ref::<CudaEventBackend>()?;
        if !self.0.is_complete() || !end.0.is_complete() {
            return None;
        }
        self.0.elapsed_ms(&end.0).ok().map(f64::from)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
