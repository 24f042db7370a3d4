//! Recompute scopes: tensors computed again in backward instead of kept or spilled give the
//! same gradients bit for bit, store fewer bytes, free everything by the step's end, and a
//! function that does not compute the same thing again is a loud error. Runs on the host
//! device, and on CUDA where present.

use stagehand::activations::{f_recompute, recompute, ActivationRuntime};
use stagehand::events::{ActivationStepMetrics, Bus, EventKind, Hub, KeepReason};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::nn;
use tch::{Kind, Tensor};

mod common;
use common::{assert_bit_identical, device, grads, rng, sgd_steps, spill_all_builder, Collected};

/// Attention probabilities and an MLP's activation, either under `recompute` or plain.
fn block(x: &Tensor, p: &[Tensor], scoped: bool) -> Tensor {
    let (q, k) = (x.matmul(&p[0]), x.matmul(&p[1]));
    let scores = |s: &[Tensor]| (s[0].matmul(&s[1].transpose(-2, -1)) * 0.125).softmax(-1, Kind::Float);
    let att = if scoped { recompute(&[&q, &k], scores) } else { scores(&[q, k]) };
    let x = x + att.matmul(x);
    let u = x.matmul(&p[2]);
    let act = |s: &[Tensor]| s[0].gelu("tanh");
    let h = if scoped { recompute(&[&u], act) } else { act(&[u]) };
    &x + h.matmul(&p[3])
}

/// Three steps of SGD; the final gradients, the losses and each step's metrics.
fn train(rt: Option<&ActivationRuntime>, scoped: bool) -> (Vec<(String, Tensor)>, Vec<f64>, Vec<ActivationStepMetrics>) {
    let dev = device().tch_device();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(dev);
    let root = vs.root();
    let d = 32;
    let p: Vec<Tensor> = [("q", d), ("k", d), ("fc", 4 * d)]
        .iter()
        .map(|(n, o)| root.randn(n, &[d, *o], 0.0, 0.2))
        .chain(std::iter::once(root.randn("out", &[4 * d, d], 0.0, 0.2)))
        .collect();
    let x = Tensor::randn([4, 16, d], (Kind::Float, dev));
    let (losses, metrics) = sgd_steps(rt, &vs, || block(&block(&x, &p, scoped), &p, scoped).square().mean(Kind::Float));
    (grads(&vs), losses, metrics)
}

#[test]
fn recomputed_tensors_give_the_same_gradients_and_are_not_stored() {
    let _rng = rng();
    let (plain, plain_losses, _) = train(None, true);
    let rt = ActivationRuntime::new(device(), spill_all_builder().build().expect("config"), Bus::disabled(), None)
        .expect("runtime");
    let (scoped, scoped_losses, with) = train(Some(&rt), true);
    assert_bit_identical(&plain, &scoped);
    assert_eq!(plain_losses, scoped_losses);
    assert_eq!(rt.live_records(), 0, "every record released");
    let pool = rt.pool_stats();
    assert_eq!(pool.free, pool.total, "every slab back in its class");

    let rt2 = ActivationRuntime::new(device(), spill_all_builder().build().expect("config"), Bus::disabled(), None)
        .expect("runtime");
    let (unscoped, _, without) = train(Some(&rt2), false);
    assert_bit_identical(&plain, &unscoped);
    for (a, b) in with.iter().zip(&without) {
        // Per block, the scores' matmul inputs, the softmax output and the matmul's view of it,
        // the GELU's input and its output are recomputed; q, k and u are stored, as sources.
        assert!(a.activations_recomputed >= 8, "{a:?}");
        assert!(a.recompute_bytes > 0, "{a:?}");
        assert_eq!(b.activations_recomputed, 0, "{b:?}");
        // Not stored per block: the GELU output (4 x 16 x 128 floats) and the attention
        // probabilities (4 x 16 x 16); their sources were saved anyway by the matmuls.
        let spared = 2 * 4 * (4 * 16 * 128 + 4 * 16 * 16);
        assert!(
            a.spill_bytes + spared <= b.spill_bytes,
            "recompute stores fewer bytes: {} spilled against {} ({} recomputed)",
            a.spill_bytes,
            b.spill_bytes,
            a.recompute_bytes
        );
        assert!(a.recompute_ms > 0.0, "{a:?}");
    }
}

