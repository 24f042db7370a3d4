//! Gradients with spilling are bit-identical to resident training: an MLP, a small transformer,
//! a hand-checkpointed (recomputed) region, and managed weights handed to a weight resolver.
//! Runs on the host device, and on CUDA where present.

use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::events::{ActivationStepMetrics, BlockId, Bus};
use stagehand::saved::{WeightResolver, WeightSave};
use stagehand::torch::TensorIdentity;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::{assert_bit_identical, device, grads, rng, sgd_steps};

fn spill_all() -> ActivationConfig {
    common::spill_all_builder().build().expect("config")
}

fn mlp(vs: &nn::Path<'_>) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 32, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "l2", 128, 128, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs / "l3", 128, 8, Default::default()))
}

/// Three MLP steps with an optimizer; returns the final gradients, the losses and per-step metrics.
fn train_mlp(rt: Option<&ActivationRuntime>) -> (Vec<(String, Tensor)>, Vec<f64>, Vec<ActivationStepMetrics>) {
    let dev = device();
    tch::manual_seed(11);
    let vs = nn::VarStore::new(dev.tch_device());
    let net = mlp(&vs.root());
    let x = Tensor::randn([64, 32], (Kind::Float, dev.tch_device()));
    let y = Tensor::randn([64, 8], (Kind::Float, dev.tch_device()));
    let (losses, metrics) = sgd_steps(rt, &vs, || net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
    (grads(&vs), losses, metrics)
}

#[test]
fn mlp_gradients_are_bit_identical_with_spilling() {
    let _rng = rng();
    let (resident, resident_losses, _) = train_mlp(None);
    let rt = ActivationRuntime::new(device(), spill_all(), Bus::disabled(), None).expect("runtime");
    let (spilled, spilled_losses, metrics) = train_mlp(Some(&rt));
    assert_bit_identical(&resident, &spilled);
    assert_eq!(resident_losses, spilled_losses);
    for m in &metrics {
        assert!(m.activations_spilled >= 4, "{m:?}");
        assert_eq!(m.activations_saved, m.activations_kept + m.activations_spilled + m.weight_handles);
        assert_eq!(m.activations_restored, m.activations_spilled, "{m:?}");
        assert_eq!(m.spill_bytes, m.restore_bytes);
        assert_eq!(m.pool_hits + m.pool_misses, m.activations_spilled);
    }
    assert_eq!(rt.live_records(), 0);
    let pool = rt.pool_stats();
    assert_eq!(pool.free, pool.total, "every slab back in its class");
}

struct Block {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    o: nn::Linear,
    ln1: nn::LayerNorm,
    ln2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

const D: i64 = 32;

impl Block {
    fn new(p: &nn::Path<'_>) -> Block {
        let l = |n: &str, i, o| nn::linear(p / n, i, o, Default::default());
        Block {
            q: l("q", D, D),
            k: l("k", D, D),
            v: l("v", D, D),
            o: l("o", D, D),
            ln1: nn::layer_norm(p / "ln1", vec![D], Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![D], Default::default()),
            up: l("up", D, 4 * D),
            down: l("down", 4 * D, D),
        }
    }

    fn forward(&self, x: &Tensor, rt: Option<&ActivationRuntime>) -> Tensor {
        let h = x.apply(&self.ln1);
        let attn = {
            let _r = rt.map(|r| r.region("attn"));
            let (q, k, v) = (h.apply(&self.q), h.apply(&self.k), h.apply(&self.v));
            // k.transpose is a non-contiguous save: restored with its strides.
            let s = q.matmul(&k.transpose(-2, -1)) / (D as f64).sqrt();
            s.softmax(-1, Kind::Float).matmul(&v).apply(&self.o)
        };
        let x = x + attn;
        let _r = rt.map(|r| r.region("mlp"));
        &x + x.apply(&self.ln2).apply(&self.up).gelu("none").apply(&self.down)
    }
}

fn train_transformer(rt: Option<&ActivationRuntime>) -> (Vec<(String, Tensor)>, Vec<ActivationStepMetrics>) {
    let dev = device();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(dev.tch_device());
    let blocks: Vec<Block> = (0..3).map(|i| Block::new(&(vs.root() / format!("blocks{i}")))).collect();
    let x = Tensor::randn([4, 16, D], (Kind::Float, dev.tch_device()));
    if let Some(rt) = rt {
        rt.register_parameters(vs.trainable_variables().iter());
    }
    let (_, metrics) = sgd_steps(rt, &vs, || {
        let mut h = x.shallow_clone();
        for (i, b) in blocks.iter().enumerate() {
            let _block = rt.map(|r| r.region(&format!("blocks.{i}")));
            h = b.forward(&h, rt);
        }
        h.pow_tensor_scalar(2).mean(Kind::Float)
    });
    (grads(&vs), metrics)
}

#[test]
fn transformer_gradients_are_bit_identical_with_spilling_regions_and_learned_tail() {
    let _rng = rng();
    let (resident, _) = train_transformer(None);
    let cfg = ActivationConfig::builder()
        .spill_batches(0, 0)
        .watermarks_bytes(1, 0)
        .min_spill_bytes(1024)
        .classes_bytes(&[8 << 10, 64 << 10])
        .slabs_per_class(&[256, 64])
        .keep_tail_groups(1)
        .restore_ahead(3, 1 << 20)
        .max_inflight(2, 2)
        .debug_checksums(true)
        .build()
        .expect("config");
    let rt = ActivationRuntime::new(device(), cfg, Bus::disabled(), None).expect("runtime");
    let (spilled, metrics) = train_transformer(Some(&rt));
    assert_bit_identical(&resident, &spilled);
    // The first step learns three block groups; later steps keep the last block's saves.
    let profile = rt.profile();
    assert_eq!(profile.len(), 3, "{profile:?}");
    assert!(profile.iter().all(|g| g.bytes > 0 && g.name.starts_with("blocks.")));
    assert!(metrics[1].activations_spilled < metrics[0].activations_spilled, "{metrics:?}");
    assert!(metrics[1].activations_kept > metrics[0].activations_kept, "{metrics:?}");
    for m in &metrics {
        assert_eq!(m.activations_restored, m.activations_spilled, "{m:?}");
        assert!(m.activations_predicted > 0, "the restorer ran ahead: {m:?}");
    }
    assert_eq!(rt.live_records(), 0);
}

/// Runs `f` twice: once resident, once with spilling; the forward recomputes block 0 in
/// backward (hand checkpointing: no saves in the first pass, a second pass under the hooks).
fn train_recomputed(rt: Option<&ActivationRuntime>) -> Vec<(String, Tensor)> {
    let dev = device();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(dev.tch_device());
    let b0 = mlp(&(vs.root() / "b0"));
    let b1 = nn::linear(vs.root() / "b1", 8, 32, Default::default());
    let x = Tensor::randn([16, 32], (Kind::Float, dev.tch_device()));
    if let Some(rt) = rt {
        rt.begin_step(1);
    }
    let _hooks = rt.map(|r| r.managed_forward().expect("hooks"));
    // Forward of block 0 without saving anything.
    let h = tch::no_grad(|| b0.forward(&x));
    let h_in = h.detach().set_requires_grad(true);
    let loss = h_in.apply(&b1).tanh().sum(Kind::Float);
    loss.backward();
    // Backward reached block 0: recompute it under the hooks, then continue backward.
    let h2 = b0.forward(&x);
    assert!(h2.equal(&h), "recomputation reproduces the forward");
    // Chain the upstream gradient in: d(sum(h2 * g))/dh2 is exactly g.
    (&h2 * h_in.grad()).sum(Kind::Float).backward();
    drop(_hooks);
    if let Some(rt) = rt {
        let m = rt.end_step().expect("step end");
        assert!(m.activations_spilled > 0, "{m:?}");
        assert_eq!(m.activations_restored, m.activations_spilled);
    }
    grads(&vs)
}

#[test]
fn recomputed_region_gets_the_same_gradients() {
    let _rng = rng();
    let resident = train_recomputed(None);
    let rt = ActivationRuntime::new(device(), spill_all(), Bus::disabled(), None).expect("runtime");
    let spilled = train_recomputed(Some(&rt));
    assert_bit_identical(&resident, &spilled);
}

/// A stand-in for the weight runtime: the registered parameters are "managed"; it counts calls.
struct FakeWeights {
    params: Mutex<Vec<Tensor>>,
    by_ptr: HashMap<u64, u32>,
    resolved: AtomicU64,
    materialized: AtomicU64,
    released: AtomicU64,
    /// How long each materialize takes (the weight runtime's own work, timed as its own).
    materialize_takes: std::time::Duration,
}

impl WeightResolver for FakeWeights {
    fn resolve(&self, t: &Tensor) -> Option<WeightSave> {
        let id = TensorIdentity::of(t);
        let &param = self.by_ptr.get(&id.storage_ptr)?;
        self.resolved.fetch_add(1, Ordering::Relaxed);
        Some(WeightSave {
            block: BlockId(0),
            param,
            storage_offset: id.storage_offset,
            sizes: id.sizes,
            strides: id.strides,
            bytes: (t.numel() * t.kind().elt_size_in_bytes()) as u64,
        })
    }
    fn materialize(&self, save: &WeightSave) -> Result<Tensor, stagehand::torch::HookError> {
        self.materialized.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.materialize_takes);
        let params = self.params.lock().map_err(|_| "poisoned")?;
        let p = params.get(save.param as usize).ok_or("no such parameter")?;
        Ok(p.detach().as_strided(&save.sizes, &save.strides, Some(save.storage_offset)))
    }
    fn release(&self, _save: &WeightSave) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn managed_weights_go_to_the_resolver_and_activations_spill() {
    let _rng = rng();
    let (resident, _, _) = train_mlp(None);
    // Same model, same seed: build it to learn the parameters' storage, then train.
    let dev = device();
    tch::manual_seed(11);
    let vs = nn::VarStore::new(dev.tch_device());
    let net = mlp(&vs.root());
    let params = vs.trainable_variables();
    let weights = Arc::new(FakeWeights {
        by_ptr: params
            .iter()
            .enumerate()
            .map(|(i, p)| (TensorIdentity::of(p).storage_ptr, i as u32))
            .collect(),
        params: Mutex::new(params.iter().map(|p| p.shallow_clone()).collect()),
        resolved: AtomicU64::new(0),
        materialized: AtomicU64::new(0),
        released: AtomicU64::new(0),
        materialize_takes: std::time::Duration::from_millis(40),
    });
    let rt = ActivationRuntime::new(dev.clone(), spill_all(), Bus::disabled(), Some(weights.clone())).expect("runtime");
    let mut opt = nn::Sgd::default().build(&vs, 1e-2).expect("optimizer");
    let x = Tensor::randn([64, 32], (Kind::Float, dev.tch_device()));
    let y = Tensor::randn([64, 8], (Kind::Float, dev.tch_device()));
    for step in 1..=3 {
        rt.begin_step(step);
        let loss = {
            let _hooks = rt.managed_forward().expect("hooks");
            net.forward(&x).mse_loss(&y, tch::Reduction::Mean)
        };
        opt.zero_grad();
        loss.backward();
        drop(loss);
        let m = rt.end_step().expect("step end");
        // The first linear needs no weight in backward (its input needs no gradient).
        assert_eq!(m.weight_handles, 2, "one W.t() per later linear: {m:?}");
        assert!(m.activations_spilled > 0);
        // The resolver's 80 ms of backward uses are the weight runtime's time, not the hooks'.
        assert!(m.host_ms < 40.0, "the hooks' own time holds no materialize: {m:?}");
        opt.step();
    }
    assert_bit_identical(&resident, &grads(&vs));
    assert_eq!(weights.resolved.load(Ordering::Relaxed), 6);
    assert_eq!(weights.materialized.load(Ordering::Relaxed), 6);
    assert_eq!(weights.released.load(Ordering::Relaxed), 6);
}

/// Collects the subjects of the spill copies issued.
struct SpillCopies(Arc<Mutex<Vec<String>>>);

impl stagehand::events::EventSink for SpillCopies {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        if let stagehand::events::EventKind::TransferIssued {
            dir: stagehand::events::Direction::D2h,
            subject,
            ..
        } = &e.kind
        {
            if let Ok(mut v) = self.0.lock() {
                v.push(subject.clone());
            }
        }
    }
}

#[test]
fn transformer_gradients_are_bit_identical_with_small_spills_copied_in_batches_per_region() {
    let _rng = rng();
    let (resident, _) = train_transformer(None);
    // Every save of this model is under 64 KiB: all of them travel in batches, one block at a
    // time; checksums verify each tensor's part of its slab at restore.
    let cfg = ActivationConfig::builder()
        .watermarks_bytes(1, 0)
        .min_spill_bytes(1024)
        .spill_batches(64 << 10, 1 << 20)
        .classes_bytes(&[64 << 10, 1 << 20])
        .slabs_per_class(&[64, 64])
        .keep_tail_groups(0)
        .restore_ahead(3, 1 << 20)
        .debug_checksums(true)
        .build()
        .expect("config");
    let hub = Arc::new(stagehand::events::Hub::new());
    let copies = Arc::new(Mutex::new(Vec::new()));
    hub.add_sink(Box::new(SpillCopies(copies.clone())));
    let bus = Bus::with_hub(hub, 1 << 16);
    let rt = ActivationRuntime::new(device(), cfg, bus.clone(), None).expect("runtime");
    let (batched, metrics) = train_transformer(Some(&rt));
    assert_bit_identical(&resident, &batched);
    bus.flush();
    let copies = copies.lock().expect("copies").clone();
    let spilled: u64 = metrics.iter().map(|m| m.activations_spilled).sum();
    assert!((copies.len() as u64) * 4 < spilled, "{} copies for {spilled} spills: {copies:?}", copies.len());
    // A batch never mixes blocks: each names the top-level region its tensors were saved in
    // (with the attention and MLP regions nested in it), one per block and step. The one save
    // outside the blocks (the loss's) is a batch of one: a single copy.
    let blocks = ["blocks.0", "blocks.1", "blocks.2"];
    let (batches, singles): (Vec<&String>, Vec<&String>) = copies.iter().partition(|s| s.starts_with("batch of "));
    assert_eq!((batches.len(), singles.len()), (3 * metrics.len(), metrics.len()), "{copies:?}");
    assert!(batches.iter().all(|s| blocks.iter().any(|b| s.ends_with(&format!(" of {b}")))), "{copies:?}");
    for m in &metrics {
        assert_eq!(m.activations_restored, m.activations_spilled, "{m:?}");
        assert_eq!(m.pageable_bytes, 0, "{m:?}");
    }
    assert_eq!(rt.live_records(), 0);
    let pool = rt.pool_stats();
    assert_eq!(pool.free, pool.total, "every slab back in its class");
}
