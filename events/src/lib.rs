#![doc = include_str!("../README.md")]

pub mod bus;
pub mod describe;
pub mod insight;
pub mod jsonl;
pub mod model;
pub mod preamble;
pub mod replay;
pub mod snapshot;
pub mod steps;
#[cfg(any(test, feature = "synthetic"))]
pub mod synthetic;
pub mod telemetry;
pub mod wire;

#[cfg(test)]
mod proptests;

pub use bus::{Bus, EventSink, Hub, SnapshotSink};
pub use jsonl::{JsonlSink, OpenMode, ReadReport};
pub use model::*;
pub use replay::{Replay, ReplayStatus};
pub use snapshot::Snapshot;
pub use telemetry::{Level, Telemetry, TelemetryConfig};
pub use wire::{StreamMessage, DEFAULT_SERVER_ADDR};
