//! The Conductor's error type.

use crate::events::model::Phase;

/// Everything the Conductor can refuse with an error (as opposed to a denial, which is a
/// normal answer: see [`crate::events::model::DenyReason`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A phase method was called out of order.
    #[error("invalid phase transition {from} -> {to} at step {step}: expected one of {expected}")]
    InvalidPhaseTransition {
        step: u64,
        from: Phase,
        to: Phase,
        /// The phases that may follow `from`, comma separated.
        expected: String,
    },
    /// A configuration value is out of range.
    #[error("invalid conductor config: {field} = {value}: {expected}")]
    InvalidConfig {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    /// An adapter with this name is already registered.
    #[error("adapter {0:?} is already registered")]
    DuplicateAdapter(String),
}

/// The Conductor's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
