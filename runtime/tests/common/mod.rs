//! What the runtime's integration tests share: the RNG lock, the device with the hook engine
//! installed, gradient comparison, and the small two-linear block model the weight tests stream.
//! Each test crate uses part of it.
#![allow(dead_code)]

use stagehand::activations::ActivationConfigBuilder;
use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::events::ActivationStepMetrics;
use stagehand::device::Device;
use std::sync::Mutex;
use tch::nn;
use tch::Tensor;

/// Every event the bus delivers from the moment it is attached, in order (the hub's sinks see
/// each one, after the hub's snapshot).
pub struct Collected(std::sync::Arc<Mutex<Vec<stagehand::events::Event>>>);

impl Collected {
    pub fn on(bus: &stagehand::events::Bus) -> Collected {
        let log = EventLog::default();
        bus.hub().expect("hub").add_sink(Box::new(log.clone()));
        Collected(log.0)
    }

    /// The events delivered since the last call.
    pub fn take(&self) -> Vec<stagehand::events::Event> {
        std::mem::take(&mut *self.0.lock().expect("events"))
    }
}

/// A sink that keeps every event it is given, shared with whoever holds a clone.
#[derive(Debug, Clone, Default)]
pub struct EventLog(pub std::sync::Arc<Mutex<Vec<stagehand::events::Event>>>);

impl stagehand::events::EventSink for EventLog {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(e.clone());
    }
}

/// libtorch's RNG is process-global: tests that draw from it (or compare runs that do) take
/// this lock so parallel tests do not interleave their draws.
static RNG: Mutex<()> = Mutex::new(());

pub fn rng() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|p| p.into_inner())
}

/// A plain model drawn from `seed` under the RNG lock on a CPU VarStore (as a Stagehand store
/// makes its layers), then moved to `dev`: the reference a managed model built from the same
/// seed is compared with.
pub fn seeded_on_cpu<T>(seed: i64, dev: tch::Device, build: impl FnOnce(&nn::VarStore) -> T) -> (nn::VarStore, T) {
    let _g = rng();
    tch::manual_seed(seed);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let model = build(&vs);
    vs.set_device(dev);
    (vs, model)
}

/// Three SGD steps (lr 1e-2) over `vs` of the loss `forward` computes, under `rt`'s saved-tensor
/// hooks when given (plain tch otherwise); the losses and `rt`'s metrics of each step.
pub fn sgd_steps(
    rt: Option<&ActivationRuntime>,
    vs: &nn::VarStore,
    mut forward: impl FnMut() -> Tensor,
) -> (Vec<f64>, Vec<ActivationStepMetrics>) {
    use tch::nn::OptimizerConfig;
    let mut opt = nn::Sgd::default().build(vs, 1e-2).expect("optimizer");
    let (mut losses, mut metrics) = (Vec::new(), Vec::new());
    for step in 1..=3 {
        if let Some(rt) = rt {
            rt.begin_step(step);
        }
        let loss = {
            let _hooks = rt.map(|r| r.managed_forward().expect("hooks"));
            forward()
        };
        opt.zero_grad();
        loss.backward();
        losses.push(loss.double_value(&[]));
        drop(loss);
        if let Some(rt) = rt {
            metrics.push(rt.end_step().expect("step end"));
        }
        opt.step();
    }
    (losses, metrics)
}

/// The tests of one binary that run on the GPU take it one at a time (see [`device`]).
static GPU: Mutex<()> = Mutex::new(());

thread_local! {
    /// The GPU, held by this test's thread until it ends (passing or panicking).
    static GPU_HELD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, ()>>> = const { std::cell::RefCell::new(None) };
}

/// The host device, or CUDA where present, with the hook engine installed. The hook engine must
/// be libtorch's engine before the first backward of the process (a resident run included):
/// the device threads start once per process, for the first engine.
///
/// On CUDA the calling test holds the GPU until its thread ends: the allocator's readings are
/// the whole device's, and a budget computed from one (what the device holds plus the model's
/// needs, a plan's stated minimum) must not count the tensors of a test running beside it.
pub fn device() -> Device {
    stagehand::torch::hooks::install().expect("hook engine");
    // The tests compare runs bit for bit. libtorch's CPU reductions (a bias gradient's sum over
    // the batch) split their work by the threads free at that moment, so the same sum rounds
    // differently when the runtime's own threads or a parallel test are busy (about 1 run in
    // 30 before): one intra-op thread makes every run sum in the same order.
    tch::set_num_threads(1);
    let d = Device::auto(1 << 30);
    if d.is_cuda() {
        GPU_HELD.with(|held| {
            let mut held = held.borrow_mut();
            if held.is_none() {
                *held = Some(GPU.lock().unwrap_or_else(|p| p.into_inner()));
            }
        });
    }
    // cuBLAS's workspaces, allocated now, so budgets computed from a reading count them.
    d.warm_up().expect("warm up");
    d
}

