//! The misuses a port of a tch program runs into, each answered by an error that names what is
//! wrong and what to do (or by the right result), never by a panic inside a tch layer or a
//! computation with a placeholder: handles of managed weights kept where they would read a
//! placeholder, two runtimes over one VarStore, a variable in two blocks, a model used after its
//! handle is gone, a layer made after the first step, a second optimizer, tiny budgets in layer
//! mode, and a non-finite loss with the numeric guards on.

use stagehand::device::Device;
use stagehand::nn::{self as snn, LayerOptions, ManagedVarStore};
use stagehand::weights::{WeightConfig, WeightRuntime};
use stagehand::{Error, Stagehand};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_losses, assert_same, cpu, handle, values};
use common::rng;

const D: i64 = 32;
/// Small enough that the blocks below stream.
const BUDGET: u64 = 96 << 10;

fn seeded<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    let _g = rng();
    tch::manual_seed(seed);
    f()
}

/// Three blocks of one linear each.
fn layers(sh: &Stagehand) -> Vec<snn::Linear> {
    seeded(3, || {
        let r = sh.root();
        (0..3).map(|i| snn::linear(&r / "blocks" / i / "fc", D, D, Default::default())).collect()
    })
}

fn forward(layers: &[impl Module], x: &Tensor) -> Tensor {
    layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).tanh()).square().mean(Kind::Float)
}

fn x(dev: tch::Device) -> Tensor {
    seeded(9, || Tensor::randn([4, D], (Kind::Float, tch::Device::Cpu)).to_device(dev))
}

/// The error says which variable and what to do instead.
fn assert_names_the_kept_handle(e: &Error, name: &str) {
    let m = e.to_string();
    assert!(m.contains(&format!("'{name}'")) && m.contains("Stagehand does not know of") && m.contains("Managed::run"), "{m}");
}

#[test]
fn a_handle_of_a_managed_weight_kept_outside_its_layer_is_an_error_naming_it() {
    let device = common::device();
    let dev = device.tch_device();

    // tch's own Path::get, reached through Deref, before the model first ran: refused when
    // the model is sealed (the handle's plan), before any forward reads a placeholder.
    let sh = handle(&device, BUDGET);
    let model = layers(&sh);
    let kept = (*(&sh.root() / "blocks" / 1 / "fc")).get("weight").expect("tch finds the variable");
    // Adam's state makes the blocks stream at this budget.
    let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    assert_names_the_kept_handle(&sh.prepare().expect_err("a kept handle"), "blocks.1.fc.weight");
    let e = sh.train_step(&mut opt, || forward(&model, &x(dev))).expect_err("still kept");
    assert_names_the_kept_handle(&e, "blocks.1.fc.weight");
    // Stagehand's own Path::get says where the value is instead.
    let e = (&sh.root() / "blocks" / 1 / "fc").get("weight").expect_err("a managed variable");
    assert!(e.to_string().contains("Managed::variables"), "{e}");
    let e = sh.root().get("blocks.1.fc.weight").expect_err("a dotted name");
    assert!(e.to_string().contains("blocks.1.fc.weight"), "{e}");
    // Dropping the handle is all it takes.
    drop(kept);
    sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("trains once the handle is gone");
    // A handle used and dropped at once (no step sees it) reads NaN while its block is not on
    // the device, never a plausible value.
    assert!(sh.plan().expect("plan").streams());
    let read = (*(&sh.root() / "blocks" / 1 / "fc")).get("weight").expect("found");
    assert!(read.isnan().all().int64_value(&[]) == 1, "a placeholder is NaN");
    drop(read);

    // A clone kept from a custom layer's constructor, and a view made there.
    for view in [false, true] {
        let sh = handle(&device, BUDGET);
        let mut keep = None;
        let root = sh.root();
        let model: Vec<snn::Managed<nn::Linear>> = seeded(4, || {
            (0..3)
                .map(|i| {
                    (&root / "blocks" / i / "fc")
                        .manage(|p| {
                            let l = nn::linear(p, D, D, Default::default());
                            if i == 2 {
                                keep = Some(if view { l.ws.tr() } else { l.ws.shallow_clone() });
                            }
                            l
                        })
                        .expect("managed")
                })
                .collect()
        });
        let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
        let e = sh.train_step(&mut opt, || forward(&model, &x(dev))).expect_err("a kept clone");
        assert_names_the_kept_handle(&e, "blocks.2.fc.weight");
        drop(keep);
        sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("trains");
    }

    // A clone taken out of Managed::run after a step, and in layer mode.
    let sh = handle(&device, BUDGET);
    let model = layers(&sh);
    let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
    sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("step");
    let kept = model[0].run(|l| l.ws.shallow_clone()).expect("run");
    let e = sh.train_step(&mut opt, || forward(&model, &x(dev))).expect_err("a clone kept from run");
    assert_names_the_kept_handle(&e, "blocks.0.fc.weight");
    drop(kept);

    let ms = ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        LayerOptions { vram_budget: Some(BUDGET), device: Some(device.clone()), ..LayerOptions::default() },
    )
    .expect("store");
    let model: Vec<snn::Linear> = seeded(3, || (0..3).map(|i| snn::linear(ms.root() / "blocks" / i / "fc", D, D, Default::default())).collect());
    let mut opt = ms.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
    opt.backward_step(&forward(&model, &x(dev))).expect("step");
    let kept = (*(ms.root() / "blocks" / 2 / "fc")).entry("bias").or_zeros(&[D]);
    let e = opt.backward_step(&forward(&model, &x(dev))).expect_err("tch's entry found the managed variable");
    assert_names_the_kept_handle(&e, "blocks.2.fc.bias");
    drop(kept);
    opt.backward_step(&forward(&model, &x(dev))).expect("trains");
}

