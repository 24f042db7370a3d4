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
//! Layers are grouped into blocks when the model first runs, from the model's repeated structure
//! ([`Grouping::Repeated`]: every layer under `blocks.N` joins block `blocks.N`), so a transformer
//! block streams as one copy, prefetched along the itinerary, exactly as block mode does. Step 1
//! traces the execution order; a step ends by itself when a forward starts after a backward.
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
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tch::nn::Module;
use tch::{Kind, Tensor};

/// How layers become blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Grouping {
    /// The model's repeated structure: a layer whose path runs through `<prefix>.<N>` where
    /// `<prefix>` has at least two numbered children joins block `<prefix>.<N>`; every other
    /// layer is a block of its own.
    #[default]
    Repeated,
    /// Every layer is its own block.
    Layer,
}

/// Layer-mode options.
#[derive(Debug, Clone)]
pub struct LayerOptions {
    /// Device memory cap in bytes; the weights' room is 80 % of it. Default: the device's
    /// memory (the block-mode defaults on the host device).
    pub vram_budget: Option<u64>,
    /// The weights' device room in bytes, when a plan has decided it (overrides `vram_budget`).
    pub weight_room: Option<u64>,
    /// Pinned RAM cap for the staging pool.
    pub ram_budget: Option<u64>,
    /// Lookahead depth (default 3).
    pub prefetch_k: u32,
    /// Storage dtype for managed weights. Default `None`: keep the VarStore's dtype (a cast is
    /// opt-in so an f32 model stays exact).
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
    /// How layers become blocks.
    pub grouping: Grouping,
    /// Steps begin and end by themselves (off when something else, such as the `Stagehand`
    /// handle, runs the steps).
    pub auto_step: bool,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions {
            vram_budget: None,
            weight_room: None,
            ram_budget: None,
            prefetch_k: crate::weights::config::DEFAULT_PREFETCH_WINDOW,
            dtype: None,
            inference_mode: false,
            telemetry: Bus::disabled(),
            device: None,
            install_hooks: true,
            grouping: Grouping::Repeated,
            auto_step: true,
        }
    }
}

/// The block name of each layer path under `grouping` (pure; see [`Grouping::Repeated`]).
pub fn group_layers(paths: &[String], grouping: &Grouping) -> Vec<String> {
    if *grouping == Grouping::Layer {
        return paths.to_vec();
    }
    // Numbered children of every prefix: `blocks` -> {0, 1, ...}.
    let mut children: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for p in paths {
        let parts: Vec<&str> = p.split('.').collect();
        for k in 1..parts.len() {
            if parts[k].parse::<u64>().is_ok() {
                children.entry(parts[..k].join(".")).or_default().insert(parts[k]);
            }
        }
    }
    paths
        .iter()
        .map(|p| {
            let parts: Vec<&str> = p.split('.').collect();
            (1..parts.len())
                .find(|&k| {
                    parts[k].parse::<u64>().is_ok()
                        && children.get(&parts[..k].join(".")).is_some_and(|c| c.len() >= 2)
                        && k + 1 < parts.len()
                })
                .map_or_else(|| p.clone(), |k| parts[..=k].join("."))
        })
        .collect()
}

/// Layers made so far, registered as blocks when the model first runs.
#[derive(Debug, Default)]
struct Layers {
    pending: Vec<(String, Vec<(String, Tensor)>)>,
    /// Each layer's block, once sealed.
    blocks: Option<Vec<BlockId>>,
}

#[derive(Debug)]
struct Table {
    rt: WeightRuntime,
    grouping: Grouping,
    layers: Mutex<Layers>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Layers> {
        self.layers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, name: String, params: Vec<(String, Tensor)>) -> Result<usize> {
        let mut l = self.lock();
        if l.blocks.is_some() {
            return Err(Error::misuse(
                format!("creating layer '{name}'"),
                "create every layer before the model first runs",
            ));
        }
        if l.pending.iter().any(|(n, _)| *n == name) {
            return Err(Error::Config {
                field: "layer",
                value: format!("'{name}'"),
                expected: "a path not used by another layer".into(),
            });
        }
        l.pending.push((name, params));
        Ok(l.pending.len() - 1)
    }

    /// Registers every layer's block (once) and returns layer `i`'s.
    fn block_of(&self, i: usize) -> Result<BlockId> {
        let mut l = self.lock();
        if l.blocks.is_none() {
            let paths: Vec<String> = l.pending.iter().map(|(n, _)| n.clone()).collect();
            let names = group_layers(&paths, &self.grouping);
            let mut grouped: Vec<(String, Vec<(String, Tensor)>)> = Vec::new();
            for (name, (_, params)) in names.iter().zip(std::mem::take(&mut l.pending)) {
                match grouped.iter_mut().find(|(n, _)| n == name) {
                    Some((_, ps)) => ps.extend(params),
                    None => grouped.push((name.clone(), params)),
                }
            }
            let mut ids = BTreeMap::new();
            for (name, params) in grouped {
                ids.insert(name.clone(), self.rt.register_block(&name, params)?);
            }
            l.blocks = Some(names.iter().map(|n| ids[n]).collect());
        }
        l.blocks
            .as_ref()
            .and_then(|b| b.get(i).copied())
            .ok_or_else(|| Error::internal(format!("layer {i} has no block")))
    }
}

