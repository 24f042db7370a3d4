//! Layer mode: drop-in `stagehand::nn` layers give the unwrapped model's outputs on the trace
//! step and on scheduled steps, learn the itinerary, detect steps, and train like AdamW.

use stagehand::device::Device;
use stagehand::nn::{self as snn, LayerOptions, ManagedVarStore};
use stagehand::optim::{Kernel, Optimizer};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::{rng, Collected};

const V: i64 = 20;
const D: i64 = 16;
const H: i64 = 32;

#[derive(Debug)]
struct Plain(nn::Embedding, nn::Linear, nn::Linear);
#[derive(Debug)]
struct Managed(snn::Embedding, snn::Linear, snn::Linear);

fn plain(vs: &nn::VarStore) -> Plain {
    let r = vs.root();
    Plain(
        nn::embedding(&r / "emb", V, D, Default::default()),
        nn::linear(&r / "fc1", D, H, Default::default()),
        nn::linear(&r / "fc2", H, D, Default::default()),
    )
}

fn managed(vs: &ManagedVarStore) -> Managed {
    let r = vs.root();
    Managed(
        snn::embedding(&r / "emb", V, D, Default::default()),
        snn::linear(&r / "fc1", D, H, Default::default()),
        snn::linear(&r / "fc2", H, D, Default::default()),
    )
}

impl Module for Plain {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let h = self.0.forward(ids);
        &h + self.2.forward(&self.1.forward(&h).relu())
    }
}

impl Module for Managed {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let h = self.0.forward(ids);
        &h + self.2.forward(&self.1.forward(&h).relu())
    }
}

/// The same initial weights in both (layers created in the same order from the same seed on
/// the CPU); the plain model then moves to the device.
fn models(opts: LayerOptions) -> (nn::VarStore, Plain, ManagedVarStore, Managed) {
    let dev = Device::auto(1 << 30).tch_device();
    let _g = rng();
    tch::manual_seed(11);
    let ms = ManagedVarStore::new(nn::VarStore::new(tch::Device::Cpu), opts).expect("managed store");
    let m = managed(&ms);
    tch::manual_seed(11);
    let mut vr = nn::VarStore::new(tch::Device::Cpu);
    let p = plain(&vr);
    vr.set_device(dev);
    (vr, p, ms, m)
}

fn opts(device: &Device) -> LayerOptions {
    LayerOptions {
        // Weight budget = 80 % of this: two of the three layers.
        vram_budget: Some(5760),
        prefetch_k: 1,
        device: Some(device.clone()),
        ..LayerOptions::default()
    }
}

fn batch(dev: tch::Device, seed: i64) -> Tensor {
    let _g = rng();
    tch::manual_seed(seed);
    Tensor::randint(V, [6, 3], (Kind::Int64, dev))
}

#[test]
fn layers_match_the_unwrapped_model_and_train_like_adamw() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let (vr, p, ms, m) = models(opts(&device));
    let rt = ms.runtime().clone();
    let lr = 1e-2;
    let mut ref_opt = nn::AdamW::default().build(&vr, lr).expect("adamw");
    let mut opt = Optimizer::new(&rt, vec![], nn::AdamW::default(), lr, Kernel::Exact).expect("optimizer");
    for step in 0..6 {
        let ids = batch(dev, 50 + step);
        let want = p.forward(&ids);
        let got = m.forward(&ids);
        if dev.is_cuda() {
            assert!(got.allclose(&want, 1e-5, 1e-5, false), "step {step}");
        } else {
            assert!(got.equal(&want), "step {step}: outputs differ");
        }
        ref_opt.zero_grad();
        want.square().mean(Kind::Float).backward();
        ref_opt.step();
        opt.zero_grad().expect("zero");
        got.square().mean(Kind::Float).backward();
        opt.step().expect("step");
    }
    rt.finish().expect("close the last step");
    assert_eq!(rt.step(), 6, "one step per forward+backward, detected automatically");
    let it = rt.itinerary().expect("traced in step 0");
    assert_eq!(it.forward(), [m.0.block(), m.1.block(), m.2.block()]);
    let mx = rt.last_step_metrics();
    assert!(mx.evictions > 0, "{mx:?}");
    assert!(rt.resident_bytes() <= 4608);
    if !device.is_cuda() {
        // On CUDA the watermarks see every allocation (activations, the reference model), so a
        // 5.6 KB VRAM budget stops prefetch; on the host device they see the weights alone.
        assert!(mx.prefetch_hits > 0, "{mx:?}");
    }
    // Parameters after 6 AdamW steps equal the reference's.
    let refs = vr.variables();
    for spec in rt.blocks() {
        for (i, pspec) in spec.params.iter().enumerate() {
            let got = rt.host_param(spec.id, i).expect("param");
            let want = refs[&pspec.name].to_device(tch::Device::Cpu);
            if dev.is_cuda() {
                assert!(got.allclose(&want, 1e-4, 1e-5, false), "{}", pspec.name);
            } else {
                assert!(got.equal(&want), "{}: parameters differ", pspec.name);
            }
        }
    }
    snn::release_hooks();
}

