//! Budgets from the stated minimum up: tch's mnist_conv net (two convolutions, a 4 MiB linear,
//! a small head, dropout) ported to the handle trains bit-identically to the plain program at
//! every budget from the smallest one the budget error states to past the size where nothing
//! streams, with a test pass after every epoch.

use stagehand::nn as snn;
use stagehand::{Error, Stagehand};
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_losses, assert_same, cpu, handle, handle_at, values};
use common::rng;

const BATCH: i64 = 16;
const BATCHES: i64 = 2;
const EPOCHS: i64 = 2;
const TEST: i64 = 48;
const LR: f64 = 1e-3;

#[derive(Debug)]
struct Net {
    conv1: Box<dyn Module>,
    conv2: Box<dyn Module>,
    fc1: Box<dyn Module>,
    fc2: Box<dyn Module>,
}

impl ModuleT for Net {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let h = self.conv1.forward(&xs.view([-1, 1, 28, 28])).max_pool2d_default(2);
        let h = self.conv2.forward(&h).max_pool2d_default(2).view([-1, 1024]);
        self.fc2.forward(&self.fc1.forward(&h).relu().dropout(0.5, train))
    }
}

/// tch's `Net::new(&vs.root())`, on a plain path or a Stagehand one: the layers on the root.
macro_rules! net {
    ($vs:expr, $lib:ident) => {{
        let vs = $vs;
        Net {
            conv1: Box::new($lib::conv2d(vs, 1, 32, 5, Default::default())),
            conv2: Box::new($lib::conv2d(vs, 32, 64, 5, Default::default())),
            fc1: Box::new($lib::linear(vs, 1024, 1024, Default::default())),
            fc2: Box::new($lib::linear(vs, 1024, 10, Default::default())),
        }
    }};
}

struct Data {
    train: Vec<(Tensor, Tensor)>,
    test: (Tensor, Tensor),
}

fn data(dev: tch::Device) -> Data {
    let _g = rng();
    tch::manual_seed(4242);
    let images = |n: i64| Tensor::rand([n, 1, 28, 28], (Kind::Float, tch::Device::Cpu)).to_device(dev);
    let labels = |n: i64| Tensor::randint(10, [n], (Kind::Int64, tch::Device::Cpu)).to_device(dev);
    Data {
        train: (0..BATCHES).map(|_| (images(BATCH), labels(BATCH))).collect(),
        test: (images(TEST), labels(TEST)),
    }
}

/// Losses and each epoch's test accuracy, training with `step` (which gets the batch and the
/// forward's seed, for the dropout mask).
fn train(net: &impl ModuleT, d: &Data, dev: tch::Device, mut step: impl FnMut(i64, &Tensor, &Tensor) -> f64) -> (Vec<f64>, Vec<f64>) {
    let (mut losses, mut accuracies) = (Vec::new(), Vec::new());
    for epoch in 0..EPOCHS {
        for (i, (x, y)) in d.train.iter().enumerate() {
            losses.push(step(epoch * BATCHES + i as i64, x, y));
        }
        accuracies.push(net.batch_accuracy_for_logits(&d.test.0, &d.test.1, dev, 20));
    }
    (losses, accuracies)
}

fn seeded<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    let _g = rng();
    tch::manual_seed(seed);
    f()
}

/// A small conv net with batch norm (running statistics updated by the training forwards and
/// read by the test pass), dropout and a head: blocks of conv + batch norm.
#[derive(Debug)]
struct BnNet {
    blocks: Vec<(Box<dyn Module>, Box<dyn ModuleT>)>,
    head: Box<dyn Module>,
}

impl ModuleT for BnNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut h = xs.view([-1, 1, 28, 28]);
        for (conv, bn) in &self.blocks {
            h = bn.forward_t(&conv.forward(&h), train).relu().max_pool2d_default(2);
        }
        self.head.forward(&h.flatten(1, -1).dropout(0.25, train))
    }
}

macro_rules! bn_net {
    ($r:expr, $lib:ident) => {{
        let r = $r;
        // No bias before batch norm: the norm removes it, so its gradient is zero in exact
        // arithmetic and AdamW steps it by rounding noise, which differs between two runs' kernels on
        // CUDA (77% of a conv bias's elements apart after a few steps).
        let same = nn::ConvConfig { padding: 1, bias: false, ..Default::default() };
        BnNet {
            blocks: (0..3)
                .map(|i| {
                    let b = &r / "blocks" / i;
                    let cin = if i == 0 { 1 } else { 16 * i };
                    (
                        Box::new($lib::conv2d(&b / "conv", cin, 16 * (i + 1), 3, same)) as Box<dyn Module>,
                        Box::new($lib::batch_norm2d(&b / "bn", 16 * (i + 1), Default::default())) as Box<dyn ModuleT>,
                    )
                })
                .collect(),
            head: Box::new($lib::linear(&r / "head", 48 * 3 * 3, 10, Default::default())),
        }
    }};
}

