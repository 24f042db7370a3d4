#![doc = include_str!("../README.md")]

pub mod conductor;
pub mod error;
pub mod events;
#[cfg(feature = "torch")]
pub mod torch;

pub use error::{Error, Result};
