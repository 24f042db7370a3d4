//! The one table of metric definitions: every instrument the exporters expose, with its help,
//! unit, kind and labels. Prometheus ([`crate::metrics`]) and OpenTelemetry ([`crate::otlp`])
//! build their instruments from this table and take their values from one mapping
//! ([`crate::mapping`]), so they expose the same instruments with the same values.
//!
//! Names are derived, not written twice. An entry's `stem` (`transfer`, `phase.duration`) becomes
//! - for Prometheus: `stagehand_` + the stem with `_` for `.` + the base unit (`_bytes`,
//!   `_seconds`) unless the stem ends with it + `_total` for counters:
//!   `stagehand_transfer_bytes_total`, `stagehand_phase_duration_seconds`;
//! - for OpenTelemetry: `stagehand.` + the stem, with the unit in UCUM in the metadata:
//!   `stagehand.transfer` in `By`, `stagehand.phase.duration` in `s`, counts as `{block}`.
//!
//! These are the names an OTLP-to-Prometheus bridge (the OpenTelemetry Collector's Prometheus
//! exporter) derives from the OTel ones, so both paths land on the same series. No label carries
//! a block or tensor id: ids are unbounded, and a series per id would grow a scrape without limit.

/// Buckets for copy durations, in seconds: 20 us to 2 s (the event model's, which the
/// per-step counts are kept in).
pub const TRANSFER_BUCKETS: &[f64] = stagehand_events::model::COPY_SECONDS_BOUNDS;
/// Buckets for stalls of the compute stream, in seconds: 10 us to 1 s (as above).
pub const STALL_BUCKETS: &[f64] = stagehand_events::model::STALL_SECONDS_BOUNDS;
/// Buckets for phase and step durations, in seconds: 1 ms to 60 s.
pub const PHASE_BUCKETS: &[f64] = &[1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// What an instrument measures in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes: Prometheus `_bytes`, UCUM `By`.
    Bytes,
    /// Seconds: Prometheus `_seconds`, UCUM `s`.
    Seconds,
    /// A count of things, named by a UCUM annotation (`{block}`); no Prometheus suffix.
    Count(&'static str),
    /// A pure number (the loss): UCUM `1`; no Prometheus suffix.
    Dimensionless,
}

impl Unit {
    /// The unit in UCUM, as OpenTelemetry wants it.
    pub fn ucum(self) -> &'static str {
        match self {
            Unit::Bytes => "By",
            Unit::Seconds => "s",
            Unit::Count(a) => a,
            Unit::Dimensionless => "1",
        }
    }

    /// The Prometheus name suffix, if the unit has one.
    pub fn prometheus_suffix(self) -> Option<&'static str> {
        match self {
            Unit::Bytes => Some("bytes"),
            Unit::Seconds => Some("seconds"),
            Unit::Count(_) | Unit::Dimensionless => None,
        }
    }
}

/// The kind of instrument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// Only goes up (resets when the run, or a replay, starts over).
    Counter,
    /// A value that is set.
    Gauge,
    /// A distribution of observations, with these bucket bounds.
    Histogram(&'static [f64]),
}

impl Kind {
    /// The Prometheus type name.
    pub fn prometheus_type(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram(_) => "histogram",
        }
    }
}

/// One instrument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricDef {
    pub id: Metric,
    /// The name without prefix or unit, dotted (`phase.duration`).
    pub stem: &'static str,
    pub kind: Kind,
    pub unit: Unit,
    /// Label names, in the order observations give their values.
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

impl MetricDef {
    /// The Prometheus name: `stagehand_phase_duration_seconds`, `stagehand_transfer_bytes_total`.
    pub fn prometheus_name(&self) -> String {
        let mut n = format!("stagehand_{}", self.stem.replace('.', "_"));
        if let Some(s) = self.unit.prometheus_suffix() {
            if !n.ends_with(&format!("_{s}")) {
                n.push('_');
                n.push_str(s);
            }
        }
        if self.kind == Kind::Counter {
            n.push_str("_total");
        }
        n
    }

    /// The OpenTelemetry name: `stagehand.phase.duration`.
    pub fn otel_name(&self) -> String {
        format!("stagehand.{}", self.stem)
    }
}

