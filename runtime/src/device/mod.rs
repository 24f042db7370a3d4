//! The device layer: copy streams, events, pinned host buffers and async copies, over two peer
//! backends behind one `Backend` trait:
//!
//! - `cuda`: cudarc (loaded dynamically, no toolkit needed) on the primary context that libtorch
//!   also uses; non-blocking copy streams; pinned host memory allocated with flags 0 (not
//!   write-combined, so the CPU reads D2H results quickly), large buffers page-locked in place
//!   on huge pages (`pinning`); async copies on raw device pointers
//!   taken from tensors; the compute stream (libtorch's legacy default stream) made to wait on
//!   copy events without blocking the host.
//! - `host`: the same work done synchronously on a machine without CUDA. "VRAM" is an accounted
//!   budget ([`Device::account`]), copies are `memcpy`, events are complete when made.
//!
//! Cross-stream memory safety (see `docs/design.md`, "Copies and streams"): a copy that reads or
//! writes a tensor from libtorch's allocator is ordered after the compute stream's work
//! ([`Order::AfterCompute`]); a copy into a device slab the runtime owns waits only for that
//! slab's last use ([`Order::After`]); the compute stream waits on a copy's event before using
//! its result ([`Device::compute_wait`]); and a copy's [`Pending`] owns the host memory it reads or
//! writes and keeps its device tensor alive until the copy completed, so misuse does not compile.

mod backend;
pub mod bandwidth;
mod buffer;
mod copy;
mod cuda;
pub(crate) mod dequant;
mod host;
pub(crate) mod idle;
mod pinning;
pub mod pool;

pub use buffer::{HostBuffer, HostMemory, HostTarget};
pub(crate) use cuda::SideStream;
pub use copy::{CopyStream, Failed, Order, Pending, WaitProbe};
pub use idle::{IdleProbe, IdleSpan, IdleSpans};
pub use pool::{HostPool, HostPoolStats};

use crate::error::{Error, Result};
use crate::events::{DeviceInfo, TransferId};
use backend::{Backend, EventBackend};
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
struct Shared {
    backend: Box<dyn Backend>,
    /// The one source of transfer ids of a run: every runtime on this device draws from it, so
    /// ids are unique across weights and activations.
    next_transfer: AtomicU64,
}

/// A compute device: a CUDA GPU, or the host device that simulates one. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Device {
    shared: Arc<Shared>,
}

impl Device {
    fn with(backend: Box<dyn Backend>) -> Device {
        Device {
            shared: Arc::new(Shared {
                backend,
                next_transfer: AtomicU64::new(0),
            }),
        }
    }