#[test]
fn a_fraction_of_the_scopes_recompute_and_the_others_are_stored() {
    let _rng = rng();
    let (plain, plain_losses, _) = train(None, true);
    let run = |fraction: f64| {
        let cfg = spill_all_builder().recompute_fraction(fraction).build().expect("config");
        let rt = ActivationRuntime::new(device(), cfg, Bus::disabled(), None).expect("runtime");
        let (g, losses, metrics) = train(Some(&rt), true);
        assert_bit_identical(&plain, &g);
        assert_eq!(plain_losses, losses, "fraction {fraction}");
        assert_eq!(rt.live_records(), 0, "fraction {fraction}: every record released");
        metrics
    };
    let (all, half, none) = (run(1.0), run(0.5), run(0.0));
    for ((a, h), z) in all.iter().zip(&half).zip(&none) {
        // Four scopes a step (two blocks of two): all, every other one, none.
        assert_eq!(z.activations_recomputed, 0, "{z:?}");
        assert!(h.activations_recomputed > 0 && h.activations_recomputed < a.activations_recomputed, "{h:?} {a:?}");
        assert!(a.spill_bytes < h.spill_bytes && h.spill_bytes < z.spill_bytes, "{} {} {}", a.spill_bytes, h.spill_bytes, z.spill_bytes);
    }
}

/// The recomputation is the model's forward run again inside an unpack: reported as
/// `recompute_ms`, and left out of `host_ms`, the hooks' own cost, so the two add up.
#[test]
fn the_hooks_time_leaves_out_the_recomputed_forward() {
    let _rng = rng();
    let nap = std::time::Duration::from_millis(60);
    let rt = ActivationRuntime::new(device(), spill_all_builder().build().expect("config"), Bus::disabled(), None)
        .expect("runtime");
    let dev = device().tch_device();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(dev);
    let w = vs.root().randn("w", &[16, 16], 0.0, 0.2);
    let x = Tensor::randn([8, 16], (Kind::Float, dev));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let (_, metrics) = sgd_steps(Some(&rt), &vs, || {
        let c = c.clone();
        let h = recompute(&[&x.matmul(&w)], move |s| {
            // A slow function: its time is the model's, whether in forward or in backward.
            c.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(nap);
            s[0].tanh()
        });
        h.square().mean(Kind::Float)
    });
    assert_eq!(calls.load(Ordering::SeqCst), 6, "three steps, each computing the scope twice");
    for m in &metrics {
        assert!(m.activations_recomputed > 0, "{m:?}");
        assert!(m.recompute_ms >= nap.as_secs_f64() * 1e3, "the recomputation's time: {m:?}");
        // A handful of small tensors packed and unpacked: far below the function's sleep.
        assert!(m.host_ms < nap.as_secs_f64() * 1e3 / 2.0, "the hooks' own time holds no recomputation: {m:?}");
    }
}

/// Two scopes in a row whose outputs no operation saves (the second's goes to a mean, the
/// first's is the second's source): backward needs only what the functions saved. Each function
/// saves a tensor three times (a sigmoid's output, then `a * a`), then a matmul's inputs, and
/// counts the times it gets past that matmul.
fn stacked(x: &Tensor, w: &[Tensor], past: &Arc<AtomicUsize>) -> Tensor {
    let scope = |h: &Tensor, w: &Tensor| {
        let past = past.clone();
        recompute(&[h, w], move |s| {
            let a = s[0].sigmoid();
            let out = (&a * &a).matmul(&s[1]);
            past.fetch_add(1, Ordering::SeqCst);
            out * 2.0
        })
    };
    scope(&scope(x, &w[0]), &w[1])
}

/// What three steps of SGD over [`stacked`] left: the gradients, the losses, each step's
/// metrics, and how often the functions got past their matmul.
struct Stacked {
    grads: Vec<(String, Tensor)>,
    losses: Vec<f64>,
    metrics: Vec<ActivationStepMetrics>,
    past: usize,
}

