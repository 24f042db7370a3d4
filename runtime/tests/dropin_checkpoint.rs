//! Checkpoints are never silently wrong: a model trained under Stagehand, with blocks streamed
//! (between steps their variables point at placeholders) or kept resident (they train on the
//! device), saves its real values with tch's names in `.ot` and `.safetensors`, which plain tch
//! loads bit-identically; it loads what plain tch saved; loading checks everything before it
//! changes anything; and the optimizer's state saves to a sidecar so a resumed run equals an
//! uninterrupted one.

use stagehand::nn as snn;
use stagehand::Stagehand;
use std::collections::HashMap;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_losses, assert_same, cpu, handle, values};
use common::rng;

const D: i64 = 64;
const LAYERS: i64 = 4;
/// Makes the blocks stream.
const STREAMED: u64 = 300 << 10;
/// Keeps every block resident.
const RESIDENT: u64 = 64 << 20;

struct Net {
    blocks: Vec<Box<dyn Module>>,
    ln: nn::LayerNorm,
}

impl Net {
    fn loss(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for b in &self.blocks {
            h = &h + b.forward(&h).tanh();
        }
        self.ln.forward(&h).square().mean(Kind::Float)
    }
}

fn plain(vs: &nn::VarStore) -> Net {
    let r = vs.root();
    Net {
        blocks: (0..LAYERS)
            .map(|i| Box::new(nn::linear(&r / "blocks" / i / "fc", D, D, Default::default())) as Box<dyn Module>)
            .collect(),
        ln: nn::layer_norm(&r / "ln", vec![D], Default::default()),
    }
}

fn managed(sh: &Stagehand) -> Net {
    let r = sh.root();
    Net {
        blocks: (0..LAYERS)
            .map(|i| Box::new(snn::linear(&r / "blocks" / i / "fc", D, D, Default::default())) as Box<dyn Module>)
            .collect(),
        // tch's own layer on a Stagehand path: not managed, lives on the device.
        ln: nn::layer_norm(&r / "ln", vec![D], Default::default()),
    }
}

fn input(step: i64, dev: tch::Device) -> Tensor {
    let _g = rng();
    tch::manual_seed(500 + step);
    Tensor::randn([8, D], (Kind::Float, tch::Device::Cpu)).to_device(dev)
}

fn plain_model(seed: i64, dev: tch::Device) -> (nn::VarStore, Net) {
    common::seeded_on_cpu(seed, dev, plain)
}

fn managed_model(seed: i64, device: &stagehand::device::Device, budget: u64) -> (Stagehand, Net) {
    let sh = handle(device, budget);
    let net = {
        let _g = rng();
        tch::manual_seed(seed);
        managed(&sh)
    };
    (sh, net)
}

#[test]
fn checkpoints_of_streamed_and_resident_models_hold_their_trained_values() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");
    for (budget, streams) in [(STREAMED, true), (RESIDENT, false)] {
        // The plain model trains first: on CUDA its optimizer state then already counts in what
        // the device holds when the handle measures it, as the budget assumes.
        let (vs, net) = plain_model(3, dev);
        let mut popt = nn::Adam::default().build(&vs, 1e-2).expect("adam");
        for s in 0..4 {
            popt.backward_step(&net.loss(&input(s, dev)));
        }
        let (sh, snet) = managed_model(3, &device, budget);
        let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("optimizer");
        for s in 0..4 {
            let x = input(s, dev);
            sh.train_step(&mut opt, || snet.loss(&x)).expect("step");
        }
        assert_eq!(sh.plan().expect("plan").streams(), streams, "budget {budget}");
        let want = values(&vs);
        // No wait for the host optimizer here: saving waits for pending host steps itself.
        for name in ["m.ot", "m.safetensors"] {
            let path = dir.path().join(format!("{budget}-{name}"));
            sh.save(&path).expect("save");
            let read: HashMap<String, Tensor> = if name.ends_with(".ot") {
                Tensor::load_multi(&path).expect("load").into_iter().collect()
            } else {
                Tensor::read_safetensors(&path).expect("read").into_iter().collect()
            };
            assert_same(&read, &want, cuda, &format!("{name}, budget {budget}"));
        }
        assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &want, cuda, "snapshot");
        // After shutdown the model's own variables hold the trained values (a resident block
        // trained on the device writes them back before its device copy goes).
        sh.shutdown().expect("shutdown");
        let mut after = HashMap::new();
        for (n, t) in sh.var_store().expect("snapshot after shutdown").variables() {
            after.insert(n, t.to_device(tch::Device::Cpu));
        }
        assert_same(&after, &want, cuda, "after shutdown");
    }
}

