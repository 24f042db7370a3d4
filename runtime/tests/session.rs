//! The `Stagehand` handle end to end: a small transformer-shaped model trained through the handle
//! (blocks streamed, activations spilled, the Conductor on) gives the same losses and parameters
//! as the same model in plain tch, step for step, with every parameter trained, unmanaged layer
//! norms included. Bit-identical on the host device; within float tolerance on CUDA.

use stagehand::device::Device;
use stagehand::events::{Bus, Direction, EventKind, Hub, Owner, Phase};
use stagehand::nn as snn;
use stagehand::Stagehand;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::dropin::{assert_losses, assert_same, cpu, handle_with, values};
use common::rng;

const V: i64 = 50;
const D: i64 = 32;
const H: i64 = 64;
const LAYERS: usize = 4;
const BATCH: i64 = 32;
const SEQ: i64 = 16;

struct Net {
    tok: Box<dyn Module>,
    blocks: Vec<(Box<dyn Module>, Box<dyn Module>)>,
    ln: nn::LayerNorm,
    head: Box<dyn Module>,
}

impl Net {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let mut h = self.tok.forward(ids);
        for (fc1, fc2) in &self.blocks {
            h = &h + fc2.forward(&fc1.forward(&h).gelu("none"));
        }
        self.head.forward(&self.ln.forward(&h))
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        self.forward(ids).view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
    }
}

fn plain(vs: &nn::VarStore) -> Net {
    let r = vs.root();
    Net {
        tok: Box::new(nn::embedding(&r / "tok", V, D, Default::default())),
        blocks: (0..LAYERS)
            .map(|i| {
                let p = &r / "blocks" / i;
                (
                    Box::new(nn::linear(&p / "fc1", D, H, Default::default())) as Box<dyn Module>,
                    Box::new(nn::linear(&p / "fc2", H, D, Default::default())) as Box<dyn Module>,
                )
            })
            .collect(),
        ln: nn::layer_norm(&r / "ln", vec![D], Default::default()),
        head: Box::new(nn::linear(&r / "head", D, V, Default::default())),
    }
}

fn managed(sh: &Stagehand) -> Net {
    let r = sh.root();
    Net {
        tok: Box::new(snn::embedding(&r / "tok", V, D, Default::default())),
        blocks: (0..LAYERS)
            .map(|i| {
                let p = &r / "blocks" / i;
                (
                    Box::new(snn::linear(&p / "fc1", D, H, Default::default())) as Box<dyn Module>,
                    Box::new(snn::linear(&p / "fc2", H, D, Default::default())) as Box<dyn Module>,
                )
            })
            .collect(),
        // A tch layer on the handle's store: unmanaged, trained on the device.
        ln: nn::layer_norm(&*r / "ln", vec![D], Default::default()),
        head: Box::new(snn::linear(&r / "head", D, V, Default::default())),
    }
}

/// The plain model from `seed`, made on the CPU (as the handle's store makes it) and moved to
/// `dev`.
fn plain_seeded(seed: i64, dev: tch::Device) -> (nn::VarStore, Net) {
    common::seeded_on_cpu(seed, dev, plain)
}

/// The same model from `seed` on the handle's store.
fn managed_seeded(sh: &Stagehand, seed: i64) -> Net {
    let _g = rng();
    tch::manual_seed(seed);
    managed(sh)
}

fn batch(seed: i64, dev: tch::Device) -> (Tensor, Tensor) {
    let _g = rng();
    tch::manual_seed(seed);
    let ids = Tensor::randint(V, [BATCH, SEQ], (Kind::Int64, dev));
    let targets = Tensor::randint(V, [BATCH, SEQ], (Kind::Int64, dev));
    (ids, targets)
}

/// Every event's step, phase and kind.
struct Collect(Arc<Mutex<Vec<(u64, Phase, EventKind)>>>);

impl stagehand::events::EventSink for Collect {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        if let Ok(mut v) = self.0.lock() {
            v.push((e.step, e.phase, e.kind.clone()));
        }
    }
}