/// Trains [`stacked`] under `rt` (or plain), the loss the output's mean or, with
/// `save_output`, its square's (the square saves the second scope's output).
fn train_stacked(rt: Option<&ActivationRuntime>, save_output: bool) -> Stacked {
    let dev = device().tch_device();
    tch::manual_seed(11);
    let vs = nn::VarStore::new(dev);
    let w: Vec<Tensor> = (0..2).map(|i| vs.root().randn(&format!("w{i}"), &[16, 16], 0.0, 0.3)).collect();
    let x = Tensor::randn([8, 16], (Kind::Float, dev));
    let past = Arc::new(AtomicUsize::new(0));
    let (losses, metrics) = sgd_steps(rt, &vs, || {
        let out = stacked(&x, &w, &past);
        if save_output { out.square() } else { out }.mean(Kind::Float)
    });
    Stacked {
        grads: grads(&vs),
        losses,
        metrics,
        past: past.load(Ordering::SeqCst),
    }
}

fn early_stop_runtime(early: bool) -> ActivationRuntime {
    let cfg = spill_all_builder().recompute_early_stop(early).build().expect("config");
    ActivationRuntime::new(device(), cfg, Bus::disabled(), None).expect("runtime")
}

#[test]
fn a_recomputation_stops_at_its_last_save_when_nothing_saved_its_output() {
    let _rng = rng();
    let plain = train_stacked(None, false);
    assert_eq!(plain.past, 6, "three steps of two scopes");
    for (early, past, stopped) in [(true, 6, 2), (false, 12, 0)] {
        let rt = early_stop_runtime(early);
        let run = train_stacked(Some(&rt), false);
        assert_bit_identical(&plain.grads, &run.grads);
        assert_eq!(plain.losses, run.losses);
        // With the early stop backward's recomputations stop before the matmul after their last
        // save; without it each function runs to its end in backward too.
        assert_eq!(run.past, past, "early stop {early}");
        for m in &run.metrics {
            assert_eq!((m.scopes_recomputed, m.scopes_stopped_early), (2, stopped), "{m:?}");
        }
        assert_eq!(rt.live_records(), 0, "every record released");
    }
}

/// A scope whose output a later operation saves is recomputed whole: the output is served.
#[test]
fn a_recomputation_whose_output_was_saved_runs_to_its_end() {
    let _rng = rng();
    let plain = train_stacked(None, true);
    let rt = early_stop_runtime(true);
    let run = train_stacked(Some(&rt), true);
    assert_bit_identical(&plain.grads, &run.grads);
    assert_eq!(plain.losses, run.losses);
    assert_eq!(run.past, 6 + 3, "in backward the second scope runs to its end, the first stops");
    for m in &run.metrics {
        assert_eq!((m.scopes_recomputed, m.scopes_stopped_early), (2, 1), "{m:?}");
    }
}

#[test]
fn without_a_runtime_recompute_is_the_function() {
    let _rng = rng();
    let x = Tensor::randn([3, 5], tch::kind::FLOAT_CPU).set_requires_grad(true);
    let y = recompute(&[&x], |s| s[0].tanh());
    assert!(y.equal(&x.tanh()));
    y.sum(Kind::Float).backward();
    assert!(x.grad().defined());
}

