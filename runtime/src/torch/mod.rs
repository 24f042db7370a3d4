//! Safe wrappers over the C++ shim and libtorch: start-up (CUDA visibility), saved-tensor hooks,
//! the device allocator's statistics, and libtorch's optimizers with their groups and state.

pub mod alloc;
pub mod amp;
pub mod attention;
pub(crate) mod capture;
pub(crate) mod ffi;
mod grad_mode;
pub mod hooks;
mod init;
pub mod optim;
pub(crate) mod optimizer;
pub(crate) mod rng;
pub(crate) mod variable;

pub use alloc::{AllocatorStats, MemoryInfo};
pub use hooks::{HookError, Recompute, RecomputeFn, SavedTensorHooks, SavedTensorStore, StorageWatch, TensorIdentity};
pub use init::{cuda_available, cuda_load_error, init};
pub use optimizer::{OptimizerClass, OptimizerOptions, ParamState, TorchOptimizer};
pub use variable::VariableId;

/// Bytes of a tensor's elements (its own, not its storage's).
pub(crate) fn tensor_bytes(t: &tch::Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}
