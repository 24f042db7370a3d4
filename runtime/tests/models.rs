//! Several models on one handle: a student trained against a frozen teacher under one budget,
//! one pinned pool, one room and one Conductor trains bit-identically (host device) to the two
//! models on handles of their own; the plan counts both models; telemetry names each model's
//! blocks, memory and copies; and a finished model's pinned pool is handed to the next handle
//! without pinning anything again.

use stagehand::device::Device;
use stagehand::events::{Bus, Event, EventKind, Hub};
use stagehand::nn as snn;
use stagehand::session::ModelOptions;
use stagehand::{QuantFormat, Stagehand};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 64;
const H: i64 = 256;
const LAYERS: i64 = 4;
const BATCH: i64 = 8;
const STEPS: i64 = 4;

struct Mlp(Vec<(Box<dyn Module>, Box<dyn Module>)>);

impl Mlp {
    /// `LAYERS` residual MLP blocks of width `h` at `root / "blocks" / i`, drawn from `seed`.
    fn new(root: &snn::Path<'_>, h: i64, seed: i64) -> Mlp {
        let _g = rng();
        tch::manual_seed(seed);
        Mlp((0..LAYERS)
            .map(|i| {
                let p = root / "blocks" / i;
                let up: Box<dyn Module> = Box::new(snn::linear(&p / "up", D, h, Default::default()));
                let down: Box<dyn Module> = Box::new(snn::linear(&p / "down", h, D, Default::default()));
                (up, down)
            })
            .collect())
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.0.iter().fold(x.shallow_clone(), |h, (up, down)| &h + down.forward(&up.forward(&h).gelu("none")))
    }
}

fn batches() -> Vec<Tensor> {
    let _g = rng();
    tch::manual_seed(99);
    // Drawn from the CPU generator (the same on every device), then moved where the model computes.
    let on = common::device().tch_device();
    (0..STEPS).map(|_| Tensor::randn([BATCH, D], (Kind::Float, tch::Device::Cpu)).to_device(on)).collect()
}

/// A handle with `budget` bytes beyond what the device holds already (on CUDA, libtorch's own).
fn handle(budget: u64, hub: Option<Arc<Hub>>) -> Stagehand {
    let dev = common::device();
    let above = if dev.is_cuda() { dev.memory().allocated } else { 0 };
    let b = Stagehand::builder().budget_bytes(budget + above).device(dev);
    let b = match hub {
        Some(h) => b.bus(Bus::with_hub(h, 1 << 16)),
        None => b,
    };
    b.build().expect("handle")
}

/// The student's losses and its final weights.
type Trained = (Vec<f64>, Vec<Tensor>);

fn student_weights(sh: &Stagehand) -> Vec<Tensor> {
    let mut v: Vec<(String, Tensor)> = sh.var_store().expect("snapshot").variables().into_iter().filter(|(n, _)| n.starts_with("blocks.")).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v.into_iter().map(|(_, t)| t).collect()
}

/// Teacher and student on one handle.
fn together(budget: u64, quantize: Option<QuantFormat>, events: Option<Arc<Mutex<Vec<Event>>>>) -> (Trained, Stagehand) {
    let hub = events.map(|e| {
        let hub = Arc::new(Hub::new());
        hub.add_sink(Box::new(common::EventLog(e)));
        hub
    });
    let sh = handle(budget, hub);
    let opts = match quantize {
        Some(f) => ModelOptions::frozen().quantized(f),
        None => ModelOptions::frozen(),
    };
    let teacher = Mlp::new(&sh.model("teacher", opts).expect("teacher"), 2 * H, 1);
    let student = Mlp::new(&sh.root(), H, 2);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-3).expect("optimizer");
    let mut losses = Vec::new();
    for x in batches() {
        let r = sh
            .train_step(&mut opt, || {
                let target = tch::no_grad(|| teacher.forward(&x));
                student.forward(&x).mse_loss(&target, tch::Reduction::Mean)
            })
            .expect("step");
        losses.push(r.loss);
    }
    opt.wait().expect("host steps");
    ((losses, student_weights(&sh)), sh)
}

/// The teacher on a handle of its own (evaluating), the student on another (training).
fn apart(budget: u64) -> Trained {
    let sht = handle(budget, None);
    let teacher = Mlp::new(&sht.model("teacher", ModelOptions::frozen()).expect("teacher"), 2 * H, 1);
    let shs = handle(budget, None);
    let student = Mlp::new(&shs.root(), H, 2);
    let mut opt = shs.optimizer(nn::AdamW::default(), 1e-3).expect("optimizer");
    let mut losses = Vec::new();
    for x in batches() {
        let target = tch::no_grad(|| teacher.forward(&x));
        let r = shs.train_step(&mut opt, || student.forward(&x).mse_loss(&target, tch::Reduction::Mean)).expect("step");
        losses.push(r.loss);
    }
    opt.wait().expect("host steps");
    (losses, student_weights(&shs))
}

