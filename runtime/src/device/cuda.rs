//! The CUDA backend: cudarc on the primary context that libtorch uses.

use super::{HostBuffer, MemoryReading};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

fn cuda_err(what: &str) -> impl Fn(result::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

#[derive(Debug)]
pub(super) struct CudaBackend {
    ctx: Arc<CudaContext>,
    name: String,
    total: u64,
}

impl CudaBackend {
    pub(super) fn new(ordinal: usize) -> Result<CudaBackend> {
        // The primary context: shared with libtorch, so device pointers are interchangeable.
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the CUDA context"))?;
        let name = ctx.name().unwrap_or_else(|_| format!("cuda:{ordinal}"));
        let total = ctx.total_mem().map(|v| v as u64).unwrap_or(0);
        Ok(CudaBackend { ctx, name, total })
    }

    pub(super) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub(super) fn name(&self) -> String {
        self.name.clone()
    }

    pub(super) fn total_bytes(&self) -> u64 {
        self.total
    }

    pub(super) fn memory(&self) -> MemoryReading {
        match crate::torch::alloc::cuda_stats(self.ordinal()) {
            Ok(Some(s)) => MemoryReading {
                allocated: s.allocated,
                reserved: s.reserved,
                peak: s.allocated_peak,
            },
            _ => MemoryReading::default(),
        }
    }

    pub(super) fn reset_peak(&self) {
        let _ = crate::torch::alloc::cuda_reset_peak(self.ordinal());
    }

    pub(super) fn alloc_pinned(&self, bytes: usize) -> Result<HostBuffer> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        // Flags 0: cacheable pinned memory. The cudarc default is write-combined, which is slow
        // for the CPU to read after a D2H copy.
        // SAFETY: a plain allocation; ownership passes to the HostBuffer, which frees it.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(cuda_err("allocating pinned host memory"))?;
        // SAFETY: `ptr` was just allocated by cuMemHostAlloc in `ctx` with `bytes` bytes.
        Ok(unsafe { HostBuffer::pinned(ptr as *mut u8, bytes, self.ctx.clone()) })
    }

    pub(super) fn new_stream(&self) -> Result<Arc<CudaStream>> {
        // Non-blocking with respect to the legacy default stream libtorch computes on.
        self.ctx.new_stream().map_err(cuda_err("creating a copy stream"))
    }

    pub(super) fn record_compute(&self) -> Result<CudaEvent> {
        let ev = self
            .ctx
            .new_event(None)
            .map_err(cuda_err("creating an event"))?;
        // SAFETY: the null stream is libtorch's (legacy default) compute stream; the event is live.
        unsafe { result::event::record(ev.cu_event(), std::ptr::null_mut()) }
            .map_err(cuda_err("recording on the compute stream"))?;
        Ok(ev)
    }

    pub(super) fn compute_wait(&self, ev: &CudaEvent) -> Result<()> {
        // SAFETY: both the null stream and the event are valid.
        unsafe {
            result::stream::wait_event(
                std::ptr::null_mut(),
                ev.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("making the compute stream wait"))
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(cuda_err("synchronizing"))
    }
}

/// An event with timing on `stream`.
pub(super) fn record_timed(stream: &CudaStream) -> Result<CudaEvent> {
    let ev = stream
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(cuda_err("creating an event"))?;
    ev.record(stream).map_err(cuda_err("recording an event"))?;
    Ok(ev)
}

/// Async host-to-device copy.
///
/// # Safety
/// `dst` must be a live device allocation of at least `src.len()` bytes, and `src` must stay
/// valid until the copy completes.
pub(super) unsafe fn h2d(stream: &CudaStream, dst: u64, src: &[u8]) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
        .map_err(cuda_err("issuing an H2D copy"))
}

/// Async device-to-host copy.
///
/// # Safety
/// `src` must be a live device allocation of at least `dst.len()` bytes until the copy
/// completes, and `dst` must stay valid and unread until then.
pub(super) unsafe fn d2h(stream: &CudaStream, dst: &mut [u8], src: u64) -> Result<()> {
    // SAFETY: guaranteed by the caller.
    unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
        .map_err(cuda_err("issuing a D2H copy"))
}