/// Trains the plain program once and the port at every budget from the minimum the budget
/// error states to past the size where nothing streams: losses, test accuracies and every
/// variable (running statistics included) bit-identical on the host device.
fn every_budget<N: ModuleT>(plain: impl Fn(&nn::VarStore) -> N, port: impl Fn(&Stagehand) -> N) {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let d = data(dev);

    let (vs, net) = common::seeded_on_cpu(1, dev, &plain);
    let mut popt = nn::Adam::default().build(&vs, LR).expect("adam");
    let (want, want_acc) = train(&net, &d, dev, |s, x, y| {
        seeded(100 + s, || {
            let loss = net.forward_t(x, true).cross_entropy_for_logits(y);
            popt.backward_step(&loss);
            loss.double_value(&[])
        })
    });
    let trained = values(&vs);

    // The budget error states the smallest budget; the guide says where streaming stops. On
    // CUDA both count what the device holds, this handle's model included (a placeholder of one
    // element for each managed variable): it goes before the next handle is made, whose model
    // takes its place.
    let (minimum, guide) = {
        let tiny = handle(&device, 16 << 10);
        let _net = seeded(1, || port(&tiny));
        let _opt = tiny.optimizer(nn::Adam::default(), LR).expect("adam");
        let minimum = match tiny.prepare() {
            Err(Error::BudgetTooSmall { minimum_bytes, .. }) => minimum_bytes,
            other => panic!("16 KiB is too small: {other:?}"),
        };
        let e = tiny.prepare().expect_err("still too small").to_string();
        assert!(e.contains(&format!("budget_bytes({minimum})")), "the error states it: {e}");
        (minimum, tiny.budget_guide().expect("guide"))
    };
    assert_eq!(guide.minimum_bytes, minimum);
    assert!(guide.minimum_bytes <= guide.full_window_bytes && guide.full_window_bytes <= guide.resident_bytes, "{guide:?}");

    let mut budgets: Vec<u64> = vec![minimum, minimum + 4096];
    let span = guide.resident_bytes + (1 << 20) - minimum;
    budgets.extend((1..=10).map(|k| minimum + span * k / 10));
    budgets.extend([guide.full_window_bytes, guide.resident_bytes - 1, guide.resident_bytes]);
    budgets.sort_unstable();
    budgets.dedup();
    for budget in budgets {
        // The guide's sizes count what the device holds already (on CUDA).
        let sh = handle_at(&device, budget);

        let net = seeded(1, || port(&sh));
        let mut opt = sh.optimizer(nn::Adam::default(), LR).expect("adam");
        let (got, got_acc) = train(&net, &d, dev, |s, x, y| {
            seeded(100 + s, || {
                sh.train_step(&mut opt, || net.forward_t(x, true).cross_entropy_for_logits(y))
                    .unwrap_or_else(|e| panic!("budget {budget}: {e}"))
                    .loss
            })
        });
        let plan = sh.plan().expect("plan");
        assert_eq!(plan.streams(), budget < guide.resident_bytes, "budget {budget}: {plan:?}");
        assert_losses(&got, &want, cuda);
        assert_eq!(got_acc, want_acc, "budget {budget}: test accuracy");
        opt.wait().expect("host steps");
        assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &trained, cuda, &format!("budget {budget}"));
        if plan.streams() {
            // The runtime holds what the plan gave it: the resident blocks and the plan's slots.
            assert_eq!(sh.weights().device_bytes(), plan.weights_budget_bytes(), "budget {budget}: {plan:?}");
        }
    }
}

#[test]
fn mnist_conv_trains_like_tch_at_every_budget_from_the_stated_minimum_up() {
    every_budget(|vs| net!(&vs.root(), nn), |sh| net!(&sh.root(), snn));
}

#[test]
fn a_batch_norm_conv_net_trains_like_tch_at_every_budget_from_the_stated_minimum_up() {
    every_budget(|vs| bn_net!(vs.root(), nn), |sh| bn_net!(sh.root(), snn));
}

#[test]
fn a_budget_error_is_typed_and_a_handle_too_small_for_its_model_never_panics() {
    let device = common::device();
    for budget in [1u64, 4 << 10, 512 << 10] {
        let sh: Stagehand = handle(&device, budget);
        let net = seeded(1, || net!(&sh.root(), snn));
        let mut opt = sh.optimizer(nn::Adam::default(), LR).expect("adam");
        let x = Tensor::zeros([2, 1, 28, 28], (Kind::Float, device.tch_device()));
        let y = Tensor::zeros([2], (Kind::Int64, device.tch_device()));
        let e = sh
            .train_step(&mut opt, || net.forward_t(&x, true).cross_entropy_for_logits(&y))
            .expect_err("too small");
        assert!(matches!(e, Error::BudgetTooSmall { .. }), "{e}");
    }
}
