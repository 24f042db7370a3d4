//! Out-of-memory forensics through the handle, on the host device (whose budget is enforced for
//! the runtime's own allocations): a step whose allocation does not fit returns an error that
//! says what held the device and what was about to happen, the bus carries the same report,
//! and the flight recorder leaves a dump that names itself in the report.

use stagehand::device::Device;
use stagehand::events::jsonl::read_file;
use stagehand::events::{BlockState, EventKind, Level, Phase, TelemetryConfig};
use stagehand::nn as snn;
use stagehand::{Error, Stagehand};
use tch::nn::Module;
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 32;
const BUDGET: u64 = 256 << 10;

fn model(sh: &Stagehand) -> Vec<snn::Linear> {
    let _g = rng();
    tch::manual_seed(1);
    let r = sh.root();
    (0..4).map(|i| snn::linear(&r / "blocks" / i / "fc", D, D, Default::default())).collect()
}

fn step(sh: &Stagehand, layers: &[snn::Linear], opt: &mut stagehand::optim::Optimizer) -> stagehand::Result<stagehand::StepReport> {
    let x = Tensor::ones([4, D], (Kind::Float, tch::Device::Cpu));
    sh.train_step(opt, || layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h)).square().mean(Kind::Float))
}

#[test]
fn an_allocation_that_does_not_fit_reports_what_held_the_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("run.jsonl");
    let device = Device::host(BUDGET);
    let sh = Stagehand::builder()
        .budget_bytes(BUDGET)
        .device(device.clone())
        .telemetry(TelemetryConfig { level: Level::Summary, path: Some(file.clone()), ..Default::default() })
        .build()
        .expect("handle");
    let layers = model(&sh);
    let mut opt = sh.optimizer(tch::nn::Sgd::default(), 1e-2).expect("optimizer");
    let plan = sh.prepare().expect("a plan for the budget");
    assert_eq!(plan.resident_blocks.len(), 4, "the budget keeps every block resident: {plan:?}");
    let block_bytes = sh.weights().blocks()[0].bytes as u64;
    // Something else takes the device's memory after the plan was made: two blocks still fit,
    // the third does not.
    let other = BUDGET - 2 * block_bytes - block_bytes / 2;
    device.account(other as i64);

    let err = step(&sh, &layers, &mut opt).expect_err("the step runs out of memory");
    let Error::OutOfMemory(report) = &err else { panic!("not an out-of-memory report: {err}") };
    let text = err.to_string();
    assert_eq!((report.step, report.phase), (1, Phase::Forward), "{text}");
    assert!(report.doing.starts_with("making block 'blocks.2' resident"), "{}", report.doing);
    assert_eq!(report.requested_bytes, block_bytes, "{report:?}");
    assert_eq!(report.held.budget_bytes, BUDGET);
    let held: Vec<(&str, BlockState, bool)> = report.held.blocks.iter().map(|b| (b.name.as_str(), b.state, b.resident)).collect();
    assert_eq!(held, [("blocks.0", BlockState::GpuReady, true), ("blocks.1", BlockState::GpuReady, true)]);
    assert_eq!(report.owners.weights_bytes, 2 * block_bytes);
    let acts = report.held.activations_kept_bytes;
    assert_eq!(report.owners.allocated_bytes, other + 2 * block_bytes + acts, "the device's reading at the failure");
    assert_eq!(report.owners.other_bytes, other, "what the run does not own");
    assert!(report.held.error.contains("device out of memory"), "{}", report.held.error);
    let dump = report.dump.clone().expect("a flight record");
    assert!(text.contains(&format!("Flight record: {}", dump.display())), "{text}");
    for words in [
        "out of device memory in the forward of step 1 while making block 'blocks.2' resident",
        "of a 256.0 KiB budget: weights 8.5 KiB in 2 blocks (2 resident, 0 streamed) [blocks.0 gpu_ready 4.2 KiB, blocks.1 gpu_ready 4.2 KiB]",
    ] {
        assert!(text.contains(words), "'{words}' missing from: {text}");
    }

    // The dump holds the run's context and the report, which names the dump.
    let (events, r) = read_file(&dump).expect("the dump reads");
    assert_eq!(r.skipped_total, 0);
    assert!(matches!(events.first().map(|e| &e.kind), Some(EventKind::LimitsSet { .. })), "{:?}", events.first());
    let named = events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::OutOfMemory { dump, held, .. } => Some((dump.clone(), held.clone())),
            _ => None,
        })
        .expect("the report is in the dump");
    assert_eq!(named.0.as_deref(), Some(dump.display().to_string().as_str()));
    assert_eq!(named.1.as_deref(), Some(&report.held));
    // Opened in a reader (stagehand-top --replay, the replay server: the same reducer), the dump
    // leads with the out-of-memory finding the dashboards show first.
    let findings = stagehand::events::insight::findings(&stagehand::events::Snapshot::from_events(&events));
    let oom = findings.iter().find(|f| f.id == "out_of_memory").expect("an out-of-memory finding");
    assert!(oom.message.contains("ran out of memory at step 1 (forward)") && oom.message.contains("weights held 8.5 KiB"), "{}", oom.message);
    // The summary-level file keeps it too, with the same name.
    sh.telemetry().expect("attached").flush();
    let (file_events, _) = read_file(&file).expect("the telemetry file reads");
    assert!(file_events.iter().any(|e| matches!(&e.kind, EventKind::OutOfMemory { dump: Some(d), .. } if *d == dump.display().to_string())));
    assert!(file_events.iter().any(|e| matches!(&e.kind, EventKind::FlightRecorded { reason, .. } if reason == "out_of_memory")));
    // The live snapshot links the report to its dump.
    let snap = sh.hub().expect("hub").snapshot();
    assert_eq!(snap.out_of_memory.back().and_then(|o| o.dump.clone()), Some(dump.display().to_string()));
}

#[test]
fn without_telemetry_the_error_says_why_there_is_no_record() {
    let device = Device::host(BUDGET);
    let sh = Stagehand::builder().budget_bytes(BUDGET).device(device.clone()).build().expect("handle");
    let layers = model(&sh);
    let mut opt = sh.optimizer(tch::nn::Sgd::default(), 1e-2).expect("optimizer");
    sh.prepare().expect("plan");
    device.account(BUDGET as i64);
    let err = step(&sh, &layers, &mut opt).expect_err("out of memory");
    assert!(matches!(&err, Error::OutOfMemory(r) if r.dump.is_none()), "{err}");
    assert!(err.to_string().contains("No flight record: no telemetry is attached"), "{err}");
}

#[test]
fn a_step_that_fits_is_not_touched() {
    let sh = Stagehand::builder().budget_bytes(BUDGET).device(Device::host(BUDGET)).build().expect("handle");
    let layers = model(&sh);
    let mut opt = sh.optimizer(tch::nn::Sgd::default(), 1e-2).expect("optimizer");
    let r = step(&sh, &layers, &mut opt).expect("the step fits");
    assert!(r.loss.is_finite());
    assert_eq!(r.non_finite, None, "guards are off");
}
