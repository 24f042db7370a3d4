//! Prometheus metrics of a run, updated from events by an [`EventSink`].
//!
//! The instruments are the [`crate::catalog`]'s, named the Prometheus way (`stagehand_` prefix,
//! base units `_bytes` and `_seconds`, `_total` for counters), and their values come from the
//! shared [`crate::mapping`], so `/metrics` and the OTLP export agree. Labels are
//! low-cardinality (direction, owner, state, pool, class index, reason, phase, part); block and
//! tensor ids stay in the events and never become labels. Every series carries the const labels
//! `device` (the CUDA ordinal) and `device_name`, as GPU exporters (DCGM, nvidia_gpu_exporter)
//! label theirs, so the series can be joined.

use crate::catalog::{Kind, CATALOG};
use crate::mapping::{initial, Mapper, Observation, Value};
use crate::{Error, Result};
use prometheus::{CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry, TextEncoder};
use stagehand::events::model::{Event, EventKind};
use stagehand::events::EventSink;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The content type of the text exposition format this module renders.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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

/// One Prometheus family per catalog entry.
enum Family {
    Counter(CounterVec),
    Gauge(GaugeVec),
    Histogram(HistogramVec),
}

/// The families, in catalog order, registered in one registry with one set of const labels.
struct Families {
    registry: Registry,
    families: Vec<Family>,
}

impl Families {
    fn new(l: &DeviceLabels) -> Result<Families> {
        let registry = Registry::new();
        let mut families = Vec::with_capacity(CATALOG.len());
        for d in CATALOG {
            let name = d.prometheus_name();
            let opts = Opts::new(name.clone(), d.help).const_labels(l.to_map());
            let f = match d.kind {
                Kind::Counter => {
                    let c = CounterVec::new(opts, d.labels)?;
                    registry.register(Box::new(c.clone()))?;
                    Family::Counter(c)
                }
                Kind::Gauge => {
                    let g = GaugeVec::new(opts, d.labels)?;
                    registry.register(Box::new(g.clone()))?;
                    Family::Gauge(g)
                }
                Kind::Histogram(buckets) => {
                    let h = HistogramVec::new(
                        HistogramOpts::new(name, d.help).const_labels(l.to_map()).buckets(buckets.to_vec()),
                        d.labels,
                    )?;
                    registry.register(Box::new(h.clone()))?;
                    Family::Histogram(h)
                }
            };
            families.push(f);
        }
        let f = Families { registry, families };
        for o in initial() {
            f.apply(&o);
        }
        Ok(f)
    }

    fn apply(&self, o: &Observation) {
        let Some(f) = self.families.get(o.metric as usize) else { return };
        let labels: Vec<&str> = o.labels.iter().map(String::as_str).collect();
        // A label count that does not match the family is a bug in the mapping (the mapping's
        // tests check every observation against the catalog); skip rather than panic.
        match (f, o.value) {
            (Family::Counter(c), Value::Add(v)) if v >= 0.0 && v.is_finite() => {
                if let Ok(c) = c.get_metric_with_label_values(&labels) {
                    c.inc_by(v);
                }
            }
            (Family::Counter(c), Value::Touch) => {
                let _ = c.get_metric_with_label_values(&labels);
            }
            (Family::Gauge(g), Value::Set(v)) => {
                if let Ok(g) = g.get_metric_with_label_values(&labels) {
                    g.set(v);
                }
            }
            (Family::Gauge(g), Value::Touch) => {
                let _ = g.get_metric_with_label_values(&labels);
            }
            (Family::Histogram(h), Value::Observe(v)) if v.is_finite() => {
                if let Ok(h) = h.get_metric_with_label_values(&labels) {
                    h.observe(v);
                }
            }
            (Family::Histogram(h), Value::Touch) => {
                let _ = h.get_metric_with_label_values(&labels);
            }
            _ => {}
        }
    }
}

struct Inner {
    labels: Option<DeviceLabels>,
    /// Labels fixed at construction are never replaced by those of `run_started`.
    fixed_labels: bool,
    families: Families,
    mapper: Mapper,
    scratch: Vec<Observation>,
}

impl Inner {
    /// Fresh series under `labels` and an empty run: what Prometheus reads as a counter reset.
    fn restart(&mut self, labels: &DeviceLabels) -> Result<()> {
        self.families = Families::new(labels)?;
        self.mapper = Mapper::new();
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
        self.scratch.clear();
        self.mapper.on_event(e, &mut self.scratch);
        for o in &self.scratch {
            self.families.apply(o);
        }
        Ok(())
    }

    /// Sets the gauges from the run's state; called before each render.
    fn refresh_gauges(&mut self) {
        self.scratch.clear();
        self.mapper.gauges(&mut self.scratch);
        for o in &self.scratch {
            self.families.apply(o);
        }
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
            .field("events", &inner.mapper.snapshot().events_applied)
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
                mapper: Mapper::new(),
                scratch: Vec::new(),
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
        let mut inner = self.lock();
        inner.refresh_gauges();
        inner.families.registry.clone()
    }

    /// The metrics in the Prometheus text format ([`TEXT_CONTENT_TYPE`]).
    pub fn render(&self) -> Result<String> {
        let families = {
            let mut inner = self.lock();
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

    /// A replay seek: fresh series (a counter reset, as after a restarted process) that the
    /// history then adds up, so `/metrics` agrees with the replay's position either way.
    fn rewind_begin(&mut self) {
        let mut inner = self.lock();
        let labels = inner.labels.clone().unwrap_or_default();
        // Families::new only fails on a name clash inside this module; the old series then stay
        // and the history adds to them, which is the best left to do.
        let _ = inner.restart(&labels);
    }

    fn rewind_event(&mut self, event: &Event) {
        let _ = self.record(event);
    }
}
