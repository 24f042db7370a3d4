//! Prometheus and OpenTelemetry expose the same instruments, from one table, with consistent
//! names and units, and the same values for the same events.

use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use prometheus_parse::{Scrape, Value};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::bus::feed;
use stagehand_exporter::catalog::{by_otel_name, by_prometheus_name, Kind, Metric};
use stagehand_exporter::{Metrics, OtelSink, CATALOG};
use std::collections::{BTreeMap, BTreeSet};

#[test]
fn both_exporters_expose_the_same_instruments_with_the_same_values() {
    let events = synthetic::events(SyntheticRun::finished(3));

    let mut prom = Metrics::new();
    feed(&mut prom, &events);
    let text = prom.render().expect("renders");
    let mut prom_ids = BTreeSet::new();
    for l in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, ty) = l.split_once(' ').expect("name and type");
        let d = by_prometheus_name(name).unwrap_or_else(|| panic!("{name} is not in the catalog"));
        assert_eq!(ty, d.kind.prometheus_type(), "{name}");
        prom_ids.insert(d.id);
    }

    let exporter = InMemoryMetricExporter::default();
    let mp = SdkMeterProvider::builder().with_reader(PeriodicReader::builder(exporter.clone()).build()).build();
    let mut otel = OtelSink::with_providers(mp, SdkTracerProvider::builder().build());
    feed(&mut otel, &events);
    otel.force_flush().expect("flushes");
    let finished = exporter.get_finished_metrics().expect("metrics");
    let last = finished.last().expect("an export");
    let mut otel_ids = BTreeSet::new();
    let mut otel_sums: BTreeMap<Metric, f64> = BTreeMap::new();
    for scope in last.scope_metrics() {
        for m in scope.metrics() {
            let d = by_otel_name(m.name()).unwrap_or_else(|| panic!("{} is not in the catalog", m.name()));
            assert_eq!(m.unit(), d.unit.ucum(), "{}", m.name());
            otel_ids.insert(d.id);
            match m.data() {
                AggregatedMetrics::F64(MetricData::Sum(s)) => {
                    assert_eq!(d.kind, Kind::Counter, "{} exported as a sum", m.name());
                    otel_sums.insert(d.id, s.data_points().map(|p| p.value()).sum());
                }
                AggregatedMetrics::F64(MetricData::Gauge(_)) => assert_eq!(d.kind, Kind::Gauge, "{}", m.name()),
                AggregatedMetrics::F64(MetricData::Histogram(_)) => {
                    assert!(matches!(d.kind, Kind::Histogram(_)), "{}", m.name())
                }
                _ => panic!("{}: not an f64 sum, gauge or histogram", m.name()),
            }
        }
    }
    let all: BTreeSet<Metric> = CATALOG.iter().map(|d| d.id).collect();
    assert_eq!(prom_ids, all, "Prometheus exposes every instrument of the table");
    assert_eq!(otel_ids, all, "OpenTelemetry exposes every instrument of the table");

    // Counters add up to the same totals on both sides.
    let s = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    for d in CATALOG.iter().filter(|d| d.kind == Kind::Counter) {
        let name = d.prometheus_name();
        let prom_total: f64 = s
            .samples
            .iter()
            .filter(|x| x.metric == name)
            .map(|x| match x.value {
                Value::Counter(v) => v,
                _ => 0.0,
            })
            .sum();
        let otel_total = otel_sums.get(&d.id).copied().unwrap_or(0.0);
        assert!((prom_total - otel_total).abs() <= 1e-9 * prom_total.abs().max(1.0), "{name}: {prom_total} vs {otel_total}");
    }
    assert!(otel_sums.get(&Metric::TransferBytes).is_some_and(|v| *v > 0.0));
    otel.shutdown().expect("shuts down");
}
