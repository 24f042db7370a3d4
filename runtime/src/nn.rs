//! Layer mode: drop-in replacements for the `tch::nn` layers that hold weights (`linear`,
//! `conv2d`, `embedding`) with the same constructors. Existing model code changes an import and
//! wraps its `VarStore` once:
//!
//! ```no_run
//! use stagehand::nn::{self as snn, LayerOptions, ManagedVarStore};
//! use tch::nn::Module;
//! let vs = ManagedVarStore::new(tch::nn::VarStore::new(tch::Device::Cpu), LayerOptions::default())?;
//! let root = vs.root();
//! let fc = snn::linear(&root / "fc", 784, 10, Default::default());
//! let y = fc.forward(&tch::Tensor::zeros([1, 784], (tch::Kind::Float, tch::Device::Cpu)));
//! # Ok::<(), stagehand::Error>(())
//! ```
//!
//! Each layer is one block. Step 0 traces the execution order; from step 1 the itinerary drives
//! prefetch; a step ends by itself when the first layer runs again (or after a backward).
//! Saved-tensor hooks go on for the thread on the first forward, so weights autograd saves are
//! handles and eviction frees them. Other layers (`layer_norm`, ...) use `tch::nn` on
//! `&*root / "name"` and live on the device.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::{BlockId, Bus};
use crate::torch::SavedTensorHooks;
use crate::weights::{WeightConfig, WeightRuntime};
use std::borrow::Borrow;
use std::cell::RefCell;
use tch::nn::Module;
use tch::{Kind, Tensor};

/// Layer-mode options (the seed's, with its auto-sizing rules).
#[derive(Debug, Clone)]
pub struct LayerOptions {
    /// Device memory cap in bytes; watermarks at 80 % / 60 % of it. Default: the device's
    /// memory (the block-mode defaults on the host device).
    pub vram_budget: Option<u64>,
    /// Pinned RAM cap for the staging pool.
    pub ram_budget: Option<u64>,
    /// Lookahead depth (default 3).
    pub prefetch_k: u32,
    /// Storage dtype for managed weights. Default `None`: keep the VarStore's dtype (the
    /// seed casts to bf16 by default; here a cast is opt-in so an f32 model stays exact).
    pub dtype: Option<Kind>,
    /// Forward only: no backward in the itinerary, no saved-tensor hooks.
    pub inference_mode: bool,
    /// Where events go (default: nowhere).
    pub telemetry: Bus,
    /// The device (default: CUDA when the VarStore is on CUDA, else the host device).
    pub device: Option<Device>,
    /// Turn saved-tensor hooks on for the forward thread (turn off when another store, such as
    /// the activation runtime's, is installed and uses this runtime's resolver).
    pub install_hooks: bool,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions {
            vram_budget: None,
            ram_budget: None,
            prefetch_k: crate::weights::config::DEFAULT_PREFETCH_WINDOW,
            dtype: None,
            inference_mode: false,
            telemetry: Bus::disabled(),
            device: None,
            install_hooks: true,
        }
    }
}

/// A `VarStore` whose weight layers stream through a [`WeightRuntime`].
#[derive(Debug)]
pub struct ManagedVarStore {
    vs: tch::nn::VarStore,
    rt: WeightRuntime,
    opts: LayerOptions,
}

impl ManagedVarStore {
    /// Wraps `vs`. Create it on the CPU for models larger than VRAM (layers are initialised
    /// there, then held in host memory); unmanaged variables live on `vs`'s device.
    pub fn new(vs: tch::nn::VarStore, opts: LayerOptions) -> Result<ManagedVarStore> {
        let device = match (&opts.device, vs.device()) {
            (Some(d), _) => d.clone(),
            (None, tch::Device::Cuda(i)) => Device::cuda(i)?,
            (None, _) => Device::host(opts.vram_budget.unwrap_or(u64::MAX / 4)),
        };
        let total = device.is_cuda().then(|| device.info().total_bytes);
        let mut cfg = WeightConfig::layer_auto(1, opts.prefetch_k, opts.vram_budget, opts.ram_budget, total);
        cfg.inference_mode = opts.inference_mode;
        // Layer mode is module-backed only: blocks never stage through slabs, so the slab size
        // does not bound them (file-backed blocks are a block-mode feature).
        cfg.pinned_slab_bytes = u64::MAX / 4;
        cfg.pinned_pool_bytes = cfg.pinned_slab_bytes;
        let rt = WeightRuntime::new(device, cfg, opts.telemetry.clone())?;
        rt.set_auto_step(true);
        Ok(ManagedVarStore { vs, rt, opts })
    }

