//! Prometheus metrics of a run, updated from events and the hub's snapshot by a
//! [`SnapshotSink`].
//!
//! The instruments are the [`crate::catalog`]'s, named the Prometheus way (`stagehand_` prefix,
//! base units `_bytes` and `_seconds`, `_total` for counters), and their values come from the
//! shared [`crate::mapping`], so `/metrics` and the OTLP export agree. Labels are
//! low-cardinality (direction, owner, state, pool, class index, reason, phase, part); block and
//! tensor ids stay in the events and never become labels. Every series carries the const labels
//! `device` (the CUDA ordinal) and `device_name`, as GPU exporters (DCGM, nvidia_gpu_exporter)
//! label theirs, so the series can be joined. A data-parallel run's events carry their device:
//! each device gets series of its own (its `device` label), fed by its events and the run's,
//! which it reduces into a snapshot of that device (the hub's follows the first device).

use crate::catalog::{Kind, CATALOG};
use crate::mapping::{gauges, initial, Mapper, Observation, Value, SHAPED_GAUGES};
use crate::{Error, Result};
use prometheus::{CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry, TextEncoder};
use stagehand_events::model::{Event, EventKind};
use stagehand_events::{Snapshot, SnapshotSink};
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
    /// Drops the series of [`SHAPED_GAUGES`], which the next gauges set again from the state.
    fn reset_shaped_gauges(&self) {
        for m in SHAPED_GAUGES {
            if let Some(Family::Gauge(g)) = self.families.get(m as usize) {
                g.reset();
            }
        }
    }

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

/// One device's series of a data-parallel run, from that device's own reduction of its events
/// and the run's.
struct Lane {
    families: Families,
    snapshot: Snapshot,
    mapper: Mapper,
}

impl Lane {
    fn on_event(&mut self, e: &Event, scratch: &mut Vec<Observation>) {
        self.snapshot.apply(e);
        scratch.clear();
        self.mapper.on_event(e, &self.snapshot, scratch);
        for o in scratch.iter() {
            self.families.apply(o);
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
    /// A data-parallel run: each device's series, by its index (empty for a run on one device,
    /// whose events carry none).
    lanes: std::collections::BTreeMap<u32, Lane>,
    /// The run's `run_started`, for a device's series made after it.
    started: Option<Event>,
    /// Events recorded.
    events: u64,
}

/// Devices with series of their own, at most (events of others go to the run's series).
const MAX_LANES: usize = 64;

impl Inner {
    /// Fresh series under `labels`, counted by `mapper`: what Prometheus reads as a counter
    /// reset.
    fn restart(&mut self, labels: &DeviceLabels, mapper: Mapper) -> Result<()> {
        self.families = Families::new(labels)?;
        self.mapper = mapper;
        self.lanes.clear();
        Ok(())
    }

    /// Records `e`, the hub's snapshot after it being `state`.
    fn on_event(&mut self, e: &Event, state: &Snapshot) -> Result<()> {
        self.events = self.events.saturating_add(1);
        if let EventKind::RunStarted { device, .. } = &e.kind {
            if !self.fixed_labels {
                // A new run: new labels and fresh series (counter resets are what Prometheus
                // expects of a restarted process).
                let labels = DeviceLabels::new(device.index, device.name.clone());
                self.restart(&labels, Mapper::at(state))?;
                self.labels = Some(labels);
            }
            self.started = Some(e.clone());
        }
        if let Some(d) = e.device {
            if self.lanes.contains_key(&d) || self.lanes.len() < MAX_LANES {
                self.lane_event(d, e)?;
                return Ok(());
            }
        }
        // The run's own events reach every device's series too.
        if e.device.is_none() {
            let devices: Vec<u32> = self.lanes.keys().copied().collect();
            for d in devices {
                self.lane_event(d, e)?;
            }
        }
        self.scratch.clear();
        self.mapper.on_event(e, state, &mut self.scratch);
        for o in &self.scratch {
            self.families.apply(o);
        }
        Ok(())
    }

    /// Applies `e` to device `d`'s series, made (with the run's start) at its first event.
    fn lane_event(&mut self, d: u32, e: &Event) -> Result<()> {
        if !self.lanes.contains_key(&d) {
            let name = self.labels.as_ref().map(|l| l.device_name.clone()).unwrap_or_default();
            let mut lane = Lane { families: Families::new(&DeviceLabels::new(d, name))?, snapshot: Snapshot::new(), mapper: Mapper::new() };
            if let Some(s) = &self.started {
                lane.on_event(s, &mut self.scratch);
            }
            self.lanes.insert(d, lane);
        }
        let Some(lane) = self.lanes.get_mut(&d) else { return Ok(()) };
        lane.on_event(e, &mut self.scratch);
        Ok(())
    }

    /// Sets the gauges from the run's state (the hub's `state`, each device's own); called
    /// once per batch, not per event.
    fn refresh_gauges(&mut self, state: &Snapshot) {
        self.scratch.clear();
        gauges(state, &mut self.scratch);
        self.families.reset_shaped_gauges();
        for o in &self.scratch {
            self.families.apply(o);
        }
        for lane in self.lanes.values() {
            self.scratch.clear();
            gauges(&lane.snapshot, &mut self.scratch);
            lane.families.reset_shaped_gauges();
            for o in &self.scratch {
                lane.families.apply(o);
            }
        }
    }

    /// What `/metrics` shows: the run's series, or each device's of a data-parallel run (one
    /// family per name, its series from every device).
    fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        if self.lanes.is_empty() {
            return self.families.registry.gather();
        }
        let mut out: Vec<prometheus::proto::MetricFamily> = Vec::new();
        for lane in self.lanes.values() {
            let families = &lane.families;
            for mut f in families.registry.gather() {
                match out.iter_mut().find(|o| o.name() == f.name()) {
                    Some(o) => o.mut_metric().extend(f.take_metric()),
                    None => out.push(f),
                }
            }
        }
        out
    }
}

/// The Prometheus side of a run: attach it to a [`Hub`](stagehand_events::Hub) as a snapshot
/// sink and render `/metrics` from any thread. Cheap to clone; clones share one registry.
/// Counters and histograms move with each event, gauges with each batch the hub delivers (and
/// each flush): a scrape shows the run as of the last batch.
///
/// ```
/// use stagehand_events::Hub;
/// use stagehand_exporter::Metrics;
/// let hub = Hub::new();
/// let metrics = Metrics::new();
/// hub.add_snapshot_sink(Box::new(metrics.clone()));
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
            .field("events", &inner.events)
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
                lanes: std::collections::BTreeMap::new(),
                started: None,
                events: 0,
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device labels in use, once known.
    pub fn labels(&self) -> Option<DeviceLabels> {
        self.lock().labels.clone()
    }