#[test]
fn a_function_that_computes_something_else_in_backward_is_an_error() {
    let _rng = rng();
    let rt = ActivationRuntime::new(device(), spill_all_builder().build().expect("config"), Bus::disabled(), None)
        .expect("runtime");
    let dev = device().tch_device();
    let x = Tensor::randn([8, 16], (Kind::Float, dev)).set_requires_grad(true);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    rt.begin_step(1);
    let loss = {
        let _hooks = rt.managed_forward().expect("hooks");
        // The second call (backward's) saves a tensor of another shape.
        let y = f_recompute(&[&x], move |s| {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                s[0].tanh()
            } else {
                s[0].narrow(1, 0, 8).tanh().repeat([1, 2])
            }
        })
        .expect("scope");
        (&y * &y).sum(Kind::Float)
    };
    let err = loss.f_backward().expect_err("the recomputation differs");
    assert!(err.to_string().contains("must compute the same thing"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    drop(loss);
    rt.end_step().expect("step end");
    assert_eq!(rt.live_records(), 0);
}

#[test]
fn a_streamed_layer_inside_a_scope_without_its_weights_as_sources_is_refused() {
    use stagehand::nn as snn;
    use tch::nn::Module;
    let _rng = rng();
    let device = device();
    // Sixteen 96 x 96 layers (37 KB each) under 320 KiB: some of them stream.
    let sh = common::dropin::handle(&device, 320 << 10);
    let mut layers: Option<Vec<_>> =
        Some((0..16).map(|i| snn::linear(sh.root() / format!("l{i}"), 96, 96, Default::default())).collect());
    let mut opt = sh.optimizer(nn::Sgd::default(), 1e-2).expect("optimizer");
    let x = Tensor::randn([4, 96], (Kind::Float, sh.device().tch_device()));
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let inner = layers.take().expect("the layers");
        sh.train_step(&mut opt, || {
            recompute(&[&x], move |s| inner.iter().fold(s[0].shallow_clone(), |h, l| l.forward(&h).relu())).sum(Kind::Float)
        })
    }))
    .expect_err("the scope refuses the streamed weight");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains("inside a recompute scope") && msg.contains("among its sources"), "{msg}");
}

/// Block mode with each block checkpointed: the block's function recomputed in backward from
/// its input and its streamed weights, given as sources (so backward's recomputation gets them
/// resident). Frozen weights, the input requiring grad, a 3-block room for 6 blocks.
#[test]
fn checkpointed_streamed_blocks_give_the_same_input_gradients() {
    use common::blocks::{block_bytes, block_fwd, pair, D};
    use stagehand::activations::ActivationConfig;
    use stagehand::weights::{WeightConfig, WeightRuntime};
    let device = device();
    let dev = device.tch_device();
    let n = 6;
    let (_vr, r, vm, m) = pair(dev, n, false);
    let cfg = WeightConfig::builder()
        .pool(4 << 20, 1 << 20)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(3 * block_bytes())
        .prefetch_window(2)
        .build()
        .expect("config");
    let rt = WeightRuntime::from_var_store(&vm, r"^blocks\.\d+$", device.clone(), cfg, Bus::disabled()).expect("runtime");
    let ids: Vec<_> = (0..n).map(|i| rt.block_id(&format!("blocks.{i}")).expect("id")).collect();
    // Everything stays on the device: only what the scopes store is compared.
    let keep = ActivationConfig::builder().watermarks_bytes(1 << 40, 1 << 39).build().expect("config");
    let run = |scoped: bool| -> Vec<(Tensor, Tensor, ActivationStepMetrics)> {
        let acts = ActivationRuntime::new(device.clone(), keep.clone(), Bus::disabled(), Some(rt.resolver())).expect("acts");
        (0..3)
            .map(|step| {
                let x = {
                    let _g = rng();
                    tch::manual_seed(100 + step);
                    Tensor::randn([8, D], (Kind::Float, dev)).set_requires_grad(true)
                };
                rt.begin_step().expect("begin");
                acts.begin_step(step as u64 + 1);
                let y = {
                    let _hooks = acts.managed_forward().expect("hooks");
                    let mut h = x.shallow_clone();
                    for (id, b) in ids.iter().zip(&m) {
                        h = rt
                            .run_block(*id, || {
                                let bias = |l: &nn::Linear| l.bs.as_ref().expect("bias").shallow_clone();
                                let w = [b.0.ws.shallow_clone(), bias(&b.0), b.1.ws.shallow_clone(), bias(&b.1)];
                                if scoped {
                                    recompute(&[&h, &w[0], &w[1], &w[2], &w[3]], |s| {
                                        &s[0] + s[0].linear(&s[1], Some(&s[2])).relu().linear(&s[3], Some(&s[4]))
                                    })
                                } else {
                                    block_fwd(b, &h)
                                }
                            })
                            .expect("block");
                    }
                    h
                };
                y.sum(Kind::Float).backward();
                // Backward released every saved tensor, and each scope its sources and its
                // recomputation, while the output still lives.
                assert_eq!(acts.live_records(), 0, "step {step}: records left after backward");
                let metrics = acts.end_step().expect("acts end");
                rt.end_step().expect("end");
                (y.detach(), x.grad(), metrics)
            })
            .collect()
    };
    let plain = run(false);
    let scoped = run(true);
    for (step, ((py, pg, pm), (sy, sg, sm))) in plain.iter().zip(&scoped).enumerate() {
        let xr = {
            let _g = rng();
            tch::manual_seed(100 + step as i64);
            Tensor::randn([8, D], (Kind::Float, dev)).set_requires_grad(true)
        };
        let want = r.iter().fold(xr.shallow_clone(), |h, b| block_fwd(b, &h));
        want.sum(Kind::Float).backward();
        assert!(py.equal(&want) && sy.equal(&want), "step {step}: outputs differ");
        assert!(pg.equal(&xr.grad()) && sg.equal(&xr.grad()), "step {step}: input gradients differ");
        // Unscoped, each block keeps its relu output (8 x 32) and saves its two weights; scoped,
        // the relu output is recomputed and the block input (8 x 16) and four weights are the
        // sources: fewer bytes on the device.
        assert_eq!(pm.activations_recomputed, 0, "{pm:?}");
        assert!(sm.activations_recomputed >= 3 * n as u64, "step {step}: {sm:?}");
        if !device.is_cuda() {
            assert!(sm.vram_peak_mib < pm.vram_peak_mib, "step {step}: a lower peak: {sm:?} against {pm:?}");
        }
    }
    let mx = rt.last_step_metrics();
    assert!(mx.evictions > 0 && mx.prefetch_hits > 0, "the blocks streamed: {mx:?}");
}