#[test]
fn two_runtimes_over_one_var_store_and_a_variable_in_two_blocks_are_errors_at_construction() {
    let device = common::device();
    let dev = device.tch_device();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let plain: Vec<nn::Linear> = seeded(5, || (0..2).map(|i| nn::linear(vs.root() / "blocks" / i, D, D, Default::default())).collect());
    let w0 = plain[0].ws.copy();
    let cfg = || WeightConfig::builder().weight_budget(1 << 20).build().expect("config");
    let rt = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", Device::host(1 << 30), cfg(), Default::default()).expect("first runtime");
    let e = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", Device::host(1 << 30), cfg(), Default::default())
        .expect_err("a second runtime over the same variables");
    let m = e.to_string();
    assert!(m.contains("blocks.0") && m.contains("another weight runtime") && m.contains("one WeightRuntime per VarStore"), "{m}");
    // The first runtime still holds the real values.
    let weight = |rt: &WeightRuntime| {
        let b = rt.block_id("blocks.0").expect("block");
        let i = rt.blocks()[b.0 as usize].params.iter().position(|p| p.name == "blocks.0.weight").expect("weight");
        rt.host_param(b, i).expect("value")
    };
    let first = weight(&rt);
    assert!(first.equal(&w0), "the refused runtime changed nothing");
    drop(rt);
    // Once the first runtime is gone, its variables are free again (they point at its
    // placeholders, so a fresh VarStore is what a new runtime should get; here only the claim is
    // checked).
    let vs2 = nn::VarStore::new(tch::Device::Cpu);
    let _ = seeded(5, || (0..2).map(|i| nn::linear(vs2.root() / "blocks" / i, D, D, Default::default())).collect::<Vec<_>>());
    let rt2 = WeightRuntime::from_var_store(&vs2, r"^blocks\.\d+$", Device::host(1 << 30), cfg(), Default::default()).expect("runtime");
    let got = weight(&rt2);
    assert!(got.equal(&w0), "the new runtime has the real weights");
    let _ = dev;

    // One variable in two blocks of one runtime.
    let w = Tensor::ones([D, D], (Kind::Float, tch::Device::Cpu));
    let rt3 = WeightRuntime::new(Device::host(1 << 30), cfg(), Default::default()).expect("runtime");
    rt3.register_block("a", vec![("w".into(), w.shallow_clone())]).expect("first block");
    let e = rt3.register_block("b", vec![("w".into(), w.shallow_clone())]).expect_err("the same variable again");
    assert!(e.to_string().contains("block 'a' of this runtime"), "{e}");
    let e = rt3
        .register_block("c", vec![("x".into(), Tensor::zeros([2], (Kind::Float, tch::Device::Cpu))), ("y".into(), w.shallow_clone())])
        .expect_err("all or none");
    assert!(e.to_string().contains("'y'"), "{e}");
}

