//! Safe wrappers over the C++ shim and libtorch: start-up (CUDA visibility), saved-tensor hooks,
//! and the device allocator's statistics.

pub mod alloc;
pub(crate) mod ffi;
pub mod hooks;
mod init;
pub mod optim;

pub use alloc::{AllocatorStats, MemoryInfo};
pub use hooks::{SavedTensorHooks, SavedTensorStore, StorageWatch, TensorIdentity};
pub use init::{cuda_available, cuda_load_error, init};