    /// The registry, for callers that gather or serve it themselves (its gauges as of the hub's
    /// last batch). A data-parallel run's devices have registries of their own:
    /// [`render`](Self::render) shows them all.
    pub fn registry(&self) -> Registry {
        self.lock().families.registry.clone()
    }

    /// The metrics in the Prometheus text format ([`TEXT_CONTENT_TYPE`]).
    pub fn render(&self) -> Result<String> {
        let families = self.lock().gather();
        let mut buf = Vec::new();
        TextEncoder::new().encode(&families, &mut buf)?;
        String::from_utf8(buf).map_err(|e| Error::Encode(e.to_string()))
    }
}

impl SnapshotSink for Metrics {
    /// Counters count from here on; gauges show the run as it stands.
    fn attach(&mut self, state: &Snapshot) {
        let mut inner = self.lock();
        inner.mapper = Mapper::at(state);
        inner.refresh_gauges(state);
    }

    fn on_event(&mut self, event: &Event, state: &Snapshot) {
        // Registration cannot fail after construction; a failed rebuild keeps the old families.
        let _ = self.lock().on_event(event, state);
    }

    fn flush(&mut self, state: &Snapshot) {
        self.lock().refresh_gauges(state);
    }

    /// A replay seek: fresh series (a counter reset, as after a restarted process) that the
    /// history then adds up, so `/metrics` agrees with the replay's position either way.
    fn rewind_begin(&mut self) {
        let mut inner = self.lock();
        let labels = inner.labels.clone().unwrap_or_default();
        // Families::new only fails on a name clash inside this module; the old series then stay
        // and the history adds to them, which is the best left to do.
        let _ = inner.restart(&labels, Mapper::new());
    }

    fn rewind_event(&mut self, event: &Event, state: &Snapshot) {
        let _ = self.lock().on_event(event, state);
    }
}
