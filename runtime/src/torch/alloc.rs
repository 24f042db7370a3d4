//! The CUDA caching allocator's statistics: the VRAM signal for watermarks (what
//! `torch.cuda.memory_allocated` reads in Python).

use super::ffi;
use crate::error::{Error, Result};
use std::os::raw::c_char;

/// Bytes held by libtorch's CUDA caching allocator on one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    pub allocated: u64,
    pub allocated_peak: u64,
    pub reserved: u64,
    pub reserved_peak: u64,
    pub active: u64,
    pub active_peak: u64,
    pub num_ooms: u64,
    pub num_alloc_retries: u64,
}

/// Free and total device memory as the driver reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free: u64,
    pub total: u64,
}

fn check(rc: i32, err: &[c_char], what: &str) -> Result<bool> {
    match rc {
        0 => Ok(true),
        1 => Ok(false),
        _ => Err(Error::Torch(tch::TchError::Torch(format!("{what}: {}", ffi::message(err))))),
    }
}

/// Statistics of `device`, or `None` while the CUDA allocator is not initialized (no CUDA, or
/// nothing allocated on the device yet).
pub fn cuda_stats(device: usize) -> Result<Option<AllocatorStats>> {
    let mut out = ffi::AllocStats::default();
    let mut err = [0 as c_char; 1024];
    // SAFETY: `out` and `err` are valid for writes of their sizes.
    let rc = unsafe {
        ffi::stagehand_cuda_alloc_stats(device as i32, &mut out, err.as_mut_ptr(), err.len())
    };
    let pos = |v: i64| v.max(0) as u64;
    Ok(check(rc, &err, "reading allocator statistics")?.then(|| AllocatorStats {
        allocated: pos(out.allocated_current),
        allocated_peak: pos(out.allocated_peak),
        reserved: pos(out.reserved_current),
        reserved_peak: pos(out.reserved_peak),
        active: pos(out.active_current),
        active_peak: pos(out.active_peak),
        num_ooms: pos(out.num_ooms),
        num_alloc_retries: pos(out.num_alloc_retries),
    }))
}

/// Resets the peak statistics of `device`. Returns false when there is no CUDA allocator.
pub fn cuda_reset_peak(device: usize) -> Result<bool> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: `err` is valid for writes of its size.
    let rc = unsafe { ffi::stagehand_cuda_reset_peak(device as i32, err.as_mut_ptr(), err.len()) };
    check(rc, &err, "resetting peak statistics")
}

/// Returns cached, unused device memory to the driver. False when there is no CUDA allocator.
pub fn cuda_empty_cache() -> Result<bool> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: `err` is valid for writes of its size.
    let rc = unsafe { ffi::stagehand_cuda_empty_cache(err.as_mut_ptr(), err.len()) };
    check(rc, &err, "emptying the cache")
}

/// Free and total memory of `device`, or `None` without a CUDA allocator.
pub fn cuda_mem_info(device: usize) -> Result<Option<MemoryInfo>> {
    let (mut free, mut total) = (0u64, 0u64);
    let mut err = [0 as c_char; 1024];
    // SAFETY: all out-parameters are valid for writes.
    let rc = unsafe {
        ffi::stagehand_cuda_mem_info(device as i32, &mut free, &mut total, err.as_mut_ptr(), err.len())
    };
    Ok(check(rc, &err, "reading memory info")?.then_some(MemoryInfo { free, total }))
}