    /// CUDA device `ordinal`; a clear "no CUDA device" error on a machine without one.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        if !crate::torch::init() {
            return Err(Error::NoCuda(
                crate::torch::cuda_load_error().unwrap_or_else(|| "libtorch reports no CUDA device".into()),
            ));
        }
        Ok(Device::with(Box::new(cuda::CudaBackend::new(ordinal)?)))
    }

    /// The host device, with `budget_bytes` of simulated VRAM.
    pub fn host(budget_bytes: u64) -> Device {
        Device::host_numbered(budget_bytes, 0)
    }

    /// Simulated device number `index` with `budget_bytes` of simulated VRAM: several stand for
    /// the GPUs of a data-parallel group on a machine without CUDA.
    pub fn host_numbered(budget_bytes: u64, index: u32) -> Device {
        Device::with(Box::new(host::HostBackend::new(budget_bytes, index)))
    }

    /// CUDA device 0 when present, otherwise the host device with `host_budget_bytes`.
    pub fn auto(host_budget_bytes: u64) -> Device {
        Device::cuda(0).unwrap_or_else(|_| Device::host(host_budget_bytes))
    }

    fn backend(&self) -> &dyn Backend {
        &*self.shared.backend
    }

    /// Whether this is a real CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.tch_device().is_cuda()
    }

    /// The tch device that tensors of this device live on.
    pub fn tch_device(&self) -> tch::Device {
        self.backend().tch_device()
    }

    /// Whether the device computes bfloat16 at full speed: CUDA compute capability 8.0 or
    /// later (Ampere, Hopper), whose tensor cores take bf16. The host device does not.
    pub fn computes_bf16_fast(&self) -> bool {
        self.backend().compute_capability().is_some_and(|(major, _)| major >= 8)
    }

    /// What dashboards show about this device.
    pub fn info(&self) -> DeviceInfo {
        self.backend().info()
    }

    /// Makes libtorch allocate what it keeps for itself once work starts, so that a reading
    /// taken afterwards counts it: on CUDA, cuBLAS's workspaces (tens of MiB on recent GPUs, one
    /// per thread that runs matrix products: the forward's and autograd's) come from the same
    /// allocator as tensors and stay allocated. Runs one small product forward and backward on
    /// this thread and on autograd's; nothing on the host device.
    pub fn warm_up(&self) -> crate::error::Result<()> {
        if !self.is_cuda() {
            return Ok(());
        }
        let dev = self.tch_device();
        // With gradients on whatever the caller's mode: the first use may come inside
        // `no_grad` (a frozen model's forward, an evaluation before any step), where the
        // product would not require a gradient and its backward would fail.
        tch::with_grad(|| -> crate::error::Result<()> {
            let a = tch::Tensor::f_ones([64, 64], (tch::Kind::Float, dev))?.set_requires_grad(true);
            let b = tch::Tensor::f_ones([64, 64], (tch::Kind::Float, dev))?;
            a.f_matmul(&b)?.f_sum(tch::Kind::Float)?.f_backward()?;
            Ok(())
        })?;
        self.synchronize()
    }

    /// Current, reserved and peak device memory.
    pub fn memory(&self) -> MemoryReading {
        self.backend().memory()
    }

    /// Restarts the peak from the current value.
    pub fn reset_peak(&self) {
        self.backend().reset_peak()
    }

    /// On the host device, adds `delta` bytes to the simulated VRAM (runtimes report what they
    /// hold "on the device"). On CUDA the allocator counts real bytes, so this does nothing.
    pub fn account(&self, delta: i64) {
        self.backend().account(delta)
    }

    /// A new transfer id, unique among all copies on this device.
    pub fn next_transfer_id(&self) -> TransferId {
        TransferId(self.shared.next_transfer.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Allocates a host buffer for copies: pinned on CUDA (allocate once, never on a hot path),
    /// plain aligned memory on the host device.
    pub fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        self.backend().alloc_host(bytes)
    }

    /// A device tensor of `bytes` bytes (uint8) owned by the caller, for runtime-owned slabs. On
    /// the host device it is accounted as simulated VRAM until [`Device::account`] gives it back,
    /// and refused with [`Error::DeviceFull`] when the budget cannot hold it.
    pub fn alloc_slab(&self, bytes: usize) -> Result<Tensor> {
        self.alloc_slab_for(bytes, || "a device slab".into())
    }

    /// [`alloc_slab`](Self::alloc_slab), naming what the slab is for in an out-of-memory error.
    pub fn alloc_slab_for(&self, bytes: usize, what: impl Fn() -> String) -> Result<Tensor> {
        self.backend().claim(bytes as u64, &what)?;
        match Tensor::f_empty([bytes as i64], (tch::Kind::Uint8, self.tch_device())) {
            Ok(t) => Ok(t),
            Err(e) => {
                self.backend().account(-(bytes as i64));
                Err(e.into())
            }
        }
    }

    /// A new stream for work another library queues on this device (NCCL's collectives);
    /// `None` on the host device, whose collectives run on the calling thread.
    pub(crate) fn side_stream(&self) -> Result<Option<SideStream>> {
        match self.backend().cuda_context() {
            Some(ctx) => Ok(Some(SideStream::new(&ctx)?)),
            None => Ok(None),
        }
    }

    /// Makes this device current on the calling thread (CUDA: its primary context, which the
    /// runtime and libtorch share), so that work queued on the compute stream from this thread
    /// goes to this device. A no-op on the host device. Each rank's thread of a data-parallel
    /// group calls it first.
    pub fn bind_to_thread(&self) -> Result<()> {
        match self.backend().cuda_context() {
            Some(ctx) => ctx.bind_to_thread().map_err(|source| Error::Cuda { what: "binding the context", source }),
            None => Ok(()),
        }
    }

    /// A new non-blocking copy stream.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        Ok(CopyStream::new(self.clone(), self.backend().new_stream()?))
    }

    /// An event recorded on the compute stream (libtorch's current, legacy default stream),
    /// with timing.
    pub fn record_compute(&self) -> Result<StreamEvent> {
        self.backend().record_compute()
    }

    /// Makes the compute stream wait for `event` (no host synchronisation).
    pub fn compute_wait(&self, event: &StreamEvent) -> Result<()> {
        self.backend().compute_wait(event)
    }

    /// Like [`compute_wait`](Self::compute_wait), and measures how long the compute stream will
    /// sit idle for `event`: timed events recorded on the compute stream before and after the
    /// wait (timed events cost the compute stream nothing measurable; `event`, a copy's, may
    /// carry no time).
    pub fn compute_wait_timed(&self, event: &StreamEvent) -> Result<WaitProbe> {
        let before = self.record_compute()?;
        self.compute_wait(event)?;
        Ok(WaitProbe::new(before, self.record_compute()?))
    }

    /// Blocks the host until the compute stream is idle (tests, step ends that read results,
    /// shutdown).
    pub fn synchronize(&self) -> Result<()> {
        self.backend().synchronize()
    }

    /// Bytes of a contiguous tensor on this device, or an error naming what is wrong.
    fn check_tensor(&self, t: &Tensor, what: &str) -> Result<usize> {
        if t.device() != self.tch_device() {
            return Err(Error::Config {
                field: "tensor",
                value: format!("{what} on {:?}", t.device()),
                expected: format!("a tensor on {:?}", self.tch_device()),
            });
        }
        if !t.is_contiguous() {
            return Err(Error::Config {
                field: "tensor",
                value: format!("{what} with strides {:?}", t.stride()),
                expected: "a contiguous tensor".into(),
            });
        }
        Ok(t.numel() * t.kind().elt_size_in_bytes())
    }
}