macro_rules! catalog {
    ($( $(#[$doc:meta])* $id:ident => $stem:literal, $kind:expr, $unit:expr, [$($label:literal),*], $help:literal; )*) => {
        /// Every instrument, by name in code. `CATALOG[m as usize].id == m`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Metric { $( $(#[$doc])* $id ),* }

        /// The definitions, in [`Metric`] order.
        pub const CATALOG: &[MetricDef] = &[
            $( MetricDef { id: Metric::$id, stem: $stem, kind: $kind, unit: $unit, labels: &[$($label),*], help: $help } ),*
        ];
    };
}

use Kind::{Counter, Gauge, Histogram};
use Unit::{Bytes, Count, Dimensionless, Seconds};

catalog! {
    BuildInfo => "build_info", Gauge, Count("1"), ["version", "schema"], "Stagehand version and event schema; always 1.";
    Events => "events", Counter, Count("{event}"), ["kind"], "Events received, by kind.";
    EventsDropped => "events.dropped", Counter, Count("{event}"), [], "Events the bus dropped because consumers fell behind.";
    TelemetryLost => "telemetry.lost", Counter, Count("{event}"), [], "Events a telemetry sink failed to write (a full disk, a closed pipe).";
    Step => "step", Gauge, Count("{step}"), [], "Current training step.";
    StepDuration => "step.duration", Histogram(PHASE_BUCKETS), Seconds, [], "Wall time of whole training steps.";
    Loss => "loss", Gauge, Dimensionless, [], "Loss of the last step.";
    StepTime => "step.time", Counter, Seconds, ["part"], "Time of finished steps by part (compute, h2d_wait, d2h_wait, weight_stall, restore_stall, optimizer, other).";
    LastStepTime => "last_step.time", Gauge, Seconds, ["part"], "Time of the last finished step by part.";
    TransferBytes => "transfer", Counter, Bytes, ["direction", "owner"], "Bytes moved across PCIe by completed copies.";
    Transfers => "transfers", Counter, Count("{copy}"), ["direction", "owner"], "Completed copies.";
    TransferDuration => "transfer.duration", Histogram(TRANSFER_BUCKETS), Seconds, ["direction"], "Duration of the timed copies (one in 16 per copy stream on CUDA, every copy on the host device), between events on the copy's stream.";
    TransfersInflight => "transfers.inflight", Gauge, Count("{copy}"), ["direction"], "Copies in flight.";
    StallDuration => "stall.duration", Histogram(STALL_BUCKETS), Seconds, ["source"], "Time the compute stream waited for a block (weights) or a restore (activations).";
    PrefetchHits => "prefetch.hits", Counter, Count("{block}"), [], "Blocks that were on the device when needed.";
    PrefetchMisses => "prefetch.misses", Counter, Count("{block}"), [], "Blocks that were not ready when needed.";
    HostSteps => "host_optimizer.steps", Counter, Count("{block}"), ["during_backward"], "Blocks the host optimizer stepped, by whether they were given to it while backward ran (true) or at the optimizer's call (false).";
    Evictions => "evictions", Counter, Count("{block}"), ["reason"], "Blocks evicted, by reason.";
    ResidencyBlocks => "residency.blocks", Gauge, Count("{block}"), ["state"], "Weight blocks in each residency state.";
    PoolCapacity => "pool.capacity", Gauge, Bytes, ["pool", "class", "slab_bytes"], "Bytes a pinned pool holds, by size class.";
    PoolUsed => "pool.used", Gauge, Bytes, ["pool", "class", "slab_bytes"], "Bytes in taken slabs, by size class.";
    PoolSlabsInUse => "pool.slabs_in_use", Gauge, Count("{slab}"), ["pool", "class", "slab_bytes"], "Slabs taken, by size class.";
    PoolExhausted => "pool.exhausted", Counter, Count("{request}"), ["pool"], "Requests that found no free slab.";
    PoolPageableFallback => "pool.pageable_fallback", Counter, Bytes, ["pool"], "Bytes allocated in pageable memory because the pinned pool was full.";
    ActivationsPacked => "activations.packed", Counter, Count("{tensor}"), ["decision"], "Saved tensors seen by the pack hook, by decision.";
    ActivationSpill => "activation.spill", Counter, Bytes, [], "Bytes of activations spilled to the host.";
    ActivationRestores => "activation.restores", Counter, Count("{tensor}"), ["predicted"], "Spilled activations restored to the device.";
    ActivationRestore => "activation.restore", Counter, Bytes, [], "Bytes of activations restored to the device.";
    Vram => "vram", Gauge, Bytes, ["kind"], "Device memory: allocated and reserved at the latest reading, and the run's peak of allocated memory.";
    MemoryLimit => "memory.limit", Gauge, Bytes, ["owner", "limit"], "The limits each owner published: budget, high and low watermarks.";
    VramOwner => "vram.owner", Gauge, Bytes, ["owner"], "Device memory by owner, latest reading.";
    VramAtPeak => "vram.at_peak", Gauge, Bytes, ["owner"], "Device memory by owner at the last finished step's fullest reading.";
    ConductorReservations => "conductor.reservations", Counter, Count("{request}"), ["outcome", "mode"], "Reservation requests, by outcome and mode.";
    ConductorGrants => "conductor.grants", Counter, Count("{request}"), ["what"], "Conductor grants: reservations (full or partial) and transfer slots.";
    ConductorDenials => "conductor.denials", Counter, Count("{request}"), ["what", "reason"], "Conductor refusals, by reason.";
    ConductorReserved => "conductor.reserved", Gauge, Bytes, [], "Bytes held by active reservations.";
    ConductorHintChanges => "conductor.hint_changes", Counter, Count("{change}"), ["rule"], "Hint changes by the policy bridge, by rule.";
    PhaseDuration => "phase.duration", Histogram(PHASE_BUCKETS), Seconds, ["phase"], "Time spent in each phase of a step.";
    ItineraryChanges => "itinerary.changes", Counter, Count("{change}"), [], "Times a step ran its blocks in another order and the itinerary was traced again.";
    OutOfMemory => "out_of_memory", Counter, Count("{event}"), [], "Device allocations that failed.";
    NonFinite => "non_finite", Counter, Count("{value}"), ["where"], "Non-finite values (NaN, infinity) seen, by where they were (output, gradient, loss, other).";
    FlightRecords => "flight_records", Counter, Count("{file}"), [], "Flight-recorder files written.";
}

impl Metric {
    /// The definition of this instrument.
    pub fn def(self) -> &'static MetricDef {
        &CATALOG[self as usize]
    }
}

/// The definition whose Prometheus name is `name` (also the `_bucket`, `_sum` and `_count`
/// series of a histogram).
pub fn by_prometheus_name(name: &str) -> Option<&'static MetricDef> {
    CATALOG.iter().find(|d| {
        let n = d.prometheus_name();
        n == name
            || (matches!(d.kind, Kind::Histogram(_))
                && ["_bucket", "_sum", "_count"].iter().any(|s| name.strip_suffix(s) == Some(n.as_str())))
    })
}

