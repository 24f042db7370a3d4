//! A tch conv net with batch norm ported to Stagehand: conv2d + batch_norm2d blocks, a group
//! norm, a transposed convolution and a linear head, trained with SGD (momentum, nesterov)
//! through the handle. On the host device the losses, every parameter and the batch norms'
//! running statistics are bit-identical with the plain program over many steps, and checkpoints
//! (running statistics included) round-trip both ways. Every other drop-in (1-d and 3-d
//! convolutions and transposed convolutions, batch norms, layer norm) matches its tch layer.

use stagehand::nn::{self as snn, LayerOptions, ManagedVarStore};
use stagehand::Stagehand;
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_all_changed, assert_losses, assert_same, cpu, handle, values};
use common::rng;

const BLOCKS: i64 = 3;
const C: i64 = 8;
const CLASSES: i64 = 5;
const STEPS: i64 = 10;
const BUDGET: u64 = 64 << 10;

struct ConvNet {
    blocks: Vec<(Box<dyn Module>, Box<dyn ModuleT>)>,
    gn: Box<dyn Module>,
    up: Box<dyn Module>,
    head: Box<dyn Module>,
}

impl ConvNet {
    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (conv, bn) in &self.blocks {
            h = bn.forward_t(&conv.forward(&h), true).relu();
        }
        let h = self.up.forward(&self.gn.forward(&h)).adaptive_avg_pool2d([2, 2]).flatten(1, -1);
        self.head.forward(&h).cross_entropy_for_logits(y)
    }
}

macro_rules! conv_net {
    ($r:expr, $lib:ident) => {{
        let r = $r;
        let same = nn::ConvConfig { padding: 1, ..Default::default() };
        ConvNet {
            blocks: (0..BLOCKS)
                .map(|i| {
                    let b = &r / "blocks" / i;
                    let cin = if i == 0 { 3 } else { C };
                    (
                        Box::new($lib::conv2d(&b / "conv", cin, C, 3, same)) as Box<dyn Module>,
                        Box::new($lib::batch_norm2d(&b / "bn", C, Default::default())) as Box<dyn ModuleT>,
                    )
                })
                .collect(),
            gn: Box::new($lib::group_norm(&r / "gn", 2, C, Default::default())),
            up: Box::new($lib::conv_transpose2d(&r / "up", C, 4, 2, nn::ConvTransposeConfig { stride: 2, ..Default::default() })),
            head: Box::new($lib::linear(&r / "head", 16, CLASSES, Default::default())),
        }
    }};
}

fn batch(step: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(700 + step);
    let x = Tensor::randn([8, 3, 12, 12], (Kind::Float, tch::Device::Cpu));
    let y = Tensor::randint(CLASSES, [8], (Kind::Int64, tch::Device::Cpu));
    (x.to_device(dev), y.to_device(dev))
}

fn managed(sh: &Stagehand, seed: i64) -> ConvNet {
    let _g = rng();
    tch::manual_seed(seed);
    conv_net!(sh.root(), snn)
}

#[test]
fn the_ported_conv_net_trains_like_the_tch_program_running_statistics_included() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");
    let sgd = nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-4, nesterov: true };

    let (vs, net) = common::seeded_on_cpu(31, dev, |vs| conv_net!(vs.root(), nn));
    let initial = values(&vs);
    let mut opt = sgd.build(&vs, 0.05).expect("sgd");
    let want: Vec<f64> = (0..STEPS)
        .map(|s| {
            let (x, y) = batch(s, dev);
            let loss = net.loss(&x, &y);
            opt.backward_step(&loss);
            loss.double_value(&[])
        })
        .collect();
    let trained = values(&vs);

    let sh = handle(&device, BUDGET);
    let snet = managed(&sh, 31);
    let mut sopt = sh.optimizer(sgd, 0.05).expect("optimizer");
    let got: Vec<f64> = (0..STEPS)
        .map(|s| {
            let (x, y) = batch(s, dev);
            sh.train_step(&mut sopt, || snet.loss(&x, &y)).expect("step").loss
        })
        .collect();
    assert_losses(&got, &want, cuda);
    assert!(sh.plan().expect("plan").streams(), "the budget makes blocks stream");
    let wm = sh.weights().last_step_metrics();
    assert!(wm.evictions > 0 && wm.d2h_bytes > 0, "blocks streamed and trained on the host: {wm:?}");
    let snapshot = cpu(sh.var_store().expect("snapshot").variables());
    assert_same(&snapshot, &trained, cuda, "after training");
    // Weights and running statistics all moved (num_batches_tracked is not a tch variable).
    assert_all_changed(&snapshot, &initial, &[]);

    // Checkpoints both ways, running statistics included.
    let path = dir.path().join("conv.safetensors");
    sh.save(&path).expect("save");
    let mut plain = nn::VarStore::new(tch::Device::Cpu);
    let _ = {
        let _g = rng();
        tch::manual_seed(1);
        conv_net!(plain.root(), nn)
    };
    plain.load(&path).expect("plain loads it");
    assert_same(&values(&plain), &trained, cuda, "plain tch loaded Stagehand's");
    let back = dir.path().join("plain.ot");
    vs.save(&back).expect("plain save");
    let sh2 = handle(&device, BUDGET);
    let _net2 = managed(&sh2, 2);
    sh2.load(&back).expect("load");
    assert_same(&cpu(sh2.var_store().expect("snapshot").variables()), &trained, cuda, "Stagehand loaded plain tch's");
}

