//! A block-mode program over a safetensors base, without a hand-written step: the frozen base's
//! blocks stream from the file they were saved to, each wrapped as a plain tch `Module`
//! (`Managed::in_block`, steps beginning and ending by themselves), while low-rank adapters in
//! the same VarStore train on the device with one optimizer over every trainable variable.
//! On the host device the losses are bit-identical with the plain program, the adapters train,
//! the base never changes, and checkpoints round-trip with plain tch; a checkpoint that would
//! change the frozen, file-backed base is refused.

use stagehand::events::Bus;
use stagehand::nn::Managed;
use stagehand::optim::{Kernel, Optimizer};
use stagehand::weights::{WeightConfig, WeightRuntime};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_losses, assert_same, values};
use common::rng;

const BLOCKS: i64 = 6;
const D: i64 = 32;
const RANK: i64 = 4;
const STEPS: i64 = 8;

/// A frozen base block.
#[derive(Debug)]
struct Mlp {
    up: nn::Linear,
    down: nn::Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.down.forward(&self.up.forward(x).gelu("none"))
    }
}

struct Model {
    base: Vec<Box<dyn Module>>,
    lora: Vec<(nn::Linear, nn::Linear)>,
}

impl Model {
    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (b, (a, bb)) in self.base.iter().zip(&self.lora) {
            h = &h + b.forward(&h) * 0.1 + bb.forward(&a.forward(&h));
        }
        h.mse_loss(y, tch::Reduction::Mean)
    }
}

/// The base blocks (frozen) and the adapters (trainable) in one VarStore.
fn build(vs: &nn::VarStore) -> (Vec<Mlp>, Vec<(nn::Linear, nn::Linear)>) {
    let r = vs.root();
    let base: Vec<Mlp> = (0..BLOCKS)
        .map(|i| {
            let p = &r / "blocks" / i;
            Mlp {
                up: nn::linear(&p / "up", D, 2 * D, Default::default()),
                down: nn::linear(&p / "down", 2 * D, D, Default::default()),
            }
        })
        .collect();
    for (name, t) in vs.variables() {
        if name.starts_with("blocks.") {
            let _ = t.set_requires_grad(false);
        }
    }
    let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
    let lora = (0..BLOCKS)
        .map(|i| {
            let p = &r / "lora" / i;
            (nn::linear(&p / "a", D, RANK, no_bias), nn::linear(&p / "b", RANK, D, no_bias))
        })
        .collect();
    (base, lora)
}

fn batch(step: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(900 + step);
    let x = Tensor::randn([16, D], (Kind::Float, tch::Device::Cpu));
    let y = x.flip([1]).tanh();
    (x.to_device(dev), y.to_device(dev))
}

#[test]
fn a_block_mode_model_over_a_safetensors_base_trains_like_plain_tch_without_step_calls() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("base.safetensors");

    // Plain tch: everything resident, the base frozen.
    let (vs, (base, lora)) = common::seeded_on_cpu(41, dev, build);
    let base: Vec<Box<dyn Module>> = base.into_iter().map(|b| Box::new(b) as Box<dyn Module>).collect();
    let model = Model { base, lora };
    let base_file: Vec<(String, Tensor)> =
        values(&vs).into_iter().filter(|(n, _)| n.starts_with("blocks.")).collect();
    Tensor::write_safetensors(&base_file, &file).expect("the base file");
    let initial = values(&vs);
    let mut opt = nn::AdamW::default().build(&vs, 1e-2).expect("adamw");
    let want: Vec<f64> = (0..STEPS)
        .map(|s| {
            let (x, y) = batch(s, dev);
            let loss = model.loss(&x, &y);
            opt.backward_step(&loss);
            loss.double_value(&[])
        })
        .collect();

    // Block mode: blocks by a pattern, each streamed from the file, each a Module.
    let svs = nn::VarStore::new(tch::Device::Cpu);
    let (base, lora) = {
        let _g = rng();
        tch::manual_seed(41);
        build(&svs)
    };
    let block_bytes = (4 * D * D * 4 + 1024) as u64;
    let cfg = WeightConfig::builder()
        .pool(8 * block_bytes.next_power_of_two(), block_bytes.next_power_of_two())
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(2 * block_bytes)
        .prefetch_window(1)
        .build()
        .expect("config");
    let rt = WeightRuntime::from_var_store(&svs, r"^blocks\.\d+$", device.clone(), cfg, Bus::disabled()).expect("runtime");
    rt.set_auto_step(true);
    let base: Vec<Box<dyn Module>> = base
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let id = rt.block_id(&format!("blocks.{i}")).expect("block");
            rt.back_with_file(id, &file, "").expect("file-backed");
            Box::new(Managed::in_block(&rt, id, m).expect("module")) as Box<dyn Module>
        })
        .collect();
    let smodel = Model { base, lora };
    let mut sopt = Optimizer::for_var_store(&rt, nn::AdamW::default(), 1e-2, Kernel::Exact).expect("optimizer");
    let got: Vec<f64> = (0..STEPS)
        .map(|s| {
            let (x, y) = batch(s, dev);
            let loss = smodel.loss(&x, &y);
            sopt.backward_step(&loss).expect("step");
            loss.double_value(&[])
        })
        .collect();
    rt.finish().expect("close the last step");
    assert_losses(&got, &want, cuda);
    assert_eq!(rt.step(), STEPS as u64, "one step per forward and backward, found by itself");
    let m = rt.last_step_metrics();
    assert!(m.evictions > 0, "the base streamed: {m:?}");

    // Adapters trained, the base untouched, everything equal to plain tch.
    let snapshot = stagehand::checkpoint::snapshot(&svs, Some(&rt)).expect("snapshot");
    let got_values: std::collections::HashMap<String, Tensor> =
        snapshot.variables().into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu))).collect();
    assert_same(&got_values, &values(&vs), cuda, "after training");
    for (n, t) in &got_values {
        assert_eq!(t.equal(&initial[n]), n.starts_with("blocks."), "{n}: only adapters change");
    }

    // Checkpoints with plain tch, both ways; the base must stay the file's.
    let out = dir.path().join("run.ot");
    stagehand::checkpoint::save(&out, &svs, Some(&rt)).expect("save");
    let mut plain = nn::VarStore::new(tch::Device::Cpu);
    let _ = build(&plain);
    plain.load(&out).expect("plain loads it");
    assert_same(&values(&plain), &values(&vs), cuda, "plain loaded block mode's");
    let back = dir.path().join("plain.safetensors");
    vs.save(&back).expect("plain save");
    stagehand::checkpoint::load(&back, &svs, Some(&rt)).expect("the base equals the file: loads");
    let mut changed: Vec<(String, Tensor)> = values(&vs).into_iter().collect();
    for (n, t) in &mut changed {
        if n == "blocks.2.up.weight" {
            *t = t.ones_like();
        }
    }
    let bad = dir.path().join("changed-base.ot");
    Tensor::save_multi(&changed, &bad).expect("write");
    let e = stagehand::checkpoint::load(&bad, &svs, Some(&rt)).expect_err("the base is frozen");
    assert!(e.to_string().contains("'blocks.2.up.weight'") && e.to_string().contains("file-backed block is frozen"), "{e}");
}