#[test]
fn plain_tch_checkpoints_load_into_a_running_model_before_and_after_it_ran() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");
    let (vs, net) = plain_model(11, dev);
    let path = dir.path().join("plain.safetensors");
    vs.save(&path).expect("plain save");
    for budget in [STREAMED, RESIDENT] {
        // Loaded after the model has run (blocks registered, some on the device): every later
        // forward must see the loaded values, not a stale device copy.
        let (sh, snet) = managed_model(12, &device, budget);
        let mut opt = sh.optimizer(nn::Sgd::default(), 0.0).expect("optimizer");
        for s in 0..2 {
            let x = input(s, dev);
            sh.train_step(&mut opt, || snet.loss(&x)).expect("step");
        }
        sh.load(&path).expect("load");
        assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &values(&vs), cuda, "loaded");
        let x = input(9, dev);
        let got = sh.train_step(&mut opt, || snet.loss(&x)).expect("step").loss;
        assert_losses(&[got], &[net.loss(&x).double_value(&[])], cuda);
    }
}

#[test]
fn loading_checks_every_name_shape_and_dtype_before_changing_anything() {
    let device = common::device();
    let dir = tempfile::tempdir().expect("dir");
    let (sh, snet) = managed_model(5, &device, STREAMED);
    let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("optimizer");
    let x = input(0, device.tch_device());
    sh.train_step(&mut opt, || snet.loss(&x)).expect("step");
    let before = cpu(sh.var_store().expect("snapshot").variables());
    let unchanged = |what: &str| assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &before, false, what);

    // A checkpoint without one variable: an error naming it; nothing changed.
    let mut most: Vec<(String, Tensor)> = before.iter().map(|(n, t)| (n.clone(), t.zeros_like())).collect();
    most.retain(|(n, _)| n != "blocks.2.fc.bias");
    let missing = dir.path().join("missing.ot");
    Tensor::save_multi(&most, &missing).expect("write");
    let e = sh.load(&missing).expect_err("a variable is missing");
    assert!(e.to_string().contains("'blocks.2.fc.bias'") && e.to_string().contains("load_partial"), "{e}");
    unchanged("after a refused load");
    // load_partial loads the rest and says what it lacked.
    let lacked = sh.load_partial(&missing).expect("partial");
    assert_eq!(lacked, ["blocks.2.fc.bias"]);
    let now = cpu(sh.var_store().expect("snapshot").variables());
    assert!(now["blocks.0.fc.weight"].equal(&before["blocks.0.fc.weight"].zeros_like()));
    assert!(now["blocks.2.fc.bias"].equal(&before["blocks.2.fc.bias"]));

    // A shape that differs, and a managed weight in another dtype.
    let mut wrong: Vec<(String, Tensor)> = before.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    for (n, t) in &mut wrong {
        if n == "blocks.1.fc.weight" {
            *t = Tensor::zeros([D, D + 1], (Kind::Float, tch::Device::Cpu));
        }
    }
    let shape = dir.path().join("shape.safetensors");
    Tensor::write_safetensors(&wrong, &shape).expect("write");
    let e = sh.load(&shape).expect_err("shape");
    assert!(e.to_string().contains("'blocks.1.fc.weight'") && e.to_string().contains("[64, 65]"), "{e}");
    let mut half: Vec<(String, Tensor)> = before.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    for (n, t) in &mut half {
        if n == "blocks.3.fc.weight" {
            *t = t.to_kind(Kind::Half);
        }
    }
    let dtype = dir.path().join("dtype.ot");
    Tensor::save_multi(&half, &dtype).expect("write");
    let e = sh.load(&dtype).expect_err("dtype");
    assert!(e.to_string().contains("'blocks.3.fc.weight'") && e.to_string().contains("Half"), "{e}");

    // Not a checkpoint at all.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}").expect("write");
    let e = sh.load(&junk).expect_err("junk");
    assert!(e.to_string().contains("not a safetensors file"), "{e}");
    let e = sh.load(dir.path().join("absent.ot")).expect_err("absent");
    assert!(e.to_string().contains("absent.ot"), "{e}");
}

/// Trains `steps` steps from `from` with Adam (host steps on the worker) and returns the losses.
fn run(sh: &Stagehand, net: &Net, opt: &mut stagehand::optim::Optimizer, from: i64, steps: i64) -> Vec<f64> {
    (from..from + steps)
        .map(|s| {
            let x = input(s, sh.device().tch_device());
            sh.train_step(opt, || net.loss(&x)).expect("step").loss
        })
        .collect()
}