/// Plain tch's AdamW on `net`, a step for each batch seed of `batches`; the losses.
fn plain_losses(vs: &nn::VarStore, net: &Net, lr: f64, batches: impl IntoIterator<Item = i64>) -> Vec<f64> {
    let mut opt = nn::AdamW::default().build(vs, lr).expect("adamw");
    batches
        .into_iter()
        .map(|s| {
            let (ids, targets) = batch(s, vs.device());
            let loss = net.loss(&ids, &targets);
            opt.backward_step(&loss);
            loss.double_value(&[])
        })
        .collect()
}

#[test]
fn training_through_the_handle_equals_plain_tch() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let steps = 6;
    let lr = 1e-2;

    // Plain tch, everything on the device.
    let (vs, net) = plain_seeded(5, dev);
    let initial = values(&vs);
    let want = plain_losses(&vs, &net, lr, 100..100 + steps);

    // The same model through the handle: a budget that makes blocks stream and activations
    // spill, every spill checksummed and verified before its restore.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hub = Arc::new(Hub::new());
    hub.add_sink(Box::new(Collect(seen.clone())));
    let bus = Bus::with_hub(hub, 1 << 20);
    // On CUDA the budget counts what the device already holds (the plain model, cuBLAS's
    // workspace): the handle gets the same 400 KiB on top of it.
    let (sh, budget) = handle_with(&device, 400 << 10, |b| b.bus(bus.clone()).checksums(true));
    let net = managed_seeded(&sh, 5);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let mut got = Vec::new();
    for s in 0..steps {
        let (ids, targets) = batch(100 + s, dev);
        let report = sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step");
        if s == 0 {
            // The first step kept an eighth of the plan's activations and measured what rode
            // above its watermark; the next steps keep the plan's watermark where that and the
            // restores' allowance still fit.
            let plan = sh.plan().expect("planned");
            let (first, _) = plan.first_spill_watermarks();
            let above = report.vram_peak_bytes.saturating_sub(first);
            let fits = (budget - budget / 32).saturating_sub(above).saturating_sub(plan.restore_allowance_bytes);
            let want = plan.spill_high_bytes.min(fits).max(plan.spill_floor_bytes);
            assert!(first < plan.spill_high_bytes, "{plan:?}");
            assert_eq!(sh.activations().expect("spilling").watermarks().0, want, "peak {}", report.vram_peak_bytes);
        }
        got.push(report.loss);
        let t = report.time;
        let parts = t.compute_ms + t.h2d_wait_ms + t.d2h_wait_ms + t.weight_stall_ms + t.restore_stall_ms + t.optimizer_ms + t.other_ms;
        assert!(parts >= t.step_ms * 0.999, "step {s}: the parts cover the step: {t:?}");
    }
    assert_losses(&got, &want, cuda);
    let plan = sh.plan().expect("planned");
    assert!(plan.streams(), "the budget makes blocks stream: {plan:?}");
    let wm = sh.weights().last_step_metrics();
    assert!(wm.evictions > 0 && wm.h2d_bytes > 0, "{wm:?}");
    assert!(wm.d2h_bytes > 0, "gradients went to the host: {wm:?}");
    let acts = sh.activations().expect("spilling");
    assert!(acts.config().debug_checksums, "the builder's checksums reach the activation runtime");
    let am = acts.last_step_metrics().expect("a step");
    assert!(am.activations_spilled > 0, "{am:?}");
    assert_eq!(am.pool_misses, 0, "the traced pool held every spill of the last step: {am:?}");

    // Every parameter equals plain tch's, and every one of them was trained.
    opt.wait().expect("host steps done");
    let trained = cpu(sh.var_store().expect("snapshot").variables());
    sh.shutdown().expect("shutdown");
    assert_same(&trained, &values(&vs), cuda, "parameters");
    for (name, t) in &trained {
        assert!(!t.equal(&initial[name]), "{name} was never trained");
    }
    assert_eq!(trained.len(), 2 + 2 * 2 * LAYERS + 1 + 2, "every variable compared");

    bus.flush();
    let tagged = seen.lock().expect("events").clone();
    // Layer mode tags the weights' work with the step and phase it belongs to: after the first
    // step, loads in the forward and backward, gradient copies to the host in the backward,
    // each under its own step, and none left at step 0 or idle.
    let weights_copies = |dir: Direction| {
        tagged
            .iter()
            .filter(move |(_, _, k)| matches!(k, EventKind::TransferIssued { owner: Owner::Weights, dir: d, .. } if *d == dir))
    };
    for step in 2..=steps as u64 {
        let phases = |dir| weights_copies(dir).filter(|(s, _, _)| *s == step).map(|(_, p, _)| *p).collect::<Vec<_>>();
        let loads = phases(Direction::H2d);
        assert!(loads.contains(&Phase::Forward) && loads.contains(&Phase::Backward), "step {step} loads: {loads:?}");
        let grads = phases(Direction::D2h);
        assert!(grads.contains(&Phase::Backward), "step {step} gradient copies: {grads:?}");
        assert!(grads.iter().all(|p| matches!(p, Phase::Backward | Phase::Optimizer)), "step {step} gradient copies: {grads:?}");
    }
    let untagged = weights_copies(Direction::H2d).chain(weights_copies(Direction::D2h)).filter(|(s, p, _)| *s == 0 || *p == Phase::Idle).count();
    assert_eq!(untagged, 0, "weight copies outside any step");
    let events: Vec<EventKind> = tagged.into_iter().map(|(_, _, k)| k).collect();
    let times = events.iter().filter(|e| matches!(e, EventKind::StepTime(_))).count();
    assert_eq!(times, steps as usize, "a time breakdown per step");
    assert!(events.iter().any(|e| matches!(e, EventKind::VramOwners(o) if o.weights_bytes > 0)));
    let activation_limits: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            EventKind::LimitsSet { owner: Owner::Activations, high_watermark_bytes, low_watermark_bytes, .. } => {
                Some((high_watermark_bytes.unwrap_or(0), low_watermark_bytes.unwrap_or(0)))
            }
            _ => None,
        })
        .collect();
    assert_eq!(activation_limits.first(), Some(&plan.first_spill_watermarks()), "the first step's limits are published");
}

