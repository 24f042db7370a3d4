//! The saved-tensor store autograd talks to while [`super::ActivationRuntime::managed_forward`]
//! is on: it hands each call to the runtime's state.

use super::state::Shared;
use crate::torch::{HookError, Recompute, SavedTensorStore};
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;

/// Where autograd's saved tensors go.
#[derive(Clone)]
pub struct ActivationStore {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ActivationStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationStore").finish_non_exhaustive()
    }
}

impl ActivationStore {
    pub(super) fn new(shared: Arc<Shared>) -> ActivationStore {
        ActivationStore { shared }
    }
}

/// Runs one hook call, adding its host time to the step's `host_ms`.
fn timed<T>(shared: &Shared, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let r = f();
    shared.add_host_ms(t0.elapsed().as_secs_f64() * 1e3);
    r
}

impl SavedTensorStore for ActivationStore {
    fn pack(&self, tensor: Tensor) -> std::result::Result<u64, HookError> {
        Ok(timed(&self.shared, || self.shared.pack(tensor))?)
    }

    fn unpack(&self, handle: u64) -> std::result::Result<Tensor, HookError> {
        Ok(timed(&self.shared, || self.shared.unpack(handle))?)
    }

    fn release(&self, handle: u64) {
        timed(&self.shared, || self.shared.release(handle));
    }

    fn open_recompute(&self) -> std::result::Result<bool, HookError> {
        Ok(self.shared.open_recompute()?)
    }

    fn close_recompute(&self, closing: Option<Recompute<'_>>) -> std::result::Result<(), HookError> {
        Ok(timed(&self.shared, || self.shared.close_recompute(closing))?)
    }
}