/// Spill everything eligible: watermarks at the bottom, tiny minimum size, a roomy pool, no
/// learned tail, checksums on. Tests add their own restore and in-flight limits.
pub fn spill_all_builder() -> ActivationConfigBuilder {
    ActivationConfig::builder()
        .watermarks_bytes(1, 0)
        .min_spill_bytes(1)
        .classes_bytes(&[4096, 64 << 10, 1 << 20])
        .slabs_per_class(&[64, 64, 16])
        .keep_tail_groups(0)
        .debug_checksums(true)
}

/// Every variable's gradient on the host, sorted by name.
pub fn grads(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut g: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, v)| (n, v.grad().to_device(tch::Device::Cpu)))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    g
}

pub fn assert_bit_identical(a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "gradient of {na} differs");
    }
}

/// The weight tests' model: blocks of `x + fc2(relu(fc1(x)))`, D -> H -> D.
pub mod blocks {
    use tch::nn::{self, Module};
    use tch::Tensor;

    pub const D: i64 = 16;
    pub const H: i64 = 32;

    pub type Block = (nn::Linear, nn::Linear);

    /// `n` blocks named `blocks.{i}.fc1` / `blocks.{i}.fc2`.
    pub fn build(vs: &nn::VarStore, n: usize) -> Vec<Block> {
        (0..n)
            .map(|i| {
                let p = vs.root() / "blocks" / i;
                (
                    nn::linear(&p / "fc1", D, H, Default::default()),
                    nn::linear(&p / "fc2", H, D, Default::default()),
                )
            })
            .collect()
    }

    /// A reference model on `dev` and an identical one in host memory, for a weight runtime to
    /// stream (seed 7); both frozen unless `trainable`.
    pub fn pair(dev: tch::Device, n: usize, trainable: bool) -> (nn::VarStore, Vec<Block>, nn::VarStore, Vec<Block>) {
        let _g = super::rng();
        tch::manual_seed(7);
        let mut vr = nn::VarStore::new(dev);
        let r = build(&vr, n);
        let mut vm = nn::VarStore::new(tch::Device::Cpu);
        let m = build(&vm, n);
        vm.copy(&vr).expect("copy weights");
        if !trainable {
            vr.freeze();
            vm.freeze();
        }
        (vr, r, vm, m)
    }

    pub fn block_fwd(b: &Block, x: &Tensor) -> Tensor {
        x + b.1.forward(&b.0.forward(x).relu())
    }

    /// Bytes of one block in the runtime's layout (fc1 w,b + fc2 w,b, each 256-aligned).
    pub fn block_bytes() -> u64 {
        let a = |b: i64| (b as u64 * 4).div_ceil(256) * 256;
        a(D * H) + a(H) + a(H * D) + a(D)
    }
}

/// What the drop-in tests share: handles, value maps and comparisons that are exact on the host
/// device and within float tolerance on CUDA.
pub mod dropin {
    use stagehand::device::Device;
    use stagehand::optim::Kernel;
    use stagehand::Stagehand;
    use std::collections::HashMap;
    use tch::Tensor;

    /// A handle with `budget` bytes of device memory: on CUDA on top of what the device holds
    /// already (reference models, library workspaces), else the host device with that budget.
    /// The exact host kernel, so the host device is bit-identical with plain tch.
    pub fn handle(device: &Device, budget: u64) -> Stagehand {
        handle_with(device, budget, |b| b).0
    }

    /// [`handle`] with what `more` sets on the builder besides; the handle and its whole budget.
    pub fn handle_with(
        device: &Device,
        budget: u64,
        more: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
    ) -> (Stagehand, u64) {
        let cuda = device.is_cuda();
        let budget = budget + if cuda { device.memory().allocated } else { 0 };
        let builder = Stagehand::builder()
            .budget_bytes(budget)
            .device(if cuda { device.clone() } else { Device::host(budget) })
            .kernel(Kernel::Exact);
        (more(builder).build().expect("handle"), budget)
    }

