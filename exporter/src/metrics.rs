//! Prometheus metrics of a run, updated from events by an [`EventSink`].
//!
//! Every metric name lives in [`NAMES`]-style constants of this module, in one table, so the
//! Grafana dashboard, the OTLP export and the tests agree. Names follow design.md section 6:
//! the `stagehand_` prefix, base units (`_bytes`, `_seconds`) and `_total` for counters. Labels
//! are low-cardinality (direction, owner, state, pool, class index, reason, phase); block and
//! tensor ids stay in the events and never become labels. Every series carries the const labels
//! `device` (the CUDA ordinal) and `device_name`, as GPU exporters (DCGM, nvidia_gpu_exporter)
//! label theirs, so the series can be joined.

use crate::{Error, Result};
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use stagehand::events::model::{
    BlockState, Direction, Event, EventKind, PackDecision, Phase, PoolKind,
    ReservationOutcome, SCHEMA_VERSION,
};
use stagehand::events::{EventSink, Snapshot};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The content type of the text exposition format this module renders.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Buckets for copy durations, in seconds: 20 us to 2 s.
const TRANSFER_BUCKETS: &[f64] = &[
    2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
    2.0,
];
/// Buckets for stalls of the compute stream, in seconds: 10 us to 1 s.
const STALL_BUCKETS: &[f64] = &[
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
];
/// Buckets for phase and step durations, in seconds: 1 ms to 60 s.
const PHASE_BUCKETS: &[f64] = &[
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The device labels every series carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceLabels {
    /// CUDA ordinal ("0"); the host device is "0" too.
    pub device: String,
    /// "NVIDIA H200", or "host (simulated)".
    pub device_name: String,
}

impl DeviceLabels {
    /// Labels for device `index` called `name`.
    pub fn new(index: u32, name: impl Into<String>) -> DeviceLabels {
        DeviceLabels {
            device: index.to_string(),
            device_name: name.into(),
        }
    }

    fn to_map(&self) -> HashMap<String, String> {
        HashMap::from([
            ("device".to_owned(), self.device.clone()),
            ("device_name".to_owned(), self.device_name.clone()),
        ])
    }
}

/// The metric families, registered in one registry with one set of const labels.
struct Families {
    registry: Registry,
    build_info: IntGaugeVec,
    events: IntCounterVec,
    events_dropped: IntCounter,
    step: IntGauge,
    step_duration: Histogram,
    loss: Gauge,
    transfer_bytes: IntCounterVec,
    transfers: IntCounterVec,
    transfer_duration: HistogramVec,
    transfers_inflight: IntGaugeVec,
    stall_duration: HistogramVec,
    prefetch_hits: IntCounter,
    prefetch_misses: IntCounter,
    evictions: IntCounterVec,
    residency: IntGaugeVec,
    pool_capacity: IntGaugeVec,
    pool_used: IntGaugeVec,
    pool_slabs_in_use: IntGaugeVec,
    pool_exhausted: IntCounterVec,
    pageable_fallback_bytes: IntCounterVec,
    activations_packed: IntCounterVec,
    spill_bytes: IntCounter,
    restores: IntCounterVec,
    restore_bytes: IntCounter,
    vram: GaugeVec,
    reservations: IntCounterVec,
    grants: IntCounterVec,
    denials: IntCounterVec,
    reserved_bytes: IntGauge,
    hint_changes: IntCounterVec,
    phase_duration: HistogramVec,
}

/// Every metric name this module exports, with its type, for documentation and tests.
pub const METRIC_NAMES: &[(&str, &str)] = &[
    ("stagehand_build_info", "gauge"),
    ("stagehand_events_total", "counter"),
    ("stagehand_events_dropped_total", "counter"),
    ("stagehand_step", "gauge"),
    ("stagehand_step_duration_seconds", "histogram"),
    ("stagehand_loss", "gauge"),
    ("stagehand_transfer_bytes_total", "counter"),
    ("stagehand_transfers_total", "counter"),
    ("stagehand_transfer_duration_seconds", "histogram"),
    ("stagehand_transfers_inflight", "gauge"),
    ("stagehand_stall_duration_seconds", "histogram"),
    ("stagehand_prefetch_hits_total", "counter"),
    ("stagehand_prefetch_misses_total", "counter"),
    ("stagehand_evictions_total", "counter"),
    ("stagehand_residency_blocks", "gauge"),
    ("stagehand_pool_capacity_bytes", "gauge"),
    ("stagehand_pool_used_bytes", "gauge"),
    ("stagehand_pool_slabs_in_use", "gauge"),
    ("stagehand_pool_exhausted_total", "counter"),
    ("stagehand_pool_pageable_fallback_bytes_total", "counter"),
    ("stagehand_activations_packed_total", "counter"),
    ("stagehand_activation_spill_bytes_total", "counter"),
    ("stagehand_activation_restores_total", "counter"),
    ("stagehand_activation_restore_bytes_total", "counter"),
    ("stagehand_vram_bytes", "gauge"),
    ("stagehand_conductor_reservations_total", "counter"),
    ("stagehand_conductor_grants_total", "counter"),
    ("stagehand_conductor_denials_total", "counter"),
    ("stagehand_conductor_reserved_bytes", "gauge"),
    ("stagehand_conductor_hint_changes_total", "counter"),
    ("stagehand_phase_duration_seconds", "histogram"),
];

fn opts(name: &str, help: &str, labels: &DeviceLabels) -> Opts {
    Opts::new(name, help).const_labels(labels.to_map())
}

fn hopts(name: &str, help: &str, labels: &DeviceLabels, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .const_labels(labels.to_map())
        .buckets(buckets.to_vec())
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> Result<T> {
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

impl Families {
    fn new(l: &DeviceLabels) -> Result<Families> {
        let r = Registry::new();
        let f = Families {
            build_info: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_build_info", "Stagehand version and event schema; always 1.", l),
                    &["version", "schema"],
                )?,
            )?,
            events: reg(
                &r,
                IntCounterVec::new(
                    opts("stagehand_events_total", "Events received, by kind.", l),
                    &["kind"],
                )?,
            )?,
            events_dropped: reg(
                &r,
                IntCounter::with_opts(opts(
                    "stagehand_events_dropped_total",
                    "Events the bus dropped because consumers fell behind.",
                    l,
                ))?,
            )?,
            step: reg(
                &r,
                IntGauge::with_opts(opts("stagehand_step", "Current training step.", l))?,
            )?,
            step_duration: reg(
                &r,
                Histogram::with_opts(hopts(
                    "stagehand_step_duration_seconds",
                    "Wall time of whole training steps.",
                    l,
                    PHASE_BUCKETS,
                ))?,
            )?,
            loss: reg(
                &r,
                Gauge::with_opts(opts("stagehand_loss", "Loss of the last step.", l))?,
            )?,
            transfer_bytes: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_transfer_bytes_total",
                        "Bytes moved across PCIe by completed copies.",
                        l,
                    ),
                    &["direction", "owner"],
                )?,
            )?,
            transfers: reg(
                &r,
                IntCounterVec::new(
                    opts("stagehand_transfers_total", "Completed copies.", l),
                    &["direction", "owner"],
                )?,
            )?,
            transfer_duration: reg(
                &r,
                HistogramVec::new(
                    hopts(
                        "stagehand_transfer_duration_seconds",
                        "Duration of copies, from issue to observed completion.",
                        l,
                        TRANSFER_BUCKETS,
                    ),
                    &["direction"],
                )?,
            )?,
            transfers_inflight: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_transfers_inflight", "Copies in flight.", l),
                    &["direction"],
                )?,
            )?,
            stall_duration: reg(
                &r,
                HistogramVec::new(
                    hopts(
                        "stagehand_stall_duration_seconds",
                        "Time the compute stream waited for a block or a restore.",
                        l,
                        STALL_BUCKETS,
                    ),
                    &["source"],
                )?,
            )?,
            prefetch_hits: reg(
                &r,
                IntCounter::with_opts(opts(
                    "stagehand_prefetch_hits_total",
                    "Blocks that were on the device when needed.",
                    l,
                ))?,
            )?,
            prefetch_misses: reg(
                &r,
                IntCounter::with_opts(opts(
                    "stagehand_prefetch_misses_total",
                    "Blocks that were not ready when needed.",
                    l,
                ))?,
            )?,
            evictions: reg(
                &r,
                IntCounterVec::new(
                    opts("stagehand_evictions_total", "Blocks evicted, by reason.", l),
                    &["reason"],
                )?,
            )?,
            residency: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_residency_blocks", "Weight blocks in each residency state.", l),
                    &["state"],
                )?,
            )?,
            pool_capacity: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_pool_capacity_bytes", "Bytes a pinned pool holds, by size class.", l),
                    &["pool", "class", "slab_bytes"],
                )?,
            )?,
            pool_used: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_pool_used_bytes", "Bytes in taken slabs, by size class.", l),
                    &["pool", "class", "slab_bytes"],
                )?,
            )?,
            pool_slabs_in_use: reg(
                &r,
                IntGaugeVec::new(
                    opts("stagehand_pool_slabs_in_use", "Slabs taken, by size class.", l),
                    &["pool", "class", "slab_bytes"],
                )?,
            )?,
            pool_exhausted: reg(
                &r,
                IntCounterVec::new(
                    opts("stagehand_pool_exhausted_total", "Requests that found no free slab.", l),
                    &["pool"],
                )?,
            )?,
            pageable_fallback_bytes: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_pool_pageable_fallback_bytes_total",
                        "Bytes allocated outside the pool, in pageable memory.",
                        l,
                    ),
                    &["pool"],
                )?,
            )?,
            activations_packed: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_activations_packed_total",
                        "Saved tensors seen by the pack hook, by decision.",
                        l,
                    ),
                    &["decision"],
                )?,
            )?,
            spill_bytes: reg(
                &r,
                IntCounter::with_opts(opts(
                    "stagehand_activation_spill_bytes_total",
                    "Bytes of activations spilled to the host.",
                    l,
                ))?,
            )?,
            restores: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_activation_restores_total",
                        "Spilled activations restored to the device.",
                        l,
                    ),
                    &["predicted"],
                )?,
            )?,
            restore_bytes: reg(
                &r,
                IntCounter::with_opts(opts(
                    "stagehand_activation_restore_bytes_total",
                    "Bytes of activations restored to the device.",
                    l,
                ))?,
            )?,
            vram: reg(
                &r,
                GaugeVec::new(
                    opts(
                        "stagehand_vram_bytes",
                        "Device memory: allocated, reserved, peak, and the limits it is held to.",
                        l,
                    ),
                    &["kind"],
                )?,
            )?,
            reservations: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_conductor_reservations_total",
                        "Conductor reservation requests, by outcome and mode.",
                        l,
                    ),
                    &["outcome", "mode"],
                )?,
            )?,
            grants: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_conductor_grants_total",
                        "Conductor grants: reservations (full or partial) and transfer slots.",
                        l,
                    ),
                    &["what"],
                )?,
            )?,
            denials: reg(
                &r,
                IntCounterVec::new(
                    opts("stagehand_conductor_denials_total", "Conductor refusals, by reason.", l),
                    &["what", "reason"],
                )?,
            )?,
            reserved_bytes: reg(
                &r,
                IntGauge::with_opts(opts(
                    "stagehand_conductor_reserved_bytes",
                    "Bytes held by active reservations.",
                    l,
                ))?,
            )?,
            hint_changes: reg(
                &r,
                IntCounterVec::new(
                    opts(
                        "stagehand_conductor_hint_changes_total",
                        "Hint changes by the policy bridge, by rule.",
                        l,
                    ),
                    &["rule"],
                )?,
            )?,
            phase_duration: reg(
                &r,
                HistogramVec::new(
                    hopts(
                        "stagehand_phase_duration_seconds",
                        "Time spent in each phase of a step.",
                        l,
                        PHASE_BUCKETS,
                    ),
                    &["phase"],
                )?,
            )?,
            registry: r,
        };
        f.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), &SCHEMA_VERSION.to_string()])
            .set(1);
        // Series that exist from the start, so dashboards show zeros rather than "no data".
        for d in [Direction::H2d, Direction::D2h] {
            f.transfers_inflight.with_label_values(&[d.as_str()]).set(0);
        }
        for s in BlockState::ALL {
            f.residency.with_label_values(&[s.as_str()]).set(0);
        }
        for d in ["h2d", "d2h"] {
            f.transfer_duration.with_label_values(&[d]);
            for o in ["weights", "activations"] {
                f.transfer_bytes.with_label_values(&[d, o]);
                f.transfers.with_label_values(&[d, o]);
            }
        }
        for src in ["weights", "activations"] {
            f.stall_duration.with_label_values(&[src]);
        }
        for r in ["watermark", "budget", "explicit", "shutdown"] {
            f.evictions.with_label_values(&[r]);
        }
        for p in ["weights", "activations"] {
            f.pool_exhausted.with_label_values(&[p]);
            f.pageable_fallback_bytes.with_label_values(&[p]);
        }
        for d in ["kept", "spilled", "weight_handle", "duplicate"] {
            f.activations_packed.with_label_values(&[d]);
        }
        for p in ["true", "false"] {
            f.restores.with_label_values(&[p]);
        }
        for w in ["reservation", "slot"] {
            f.grants.with_label_values(&[w]);
        }
        for p in [Phase::StepBegin, Phase::Forward, Phase::Backward, Phase::Optimizer, Phase::StepEnd] {
            f.phase_duration.with_label_values(&[p.as_str()]);
        }
        Ok(f)
    }
}