    /// The root path, for the drop-in constructors.
    pub fn root(&self) -> Path<'_> {
        Path {
            inner: self.vs.root(),
            store: self,
        }
    }

    /// The runtime (for metrics, `OffloadedAdamW`, shutdown).
    pub fn runtime(&self) -> &WeightRuntime {
        &self.rt
    }

    /// The wrapped VarStore.
    pub fn var_store(&self) -> &tch::nn::VarStore {
        &self.vs
    }

    fn register(&self, name: String, params: Vec<(String, Tensor)>) -> Result<Layer> {
        let mut params = params;
        if let Some(kind) = self.opts.dtype {
            for (_, t) in &mut params {
                if t.is_floating_point() && t.kind() != kind {
                    let cast = tch::no_grad(|| t.f_to_kind(kind))?;
                    t.set_data(&cast);
                }
            }
        }
        let block = self.rt.register_block(&name, params)?;
        Ok(Layer {
            rt: self.rt.clone(),
            block,
            hooks: self.opts.install_hooks && !self.opts.inference_mode,
        })
    }
}

/// A path in a [`ManagedVarStore`]; derefs to `tch::nn::Path` for unmanaged layers.
#[derive(Debug)]
pub struct Path<'a> {
    inner: tch::nn::Path<'a>,
    store: &'a ManagedVarStore,
}

impl<'a> std::ops::Deref for Path<'a> {
    type Target = tch::nn::Path<'a>;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl<'a, T: ToString> std::ops::Div<T> for &Path<'a> {
    type Output = Path<'a>;
    fn div(self, rhs: T) -> Path<'a> {
        Path {
            inner: self.inner.sub(rhs),
            store: self.store,
        }
    }
}

impl<'a, T: ToString> std::ops::Div<T> for Path<'a> {
    type Output = Path<'a>;
    fn div(self, rhs: T) -> Path<'a> {
        &self / rhs
    }
}

impl Path<'_> {
    fn name(&self) -> String {
        self.inner.components().collect::<Vec<_>>().join(".")
    }
}

thread_local! {
    /// Hooks turned on by layer mode on this thread, one per runtime (the newest wins).
    static HOOKS: RefCell<Vec<(usize, SavedTensorHooks)>> = const { RefCell::new(Vec::new()) };
}

/// Turns off the saved-tensor hooks layer mode turned on for this thread.
pub fn release_hooks() {
    HOOKS.with(|h| {
        let mut v = h.borrow_mut();
        // Reverse order: each guard restores the store that was active before it.
        while let Some(g) = v.pop() {
            drop(g);
        }
    });
}

#[derive(Debug, Clone)]
struct Layer {
    rt: WeightRuntime,
    block: BlockId,
    hooks: bool,
}

impl Layer {
    fn try_run<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        if self.hooks {
            let key = self.rt.identity();
            HOOKS.with(|h| -> Result<()> {
                let mut v = h.borrow_mut();
                if !v.iter().any(|(k, _)| *k == key) {
                    v.push((key, self.rt.hooks()?));
                }
                Ok(())
            })?;
        }
        self.rt.before_block(self.block)?;
        let out = f();
        self.rt.after_block(self.block)?;
        Ok(out)
    }

    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        // `Module::forward` cannot return an error; like tch's own layers, a failure panics.
        self.try_run(f)
            .unwrap_or_else(|e| panic!("stagehand layer (block {}): {e}", self.block))
    }
}

