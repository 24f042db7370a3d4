//! Quantized frozen weights: adapters trained over a quantized base compute exactly what they
//! compute over the same base dequantized (bit for bit on the host device), the base streams at
//! its payload's width, each block's quantization error is reported (event and plan) within the
//! stated bound, trained weights are never quantized, a quantized file reads back as it was
//! saved, and a checkpoint holds the dequantized base the model computes with.

use stagehand::device::Device;
use stagehand::events::{Bus, Event, EventKind, Hub};
use stagehand::nn as snn;
use stagehand::session::ModelOptions;
use stagehand::weights::quant::error_bound;
use stagehand::weights::{WeightConfig, WeightRuntime};
use stagehand::{Precision, QuantFormat, Stagehand};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 128;
const H: i64 = 256;
const RANK: i64 = 4;
const LAYERS: i64 = 6;
const BATCH: i64 = 16;
const STEPS: usize = 5;
/// Streams the base: room for a few of its six blocks.
const BUDGET: u64 = 2 << 20;

/// `above` bytes of budget beyond what the device holds already (on CUDA, libtorch's own).
fn budget(dev: &Device, above: u64) -> u64 {
    above + if dev.is_cuda() { dev.memory().allocated } else { 0 }
}

struct Adapted {
    base: Vec<(Box<dyn Module>, Box<dyn Module>)>,
    lora: Vec<(nn::Linear, nn::Linear)>,
}

impl Adapted {
    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for ((fc1, fc2), (a, b)) in self.base.iter().zip(&self.lora) {
            h = &h + fc2.forward(&fc1.forward(&h).gelu("none")) * 0.5 + b.forward(&a.forward(&h));
        }
        h
    }
}

/// The base (a frozen model "base", quantized in `format` when given) and trainable low-rank
/// adapters beside it (tch layers on the root: they live on the device and train there).
fn build(sh: &Stagehand, format: Option<QuantFormat>) -> Adapted {
    build_seeded(sh, format, 7)
}

/// [`build`], the base drawn from `seed`.
fn build_seeded(sh: &Stagehand, format: Option<QuantFormat>, seed: i64) -> Adapted {
    let _g = rng();
    let opts = match format {
        Some(f) => ModelOptions::frozen().quantized(f),
        None => ModelOptions::frozen(),
    };
    let base = sh.model("base", opts).expect("base model");
    tch::manual_seed(seed);
    let blocks = (0..LAYERS)
        .map(|i| {
            let p = &base / "blocks" / i;
            let fc1: Box<dyn Module> = Box::new(snn::linear(&p / "fc1", D, H, Default::default()));
            let fc2: Box<dyn Module> = Box::new(snn::linear(&p / "fc2", H, D, Default::default()));
            (fc1, fc2)
        })
        .collect();
    let root = sh.root();
    let lora = (0..LAYERS)
        .map(|i| {
            let p = &*root / "lora" / i;
            let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
            let b = nn::LinearConfig { ws_init: nn::Init::Const(0.0), bias: false, ..Default::default() };
            (nn::linear(&p / "a", D, RANK, no_bias), nn::linear(&p / "b", RANK, D, b))
        })
        .collect();
    Adapted { base: blocks, lora }
}

struct Run {
    losses: Vec<f64>,
    h2d: Vec<u64>,
    adapters: Vec<Tensor>,
    base: Vec<(String, Tensor)>,
    events: Vec<Event>,
    plan: stagehand::Plan,
}

/// Trains the adapters `STEPS` steps; `base_values` (a checkpoint) replaces the base's values
/// before the model first runs.
fn train(precision: Precision, format: Option<QuantFormat>, base_values: Option<&std::path::Path>) -> Run {
    // A device of its own: the host device accounts a runtime's room for as long as it lives.
    let dev = &common::device();
    let hub = Arc::new(Hub::new());
    let events = Arc::new(Mutex::new(Vec::new()));
    hub.add_sink(Box::new(common::EventLog(events.clone())));
    let sh = Stagehand::builder()
        .budget_bytes(budget(dev, BUDGET))
        .device(dev.clone())
        .bus(Bus::with_hub(hub, 1 << 16))
        .precision(precision)
        .build()
        .expect("handle");
    let model = build(&sh, format);
    if let Some(file) = base_values {
        sh.load_partial(file).expect("the dequantized base");
    }
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
    let (x, y) = {
        let _g = rng();
        tch::manual_seed(11);
        let x = Tensor::randn([STEPS as i64, BATCH, D], (Kind::Float, dev.tch_device()));
        let y = x.sin();
        (x, y)
    };
    let mut losses = Vec::new();
    let mut h2d = Vec::new();
    for s in 0..STEPS as i64 {
        let r = sh.train_step(&mut opt, || model.forward(&x.get(s)).to_kind(Kind::Float).mse_loss(&y.get(s), tch::Reduction::Mean)).expect("step");
        losses.push(r.loss);
        h2d.push(sh.weights().last_step_metrics().h2d_bytes);
    }
    opt.wait().expect("host steps");
    let plan = sh.plan().expect("plan");
    let adapters = model.lora.iter().flat_map(|(a, b)| [a.ws.to_device(tch::Device::Cpu), b.ws.to_device(tch::Device::Cpu)]).collect();
    let snapshot = sh.var_store().expect("snapshot");
    let mut base: Vec<(String, Tensor)> = snapshot.variables().into_iter().filter(|(n, _)| n.starts_with("base.")).collect();
    base.sort_by(|a, b| a.0.cmp(&b.0));
    sh.finish().expect("finish");
    let events = events.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Run { losses, h2d, adapters, base, events, plan }
}