#[test]
fn two_models_on_one_handle_train_as_on_two() {
    // Bit for bit on the host device; on CUDA within the rounding of kernels that may sum in
    // another order, and the scheduling checks (exact there) left to the GPU benchmark.
    let cuda = common::device().is_cuda();
    let budget = 3 << 20;
    let events = Arc::new(Mutex::new(Vec::new()));
    let ((losses, weights), sh) = together(budget, None, Some(events.clone()));
    let (losses2, weights2) = apart(budget);
    if cuda {
        assert!(losses.iter().zip(&losses2).all(|(a, b)| (a - b).abs() <= 1e-4 * a.abs()), "{losses:?} against {losses2:?}");
    } else {
        assert_eq!(losses, losses2, "the student's losses, bit for bit");
    }
    assert_eq!(weights.len(), weights2.len());
    for (a, b) in weights.iter().zip(&weights2) {
        let same = if cuda { a.allclose(b, 1e-4, 1e-6, false) } else { a.equal(b) };
        assert!(same, "the student's weights");
    }
    assert!(losses.last() < losses.first(), "the student learns: {losses:?}");

    // One plan for both: the teacher's blocks stream beside the student's through one room.
    let plan = sh.plan().expect("plan");
    assert!(plan.streams(), "{:?}", plan.reasons);
    let names: Vec<&str> = plan.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["main", "teacher"], "{:?}", plan.models);
    assert!(plan.models.iter().all(|m| m.blocks == LAYERS as u32 && m.predicted_h2d_bytes > 0), "{:?}", plan.models);
    assert!(plan.reasons.iter().any(|l| l.contains("model 'teacher'")), "{:?}", plan.reasons);
    // The teacher trains nothing: no gradient buffer, no optimizer state, frozen variables.
    let frozen = sh.var_store().expect("snapshot").variables();
    assert!(frozen.iter().filter(|(n, _)| n.starts_with("teacher.")).all(|(_, t)| !t.requires_grad()));

    // Telemetry: each model's blocks, its memory, its share of the copies.
    let events = events.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let registered: Vec<(String, usize, bool)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ModelRegistered { model, blocks, frozen, .. } => Some((model.clone(), blocks.len(), *frozen)),
            _ => None,
        })
        .collect();
    assert_eq!(registered, [("main".to_string(), LAYERS as usize, false), ("teacher".to_string(), LAYERS as usize, true)]);
    // The host optimizer reports each step it took, of the student's blocks alone.
    let trained: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::BlockRegistered { block, trainable: true, .. } => Some(*block),
            _ => None,
        })
        .collect();
    let stepped: Vec<_> = events.iter().filter_map(|e| if let EventKind::HostStep { block, .. } = e.kind { Some(block) } else { None }).collect();
    assert!(stepped.len() >= STEPS as usize, "a host step reported for each block stepped: {stepped:?}");
    assert!(stepped.iter().all(|b| trained.contains(b)), "only trained blocks: {stepped:?} of {trained:?}");
    let memory = events.iter().filter(|e| matches!(e.kind, EventKind::ModelMemory { .. })).count();
    assert!(memory >= 3 * STEPS as usize, "model memory beside every vram_owners reading: {memory}");
    let steps: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::WeightStep(m) => Some(m.clone()),
            _ => None,
        })
        .collect();
    for m in &steps[1..] {
        assert_eq!(m.models.len(), 2, "{m:?}");
        assert_eq!(m.models.iter().map(|s| s.h2d_bytes).sum::<u64>(), m.h2d_bytes, "the models' copies add up");
        let share: u64 = m.models.iter().map(|s| s.min_h2d_bytes).sum();
        assert!(share <= m.min_h2d_bytes && m.min_h2d_bytes - share < m.models.len() as u64, "the shares of the minimum add up: {m:?}");
        assert!(m.models.iter().all(|s| s.loads > 0), "both models stream: {m:?}");
    }
    // Once the step after the traced one has settled the room, the weights move exactly the
    // Belady minimum of the combined itinerary, each model its own share (on the host device,
    // where copies land at once; on CUDA the two-models benchmark measures it).
    for m in steps[2..].iter().filter(|_| !cuda) {
        assert_eq!(m.h2d_bytes, m.min_h2d_bytes, "{m:?}");
        assert!(m.models.iter().all(|s| s.h2d_bytes == s.min_h2d_bytes), "{m:?}");
        // The plan predicted each model's share from the step's usual order (the teacher's
        // forward, then the student's forward and backward), which this step runs.
        for (s, share) in m.models.iter().zip(&plan.models) {
            assert_eq!((s.model.as_str(), s.min_h2d_bytes), (share.name.as_str(), share.predicted_h2d_bytes), "{m:?} {:?}", plan.models);
        }
    }
    drop(sh);

    // A model declared after the model ran, or twice, or under the main model's name, is refused.
    let sh = handle(budget, None);
    let _t = Mlp::new(&sh.model("teacher", ModelOptions::frozen()).expect("teacher"), H, 1);
    let e = sh.model("teacher", ModelOptions::frozen()).expect_err("twice");
    assert!(e.to_string().contains("twice"), "{e}");
    assert!(sh.model("main", ModelOptions::frozen()).is_err());
    assert!(sh.model("a.b", ModelOptions::frozen()).is_err());
    sh.prepare().expect("plan");
    let e = sh.model("late", ModelOptions::frozen()).expect_err("late");
    assert!(e.to_string().contains("before the first step"), "{e}");
}

