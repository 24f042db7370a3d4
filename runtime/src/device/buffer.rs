//! Host buffers for copies: pinned on CUDA, plain aligned memory on the host device.

use crate::error::{Error, Result};
use std::alloc::Layout;
use std::ops::Range;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// Alignment of every host buffer (page size: good for DMA and for any dtype).
const ALIGN: usize = 4096;

/// Where a pooled buffer's range goes back to when the buffer drops (the
/// [`HostPool`](super::HostPool)'s state). A trait of this file's so that the buffer needs
/// nothing of the pool that cuts it.
pub(super) trait Lender: Send + Sync + std::fmt::Debug {
    /// Takes back `len` bytes at `offset` of chunk `chunk`.
    fn release(&self, chunk: usize, offset: usize, len: usize);
}

#[derive(Debug)]
enum Owner {
    Heap(Layout),
    Pinned(Arc<cudarc::driver::CudaContext>),
    /// Anonymous memory page-locked in place (large buffers: see `pinning.rs`), held for its
    /// drop, which unregisters and unmaps it.
    Registered(#[allow(dead_code)] super::pinning::Registered),
    /// A range of a [`HostPool`](super::HostPool) chunk, given back when the buffer drops.
    Pooled { pool: Arc<dyn Lender>, chunk: usize, offset: usize, len: usize, pinned: bool },
    Empty,
}

/// An owned, fixed-size, page-aligned host buffer.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    owner: Owner,
}