/// A managed `tch::nn::Linear`.
#[derive(Debug)]
pub struct Linear {
    /// The tch layer (its tensors point into the runtime's buffers while resident).
    pub inner: tch::nn::Linear,
    layer: Layer,
}

impl Linear {
    /// The layer's block.
    pub fn block(&self) -> BlockId {
        self.layer.block
    }
    /// `forward` with errors returned instead of panicking.
    pub fn try_forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.layer.try_run(|| self.inner.forward(xs))
    }
}

impl Module for Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.layer.run(|| self.inner.forward(xs))
    }
}

/// A managed `tch::nn::Conv2D`.
#[derive(Debug)]
pub struct Conv2D {
    /// The tch layer.
    pub inner: tch::nn::Conv2D,
    layer: Layer,
}

impl Conv2D {
    /// The layer's block.
    pub fn block(&self) -> BlockId {
        self.layer.block
    }
}

impl Module for Conv2D {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.layer.run(|| self.inner.forward(xs))
    }
}

/// A managed `tch::nn::Embedding`.
#[derive(Debug)]
pub struct Embedding {
    /// The tch layer.
    pub inner: tch::nn::Embedding,
    layer: Layer,
}

impl Embedding {
    /// The layer's block.
    pub fn block(&self) -> BlockId {
        self.layer.block
    }
}

impl Module for Embedding {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.layer.run(|| self.inner.forward(xs))
    }
}

fn param(name: &str, leaf: &str, t: &Tensor) -> (String, Tensor) {
    (format!("{name}.{leaf}"), t.shallow_clone())
}

fn fail(what: &str, name: &str, e: Error) -> ! {
    panic!("stagehand::nn::{what}('{name}'): {e}")
}

/// `tch::nn::linear`, managed.
///
/// # Panics
/// Like tch's constructors, when the layer cannot be created or registered.
pub fn linear<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, out_dim: i64, c: tch::nn::LinearConfig) -> Linear {
    let p = vs.borrow();
    let name = p.name();
    let inner = tch::nn::linear(&p.inner, in_dim, out_dim, c);
    let mut params = vec![param(&name, "weight", &inner.ws)];
    if let Some(b) = &inner.bs {
        params.push(param(&name, "bias", b));
    }
    let layer = p.store.register(name.clone(), params).unwrap_or_else(|e| fail("linear", &name, e));
    Linear { inner, layer }
}

/// `tch::nn::conv2d`, managed.
///
/// # Panics
/// Like tch's constructors, when the layer cannot be created or registered.
pub fn conv2d<'a, T: Borrow<Path<'a>>>(vs: T, i: i64, o: i64, k: i64, c: tch::nn::ConvConfig) -> Conv2D {
    let p = vs.borrow();
    let name = p.name();
    let inner = tch::nn::conv2d(&p.inner, i, o, k, c);
    let mut params = vec![param(&name, "weight", &inner.ws)];
    if let Some(b) = &inner.bs {
        params.push(param(&name, "bias", b));
    }
    let layer = p.store.register(name.clone(), params).unwrap_or_else(|e| fail("conv2d", &name, e));
    Conv2D { inner, layer }
}

/// `tch::nn::embedding`, managed.
///
/// # Panics
/// Like tch's constructors, when the layer cannot be created or registered.
pub fn embedding<'a, T: Borrow<Path<'a>>>(
    vs: T,
    num_embeddings: i64,
    embedding_dim: i64,
    c: tch::nn::EmbeddingConfig,
) -> Embedding {
    let p = vs.borrow();
    let name = p.name();
    let inner = tch::nn::embedding(&p.inner, num_embeddings, embedding_dim, c);
    let params = vec![param(&name, "weight", &inner.ws)];
    let layer = p.store.register(name.clone(), params).unwrap_or_else(|e| fail("embedding", &name, e));
    Embedding { inner, layer }
}
