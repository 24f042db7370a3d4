//! Tied weights through the handle: a GPT whose output head reuses the token embedding's weight
//! (the usual weight tying) trains bit-identically to the plain tch program with every tch
//! optimizer, without clipping and with both clip kinds, with the host optimizer's steps
//! overlapping backward and without, while blocks stream.
//!
//! The tied weight gets its gradient from two places that backward reaches at different times:
//! the head (first) and the embedding (last). Autograd accumulates both before the weight's
//! gradient exists, so the block's host step must wait for it; a step queued as backward left
//! the head's use ran with no gradient, and the embedding never trained.

use stagehand::nn as snn;
use stagehand::optim::{Algorithm, GradClip};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{Tied, assert_all_changed, assert_losses, assert_same, cpu, handle, values};
use common::rng;

const V: i64 = 24;
const D: i64 = 16;
const T: i64 = 8;
const LAYERS: i64 = 3;
const BATCH: i64 = 4;
const STEPS: i64 = 4;
/// Small enough that blocks stream (checked below).
const BUDGET: u64 = 96 << 10;

/// How gradients are clipped before the step.
#[derive(Debug, Clone, Copy)]
enum Clip {
    None,
    Value(f64),
    Norm(f64),
}

struct Block {
    ln: Box<dyn Module>,
    fc: Box<dyn Module>,
    out: Box<dyn Module>,
}

struct Gpt {
    tok: Box<dyn Tied>,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
}

impl Gpt {
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let mut x = self.tok.embed(ids) + &self.pos;
        for b in &self.blocks {
            x = &x + b.out.forward(&b.fc.forward(&b.ln.forward(&x)).gelu("none"));
        }
        let logits = self.tok.logits(&self.ln_f.forward(&x));
        logits.view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
    }
}

macro_rules! gpt {
    ($p:expr, $lib:ident) => {{
        let p = $p;
        let tok = $lib::embedding(&p / "tok", V, D, Default::default());
        let pos = p.randn("pos", &[1, T, D], 0.0, 0.02);
        let blocks = (0..LAYERS)
            .map(|i| {
                let b = &p / "blocks" / i;
                Block {
                    ln: Box::new($lib::layer_norm(&b / "ln", vec![D], Default::default())),
                    fc: Box::new($lib::linear(&b / "fc", D, 4 * D, Default::default())),
                    out: Box::new($lib::linear(&b / "out", 4 * D, D, Default::default())),
                }
            })
            .collect();
        let ln_f = nn::layer_norm(&p / "ln_f", vec![D], Default::default());
        Gpt { tok: Box::new(tok), pos, blocks, ln_f }
    }};
}

fn batch(step: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(500 + step);
    let ids = Tensor::randint(V, [BATCH, T], (Kind::Int64, tch::Device::Cpu));
    (ids.to_device(dev), ids.roll([-1], [1]).to_device(dev))
}

fn tch_optimizer(a: Algorithm, vs: &nn::VarStore, lr: f64) -> nn::Optimizer {
    match a {
        Algorithm::Sgd { momentum, dampening, wd, nesterov } => nn::Sgd { momentum, dampening, wd, nesterov }.build(vs, lr),
        Algorithm::Adam { beta1, beta2, wd, eps, amsgrad } => nn::Adam { beta1, beta2, wd, eps, amsgrad }.build(vs, lr),
        Algorithm::AdamW { beta1, beta2, wd, eps, amsgrad } => nn::AdamW { beta1, beta2, wd, eps, amsgrad }.build(vs, lr),
        Algorithm::RmsProp { alpha, eps, wd, momentum, centered } => nn::RmsProp { alpha, eps, wd, momentum, centered }.build(vs, lr),
    }
    .expect("tch optimizer")
}

/// tch's six optimizers (SGD plain and with momentum, Adam, Adam with amsgrad, AdamW, RMSprop).
fn algorithms() -> [Algorithm; 6] {
    [
        nn::Sgd::default().into(),
        nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-3, nesterov: true }.into(),
        nn::Adam::default().into(),
        nn::Adam { amsgrad: true, wd: 1e-2, ..Default::default() }.into(),
        nn::AdamW::default().into(),
        nn::RmsProp { momentum: 0.5, centered: true, ..Default::default() }.into(),
    ]
}

