//! The saved-tensor hook substrate on a real libtorch autograd graph (CPU).

use stagehand::torch::{SavedTensorHooks, SavedTensorStore, TensorIdentity};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

mod common;
use common::rng;

/// What a store does with the tensors it hands back.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Deep copy on pack, return the copy.
    Copy,
    /// Like Copy, but adds noise on unpack (the negative control).
    Poison,
    /// Refuse in pack.
    FailPack,
    /// Refuse in unpack.
    FailUnpack,
    /// Panic in pack.
    PanicPack,
}

struct TestStore {
    mode: Mode,
    next: AtomicU64,
    held: Mutex<HashMap<u64, Tensor>>,
    identities: Mutex<HashMap<TensorIdentity, u32>>,
    packs: AtomicU64,
    unpacks: AtomicU64,
    releases: AtomicU64,
}

impl TestStore {
    fn new(mode: Mode) -> Arc<TestStore> {
        Arc::new(TestStore {
            mode,
            next: AtomicU64::new(1),
            held: Mutex::new(HashMap::new()),
            identities: Mutex::new(HashMap::new()),
            packs: AtomicU64::new(0),
            unpacks: AtomicU64::new(0),
            releases: AtomicU64::new(0),
        })
    }

    fn duplicates(&self) -> u32 {
        self.identities
            .lock()
            .expect("lock")
            .values()
            .map(|n| n.saturating_sub(1))
            .sum()
    }
}

impl SavedTensorStore for TestStore {
    fn pack(&self, tensor: Tensor) -> Result<u64, stagehand::torch::HookError> {
        self.packs.fetch_add(1, Ordering::Relaxed);
        match self.mode {
            Mode::FailPack => return Err("store refused the tensor".into()),
            Mode::PanicPack => panic!("store exploded"),
            _ => {}
        }
        *self
            .identities
            .lock()
            .expect("lock")
            .entry(TensorIdentity::of(&tensor))
            .or_insert(0) += 1;
        let h = self.next.fetch_add(1, Ordering::Relaxed);
        self.held
            .lock()
            .expect("lock")
            .insert(h, tensor.detach().copy());
        Ok(h)
    }

    fn unpack(&self, handle: u64) -> Result<Tensor, stagehand::torch::HookError> {
        self.unpacks.fetch_add(1, Ordering::Relaxed);
        if self.mode == Mode::FailUnpack {
            return Err(format!("handle {handle} is gone").into());
        }
        let held = self.held.lock().expect("lock");
        let t = held
            .get(&handle)
            .ok_or_else(|| format!("unknown handle {handle}"))?;
        Ok(match self.mode {
            Mode::Poison if t.is_floating_point() => t + 0.5,
            _ => t.shallow_clone(),
        })
    }

    fn release(&self, handle: u64) {
        self.releases.fetch_add(1, Ordering::Relaxed);
        self.held.lock().expect("lock").remove(&handle);
    }
}

fn mlp(vs: &nn::Path<'_>) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 16, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "l2", 32, 32, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs / "l3", 32, 4, Default::default()))
}

/// Trains the MLP for a few steps; returns the losses and the final gradients.
fn train(store: Option<Arc<TestStore>>) -> (Vec<f64>, Vec<Tensor>) {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2).expect("optimizer");
    let x = Tensor::randn([64, 16], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([64, 4], (Kind::Float, Device::Cpu));
    let mut losses = Vec::new();
    for _ in 0..5 {
        let _hooks = store
            .clone()
            .map(|s| SavedTensorHooks::enable(s).expect("hooks install"));
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        losses.push(loss.double_value(&[]));
        opt.step();
    }
    let mut grads: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, v)| (name, v.grad().copy()))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, grads.into_iter().map(|(_, g)| g).collect())
}

