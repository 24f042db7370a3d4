//! Checkpointed blocks (`GptConfig::checkpoint`): each block one recompute scope over its input,
//! weights and biases, through the handle in layer mode with trainable streamed weights. The
//! losses equal the resident model's step for step (the same computation in plain tch), in fp32
//! and in bf16, while the activation runtime stores only block inputs: it spills less than the
//! same model without checkpointing under the same budget.

use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::optim::Kernel;
use stagehand::Precision;
use stagehand_examples::trainer::{train, Memory, TrainConfig};

mod common;
use common::serial;

#[test]
fn checkpointed_blocks_train_as_the_resident_model_and_spill_less() {
    let _serial = serial();
    for precision in [Precision::Fp32, Precision::Bf16] {
        // Room for the prefetch window; the activations of 4 x 64 tokens do not fit beside it.
        let budget = if precision == Precision::Fp32 { 10 << 20 } else { 6 << 20 };
        let device = Device::host(budget);
        let mut cfg = TrainConfig::demo(6, 4, 128, 64, 4, budget).with_precision(precision);
        // The demo's rule: checkpointed blocks in 16-bit precisions.
        assert_eq!(cfg.model.checkpoint, precision.is_mixed(), "{precision}");
        cfg.kernel = Some(Kernel::Exact);
        cfg.model.checkpoint = false;
        let mut resident = cfg.clone();
        resident.memory = Memory::Resident;
        resident.model.checkpoint = true;
        let want = train(&resident, &device, &Bus::disabled(), |_, _, _| {}).expect("resident");
        let plain = train(&cfg, &device, &Bus::disabled(), |_, _, _| {}).expect("stagehand");
        cfg.model.checkpoint = true;
        let got = train(&cfg, &device, &Bus::disabled(), |_, _, _| {}).expect("stagehand, checkpointed");
        assert_eq!(got.losses, want.losses, "{precision}: losses step for step");
        assert_eq!(plain.losses, want.losses, "{precision}: losses without checkpointing");
        assert!(got.losses[5] < got.losses[0], "{precision}: it trains: {:?}", got.losses);
        let plan = got.plan.as_ref().expect("a plan");
        assert!(plan.streams(), "{precision}: the budget makes blocks stream: {:?}", plan.reasons);
        assert!(plain.spill_bytes > 0, "{precision}: without checkpointing the budget spills");
        assert!(
            got.spill_bytes < plain.spill_bytes / 2,
            "{precision}: checkpointed blocks store only their inputs: {} bytes spilled against {}",
            got.spill_bytes,
            plain.spill_bytes
        );
    }
}

/// The same checkpointed model data parallel over two simulated devices (each rank's blocks
/// recomputed on its own backward thread) trains as one device over the same global batch, in
/// fp32 to float rounding (the group's loss is the mean of the ranks' means; in bf16 the ranks'
/// summed 16-bit gradients also round otherwise than one device's, checkpointed or not).
#[test]
fn checkpointed_blocks_train_in_a_group_as_on_one_device() {
    use stagehand::parallel::Devices;
    use stagehand_examples::trainer::{train_group, Hooks};
    let _serial = serial();
    let budget = 10 << 20;
    let mut cfg = TrainConfig::demo(4, 4, 128, 64, 4, budget);
    cfg.model.checkpoint = true;
    cfg.kernel = Some(Kernel::Exact);
    cfg.threads = Some(1);
    let one = train(&cfg, &Device::host(budget), &Bus::disabled(), |_, _, _| {}).expect("one device");
    let ranks = train_group(&cfg, Devices::host(2, budget), &Bus::disabled(), |_, _, _, _| {}, Hooks::default(), |b| b).expect("group");
    assert_eq!(ranks.len(), 2);
    for r in &ranks {
        assert_eq!(r.summary.losses.len(), one.losses.len(), "rank {}", r.rank);
        for (step, (a, b)) in r.summary.losses.iter().zip(&one.losses).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "rank {} step {}: {a} against one device's {b}", r.rank, step + 1);
        }
        assert_eq!(r.summary.spill_bytes, 0, "rank {}: only block inputs stored", r.rank);
    }
    assert!(one.losses[3] < one.losses[0], "it trains: {:?}", one.losses);
}
