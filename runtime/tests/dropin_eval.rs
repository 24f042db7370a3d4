//! Evaluation and sampling through the handle, written as a tch user writes them: a minGPT-style
//! model with a head tied to the token embedding and dropout (`ModuleT`), trained through
//! `train_step`, evaluated every few steps on held-out data under `tch::no_grad` with
//! `train = false`, and sampled token by token with a plain forward outside any step (as
//! min-gpt's `sample` does, gradients on). On the host device, the losses, the evaluation
//! losses, the sampled tokens and every parameter are bit-identical to the plain tch program
//! while blocks stream; telemetry marks evaluations as their own phase and never counts them as
//! training steps; evaluation forwards are prefetched along their own itinerary.

use stagehand::device::Device;
use stagehand::events::{Bus, Event, EventKind, EvaluationMetrics, Hub, Phase};
use stagehand::nn as snn;
use stagehand::optim::Kernel;
use stagehand::Stagehand;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{IndexOp, Kind, Tensor};

mod common;
use common::dropin::{Tied, assert_losses, assert_same, cpu, values};
use common::rng;

const V: i64 = 32;
const D: i64 = 32;
const HEADS: i64 = 4;
const T: i64 = 8;
const LAYERS: i64 = 4;
const BATCH: i64 = 4;
const STEPS: i64 = 6;
const EVAL_EVERY: i64 = 2;
const SAMPLES: usize = 6;
const DROPOUT: f64 = 0.1;
const BUDGET: u64 = 512 << 10;

#[derive(Debug)]
struct Block {
    ln1: Box<dyn Module>,
    qkv: Box<dyn Module>,
    proj: Box<dyn Module>,
    ln2: Box<dyn Module>,
    fc: Box<dyn Module>,
    out: Box<dyn Module>,
}

impl Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let (b, t, c) = x.size3().expect("[batch, time, channels]");
        let heads = |y: &Tensor| y.view([b, t, HEADS, c / HEADS]).transpose(1, 2);
        let qkv = self.qkv.forward(&self.ln1.forward(x)).split(c, 2);
        let (q, k, v) = (heads(&qkv[0]), heads(&qkv[1]), heads(&qkv[2]));
        let mask = Tensor::ones([t, t], (Kind::Float, x.device())).tril(0).view([1, 1, t, t]);
        let att = (q.matmul(&k.transpose(-2, -1)) * (1.0 / ((c / HEADS) as f64).sqrt()))
            .masked_fill(&mask.eq(0.), f64::NEG_INFINITY)
            .softmax(-1, Kind::Float)
            .dropout(DROPOUT, train);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        let x = x + self.proj.forward(&y).dropout(DROPOUT, train);
        &x + self.out.forward(&self.fc.forward(&self.ln2.forward(&x)).gelu("none")).dropout(DROPOUT, train)
    }
}

#[derive(Debug)]
struct Gpt {
    tok: Box<dyn Tied>,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
}

impl ModuleT for Gpt {
    fn forward_t(&self, ids: &Tensor, train: bool) -> Tensor {
        let t = ids.size()[1];
        let mut x = (self.tok.embed(ids) + self.pos.narrow(1, 0, t)).dropout(DROPOUT, train);
        for b in &self.blocks {
            x = b.forward_t(&x, train);
        }
        self.tok.logits(&self.ln_f.forward(&x))
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
                    ln1: Box::new($lib::layer_norm(&b / "ln1", vec![D], Default::default())),
                    // No bias on the projections: the keys' part of it shifts every score of a
                    // query alike, which the softmax removes, so its gradient is zero in exact
                    // arithmetic and AdamW steps it by rounding noise, which differs between two
                    // runs' kernels on CUDA (a third of the bias apart after a few steps).
                    qkv: Box::new($lib::linear(&b / "qkv", D, 3 * D, nn::LinearConfig { bias: false, ..Default::default() })),
                    proj: Box::new($lib::linear(&b / "proj", D, D, Default::default())),
                    ln2: Box::new($lib::layer_norm(&b / "ln2", vec![D], Default::default())),
                    fc: Box::new($lib::linear(&b / "fc", D, 4 * D, Default::default())),
                    out: Box::new($lib::linear(&b / "out", 4 * D, D, Default::default())),
                }
            })
            .collect();
        let ln_f = nn::layer_norm(&p / "ln_f", vec![D], Default::default());
        Gpt { tok: Box::new(tok), pos, blocks, ln_f }
    }};
}

fn batch(seed: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(seed);
    let ids = Tensor::randint(V, [BATCH, T], (Kind::Int64, tch::Device::Cpu));
    (ids.to_device(dev), ids.roll([-1], [1]).to_device(dev))
}

fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits.view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
}

/// min-gpt's `sample`: a plain forward per token (gradients on, `train = false`), the last
/// position's logits, a multinomial draw, the window moved on by one.
fn sample(gpt: &impl ModuleT, dev: tch::Device) -> Vec<i64> {
    let mut input = Tensor::zeros([1, T], (Kind::Int64, dev));
    let mut out = Vec::new();
    for _ in 0..SAMPLES {
        let logits = input.apply_t(gpt, false).i((0, -1, ..));
        let y = logits.softmax(-1, Kind::Float).multinomial(1, true);
        out.push(y.int64_value(&[0]));
        input = Tensor::cat(&[input, y.view([1, 1])], 1).narrow(1, 1, T);
    }
    out
}

/// What a run produced: training losses, evaluation losses, sampled tokens.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f64>,
    evals: Vec<f64>,
    samples: Vec<Vec<i64>>,
}

/// The held-out batch and each step's batch, on the device for the whole test: on CUDA the
/// plan counts what the device holds when it is made, so the budgets a guide states hold for a
/// handle planned later only if the data was there for both.
struct Data {
    held_out: (Tensor, Tensor),
    steps: Vec<(Tensor, Tensor)>,
}

fn data(dev: tch::Device) -> Data {
    Data { held_out: batch(77, dev), steps: (0..STEPS).map(|s| batch(1000 + s, dev)).collect() }
}

/// The loop: a training step (`step` takes the batch), and every few steps an evaluation under
/// `no_grad` and sampling. Every forward draws dropout masks and samples from libtorch's RNG,
/// seeded the same way in both programs.
fn run(gpt: &Gpt, d: &Data, dev: tch::Device, mut step: impl FnMut(&Tensor, &Tensor) -> f64) -> Run {
    let mut r = Run { losses: Vec::new(), evals: Vec::new(), samples: Vec::new() };
    let (vx, vy) = &d.held_out;
    for (s, (x, y)) in (0..STEPS).zip(&d.steps) {
        r.losses.push({
            let _g = rng();
            tch::manual_seed(2000 + s);
            step(x, y)
        });
        if s % EVAL_EVERY == EVAL_EVERY - 1 {
            let _g = rng();
            r.evals.push(tch::no_grad(|| loss(&gpt.forward_t(vx, false), vy).double_value(&[])));
            tch::manual_seed(3000 + s);
            r.samples.push(sample(gpt, dev));
        }
    }
    r
}

/// A handle with `budget` bytes in all (on CUDA counting what the device holds already, as the
/// sizes a plan states do).
fn handle(device: &Device, budget: u64, bus: Bus) -> Stagehand {
    let cuda = device.is_cuda();
    Stagehand::builder()
        .budget_bytes(budget)
        .device(if cuda { device.clone() } else { Device::host(budget) })
        .kernel(Kernel::Exact)
        .bus(bus)
        .build()
        .expect("handle")
}

/// The loop through the handle at `budget`, with every event it published.
fn through_the_handle(device: &Device, d: &Data, budget: u64) -> (Run, Vec<Event>, Stagehand, stagehand::optim::Optimizer) {
    let dev = device.tch_device();
    let events = Arc::new(Mutex::new(Vec::new()));
    let hub = Arc::new(Hub::new());
    hub.add_sink(Box::new(common::EventLog(events.clone())));
    let bus = Bus::with_hub(hub, 1 << 20);
    let sh = handle(device, budget, bus.clone());
    let model = {
        let _g = rng();
        tch::manual_seed(21);
        gpt!(sh.root(), snn)
    };
    let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3).expect("adamw");
    let got = run(&model, d, dev, |x, y| {
        sh.train_step(&mut opt, || loss(&model.forward_t(x, true), y))
            .unwrap_or_else(|e| panic!("budget {budget}: {e}"))
            .loss
    });
    sh.finish().expect("finish");
    bus.flush();
    let events = events.lock().expect("events").clone();
    (got, events, sh, opt)
}

