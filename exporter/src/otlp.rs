//! OpenTelemetry export (feature `otlp`): the same metrics as the Prometheus side, as OTel
//! instruments, plus a span per training step with a child span per phase.
//!
//! [`OtelSink::from_env`] builds OTLP/HTTP (protobuf) exporters configured by the standard
//! variables: `OTEL_EXPORTER_OTLP_ENDPOINT` (default `http://localhost:4318`), the per-signal
//! `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_METRIC_EXPORT_INTERVAL`, and `OTEL_SERVICE_NAME` /
//! `OTEL_RESOURCE_ATTRIBUTES` for the resource. [`OtelSink::with_providers`] takes providers
//! built by the caller (other exporters, or the SDK's in-memory ones in tests).
//!
//! Instrument names use OTel's dotted style with units in the metadata
//! (`stagehand.transfer.bytes`, unit `By`); an OTLP-to-Prometheus bridge turns them into the
//! Prometheus names of [`crate::metrics`]. Every data point carries `device` and `device_name`.

use crate::{Error, Result};
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _};
use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use stagehand::events::model::{
    BlockState, Event, EventKind, PackDecision, Phase, PoolKind, ReservationOutcome,
};
use stagehand::events::{EventSink, Snapshot};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The instrumentation scope name.
pub const SCOPE: &str = "stagehand";

struct Instruments {
    transfer_bytes: Counter<u64>,
    transfer_duration: Histogram<f64>,
    stall_duration: Histogram<f64>,
    prefetch_hits: Counter<u64>,
    prefetch_misses: Counter<u64>,
    evictions: Counter<u64>,
    residency: Gauge<u64>,
    pool_used: Gauge<u64>,
    pool_capacity: Gauge<u64>,
    activations_packed: Counter<u64>,
    spill_bytes: Counter<u64>,
    restores: Counter<u64>,
    restore_bytes: Counter<u64>,
    vram: Gauge<u64>,
    grants: Counter<u64>,
    denials: Counter<u64>,
    phase_duration: Histogram<f64>,
    step_duration: Histogram<f64>,
    events_dropped: Counter<u64>,
    build_info: Gauge<u64>,
}

impl Instruments {
    fn new(m: &Meter) -> Instruments {
        Instruments {
            transfer_bytes: m
                .u64_counter("stagehand.transfer.bytes")
                .with_unit("By")
                .with_description("Bytes moved across PCIe by completed copies.")
                .build(),
            transfer_duration: m
                .f64_histogram("stagehand.transfer.duration")
                .with_unit("s")
                .with_description("Duration of copies, from issue to observed completion.")
                .build(),
            stall_duration: m
                .f64_histogram("stagehand.stall.duration")
                .with_unit("s")
                .with_description("Time the compute stream waited for a block or a restore.")
                .build(),
            prefetch_hits: m
                .u64_counter("stagehand.prefetch.hits")
                .with_description("Blocks that were on the device when needed.")
                .build(),
            prefetch_misses: m
                .u64_counter("stagehand.prefetch.misses")
                .with_description("Blocks that were not ready when needed.")
                .build(),
            evictions: m
                .u64_counter("stagehand.evictions")
                .with_description("Blocks evicted, by reason.")
                .build(),
            residency: m
                .u64_gauge("stagehand.residency.blocks")
                .with_description("Weight blocks in each residency state.")
                .build(),
            pool_used: m
                .u64_gauge("stagehand.pool.used")
                .with_unit("By")
                .with_description("Bytes in taken slabs, by size class.")
                .build(),
            pool_capacity: m
                .u64_gauge("stagehand.pool.capacity")
                .with_unit("By")
                .with_description("Bytes a pinned pool holds, by size class.")
                .build(),
            activations_packed: m
                .u64_counter("stagehand.activations.packed")
                .with_description("Saved tensors seen by the pack hook, by decision.")
                .build(),
            spill_bytes: m
                .u64_counter("stagehand.activation.spill.bytes")
                .with_unit("By")
                .with_description("Bytes of activations spilled to the host.")
                .build(),
            restores: m
                .u64_counter("stagehand.activation.restores")
                .with_description("Spilled activations restored to the device.")
                .build(),
            restore_bytes: m
                .u64_counter("stagehand.activation.restore.bytes")
                .with_unit("By")
                .with_description("Bytes of activations restored to the device.")
                .build(),
            vram: m
                .u64_gauge("stagehand.vram")
                .with_unit("By")
                .with_description("Device memory: allocated, reserved, peak and the limits.")
                .build(),
            grants: m
                .u64_counter("stagehand.conductor.grants")
                .with_description("Conductor grants: reservations and transfer slots.")
                .build(),
            denials: m
                .u64_counter("stagehand.conductor.denials")
                .with_description("Conductor refusals, by reason.")
                .build(),
            phase_duration: m
                .f64_histogram("stagehand.phase.duration")
                .with_unit("s")
                .with_description("Time spent in each phase of a step.")
                .build(),
            step_duration: m
                .f64_histogram("stagehand.step.duration")
                .with_unit("s")
                .with_description("Wall time of whole training steps.")
                .build(),
            events_dropped: m
                .u64_counter("stagehand.events.dropped")
                .with_description("Events the bus dropped because consumers fell behind.")
                .build(),
            build_info: m
                .u64_gauge("stagehand.build_info")
                .with_description("Stagehand version; always 1.")
                .build(),
        }
    }
}

