//! Micro-batches (gradient accumulation) through the trainer: a step's batch split into
//! `micro_batches` forwards and backwards, then one optimizer step. Through the handle the
//! losses equal the resident model's trained the same way, step for step; they follow one
//! micro-batch over the whole batch to float rounding; and a data-parallel group whose GPUs
//! share the micro-batches out trains as one device.

use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::optim::Kernel;
use stagehand::parallel::Devices;
use stagehand_examples::trainer::{train, train_group, Hooks, Memory, TrainConfig};

mod common;
use common::serial;

const BUDGET: u64 = 10 << 20;

/// 4 blocks of d=128, 8 sequences of 64 tokens a step, streamed and spilled under 10 MiB.
fn config(micro_batches: usize) -> TrainConfig {
    let mut cfg = TrainConfig::demo(5, 4, 128, 64, 8, BUDGET);
    cfg.kernel = Some(Kernel::Exact);
    cfg.threads = Some(1);
    cfg.micro_batches = micro_batches;
    cfg
}

fn close(a: &[f64], b: &[f64], tol: f64) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("{} steps against {}", a.len(), b.len()));
    }
    match a.iter().zip(b).position(|(x, y)| (x - y).abs() > tol * y.abs().max(1.0)) {
        Some(i) => Err(format!("step {}: {} against {}", i + 1, a[i], b[i])),
        None => Ok(()),
    }
}

#[test]
fn micro_batches_through_the_handle_train_as_the_resident_model() {
    let _serial = serial();
    let device = Device::host(BUDGET);
    let cfg = config(4);
    let mut resident = cfg.clone();
    resident.memory = Memory::Resident;
    let want = train(&resident, &device, &Bus::disabled(), |_, _, _| {}).expect("resident");
    let got = train(&cfg, &device, &Bus::disabled(), |_, _, _| {}).expect("stagehand");
    assert!(got.plan.as_ref().expect("a plan").streams(), "the budget makes blocks stream");
    close(&got.losses, &want.losses, 1e-6).expect("the same losses as resident, each step");
    assert!(got.losses[4] < got.losses[0], "it trains: {:?}", got.losses);
    // One micro-batch over the whole batch: the same updates, summed in another order.
    let whole = train(&config(1), &device, &Bus::disabled(), |_, _, _| {}).expect("one micro-batch");
    close(&got.losses, &whole.losses, 1e-5).expect("four micro-batches follow one");
    assert_ne!(got.losses, whole.losses, "the split is real: the sums round otherwise");
}

#[test]
fn a_group_shares_the_micro_batches_out_and_trains_as_one_device() {
    let _serial = serial();
    let one = train(&config(4), &Device::host(BUDGET), &Bus::disabled(), |_, _, _| {}).expect("one device");
    // Two devices, each two micro-batches of its four sequences.
    let ranks = train_group(&config(2), Devices::host(2, BUDGET), &Bus::disabled(), |_, _, _, _| {}, Hooks::default(), |b| b).expect("group");
    for r in &ranks {
        close(&r.summary.losses, &one.losses, 1e-5).unwrap_or_else(|e| panic!("rank {}: {e}", r.rank));
    }
}

#[test]
fn a_batch_that_does_not_split_is_refused_before_training() {
    let _serial = serial();
    let mut cfg = config(3);
    let err = train(&cfg, &Device::host(BUDGET), &Bus::disabled(), |_, _, _| {}).expect_err("8 sequences in 3");
    assert!(err.to_string().contains("multiple of 3"), "{err}");
    cfg.micro_batches = 0;
    let err = train(&cfg, &Device::host(BUDGET), &Bus::disabled(), |_, _, _| {}).expect_err("no micro-batch");
    assert!(err.to_string().contains("at least 1"), "{err}");
    let err = train_group(&config(4), Devices::host(4, BUDGET), &Bus::disabled(), |_, _, _, _| {}, Hooks::default(), |b| b)
        .expect_err("8 sequences over 4 devices in 4 micro-batches each");
    assert!(err.to_string().contains("multiple of 16"), "{err}");
}
