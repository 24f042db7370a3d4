//! Gradient accumulation on the device (the default; `super::host_sum` adds on the host where
//! `host_gradient_sums` is on, and a data-parallel rank's shards always add here). A parameter's first
//! gradient of an accumulation window goes straight to its pinned host buffer; a later one (a
//! micro-batch after the first, a weight used twice) is added to the sum so far on the device:
//! the sum comes back from the host buffer into a scratch slab, the compute stream adds the new
//! gradient to it in place once it landed, and the sum then leaves as a first gradient does.
//! The sums come back on a copy stream of their own: on the sink's stream each would queue
//! behind the gradients going out before it, in the other direction of the link, and the
//! compute stream waits for it. The sink's next copy into that buffer is ordered after the add,
//! so after the read.
//!
//! The cost: one more copy each way per gradient, on the copy engines, and the compute stream
//! waits for the sum's return. The host's alternative costs host memory bandwidth and cores
//! instead, which the host optimizer, the copies and the training thread need: on an H100's
//! 16-core host it made steps slower (the benchmark notes, "Gradient sums on the host"). The
//! sum is the one autograd makes when it accumulates into `.grad` on the device, in the same
//! dtype.

use crate::device::{HostBuffer, HostMemory, Order, StreamEvent};
use crate::error::Result;
use crate::transfer::{Copier, Transfer};
use tch::{Kind, Tensor};

/// Alignment of each gradient's place in the scratch slab (bytes).
const ALIGN: u64 = 256;

/// A pinned host buffer read by a copy while its owner keeps it.
#[derive(Debug)]
struct HostRead {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only read, by the copy engine.
unsafe impl Send for HostRead {}

// SAFETY: the memory does not move (a `HostBuffer`'s allocation stays where it is while the
// value moves), and nothing writes or frees it before the read completes: the only writer is
// the sink's next copy into the buffer, ordered after the compute stream's add, which waits for
// the read, and the buffer is given back (and may be freed) only once that copy completed. The
// sink waits for every read before it reports its copies landed (`DeviceSum::wait_all`).
unsafe impl HostMemory for HostRead {
    fn host_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn host_len(&self) -> usize {
        self.len
    }
}

/// The device side of gradient accumulation: a scratch slab for the sums coming back, and the
/// copies reading them.
#[derive(Debug)]
pub(crate) struct DeviceSum {
    /// The sums' own copy stream.
    copier: Copier,
    /// Bytes, on the device; dropped at the end of each accumulation window.
    scratch: Option<Tensor>,
    /// The compute stream after the last add that read the scratch: the next sums may land in
    /// it once that has run. `None` for a slab libtorch just handed out, which the compute
    /// stream may still be using.
    free: Option<StreamEvent>,
    reads: Vec<Transfer<HostRead>>,
    /// Bytes brought back since the last `take_read_bytes`.
    read_bytes: u64,
}

impl DeviceSum {
    /// Sums brought back on `copier`'s stream (one no other copies use).
    pub(crate) fn new(copier: Copier) -> DeviceSum {
        DeviceSum { copier, scratch: None, free: None, reads: Vec::new(), read_bytes: 0 }
    }

    /// Adds to each device gradient the sum so far in its host buffer (`(buffer, gradient)`,
    /// the gradient contiguous, its bytes at the start of the buffer), in place, on the compute
    /// stream. The buffers may be written by copies ordered after the compute stream's work
    /// queued so far (`Order::AfterCompute`) right after: the adds wait for the reads.
    pub(crate) fn add_host_sums(&mut self, pairs: &[(&HostBuffer, &Tensor)], subject: &str) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let device = self.copier.device().clone();
        let sizes: Vec<u64> = pairs.iter().map(|(_, g)| crate::torch::tensor_bytes(g)).collect();
        for (&(buf, _), &bytes) in pairs.iter().zip(&sizes) {
            if (buf.host_len() as u64) < bytes {
                return Err(crate::Error::internal(format!(
                    "{subject}: a host gradient of {} bytes for a device gradient of {bytes}",
                    buf.host_len()
                )));
            }
        }
        let total: u64 = sizes.iter().map(|b| b.div_ceil(ALIGN) * ALIGN).sum();
        if self.scratch.as_ref().is_none_or(|s| (s.numel() as u64) < total) {
            // A larger slab: the old one's last reader is on the compute stream, which frees it
            // in order.
            self.scratch = Some(Tensor::f_empty([total as i64], (Kind::Uint8, device.tch_device()))?);
            self.free = None;
        }
        let scratch = self.scratch.as_ref().ok_or_else(|| crate::Error::internal("no scratch slab"))?;
        let mut views = Vec::with_capacity(pairs.len());
        let mut offset = 0u64;
        for (&(buf, g), &bytes) in pairs.iter().zip(&sizes) {
            let view = scratch.f_narrow(0, offset as i64, bytes as i64)?.f_view_dtype(g.kind())?.f_view(g.size().as_slice())?;
            offset += bytes.div_ceil(ALIGN) * ALIGN;
            let order = match &self.free {
                Some(e) => Order::After(e),
                None => Order::AfterCompute,
            };
            let read = HostRead { ptr: buf.host_ptr(), len: buf.host_len() };
            let t = self.copier.h2d(&view, read, 0, order, None, || format!("{subject}: the sum so far")).map_err(|f| f.error)?;
            self.reads.push(t);
            self.read_bytes += bytes;
            views.push(view);
        }
        // The reads share one stream: the compute stream waits for the last.
        if let Some(last) = self.reads.last() {
            device.compute_wait(last.done())?;
        }
        tch::no_grad(|| -> Result<()> {
            for (&(_, g), v) in pairs.iter().zip(&views) {
                let _ = g.shallow_clone().f_add_(v)?;
            }
            Ok(())
        })?;
        self.free = Some(device.record_compute()?);
        self.reap();
        Ok(())
    }

    /// Reports the reads that completed.
    fn reap(&mut self) {
        for t in std::mem::take(&mut self.reads) {
            if let Err(t) = self.copier.finish(t) {
                self.reads.push(t);
            }
        }
    }

    /// Bytes of sums brought back to the device since the last call.
    pub(crate) fn take_read_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.read_bytes)
    }

    /// Device bytes the scratch slab holds.
    pub(crate) fn device_bytes(&self) -> u64 {
        self.scratch.as_ref().map_or(0, |s| s.numel() as u64)
    }

    /// Waits for every read and gives the scratch slab back (the window's sums are all in).
    pub(crate) fn wait_all(&mut self) -> Result<()> {
        for t in std::mem::take(&mut self.reads) {
            self.copier.wait(t)?;
        }
        self.scratch = None;
        self.free = None;
        Ok(())
    }
}