#[test]
fn a_model_used_after_its_handle_is_dropped_is_an_error_at_the_next_call() {
    let device = common::device();
    let dev = device.tch_device();
    let model = {
        let sh = handle(&device, BUDGET);
        let model = layers(&sh);
        let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
        sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("step");
        model
    };
    let e = model[0].try_forward(&x(dev)).expect_err("the handle is gone");
    assert!(e.to_string().contains("Stagehand handle was dropped"), "{e}");
    // The values stay readable: the host copies are the trained weights.
    let v = model[1].variables().expect("values");
    assert!(v.iter().all(|(_, t)| t.isfinite().all().int64_value(&[]) == 1));
    assert!(model[2].run(|l| l.ws.size()).is_err());
    // `Module::forward` cannot return the error: it panics with it, never inside tch.
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model[0].forward(&x(dev)))).expect_err("no forward");
    let m = p.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(m.starts_with("stagehand layer 'blocks.0.fc'") && m.contains("Stagehand handle was dropped"), "{m}");
}

#[test]
fn a_layer_made_after_the_first_step_is_registered_and_trains_like_tch() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let (vs, plain) = common::seeded_on_cpu(3, dev, |vs| {
        (0..3).map(|i| nn::linear(vs.root() / "blocks" / i / "fc", D, D, Default::default())).collect::<Vec<_>>()
    });
    let mut popt = nn::Adam::default().build(&vs, 1e-2).expect("adam");
    let sh = handle(&device, BUDGET);
    let model = layers(&sh);
    let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    let (mut want, mut got) = (Vec::new(), Vec::new());
    for s in 0..2 {
        let l = forward(&plain, &x(dev));
        popt.backward_step(&l);
        want.push(l.double_value(&[]));
        got.push(sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("step").loss);
        let _ = s;
    }
    // A head made after the model ran, in both programs, on the same draws: the CPU's, where
    // the handle's store makes its variables (made on the plain program's CUDA store, tch would
    // draw them from the CUDA generator, other numbers for the same seed).
    let phead = seeded(8, || {
        let drawn = nn::linear(nn::VarStore::new(tch::Device::Cpu).root() / "head", D, D, Default::default());
        let head = nn::linear(vs.root() / "head", D, D, Default::default());
        tch::no_grad(|| {
            head.ws.shallow_clone().copy_(&drawn.ws);
            if let (Some(b), Some(d)) = (&head.bs, &drawn.bs) {
                b.shallow_clone().copy_(d);
            }
        });
        head
    });
    let shead = seeded(8, || snn::linear(sh.root() / "head", D, D, Default::default()));
    for _ in 0..3 {
        let l = phead.forward(&(forward(&plain, &x(dev)) * Tensor::ones([1, D], (Kind::Float, dev)))).square().mean(Kind::Float);
        popt.backward_step(&l);
        want.push(l.double_value(&[]));
        got.push(
            sh.train_step(&mut opt, || {
                shead.forward(&(forward(&model, &x(dev)) * Tensor::ones([1, D], (Kind::Float, dev)))).square().mean(Kind::Float)
            })
            .expect("a late layer trains")
            .loss,
        );
    }
    assert_losses(&got, &want, cuda);
    opt.wait().expect("host steps");
    assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &values(&vs), cuda, "late layer");
    assert!(sh.weights().blocks().iter().any(|b| b.name == "head"), "the late layer is a block");
}

#[test]
fn a_second_optimizer_on_one_handle_is_an_error() {
    let device = common::device();
    let sh = handle(&device, BUDGET);
    let _model = layers(&sh);
    let _opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    let e = sh.optimizer(nn::Sgd::default(), 0.1).expect_err("one optimizer per handle");
    assert!(e.to_string().contains("one optimizer"), "{e}");
}

