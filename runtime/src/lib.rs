#![doc = include_str!("../README.md")]

pub mod checkpoint;
pub(crate) mod collective;
pub mod conductor;
pub mod device;
pub mod error;
/// The event vocabulary and spine (the `stagehand-events` crate): `stagehand::events::...` and
/// the runtime's own `crate::events::...` name it as before it was a crate of its own.
pub use stagehand_events as events;
pub mod guards;
pub mod activations;
pub mod nn;
pub mod oom;
pub mod optim;
pub mod parallel;
pub(crate) mod pinned;
pub mod precision;
pub mod saved;
pub mod session;
pub(crate) mod tensorfile;
#[cfg(test)]
pub(crate) mod test_support;
pub mod torch;
pub(crate) mod transfer;
pub mod weights;

pub use error::{Error, Result};
pub use oom::OomReport;
pub use precision::{LossScaler, Precision, QuantFormat, StateStorage};
pub use session::{Plan, Stagehand, StagehandBuilder, StepReport};
