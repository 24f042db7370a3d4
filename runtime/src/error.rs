//! The crate's error type.

use crate::events::BlockState;

/// Everything that can go wrong in the runtime, with the offending value quoted.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(String),
    /// A CUDA driver call failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// A CUDA operation was asked for on a machine without a usable CUDA device.
    #[error("no CUDA device: {0}")]
    NoCuda(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {field} = {value}: {expected}")]
    Config {
        field: &'static str,
        value: String,
        expected: String,
    },
    /// A residency transition outside the eight valid edges.
    #[error("cannot transition block '{block}' from '{from}' to '{to}'")]
    InvalidTransition {
        block: String,
        from: BlockState,
        to: BlockState,
    },
    /// A block id that is not registered.
    #[error("unknown block '{0}'")]
    UnknownBlock(String),
    /// A request larger than the pool can ever satisfy.
    #[error("'{what}' needs {needed} bytes but {limit}")]
    TooLarge {
        what: String,
        needed: u64,
        limit: String,
    },
    /// A pool or runtime was used after shutdown.
    #[error("{0} is shut down")]
    Shutdown(&'static str),
    /// A refcount or lifecycle rule was broken.
    #[error("{0}")]
    State(String),
    /// Reading weights or telemetry failed.
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// The Conductor refused a call (a phase out of order, an adapter registered twice).
    #[error("conductor: {0}")]
    Conductor(#[from] crate::conductor::Error),
}

#[cfg(feature = "torch")]
impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        Error::Torch(e.to_string())
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