#[test]
fn a_tied_gpt_evaluates_and_samples_through_the_handle_like_tch_at_every_budget() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();

    let d = data(dev);
    let (vs, plain) = common::seeded_on_cpu(21, dev, |vs| gpt!(vs.root(), nn));
    let mut popt = nn::AdamW::default().build(&vs, 3e-3).expect("adamw");
    let want = run(&plain, &d, dev, |x, y| {
        let l = loss(&plain.forward_t(x, true), y);
        popt.backward_step(&l);
        l.double_value(&[])
    });
    let trained = values(&vs);

    // From the smallest budget the plan states to past the one where nothing streams.
    let held = if cuda { device.memory().allocated } else { 0 };
    let guide = {
        let sh = handle(&device, held + (1 << 10), Bus::disabled());
        let _model = {
            let _g = rng();
            tch::manual_seed(21);
            gpt!(sh.root(), snn)
        };
        let _opt = sh.optimizer(nn::AdamW::default(), 3e-3).expect("adamw");
        sh.budget_guide().expect("guide")
    };
    let mut budgets = vec![guide.minimum_bytes, guide.full_window_bytes, held + BUDGET, guide.resident_bytes, guide.resident_bytes * 2];
    budgets.extend((1..4).map(|k| guide.minimum_bytes + (guide.resident_bytes - guide.minimum_bytes) * k / 4));
    budgets.sort_unstable();
    budgets.dedup();
    for budget in budgets {
        let (got, events, sh, opt) = through_the_handle(&device, &d, budget);
        let plan = sh.plan().expect("plan");
        assert_eq!(plan.streams(), budget < guide.resident_bytes, "budget {budget}");
        assert_losses(&got.losses, &want.losses, cuda);
        assert_losses(&got.evals, &want.evals, cuda);
        if !cuda {
            assert_eq!(got.samples, want.samples, "budget {budget}: sampled tokens");
        }
        opt.wait().expect("host steps");
        assert_same(&cpu(sh.var_store().expect("snapshot").variables()), &trained, cuda, &format!("budget {budget}"));

        // Telemetry: every evaluation is its own phase and its own event; the steps are the
        // training steps only.
        let train_steps = events.iter().filter(|e| matches!(e.kind, EventKind::TrainStep(_))).count();
        assert_eq!(train_steps as i64, STEPS, "evaluations are not training steps");
        let begins: Vec<u64> = events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. }))
            .map(|e| e.step)
            .collect();
        assert_eq!(begins, (1..=STEPS as u64).collect::<Vec<_>>());
        let evals: Vec<(u64, EvaluationMetrics)> = events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Evaluation(m) => Some((e.step, m.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(evals.len() as i64, STEPS / EVAL_EVERY, "{evals:?}");
        let eval_phases = events.iter().filter(|e| matches!(e.kind, EventKind::PhaseChanged { to: Phase::Eval, .. })).count();
        assert_eq!(eval_phases, evals.len());
        for (i, (step, m)) in evals.iter().enumerate() {
            assert_eq!(*step, (i as u64 + 1) * EVAL_EVERY as u64, "an evaluation belongs to the step before it");
            // One evaluation forward and the samples, each using the embedding, every block
            // and the head.
            let uses = (1 + SAMPLES as u64) * (LAYERS as u64 + 2);
            assert!(m.block_uses >= uses, "{m:?}");
            assert_eq!(m.prefetch_hits + m.prefetch_misses, m.block_uses, "{m:?}");
            if plan.streams() {
                // Prefetched along the evaluation's itinerary: the first use of the evaluation
                // may miss (its block was just stepped on the host), then every use is a hit
                // (measured: 0 or 1 misses in 182 uses at every budget).
                assert!(m.prefetch_misses <= 2, "budget {budget}: {m:?}");
            }
        }
        // What happened during an evaluation is tagged with its phase.
        assert!(events
            .iter()
            .any(|e| e.phase == Phase::Eval && matches!(e.kind, EventKind::PrefetchHit { .. } | EventKind::PrefetchMiss { .. })));
        let snap = sh.hub().expect("hub").snapshot();
        assert_eq!(snap.step, STEPS as u64);
    }
}

#[test]
fn gradients_through_a_forward_outside_a_step_are_an_error_not_a_panic() {
    // The loop written the tch way through the handle: the forward outside `train_step`, then
    // the optimizer's `backward_step`. The forward evaluates; its backward is refused.
    let device = common::device();
    let dev = device.tch_device();
    let held = if device.is_cuda() { device.memory().allocated } else { 0 };
    let sh = handle(&device, held + BUDGET, Bus::disabled());
    let model = {
        let _g = rng();
        tch::manual_seed(21);
        gpt!(sh.root(), snn)
    };
    let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3).expect("adamw");
    let (x, y) = batch(5, dev);
    // Before any step and after one. (Dropout draws from libtorch's RNG, which the other test
    // compares runs of.)
    let _g = rng();
    for _ in 0..2 {
        let l = loss(&model.forward_t(&x, true), &y);
        let e = opt.backward_step(&l).expect_err("a backward through an evaluation forward");
        assert!(e.to_string().contains("outside a training step") && e.to_string().contains("train_step"), "{e}");
        sh.train_step(&mut opt, || loss(&model.forward_t(&x, true), &y)).expect("a step still trains");
    }
}