#[test]
fn blocks_split_into_parts_stream_and_train_as_plain_tch() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let (steps, lr) = (4, 1e-2);
    let (vs, net) = plain_seeded(7, dev);
    let want = plain_losses(&vs, &net, lr, 200..200 + steps);

    let (sh, _) = handle_with(&device, 400 << 10, |b| b.grouping(snn::Grouping::Parts(2)));
    let net = managed_seeded(&sh, 7);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let got: Vec<f64> = (0..steps)
        .map(|s| {
            let (ids, targets) = batch(200 + s, dev);
            sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step").loss
        })
        .collect();
    assert_losses(&got, &want, cuda);
    // Each block's two linears are its two parts, streamed as units, the window counting parts.
    for i in 0..LAYERS {
        for part in 0..2 {
            sh.weights().block_id(&format!("blocks.{i}.part{part}")).expect("a part is a streaming unit");
        }
        assert!(sh.weights().block_id(&format!("blocks.{i}")).is_err(), "no whole block {i}");
    }
    let plan = sh.plan().expect("planned");
    assert!(plan.streams(), "{plan:?}");
    assert_eq!(plan.prefetch_window, 2 * stagehand::session::plan::DEFAULT_PREFETCH_WINDOW);
    assert!(sh.weights().last_step_metrics().evictions > 0);
    assert_parameters_as_plain(&sh, &mut opt, &vs, cuda);
}

#[test]
fn a_prefetch_window_of_zero_loads_every_block_on_demand_and_trains_the_same() {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let (steps, lr) = (3, 1e-2);
    let (vs, net) = plain_seeded(9, dev);
    let want = plain_losses(&vs, &net, lr, 300..300 + steps);

    let (sh, _) = handle_with(&device, 400 << 10, |b| b.prefetch_window(0));
    let net = managed_seeded(&sh, 9);
    let mut opt = sh.optimizer(nn::AdamW::default(), lr).expect("optimizer");
    let got: Vec<f64> = (0..steps)
        .map(|s| {
            let (ids, targets) = batch(300 + s, dev);
            sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step").loss
        })
        .collect();
    assert_losses(&got, &want, cuda);
    // The window asked for is the window used: nothing loads ahead, so every trained streamed
    // block (the host optimizer changed it) is a demand load at its first use of the step.
    let plan = sh.plan().expect("planned");
    assert!(plan.streams(), "{plan:?}");
    assert_eq!(plan.prefetch_window, 0, "{plan:?}");
    let streamed = (sh.weights().blocks().len() - plan.resident_blocks.len()) as u64;
    let wm = sh.weights().last_step_metrics();
    assert!(wm.prefetch_misses >= streamed, "{streamed} streamed blocks: {wm:?}");
    sh.shutdown().expect("shutdown");
}

