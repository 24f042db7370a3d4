//! OpenTelemetry export (feature `otlp`): the [`crate::catalog`]'s instruments with OTel names
//! and UCUM units (`stagehand.transfer` in `By`, `stagehand.phase.duration` in `s`), valued by
//! the same [`crate::mapping`] as `/metrics`; and a span `step` per training step (attribute
//! `step`, the step number) with a child span per phase (`forward`, `backward`, ...).
//!
//! [`from_env`] returns an exporter when the standard variables ask for one, so a program
//! attaches OTLP in one line:
//!
//! ```no_run
//! # fn main() -> stagehand_exporter::Result<()> {
//! # let hub = stagehand_events::Hub::new();
//! stagehand_exporter::otlp::attach_from_env(&hub)?; // OTLP whenever OTEL_EXPORTER_OTLP_ENDPOINT is set
//! # Ok(()) }
//! ```
//!
//! It reads `OTEL_SDK_DISABLED`; `OTEL_EXPORTER_OTLP_ENDPOINT` (or the per-signal
//! `OTEL_EXPORTER_OTLP_{METRICS,TRACES}_ENDPOINT`): no endpoint, no exporter;
//! `OTEL_METRICS_EXPORTER` / `OTEL_TRACES_EXPORTER` (`otlp`, or `none` to leave a signal out);
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (this build speaks `http/protobuf`; anything else is an
//! error rather than a silent fallback). The exporters themselves take
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT` and `OTEL_METRIC_EXPORT_INTERVAL`,
//! and the resource `OTEL_SERVICE_NAME` (default `stagehand`) and `OTEL_RESOURCE_ATTRIBUTES`.
//!
//! A collector cannot stall or bloat the run: exports run on the SDK's threads through a client
//! bounded in time and answer size ([`crate::collector`]), and a shutdown waits for the last
//! export at most [`SHUTDOWN_WAIT`].
//! [`OtelSink::with_providers`] takes providers built by the caller (other exporters, or the
//! SDK's in-memory ones in tests).

use crate::catalog::{Kind, CATALOG};
pub use crate::collector::SHUTDOWN_WAIT;
use crate::collector::{export_timeout, BoundedClient};
use crate::mapping::{gauges, initial, Mapper, Observation, Value};
use crate::{Error, Result};
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _};
use opentelemetry::trace::{Span as _, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use stagehand_events::model::{Event, EventKind, Phase};
use stagehand_events::{Hub, Snapshot, SnapshotSink};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The instrumentation scope name.
pub const SCOPE: &str = "stagehand";
/// The name of the span of a training step.
pub const STEP_SPAN: &str = "step";

/// One OTel instrument per catalog entry.
enum Instrument {
    Counter(Counter<f64>),
    Gauge(Gauge<f64>),
    Histogram(Histogram<f64>),
}

fn instruments(m: &Meter) -> Vec<Instrument> {
    CATALOG
        .iter()
        .map(|d| match d.kind {
            Kind::Counter => Instrument::Counter(
                m.f64_counter(d.otel_name()).with_unit(d.unit.ucum()).with_description(d.help).build(),
            ),
            Kind::Gauge => {
                Instrument::Gauge(m.f64_gauge(d.otel_name()).with_unit(d.unit.ucum()).with_description(d.help).build())
            }
            Kind::Histogram(b) => Instrument::Histogram(
                m.f64_histogram(d.otel_name())
                    .with_unit(d.unit.ucum())
                    .with_description(d.help)
                    .with_boundaries(b.to_vec())
                    .build(),
            ),
        })
        .collect()
}

/// Which signals the environment asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub metrics: bool,
    pub traces: bool,
}

/// What the `OTEL_*` variables (read through `get`) ask for: `None` when they ask for no
/// export, an error when they ask for something this build cannot do.
pub fn plan(get: impl Fn(&str) -> Option<String>) -> Result<Option<Plan>> {
    let var = |k: &str| get(k).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let general = var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
    let signal = |exporter: &str, endpoint: &str, protocol: &str| -> Result<bool> {
        match var(exporter).as_deref() {
            None | Some("otlp") => {}
            Some("none") => return Ok(false),
            Some(other) => {
                return Err(Error::Otel(format!("{exporter}='{other}': this build exports 'otlp' (or 'none')")))
            }
        }
        if !(general || var(endpoint).is_some()) {
            return Ok(false);
        }
        for p in [protocol, "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(v) = var(p) {
                if v != "http/protobuf" {
                    return Err(Error::Otel(format!("{p}='{v}': this build speaks 'http/protobuf'")));
                }
                break;
            }
        }
        Ok(true)
    };
    let metrics = signal("OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")?;
    let traces = signal("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")?;
    Ok((metrics || traces).then_some(Plan { metrics, traces }))
}

/// An OTLP/HTTP exporter when the `OTEL_*` variables ask for one, `None` when they do not.
pub fn from_env() -> Result<Option<OtelSink>> {
    match plan(|k| std::env::var(k).ok())? {
        Some(p) => OtelSink::build(p).map(Some),
        None => Ok(None),
    }
}

/// Attaches an OTLP exporter to `hub` when the `OTEL_*` variables ask for one; returns whether it
/// did. The sink exports everything when the hub drops it.
pub fn attach_from_env(hub: &Hub) -> Result<bool> {
    Ok(match from_env()? {
        Some(sink) => {
            hub.add_snapshot_sink(Box::new(sink));
            true
        }
        None => false,
    })
}

/// A [`SnapshotSink`] that records the run into OpenTelemetry metrics and spans, reading the
/// hub's snapshot for the gauges and the finished steps' tallies.
pub struct OtelSink {
    meter_provider: SdkMeterProvider,
    tracer_provider: SdkTracerProvider,
    tracer: SdkTracer,
    instruments: Vec<Instrument>,
    device: Vec<KeyValue>,
    mapper: Mapper,
    scratch: Vec<Observation>,
    /// Events recorded.
    events: u64,
    /// The run's time as of the last event, where open spans end when the sink closes.
    t_ns: u64,
    /// Whether the zero series were recorded (at the first event, under its device labels).
    initialized: bool,
    wall_anchor: SystemTime,
    /// The step span being recorded, as a context for its phase spans.
    step_cx: Option<Context>,
    /// The open phase: (phase, step, start).
    phase: Option<(Phase, u64, SystemTime)>,
    dirty_gauges: bool,
    closed: bool,
}

impl std::fmt::Debug for OtelSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtelSink")
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

fn service_name() -> String {
    std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "stagehand".to_owned())
}

impl OtelSink {
    /// OTLP/HTTP exporters for the signals of `plan`, configured by the `OTEL_*` variables.
    pub fn build(plan: Plan) -> Result<OtelSink> {
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
        let resource = Resource::builder().with_service_name(service_name()).build();
        let timeout = export_timeout(|k| std::env::var(k).ok());
        let client = BoundedClient::new(timeout).map_err(Error::Otel)?;
        let mut mp = SdkMeterProvider::builder().with_resource(resource.clone());
        if plan.metrics {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_http_client(client.clone())
                .with_timeout(timeout)
                .build()
                .map_err(|e| Error::Otel(format!("metric exporter: {e}")))?;
            mp = mp.with_reader(PeriodicReader::builder(exporter).build());
        }
        let mut tp = SdkTracerProvider::builder().with_resource(resource);
        if plan.traces {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_timeout(timeout)
                .build()
                .map_err(|e| Error::Otel(format!("span exporter: {e}")))?;
            tp = tp.with_batch_exporter(exporter);
        }
        Ok(OtelSink::with_providers(mp.build(), tp.build()))
    }

    /// A sink recording into providers the caller built.
    pub fn with_providers(meter_provider: SdkMeterProvider, tracer_provider: SdkTracerProvider) -> OtelSink {
        let meter = meter_provider.meter(SCOPE);
        let tracer = tracer_provider.tracer(SCOPE);
        OtelSink {
            instruments: instruments(&meter),
            meter_provider,
            tracer_provider,
            tracer,
            device: Vec::new(),
            mapper: Mapper::new(),
            scratch: Vec::new(),
            events: 0,
            t_ns: 0,
            initialized: false,
            wall_anchor: SystemTime::now(),
            step_cx: None,
            phase: None,
            dirty_gauges: false,
            closed: false,
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

    /// Ends open spans, exports everything and stops the exporters, waiting at most
    /// [`SHUTDOWN_WAIT`] for the collector (a slow one loses the last export, and says so).
    pub fn shutdown(mut self) -> Result<()> {
        self.close()
    }

    fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        // The gauges were recorded with the hub's last batch (the hub flushes its sinks after
        // every batch and when the bus closes).
        let end = self.wall(self.t_ns);
        self.end_phase(end);
        self.end_step(end);
        // The last export goes on a thread of its own, waited for a bounded time: a slow
        // collector must not hold the run's end.
        let (mp, tp) = (self.meter_provider.clone(), self.tracer_provider.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().name("stagehand-otlp-shutdown".into()).spawn(move || {
            let m = mp.shutdown();
            let t = tp.shutdown();
            let _ = tx.send((m, t));
        });
        if let Err(e) = spawned {
            return Err(Error::Otel(format!("cannot start the shutdown's thread: {e}")));
        }
        let (m, t) = rx.recv_timeout(SHUTDOWN_WAIT).map_err(|_| {
            Error::Otel(format!(
                "the collector did not take the last export within {} s: given up on it",
                SHUTDOWN_WAIT.as_secs()
            ))
        })?;
        m.map_err(|e| Error::Otel(format!("metrics shutdown: {e}")))?;
        t.map_err(|e| Error::Otel(format!("spans shutdown: {e}")))
    }

    fn wall(&self, t_ns: u64) -> SystemTime {
        self.wall_anchor + Duration::from_nanos(t_ns)
    }

    fn apply(&self, o: &Observation) {
        let Some(inst) = self.instruments.get(o.metric as usize) else { return };
        let def = o.metric.def();
        let mut attrs = self.device.clone();
        attrs.extend(def.labels.iter().zip(&o.labels).map(|(k, v)| KeyValue::new(*k, v.clone())));
        match (inst, o.value) {
            (Instrument::Counter(c), Value::Add(v)) if v >= 0.0 && v.is_finite() => c.add(v, &attrs),
            // A counter series exists from zero; a histogram cannot be created empty in OTel.
            (Instrument::Counter(c), Value::Touch) => c.add(0.0, &attrs),
            (Instrument::Gauge(g), Value::Set(v)) => g.record(v, &attrs),
            (Instrument::Histogram(h), Value::Observe(v)) if v.is_finite() => h.record(v, &attrs),
            _ => {}
        }
    }

    fn end_phase(&mut self, at: SystemTime) {
        if let Some((phase, step, start)) = self.phase.take() {
            let parent = self.step_cx.clone().unwrap_or_default();
            let mut attrs = self.device.clone();
            attrs.push(KeyValue::new("phase", phase.as_str()));
            attrs.push(KeyValue::new("step", step as i64));
            let mut span = self
                .tracer
                .span_builder(phase.as_str())
                .with_start_time(start)
                .with_attributes(attrs)
                .start_with_context(&self.tracer, &parent);
            span.end_with_timestamp(at.max(start));
        }
    }

    fn end_step(&mut self, at: SystemTime) {
        if let Some(cx) = self.step_cx.take() {
            cx.span().end_with_timestamp(at);
        }
    }

    fn record_gauges(&mut self, state: &Snapshot) {
        if !self.dirty_gauges {
            return;
        }
        self.dirty_gauges = false;
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        gauges(state, &mut out);
        for o in &out {
            self.apply(o);
        }
        self.scratch = out;
    }

    fn spans(&mut self, e: &Event) {
        match &e.kind {
            EventKind::PhaseChanged { from, to, .. } => {
                let now = self.wall(e.t_ns);
                self.end_phase(now);
                if *to == Phase::StepBegin || *from == Phase::StepEnd {
                    self.end_step(now);
                }
                if *to == Phase::StepBegin {
                    let mut attrs = self.device.clone();
                    attrs.push(KeyValue::new("step", e.step as i64));
                    let span = self
                        .tracer
                        .span_builder(STEP_SPAN)
                        .with_start_time(now)
                        .with_attributes(attrs)
                        .start(&self.tracer);
                    self.step_cx = Some(Context::new().with_span(span));
                }
                if *to != Phase::Idle {
                    self.phase = Some((*to, e.step, now));
                }
            }
            EventKind::RunEnded { .. } => {
                let end = self.wall(e.t_ns);
                self.end_phase(end);
                self.end_step(end);
            }
            _ => {}
        }
    }

    fn record(&mut self, e: &Event, state: &Snapshot) {
        self.events = self.events.saturating_add(1);
        self.t_ns = state.t_ns;
        if let EventKind::RunStarted { device, wall_clock_unix_ms, .. } = &e.kind {
            self.device = vec![
                KeyValue::new("device", device.index.to_string()),
                KeyValue::new("device_name", device.name.clone()),
            ];
            self.wall_anchor = UNIX_EPOCH + Duration::from_millis(*wall_clock_unix_ms);
            // A new run: its zero series under its own device labels.
            self.initialized = false;
        }
        if !self.initialized {
            self.initialized = true;
            for o in initial() {
                self.apply(&o);
            }
        }
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        self.mapper.on_event(e, state, &mut out);
        for o in &out {
            self.apply(o);
        }
        self.scratch = out;
        self.spans(e);
        self.dirty_gauges = true;
    }
}

impl SnapshotSink for OtelSink {
    /// Counters count from here on.
    fn attach(&mut self, state: &Snapshot) {
        self.mapper = Mapper::at(state);
        self.t_ns = state.t_ns;
    }

    fn on_event(&mut self, event: &Event, state: &Snapshot) {
        self.record(event, state);
    }

    fn flush(&mut self, state: &Snapshot) {
        // Gauges once per batch rather than once per event; the periodic reader exports them.
        self.record_gauges(state);
    }

    /// A replay seek: the counters go on from the new position (OTLP has no counter reset to
    /// announce a jump back), the gauges show it.
    fn rewind_end(&mut self, state: &Snapshot) {
        self.mapper = Mapper::at(state);
        self.t_ns = state.t_ns;
        self.dirty_gauges = true;
        self.record_gauges(state);
    }
}

impl Drop for OtelSink {
    /// A sink dropped by its hub still ends its spans and exports what it holds.
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            eprintln!("stagehand: OpenTelemetry export at shutdown failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_endpoint_no_exporter() {
        assert_eq!(plan(env(&[])).ok(), Some(None));
        assert_eq!(plan(env(&[("OTEL_SERVICE_NAME", "x")])).ok(), Some(None));
        let both = Some(Some(Plan { metrics: true, traces: true }));
        assert_eq!(plan(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")])).ok(), both);
        assert_eq!(
            plan(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"), ("OTEL_SDK_DISABLED", "true")])).ok(),
            Some(None)
        );
    }

    #[test]
    fn signals_follow_their_own_variables() {
        let only_traces = plan(env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")])).ok();
        assert_eq!(only_traces, Some(Some(Plan { metrics: false, traces: true })));
        let no_metrics = plan(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_METRICS_EXPORTER", "none")])).ok();
        assert_eq!(no_metrics, Some(Some(Plan { metrics: false, traces: true })));
    }

    #[test]
    fn what_this_build_cannot_do_is_an_error_not_a_fallback() {
        let grpc = plan(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]));
        assert!(grpc.as_ref().is_err_and(|e| e.to_string().contains("http/protobuf")), "{grpc:?}");
        let zipkin = plan(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_TRACES_EXPORTER", "zipkin")]));
        assert!(zipkin.is_err());
        // The per-signal protocol wins over the general one.
        let mixed = plan(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ]));
        assert_eq!(mixed.ok(), Some(Some(Plan { metrics: true, traces: false })));
    }
}