#[test]
fn copying_store_trains_bit_identically() {
    let _rng = rng();
    let (base_losses, base_grads) = train(None);
    let store = TestStore::new(Mode::Copy);
    let (losses, grads) = train(Some(store.clone()));
    assert_eq!(losses, base_losses, "losses must be bit-identical");
    for (a, b) in grads.iter().zip(&base_grads) {
        assert!(a.equal(b), "gradients must be bit-identical");
    }
    let packs = store.packs.load(Ordering::Relaxed);
    assert!(packs >= 5 * 6, "every step saves tensors through the store, saw {packs}");
    assert_eq!(store.unpacks.load(Ordering::Relaxed), packs, "every saved tensor came back");
    assert_eq!(store.releases.load(Ordering::Relaxed), packs, "every saved variable was released");
    assert!(store.held.lock().expect("lock").is_empty(), "nothing left after backward");
}

#[test]
fn poisoning_store_changes_the_gradients() {
    let _rng = rng();
    let (base_losses, base_grads) = train(None);
    let (losses, grads) = train(Some(TestStore::new(Mode::Poison)));
    assert_eq!(losses[0], base_losses[0], "the first forward does not unpack anything");
    let changed = grads.iter().zip(&base_grads).filter(|(a, b)| !a.equal(b)).count();
    assert!(changed > 0, "poisoned unpacks must change the gradients");
}

#[test]
fn relu_output_saved_twice_is_seen_as_a_duplicate() {
    let _rng = rng();
    let store = TestStore::new(Mode::Copy);
    let x = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    {
        let _hooks = SavedTensorHooks::enable(store.clone()).expect("hooks");
        // relu saves its output; using it twice in products saves it again.
        let r = x.relu();
        let loss = (&r * &r).sum(Kind::Float);
        loss.backward();
    }
    assert!(store.duplicates() >= 1, "the same tensor was saved more than once");
    assert!(store.held.lock().expect("lock").is_empty());
}

#[test]
fn hooks_are_off_on_other_threads_and_after_the_guard() {
    let _rng = rng();
    let store = TestStore::new(Mode::Copy);
    let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    {
        let _hooks = SavedTensorHooks::enable(store.clone()).expect("hooks");
        let other = std::thread::spawn(|| {
            let y = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            y.exp().sum(Kind::Float).backward();
        });
        other.join().expect("other thread");
        assert_eq!(store.packs.load(Ordering::Relaxed), 0, "another thread is not hooked");
    }
    x.exp().sum(Kind::Float).backward();
    assert_eq!(store.packs.load(Ordering::Relaxed), 0, "no hooks after the guard");
}

#[test]
fn failing_pack_is_a_torch_error() {
    let _rng = rng();
    let store = TestStore::new(Mode::FailPack);
    let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let _hooks = SavedTensorHooks::enable(store).expect("hooks");
    let err = x.f_exp().expect_err("pack failure must fail the op");
    assert!(err.to_string().contains("store refused the tensor"), "{err}");
}

#[test]
fn panicking_pack_is_a_torch_error_not_an_abort() {
    let _rng = rng();
    let store = TestStore::new(Mode::PanicPack);
    let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let _hooks = SavedTensorHooks::enable(store).expect("hooks");
    let err = x.f_exp().expect_err("a panic must fail the op");
    assert!(err.to_string().contains("panic in pack: store exploded"), "{err}");
}

#[test]
fn failing_unpack_is_a_backward_error() {
    let _rng = rng();
    let store = TestStore::new(Mode::FailUnpack);
    let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let _hooks = SavedTensorHooks::enable(store.clone()).expect("hooks");
    let loss = x.exp().sum(Kind::Float);
    let err = Tensor::f_run_backward(&[loss], &[&x], false, false).expect_err("unpack failure");
    assert!(err.to_string().contains("is gone"), "{err}");
}

#[test]
fn allocator_statistics_without_cuda_are_absent_not_errors() {
    let _rng = rng();
    stagehand::torch::init();
    if stagehand::torch::cuda_available() {
        let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
        let s = stagehand::torch::alloc::cuda_stats(0)
            .expect("stats")
            .expect("allocator initialized");
        assert!(s.allocated >= 4 << 20, "{s:?}");
        drop(t);
    } else {
        assert_eq!(stagehand::torch::alloc::cuda_stats(0).expect("no error"), None);
        assert!(!stagehand::torch::alloc::cuda_empty_cache().expect("no error"));
    }
}