/// The compute stream's time inside the weights' hooks, on request: each step measures some,
/// never more than the hooks' own time (on the host device the two clocks are one: a hook's span
/// lies inside its timed call), and nothing when not asked for.
#[test]
fn the_hooks_gpu_time_is_measured_on_request() {
    let device = common::device();
    let dev = device.tch_device();
    for on in [true, false] {
        let (sh, _) = handle_with(&device, 400 << 10, |b| b.measure_hook_gpu_time(on));
        let net = managed_seeded(&sh, 9);
        let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
        let mut total = 0.0;
        for s in 0..3 {
            let (ids, targets) = batch(300 + s, dev);
            sh.train_step(&mut opt, || net.loss(&ids, &targets)).expect("step");
            let m = sh.weights().last_step_metrics();
            total += m.hook_gpu_ms;
            if !on {
                assert_eq!(m.hook_gpu_ms, 0.0, "not measured: {m:?}");
            } else if !device.is_cuda() {
                assert!(m.hook_gpu_ms > 0.0, "step {s}: {m:?}");
                assert!(m.hook_gpu_ms <= m.host_ms + m.update_wait_ms + 0.5, "step {s}: {m:?}");
            }
        }
        // On CUDA a span counts once the stream has passed it: by the third step's end, the
        // first two steps' have.
        assert_eq!(total > 0.0, on, "{total} ms");
        sh.shutdown().expect("shutdown");
    }
}

#[test]
fn budgets_that_cannot_work_are_refused_with_the_reason() {
    let e = Stagehand::builder().build().expect_err("no budget");
    assert!(e.to_string().contains("budget"), "{e}");
    let e = Stagehand::builder().budget_bytes(0).build().expect_err("zero");
    assert!(e.to_string().contains("above 0"), "{e}");
    for bad in [-1.0, 1.5, f64::NAN] {
        let e = Stagehand::builder().budget_mib(64).recompute_fraction(bad).build().expect_err("not a fraction");
        assert!(e.to_string().contains("recompute_fraction"), "{e}");
    }
    // The host device's "VRAM" is host memory: more than the host has is refused up front.
    for budget in [u64::MAX, 1 << 50] {
        let e = Stagehand::builder()
            .budget_bytes(budget)
            .device(Device::host(budget))
            .build()
            .expect_err("more than the host holds");
        assert!(e.to_string().contains("host's available memory"), "{e}");
    }
    let sh = Stagehand::builder()
        .budget_bytes(4 << 10)
        .device(Device::host(4 << 10))
        .build()
        .expect("the budget is only checked against the model");
    two_blocks(&sh);
    let e = sh.prepare().expect_err("4 KiB holds no 16 KiB block");
    assert!(e.to_string().contains("budget"), "{e}");
}

/// The activation pool's pinned limit set on the builder replaces the plan's and says so; one
/// over the host memory the model leaves, or of 0 bytes, is refused before anything trains.
#[test]
fn an_activation_pool_limit_replaces_the_plans_within_the_host_memory() {
    let model = |limit: u64| {
        let sh = Stagehand::builder()
            .budget_mib(1)
            .device(Device::host(1 << 20))
            .activation_pool_limit_bytes(limit)
            .build()
            .expect("build");
        two_blocks(&sh);
        sh
    };
    let sh = model(3 << 20);
    let plan = sh.prepare().expect("plan");
    assert_eq!(plan.pool_limit_bytes, 3 << 20);
    assert!(plan.reasons.iter().any(|r| r.contains("activation_pool_limit 3.0 MiB (the plan's")), "{:?}", plan.reasons);
    assert!(plan.host_left_bytes > 3 << 20, "{plan:?}");
    sh.shutdown().expect("shutdown");

    let sh = model(u64::MAX);
    let e = sh.prepare().expect_err("more than the host has");
    assert!(e.to_string().contains("activation_pool_limit") && e.to_string().contains("host memory"), "{e}");

    let e = Stagehand::builder().budget_mib(1).activation_pool_limit_bytes(0).build().expect_err("0 bytes");
    assert!(e.to_string().contains("activation_pool_limit"), "{e}");
}

