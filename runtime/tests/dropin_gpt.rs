//! A tch GPT program ported to Stagehand the way a user would: minGPT's shape, with a custom
//! linear built from `p.randn`/`p.zeros` in two weight-decay groups, layer norms (drop-in ones
//! in the blocks, tch's own on a Stagehand path for the final one), position embeddings as a
//! bare variable, a head tied to the token embedding, AdamW with decay groups, a learning-rate
//! change and gradient-norm clipping. The port changes the imports, the store, the custom
//! layer's wrapper (`p.manage`) and the loop's step call.
//!
//! On the host device: losses bit-identical with the plain program over many steps while blocks
//! stream and activations spill, every parameter trained, and checkpoints round-tripping between
//! plain tch and Stagehand both ways (`.ot` and `.safetensors`). On CUDA the same within float
//! tolerance.

use stagehand::nn as snn;
use stagehand::optim::GradClip;
use stagehand::Stagehand;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{Tied, assert_all_changed, assert_losses, assert_same, cpu, handle, values};
use common::rng;

const V: i64 = 64;
const D: i64 = 32;
const HEADS: i64 = 4;
const T: i64 = 16;
const LAYERS: i64 = 6;
const BATCH: i64 = 8;
const STEPS: i64 = 10;
const LR: f64 = 3e-3;
const NO_WEIGHT_DECAY: usize = 0;
const WEIGHT_DECAY: usize = 1;
const BUDGET: u64 = 640 << 10;

/// minGPT's custom linear: weights decay, biases do not.
fn linear(p: nn::Path<'_>, in_dim: i64, out_dim: i64) -> nn::Linear {
    let wd = p.set_group(WEIGHT_DECAY);
    let no_wd = p.set_group(NO_WEIGHT_DECAY);
    nn::Linear {
        ws: wd.randn("weight", &[out_dim, in_dim], 0.0, 0.02),
        bs: Some(no_wd.zeros("bias", &[out_dim])),
    }
}

/// The port of `linear`: the same constructor, its variables one managed block.
fn managed_linear(p: &snn::Path<'_>, in_dim: i64, out_dim: i64) -> snn::Managed<nn::Linear> {
    p.manage(|p| linear(p.clone(), in_dim, out_dim)).expect("a custom layer is managed")
}

struct Block {
    ln1: Box<dyn Module>,
    qkv: Box<dyn Module>,
    proj: Box<dyn Module>,
    ln2: Box<dyn Module>,
    fc: Box<dyn Module>,
    out: Box<dyn Module>,
}

impl Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().expect("[batch, time, channels]");
        let heads = |y: Tensor| y.view([b, t, HEADS, c / HEADS]).transpose(1, 2);
        let qkv = self.qkv.forward(&self.ln1.forward(x)).split(c, 2);
        let (q, k, v) = (heads(qkv[0].shallow_clone()), heads(qkv[1].shallow_clone()), heads(qkv[2].shallow_clone()));
        let mask = Tensor::ones([t, t], (Kind::Float, x.device())).tril(0).view([1, 1, t, t]);
        let att = (q.matmul(&k.transpose(-2, -1)) * (1.0 / ((c / HEADS) as f64).sqrt()))
            .masked_fill(&mask.eq(0.), f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        let x = x + self.proj.forward(&y);
        &x + self.out.forward(&self.fc.forward(&self.ln2.forward(&x)).gelu("none"))
    }
}

struct Gpt {
    tok: Box<dyn Tied>,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
}

impl Gpt {
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let mut x = self.tok.embed(ids) + self.pos.narrow(1, 0, t);
        for b in &self.blocks {
            x = b.forward(&x);
        }
        let logits = self.tok.logits(&self.ln_f.forward(&x));
        logits.view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
    }
}