#[test]
fn adapters_over_a_quantized_base_train_exactly_as_over_the_dequantized_base() {
    // Bit for bit on the host device; on CUDA (a dequantization racing its own payload, or
    // reading a payload not landed, would show as a base far from the dequantized one) within
    // the rounding of kernels that may sum in another order.
    let cuda = common::device().is_cuda();
    let close = |a: f64, b: f64| if cuda { (a - b).abs() <= 1e-4 * a.abs().max(1e-6) } else { a == b };
    let dir = tempfile::tempdir().expect("dir");
    for (precision, format) in [(Precision::Fp32, QuantFormat::Int8), (Precision::Bf16, QuantFormat::Int8), (Precision::Fp32, QuantFormat::Fp8E4m3)] {
        let q = train(precision, Some(format), None);
        assert!(q.plan.streams(), "{precision}: the base streams ({:?})", q.plan.reasons);
        // The dequantized base, as the quantized run's snapshot reads it, loaded into a base
        // that is not quantized.
        let file = dir.path().join(format!("base-{precision}-{format}.safetensors"));
        let named: Vec<(String, Tensor)> = q.base.iter().map(|(n, t)| (n.clone(), t.contiguous())).collect();
        Tensor::write_safetensors(&named, &file).expect("save the dequantized base");
        let full = train(precision, None, Some(&file));
        for ((n, a), (m, b)) in q.base.iter().zip(&full.base) {
            assert_eq!(n, m);
            assert!(a.equal(b), "{precision} {format}: base '{n}' is the dequantized one in both runs");
        }
        assert!(q.losses.iter().zip(&full.losses).all(|(a, b)| close(*a, *b)), "{precision} {format}: the losses {:?} against {:?}", q.losses, full.losses);
        for (a, b) in q.adapters.iter().zip(&full.adapters) {
            let same = if cuda { a.allclose(b, 1e-4, 1e-6, false) } else { a.equal(b) };
            assert!(same, "{precision} {format}: the trained adapters");
        }
        assert!(q.losses.last() < q.losses.first(), "{precision} {format}: the adapters learn: {:?}", q.losses);

        // The quantized base moves its payload: as many loads as the full-width base, each of
        // its payload's bytes.
        let report = &q.plan.quantization;
        assert_eq!(report.len(), LAYERS as usize, "{precision}: one report a base block");
        let (payload, width) = (report[0].quantized_bytes, report[0].full_bytes);
        assert!(payload * 2 < width + width / 8, "{precision} {format}: {payload} of {width} bytes");
        for (s, (&a, &b)) in q.h2d.iter().zip(&full.h2d).enumerate() {
            assert!(a > 0, "step {s} loads blocks");
            assert_eq!(a * width, b * payload, "step {s}: the same loads, at the payload's width ({a} against {b} bytes)");
        }
        let kind = precision.compute_kind().unwrap_or(Kind::Float);
        for r in report {
            assert!(r.max_rel_error > 0.0 && r.max_rel_error <= error_bound(format, kind), "{r:?}");
            assert_eq!((r.format, r.quantized_params, r.params), (format, 2, 4), "{r:?}");
        }
        assert!(q.plan.reasons.iter().any(|l| l.contains("quantized to")), "{:?}", q.plan.reasons);
        // The telemetry: one `quantized` event a block, the base declared as a quantized model.
        let events: Vec<_> = q.events.iter().filter_map(|e| match &e.kind {
            EventKind::Quantized(r) => Some(r.clone()),
            _ => None,
        }).collect();
        assert_eq!(&events, report, "the events report what the plan does");
    }
}