    /// A handle whose budget is `budget` bytes in all (a size a plan stated: on CUDA it counts
    /// what the device holds already), on CUDA or the host device with that budget.
    pub fn handle_at(device: &Device, budget: u64) -> Stagehand {
        Stagehand::builder()
            .budget_bytes(budget)
            .device(if device.is_cuda() { device.clone() } else { Device::host(budget) })
            .kernel(Kernel::Exact)
            .build()
            .expect("handle")
    }

    /// A tied token embedding: its forward, and the output head that multiplies by its weight
    /// (on the handle, with the weight's block resident for the product).
    pub trait Tied: std::fmt::Debug + Send {
        fn embed(&self, ids: &Tensor) -> Tensor;
        fn logits(&self, x: &Tensor) -> Tensor;
    }

    impl Tied for tch::nn::Embedding {
        fn embed(&self, ids: &Tensor) -> Tensor {
            tch::nn::Module::forward(self, ids)
        }
        fn logits(&self, x: &Tensor) -> Tensor {
            x.matmul(&self.ws.tr())
        }
    }

    impl Tied for stagehand::nn::Embedding {
        fn embed(&self, ids: &Tensor) -> Tensor {
            tch::nn::Module::forward(self, ids)
        }
        fn logits(&self, x: &Tensor) -> Tensor {
            self.run(|e| x.matmul(&e.ws.tr())).expect("tied head")
        }
    }

    /// CPU copies of every variable of `vs`.
    pub fn values(vs: &tch::nn::VarStore) -> HashMap<String, Tensor> {
        vs.variables().into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu).copy())).collect()
    }

    /// CPU copies of a name -> tensor map.
    pub fn cpu(m: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
        m.into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu).copy())).collect()
    }

    /// Losses step for step: bit-identical on the host device, close on CUDA.
    pub fn assert_losses(got: &[f64], want: &[f64], cuda: bool) {
        assert_eq!(got.len(), want.len());
        if cuda {
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() < 1e-3 * b.abs().max(1.0), "losses {got:?} vs {want:?}");
            }
        } else {
            assert_eq!(got, want, "losses step for step");
        }
    }

    /// The same names with equal values (bit-identical on the host device, close on CUDA).
    pub fn assert_same(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>, cuda: bool, what: &str) {
        let mut a: Vec<&String> = got.keys().collect();
        let mut b: Vec<&String> = want.keys().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{what}: the same variables");
        for (name, t) in got {
            let w = &want[name];
            assert_eq!(t.size(), w.size(), "{what}: {name} shape");
            if cuda {
                assert_close_on_cuda(t, w, &format!("{what}: {name}"));
            } else {
                assert!(t.equal(w), "{what}: {name} differs");
            }
        }
    }

    /// Two runs of the same training on CUDA agree up to kernel order: most elements within
    /// `allclose(1e-3, 1e-4)`, and the difference small against the tensor as a whole. Adam
    /// amplifies reduction-order noise in a gradient near zero into a step of up to the learning
    /// rate, so a few elements may differ by more than an element-wise tolerance; a parameter
    /// stepped wrongly, or not at all, differs in most of its elements and fails.
    fn assert_close_on_cuda(got: &Tensor, want: &Tensor, what: &str) {
        if got.allclose(want, 1e-3, 1e-4, false) {
            return;
        }
        let (g, w) = (got.to_kind(tch::Kind::Double), want.to_kind(tch::Kind::Double));
        let diff = (&g - &w).abs();
        let bound = w.abs() * 1e-3 + 1e-4;
        let outside = diff.gt_tensor(&bound).to_kind(tch::Kind::Double).mean(tch::Kind::Double).double_value(&[]);
        let relative = diff.norm().double_value(&[]) / w.norm().double_value(&[]).max(1e-12);
        let largest = diff.max().double_value(&[]);
        assert!(
            outside <= 0.01 && relative <= 1e-3,
            "{what} differs: {:.3}% of its elements outside allclose(1e-3, 1e-4), relative difference {relative:.3e} (at most 1% and 1e-3), largest {largest:.3e}",
            outside * 100.0
        );
    }

    /// Every variable changed from `before` (each one trained).
    pub fn assert_all_changed(after: &HashMap<String, Tensor>, before: &HashMap<String, Tensor>, skip: &[&str]) {
        for (name, t) in after {
            if skip.iter().any(|s| name.contains(s)) {
                continue;
            }
            assert!(!t.equal(&before[name]), "{name} was never trained");
        }
    }
}