/// The plain tch program's model.
fn plain_gpt(vs: &nn::VarStore) -> Gpt {
    let p = vs.root().set_group(NO_WEIGHT_DECAY);
    let tok = nn::embedding(&p / "tok", V, D, Default::default());
    let pos = p.randn("pos", &[1, T, D], 0.0, 0.02);
    let blocks = (0..LAYERS)
        .map(|i| {
            let b = &p / "blocks" / i;
            Block {
                ln1: Box::new(nn::layer_norm(&b / "ln1", vec![D], Default::default())),
                qkv: Box::new(linear(&b / "attn" / "qkv", D, 3 * D)),
                proj: Box::new(linear(&b / "attn" / "proj", D, D)),
                ln2: Box::new(nn::layer_norm(&b / "ln2", vec![D], Default::default())),
                fc: Box::new(linear(&b / "mlp" / "fc", D, 4 * D)),
                out: Box::new(linear(&b / "mlp" / "out", 4 * D, D)),
            }
        })
        .collect();
    let ln_f = nn::layer_norm(&p / "ln_f", vec![D], Default::default());
    Gpt { tok: Box::new(tok), pos, blocks, ln_f }
}

/// The same model under Stagehand: drop-in layers, the custom linear managed, the final layer
/// norm tch's own on a Stagehand path.
fn stagehand_gpt(sh: &Stagehand) -> Gpt {
    let root = sh.root();
    let p = root.set_group(NO_WEIGHT_DECAY);
    let tok = snn::embedding(&p / "tok", V, D, Default::default());
    let pos = p.randn("pos", &[1, T, D], 0.0, 0.02);
    let blocks = (0..LAYERS)
        .map(|i| {
            let b = &p / "blocks" / i;
            Block {
                ln1: Box::new(snn::layer_norm(&b / "ln1", vec![D], Default::default())),
                qkv: Box::new(managed_linear(&(&b / "attn" / "qkv"), D, 3 * D)),
                proj: Box::new(managed_linear(&(&b / "attn" / "proj"), D, D)),
                ln2: Box::new(snn::layer_norm(&b / "ln2", vec![D], Default::default())),
                fc: Box::new(managed_linear(&(&b / "mlp" / "fc"), D, 4 * D)),
                out: Box::new(managed_linear(&(&b / "mlp" / "out"), 4 * D, D)),
            }
        })
        .collect();
    let ln_f = nn::layer_norm(&p / "ln_f", vec![D], Default::default());
    Gpt { tok: Box::new(tok), pos, blocks, ln_f }
}

fn batch(step: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(1000 + step);
    let ids = Tensor::randint(V, [BATCH, T], (Kind::Int64, tch::Device::Cpu));
    let targets = ids.roll([-1], [1]);
    (ids.to_device(dev), targets.to_device(dev))
}