fn pool_name(p: PoolKind) -> &'static str {
    match p {
        PoolKind::Weights => "weights",
        PoolKind::Activations => "activations",
    }
}

struct Inner {
    labels: Option<DeviceLabels>,
    /// Labels fixed at construction are never replaced by those of `run_started`.
    fixed_labels: bool,
    families: Families,
    /// The run's state, for the gauges (residency, pools, VRAM), kept by the shared reducer.
    snapshot: Snapshot,
    dropped_seen: u64,
}

impl Inner {
    /// Fresh series under `labels` and an empty run: what Prometheus reads as a counter reset.
    fn restart(&mut self, labels: &DeviceLabels) -> Result<()> {
        self.families = Families::new(labels)?;
        self.snapshot = Snapshot::new();
        self.dropped_seen = 0;
        Ok(())
    }

    fn on_event(&mut self, e: &Event) -> Result<()> {
        if let EventKind::RunStarted { device, .. } = &e.kind {
            if !self.fixed_labels {
                // A new run: new labels and fresh series (counter resets are what Prometheus
                // expects of a restarted process).
                let labels = DeviceLabels::new(device.index, device.name.clone());
                self.restart(&labels)?;
                self.labels = Some(labels);
            }
        }
        self.snapshot.apply(e);
        let f = &self.families;
        f.events.with_label_values(&[e.kind.name()]).inc();
        match &e.kind {
            EventKind::PhaseChanged { from, duration_s, .. }
                if *from != Phase::Idle && duration_s.is_finite() && *duration_s >= 0.0 =>
            {
                f.phase_duration.with_label_values(&[from.as_str()]).observe(*duration_s);
            }
            EventKind::PrefetchHit { .. } => f.prefetch_hits.inc(),
            EventKind::PrefetchMiss { stall_ms, .. } => {
                f.prefetch_misses.inc();
                f.stall_duration
                    .with_label_values(&["weights"])
                    .observe(stall_ms.max(0.0) / 1e3);
            }
            EventKind::Eviction { reason, .. } => {
                f.evictions.with_label_values(&[&stagehand::events::wire_name(reason)]).inc()
            }
            EventKind::TransferCompleted {
                dir,
                owner,
                bytes,
                duration_ms,
                ..
            } => {
                f.transfer_bytes
                    .with_label_values(&[dir.as_str(), owner.as_str()])
                    .inc_by(*bytes);
                f.transfers
                    .with_label_values(&[dir.as_str(), owner.as_str()])
                    .inc();
                f.transfer_duration
                    .with_label_values(&[dir.as_str()])
                    .observe(duration_ms.max(0.0) / 1e3);
            }
            EventKind::PoolExhausted { pool, .. } => {
                f.pool_exhausted.with_label_values(&[pool_name(*pool)]).inc()
            }
            EventKind::PageableFallback { pool, bytes } => f
                .pageable_fallback_bytes
                .with_label_values(&[pool_name(*pool)])
                .inc_by(*bytes),
            EventKind::Pack {
                decision, bytes, ..
            } => {
                f.activations_packed
                    .with_label_values(&[&stagehand::events::wire_name(decision)])
                    .inc();
                if *decision == PackDecision::Spilled {
                    f.spill_bytes.inc_by(*bytes);
                }
            }
            EventKind::Restored {
                bytes,
                predicted,
                stall_ms,
                ..
            } => {
                f.restores
                    .with_label_values(&[if *predicted { "true" } else { "false" }])
                    .inc();
                f.restore_bytes.inc_by(*bytes);
                if *stall_ms > 0.0 {
                    f.stall_duration
                        .with_label_values(&["activations"])
                        .observe(stall_ms / 1e3);
                }
            }
            EventKind::Reservation {
                mode,
                outcome,
                reason,
                ..
            } => {
                f.reservations
                    .with_label_values(&[&stagehand::events::wire_name(outcome), &stagehand::events::wire_name(mode)])
                    .inc();
                if matches!(
                    outcome,
                    ReservationOutcome::Granted | ReservationOutcome::Partial
                ) {
                    f.grants.with_label_values(&["reservation"]).inc();
                }
                if let Some(r) = reason {
                    f.denials
                        .with_label_values(&["reservation", r.as_str()])
                        .inc();
                }
            }
            EventKind::SlotGranted { .. } => f.grants.with_label_values(&["slot"]).inc(),
            EventKind::SlotDenied { reason, .. } => {
                f.denials.with_label_values(&["slot", reason.as_str()]).inc()
            }
            EventKind::HintsChanged { rule, .. } => {
                f.hint_changes.with_label_values(&[&stagehand::events::wire_name(rule)]).inc()
            }
            EventKind::TrainStep(m) => {
                f.loss.set(m.loss);
                if m.step_time_s.is_finite() && m.step_time_s >= 0.0 {
                    f.step_duration.observe(m.step_time_s);
                }
            }
            EventKind::EventsDropped { total } if *total > self.dropped_seen => {
                f.events_dropped.inc_by(*total - self.dropped_seen);
                self.dropped_seen = *total;
            }
            _ => {}
        }
        Ok(())
    }

