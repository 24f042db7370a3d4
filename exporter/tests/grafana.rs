//! The Grafana dashboard against the exporter: every query names a metric the exporter
//! registers, every series drawn is in a unit consistent with the metric and what the query
//! does to it (a rate of bytes is bytes per second, a ratio is a fraction, a loss is a number),
//! and every panel has data from the first scrape.

use serde_json::Value;
use stagehand_exporter::catalog::{by_prometheus_name, Kind, MetricDef, Unit};
use stagehand_exporter::Metrics;

fn dashboard() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/stagehand.json")).expect("dashboard");
    serde_json::from_str(&text).expect("JSON")
}

/// The metric names an expression queries.
fn names(expr: &str) -> Vec<&str> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("stagehand_"))
        .collect()
}

/// The Grafana units a series may be drawn in, from its metrics and what the query does.
fn allowed(expr: &str, defs: &[&MetricDef]) -> Vec<&'static str> {
    let rate = expr.contains("rate(") || expr.contains("increase(");
    let quantile = expr.contains("histogram_quantile(");
    let mean = expr.contains("_sum") && expr.contains("_count") && expr.contains('/');
    let unit = defs[0].unit;
    assert!(defs.iter().all(|d| d.unit == unit), "{expr}: metrics of different units");
    if quantile || mean {
        return match unit {
            Unit::Seconds => vec!["s"],
            Unit::Bytes => vec!["bytes", "decbytes"],
            _ => vec!["short", "none"],
        };
    }
    if expr.contains(" / ") {
        // A ratio of two quantities of the same unit: a fraction.
        return vec!["percentunit"];
    }
    match (unit, rate) {
        (Unit::Bytes, true) => vec!["Bps", "binBps"],
        // Seconds per second: the share of time.
        (Unit::Seconds, true) => vec!["percentunit"],
        (Unit::Count(_), true) => vec!["ops", "cps", "reqps"],
        (Unit::Bytes, false) => vec!["bytes", "decbytes"],
        (Unit::Seconds, false) => vec!["s"],
        (Unit::Count(_), false) => vec!["short", "none"],
        (Unit::Dimensionless, _) => vec!["none", "short"],
    }
}

/// The unit a panel draws a target in: an override for its refId, else the panel's.
fn unit_of<'a>(panel: &'a Value, ref_id: &str) -> &'a str {
    let overridden = panel["fieldConfig"]["overrides"].as_array().into_iter().flatten().find_map(|o| {
        (o["matcher"]["id"] == "byFrameRefID" && o["matcher"]["options"] == ref_id)
            .then(|| o["properties"].as_array().into_iter().flatten().find(|p| p["id"] == "unit"))
            .flatten()
            .and_then(|p| p["value"].as_str())
    });
    overridden.or_else(|| panel["fieldConfig"]["defaults"]["unit"].as_str()).unwrap_or("")
}

#[test]
fn every_query_names_an_exported_metric_in_a_consistent_unit() {
    let dash = dashboard();
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 15);
    for p in panels {
        let title = p["title"].as_str().unwrap_or("");
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            let found: Vec<&str> = names(expr);
            assert!(!found.is_empty(), "{title}: {expr}");
            let defs: Vec<&MetricDef> = found
                .iter()
                .map(|n| by_prometheus_name(n).unwrap_or_else(|| panic!("{title} queries unknown {n}")))
                .collect();
            for (n, d) in found.iter().zip(&defs) {
                // Histogram series are queried by their _bucket, _sum or _count.
                if matches!(d.kind, Kind::Histogram(_)) {
                    assert_ne!(*n, d.prometheus_name(), "{title}: a histogram is queried by its series");
                }
            }
            let unit = unit_of(p, t["refId"].as_str().unwrap_or(""));
            let ok = allowed(expr, &defs);
            assert!(ok.contains(&unit), "{title} ({}) draws {expr} in '{unit}', expected one of {ok:?}", t["refId"]);
        }
    }
}

#[test]
fn the_two_questions_have_their_panels() {
    let dash = dashboard();
    let exprs: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten().filter_map(|t| t["expr"].as_str().map(str::to_owned)))
        .collect();
    for needed in ["stagehand_last_step_time_seconds", "stagehand_step_time_seconds_total", "stagehand_vram_owner_bytes", "stagehand_vram_at_peak_bytes", "stagehand_memory_limit_bytes"] {
        assert!(exprs.iter().any(|e| e.contains(needed)), "no panel queries {needed}");
    }
}

/// Metrics whose only true value comes from the run (a zero would be a false reading).
const APPEAR_WITH_THE_RUN: &[&str] = &["stagehand_loss", "stagehand_memory_limit_bytes", "stagehand_pool_used_bytes", "stagehand_pool_capacity_bytes"];

#[test]
fn every_queried_series_exists_from_the_first_scrape() {
    let text = Metrics::new().render().expect("renders");
    let present: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let dash = dashboard();
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            for n in names(t["expr"].as_str().expect("expr")) {
                if APPEAR_WITH_THE_RUN.contains(&n) {
                    continue;
                }
                assert!(present.contains(&n), "{}: {n} has no series before the first event", p["title"]);
            }
        }
    }
}
