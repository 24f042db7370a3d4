//! The contract between the weight runtime and whoever owns the saved-tensor hooks.
//!
//! Autograd saves views of managed weights for backward (`nn::linear` saves `W.t()`). If the
//! saved tensor kept the device storage alive, evicting the block would free nothing. So the
//! hook store asks the weight runtime to [`resolve`](WeightResolver::resolve) every saved tensor:
//! a managed weight is stored as a [`WeightSave`] (a handle: block, parameter, view geometry)
//! instead of a tensor, and in backward [`materialize`](WeightResolver::materialize) makes the
//! block resident again (a prefetch hit, or a counted stall) and rebuilds the same view.
//!
//! The activation runtime's store uses this for weights and spills the rest; the weight runtime
//! alone uses a store that keeps everything else as it is.

use crate::events::BlockId;
use tch::Tensor;

/// How to find a saved weight view again after its block was evicted and reloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSave {
    pub block: BlockId,
    /// Index of the parameter within its block.
    pub param: u32,
    /// The saved view's geometry relative to the parameter's storage.
    pub storage_offset: i64,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    /// Bytes of the view (for telemetry).
    pub bytes: u64,
}

/// Implemented by the weight runtime; called from the saved-tensor hooks (pack on the forward
/// thread; materialize and release possibly on an autograd worker thread).
pub trait WeightResolver: Send + Sync {
    /// `Some` when `tensor` views a managed weight (recognised by storage pointer: views and
    /// transposes count), `None` otherwise.
    fn resolve(&self, tensor: &Tensor) -> Option<WeightSave>;
    /// The saved view, resident on the device, ready for the compute stream.
    fn materialize(&self, save: &WeightSave) -> Result<Tensor, crate::error::HookError>;
    /// The saved variable holding `save` is gone.
    fn release(&self, save: &WeightSave);
    /// The block the forward is running now, as a region name for the tensors it saves
    /// (`blocks.3`), when the runtime knows it.
    fn current_region(&self) -> Option<std::sync::Arc<str>> {
        None
    }
}
