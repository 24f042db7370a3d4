//! The default CPU generator's state: read before a data-parallel group's ranks other than 0
//! build their models (whose random initial values are replaced by rank 0's) and put back
//! after, so that what the training loop draws next is what a one-device program draws.

use super::ffi;
use crate::error::{Error, Result};

/// A saved state of the default CPU generator.
#[derive(Debug, Clone)]
pub(crate) struct RngState(Vec<u8>);

/// The default CPU generator's state now (`None` when libtorch does not give it).
pub(crate) fn cpu_rng_state() -> Option<RngState> {
    // SAFETY: a null buffer asks for the size only.
    let n = unsafe { ffi::stagehand_cpu_rng_state(std::ptr::null_mut(), 0) };
    if n == 0 {
        return None;
    }
    let mut buf = vec![0u8; n];
    // SAFETY: `buf` holds `n` bytes, the size just read.
    let got = unsafe { ffi::stagehand_cpu_rng_state(buf.as_mut_ptr(), buf.len()) };
    (got == n).then_some(RngState(buf))
}

/// Puts the default CPU generator back to `state`.
pub(crate) fn set_cpu_rng_state(state: &RngState) -> Result<()> {
    let mut err = [0 as std::os::raw::c_char; 512];
    // SAFETY: `state` is a byte buffer of its length; `err` a writable buffer of its length.
    let rc = unsafe { ffi::stagehand_cpu_rng_set_state(state.0.as_ptr(), state.0.len(), err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        // SAFETY: the shim wrote a NUL-terminated message.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        return Err(Error::internal(format!("restoring the CPU random generator: {msg}")));
    }
    Ok(())
}