#[test]
fn conv_layers_match_in_inference_mode() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let o = LayerOptions {
        inference_mode: true,
        prefetch_k: 1,
        device: Some(device.clone()),
        vram_budget: Some(1 << 20),
        ..LayerOptions::default()
    };
    let (ms, c1, c2, vr, r1, r2) = {
        let _g = rng();
        tch::manual_seed(3);
        let ms = ManagedVarStore::new(nn::VarStore::new(tch::Device::Cpu), o).expect("store");
        let root = ms.root();
        let c1 = snn::conv2d(&root / "c1", 3, 8, 3, Default::default());
        let c2 = snn::conv2d(&root / "c2", 8, 4, 3, Default::default());
        tch::manual_seed(3);
        let mut vr = nn::VarStore::new(tch::Device::Cpu);
        let r1 = nn::conv2d(vr.root() / "c1", 3, 8, 3, Default::default());
        let r2 = nn::conv2d(vr.root() / "c2", 8, 4, 3, Default::default());
        vr.set_device(dev);
        (ms, c1, c2, vr, r1, r2)
    };
    let _ = &vr;
    for step in 0..3 {
        let x = {
            let _g = rng();
            tch::manual_seed(70 + step);
            Tensor::randn([2, 3, 9, 9], (Kind::Float, dev))
        };
        let got = tch::no_grad(|| c2.forward(&c1.forward(&x).relu()));
        let want = tch::no_grad(|| r2.forward(&r1.forward(&x).relu()));
        if dev.is_cuda() {
            assert!(got.allclose(&want, 1e-5, 1e-5, false), "step {step}");
        } else {
            assert!(got.equal(&want), "step {step}: outputs differ");
        }
    }
    // Inference: a step ends when the first layer runs again.
    assert_eq!(ms.runtime().step(), 2);
}

/// Protections published over four forward-only passes of six equal layers in room for four,
/// with layer mode's cyclic pins on or off.
fn pins_published(pins: bool) -> Vec<u32> {
    let bus = stagehand::events::Bus::new();
    let sub = Collected::on(&bus);
    let o = LayerOptions {
        inference_mode: true,
        cyclic_pins: pins,
        // 80 % of it is the room: four 1280-byte blocks (a 16 x 16 weight, its bias aligned).
        vram_budget: Some(6600),
        device: Some(Device::host(1 << 30)),
        telemetry: bus.clone(),
        ..LayerOptions::default()
    };
    let ms = ManagedVarStore::new(nn::VarStore::new(tch::Device::Cpu), o).expect("store");
    // Under the RNG lock: drawing initial weights while another test of this binary seeds
    // its models would change theirs.
    let layers: Vec<_> = {
        let _g = rng();
        (0..6).map(|i| snn::linear(ms.root() / "blocks" / i.to_string() / "fc", 16, 16, Default::default())).collect()
    };
    let x = Tensor::ones([2, 16], (Kind::Float, tch::Device::Cpu));
    for _ in 0..4 {
        let _ = tch::no_grad(|| layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h)));
    }
    ms.runtime().finish().expect("finish");
    bus.flush();
    let mut pinned = Vec::new();
    for e in sub.take() {
        if let stagehand::events::EventKind::Protection { block, protected: true } = &e.kind {
            pinned.push(block.0);
        }
    }
    pinned
}

#[test]
fn layer_mode_passes_its_cyclic_pins_option_to_the_runtime() {
    // Six blocks through four slots: two pinned (the first and the fourth) when on.
    assert_eq!(pins_published(true), [0, 3]);
    assert!(pins_published(false).is_empty());
}

#[test]
fn a_cpu_varstore_without_a_device_warns_when_cuda_is_there() {
    let bus = stagehand::events::Bus::new();
    let sub = Collected::on(&bus);
    let o = LayerOptions { telemetry: bus.clone(), ..LayerOptions::default() };
    let ms = ManagedVarStore::new(nn::VarStore::new(tch::Device::Cpu), o).expect("store");
    bus.flush();
    let mut warnings = Vec::new();
    for e in sub.take() {
        if let stagehand::events::EventKind::Warning { message, .. } = &e.kind {
            warnings.push(message.clone());
        }
    }
    let host_device = !ms.runtime().device().is_cuda();
    assert!(host_device, "a CPU VarStore without a device computes on the host device");
    if tch::Cuda::is_available() {
        assert!(warnings.iter().any(|w| w.contains("LayerOptions::device is unset")), "{warnings:?}");
    } else {
        assert!(warnings.is_empty(), "{warnings:?}");
    }
}
