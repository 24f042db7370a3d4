//! Gradient accumulation through the handle: `train_step_micro` over two micro-batches trains as
//! plain tch does accumulating `loss / 2` of each before one optimizer step (bit-identical on the
//! host device), with the streamed blocks' gradients summed on the host (the second
//! micro-batch's gradients cross the link once and a worker adds them into the first's there)
//! or on the device (the first's sums brought back from their host buffers). Each
//! micro-batch follows the itinerary: the host steps start during the last one's backward, and a
//! micro-batch's first blocks are prefetched across the end of the one before.

use stagehand::device::Device;
use stagehand::events::{Bus, Direction, EventKind, Hub, Owner};
use std::sync::Arc;
use stagehand::nn as snn;
use stagehand::optim::Kernel;
use stagehand::Stagehand;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 32;
const LAYERS: i64 = 4;

fn net(layers: impl Fn(i64) -> Box<dyn Module>) -> Vec<Box<dyn Module>> {
    (0..LAYERS).map(layers).collect()
}

fn loss(model: &[Box<dyn Module>], x: &Tensor) -> Tensor {
    model.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).tanh()).square().mean(Kind::Float)
}

/// A handle with `above` bytes of budget beyond what the device holds already (on CUDA,
/// libtorch's own), on `device` (the host device: one of that budget's own).
fn handle(device: &Device, above: u64) -> stagehand::StagehandBuilder {
    let cuda = device.is_cuda();
    let budget = above + if cuda { device.memory().allocated } else { 0 };
    Stagehand::builder().budget_bytes(budget).device(if cuda { device.clone() } else { Device::host(budget) })
}

/// The test's net on the handle's root, drawn from `seed`.
fn streamed(sh: &Stagehand, seed: i64) -> Vec<Box<dyn Module>> {
    let _g = rng();
    tch::manual_seed(seed);
    net(|i| Box::new(snn::linear(sh.root() / "blocks" / i / "fc", D, D, Default::default())) as Box<dyn Module>)
}

fn micro(step: i64, i: usize, dev: tch::Device) -> Tensor {
    let _g = rng();
    tch::manual_seed(1000 + step * 10 + i as i64);
    Tensor::randn([8, D], (Kind::Float, dev))
}

/// Plain tch from seed 3: step `s` accumulates `loss / n` over `counts[s]` micro-batches before
/// one AdamW step. The trained VarStore and each step's mean loss.
fn plain_accumulation(counts: &[usize], lr: f64, dev: tch::Device) -> (nn::VarStore, Vec<f64>) {
    let (vs, plain) = common::seeded_on_cpu(3, dev, |vs| {
        net(|i| Box::new(nn::linear(vs.root() / "blocks" / i / "fc", D, D, Default::default())) as Box<dyn Module>)
    });
    let mut opt = nn::AdamW::default().build(&vs, lr).expect("adamw");
    let mut losses = Vec::new();
    for (s, &n) in counts.iter().enumerate() {
        opt.zero_grad();
        let mut total = 0.0;
        for i in 0..n {
            let l = loss(&plain, &micro(s as i64, i, dev));
            (&l / n as f64).backward();
            total += l.double_value(&[]);
        }
        opt.step();
        losses.push(total / n as f64);
    }
    (vs, losses)
}

/// The handle's losses and trained variables against plain tch's (bit-identical on the host
/// device).
fn assert_trains_as(sh: &Stagehand, got: &[f64], want: &[f64], vs: &nn::VarStore) {
    let cuda = vs.device().is_cuda();
    if cuda {
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-4 * b.abs().max(1e-3), "{got:?} vs {want:?}");
        }
    } else {
        assert_eq!(got, want);
    }
    let snap = sh.var_store().expect("snapshot").variables();
    for (n, t) in vs.variables() {
        let t = t.to_device(tch::Device::Cpu);
        let g = snap[&n].to_device(tch::Device::Cpu);
        if cuda {
            assert!(g.allclose(&t, 1e-4, 1e-5, false), "{n}");
        } else {
            assert!(g.equal(&t), "{n}: parameters differ");
        }
    }
}

#[test]
fn two_micro_batches_equal_plain_accumulation_with_host_sums() {
    two_micro_batches_equal_plain_accumulation(true);
}

#[test]
fn two_micro_batches_equal_plain_accumulation_with_device_sums() {
    two_micro_batches_equal_plain_accumulation(false);
}