#[test]
fn the_ported_gpt_trains_like_the_tch_program_and_checkpoints_both_ways() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");

    // The plain tch program.
    let (vs, gpt) = common::seeded_on_cpu(7, dev, plain_gpt);
    let initial = values(&vs);
    let mut opt = nn::AdamW::default().build(&vs, LR).expect("adamw");
    opt.set_weight_decay_group(NO_WEIGHT_DECAY, 0.0);
    opt.set_weight_decay_group(WEIGHT_DECAY, 0.1);
    let mut want = Vec::new();
    for s in 0..STEPS {
        if s == STEPS / 2 {
            opt.set_lr(LR / 2.0);
        }
        let (ids, targets) = batch(s, dev);
        let loss = gpt.loss(&ids, &targets);
        opt.backward_step_clip_norm(&loss, 1.0);
        want.push(loss.double_value(&[]));
    }
    let trained = values(&vs);

    // The port.
    let sh = handle(&device, BUDGET);
    let sgpt = {
        let _g = rng();
        tch::manual_seed(7);
        stagehand_gpt(&sh)
    };
    let mut sopt = sh.optimizer(nn::AdamW::default(), LR).expect("optimizer");
    sopt.set_weight_decay_group(NO_WEIGHT_DECAY, 0.0).expect("group 0");
    sopt.set_weight_decay_group(WEIGHT_DECAY, 0.1).expect("group 1");
    sopt.set_grad_clip(Some(GradClip::Norm(1.0)));
    let e = sopt.set_weight_decay_group(5, 0.0).expect_err("no group 5");
    assert!(e.to_string().contains("group 5") && e.to_string().contains("0..2"), "{e}");
    let mut got = Vec::new();
    for s in 0..STEPS {
        if s == STEPS / 2 {
            sopt.set_lr(LR / 2.0).expect("lr");
        }
        let (ids, targets) = batch(s, dev);
        got.push(sh.train_step(&mut sopt, || sgpt.loss(&ids, &targets)).expect("step").loss);
    }
    assert_losses(&got, &want, cuda);
    let plan = sh.plan().expect("planned");
    assert!(plan.streams(), "the budget makes blocks stream: {plan:?}");
    let wm = sh.weights().last_step_metrics();
    assert!(wm.evictions > 0 && wm.d2h_bytes > 0, "blocks streamed and trained on the host: {wm:?}");

    // Every parameter equals the plain program's, and every one was trained (the unmanaged
    // position embedding and final norm, the tied embedding through both of its uses).
    sopt.wait().expect("host steps");
    let snapshot = cpu(sh.var_store().expect("snapshot").variables());
    assert_same(&snapshot, &trained, cuda, "after training");
    assert_all_changed(&snapshot, &initial, &[]);
    assert!(snapshot.keys().any(|n| n == "blocks.3.attn.qkv.weight"), "the managed custom layer keeps tch's names");

    // Stagehand -> plain tch, both formats.
    for name in ["gpt.ot", "gpt.safetensors"] {
        let path = dir.path().join(name);
        sh.save(&path).expect("save");
        let mut plain = nn::VarStore::new(tch::Device::Cpu);
        let _model = {
            let _g = rng();
            tch::manual_seed(99);
            plain_gpt(&plain)
        };
        plain.load(&path).expect("plain tch loads Stagehand's checkpoint");
        assert_same(&values(&plain), &trained, cuda, name);
    }

    // plain tch -> Stagehand (a model made from another seed, loaded before it ever ran), then
    // one step of each from the loaded weights: the same loss and the same parameters.
    for name in ["plain.ot", "plain.safetensors"] {
        let path = dir.path().join(name);
        vs.save(&path).expect("plain save");
        let sh2 = handle(&device, BUDGET);
        let g2 = {
            let _g = rng();
            tch::manual_seed(99);
            stagehand_gpt(&sh2)
        };
        sh2.load(&path).expect("Stagehand loads tch's checkpoint");
        assert_same(&cpu(sh2.var_store().expect("snapshot").variables()), &trained, cuda, name);
        let (ids, targets) = batch(100, dev);
        let mut o2 = sh2.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
        let l2 = sh2.train_step(&mut o2, || g2.loss(&ids, &targets)).expect("step").loss;
        let l1 = gpt.loss(&ids, &targets).double_value(&[]);
        assert_losses(&[l2], &[l1], cuda);
    }
}

#[test]
fn a_trainable_variable_no_optimizer_covers_is_an_error_at_the_first_step() {
    let device = common::device();
    let dev = device.tch_device();
    let sh = handle(&device, BUDGET);
    let gpt = {
        let _g = rng();
        tch::manual_seed(3);
        stagehand_gpt(&sh)
    };
    // The runtime's blocks only: the position embedding and the final norm are left out.
    let mut opt = stagehand::optim::Optimizer::new(sh.weights(), vec![], nn::AdamW::default(), LR, stagehand::optim::Kernel::Exact)
        .expect("optimizer");
    let (ids, targets) = batch(0, dev);
    let e = sh.train_step(&mut opt, || gpt.loss(&ids, &targets)).expect_err("uncovered variables");
    let msg = e.to_string();
    assert!(msg.contains("'ln_f.") || msg.contains("'pos'"), "{msg}");
    assert!(msg.contains("no optimizer steps it") && msg.contains("Stagehand::optimizer"), "{msg}");
}