    /// Sets the gauges from the snapshot; called before each render.
    fn refresh_gauges(&self) {
        let f = &self.families;
        let s = &self.snapshot;
        f.step.set(s.step as i64);
        let counts = s.residency_counts();
        for st in BlockState::ALL {
            f.residency
                .with_label_values(&[st.as_str()])
                .set(counts.get(&st).copied().unwrap_or(0) as i64);
        }
        for d in [Direction::H2d, Direction::D2h] {
            f.transfers_inflight
                .with_label_values(&[d.as_str()])
                .set(s.transfers.dir(d).inflight as i64);
        }
        for (kind, pool) in [
            (PoolKind::Weights, &s.weight_pool),
            (PoolKind::Activations, &s.activation_pool),
        ] {
            let Some(pool) = pool else { continue };
            for (i, c) in pool.classes.iter().enumerate() {
                let labels = [pool_name(kind), &i.to_string(), &c.slab_bytes.to_string()];
                f.pool_capacity
                    .with_label_values(&labels)
                    .set((c.slab_bytes * c.slabs as u64) as i64);
                f.pool_used
                    .with_label_values(&labels)
                    .set((c.slab_bytes * c.in_use as u64) as i64);
                f.pool_slabs_in_use
                    .with_label_values(&labels)
                    .set(c.in_use as i64);
            }
        }
        if let Some(v) = &s.vram {
            for (k, b) in [
                ("allocated", v.allocated_bytes),
                ("reserved", v.reserved_bytes),
                ("peak_allocated", v.peak_allocated_bytes),
                ("high_watermark", s.spill_watermarks().map_or(0, |w| w.0)),
                ("low_watermark", s.spill_watermarks().map_or(0, |w| w.1)),
                ("budget", s.vram_budget_bytes().unwrap_or(0)),
            ] {
                f.vram.with_label_values(&[k]).set(b as f64);
            }
        }
        f.reserved_bytes.set(s.conductor.active_bytes as i64);
    }
}