#[test]
fn a_tied_head_trains_like_tch_with_every_optimizer_clip_and_overlap() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    for algorithm in algorithms() {
        for clip in [Clip::None, Clip::Value(0.05), Clip::Norm(0.5)] {
            for overlap in [true, false] {
                let what = format!("{algorithm:?} {clip:?} overlap {overlap}");
                let lr = if matches!(algorithm, Algorithm::Sgd { .. }) { 0.5 } else { 1e-2 };
                let (vs, plain) = common::seeded_on_cpu(11, dev, |vs| gpt!(vs.root(), nn));
                let initial = values(&vs);
                let mut popt = tch_optimizer(algorithm, &vs, lr);
                let want: Vec<f64> = (0..STEPS)
                    .map(|s| {
                        let (x, y) = batch(s, dev);
                        let loss = plain.loss(&x, &y);
                        match clip {
                            Clip::None => popt.backward_step(&loss),
                            Clip::Value(m) => popt.backward_step_clip(&loss, m),
                            Clip::Norm(m) => popt.backward_step_clip_norm(&loss, m),
                        }
                        loss.double_value(&[])
                    })
                    .collect();

                let sh = handle(&device, BUDGET);
                let model = {
                    let _g = rng();
                    tch::manual_seed(11);
                    gpt!(sh.root(), snn)
                };
                let mut opt = sh.optimizer(algorithm, lr).expect("optimizer");
                opt.set_grad_clip(match clip {
                    Clip::None => None,
                    Clip::Value(m) => Some(GradClip::Value(m)),
                    Clip::Norm(m) => Some(GradClip::Norm(m)),
                });
                opt.set_overlap_backward(overlap);
                let got: Vec<f64> = (0..STEPS)
                    .map(|s| {
                        let (x, y) = batch(s, dev);
                        sh.train_step(&mut opt, || model.loss(&x, &y)).expect("step").loss
                    })
                    .collect();
                assert!(sh.plan().expect("plan").streams(), "{what}: blocks stream");
                let m = sh.weights().last_step_metrics();
                assert!(m.evictions > 0 && m.d2h_bytes > 0, "{what}: blocks streamed and trained on the host: {m:?}");
                assert_losses(&got, &want, cuda);
                opt.wait().expect("host steps");
                let trained = cpu(sh.var_store().expect("snapshot").variables());
                assert_same(&trained, &values(&vs), cuda, &what);
                assert_all_changed(&trained, &initial, &[]);
            }
        }
    }
}

/// A linear scaled by a variable it does not own: the scale is made outside the layer's
/// constructor (unmanaged, on the device) and shared by every block and the loss.
#[derive(Debug)]
struct Scaled {
    lin: nn::Linear,
    scale: Tensor,
}

impl Module for Scaled {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.lin.forward(xs) * &self.scale
    }
}

/// Blocks of `x + scaled(x)`; the scale also multiplies the loss.
struct Shared {
    scale: Tensor,
    blocks: Vec<Box<dyn Module>>,
}

impl Shared {
    fn loss(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for b in &self.blocks {
            h = &h + b.forward(&h).tanh();
        }
        (h.square().mean(Kind::Float) * self.scale.sum(Kind::Float)).sqrt()
    }
}