#[test]
fn trained_weights_are_never_quantized() {
    let dev = common::device();
    let sh = Stagehand::builder().budget_bytes(budget(&dev, BUDGET)).device(dev.clone()).build().expect("handle");
    let e = sh.model("student", ModelOptions::trained().quantized(QuantFormat::Int8)).expect_err("a trained model quantized");
    assert!(e.to_string().contains("never quantized"), "{e}");

    // Block mode: a trainable block refuses, a frozen one quantizes. The layers draw from the
    // global generator: under its lock, or a test beside this one seeding it draws other values.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    {
        let _g = rng();
        let _a = nn::linear(vs.root() / "blocks" / 0 / "fc", D, H, Default::default());
        let _b = nn::linear(vs.root() / "blocks" / 1 / "fc", D, H, Default::default());
    }
    // Block 1 frozen, block 0 trains.
    for (n, t) in vs.variables() {
        if n.starts_with("blocks.1.") {
            let _ = t.set_requires_grad(false);
        }
    }
    let cfg = WeightConfig::builder().weight_budget(1 << 20).build().expect("config");
    let rt = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", Device::host(1 << 24), cfg, Bus::disabled()).expect("runtime");
    let e = rt.quantize(rt.block_id("blocks.0").expect("id"), QuantFormat::Int8).expect_err("trainable");
    assert!(e.to_string().contains("never quantized") && e.to_string().contains("blocks.0.fc.weight"), "{e}");
    let r = rt.quantize(rt.block_id("blocks.1").expect("id"), QuantFormat::Int8).expect("frozen");
    assert_eq!(r.quantized_params, 1);
    let e = rt.quantize(rt.block_id("blocks.1").expect("id"), QuantFormat::Int8).expect_err("twice");
    assert!(e.to_string().contains("again"), "{e}");
    rt.shutdown().expect("shutdown");
}

/// A frozen stack of `n` blocks drawn from `seed`, in a plain VarStore.
fn seeded(seed: i64, n: i64) -> nn::VarStore {
    let _g = rng();
    tch::manual_seed(seed);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    for i in 0..n {
        let _ = nn::linear(vs.root() / "blocks" / i / "fc", D, H, Default::default());
    }
    vs.freeze();
    vs
}

/// [`seeded`], its blocks in a block-mode runtime.
fn frozen_stack(seed: i64, n: i64) -> (nn::VarStore, WeightRuntime) {
    let vs = seeded(seed, n);
    let cfg = WeightConfig::builder().weight_budget(1 << 20).build().expect("config");
    let rt = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", Device::host(1 << 24), cfg, Bus::disabled()).expect("runtime");
    (vs, rt)
}

fn values(rt: &WeightRuntime) -> Vec<Tensor> {
    rt.blocks().iter().flat_map(|b| (0..b.params.len()).map(move |j| (b.id, j))).map(|(id, j)| rt.host_param(id, j).expect("value")).collect()
}

#[test]
fn a_quantized_file_reads_back_as_it_was_saved() {
    let dir = tempfile::tempdir().expect("dir");
    for format in QuantFormat::ALL {
        let (_vs, rt) = frozen_stack(1, 3);
        let reports: Vec<_> = rt.blocks().iter().map(|b| rt.quantize(b.id, format).expect("quantize")).collect();
        let file = dir.path().join(format!("q-{format}.safetensors"));
        rt.save_quantized(&file).expect("save");
        // Another stack of the same shapes, other values: it takes the file's as they are.
        let (_vs2, rt2) = frozen_stack(2, 3);
        let read: Vec<_> = rt2.blocks().iter().map(|b| rt2.quantize_from_file(b.id, &file, "", QuantFormat::Int8).expect("read")).collect();
        for (a, b) in values(&rt).iter().zip(values(&rt2).iter()) {
            assert!(a.equal(b), "{format}: a value read back differs");
        }
        assert_eq!(reports, read, "{format}: the file carries each block's error and its own format");

        // A full-width file is quantized as it is read, as the host copy would have been.
        let full = dir.path().join("full.safetensors");
        seeded(1, 3).save(&full).expect("full-width file");
        let (_vs3, rt3) = frozen_stack(1, 3);
        let (_vs4, rt4) = frozen_stack(3, 3);
        for (b3, b4) in rt3.blocks().iter().zip(rt4.blocks()) {
            assert_eq!(rt3.quantize(b3.id, format).expect("host"), rt4.quantize_from_file(b4.id, &full, "", format).expect("file"));
        }
        for (a, b) in values(&rt3).iter().zip(values(&rt4).iter()) {
            assert!(a.equal(b), "{format}: quantizing a file's values equals quantizing the same values in memory");
        }
    }
    // A file that lies is refused, and the block is left as it was.
    let (_vs, rt) = frozen_stack(1, 1);
    rt.quantize(rt.block_id("blocks.0").expect("id"), QuantFormat::Int8).expect("quantize");
    let file = dir.path().join("q.safetensors");
    rt.save_quantized(&file).expect("save");
    let bytes = std::fs::read(&file).expect("read");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("file");
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for (n, _, _, data) in &mut owned {
        if n.ends_with("@scales") {
            // Every float32 scale negative: its sign bit set.
            data.chunks_mut(4).for_each(|f| f[3] |= 0x80);
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, data)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), data).expect("view")))
        .collect();
    let bad = dir.path().join("bad.safetensors");
    safetensors::serialize_to_file(views, meta.metadata().clone(), &bad).expect("write");
    let (_vs2, rt2) = frozen_stack(2, 1);
    let before = values(&rt2);
    let e = rt2.quantize_from_file(rt2.block_id("blocks.0").expect("id"), &bad, "", QuantFormat::Int8).expect_err("negative scales");
    assert!(e.to_string().contains("bad.safetensors") && e.to_string().contains("negative"), "{e}");
    for (a, b) in before.iter().zip(values(&rt2).iter()) {
        assert!(a.equal(b), "a refused file changes nothing");
    }
}

