//! Mixed precision through the `Stagehand` handle, against plain tch doing the standard recipe
//! by hand: bf16 weights on the device, float32 master weights and AdamW state, the forward under
//! autocast (the loss in float32), bf16 gradients applied to the masters in float32.
//! Bit-identical on the host device; within bf16 tolerance on CUDA. Also: a bf16 model trains
//! through float32 masters, fp16 skips an overflowing step and lowers its loss scale, and 8-bit
//! optimizer state trains as float32 state does.

use stagehand::device::Device;
use stagehand::nn as snn;
use stagehand::optim::Kernel;
use stagehand::torch::amp::Autocast;
use stagehand::{Precision, Stagehand, StateStorage};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const V: i64 = 50;
const D: i64 = 32;
const H: i64 = 64;
const LAYERS: usize = 4;
const BATCH: i64 = 16;
const SEQ: i64 = 16;
const BUDGET: u64 = 400 << 10;

struct Net {
    tok: Box<dyn Module>,
    blocks: Vec<(Box<dyn Module>, Box<dyn Module>)>,
    ln: nn::LayerNorm,
    head: Box<dyn Module>,
}

impl Net {
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let mut h = self.tok.forward(ids);
        for (fc1, fc2) in &self.blocks {
            h = &h + fc2.forward(&fc1.forward(&h).gelu("none"));
        }
        self.head.forward(&self.ln.forward(&h)).view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
    }
}

fn build(r: &nn::Path<'_>, managed: Option<&Stagehand>) -> Net {
    let lin = |p: &str, i: i64, o: i64| -> Box<dyn Module> {
        match managed {
            Some(sh) => {
                let path = p.split('.').fold(sh.root(), |acc, s| acc / s);
                Box::new(snn::linear(path, i, o, Default::default()))
            }
            None => {
                let mut parts = p.split('.');
                let first = r / parts.next().unwrap_or_default();
                Box::new(nn::linear(parts.fold(first, |acc, s| acc / s), i, o, Default::default()))
            }
        }
    };
    Net {
        tok: match managed {
            Some(sh) => Box::new(snn::embedding(sh.root() / "tok", V, D, Default::default())),
            None => Box::new(nn::embedding(r / "tok", V, D, Default::default())),
        },
        blocks: (0..LAYERS).map(|i| (lin(&format!("blocks.{i}.fc1"), D, H), lin(&format!("blocks.{i}.fc2"), H, D))).collect(),
        // Unmanaged on the handle: float32 on the device, cast per op by autocast.
        ln: nn::layer_norm(r / "ln", vec![D], Default::default()),
        head: lin("head", D, V),
    }
}

fn batch(seed: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(seed);
    (Tensor::randint(V, [BATCH, SEQ], (Kind::Int64, dev)), Tensor::randint(V, [BATCH, SEQ], (Kind::Int64, dev)))
}

/// The standard recipe in plain tch: float32 masters (`master`), bf16 copies of the managed
/// weights computing (`compute`), the layer norm trained in float32 directly; AdamW over the
/// masters. Returns each step's loss and the final masters.
fn reference(seed: i64, dev: tch::Device, steps: i64, lr: f64) -> (Vec<f64>, Vec<(String, Tensor)>) {
    let (master, _) = common::seeded_on_cpu(seed, dev, |vs| build(&vs.root(), None));
    let (compute, net) = common::seeded_on_cpu(seed, dev, |vs| build(&vs.root(), None));
    // The managed weights compute in bf16; the norm is shared with the masters (it trains in
    // float32 on the device, as an unmanaged variable does).
    let managed = |n: &str| !n.starts_with("ln.");
    tch::no_grad(|| {
        for (name, mut t) in compute.variables() {
            if managed(&name) {
                t.set_data(&t.to_kind(Kind::BFloat16));
            }
        }
    });
    let mut opt = nn::AdamW::default().build(&master, lr).expect("adamw");
    let mut losses = Vec::new();
    for s in 0..steps {
        let (ids, targets) = batch(100 + s, dev);
        let loss = {
            let _ac = Autocast::enter(dev.is_cuda(), Kind::BFloat16).expect("autocast");
            net.loss(&ids, &targets)
        };
        assert_eq!(loss.kind(), Kind::Float, "autocast computes the loss in float32");
        opt.zero_grad();
        for (_, t) in compute.variables() {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        loss.backward();
        let cv = compute.variables();
        for (name, m) in master.variables() {
            let g = cv[&name].grad();
            assert_eq!(g.kind(), if managed(&name) { Kind::BFloat16 } else { Kind::Float }, "{name}: its gradient's dtype");
            stagehand::torch::optim::set_grad(&m, Some(&g.to_kind(Kind::Float))).expect("grad");
        }
        opt.step();
        tch::no_grad(|| {
            for (name, m) in master.variables() {
                cv[&name].detach().copy_(&m);
            }
        });
        losses.push(loss.double_value(&[]));
    }
    let mut vars: Vec<(String, Tensor)> = master.variables().into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu))).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, vars)
}

