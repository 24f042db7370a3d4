//! Tests of levels, the flight recorder and the attached telemetry, on a live bus.

use super::*;
use crate::jsonl::read_file;
use crate::snapshot::Snapshot;
use crate::synthetic::{self, SyntheticRun};
use std::time::Duration;

fn config(level: Level, path: PathBuf) -> TelemetryConfig {
    TelemetryConfig {
        level,
        path: Some(path),
        flight_recorder: FlightConfig { enabled: false, ..Default::default() },
        ..Default::default()
    }
}

/// The totals that have per-step aggregates, as one comparable value.
fn totals(s: &Snapshot) -> String {
    let w = &s.weights;
    let a = &s.activations;
    let c = &s.conductor;
    let t = &s.transfers;
    format!(
        "w {} {} {} {} {} {} {} | a {} {} {} {} {} {} {} {} {} {} {} {} | c {} {} {} {} {} | h2d {} {} {} {} d2h {} {} {} {}",
        w.prefetch_hits, w.prefetch_misses, w.stall_count, w.stall_time_ms, w.evictions, w.h2d_bytes, w.d2h_bytes,
        a.counts.saved, a.counts.kept, a.counts.spilled, a.counts.weight_handles, a.counts.restored, a.counts.predicted, a.counts.spill_bytes, a.counts.restore_bytes,
        a.counts.stall_time_ms, a.counts.stall_count, a.counts.pool_hits, a.counts.pool_misses,
        c.grants, c.partials, c.denials, c.slot_grants, c.slot_denials,
        t.h2d.count, t.h2d.bytes, t.h2d.busy_ms, t.h2d.last_gbps, t.d2h.count, t.d2h.bytes, t.d2h.busy_ms, t.d2h.last_gbps,
    )
}

fn breakdowns(s: &Snapshot) -> String {
    let c = &s.conductor;
    let a = &s.activations;
    let blocks: Vec<_> = s.blocks.iter().map(|b| (b.loads, b.evictions, b.state, b.refcount, b.protected)).collect();
    let pool = |p: &Option<crate::snapshot::PoolView>| {
        p.as_ref().map(|p| {
            let classes: Vec<(u64, u64)> = p.classes.iter().map(|c| (c.hits, c.exhausted)).collect();
            let held: Vec<(u32, u32)> = p.classes.iter().map(|c| (c.in_use, c.peak_in_use)).collect();
            format!("{classes:?} {held:?} {} {} {}", p.pageable_fallbacks, p.pageable_bytes, p.total_wait_ms)
        })
    };
    format!(
        "{:?} {:?} {:?} {} | {:?} {} {} | {blocks:?} {:?} | {:?} {:?} | {} {} {} {} {} {} | {:?}",
        c.by_mode, c.by_priority, c.denials_by_reason, c.ceilings, a.kept_by_reason, a.duplicates, a.finalized_inline,
        s.residency, pool(&s.weight_pool), pool(&s.activation_pool),
        c.active_reservations, c.active_bytes, c.h2d_inflight, c.d2h_inflight, s.transfers.h2d.inflight, s.transfers.d2h.inflight,
        (s.itinerary.cursor, s.itinerary.backward, &s.itinerary.window),
    )
}