#[test]
fn layer_mode_with_a_tiny_or_zero_budget_is_an_error_not_a_panic() {
    let device = common::device();
    // One step through the fallible calls: the store, each layer, the optimizer's step, with
    // the input on `input`.
    let attempt = |budget: u64, on: Option<Device>, input: tch::Device| -> stagehand::Result<f64> {
        let ms = ManagedVarStore::new(
            nn::VarStore::new(tch::Device::Cpu),
            LayerOptions { vram_budget: Some(budget), device: on, ..LayerOptions::default() },
        )?;
        let model: Vec<snn::Linear> = seeded(3, || (0..3).map(|i| snn::linear(ms.root() / "blocks" / i / "fc", D, D, Default::default())).collect());
        let mut opt = ms.optimizer(nn::Sgd::default(), 0.1)?;
        let mut h = x(input);
        for l in &model {
            h = l.try_forward(&h)?.tanh();
        }
        let loss = h.square().mean(Kind::Float);
        opt.backward_step(&loss)?;
        Ok(loss.double_value(&[]))
    };
    for budget in [0u64, 1, 100, 4 << 10, 20 << 10] {
        // Without a device, a CPU VarStore's layers compute on the host device: the input there.
        for on in [Some(device.clone()), None] {
            let input = on.as_ref().map_or(tch::Device::Cpu, Device::tch_device);
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| attempt(budget, on.clone(), input))) {
                Ok(Ok(loss)) => assert!(budget >= 4 << 10 && loss.is_finite(), "budget {budget}"),
                Ok(Err(e)) => {
                    let m = e.to_string();
                    assert!(budget < 20 << 10 && m.contains("bytes") && m.contains("vram_budget"), "budget {budget}: {m}");
                }
                Err(_) => panic!("budget {budget}: a panic, not an error"),
            }
        }
    }
    // An input on the GPU for layers computing on the host (no device set): an error naming
    // both devices and the setting, not libtorch's panic inside the layer.
    if device.is_cuda() {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| attempt(20 << 10, None, device.tch_device()))) {
            Ok(Err(e)) => {
                let m = e.to_string();
                assert!(m.contains(&format!("{:?}", device.tch_device())) && m.contains("Cpu") && m.contains("LayerOptions::device"), "{m}");
            }
            Ok(Ok(_)) => panic!("an input on another device than the layers' trained"),
            Err(_) => panic!("an input on another device: a panic, not an error"),
        }
    } else {
        eprintln!("skipping the input on another device: no CUDA device");
    }
}

#[test]
fn guards_skip_the_optimizer_step_on_a_non_finite_loss_say_so_and_count_it() {
    let device = common::device();
    let dev = device.tch_device();
    for bad in [f64::NAN, f64::INFINITY] {
        let budget = BUDGET + if device.is_cuda() { device.memory().allocated } else { 0 };
        let sh = Stagehand::builder()
            .budget_bytes(budget)
            .device(if device.is_cuda() { device.clone() } else { Device::host(budget) })
            .kernel(stagehand::optim::Kernel::Exact)
            .guards(true)
            .build()
            .expect("handle");
        let model = layers(&sh);
        let mut opt = sh.optimizer(nn::Sgd::default(), 0.1).expect("sgd");
        sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("a finite step");
        opt.wait().expect("host steps");
        let before = cpu(sh.var_store().expect("snapshot").variables());
        let r = sh.train_step(&mut opt, || forward(&model, &x(dev)) * bad).expect("a non-finite step is reported, not an error");
        assert!(r.optimizer_skipped && !r.loss.is_finite(), "{r:?}");
        assert!(r.non_finite.is_some(), "the guards name it");
        assert_eq!(sh.skipped_steps(), 1);
        opt.wait().expect("host steps");
        assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &before, device.is_cuda(), "nothing stepped");
        let r = sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("training goes on");
        assert!(!r.optimizer_skipped && r.loss.is_finite());
        assert_eq!(sh.skipped_steps(), 1);
    }
}

#[test]
fn a_model_built_after_the_plan_was_made_trains_like_tch() {
    // The plan made before any layer existed (nothing streams): the layers made afterwards are
    // late blocks, kept resident with their memory taken when they are made.
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let (vs, plain) = common::seeded_on_cpu(3, dev, |vs| {
        (0..3).map(|i| nn::linear(vs.root() / "blocks" / i / "fc", D, D, Default::default())).collect::<Vec<_>>()
    });
    let mut popt = nn::Adam::default().build(&vs, 1e-2).expect("adam");
    let sh = handle(&device, 1 << 20);
    let plan = sh.prepare().expect("a plan for no model yet");
    assert!(!plan.streams());
    let model = layers(&sh);
    let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    let (mut want, mut got) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let l = forward(&plain, &x(dev));
        popt.backward_step(&l);
        want.push(l.double_value(&[]));
        got.push(sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("step").loss);
    }
    assert_losses(&got, &want, cuda);
    opt.wait().expect("host steps");
    assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &values(&vs), cuda, "built after the plan");
    let m = sh.weights().last_step_metrics();
    assert_eq!((m.h2d_bytes, m.evictions), (0, 0), "resident, nothing streams: {m:?}");
}

/// A ported tch model: four blocks of one linear each on a `ManagedVarStore` under `BUDGET`.
fn ported(device: &Device) -> (ManagedVarStore, Vec<snn::Linear>) {
    let ms = ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        LayerOptions { vram_budget: Some(BUDGET), device: Some(device.clone()), ..LayerOptions::default() },
    )
    .expect("store");
    let model = seeded(3, || (0..4).map(|i| snn::linear(ms.root() / "blocks" / i / "fc", D, D, Default::default())).collect());
    (ms, model)
}