/// The definition whose OpenTelemetry name is `name`.
pub fn by_otel_name(name: &str) -> Option<&'static MetricDef> {
    CATALOG.iter().find(|d| d.otel_name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_enum_order_and_names_are_unique() {
        for (i, d) in CATALOG.iter().enumerate() {
            assert_eq!(d.id as usize, i, "{}", d.stem);
        }
        let mut names: Vec<String> = CATALOG.iter().map(MetricDef::prometheus_name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), CATALOG.len());
    }

    #[test]
    fn the_readme_lists_every_instrument() {
        let readme = include_str!("../README.md");
        for d in CATALOG {
            let row = format!("| `{}` | `{}` `{}` |", d.prometheus_name(), d.otel_name(), d.unit.ucum());
            assert!(readme.contains(&row), "README lacks {row}");
        }
    }

    #[test]
    fn names_follow_each_side_s_conventions() {
        let n = |m: Metric| (m.def().prometheus_name(), m.def().otel_name(), m.def().unit.ucum());
        assert_eq!(n(Metric::TransferBytes), ("stagehand_transfer_bytes_total".into(), "stagehand.transfer".into(), "By"));
        assert_eq!(n(Metric::PhaseDuration), ("stagehand_phase_duration_seconds".into(), "stagehand.phase.duration".into(), "s"));
        assert_eq!(n(Metric::Vram), ("stagehand_vram_bytes".into(), "stagehand.vram".into(), "By"));
        assert_eq!(n(Metric::PrefetchHits).0, "stagehand_prefetch_hits_total");
        assert_eq!(n(Metric::StepTime).0, "stagehand_step_time_seconds_total");
        assert_eq!(n(Metric::LastStepTime).0, "stagehand_last_step_time_seconds");
        assert_eq!(n(Metric::Loss), ("stagehand_loss".into(), "stagehand.loss".into(), "1"));
        assert_eq!(by_prometheus_name("stagehand_transfer_duration_seconds_bucket").map(|d| d.id), Some(Metric::TransferDuration));
        assert_eq!(by_prometheus_name("stagehand_vram_bytes_sum"), None, "a gauge has no _sum");
    }
}