fn handle(device: &Device, precision: Precision) -> Stagehand {
    let cuda = device.is_cuda();
    let budget = BUDGET + if cuda { device.memory().allocated } else { 0 };
    Stagehand::builder()
        .budget_bytes(budget)
        .device(if cuda { device.clone() } else { Device::host(budget) })
        .kernel(Kernel::Exact)
        .precision(precision)
        .build()
        .expect("handle")
}

#[test]
fn bf16_through_the_handle_equals_the_standard_recipe_in_plain_tch() {
    let device = common::device();
    let dev = device.tch_device();
    let steps = 6;
    let lr = 1e-2;
    let (want, want_vars) = reference(7, dev, steps, lr);

    let sh = handle(&device, Precision::Bf16);
    let net = {
        let _g = rng();
        tch::manual_seed(7);
        let root = sh.root();
        build(&root, Some(&sh))
    };
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let mut got = Vec::new();
    for s in 0..steps {
        let (ids, targets) = batch(100 + s, dev);
        let r = sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step");
        assert_eq!((r.loss_scale, r.optimizer_skipped), (None, false));
        got.push(r.loss);
    }
    let plan = sh.plan().expect("planned");
    assert!(plan.streams(), "blocks stream: {plan:?}");
    assert!(plan.resident_blocks.is_empty(), "trained blocks never stay resident under bf16: {plan:?}");
    assert!(plan.master_bytes > 0 && plan.reasons.iter().any(|r| r.contains("float32 master 4")), "{:?}", plan.reasons);
    // bf16 crosses PCIe: every streamed block's layout is in bf16.
    for b in sh.weights().blocks() {
        for p in &b.params {
            assert_eq!((p.kind, p.declared), (Kind::BFloat16, Kind::Float), "{}", p.name);
        }
    }
    let wm = sh.weights().last_step_metrics();
    let bf16_bytes: u64 = sh.weights().blocks().iter().map(|b| b.bytes as u64).sum();
    assert!(wm.d2h_bytes > 0 && wm.d2h_bytes <= bf16_bytes, "gradients crossed in bf16: {} of {bf16_bytes}", wm.d2h_bytes);
    opt.wait().expect("host steps");
    let mut vars: Vec<(String, Tensor)> = sh.var_store().expect("snapshot").variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(vars.len(), want_vars.len());
    if device.is_cuda() {
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-2 * b.abs(), "losses {got:?} vs {want:?}");
        }
    } else {
        assert_eq!(got, want, "losses step for step");
    }
    for ((n, t), (wn, w)) in vars.iter().zip(&want_vars) {
        assert_eq!(n, wn);
        assert_eq!(t.kind(), Kind::Float, "{n}: the snapshot holds the float32 master");
        let t = t.to_device(tch::Device::Cpu);
        if device.is_cuda() {
            assert!(t.allclose(w, 1e-2, 1e-3, false), "{n} differs");
        } else {
            assert!(t.equal(w), "{n}: masters differ");
        }
    }
}

#[test]
fn a_bf16_model_trains_through_float32_masters() {
    // A model stored in bf16 (layer mode's storage dtype). AdamW moves every weight by about lr
    // a step: 1e-4 is under half a bf16 step at 1.0 (2^-8), so weights updated in bf16 would
    // never move, while float32 masters gather the updates until their bf16 copy moves.
    let device = common::device();
    let dev = device.tch_device();
    let budget = (64 << 10) + if device.is_cuda() { device.memory().allocated } else { 0 };
    let vs = snn::ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        snn::LayerOptions {
            vram_budget: Some(budget),
            device: Some(if device.is_cuda() { device.clone() } else { Device::host(budget) }),
            dtype: Some(Kind::BFloat16),
            ..snn::LayerOptions::default()
        },
    )
    .expect("store");
    let (first, lin) = {
        let _g = rng();
        let no_bias = || nn::LinearConfig { bias: false, ..Default::default() };
        (snn::linear(vs.root() / "blocks" / 0 / "fc", D, D, no_bias()), snn::linear(vs.root() / "blocks" / 1 / "fc", D, D, no_bias()))
    };
    let mut opt = vs.optimizer(nn::AdamW { wd: 0.0, ..Default::default() }, 1e-4).expect("optimizer");
    let x = Tensor::ones([4, D], (Kind::BFloat16, dev));
    let start = {
        let w = lin.variables().expect("values");
        w[0].1.to_kind(Kind::Float)
    };
    for _ in 0..40 {
        let loss = lin.forward(&first.forward(&x)).to_kind(Kind::Float).sum(Kind::Float);
        opt.backward_step(&loss).expect("step");
    }
    opt.wait().expect("host steps");
    let spec = &vs.runtime().blocks()[1].params[0];
    assert_eq!((spec.kind, spec.declared), (Kind::BFloat16, Kind::BFloat16));
    assert!(spec.has_master(), "a trained bf16 parameter has a float32 master");
    let w = &lin.variables().expect("values")[0].1;
    assert_eq!(w.kind(), Kind::BFloat16, "values keep the model's dtype");
    let moved = (w.to_kind(Kind::Float) - &start).abs().max().double_value(&[]);
    assert!(moved > 0.003, "40 updates of 1e-4 reached the bf16 copy through the master (moved {moved})");
}

