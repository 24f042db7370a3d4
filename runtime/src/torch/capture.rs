//! A recompute scope's forward run again in backward: every tensor autograd saves while it
//! runs, in order, and an early stop once the last of them is saved.
//!
//! Backward needs what the scope's forward saved, and its output only where a later operation
//! saved that. What a function computes after its last save is then wasted: in a checkpointed
//! transformer block, the MLP's output projection (a third of the block's matmul work) and the
//! residual add after it. Given the number of saves to expect, the capture stops the function
//! at the last one, as PyTorch's `checkpoint` does with early stopping: the pack reports a stop,
//! the shim throws out of the operation (autograd packs an operation's inputs before it
//! launches the kernel, so the operation never runs), tch's operation panics with the error, and
//! the unwind is caught here. Those panics are not printed: a panic hook installed at the first
//! stop passes every other panic to the hook it replaced. Built with `panic = "abort"` the
//! function always runs to its end.

use super::grad_mode::GradMode;
use super::hooks::{set_stopping, stopping, SavedTensorHooks, SavedTensorStore};
use crate::error::HookError;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, Once};
use tch::Tensor;

/// What a recomputation saved, and its output unless it stopped early.
pub(crate) struct Captured {
    pub(crate) output: Option<Tensor>,
    pub(crate) saved: Vec<Tensor>,
}

/// Runs `f` with grad mode on; returns its output (detached) with every tensor autograd saved
/// while it ran, in order. With `stop_after = Some(n)`, `f` is stopped at its `n`-th save and
/// the output is `None`. A panic of `f`'s own is resumed.
pub(crate) fn capture_saved(f: impl FnOnce() -> Tensor, stop_after: Option<usize>) -> Result<Captured, HookError> {
    let stop_after = stop_after.filter(|_| cfg!(panic = "unwind"));
    if stop_after.is_some() {
        quiet_stops();
    }
    let capture = Arc::new(Capture {
        stop_after,
        inner: Mutex::new(Inner::default()),
    });
    let run = catch_unwind(AssertUnwindSafe(|| -> Result<Tensor, HookError> {
        let _grad = GradMode::set(true);
        let _hooks = SavedTensorHooks::enable(capture.clone()).map_err(|e| -> HookError { Box::new(e) })?;
        Ok(f().detach())
    }));
    set_stopping(false);
    let Inner { saved, stopped } = std::mem::take(&mut *capture.inner.lock().unwrap_or_else(|p| p.into_inner()));
    match run {
        // A function that carried on past the stop (it caught the error) returned something
        // other than its output.
        Ok(Ok(output)) => Ok(Captured { output: (!stopped).then_some(output), saved }),
        Ok(Err(e)) => Err(e),
        Err(_) if stopped => Ok(Captured { output: None, saved }),
        Err(panic) => resume_unwind(panic),
    }
}

/// Collects the tensors autograd saves, in order, instead of storing them; refuses the saves
/// from the stopping one on.
struct Capture {
    stop_after: Option<usize>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    saved: Vec<Tensor>,
    stopped: bool,
}

/// The handle of a save left out of the capture (never unpacked: see `unpack`).
const UNNAMED: u64 = u64::MAX;

const STOPPED: &str = "the recomputation stopped: backward has every tensor it needs";

impl SavedTensorStore for Capture {
    fn pack(&self, tensor: Tensor) -> Result<u64, HookError> {
        // A tensor of a kind tch cannot name (flash attention's RNG seed and offset on CUDA)
        // never became a member of the scope in the forward (the activation runtime keeps it
        // where it is, apart), so it is neither one of the saves to match nor one to count.
        if tensor.f_kind().is_err() {
            return Ok(UNNAMED);
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if !g.stopped {
            // Detached: a captured output must not hold its own graph.
            g.saved.push(tensor.detach());
            if self.stop_after != Some(g.saved.len()) {
                return Ok(g.saved.len() as u64 - 1);
            }
            g.stopped = true;
        }
        set_stopping(true);
        Err(STOPPED.into())
    }

    fn unpack(&self, handle: u64) -> Result<Tensor, HookError> {
        Err(format!("a recomputation's own graph is never run backward (handle {handle})").into())
    }

    fn release(&self, _handle: u64) {}
}

/// Installs, once, a panic hook that prints nothing for a recomputation's stop and hands every
/// other panic to the hook it replaced.
fn quiet_stops() {
    static QUIET: Once = Once::new();
    QUIET.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !stopping() {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The forward keeps a tensor of an unnamed kind apart from the scope's members, so the
    /// capture neither records it nor counts it toward the stop: with a stop after two saves, a
    /// function that saves one between two named tensors stops at the second named one.
    #[test]
    fn a_save_of_an_unnamed_kind_is_neither_captured_nor_counted() {
        let capture = Capture {
            stop_after: Some(2),
            inner: Mutex::new(Inner::default()),
        };
        let a = Tensor::ones([3], (Kind::Float, Device::Cpu));
        assert_eq!(capture.pack(a.shallow_clone()).expect("a first save"), 0);
        assert_eq!(capture.pack(crate::torch::hooks::unsigned_scalar()).expect("an unnamed kind"), UNNAMED);
        assert!(capture.pack(a.shallow_clone()).is_err(), "the second named save is the stop");
        set_stopping(false);
        let g = capture.inner.lock().expect("not poisoned");
        assert!(g.stopped);
        assert_eq!(g.saved.iter().map(Tensor::size).collect::<Vec<_>>(), vec![vec![3], vec![3]]);
    }
}