#[test]
fn a_run_resumed_from_model_and_optimizer_checkpoints_equals_an_uninterrupted_one() {
    let device = common::device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");
    for algorithm in [
        stagehand::optim::Algorithm::from(nn::Adam { amsgrad: true, ..Default::default() }),
        nn::Sgd { momentum: 0.9, ..Default::default() }.into(),
        nn::RmsProp { momentum: 0.5, centered: true, ..Default::default() }.into(),
    ] {
        let (sh, net) = managed_model(21, &device, STREAMED);
        let mut opt = sh.optimizer(algorithm, 1e-2).expect("optimizer");
        let want = run(&sh, &net, &mut opt, 0, 6);

        let (sh1, net1) = managed_model(21, &device, STREAMED);
        let mut opt1 = sh1.optimizer(algorithm, 1e-2).expect("optimizer");
        let mut got = run(&sh1, &net1, &mut opt1, 0, 3);
        let (model, state) = (dir.path().join("model.safetensors"), dir.path().join("model.optimizer.safetensors"));
        sh1.save(&model).expect("save model");
        opt1.save_state(&state).expect("save optimizer");

        // A new process, in effect: another seed, a fresh optimizer, both checkpoints loaded
        // before the first step.
        let (sh2, net2) = managed_model(77, &device, STREAMED);
        let mut opt2 = sh2.optimizer(algorithm, 1.0).expect("optimizer");
        sh2.load(&model).expect("load model");
        opt2.load_state(&state).expect("load optimizer");
        assert_eq!(opt2.group_options(0).lr, 1e-2, "group options come back with the state");
        got.extend(run(&sh2, &net2, &mut opt2, 3, 3));
        assert_losses(&got, &want, cuda);

        // The wrong algorithm's state is refused, naming both.
        let other: stagehand::optim::Algorithm = nn::AdamW::default().into();
        if other.name() != algorithm.name() {
            let (sh3, _net3) = managed_model(1, &device, STREAMED);
            let mut opt3 = sh3.optimizer(other, 1e-2).expect("optimizer");
            let e = opt3.load_state(&state).expect_err("another algorithm");
            assert!(e.to_string().contains(algorithm.name()) && e.to_string().contains("AdamW"), "{e}");
        }
    }
    // The fused host kernel resumes exactly too, and reads the exact kernel's files.
    let adamw: stagehand::optim::Algorithm = nn::AdamW::default().into();
    let fused = |sh: &Stagehand| {
        stagehand::optim::Optimizer::for_var_store(sh.weights(), adamw, 1e-2, stagehand::optim::Kernel::Fused).expect("fused")
    };
    let (sh, net) = managed_model(21, &device, STREAMED);
    let want = run(&sh, &net, &mut fused(&sh), 0, 6);
    let (sh1, net1) = managed_model(21, &device, STREAMED);
    let mut opt1 = fused(&sh1);
    let mut got = run(&sh1, &net1, &mut opt1, 0, 3);
    let (model, state) = (dir.path().join("fused.safetensors"), dir.path().join("fused.optimizer.safetensors"));
    sh1.save(&model).expect("save model");
    opt1.save_state(&state).expect("save optimizer");
    let (sh2, net2) = managed_model(77, &device, STREAMED);
    let mut opt2 = fused(&sh2);
    sh2.load(&model).expect("load model");
    opt2.load_state(&state).expect("load optimizer");
    got.extend(run(&sh2, &net2, &mut opt2, 3, 3));
    assert_losses(&got, &want, cuda);
    let (sh3, net3) = managed_model(77, &device, STREAMED);
    let mut exact = sh3.optimizer(adamw, 1e-2).expect("exact");
    sh3.load(&model).expect("load model");
    exact.load_state(&state).expect("the exact kernel reads the fused kernel's state");
    let resumed = run(&sh3, &net3, &mut exact, 3, 3);
    for (a, b) in resumed.iter().zip(&want[3..]) {
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "exact from fused state: {resumed:?} vs {want:?}");
    }

    // The sidecar says what it is.
    let meta = safetensors_metadata(&dir.path().join("model.optimizer.safetensors"));
    assert_eq!(meta["format"], stagehand::optim::state::FORMAT);
    assert_eq!(meta["algorithm"], "RMSprop");
    assert!(meta["variables"].contains("blocks.0.fc.weight") && meta["variables"].contains("ln.weight"), "{meta:?}");
}

fn safetensors_metadata(path: &std::path::Path) -> HashMap<String, String> {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("json header");
    serde_json::from_value(header["__metadata__"].clone()).expect("metadata")
}
