#![doc = include_str!("../README.md")]

#[cfg(feature = "torch")]
pub mod checkpoint;
#[cfg(feature = "torch")]
pub(crate) mod collective;
pub mod conductor;
#[cfg(feature = "torch")]
pub mod device;
pub mod error;
pub mod events;
#[cfg(feature = "torch")]
pub mod guards;
#[cfg(feature = "torch")]
pub mod activations;
#[cfg(feature = "torch")]
pub mod nn;
pub mod oom;
#[cfg(feature = "torch")]
pub mod optim;
#[cfg(feature = "torch")]
pub mod parallel;
#[cfg(feature = "torch")]
pub(crate) mod pinned;
pub mod precision;
#[cfg(feature = "torch")]
pub mod saved;
#[cfg(feature = "torch")]
pub mod session;
#[cfg(feature = "torch")]
pub(crate) mod tensorfile;
#[cfg(feature = "torch")]
pub mod torch;
#[cfg(feature = "torch")]
pub(crate) mod transfer;
#[cfg(feature = "torch")]
pub mod weights;

pub use error::{Error, Result};
pub use oom::OomReport;
pub use precision::{LossScaler, Precision, QuantFormat, StateStorage};
#[cfg(feature = "torch")]
pub use session::{Plan, Stagehand, StagehandBuilder, StepReport};