/// A completion marker for work on a stream. Events of the host device are complete when made
/// and carry the host time they were made at, so copy durations are measured there too.
#[derive(Debug, Clone)]
pub struct StreamEvent(Arc<dyn EventBackend>);

impl StreamEvent {
    /// Whether the work before the event has finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    /// Blocks the host until the event completes.
    pub fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }

    /// Milliseconds from `self` to a later `end`, once both completed (`None` before, or when
    /// the two events come from different backends).
    pub fn elapsed_ms(&self, end: &StreamEvent) -> Option<f64> {
        self.0.elapsed_ms(&*end.0)
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
        let buf = dev.alloc_host(4096).expect("buffer");
        let (buf, _) = stream.d2h(buf, 0, &src, Order::AfterCompute).expect("d2h").wait().expect("wait");
        let dst = Tensor::zeros([256], (Kind::Float, tch::Device::Cpu));
        let copy = stream.h2d(&dst, buf, 0, Order::AfterCompute).expect("h2d");
        assert!(copy.is_complete(), "host copies are synchronous");
        assert!(copy.elapsed_ms().is_some_and(|ms| ms >= 0.0), "host copies are timed");
        drop(copy);
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
        let err = stream.h2d(&big, buf, 0, Order::AfterCompute).expect_err("too small").error;
        assert!(err.to_string().contains("256 bytes"), "{err}");
        let t = Tensor::zeros([4, 4], (Kind::Float, tch::Device::Cpu)).tr();
        let buf = dev.alloc_host(1024).expect("buffer");
        let err = stream.d2h(buf, 0, &t, Order::AfterCompute).expect_err("non-contiguous refused").error;
        assert!(err.to_string().contains("contiguous"), "{err}");
    }

    #[test]
    fn transfer_ids_are_unique_across_clones() {
        let dev = Device::host(0);
        let other = dev.clone();
        let ids: std::collections::HashSet<_> =
            (0..100).flat_map(|_| [dev.next_transfer_id(), other.next_transfer_id()]).collect();
        assert_eq!(ids.len(), 200);
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