/// Two 64 x 64 linear blocks (16 KiB of weights each) on the handle's root.
fn two_blocks(sh: &Stagehand) {
    let r = sh.root();
    // Layer initialisation draws from libtorch's global generator: hold it, as the other test does.
    let _g = rng();
    let _l = snn::linear(&r / "blocks" / 0 / "fc", 64, 64, Default::default());
    let _m = snn::linear(&r / "blocks" / 1 / "fc", 64, 64, Default::default());
}

/// `net`'s loss, failing as `how` says on the step it is told to: in the forward, with an
/// allocation no host can make (an out-of-memory); or in backward, from a scope whose function
/// computes something else when backward runs it again, either after the embedding (reached
/// after every block, once their host steps are queued: `"backward"`) or on the logits (the
/// first thing backward reaches, before any host step: `"early in backward"`).
fn loss_that_fails(net: &Net, ids: &Tensor, targets: &Tensor, how: Option<&str>) -> Tensor {
    let mut h = net.tok.forward(ids);
    match how {
        Some("forward") => {
            let _ = Tensor::zeros([1i64 << 52], (Kind::Float, tch::Device::Cpu));
        }
        Some("backward") => h = changes_in_backward(&h),
        _ => {}
    }
    for (fc1, fc2) in &net.blocks {
        h = &h + fc2.forward(&fc1.forward(&h).gelu("none"));
    }
    let mut logits = net.head.forward(&net.ln.forward(&h));
    if how == Some("early in backward") {
        logits = changes_in_backward(&logits);
    }
    logits.view([-1, V]).cross_entropy_for_logits(&targets.view([-1]))
}

/// `tanh(t)` in a recompute scope whose recomputation saves a tensor of another shape: an error
/// when backward reaches it.
fn changes_in_backward(t: &Tensor) -> Tensor {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    stagehand::activations::recompute(&[t], move |s| {
        if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            s[0].tanh()
        } else {
            let half = s[0].size()[2] / 2;
            s[0].narrow(2, 0, half).tanh().repeat([1, 1, 2])
        }
    })
}

/// Every parameter trained through `sh` equals plain tch's in `vs` (once the host steps are
/// done); the handle then shuts down.
fn assert_parameters_as_plain(sh: &Stagehand, opt: &mut stagehand::optim::Optimizer, vs: &nn::VarStore, cuda: bool) {
    opt.wait().expect("host steps done");
    let trained = cpu(sh.var_store().expect("snapshot").variables());
    sh.shutdown().expect("shutdown");
    assert_same(&trained, &values(vs), cuda, "parameters");
}

/// The model from `seed` on a handle whose blocks stream and spill, two AdamW steps trained.
fn two_steps_trained(seed: i64) -> (Stagehand, Net, stagehand::optim::Optimizer, tch::Device) {
    let device = common::device();
    let dev = device.tch_device();
    let (sh, _) = handle_with(&device, 400 << 10, |b| b);
    let net = managed_seeded(&sh, seed);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
    for s in 0..2 {
        let (ids, targets) = batch(100 * seed + s, dev);
        sh.train_step(&mut opt, || loss_that_fails(&net, &ids, &targets, None)).expect("step");
    }
    (sh, net, opt, dev)
}