/// A backward that fails after it queued its later blocks' host steps leaves the model part
/// stepped (those blocks hold the next step's values, the first does not). A retried step
/// would train on from it, as a caught out-of-memory is retried in PyTorch, where nothing steps
/// before `step()`. So every later use refuses it, with the failed step and its cause: the
/// next forward, the optimizer, and a checkpoint of its values.
#[test]
fn a_backward_that_fails_after_host_steps_ran_leaves_a_model_that_refuses_every_use() {
    let device = common::device();
    let dev = device.tch_device();
    let (ms, model) = ported(&device);
    let mut opt = ms.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    for _ in 0..3 {
        opt.backward_step(&forward(&model, &x(dev))).expect("step");
    }
    // After the first block, an op libtorch has no derivative for: backward fails as it
    // reaches it, after leaving the three later blocks.
    let loss = {
        let h = model[0].forward(&x(dev));
        let y = h.nextafter(&h.zeros_like());
        forward(&model[1..], &y)
    };
    let e = opt.backward_step(&loss).expect_err("backward fails");
    assert!(e.to_string().contains("not implemented"), "{e}");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("torn.safetensors");
    let e = ms.save(&path).expect_err("a part-stepped model is not saved");
    let text = e.to_string();
    assert!(text.contains("step 4 failed (") && text.contains("some of the model's values are the next step's"), "{text}");
    assert!(!path.exists(), "nothing written");
    assert!(ms.var_store().is_err(), "no copy either");
    // The next step's forward: the layer panics with the runtime's error, as layers do.
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| forward(&model, &x(dev)))).expect_err("refused");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("using the model after step 4 failed"), "{message}");
}

/// A backward that fails before it leaves any block (an op libtorch has no derivative for, just
/// before the loss) queued no host step: the model is unchanged, and the loop trains on after
/// the caught error, as PyTorch's would, to the values plain tch reaches over the steps that ran.
#[test]
fn a_backward_that_fails_before_any_host_step_leaves_a_model_that_trains_on() {
    let device = common::device();
    let dev = device.tch_device();
    let (ms, model) = ported(&device);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let plain: Vec<nn::Linear> =
        seeded(3, || (0..4).map(|i| nn::linear(vs.root() / "blocks" / i / "fc", D, D, Default::default())).collect());
    vs.set_device(dev);
    let mut plain_opt = nn::Adam::default().build(&vs, 1e-2).expect("adam");
    let mut opt = ms.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    for _ in 0..3 {
        opt.backward_step(&forward(&model, &x(dev))).expect("step");
        plain_opt.backward_step(&forward(&plain, &x(dev)));
    }
    let loss = forward(&model, &x(dev));
    let loss = loss.nextafter(&loss.zeros_like());
    let e = opt.backward_step(&loss).expect_err("backward fails");
    assert!(e.to_string().contains("not implemented"), "{e}");
    for _ in 0..2 {
        opt.backward_step(&forward(&model, &x(dev))).expect("the loop trains on");
        plain_opt.backward_step(&forward(&plain, &x(dev)));
    }
    opt.wait().expect("host steps done");
    let trained = cpu(ms.var_store().expect("a model no step tore").variables());
    assert_same(&trained, &values(&vs), device.is_cuda(), "parameters");
}

/// A layer whose computation panics (a shape libtorch refuses, an out-of-memory caught by the
/// caller) releases its block as the panic unwinds: a block left held would keep its slot from
/// every later load, until the room had none left.
#[test]
fn a_layer_that_panics_releases_its_block() {
    let device = common::device();
    let dev = device.tch_device();
    let sh = handle(&device, BUDGET);
    let model = layers(&sh);
    // Adam's state makes the blocks stream at this budget.
    let mut opt = sh.optimizer(nn::Adam::default(), 1e-2).expect("adam");
    assert!(sh.prepare().expect("plan").streams());
    let want = tch::no_grad(|| forward(&model, &x(dev))).double_value(&[]);
    // Every block's computation panics, twice: more holds than the room has slots.
    let wrong = Tensor::ones([4, D + 1], (Kind::Float, dev));
    for _ in 0..2 {
        for l in &model {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.forward(&wrong)));
            assert!(r.is_err(), "libtorch refuses the shape");
        }
    }
    let got = tch::no_grad(|| forward(&model, &x(dev))).double_value(&[]);
    assert_eq!(got, want, "the model evaluates as before");
    sh.train_step(&mut opt, || forward(&model, &x(dev))).expect("and trains");
}