fn two_micro_batches_equal_plain_accumulation(host_sums: bool) {
    let device = common::device();
    let dev = device.tch_device();
    let (steps, lr) = (4, 1e-2);
    let (vs, want) = plain_accumulation(&[2; 4], lr, dev);

    let cuda = device.is_cuda();
    let bus = Bus::with_hub(Arc::new(Hub::new()), 1 << 16);
    let events = common::Collected::on(&bus);
    let sh = handle(&device, 96 << 10).bus(bus.clone()).kernel(Kernel::Exact).host_gradient_sums(host_sums).build().expect("handle");
    let model = streamed(&sh, 3);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let mut got = Vec::new();
    let block = ((D * D + D) * 4) as u64;
    for s in 0..steps {
        got.push(sh.train_step_micro(&mut opt, 2, |i| loss(&model, &micro(s, i, dev))).expect("step").loss);
        let m = sh.weights().last_step_metrics();
        if host_sums {
            // The blocks that left the device after the first micro-batch's backward send
            // their second gradients once, added on the host: nothing comes back.
            assert_eq!(m.grad_sum_h2d_bytes, 0, "step {s}: {m:?}");
            assert!(m.grad_sum_host_bytes > 0 && m.grad_sum_host_bytes % block == 0, "step {s}: {m:?}");
            assert_eq!(m.d2h_bytes, LAYERS as u64 * block + m.grad_sum_host_bytes, "step {s}: {m:?}");
        } else {
            // The blocks that left the device after the first micro-batch's backward have their
            // sums brought back once, whole, in the second's; each of those sums also left twice.
            assert!(m.grad_sum_h2d_bytes > 0 && m.grad_sum_h2d_bytes % block == 0, "step {s}: {m:?}");
            assert!(2 * m.grad_sum_h2d_bytes <= m.d2h_bytes, "step {s}: {m:?}");
            assert_eq!(m.grad_sum_host_bytes, 0, "step {s}: {m:?}");
        }
        assert_eq!(m.load_bytes() + m.grad_sum_h2d_bytes, m.h2d_bytes, "step {s}: the sums are part of the copies in");
        // Each micro-batch follows the itinerary (in the first step, the first micro-batch's
        // order): the host steps start as the last backward leaves each block, and the minimum
        // counts both passes.
        assert!(m.host_steps_overlapped > 0 && m.host_steps_overlapped <= m.host_steps, "step {s}: {m:?}");
        if s > 1 && !cuda {
            assert_eq!(m.load_bytes(), m.min_h2d_bytes, "step {s}: {m:?}");
        }
    }
    assert!(sh.plan().expect("plan").streams(), "blocks stream");
    opt.wait().expect("host steps");
    assert_trains_as(&sh, &got, &want, &vs);
    let e = sh.train_step_micro(&mut opt, 0, |i| loss(&model, &micro(9, i, dev))).expect_err("no micro-batches");
    assert!(e.to_string().contains("micro_batches = 0"), "{e}");
    // One figure: the weight runtime's copies in, as its steps count them and as its transfer
    // events add up (what a full telemetry file and a summary one both total).
    sh.finish().expect("finish");
    bus.flush();
    let events = events.take();
    let steps: u64 = events.iter().filter_map(|e| match &e.kind { EventKind::WeightStep(m) => Some(m.h2d_bytes), _ => None }).sum();
    let copies: u64 = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::TransferCompleted { owner: Owner::Weights, dir: Direction::H2d, bytes, .. } => Some(*bytes),
            _ => None,
        })
        .sum();
    assert_eq!(steps, copies, "weight_step h2d_bytes against the weights' H2D transfers");
}

/// Steps of different micro-batch counts, one of them a single pass: the itinerary learned
/// from a step of two passes must not queue a block's host step before a longer step's last
/// micro-batch has added its gradients, nor wait for passes a shorter step never runs.
#[test]
fn steps_of_different_micro_batch_counts_equal_plain_accumulation() {
    let device = common::device();
    let dev = device.tch_device();
    let (counts, lr) = ([2, 3, 1, 4, 2, 1, 3], 1e-2);
    let (vs, want) = plain_accumulation(&counts, lr, dev);
    let sh = handle(&device, 96 << 10).kernel(Kernel::Exact).build().expect("handle");
    let model = streamed(&sh, 3);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let mut got = Vec::new();
    for (s, &n) in counts.iter().enumerate() {
        got.push(sh.train_step_micro(&mut opt, n, |i| loss(&model, &micro(s as i64, i, dev))).expect("step").loss);
    }
    assert!(sh.plan().expect("plan").streams(), "blocks stream");
    opt.wait().expect("host steps");
    assert_trains_as(&sh, &got, &want, &vs);
}

/// Eight micro-batches through a room of two slots: the first block (whose weights backward
/// never reads, its input needing no gradient) leaves the device in every backward, and each
/// later micro-batch needs it first.
#[test]
fn a_micro_batch_finds_its_first_blocks_prefetched_across_the_last_ones_end() {
    const MICRO: usize = 8;
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let sh = handle(&device, 40 << 10).build().expect("handle");
    let model = streamed(&sh, 5);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
    for s in 0..4 {
        sh.train_step_micro(&mut opt, MICRO, |i| loss(&model, &micro(s, i, dev))).expect("step");
        let m = sh.weights().last_step_metrics();
        // After the traced step, and the step that settles the room, the blocks each
        // micro-batch starts with are loaded ahead of it: the weights change only after the
        // step's last micro-batch. (A prefetch the copy engine or a slot held back until too
        // late is a miss too; how many depends on the machine's load, never one a micro-batch.)
        if s > 1 {
            assert!(m.prefetch_misses < MICRO as u64 / 2, "step {s}: {m:?}");
            if !cuda {
                assert_eq!(m.load_bytes(), m.min_h2d_bytes, "step {s}: {m:?}");
            }
        }
    }
    let plan = sh.plan().expect("plan");
    assert_eq!(plan.slots, 2, "{:?}", plan.reasons);
}