// SAFETY: the buffer owns its memory exclusively; access goes through &self / &mut self.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access is read-only through `as_slice`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Zeroed pageable memory; an error (not an abort) when the host has none to give.
    pub(crate) fn pageable(len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Ok(HostBuffer {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
                owner: Owner::Empty,
            });
        }
        let too_large = || Error::TooLarge {
            what: "host buffer".into(),
            needed: len as u64,
            limit: "the host could not allocate that much memory".into(),
        };
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| too_large())?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(too_large());
        }
        Ok(HostBuffer {
            ptr,
            len,
            owner: Owner::Heap(layout),
        })
    }

    /// Wraps pinned memory from `cuMemHostAlloc`.
    ///
    /// # Safety
    /// `ptr` must come from `cuMemHostAlloc` in `ctx` with at least `len` bytes.
    pub(crate) unsafe fn pinned(
        ptr: *mut u8,
        len: usize,
        ctx: Arc<cudarc::driver::CudaContext>,
    ) -> HostBuffer {
        HostBuffer {
            ptr,
            len,
            owner: Owner::Pinned(ctx),
        }
    }

    /// Wraps `len` bytes of registered memory.
    pub(super) fn registered(mut mem: super::pinning::Registered, len: usize) -> HostBuffer {
        HostBuffer { ptr: mem.as_mut_ptr(), len, owner: Owner::Registered(mem) }
    }

    /// A buffer over a range of a pool's chunk.
    ///
    /// # Safety
    /// `ptr` must be valid for `len` bytes inside chunk `chunk` of `pool`, at `offset`, and no
    /// other buffer may use that range until this one gives it back (on drop).
    pub(super) unsafe fn pooled(
        ptr: *mut u8,
        bytes: usize,
        pinned: bool,
        pool: Arc<dyn Lender>,
        chunk: usize,
        offset: usize,
        len: usize,
    ) -> HostBuffer {
        HostBuffer {
            ptr,
            len: bytes,
            owner: Owner::Pooled { pool, chunk, offset, len, pinned },
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-sized buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is page-locked (copies can run asynchronously at full bandwidth).
    pub fn is_pinned(&self) -> bool {
        matches!(self.owner, Owner::Pinned(_) | Owner::Registered(_) | Owner::Pooled { pinned: true, .. })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` bytes and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Checks that `bytes` at `offset` fit.
    pub fn range(&self, offset: usize, bytes: usize) -> Result<Range<usize>> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.len => Ok(offset..end),
            _ => Err(Error::TooLarge {
                what: "copy".into(),
                needed: bytes as u64,
                limit: format!("the host buffer has {} bytes from offset {offset}", self.len),
            }),
        }
    }

    /// Copies a contiguous CPU tensor's bytes into the buffer at `offset`.
    pub fn write_tensor(&mut self, offset: usize, src: &Tensor) -> Result<usize> {
        let src = cpu_contiguous(src, "source")?;
        let bytes = src.numel() * src.kind().elt_size_in_bytes();
        let range = self.range(offset, bytes)?;
        // SAFETY: `src` is a contiguous CPU tensor of `bytes` bytes.
        let data = unsafe { std::slice::from_raw_parts(src.data_ptr() as *const u8, bytes) };
        self.as_mut_slice()[range].copy_from_slice(data);
        Ok(bytes)
    }

    /// Copies bytes at `offset` into a contiguous CPU tensor.
    pub fn read_into(&self, offset: usize, dst: &Tensor) -> Result<usize> {
        let dst = cpu_contiguous(dst, "destination")?;
        let bytes = dst.numel() * dst.kind().elt_size_in_bytes();
        let range = self.range(offset, bytes)?;
        // SAFETY: `dst` is a contiguous CPU tensor of `bytes` bytes that we may write.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_slice()[range].as_ptr(),
                dst.data_ptr() as *mut u8,
                bytes,
            )
        };
        Ok(bytes)
    }

    /// A new CPU tensor holding a copy of the bytes at `offset`.
    pub fn to_tensor(&self, offset: usize, kind: Kind, shape: &[i64]) -> Result<Tensor> {
        let t = Tensor::empty(shape, (kind, tch::Device::Cpu));
        self.read_into(offset, &t)?;
        Ok(t)
    }
}

/// Host memory a copy may read while it is in flight: a [`Pending`](super::Pending) owns it
/// until the copy completed, so it cannot be freed or moved from under the DMA engine.
///
/// # Safety
/// `host_ptr` must stay valid for `host_len` bytes for as long as the value lives, including
/// after the value is moved (heap or pinned allocations, never inline storage), and the memory
/// must not be written by anyone else while a copy reads it.
pub unsafe trait HostMemory: Send {
    /// Start of the memory.
    fn host_ptr(&self) -> *const u8;
    /// Bytes of memory.
    fn host_len(&self) -> usize;
}

/// Host memory a copy may write while it is in flight: owned exclusively, so nothing reads it
/// before the copy completed and the [`Pending`](super::Pending) hands it back.
///
/// # Safety
/// As [`HostMemory`], and `host_ptr_mut` must be the only way to reach the memory while the
/// value is owned by a copy.
pub unsafe trait HostTarget: HostMemory {
    /// Start of the memory, writable.
    fn host_ptr_mut(&mut self) -> *mut u8;
}

// SAFETY: the buffer owns its heap or pinned allocation, which does not move with the value.
unsafe impl HostMemory for HostBuffer {
    fn host_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn host_len(&self) -> usize {
        self.len
    }
}

// SAFETY: owned exclusively; `&mut self` is the only access.
unsafe impl HostTarget for HostBuffer {
    fn host_ptr_mut(&mut self) -> *mut u8 {
        self.ptr
    }
}

// SAFETY: a shared buffer is only read by copies (an `Arc` gives no `&mut`); writers of the
// memory through other means (tensor views) must wait until no copy holds a clone, which the
// weight runtime checks with `Arc::strong_count` before it changes host weights.
unsafe impl HostMemory for std::sync::Arc<HostBuffer> {
    fn host_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn host_len(&self) -> usize {
        self.len
    }
}

fn cpu_contiguous<'a>(t: &'a Tensor, what: &str) -> Result<&'a Tensor> {
    if t.device() != tch::Device::Cpu || !t.is_contiguous() {
        return Err(Error::Config {
            field: "tensor",
            value: format!("{what} on {:?} (contiguous: {})", t.device(), t.is_contiguous()),
            expected: "a contiguous CPU tensor".into(),
        });
    }
    Ok(t)
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match &self.owner {
            // SAFETY: allocated with this layout in `pageable`.
            Owner::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr, *layout) },
            Owner::Pinned(ctx) => {
                let _ = ctx.bind_to_thread();
                // SAFETY: allocated by cuMemHostAlloc in this context; freed once.
                let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut _) };
            }
            Owner::Pooled { pool, chunk, offset, len, .. } => pool.release(*chunk, *offset, *len),
            // Unregistered and unmapped by its own drop.
            Owner::Registered(_) | Owner::Empty => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_through_a_buffer() {
        let mut b = HostBuffer::pageable(1024).expect("memory");
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        let t = Tensor::arange(10, (Kind::Int64, tch::Device::Cpu));
        assert_eq!(b.write_tensor(16, &t).expect("write"), 80);
        let back = b.to_tensor(16, Kind::Int64, &[10]).expect("read");
        assert!(back.equal(&t));
        let err = b.write_tensor(1000, &t).expect_err("does not fit");
        assert!(err.to_string().contains("80 bytes"), "{err}");
    }
}