#[test]
fn a_variable_shared_by_blocks_and_an_unmanaged_use_trains_like_tch() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let build_plain = |vs: &nn::VarStore| {
        let scale = vs.root().ones("scale", &[D]);
        let blocks = (0..LAYERS)
            .map(|i| {
                let lin = nn::linear(vs.root() / "blocks" / i / "fc", D, D, Default::default());
                Box::new(Scaled { lin, scale: scale.shallow_clone() }) as Box<dyn Module>
            })
            .collect();
        Shared { scale, blocks }
    };
    let (vs, plain) = common::seeded_on_cpu(19, dev, build_plain);
    let x = |s: i64| {
        let _g = rng();
        tch::manual_seed(900 + s);
        Tensor::randn([BATCH, D], (Kind::Float, tch::Device::Cpu)).to_device(dev)
    };
    // The plain program first: on CUDA the handle's budget is counted from what the device
    // holds when it is made, and the plain program's gradients and optimizer state would come
    // after that reading.
    let mut popt = nn::Adam::default().build(&vs, 1e-2).expect("adam");
    let want: Vec<f64> = (0..STEPS)
        .map(|s| {
            let loss = plain.loss(&x(s));
            popt.backward_step(&loss);
            loss.double_value(&[])
        })
        .collect();
    let sh = handle(&device, 24 << 10);
    let model = {
        let _g = rng();
        tch::manual_seed(19);
        let root = sh.root();
        let scale = root.ones("scale", &[D]);
        let blocks = (0..LAYERS)
            .map(|i| {
                let p = &root / "blocks" / i / "fc";
                let layer = p
                    .manage(|p| Scaled { lin: nn::linear(p, D, D, Default::default()), scale: scale.shallow_clone() })
                    .expect("managed");
                Box::new(layer) as Box<dyn Module>
            })
            .collect();
        Shared { scale, blocks }
    };
    let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    let got: Vec<f64> = (0..STEPS)
        .map(|s| {
            let x = x(s);
            sh.train_step(&mut opt, || model.loss(&x)).expect("step").loss
        })
        .collect();
    assert!(sh.plan().expect("plan").streams(), "blocks stream");
    assert_losses(&got, &want, cuda);
    opt.wait().expect("host steps");
    let trained = cpu(sh.var_store().expect("snapshot").variables());
    assert_same(&trained, &values(&vs), cuda, "shared scale");
    assert!(!trained["scale"].equal(&Tensor::ones([D], (Kind::Float, tch::Device::Cpu))), "the shared scale trained");
}

#[test]
fn a_weight_read_again_in_backward_after_its_gradient_is_complete_keeps_its_value_there() {
    // Block `a` is used twice: first through a detached copy of its weight (read by backward
    // late, contributing no gradient), then as a layer (whose backward completes the weight's
    // gradient early). Its host step must not run before that late read.
    const W: i64 = 64;
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    type Use<'a> = &'a dyn Fn(&Tensor, bool) -> Tensor;
    fn loss(a: Use<'_>, b: &dyn Module, c: &dyn Module, x: &Tensor) -> Tensor {
        let h = b.forward(x).tanh();
        let u = a(&h, true).tanh();
        let v = c.forward(&u).tanh();
        a(&v, false).square().mean(Kind::Float)
    }
    let layers = |r: &nn::Path<'_>| {
        (
            nn::linear(r / "a", W, W, Default::default()),
            nn::linear(r / "b", W, W, Default::default()),
            nn::linear(r / "c", W, W, Default::default()),
        )
    };
    let (vs, (pa, pb, pc)) = common::seeded_on_cpu(29, dev, |vs| layers(&vs.root()));
    let plain_a = |x: &Tensor, detached: bool| if detached { x.matmul(&pa.ws.detach().tr()) } else { pa.forward(x) };
    let x = |s: i64| {
        let _g = rng();
        tch::manual_seed(40 + s);
        Tensor::randn([BATCH, W], (Kind::Float, tch::Device::Cpu)).to_device(dev)
    };
    // The plain program first, its gradients made before the handle reads the device (CUDA).
    let mut popt = nn::Sgd::default().build(&vs, 0.5).expect("sgd");
    let want: Vec<f64> = (0..STEPS)
        .map(|s| {
            let l = loss(&plain_a, &pb, &pc, &x(s));
            popt.backward_step(&l);
            l.double_value(&[])
        })
        .collect();
    // Three blocks of 16 KiB: at this budget none stays resident.
    let sh = handle(&device, 144 << 10);
    let (sa, sb, sc) = {
        let _g = rng();
        tch::manual_seed(29);
        let r = sh.root();
        (
            snn::linear(&r / "a", W, W, Default::default()),
            snn::linear(&r / "b", W, W, Default::default()),
            snn::linear(&r / "c", W, W, Default::default()),
        )
    };
    let managed_a = |x: &Tensor, detached: bool| {
        if detached {
            sa.run(|l| x.matmul(&l.ws.detach().tr())).expect("run")
        } else {
            sa.forward(x)
        }
    };
    let mut opt = sh.optimizer(nn::Sgd::default(), 0.5).expect("sgd");
    let got: Vec<f64> = (0..STEPS)
        .map(|s| {
            let x = x(s);
            sh.train_step(&mut opt, || loss(&managed_a, &sb, &sc, &x)).expect("step").loss
        })
        .collect();
    assert!(sh.plan().expect("plan").streams(), "blocks stream");
    assert_losses(&got, &want, cuda);
    opt.wait().expect("host steps");
    assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &values(&vs), cuda, "detached use");
}