/// Plain tch and a handle from `seed`, over batches `100 * seed` on: two steps, a third that
/// `fail` makes fail (given the handle, the model, the optimizer and its batch), two more. The
/// handle's losses and parameters must be plain tch's over the four batches that trained (bit
/// for bit on the host device). Returns the failed step's error.
fn trains_on_as_if_the_failed_step_had_not_run(
    seed: i64,
    fail: impl FnOnce(&Stagehand, &Net, &mut stagehand::optim::Optimizer, i64) -> stagehand::Error,
) -> stagehand::Error {
    let device = common::device();
    let dev = device.tch_device();
    let cuda = device.is_cuda();
    let first = 100 * seed;
    let (vs, plain_net) = plain_seeded(seed, dev);
    // The failed step's batch, the third, trains nothing.
    let want = plain_losses(&vs, &plain_net, 1e-2, [first, first + 1, first + 3, first + 4]);

    let (sh, _) = handle_with(&device, 400 << 10, |b| b);
    let net = managed_seeded(&sh, seed);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-2).expect("optimizer");
    let train = |b: i64, opt: &mut stagehand::optim::Optimizer| {
        let (ids, targets) = batch(b, dev);
        sh.train_step(opt, || loss_that_fails(&net, &ids, &targets, None)).expect("training goes on").loss
    };
    let mut got = vec![train(first, &mut opt), train(first + 1, &mut opt)];
    let e = fail(&sh, &net, &mut opt, first + 2);
    got.extend([train(first + 3, &mut opt), train(first + 4, &mut opt)]);
    assert_losses(&got, &want, cuda);
    assert_parameters_as_plain(&sh, &mut opt, &vs, cuda);
    e
}

/// A step that fails before its backward (an out-of-memory in the forward) changed nothing: it
/// is abandoned, and the handle trains on as if it had not run.
#[test]
fn a_step_that_fails_in_its_forward_is_abandoned_and_training_goes_on_as_if_it_had_not_run() {
    let e = trains_on_as_if_the_failed_step_had_not_run(11, |sh, net, opt, b| {
        let (ids, targets) = batch(b, sh.device().tch_device());
        sh.train_step(opt, || loss_that_fails(net, &ids, &targets, Some("forward"))).expect_err("out of memory")
    });
    assert!(matches!(e, stagehand::Error::OutOfMemory(_)), "{e}");
    assert!(e.to_string().starts_with("out of host memory in the forward of step 3"), "{e}");
}

/// A step that fails in its backward before any update (the first node backward reaches, with
/// a micro-batch's gradients already summed) changed nothing either: it is abandoned, its
/// gradients dropped, and the handle trains on as if it had not run.
#[test]
fn a_step_that_fails_in_its_backward_before_any_update_is_abandoned_and_its_gradients_dropped() {
    let e = trains_on_as_if_the_failed_step_had_not_run(12, |sh, net, opt, b| {
        // Two micro-batches: the first's backward sums its gradients, the second's fails at once.
        let (ids, targets) = batch(b, sh.device().tch_device());
        let half = BATCH / 2;
        sh.train_step_micro(opt, 2, |i| {
            let how = (i == 1).then_some("early in backward");
            let rows = |t: &Tensor| t.narrow(0, i as i64 * half, half);
            loss_that_fails(net, &rows(&ids), &rows(&targets), how)
        })
        .expect_err("the second micro-batch's backward fails")
    });
    assert!(e.to_string().contains("must compute the same thing"), "{e}");
}

/// A step that fails while its host steps run leaves some blocks stepped and others not: no
/// further step, and neither `save` nor `var_store` hands out that model.
#[test]
fn a_step_that_fails_while_its_optimizer_steps_refuses_to_save_the_part_stepped_model() {
    let (sh, net, mut opt, dev) = two_steps_trained(13);
    let (ids, targets) = batch(1302, dev);
    let e = sh.train_step(&mut opt, || loss_that_fails(&net, &ids, &targets, Some("backward"))).expect_err("backward fails");
    assert!(e.to_string().contains("must compute the same thing"), "{e}");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("torn.safetensors");
    let e = sh.save(&path).expect_err("a part-stepped model");
    assert!(e.to_string().contains("some of the model's values are the next step's"), "{e}");
    assert!(!path.exists(), "nothing written");
    assert!(sh.var_store().is_err(), "no copy either");
    let e = sh.train_step(&mut opt, || loss_that_fails(&net, &ids, &targets, None)).expect_err("no step after a failed one");
    assert!(e.to_string().starts_with("step 4: step 3 failed ("), "{e}");
}