/// An [`EventSink`] that records the run into OpenTelemetry metrics and spans.
pub struct OtelSink {
    meter_provider: SdkMeterProvider,
    tracer_provider: SdkTracerProvider,
    tracer: SdkTracer,
    inst: Instruments,
    device: Vec<KeyValue>,
    snapshot: Snapshot,
    wall_anchor: SystemTime,
    dropped_seen: u64,
    /// The step span being recorded, as a context for its phase spans.
    step_cx: Option<Context>,
    /// The open phase: (phase, start).
    phase: Option<(Phase, SystemTime)>,
    dirty_gauges: bool,
}

impl std::fmt::Debug for OtelSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtelSink")
            .field("events", &self.snapshot.events_applied)
            .finish_non_exhaustive()
    }
}

impl OtelSink {
    /// OTLP/HTTP exporters for metrics and spans, configured by the `OTEL_*` variables.
    pub fn from_env() -> Result<OtelSink> {
        let resource = Resource::builder().with_service_name(service_name()).build();
        let metric_exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .build()
            .map_err(|e| Error::Otel(format!("metric exporter: {e}")))?;
        let meter_provider = SdkMeterProvider::builder()
            .with_resource(resource.clone())
            .with_reader(PeriodicReader::builder(metric_exporter).build())
            .build();
        let span_exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| Error::Otel(format!("span exporter: {e}")))?;
        let tracer_provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_batch_exporter(span_exporter)
            .build();
        Ok(OtelSink::with_providers(meter_provider, tracer_provider))
    }

    /// A sink recording into providers the caller built.
    pub fn with_providers(
        meter_provider: SdkMeterProvider,
        tracer_provider: SdkTracerProvider,
    ) -> OtelSink {
        let meter = meter_provider.meter(SCOPE);
        let inst = Instruments::new(&meter);
        inst.build_info
            .record(1, &[KeyValue::new("version", env!("CARGO_PKG_VERSION"))]);
        let tracer = tracer_provider.tracer(SCOPE);
        OtelSink {
            meter_provider,
            tracer_provider,
            tracer,
            inst,
            device: Vec::new(),
            snapshot: Snapshot::new(),
            wall_anchor: SystemTime::now(),
            dropped_seen: 0,
            step_cx: None,
            phase: None,
            dirty_gauges: false,
        }
    }

    /// Exports what was recorded so far, now.
    pub fn force_flush(&self) -> Result<()> {
        self.meter_provider
            .force_flush()
            .map_err(|e| Error::Otel(format!("metrics flush: {e}")))?;
        self.tracer_provider
            .force_flush()
            .map_err(|e| Error::Otel(format!("spans flush: {e}")))
    }

    /// Ends open spans, exports everything and stops the exporters.
    pub fn shutdown(mut self) -> Result<()> {
        let end = self.wall(self.snapshot.t_ns);
        self.end_phase(end);
        self.end_step(end);
        self.record_gauges();
        let m = self.meter_provider.shutdown();
        let t = self.tracer_provider.shutdown();
        m.map_err(|e| Error::Otel(format!("metrics shutdown: {e}")))?;
        t.map_err(|e| Error::Otel(format!("spans shutdown: {e}")))
    }

    fn wall(&self, t_ns: u64) -> SystemTime {
        self.wall_anchor + Duration::from_nanos(t_ns)
    }

    fn attrs(&self, extra: &[(&'static str, String)]) -> Vec<KeyValue> {
        let mut v = self.device.clone();
        v.extend(extra.iter().map(|(k, val)| KeyValue::new(*k, val.clone())));
        v
    }

    fn end_phase(&mut self, at: SystemTime) {
        if let Some((phase, start)) = self.phase.take() {
            let parent = self.step_cx.clone().unwrap_or_default();
            let mut span = self
                .tracer
                .span_builder(phase.as_str().to_owned())
                .with_start_time(start)
                .with_attributes(self.attrs(&[("phase", phase.as_str().to_owned())]))
                .start_with_context(&self.tracer, &parent);
            span.end_with_timestamp(at.max(start));
        }
    }

    fn end_step(&mut self, at: SystemTime) {
        if let Some(cx) = self.step_cx.take() {
            cx.span().end_with_timestamp(at);
        }
    }

    fn record_gauges(&mut self) {
        if !self.dirty_gauges {
            return;
        }
        self.dirty_gauges = false;
        let s = &self.snapshot;
        let counts = s.residency_counts();
        for st in BlockState::ALL {
            let n = counts.get(&st).copied().unwrap_or(0) as u64;
            self.inst
                .residency
                .record(n, &self.attrs(&[("state", st.as_str().to_owned())]));
        }
        for (kind, pool) in [
            (PoolKind::Weights, &s.weight_pool),
            (PoolKind::Activations, &s.activation_pool),
        ] {
            let Some(pool) = pool else { continue };
            let name = match kind {
                PoolKind::Weights => "weights",
                PoolKind::Activations => "activations",
            };
            for (i, c) in pool.classes.iter().enumerate() {
                let a = self.attrs(&[
                    ("pool", name.to_owned()),
                    ("class", i.to_string()),
                    ("slab_bytes", c.slab_bytes.to_string()),
                ]);
                self.inst.pool_used.record(c.slab_bytes * c.in_use as u64, &a);
                self.inst.pool_capacity.record(c.slab_bytes * c.slabs as u64, &a);
            }
        }
        if let Some(v) = s.vram {
            for (k, b) in [
                ("allocated", v.allocated_bytes),
                ("reserved", v.reserved_bytes),
                ("peak_allocated", v.peak_allocated_bytes),
                ("high_watermark", s.spill_watermarks().map_or(0, |w| w.0)),
                ("low_watermark", s.spill_watermarks().map_or(0, |w| w.1)),
                ("budget", s.vram_budget_bytes().unwrap_or(0)),
            ] {
                self.inst.vram.record(b, &self.attrs(&[("kind", k.to_owned())]));
            }
        }
    }

    fn record(&mut self, e: &Event) {
        self.snapshot.apply(e);
        let i = &self.inst;
        match &e.kind {
            EventKind::RunStarted {
                device,
                wall_clock_unix_ms,
                ..
            } => {
                self.device = vec![
                    KeyValue::new("device", device.index.to_string()),
                    KeyValue::new("device_name", device.name.clone()),
                ];
                self.wall_anchor = UNIX_EPOCH + Duration::from_millis(*wall_clock_unix_ms);
            }
            EventKind::PhaseChanged {
                from,
                to,
                duration_s,
            } => {
                let now = self.wall(e.t_ns);
                if *from != Phase::Idle && duration_s.is_finite() && *duration_s >= 0.0 {
                    i.phase_duration.record(
                        *duration_s,
                        &self.attrs(&[("phase", from.as_str().to_owned())]),
                    );
                }
                self.end_phase(now);
                if *to == Phase::StepBegin || *from == Phase::StepEnd {
                    self.end_step(now);
                }
                if *to == Phase::StepBegin {
                    let span = self
                        .tracer
                        .span_builder(format!("step {}", e.step))
                        .with_start_time(now)
                        .with_attributes(self.attrs(&[("step", e.step.to_string())]))
                        .start(&self.tracer);
                    self.step_cx = Some(Context::new().with_span(span));
                }
                if *to != Phase::Idle {
                    self.phase = Some((*to, now));
                }
            }
            EventKind::PrefetchHit { .. } => i.prefetch_hits.add(1, &self.device),
            EventKind::PrefetchMiss { stall_ms, .. } => {
                i.prefetch_misses.add(1, &self.device);
                i.stall_duration.record(
                    stall_ms.max(0.0) / 1e3,
                    &self.attrs(&[("source", "weights".to_owned())]),
                );
            }
            EventKind::Eviction { reason, .. } => {
                let r = stagehand::events::wire_name(reason);
                i.evictions.add(1, &self.attrs(&[("reason", r)]));
            }
            EventKind::TransferCompleted {
                dir,
                owner,
                bytes,
                duration_ms,
                ..
            } => {
                let d = dir.as_str().to_owned();
                i.transfer_bytes.add(
                    *bytes,
                    &self.attrs(&[("direction", d.clone()), ("owner", owner.as_str().to_owned())]),
                );
                i.transfer_duration
                    .record(duration_ms.max(0.0) / 1e3, &self.attrs(&[("direction", d)]));
            }
            EventKind::Pack {
                decision, bytes, ..
            } => {
                let name = stagehand::events::wire_name(decision);
                i.activations_packed
                    .add(1, &self.attrs(&[("decision", name)]));
                if *decision == PackDecision::Spilled {
                    i.spill_bytes.add(*bytes, &self.device);
                }
            }
            EventKind::Restored {
                bytes, stall_ms, ..
            } => {
                i.restores.add(1, &self.device);
                i.restore_bytes.add(*bytes, &self.device);
                if *stall_ms > 0.0 {
                    i.stall_duration.record(
                        stall_ms / 1e3,
                        &self.attrs(&[("source", "activations".to_owned())]),
                    );
                }
            }
            EventKind::Reservation {
                outcome, reason, ..
            } => {
                if matches!(
                    outcome,
                    ReservationOutcome::Granted | ReservationOutcome::Partial
                ) {
                    i.grants
                        .add(1, &self.attrs(&[("what", "reservation".to_owned())]));
                }
                if let Some(r) = reason {
                    i.denials.add(
                        1,
                        &self.attrs(&[
                            ("what", "reservation".to_owned()),
                            ("reason", r.as_str().to_owned()),
                        ]),
                    );
                }
            }
            EventKind::SlotGranted { .. } => {
                i.grants.add(1, &self.attrs(&[("what", "slot".to_owned())]))
            }
            EventKind::SlotDenied { reason, .. } => i.denials.add(
                1,
                &self.attrs(&[("what", "slot".to_owned()), ("reason", r_str(reason))]),
            ),
            EventKind::TrainStep(m) if m.step_time_s.is_finite() && m.step_time_s >= 0.0 => {
                i.step_duration.record(m.step_time_s, &self.device);
            }
            EventKind::EventsDropped { total } if *total > self.dropped_seen => {
                i.events_dropped.add(*total - self.dropped_seen, &self.device);
                self.dropped_seen = *total;
            }
            EventKind::RunEnded { .. } => {
                let end = self.wall(e.t_ns);
                self.end_phase(end);
                self.end_step(end);
            }
            _ => {}
        }
        if matches!(
            e.kind,
            EventKind::Residency { .. }
                | EventKind::BlockRegistered { .. }
                | EventKind::PoolConfigured { .. }
                | EventKind::SlabAcquired { .. }
                | EventKind::SlabReleased { .. }
                | EventKind::VramSample { .. }
        ) {
            self.dirty_gauges = true;
        }
    }
}

fn r_str(r: &stagehand::events::model::DenyReason) -> String {
    r.as_str().to_owned()
}

fn service_name() -> String {
    std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "stagehand".to_owned())
}

impl EventSink for OtelSink {
    fn on_event(&mut self, event: &Event) {
        self.record(event);
    }

    fn flush(&mut self) {
        // Gauges once per batch rather than once per event; the periodic reader exports them.
        self.record_gauges();
    }
}
