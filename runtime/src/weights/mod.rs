//! Weight Stagehand: weights live in host memory (or in safetensors files) and stream to the
//! device block by block just before they are needed, so a model larger than VRAM trains.
//!
//! - `registry`: blocks and their flat, aligned byte layout, and a parameter's bytes in a host
//!   buffer viewed as a tensor.
//! - `residency`: the six-state machine, refcounts, `keep_resident` protection.
//! - `itinerary`: the order of a step's block uses, traced forward and backward, re-traced when
//!   a step runs another order.
//! - `evictor`: which block gives up its slot (Belady's farthest next use), and the minimum of
//!   loads a step needs.
//! - `slots`: the device room, one allocation cut into equal slots the runtime owns, so a load
//!   waits only for its slot's last use.
//! - `scheduler`: loads, prefetch, finalisation on copy events, eviction, gradients sent home
//!   as backward leaves each block, host optimizer steps gating loads, evaluations (forwards
//!   outside a step).
//! - `grads`: gradients sent home as backward leaves each block; later gradients of an
//!   accumulation window added into their sums on the host (`host_sum`, a worker beside the
//!   training thread) or on the device (`accumulate`, and a data-parallel rank's `reduce`).
//! - `stepper`: the worker thread that runs host optimizer steps in the order the next forward
//!   needs the blocks; the optimizer hands it jobs through its `Job` trait.
//! - `claims`: each variable managed by one block of one runtime, process-wide.
//! - [`runtime`]: [`WeightRuntime`], the block-mode API.
//! - `handles`: the saved-tensor store that turns saved weights into block handles.
//! - `file`: safetensors-backed frozen blocks.
//! - [`quant`]: frozen blocks stored quantized (INT8 or FP8 with block-wise scales), their
//!   payload dequantized in place in their slot before use.
//! - `payload`: the layout of a quantized block's payload (plain data the registry's specs
//!   hold; `quant` makes it).
//!
//! Layer mode (drop-in layers) is [`crate::nn`]; the optimizer for streamed weights is
//! [`crate::optim`].

mod accumulate;
mod block;
mod claims;
pub mod config;
pub(crate) mod evictor;
pub mod file;
mod grads;
mod host_sum;
pub(crate) mod handles;
pub(crate) mod itinerary;
mod loads;
mod payload;
pub mod quant;
mod reduce;
pub(crate) mod registry;
pub(crate) mod residency;
mod route;
mod shard;
pub(crate) mod shared;
pub mod runtime;
pub(crate) mod scheduler;
pub(crate) mod slots;
pub(crate) mod stepper;

pub use config::{parse_bytes, WeightConfig, WeightConfigBuilder};
pub use handles::WeightStore;
pub use itinerary::Itinerary;
pub use quant::QuantLayout;
pub use registry::{BlockSpec, ParamSpec};
pub use runtime::{BlockGuard, WeightRuntime};