/// The Prometheus side of a run: attach it to a [`Hub`](stagehand::events::Hub) as a sink and
/// render `/metrics` from any thread. Cheap to clone; clones share one registry.
///
/// ```
/// use stagehand::events::Hub;
/// use stagehand_exporter::Metrics;
/// let hub = Hub::new();
/// let metrics = Metrics::new();
/// hub.add_sink(Box::new(metrics.clone()));
/// let text = metrics.render().expect("renders");
/// assert!(text.contains("stagehand_build_info"));
/// ```
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("Metrics")
            .field("labels", &inner.labels)
            .field("events", &inner.snapshot.events_applied)
            .finish()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Metrics labelled from the run's `run_started` event (empty labels until then).
    pub fn new() -> Metrics {
        Metrics::build(None).unwrap_or_else(|e| {
            // Families::new only fails on a name clash inside this module.
            panic!("the metric table of this module is consistent: {e}")
        })
    }

    /// Metrics labelled with `labels` whatever the events say.
    pub fn with_labels(labels: DeviceLabels) -> Result<Metrics> {
        Metrics::build(Some(labels))
    }

    fn build(labels: Option<DeviceLabels>) -> Result<Metrics> {
        let families = Families::new(&labels.clone().unwrap_or_default())?;
        Ok(Metrics {
            inner: Arc::new(Mutex::new(Inner {
                fixed_labels: labels.is_some(),
                labels,
                families,
                snapshot: Snapshot::new(),
                dropped_seen: 0,
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records one event (what the sink does).
    pub fn record(&self, event: &Event) -> Result<()> {
        self.lock().on_event(event)
    }

    /// The device labels in use, once known.
    pub fn labels(&self) -> Option<DeviceLabels> {
        self.lock().labels.clone()
    }

    /// The registry, for callers that gather or serve it themselves. Gauges are refreshed first.
    pub fn registry(&self) -> Registry {
        let inner = self.lock();
        inner.refresh_gauges();
        inner.families.registry.clone()
    }

    /// The metrics in the Prometheus text format ([`TEXT_CONTENT_TYPE`]).
    pub fn render(&self) -> Result<String> {
        let families = {
            let inner = self.lock();
            inner.refresh_gauges();
            inner.families.registry.gather()
        };
        let mut buf = Vec::new();
        TextEncoder::new().encode(&families, &mut buf)?;
        String::from_utf8(buf).map_err(|e| Error::Encode(e.to_string()))
    }
}

impl EventSink for Metrics {
    fn on_event(&mut self, event: &Event) {
        // Registration cannot fail after construction; a failed rebuild keeps the old families.
        let _ = self.record(event);
    }

    /// A replay seek: fresh series (a counter reset, as after a restarted process) holding what
    /// `history` adds up to, so `/metrics` agrees with the replay's position either way.
    fn rewind(&mut self, history: &[Event]) {
        let mut inner = self.lock();
        let labels = inner.labels.clone().unwrap_or_default();
        // Families::new only fails on a name clash inside this module.
        if inner.restart(&labels).is_err() {
            return;
        }
        for e in history {
            let _ = inner.on_event(e);
        }
    }
}
