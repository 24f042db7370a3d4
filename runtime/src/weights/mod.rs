//! Weight Stagehand: weights live in host memory (or in safetensors files) and stream to the
//! device block by block just before they are needed, so a model larger than VRAM trains.
//!
//! - [`registry`]: blocks and their flat, aligned byte layout.
//! - [`residency`]: the six-state machine, refcounts, `keep_resident` protection.
//! - [`pool`]: the uniform-slab pinned staging pool.
//! - [`policy`]: the itinerary (traced forward order + reversed backward), the prefetch window
//!   and the eviction score (distance to next use × size).
//! - `scheduler`: loads, prefetch, finalisation on copy events, eviction.
//! - [`runtime`]: [`WeightRuntime`], the block-mode API.
//! - [`handles`]: the saved-tensor store that turns saved weights into block handles.
//! - [`optim`]: offloaded AdamW on the host copies.
//! - [`file`]: safetensors-backed frozen blocks.
//!
//! Layer mode (drop-in layers) is [`crate::nn`].

pub mod config;
pub mod file;
pub mod handles;
pub mod optim;
pub mod policy;
pub mod pool;
pub mod registry;
pub mod residency;
pub mod runtime;
mod scheduler;

pub use config::{parse_bytes, WeightConfig, WeightConfigBuilder};
pub use handles::WeightStore;
pub use optim::OffloadedAdamW;
pub use policy::Itinerary;
pub use pool::{PinnedPool, PoolStats, Slab};
pub use registry::{BlockSpec, ParamSpec};
pub use runtime::{BlockGuard, WeightRuntime};