fn base_values(sh: &Stagehand) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = sh.var_store().expect("snapshot").variables().into_iter().filter(|(n, _)| n.starts_with("base.")).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn a_quantized_model_saves_its_payloads_and_loads_them_back_as_they_are() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("base.int8.safetensors");
    let a = {
        let dev = common::device();
        Stagehand::builder().budget_bytes(budget(&dev, BUDGET)).device(dev).build().expect("handle")
    };
    let _ma = build_seeded(&a, Some(QuantFormat::Int8), 3);
    a.prepare().expect("plan");
    a.save_quantized(&file).expect("save");
    let reports = a.plan().expect("plan").quantization;
    // Another handle, another base drawn, the file read back as it is: the same payloads, the
    // same reported errors (they were measured against the first base's values).
    let b = {
        let dev = common::device();
        Stagehand::builder().budget_bytes(budget(&dev, BUDGET)).device(dev).build().expect("handle")
    };
    let _mb = build_seeded(&b, Some(QuantFormat::Int8), 4);
    let before = base_values(&b);
    let read = b.load_quantized(&file).expect("load");
    assert_eq!(read, reports);
    let (va, vb) = (base_values(&a), base_values(&b));
    assert!(va.iter().zip(&vb).all(|((n, x), (m, y))| n == m && x.equal(y)), "the file's values");
    assert!(!before.iter().zip(&vb).all(|((_, x), (_, y))| x.equal(y)), "replaced the drawn ones");
    // A model stored otherwise refuses the file's format.
    let c = {
        let dev = common::device();
        Stagehand::builder().budget_bytes(budget(&dev, BUDGET)).device(dev).build().expect("handle")
    };
    let _mc = build_seeded(&c, Some(QuantFormat::Fp8E4m3), 4);
    let e = c.load_quantized(&file).expect_err("int8 into fp8");
    assert!(e.to_string().contains("int8") && e.to_string().contains("fp8_e4m3"), "{e}");
}

#[test]
fn a_checkpoint_holds_the_dequantized_base_which_a_full_width_base_loads_as_it_is() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("adapted.safetensors");
    let handle = || {
        let dev = common::device();
        Stagehand::builder().budget_bytes(budget(&dev, BUDGET)).device(dev).build().expect("handle")
    };
    let q = handle();
    let _mq = build_seeded(&q, Some(QuantFormat::Int8), 5);
    q.prepare().expect("plan");
    q.save(&file).expect("save");
    let dequantized = base_values(&q);
    // The same base drawn at full width: what quantizing lost.
    let full = handle();
    let _mf = build_seeded(&full, None, 5);
    let original = base_values(&full);
    let saved: Vec<(String, Tensor)> = {
        let mut v: Vec<_> = Tensor::read_safetensors(&file).expect("read").into_iter().filter(|(n, _)| n.starts_with("base.")).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(saved.len(), dequantized.len());
    for ((n, s), (m, d)) in saved.iter().zip(&dequantized) {
        assert_eq!(n, m);
        assert!(s.equal(d), "{n}: the checkpoint holds the values the model computes with");
    }
    assert!(saved.iter().zip(&original).any(|((_, s), (_, o))| !s.equal(o)), "the INT8 base differs from the full-width one it came from");
    // Loaded into a full-width base, the checkpoint gives it the dequantized values exactly.
    full.load(&file).expect("load into the full-width base");
    for ((n, a), (_, b)) in base_values(&full).iter().zip(&dequantized) {
        assert!(a.equal(b), "{n}");
    }
}