/// A `VarStore` whose weight layers stream through a [`WeightRuntime`].
#[derive(Debug)]
pub struct ManagedVarStore {
    vs: tch::nn::VarStore,
    rt: WeightRuntime,
    opts: LayerOptions,
    table: Arc<Table>,
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
        if let Some(room) = opts.weight_room {
            cfg.weight_budget_bytes = Some(room);
        } else if let Some(b) = opts.vram_budget {
            cfg.room_origin = format!("80% of the {b}-byte vram_budget, the high watermark");
        }
        let rt = WeightRuntime::new(device, cfg, opts.telemetry.clone())?;
        rt.set_auto_step(opts.auto_step);
        let table = Arc::new(Table {
            rt: rt.clone(),
            grouping: opts.grouping.clone(),
            layers: Mutex::new(Layers::default()),
        });
        Ok(ManagedVarStore { vs, rt, opts, table })
    }

    /// The root path, for the drop-in constructors.
    pub fn root(&self) -> Path<'_> {
        Path {
            inner: self.vs.root(),
            store: self,
        }
    }

    /// The runtime (for metrics, the optimizer, shutdown).
    pub fn runtime(&self) -> &WeightRuntime {
        &self.rt
    }

    /// The wrapped VarStore.
    pub fn var_store(&self) -> &tch::nn::VarStore {
        &self.vs
    }

    /// Registers every layer made so far as blocks now (otherwise this happens when the model
    /// first runs); returns the blocks in registration order.
    pub fn seal(&self) -> Result<Vec<BlockId>> {
        if self.table.lock().pending.is_empty() && self.table.lock().blocks.is_none() {
            return Ok(Vec::new());
        }
        self.table.block_of(0)?;
        Ok(self.rt.blocks().iter().map(|b| b.id).collect())
    }

    /// The VarStore paths of every managed parameter (of layers made so far).
    pub fn managed_names(&self) -> std::collections::HashSet<String> {
        let l = self.table.lock();
        let mut names: std::collections::HashSet<String> =
            l.pending.iter().flat_map(|(_, ps)| ps.iter().map(|(n, _)| n.clone())).collect();
        drop(l);
        for b in self.rt.blocks() {
            names.extend(b.params.into_iter().map(|p| p.name));
        }
        names
    }

    /// The trainable variables the runtime does not manage (layer norms, custom parameters).
    pub fn unmanaged_trainable(&self) -> Vec<(String, Tensor)> {
        let managed = self.managed_names();
        let mut v: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(n, t)| !managed.contains(n) && t.requires_grad())
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
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
        let index = self.table.add(name, params)?;
        Ok(Layer {
            table: self.table.clone(),
            index,
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
    table: Arc<Table>,
    index: usize,
    hooks: bool,
}

impl Layer {
    fn block(&self) -> Result<BlockId> {
        self.table.block_of(self.index)
    }

    fn try_run(&self, f: impl FnOnce() -> Tensor) -> Result<Tensor> {
        let block = self.block()?;
        let rt = &self.table.rt;
        if self.hooks {
            let key = rt.identity();
            HOOKS.with(|h| -> Result<()> {
                let mut v = h.borrow_mut();
                if !v.iter().any(|(k, _)| *k == key) {
                    v.push((key, rt.hooks()?));
                }
                Ok(())
            })?;
        }
        rt.before_block(block)?;
        let out = f();
        crate::guards::observe_output(rt.device(), block, &out);
        rt.after_block(block)?;
        Ok(out)
    }

    fn run(&self, f: impl FnOnce() -> Tensor) -> Tensor {
        // `Module::forward` cannot return an error; like tch's own layers, a failure panics.
        self.try_run(f)
            .unwrap_or_else(|e| panic!("stagehand layer {}: {e}", self.index))
    }
}

macro_rules! managed_layer {
    ($(#[$m:meta])* $name:ident, $inner:ty) => {
        $(#[$m])*
        #[derive(Debug)]
        pub struct $name {
            /// The tch layer (its tensors point into the runtime's buffers while resident).
            pub inner: $inner,
            layer: Layer,
        }

        impl $name {
            /// The layer's block (registering every layer's block if the model has not run yet).
            ///
            /// # Panics
            /// When the blocks cannot be registered; [`try_block`](Self::try_block) returns the
            /// error instead.
            pub fn block(&self) -> BlockId {
                self.try_block().unwrap_or_else(|e| panic!("stagehand layer: {e}"))
            }

            /// The layer's block, or why it could not be registered.
            pub fn try_block(&self) -> Result<BlockId> {
                self.layer.block()
            }

            /// `forward` with errors returned instead of panicking.
            pub fn try_forward(&self, xs: &Tensor) -> Result<Tensor> {
                self.layer.try_run(|| self.inner.forward(xs))
            }
        }

        impl Module for $name {
            fn forward(&self, xs: &Tensor) -> Tensor {
                self.layer.run(|| self.inner.forward(xs))
            }
        }
    };
}

managed_layer!(
    /// A managed `tch::nn::Linear`.
    Linear,
    tch::nn::Linear
);
managed_layer!(
    /// A managed `tch::nn::Conv2D`.
    Conv2D,
    tch::nn::Conv2D
);
managed_layer!(
    /// A managed `tch::nn::Embedding`.
    Embedding,
    tch::nn::Embedding
);

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

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn repeated_structure_makes_the_blocks() {
        let paths = names(&[
            "tok",
            "pos",
            "blocks.0.qkv",
            "blocks.0.mlp.fc",
            "blocks.1.qkv",
            "blocks.1.mlp.fc",
            "head",
            "heads.0",
            "single.0.fc",
        ]);
        let got = group_layers(&paths, &Grouping::Repeated);
        assert_eq!(
            got,
            names(&["tok", "pos", "blocks.0", "blocks.0", "blocks.1", "blocks.1", "head", "heads.0", "single.0.fc"])
        );
        assert_eq!(group_layers(&paths, &Grouping::Layer), paths);
    }
}