#[test]
fn summary_and_full_files_replay_to_the_same_steps_and_totals() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bus = Bus::new();
    let full = attach(&bus, config(Level::Full, dir.path().join("full.jsonl"))).expect("full");
    let summary = attach(&bus, config(Level::Summary, dir.path().join("summary.jsonl.zst"))).expect("summary");
    let run = SyntheticRun { blocks: 10, steps: 6, end_mid_step: false };
    synthetic::publish(run, &bus, Duration::ZERO);
    bus.close();
    let live = bus.hub().expect("enabled").snapshot();
    let (full_events, _) = read_file(&full.paths()[0]).expect("full reads");
    let (summary_events, report) = read_file(&summary.paths()[0]).expect("summary reads");
    assert_eq!(report.skipped_total, 0);
    assert!(summary_events.len() * 5 < full_events.len(), "{} vs {}", summary_events.len(), full_events.len());
    let from_full = Snapshot::from_events(&full_events);
    let from_summary = Snapshot::from_events(&summary_events);
    assert_eq!(from_full.steps.len(), 6);
    assert_eq!(from_summary.steps, from_full.steps, "per-step records");
    assert_eq!(totals(&from_summary), totals(&from_full));
    assert_eq!(totals(&from_full), totals(&live));
    // The breakdowns by label, each block's loads and evictions, the pools' counts and the
    // shape of memory come out the same from the summary's aggregates and readings.
    for (name, s) in [("summary", &from_summary), ("live", &live)] {
        assert_eq!(breakdowns(s), breakdowns(&from_full), "{name}");
        assert_eq!(s.vram_history, from_full.vram_history, "{name}: every reading");
        assert_eq!(s.vram_owners_history, from_full.vram_owners_history, "{name}");
        assert_eq!(s.vram_peak_bytes, from_full.vram_peak_bytes, "{name}");
        assert_eq!(s.tallies.counts.committed, from_full.tallies.counts.committed, "{name}");
    }
    assert!(!from_summary.conductor.denials_by_reason.is_empty() && from_summary.blocks.iter().all(|b| b.loads > 0));
    assert!(from_summary.weights.prefetch_hits > 0 && from_summary.transfers.d2h.count > 0);
    assert_eq!((full.lost(), summary.lost()), (0, 0));
}

#[test]
fn off_writes_nothing_and_needs_no_path() {
    let bus = Bus::new();
    let t = attach(&bus, TelemetryConfig { level: Level::Off, ..Default::default() }).expect("off");
    assert!(t.paths().is_empty());
    let err = attach(&bus, TelemetryConfig { level: Level::Full, ..Default::default() }).expect_err("no path");
    assert!(err.to_string().contains("needs a file path"), "{err}");
    assert_eq!("summary".parse::<Level>(), Ok(Level::Summary));
    assert!("verbose".parse::<Level>().is_err());
}

#[test]
fn a_full_disk_reaches_the_snapshot_as_lost_telemetry() {
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this system");
        return;
    }
    let bus = Bus::new();
    let t = attach(&bus, config(Level::Full, PathBuf::from("/dev/full"))).expect("opens the device");
    let n = synthetic::publish(SyntheticRun::finished(2), &bus, Duration::ZERO);
    bus.close();
    let snap = bus.hub().expect("enabled").snapshot();
    assert!(t.lost() >= n, "lost {} of {n}", t.lost());
    // Every loss reaches the snapshot, except that the last report cannot itself be written.
    assert!(snap.telemetry_lost >= n && t.lost() - snap.telemetry_lost <= 1, "{} vs {}", snap.telemetry_lost, t.lost());
    assert_eq!(t.written(), 0);
}