/// One forward and one SGD step of a tch layer and its drop-in, in layer mode: the same output
/// and the same updated weights.
fn same_layer<P: ModuleT, M: ModuleT>(name: &str, make_plain: impl Fn(nn::Path<'_>) -> P, make: impl Fn(snn::Path<'_>) -> M, x: &Tensor) {
    let device = common::device();
    let dev = device.tch_device();
    let _g = rng();
    tch::manual_seed(5);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let p = make_plain(vs.root() / "layer");
    vs.set_device(dev);
    tch::manual_seed(5);
    let opts = LayerOptions { device: Some(device.clone()), ..LayerOptions::default() };
    let ms = ManagedVarStore::new(nn::VarStore::new(tch::Device::Cpu), opts).expect("store");
    let m = make(ms.root() / "layer");
    assert!(!ms.managed_names().is_empty(), "{name}: its weights are managed");
    let mut popt = nn::Sgd::default().build(&vs, 0.1).expect("sgd");
    let mut opt = ms.optimizer(nn::Sgd::default(), 0.1).expect("optimizer");
    let x = x.to_device(dev);
    let (a, b) = (p.forward_t(&x, true), m.forward_t(&x, true));
    if dev.is_cuda() {
        assert!(a.allclose(&b, 1e-5, 1e-5, false), "{name}: outputs differ");
    } else {
        assert!(a.equal(&b), "{name}: outputs differ");
    }
    popt.backward_step(&a.square().mean(Kind::Float));
    opt.backward_step(&b.square().mean(Kind::Float)).expect("step");
    assert_same(&cpu(ms.var_store().expect("snapshot").variables()), &values(&vs), dev.is_cuda(), name);
}

#[test]
fn every_drop_in_matches_its_tch_layer() {
    let r = |shape: &[i64]| {
        let _g = rng();
        tch::manual_seed(9);
        Tensor::randn(shape, (Kind::Float, tch::Device::Cpu))
    };
    let x1 = r(&[2, 3, 9]);
    let x3 = r(&[2, 3, 4, 5, 5]);
    let cfg = Default::default;
    let tcfg = Default::default;
    same_layer("conv1d", |p| nn::conv1d(p, 3, 4, 3, cfg()), |p| snn::conv1d(p, 3, 4, 3, cfg()), &x1);
    same_layer("conv3d", |p| nn::conv3d(p, 3, 4, 2, cfg()), |p| snn::conv3d(p, 3, 4, 2, cfg()), &x3);
    same_layer("conv_transpose1d", |p| nn::conv_transpose1d(p, 3, 4, 3, tcfg()), |p| snn::conv_transpose1d(p, 3, 4, 3, tcfg()), &x1);
    same_layer("conv_transpose3d", |p| nn::conv_transpose3d(p, 3, 2, 2, tcfg()), |p| snn::conv_transpose3d(p, 3, 2, 2, tcfg()), &x3);
    same_layer("batch_norm1d", |p| nn::batch_norm1d(p, 3, Default::default()), |p| snn::batch_norm1d(p, 3, Default::default()), &x1);
    same_layer("batch_norm3d", |p| nn::batch_norm3d(p, 3, Default::default()), |p| snn::batch_norm3d(p, 3, Default::default()), &x3);
    same_layer("layer_norm", |p| nn::layer_norm(p, vec![9], Default::default()), |p| snn::layer_norm(p, vec![9], Default::default()), &x1);
    same_layer("group_norm", |p| nn::group_norm(p, 3, 3, Default::default()), |p| snn::group_norm(p, 3, 3, Default::default()), &x1);
}
