//! Activation Stagehand: spill saved tensors to a size-class pinned pool and restore them ahead
//! of backward.
//!
//! Inside [`ActivationRuntime::managed_forward`], every tensor autograd saves goes through the
//! runtime's [`ActivationStore`]: a managed weight becomes a handle for the weight runtime
//! ([`crate::saved::WeightResolver`]), small, off-device or parameter tensors are kept, and
//! activations are kept while device memory is under the high watermark and spilled above it
//! until it falls under the low one. A spill is an async D2H copy on a dedicated stream into a
//! slab of a `crate::pinned::SlabPool`; the device tensor is dropped only once its copy
//! completed. After the first step that spills, the pool is rebuilt to hold exactly what that step
//! held at once, so steady-state steps never copy through pageable memory.
//! In backward, unpack brings a spilled tensor back (the compute stream waits on the copy), and
//! the predictive restorer brings the next ones back ahead of need, following the reverse of the
//! pack order within a device allowance.
//!
//! Spilling can be scoped to named regions ([`ActivationRuntime::region`]), limited to a
//! fraction of the eligible bytes and to tensors above a minimum size; once the first step has
//! taught the runtime the order and size of the region groups, the last groups of the forward
//! (the first that backward needs) stay on the device.
//!
//! ```no_run
//! use stagehand::activations::{ActivationConfig, ActivationRuntime};
//! use stagehand::device::Device;
//! use stagehand::events::Bus;
//! # fn main() -> stagehand::Result<()> {
//! let config = ActivationConfig::builder().watermarks_mib(8_000, 6_000).build()?;
//! let acts = ActivationRuntime::new(Device::auto(1 << 30), config, Bus::disabled(), None)?;
//! # let (x, w) = (tch::Tensor::ones([4, 4], tch::kind::FLOAT_CPU), tch::Tensor::ones([4, 4], tch::kind::FLOAT_CPU).set_requires_grad(true));
//! acts.begin_step(1);
//! let loss = {
//!     let _hooks = acts.managed_forward()?;
//!     let _block = acts.region("blocks.0");
//!     x.matmul(&w).relu().sum(tch::Kind::Float)
//! };
//! loss.backward();
//! let metrics = acts.end_step()?;
//! # let _ = metrics;
//! # Ok(()) }
//! ```

pub mod config;
mod ctx;
pub(crate) mod policy;
pub(crate) mod record;
mod recompute;
mod restorer;
mod runtime;
mod sizing;
mod spills;
mod state;
mod store;

pub use config::{ActivationConfig, ActivationConfigBuilder};
pub use recompute::{f_recompute, recompute};
pub use runtime::{ActivationRuntime, HeldBytes, ManagedForward, RegionGuard};
pub use sizing::GroupProfile;
pub use store::ActivationStore;

#[cfg(test)]
mod tests;