#[test]
fn a_quantized_teacher_streams_its_payload_beside_the_student() {
    let events = Arc::new(Mutex::new(Vec::new()));
    let ((losses, _), sh) = together(3 << 20, Some(QuantFormat::Int8), Some(events.clone()));
    assert!(losses.iter().all(|l| l.is_finite()) && losses.last() < losses.first(), "{losses:?}");
    let plan = sh.plan().expect("plan");
    assert_eq!(plan.quantization.len(), LAYERS as usize, "the teacher's blocks, quantized");
    let main = plan.models.iter().find(|m| m.name == "main").expect("main");
    let teacher = plan.models.iter().find(|m| m.name == "teacher").expect("teacher");
    // The teacher is twice as wide as the student, and quantized: its host bytes are its
    // payloads', fewer than the student's float32 copies with their gradient buffers.
    let payload: u64 = plan.quantization.iter().map(|r| r.quantized_bytes).sum();
    assert_eq!(teacher.host_bytes, payload, "{teacher:?}");
    assert!(teacher.host_bytes < main.host_bytes, "{teacher:?} against {main:?}");
    let registered = events.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|e| {
        matches!(&e.kind, EventKind::ModelRegistered { model, quantized: Some(QuantFormat::Int8), .. } if model == "teacher")
    });
    assert!(registered);
}

#[test]
fn a_finished_models_pool_serves_the_next_without_pinning() {
    let dev = common::device();
    let train = |sh: &Stagehand, seed: i64| -> Vec<f64> {
        let m = Mlp::new(&sh.root(), H, seed);
        let mut opt = sh.optimizer(nn::AdamW::default(), 1e-3).expect("optimizer");
        let losses = batches()
            .iter()
            .map(|x| sh.train_step(&mut opt, || m.forward(x).square().mean(Kind::Float)).expect("step").loss)
            .collect();
        opt.wait().expect("host steps");
        losses
    };
    let budget = (3 << 20) + if dev.is_cuda() { dev.memory().allocated } else { 0 };
    let first = Stagehand::builder().budget_bytes(budget).device(dev.clone()).build().expect("first");
    let _ = train(&first, 5);
    let pool = first.shutdown_keep_pool().expect("keep the pool");
    let held = pool.stats();
    assert!(held.pinned_bytes > 0 && held.in_use_bytes == 0, "every block gave its memory back: {held:?}");
    drop(first);

    // The next model (the same shapes) is cut from the handed pool: nothing pinned again.
    let second = Stagehand::builder().budget_bytes(budget).device(Device::auto(3 << 20)).host_pool(pool.clone()).build().expect("second");
    let losses = train(&second, 6);
    let after = pool.stats();
    assert_eq!((after.chunks, after.pinned_bytes), (held.chunks, held.pinned_bytes), "no chunk pinned for the second model");
    assert!(after.served_bytes >= held.served_bytes + after.in_use_bytes, "{held:?} -> {after:?}");
    // And it trains as on a pool of its own.
    let fresh = Stagehand::builder().budget_bytes(budget).device(Device::auto(3 << 20)).build().expect("fresh");
    let again = train(&fresh, 6);
    let cuda = dev.is_cuda();
    assert!(losses.iter().zip(&again).all(|(a, b)| if cuda { (a - b).abs() <= 1e-4 * a.abs() } else { a == b }), "a handed pool changes nothing the model computes: {losses:?} against {again:?}");
}
