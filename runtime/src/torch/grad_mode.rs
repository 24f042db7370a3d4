//! Autograd's grad mode, restored by a guard.

use std::os::raw::c_int;

/// Autograd's grad mode on this thread, set until dropped. tch's `with_grad` and `no_grad` do
/// not restore it when their closure panics, and a thread that catches a panic (the training
/// thread, an autograd worker) goes on running.
pub(crate) struct GradMode(bool);

impl GradMode {
    pub(crate) fn set(enabled: bool) -> GradMode {
        // SAFETY: sets a thread-local flag of libtorch and returns its previous value.
        GradMode(unsafe { torch_sys::at_grad_set_enabled(c_int::from(enabled)) } != 0)
    }
}

impl Drop for GradMode {
    fn drop(&mut self) {
        // SAFETY: as in `set`.
        unsafe { torch_sys::at_grad_set_enabled(c_int::from(self.0)) };
    }
}
