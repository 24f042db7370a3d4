//! The demo's model in bf16: trained through the handle (blocks streamed in bf16, float32
//! masters on the host, activations spilled) it gives the same losses, step for step, as the
//! resident reference (plain tch with bf16 weights, float32 masters and AdamW over them) on the
//! host device; and it does move bf16 bytes, not float32 ones.

use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::optim::Kernel;
use stagehand::Precision;
use stagehand_examples::trainer::{train, Memory, TrainConfig};

#[test]
fn the_demo_model_in_bf16_trains_as_the_resident_recipe() {
    stagehand::torch::init();
    stagehand::torch::hooks::install().expect("hook engine");
    // One intra-op thread: libtorch's CPU reductions then sum in one order in both runs.
    tch::set_num_threads(1);
    let budget = 6 << 20;
    let device = Device::host(budget);
    let mut cfg = TrainConfig::demo(6, 4, 128, 32, 4, budget).with_precision(Precision::Bf16);
    cfg.kernel = Some(Kernel::Exact);
    // The blocks unchecked, so that activations spill (tests/checkpoint.rs covers the default).
    cfg.model.checkpoint = false;
    let mut resident = cfg.clone();
    resident.memory = Memory::Resident;
    let want = train(&resident, &device, &Bus::disabled(), |_, _, _| {}).expect("resident");
    let got = train(&cfg, &device, &Bus::disabled(), |_, _, _| {}).expect("stagehand");
    assert_eq!(got.losses, want.losses, "losses step for step");
    assert!(got.losses[5] < got.losses[0], "it trains: {:?}", got.losses);
    let plan = got.plan.expect("a plan");
    assert!(plan.streams(), "the budget makes blocks stream: {:?}", plan.reasons);
    // The pinned host copies and gradients are bf16: 2 bytes a parameter each.
    let params = cfg.model.parameters() as u64;
    assert!(plan.pinned_bytes < 5 * params, "{} pinned bytes for {params} parameters", plan.pinned_bytes);
    assert_eq!(plan.master_bytes, 4 * params, "every parameter has a float32 master");
}