#[test]
fn fp16_skips_an_overflowing_step_lowers_the_scale_and_trains_on() {
    let device = common::device();
    let dev = device.tch_device();
    let sh = handle(&device, Precision::Fp16);
    let net = {
        let _g = rng();
        tch::manual_seed(11);
        let root = sh.root();
        build(&root, Some(&sh))
    };
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
    let mut reports = Vec::new();
    let mut before_overflow = None;
    for s in 0..12 {
        let (ids, targets) = batch(200 + (s % 3), dev);
        if s == 5 {
            opt.wait().expect("host steps");
            before_overflow = Some(sh.var_store().expect("snapshot").variables());
        }
        // Step 5's loss overflows fp16 once scaled: its gradients are infinite.
        let blow = if s == 5 { 1e30 } else { 1.0 };
        let r = sh.train_step(&mut opt, || net.loss(&ids, &targets) * blow).expect("step");
        if s == 5 {
            opt.wait().expect("host steps");
            let after = sh.var_store().expect("snapshot").variables();
            for (n, t) in before_overflow.take().expect("taken") {
                assert!(t.equal(&after[&n]), "{n} changed in the skipped step");
            }
        }
        reports.push(r);
    }
    let scales: Vec<f64> = reports.iter().map(|r| r.loss_scale.expect("fp16 reports its scale")).collect();
    assert_eq!(scales[0], stagehand::precision::DEFAULT_INITIAL_SCALE);
    assert!(reports[5].optimizer_skipped && reports.iter().filter(|r| r.optimizer_skipped).count() == 1, "{reports:?}");
    assert_eq!(scales[6], scales[5] / 2.0, "the scale halves after the overflow");
    let early: f64 = reports[..3].iter().map(|r| r.loss).sum();
    let late: f64 = reports[9..].iter().map(|r| r.loss).sum();
    assert!(late < early, "training went on after the skipped step: {reports:?}");
    for b in sh.weights().blocks() {
        assert!(b.params.iter().all(|p| p.kind == Kind::Half), "fp16 streams fp16");
    }
}

#[test]
fn int8_and_bf16_optimizer_state_train_as_float32_state_does() {
    let device = common::device();
    let dev = device.tch_device();
    let mut finals = Vec::new();
    for storage in [StateStorage::Fp32, StateStorage::Bf16, StateStorage::Int8] {
        let cuda = device.is_cuda();
        let budget = BUDGET + if cuda { device.memory().allocated } else { 0 };
        let sh = Stagehand::builder()
            .budget_bytes(budget)
            .device(if cuda { device.clone() } else { Device::host(budget) })
            .precision(Precision::Bf16)
            .optimizer_state(storage)
            .build()
            .expect("handle");
        let net = {
            let _g = rng();
            tch::manual_seed(5);
            let root = sh.root();
            build(&root, Some(&sh))
        };
        let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3).expect("optimizer");
        assert_eq!(opt.state_storage(), storage);
        let mut losses = Vec::new();
        for s in 0..30 {
            let (ids, targets) = batch(300 + (s % 4), dev);
            losses.push(sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step").loss);
        }
        let plan = sh.plan().expect("plan");
        assert!(plan.reasons.iter().any(|r| r.contains(&format!("in {storage}"))), "{:?}", plan.reasons);
        finals.push(losses[26..].iter().sum::<f64>() / 4.0);
        if storage == StateStorage::Fp32 {
            assert!(finals[0] < 0.8 * losses[0], "it trains: {losses:?}");
        }
    }
    for (i, f) in finals.iter().enumerate().skip(1) {
        assert!((f / finals[0] - 1.0).abs() < 0.05, "state storage {i}: final loss {f} against float32 state's {}", finals[0]);
    }
}

#[test]
fn compressed_state_needs_the_fused_adam_kernel() {
    let device = common::device();
    let budget = BUDGET + if device.is_cuda() { device.memory().allocated } else { 0 };
    let sh = Stagehand::builder()
        .budget_bytes(budget)
        .device(if device.is_cuda() { device.clone() } else { Device::host(budget) })
        .optimizer_state(StateStorage::Int8)
        .kernel(Kernel::Exact)
        .build()
        .expect("handle");
    let e = sh.optimizer(nn::AdamW::default(), 1e-3).expect_err("the exact kernel keeps float32 state");
    assert!(e.to_string().contains("optimizer_state = int8"), "{e}");
    let sh = Stagehand::builder()
        .budget_bytes(budget)
        .device(if device.is_cuda() { device.clone() } else { Device::host(budget) })
        .optimizer_state(StateStorage::Int8)
        .build()
        .expect("handle");
    let e = sh.optimizer(nn::Sgd::default(), 1e-3).expect_err("SGD has no compressed state");
    assert!(e.to_string().contains("SGD"), "{e}");
}