#[test]
fn the_flight_recorder_dumps_recent_steps_once_per_reason_and_on_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bus = Bus::new();
    let t = attach(
        &bus,
        TelemetryConfig {
            level: Level::Summary,
            path: Some(dir.path().join("run.jsonl")),
            flight_recorder: FlightConfig {
                steps: 2,
                // Every step's restores stall 0.25 ms: a stall each step, one dump.
                stall_ms: 0.2,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .expect("attach");
    synthetic::publish(SyntheticRun { blocks: 8, steps: 5, end_mid_step: false }, &bus, Duration::ZERO);
    bus.flush();
    let snap = bus.hub().expect("enabled").snapshot();
    let names: Vec<String> = snap
        .flight_records
        .iter()
        .map(|p| PathBuf::from(p).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
        .collect();
    assert_eq!(
        names,
        ["run.flight-0001-host_stall.jsonl", "run.flight-0002-pool_exhausted.jsonl", "run.flight-0003-pageable_fallback.jsonl"],
        "one dump per reason"
    );
    let (events, report) = read_file(&snap.flight_records[0]).expect("a dump reads like any file");
    assert_eq!(report.skipped_total, 0);
    assert!(matches!(events[0].kind, EventKind::RunStarted { .. }), "starts with the preamble");
    let from_dump = Snapshot::from_events(&events);
    assert_eq!(from_dump.blocks.len(), 8);
    // Full detail of the trigger's step, which a summary file does not have.
    // The trigger: step 1's prefetch miss (3.4 ms), with the residency detail before it.
    assert!(matches!(events.last().map(|e| &e.kind), Some(EventKind::PrefetchMiss { .. })));
    assert!(events.iter().any(|e| matches!(e.kind, EventKind::Residency { .. })));

    let asked = t.dump("Looked odd!").expect("a dump on request");
    assert!(asked.ends_with("run.flight-0004-looked_odd_.jsonl"), "{asked:?}");
    let (events, _) = read_file(&asked).expect("reads");
    let steps: std::collections::BTreeSet<u64> =
        events.iter().filter(|e| !crate::preamble::Preamble::is_context(&e.kind)).map(|e| e.step).collect();
    assert!(steps.iter().all(|s| *s >= 4), "only the last two steps: {steps:?}");
    assert!(matches!(t.dump("looked odd!"), Err(TelemetryError::RateLimited(_))), "rate limited");
    assert!(matches!(t.dump("another reason"), Err(TelemetryError::RateLimited(_))), "whatever the reason");
    bus.flush();
    assert_eq!(bus.hub().expect("enabled").snapshot().flight_records.len(), 4, "announced");
}

#[test]
fn a_dump_passes_over_names_an_earlier_run_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("run.flight-0001-request.jsonl"), "kept\n").expect("writes");
    let bus = Bus::new();
    let t = attach(&bus, TelemetryConfig { level: Level::Off, path: Some(dir.path().join("run.jsonl")), ..Default::default() })
        .expect("attach");
    bus.enter_phase(1, crate::model::Phase::Forward);
    let p = t.dump("request").expect("a dump");
    assert!(p.ends_with("run.flight-0002-request.jsonl"), "{p:?}");
    assert_eq!(std::fs::read_to_string(dir.path().join("run.flight-0001-request.jsonl")).expect("reads"), "kept\n");
    assert_eq!(t.last_dump().map(|d| d.path), Some(p));
    assert_eq!(t.dumps_written(), 1);
}

#[test]
fn flight_records_go_beside_a_file_but_not_beside_a_device() {
    let (dir, stem) = super::flight::dump_location(Some(std::path::Path::new("runs/today.jsonl.zst")));
    assert_eq!((dir, stem.as_str()), (std::path::PathBuf::from("runs"), "today"));
    let (dir, stem) = super::flight::dump_location(Some(std::path::Path::new("/dev/null")));
    assert_eq!((dir, stem.as_str()), (std::path::PathBuf::from("."), "null"));
}

#[test]
fn the_first_steps_pool_fallbacks_do_not_dump_but_later_ones_do() {
    use crate::{Event, EventKind, Phase, PoolKind, SCHEMA_VERSION};
    let mut rec = super::flight::FlightRecorder::new(super::flight::FlightConfig::default(), ".".into(), "t".into());
    let at = |step: u64, kind: EventKind| Event {
        v: SCHEMA_VERSION,
        seq: step,
        t_ns: step * 1_000_000_000_000,
        step,
        phase: Phase::Forward,
        device: None,
        kind,
    };
    let fallback = || EventKind::PageableFallback { pool: PoolKind::Activations, bytes: 4096 };
    let exhausted = || EventKind::PoolExhausted { pool: PoolKind::Activations, class: 0, requested_bytes: 4096 };
    // Step 1 traces and sizes the pools: its fallbacks are expected.
    assert_eq!(rec.record(&at(1, exhausted())), None);
    assert_eq!(rec.record(&at(1, fallback())), None);
    // A later step that still runs out is an incident.
    assert_eq!(rec.record(&at(2, exhausted())).as_deref(), Some("pool_exhausted"));
    assert_eq!(rec.record(&at(2, fallback())).as_deref(), Some("pageable_fallback"));
}
