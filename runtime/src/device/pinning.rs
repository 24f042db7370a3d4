//! Pinning large host buffers fast: anonymous memory on transparent huge pages, faulted in by
//! several threads at once, then page-locked with `cuMemHostRegister`.
//!
//! `cuMemHostAlloc` faults in and locks every 4 KiB page on the calling thread. On the GPU hosts
//! that ran at 1.3-2.5 GiB/s (H200 host, 16 cores, 2026-11-27: 4 GiB in 1.6-3.0 s), so a traced
//! activation pool of 8 GiB or a large model's gradient buffers cost seconds. With huge pages
//! the same 4 GiB faulted in on one thread in 0.62-0.69 s and registered in 0.08-0.09 s, and
//! copies from it ran at the same 55 GB/s; the faults (where the kernel zeroes the memory) are
//! spread over threads here as well. Buffers below [`MIN_BYTES`] keep `cuMemHostAlloc`, whose
//! fixed cost is lower than a mapping's.

use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaContext};
use memmap2::MmapMut;
use std::sync::Arc;

/// The smallest buffer pinned through a mapping (smaller ones use `cuMemHostAlloc`).
pub(super) const MIN_BYTES: usize = 8 << 20;

/// A transparent huge page: mappings are aligned and sized in these.
const HUGE: usize = 2 << 20;

/// The page every fault-in touches (a huge page where the kernel gave one, else each small one).
const PAGE: usize = 4096;

/// Bytes each fault-in thread takes at the least: below it a thread costs more than it saves.
const BYTES_PER_THREAD: usize = 64 << 20;

/// Page-locked anonymous memory: the mapping, the registered range inside it, and the context
/// it is registered in. Unregistered and unmapped on drop.
#[derive(Debug)]
pub(super) struct Registered {
    map: MmapMut,
    offset: usize,
    ctx: Arc<CudaContext>,
}

impl Registered {
    /// `bytes` (at least 1) of zeroed memory, page-locked for every context (portable), on huge
    /// pages where the kernel allows them (`madvise`; without them it is only slower).
    pub(super) fn new(bytes: usize, ctx: Arc<CudaContext>) -> Result<Registered> {
        let too_large = || Error::TooLarge {
            what: "pinned host buffer".into(),
            needed: bytes as u64,
            limit: "the host could not map that much memory".into(),
        };
        let len = bytes.max(1).checked_next_multiple_of(HUGE).ok_or_else(too_large)?;
        // One huge page more, so the registered range can start on a huge page boundary.
        let mut map = MmapMut::map_anon(len.checked_add(HUGE).ok_or_else(too_large)?).map_err(|_| too_large())?;
        #[cfg(target_os = "linux")]
        {
            // Refused where transparent huge pages are off: small pages work, more slowly.
            let _ = map.advise(memmap2::Advice::HugePage);
            // A forked child gets none of it, as with the driver's own pinned allocations: a
            // copy-on-write page would leave the device reading the parent's old one.
            map.advise(memmap2::Advice::DontFork).map_err(|e| Error::internal(format!("keeping pinned memory out of forked processes: {e}")))?;
        }
        let offset = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        fault_in(&mut map[offset..offset + len]);
        ctx.bind_to_thread().map_err(|source| Error::Cuda { what: "binding the context", source })?;
        // SAFETY: the range lies inside `map`, which outlives the registration (unregistered in
        // `drop` before the map is unmapped).
        unsafe {
            sys::cuMemHostRegister_v2(map.as_mut_ptr().add(offset).cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
                .result()
                .map_err(|source| Error::Cuda { what: "page-locking host memory", source })?;
        }
        Ok(Registered { map, offset, ctx })
    }

    /// The first byte of the registered range.
    pub(super) fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `offset` lies inside the mapping.
        unsafe { self.map.as_mut_ptr().add(self.offset) }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in `new`, unregistered once, before the mapping goes.
        let _ = unsafe { sys::cuMemHostUnregister(self.map.as_mut_ptr().add(self.offset).cast()) }.result();
    }
}

/// Touches every page of `mem`, on as many threads as the size warrants, so that the kernel
/// maps (and zeroes) them in parallel rather than one page at a time inside the registration.
fn fault_in(mem: &mut [u8]) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (mem.len() / BYTES_PER_THREAD).clamp(1, cores.min(16));
    // Whole huge pages per thread, so no two threads fault the same one.
    let share = mem.len().div_ceil(threads).next_multiple_of(HUGE);
    std::thread::scope(|s| {
        let mut parts = mem.chunks_mut(share);
        let first = parts.next();
        for part in parts {
            // A thread the system refuses leaves its part untouched: the registration faults it
            // in, only more slowly.
            let _ = std::thread::Builder::new().spawn_scoped(s, move || touch(part));
        }
        if let Some(part) = first {
            touch(part);
        }
    });
}

fn touch(part: &mut [u8]) {
    for i in (0..part.len()).step_by(PAGE) {
        // SAFETY: in bounds; volatile so the write (of the zero the page already holds) is kept.
        unsafe { std::ptr::write_volatile(part.as_mut_ptr().add(i), 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_is_touched_once_split_on_huge_pages() {
        let mut mem = vec![1u8; 3 * HUGE + 5 * PAGE];
        fault_in(&mut mem);
        for (i, b) in mem.iter().enumerate() {
            assert_eq!(*b, if i % PAGE == 0 { 0 } else { 1 }, "byte {i}");
        }
    }

    #[test]
    fn several_threads_touch_every_page_of_a_large_buffer() {
        // Three threads' worth where the machine has the cores (two on a 2-core one).
        let mut mem = vec![1u8; 3 * BYTES_PER_THREAD + 5 * PAGE];
        fault_in(&mut mem);
        for i in (0..mem.len()).step_by(PAGE) {
            assert_eq!((mem[i], mem[i + 1]), (0, 1), "page at {i}");
        }
    }
}