/// bf16 attention through libtorch's fused kernel, forward and backward under the hooks, as the
/// demo GPT runs it: the gradients equal plain autograd's. Where the kernel libtorch picks saves
/// its RNG seed and offset as UInt64 tensors (flash attention on CUDA, in the demo on an H200;
/// tch cannot name the kind, and `kind()` panicked inside the pack hook), they are kept as they
/// are, for their kind, at 8 bytes each (`activations::tests` packs such a tensor on the host).
#[test]
fn fused_bf16_attention_trains_through_the_hooks() {
    let _rng = rng();
    let run = |rt: Option<&ActivationRuntime>| {
        let dev = device().tch_device();
        tch::manual_seed(9);
        let mut vs = nn::VarStore::new(dev);
        let w = vs.root().randn("w", &[128, 384], 0.0, 0.1);
        vs.bfloat16();
        let x = Tensor::randn([2, 64, 128], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let (losses, _) = sgd_steps(rt, &vs, || {
            // The demo GPT's attention: q, k and v are views of one projection, 4 heads of 32.
            let qkv = x.matmul(&w).view([2, 64, 3, 4, 32]);
            let (q, k, v) = (qkv.select(2, 0).transpose(1, 2), qkv.select(2, 1).transpose(1, 2), qkv.select(2, 2).transpose(1, 2));
            let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, false);
            y.to_kind(Kind::Float).square().mean(Kind::Float)
        });
        (grads(&vs), losses)
    };
    let (plain, plain_losses) = run(None);
    let bus = Bus::with_hub(Arc::new(Hub::new()), 1 << 16);
    let events = Collected::on(&bus);
    let rt = ActivationRuntime::new(device(), spill_all_builder().build().expect("config"), bus.clone(), None)
        .expect("runtime");
    let (hooked, hooked_losses) = run(Some(&rt));
    assert_bit_identical(&plain, &hooked);
    assert_eq!(plain_losses, hooked_losses);
    assert_eq!(rt.live_records(), 0, "every record released");
    bus.flush();
    let events = events.take();
    assert!(events.iter().any(|e| matches!(e.kind, EventKind::Pack { .. })), "the pack decisions reach the collector");
    let unnamed: Vec<u64> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Pack { reason: Some(KeepReason::UnnamedKind), bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    assert!(unnamed.iter().all(|&b| b == 8), "the RNG state is kept for its kind, 8 bytes each: {unnamed:?}");
    if !device().is_cuda() {
        assert!(unnamed.is_empty(), "the CPU kernel saves no tensor of an unnamed kind: {unnamed:?}");
    }
}
