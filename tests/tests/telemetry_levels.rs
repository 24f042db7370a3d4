//! The demo's loop through the handle at the default telemetry level: the summary file of a real
//! run replays to the same per-step records as a full-level file of the same run (written side by
//! side from one bus), at a small fraction of its size.

use stagehand::device::Device;
use stagehand::events::jsonl::read_file;
use stagehand::events::telemetry::{self, Level, TelemetryConfig};
use stagehand::events::{Bus, Snapshot};
use stagehand_examples::trainer::{announce, train_stagehand, TrainConfig};

#[test]
fn a_summary_file_of_a_real_run_replays_to_the_full_files_step_records() {
    stagehand::torch::init();
    let dir = tempfile::tempdir().expect("tempdir");
    let (summary, full) = (dir.path().join("summary.jsonl"), dir.path().join("full.jsonl"));
    let budget = 4 << 20;
    let device = Device::host(budget);
    let bus = Bus::new();
    let cfg = TrainConfig::demo(12, 3, 64, 16, 8, budget);
    // The full file beside the handle's own (summary) telemetry, both fed by the one bus.
    let full_t = telemetry::attach(&bus, TelemetryConfig { level: Level::Full, path: Some(full.clone()), ..Default::default() })
        .expect("full file");
    let (b, c, d) = (bus.clone(), cfg.clone(), device.clone());
    let tc = TelemetryConfig { path: Some(summary.clone()), ..Default::default() };
    assert_eq!(tc.level, Level::Summary, "the default level");
    train_stagehand(&cfg, &device, &bus, |_, _, _| {}, move |builder| {
        builder.telemetry(tc).attach(move |_| {
            announce(&b, &c, &d, "levels");
            Ok(Box::new(()))
        })
    })
    .expect("training runs");
    full_t.flush();
    bus.close();

    let (s_events, s_report) = read_file(&summary).expect("summary reads");
    let (f_events, _) = read_file(&full).expect("full reads");
    assert_eq!(s_report.skipped_total, 0);
    let (s, f) = (Snapshot::from_events(&s_events), Snapshot::from_events(&f_events));
    assert_eq!(f.steps.iter().filter(|r| r.train.is_some()).count(), 12);
    assert_eq!(s.steps, f.steps, "per-step records");
    assert_eq!((s.transfers.h2d.bytes, s.transfers.d2h.bytes), (f.transfers.h2d.bytes, f.transfers.d2h.bytes));
    assert_eq!((s.weights.prefetch_hits, s.activations.counts.spilled), (f.weights.prefetch_hits, f.activations.counts.spilled));
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    // Every reading and each step's counts by label are in the summary too: still a fraction.
    assert!(size(&summary) * 5 < size(&full), "summary {} vs full {} bytes", size(&summary), size(&full));
}
