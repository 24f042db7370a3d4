#![doc = include_str!("../README.md")]

pub mod catalog;
#[cfg(feature = "otlp")]
pub mod collector;
pub mod mapping;
pub mod metrics;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod trace;

pub use catalog::{Metric, MetricDef, CATALOG};
pub use metrics::{DeviceLabels, Metrics, TEXT_CONTENT_TYPE};
#[cfg(feature = "otlp")]
pub use otlp::OtelSink;

/// What can go wrong while exporting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Prometheus registry refused a metric (a name or label clash).
    #[error("prometheus: {0}")]
    Prometheus(#[from] prometheus::Error),
    /// Output could not be encoded.
    #[error("could not encode the output: {0}")]
    Encode(String),
    /// The telemetry file could not be read.
    #[error("telemetry: {0}")]
    Telemetry(#[from] stagehand_events::jsonl::JsonlError),
    /// Reading or writing a file failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// An OpenTelemetry exporter could not be built or flushed.
    #[error("opentelemetry: {0}")]
    Otel(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
