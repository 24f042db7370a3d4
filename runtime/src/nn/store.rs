//! [`ManagedVarStore`]: a `VarStore` whose layers stream through a [`WeightRuntime`], and the
//! table of layers made so far, registered as blocks when the model first runs (sealing).

use super::managed::{Binding, LayerTable};
use super::{group_layers, Grouping, LayerOptions};
use crate::checkpoint::VarStoreCopy;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::optim::{Algorithm, Kernel, Optimizer};
use crate::torch::VariableId;
use crate::weights::runtime::Origin;
use crate::weights::scheduler::{ModelEntry, MAIN_MODEL};
use crate::weights::{WeightConfig, WeightRuntime};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use tch::Tensor;

/// Layers made so far.
#[derive(Debug, Default)]
struct Layers {
    /// Each layer's name and (VarStore name, variable) parameters, in the order made.
    pending: Vec<(String, Vec<(String, Tensor)>)>,
    /// Each layer's block, once sealed.
    blocks: Option<Vec<BlockId>>,
    /// Layers that could not be registered, with why (reported when the model is sealed).
    failed: Vec<String>,
}

/// A model declared on the store (beside the main one): the path prefix its layers live under,
/// its index in the runtime, whether it is frozen.
#[derive(Debug, Clone)]
struct Declared {
    prefix: String,
    model: u32,
    frozen: bool,
}

/// The layer table shared by a store and its layers.
pub(crate) struct Table {
    rt: WeightRuntime,
    grouping: Grouping,
    layers: Mutex<Layers>,
    vars: Arc<Mutex<tch::nn::Variables>>,
    /// Whether sealing places unmanaged variables on the device.
    place: bool,
    /// Models declared beside the main one.
    models: Mutex<Vec<Declared>>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("layers", &self.lock().pending.len()).finish_non_exhaustive()
    }
}

impl LayerTable for Table {
    fn layer_name(&self, i: usize) -> String {
        Table::layer_name(self, i)
    }

    fn block_of(&self, i: usize) -> Result<BlockId> {
        Table::block_of(self, i)
    }

    fn runtime(&self) -> &WeightRuntime {
        Table::runtime(self)
    }

    fn values(&self, i: usize) -> Result<Vec<(String, Tensor)>> {
        Table::values(self, i)
    }
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, Layers> {
        self.layers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn runtime(&self) -> &WeightRuntime {
        &self.rt
    }

    fn declared(&self) -> MutexGuard<'_, Vec<Declared>> {
        self.models.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Declares model `name`: the layers made under the path `name` are its blocks, frozen
    /// (every variable under it stops requiring gradients when the model is sealed) and
    /// quantized as `entry` says. Before the model first runs.
    pub(crate) fn declare(&self, entry: ModelEntry) -> Result<()> {
        let name = entry.name.clone();
        if name.is_empty() || name.contains('.') || name == MAIN_MODEL {
            return Err(Error::Config {
                field: "model",
                value: format!("'{name}'"),
                expected: format!("a name without '.', other than '{MAIN_MODEL}' (the model built on the root path)"),
            });
        }
        if self.sealed() {
            return Err(Error::misuse(
                format!("declaring model '{name}' after the model first ran"),
                "every model declared before the first step or evaluation (the memory plan counts them all)",
            ));
        }
        if self.declared().iter().any(|d| d.prefix == name) {
            return Err(Error::misuse(format!("declaring model '{name}' twice"), "one declaration a model"));
        }
        let taken = self.lock().pending.iter().any(|(l, _)| l == &name || l.starts_with(&format!("{name}.")));
        if taken {
            return Err(Error::misuse(
                format!("declaring model '{name}' after layers were made under its path"),
                "the model declared before its layers are made",
            ));
        }
        let frozen = entry.frozen;
        let model = self.rt.declare_model(entry)?;
        self.declared().push(Declared { prefix: name, model, frozen });
        Ok(())
    }

    /// The declared model a block or layer named `name` belongs to (`None`: the main model).
    fn model_of(&self, name: &str) -> Option<Declared> {
        self.declared()
            .iter()
            .find(|d| name == d.prefix || name.strip_prefix(&d.prefix).is_some_and(|r| r.starts_with('.')))
            .cloned()
    }

    /// Every variable of frozen declared models stops requiring gradients (before their blocks
    /// are registered, which reads it) and leaves the store's trainable list: no gradient, no
    /// optimizer covers it, never a host step; snapshots and checkpoints say it is frozen.
    fn freeze_declared(&self) {
        let frozen: Vec<Declared> = self.declared().iter().filter(|d| d.frozen).cloned().collect();
        if frozen.is_empty() {
            return;
        }
        let under = |name: &str| frozen.iter().any(|d| name.strip_prefix(&d.prefix).is_some_and(|r| r.starts_with('.')));
        let mut vars = self.vars.lock().unwrap_or_else(|p| p.into_inner());
        let mut ids = HashSet::new();
        for (name, t) in &vars.named_variables {
            if under(name) {
                if t.requires_grad() {
                    let _ = t.shallow_clone().set_requires_grad(false);
                }
                ids.insert(VariableId::of(t));
            }
        }
        vars.trainable_variables.retain(|v| !ids.contains(&VariableId::of(&v.tensor)));
    }

    /// Registers block `name` in its model.
    fn register_block(&self, name: &str, params: Vec<(String, Tensor)>) -> Result<BlockId> {
        let model = self.model_of(name);
        if model.as_ref().is_some_and(|m| m.frozen) {
            for (_, t) in &params {
                if t.requires_grad() {
                    let _ = t.shallow_clone().set_requires_grad(false);
                }
            }
        }
        self.rt.register_block_in(name, params, model.map_or(0, |m| m.model))
    }

    /// Adds a layer: `Ok(index)`, or `Err(why)` when it cannot be registered (made after the
    /// model ran and too large for the room's slots). A name already used (two layers on one
    /// path, as tch allows) gets tch's `__N` suffix.
    fn add(&self, name: String, params: Vec<(String, Tensor)>) -> std::result::Result<usize, String> {
        let mut l = self.lock();
        let taken = |n: &str| l.pending.iter().any(|(m, _)| m == n);
        let name = if name.is_empty() {
            // A layer on the root path: named after its first variable, as tch names that.
            params.first().map(|(n, _)| n.clone()).unwrap_or_default()
        } else {
            name
        };
        let name = if taken(&name) { format!("{name}__{}", l.pending.len()) } else { name };
        if l.blocks.is_some() {
            // Made after the model first ran: a block of its own now (it streams through the
            // room's slots when it fits one, or stays resident beside blocks the plan keeps).
            let block = if self.rt.block_id(&name).is_ok() { format!("{name}__{}", l.pending.len()) } else { name.clone() };
            let bytes: u64 = params.iter().map(|(_, t)| crate::torch::tensor_bytes(t)).sum();
            let kept: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            let id = self.register_block(&block, params).map_err(|e| format!("layer '{name}' made after the model first ran: {e}"))?;
            self.rt.announce_models();
            self.rt.bus().publish(crate::events::EventKind::Warning {
                source: crate::events::Owner::Weights,
                message: format!(
                    "layer '{name}' was made after the model first ran: block '{block}' of its own ({bytes} bytes), which the memory plan did not count"
                ),
            });
            l.pending.push((name, kept));
            if let Some(b) = &mut l.blocks {
                b.push(id);
            }
            return Ok(l.pending.len() - 1);
        }
        l.pending.push((name, params));
        Ok(l.pending.len() - 1)
    }

    /// Records a layer that failed to be made (reported by `seal`).
    pub(crate) fn fail(&self, why: String) {
        self.lock().failed.push(why);
    }

    /// Registers every layer's block (once), places the variables the runtime does not manage
    /// on its device, and reports layers that failed.
    pub(crate) fn seal(&self) -> Result<()> {
        let mut l = self.lock();
        if let Some(why) = l.failed.first() {
            return Err(Error::misuse(format!("{} layer(s) could not be made", l.failed.len()), why.clone()));
        }
        if l.blocks.is_some() {
            return Ok(());
        }
        if l.pending.is_empty() {
            // Nothing to register yet: layers may still come.
            drop(l);
            return self.place_unmanaged(&HashSet::new());
        }
        let paths: Vec<String> = l.pending.iter().map(|(n, _)| n.clone()).collect();
        let bytes: Vec<u64> = l
            .pending
            .iter()
            .map(|(_, ps)| ps.iter().map(|(_, t)| crate::torch::tensor_bytes(t)).sum())
            .collect();
        let names = group_layers(&paths, &bytes, &self.grouping);
        let managed: HashSet<VariableId> =
            l.pending.iter().flat_map(|(_, ps)| ps.iter().map(|(_, t)| VariableId::of(t))).collect();
        let mut grouped: Vec<(String, Vec<(String, Tensor)>)> = Vec::new();
        for (name, (_, params)) in names.iter().zip(&l.pending) {
            let params: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            match grouped.iter_mut().find(|(n, _)| n == name) {
                Some((_, ps)) => ps.extend(params),
                None => grouped.push((name.clone(), params)),
            }
        }
        self.freeze_declared();
        let mut ids = BTreeMap::new();
        for (name, params) in grouped {
            match self.register_block(&name, params) {
                Ok(id) => ids.insert(name.clone(), id),
                Err(e) => {
                    // Reported again by every later seal (blocks before it are registered).
                    l.failed.push(e.to_string());
                    return Err(e);
                }
            };
        }
        l.blocks = Some(names.iter().map(|n| ids[n]).collect());
        drop(l);
        self.rt.announce_models();
        self.place_unmanaged(&managed)?;
        self.check_references()
    }

    /// Moves every variable not in `managed` to the compute device (the VarStore may be on the
    /// CPU, where tch's constructors initialise them).
    fn place_unmanaged(&self, managed: &HashSet<VariableId>) -> Result<()> {
        if !self.place {
            return Ok(());
        }
        let dev = self.rt.device().tch_device();
        let vars = self.vars.lock().unwrap_or_else(|p| p.into_inner());
        for t in vars.named_variables.values() {
            if !managed.contains(&VariableId::of(t)) && t.device() != dev {
                let moved = t.f_to_device(dev)?;
                t.shallow_clone().set_data(&moved);
            }
        }
        Ok(())
    }

    /// Ends registration even when no layer was made (the handle's plan is made): a layer made
    /// from now on is a late one, a block of its own.
    pub(crate) fn close_registration(&self) {
        self.freeze_declared();
        let mut l = self.lock();
        if l.blocks.is_none() && l.pending.is_empty() && l.failed.is_empty() {
            l.blocks = Some(Vec::new());
        }
    }

    /// Layer `i`'s block, sealing first.
    pub(crate) fn block_of(&self, i: usize) -> Result<BlockId> {
        self.seal()?;
        self.lock()
            .blocks
            .as_ref()
            .and_then(|b| b.get(i).copied())
            .ok_or_else(|| Error::internal(format!("layer {i} has no block")))
    }

    /// Every managed variable is held only where Stagehand knows: the VarStore, the layer, the
    /// table and the runtime. Another handle (a clone kept from the layer's constructor or from
    /// `Managed::run`, tch's `Path::get` or `Entry` reached through `Deref`, a view made at
    /// construction) reads the variable's placeholder whenever its block is not on the device,
    /// so it is an error naming the variable, never a computation with a placeholder. A graph's
    /// gradient accumulator is not counted; a layer is taken to hold each variable once.
    pub(crate) fn check_references(&self) -> Result<()> {
        let l = self.lock();
        if l.blocks.is_none() {
            return Ok(());
        }
        let held = self.rt.held_references();
        let mut in_store: HashMap<VariableId, usize> = HashMap::new();
        {
            let vars = self.vars.lock().unwrap_or_else(|p| p.into_inner());
            for t in vars.named_variables.values() {
                *in_store.entry(VariableId::of(t)).or_default() += 1;
            }
            for v in &vars.trainable_variables {
                *in_store.entry(VariableId::of(&v.tensor)).or_default() += 1;
            }
        }
        for (layer, params) in &l.pending {
            for (name, t) in params {
                let id = VariableId::of(t);
                // The VarStore's, the table's, the layer's, the runtime's.
                let known = in_store.get(&id).copied().unwrap_or(0) + 2 + held.get(&id).copied().unwrap_or(0);
                let handles = crate::torch::variable::handles(t);
                if handles > known {
                    return Err(Error::misuse(
                        format!(
                            "variable '{name}' of layer '{layer}' has {} handle(s) Stagehand does not know of: a clone kept from its constructor or from Managed::run, tch's Path::get or Path::entry reached through Deref, or a view made from it; between uses the variable points at a placeholder, so such a handle reads no weight",
                            handles - known
                        ),
                        "the weight used inside the layer's Managed::run (its block resident), its value read with Managed::variables or Stagehand::var_store, and no handle of it kept (a layer holds each variable once)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The VarStore paths of every managed parameter (of layers made so far).
    pub(crate) fn managed_names(&self) -> HashSet<String> {
        let l = self.lock();
        let mut names: HashSet<String> = l.pending.iter().flat_map(|(_, ps)| ps.iter().map(|(n, _)| n.clone())).collect();
        drop(l);
        for b in self.rt.blocks() {
            names.extend(b.params.into_iter().map(|p| p.name));
        }
        names
    }

    /// Whether the layers are registered.
    fn sealed(&self) -> bool {
        self.lock().blocks.is_some()
    }

    /// Layer `i`'s name.
    pub(crate) fn layer_name(&self, i: usize) -> String {
        self.lock().pending.get(i).map(|(n, _)| n.clone()).unwrap_or_default()
    }

    /// Canonical values of layer `i`'s parameters (fresh CPU tensors).
    pub(crate) fn values(&self, i: usize) -> Result<Vec<(String, Tensor)>> {
        let params: Vec<(String, Tensor)> = self
            .lock()
            .pending
            .get(i)
            .map(|(_, ps)| ps.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect())
            .unwrap_or_default();
        if !self.sealed() {
            return params
                .into_iter()
                .map(|(n, t)| Ok((n, tch::no_grad(|| t.f_to_device(tch::Device::Cpu)?.f_detach_copy())?)))
                .collect();
        }
        let mut at: HashMap<String, (BlockId, usize)> = HashMap::new();
        for b in self.rt.blocks() {
            for (j, p) in b.params.iter().enumerate() {
                at.insert(p.name.clone(), (b.id, j));
            }
        }
        params
            .into_iter()
            .map(|(n, _)| {
                let (b, j) = at.get(&n).copied().ok_or_else(|| Error::UnknownBlock(n.clone()))?;
                Ok((n, self.rt.host_param(b, j)?))
            })
            .collect()
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
    /// there, then held in host memory); the variables Stagehand does not manage move to the
    /// runtime's device when the model first runs.
    pub fn new(vs: tch::nn::VarStore, opts: LayerOptions) -> Result<ManagedVarStore> {
        let device = match (&opts.device, vs.device()) {
            (Some(d), _) => d.clone(),
            (None, tch::Device::Cuda(i)) => Device::cuda(i)?,
            (None, _) => {
                if tch::Cuda::is_available() {
                    // The VarStore holds the host copies, so it is usually on the CPU; without a
                    // device the layers would then compute on the CPU too, quietly, on a machine
                    // with a GPU. Said once, on stderr and the bus.
                    let message = "layers compute on the host device: the VarStore is on the CPU and LayerOptions::device is unset, although CUDA is available; set device: Some(Device::auto(..)) or Some(Device::cuda(0)?) to compute on the GPU".to_string();
                    eprintln!("stagehand: {message}");
                    opts.telemetry.publish(crate::events::EventKind::Warning { source: crate::events::Owner::Weights, message });
                }
                Device::host(opts.vram_budget.unwrap_or(u64::MAX / 4))
            }
        };
        let total = device.is_cuda().then(|| device.info().total_bytes);
        let mut cfg = WeightConfig::layer_auto(1, opts.prefetch_k, opts.vram_budget, opts.ram_budget, total);
        cfg.inference_mode = opts.inference_mode;
        cfg.precision = opts.precision;
        cfg.cyclic_pins = opts.cyclic_pins;
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
            vars: vs.variables_.clone(),
            place: opts.place_unmanaged,
            models: Mutex::new(Vec::new()),
        });
        // Weak: the runtime must not keep its own table alive (the table holds the runtime).
        let weak: Weak<Table> = Arc::downgrade(&table);
        rt.set_origin(Origin {
            vars: vs.variables_.clone(),
            // Each optimizer step: layers registered, and no handle of a managed variable
            // kept where it would read a placeholder.
            seal: Some(Arc::new(move || weak.upgrade().map_or(Ok(()), |t| t.seal().and_then(|_| t.check_references())))),
        });
        Ok(ManagedVarStore { vs, rt, opts, table })
    }

    /// The runtime (for metrics, the optimizer, shutdown).
    pub fn runtime(&self) -> &WeightRuntime {
        &self.rt
    }

    /// The device the model computes on (where variables Stagehand does not manage live once
    /// the model has run, and where inputs belong).
    pub fn device(&self) -> tch::Device {
        self.rt.device().tch_device()
    }

    /// A copy of every variable with its real value, in a plain `tch::nn::VarStore` (same names,
    /// trainability, groups): for inspection and tch APIs that read a VarStore. The model's own
    /// managed variables point at placeholders between uses, so the store itself is never handed
    /// out; save and load with [`save`](Self::save) and [`load`](Self::load).
    pub fn var_store(&self) -> Result<VarStoreCopy> {
        VarStoreCopy::take(&self.vs.variables_, Some(&self.rt))
    }

    /// The wrapped VarStore itself, whose managed variables are placeholders between uses.
    pub(crate) fn raw_var_store(&self) -> &tch::nn::VarStore {
        &self.vs
    }

    /// Registers every layer made so far as blocks now (otherwise this happens when the model
    /// first runs); returns the blocks in registration order. Fails with the reason when a
    /// layer could not be made or a block does not fit the weights' room.
    pub fn seal(&self) -> Result<Vec<BlockId>> {
        self.table.seal()?;
        Ok(self.rt.blocks().iter().map(|b| b.id).collect())
    }

    /// The VarStore paths of every managed parameter (of layers made so far).
    pub fn managed_names(&self) -> HashSet<String> {
        self.table.managed_names()
    }

    /// The layer table (for the handle's planner).
    pub(crate) fn table(&self) -> Arc<Table> {
        self.table.clone()
    }

    /// The wrapped VarStore's variables.
    pub(crate) fn vars(&self) -> Arc<Mutex<tch::nn::Variables>> {
        self.vs.variables_.clone()
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

    /// One optimizer over every trainable variable, managed or not, from one of tch's configs
    /// (`tch::nn::AdamW::default()`, ...); streamed blocks step on the host with the exact kernel
    /// on the host device and the fused one on CUDA.
    pub fn optimizer(&self, algorithm: impl Into<Algorithm>, lr: f64) -> Result<Optimizer> {
        let algorithm = algorithm.into();
        let kernel = Kernel::auto(&algorithm, self.rt.device().is_cuda());
        Optimizer::for_var_store(&self.rt, algorithm, lr, kernel)
    }

    /// Saves every variable to `path` with tch's names, in tch's format for the extension
    /// (`.safetensors`, else libtorch's archive), atomically: real values, never placeholders
    /// (see [`crate::checkpoint`]). Plain tch's `VarStore::load` reads it.
    pub fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        crate::checkpoint::save_vars(path.as_ref(), &self.vs.variables_, Some(&self.rt))
    }

    /// Loads every variable from `path` (a checkpoint of this model from Stagehand or plain
    /// tch); checks every name, shape and dtype before it changes anything. In layer mode the
    /// step in progress ends first (steps end by themselves).
    pub fn load(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.load_inner(path.as_ref(), false).map(|_| ())
    }

    /// Loads the variables `path` has; returns the names it lacks (tch's `load_partial`).
    pub fn load_partial(&self, path: impl AsRef<std::path::Path>) -> Result<Vec<String>> {
        self.load_inner(path.as_ref(), true)
    }

    fn load_inner(&self, path: &std::path::Path, partial: bool) -> Result<Vec<String>> {
        if self.opts.auto_step {
            self.rt.finish()?;
        }
        crate::checkpoint::load_vars(path, &self.vs.variables_, Some(&self.rt), partial)
    }

    /// Registers a layer made of `params` (VarStore name, variable), casting them to the
    /// storage dtype when one is set.
    pub(crate) fn register(&self, name: String, mut params: Vec<(String, Tensor)>) -> Binding {
        if params.is_empty() {
            return Binding::plain(name);
        }
        if let Some(kind) = self.opts.dtype {
            for (n, t) in &mut params {
                if t.is_floating_point() && t.kind() != kind {
                    match tch::no_grad(|| t.f_to_kind(kind)) {
                        Ok(cast) => t.set_data(&cast),
                        Err(e) => {
                            let why = format!("casting '{n}' to {kind:?}: {e}");
                            self.table.fail(why.clone());
                            return Binding::failed(name, why);
                        }
                    }
                }
            }
        }
        let hooks = self.opts.install_hooks && !self.opts.inference_mode;
        match self.table.add(name.clone(), params) {
            Ok(index) => Binding::layer(self.table.clone(), index, hooks),
            Err(why) => Binding::failed(name, why),
        }
    }

    /// The VarStore names of the variables among `tensors` (by identity), in their order.
    pub(crate) fn names_of(&self, tensors: &[&Tensor]) -> Vec<(String, Tensor)> {
        let vars = self.vs.variables_.lock().unwrap_or_else(|p| p.into_inner());
        let by_id: HashMap<VariableId, &String> = vars.named_variables.iter().map(|(n, t)| (VariableId::of(t), n)).collect();
        tensors
            .iter()
            .filter_map(|t| by_id.get(&VariableId::of(t)).map(|n| ((*n).clone(), t.shallow_clone())))
            .collect()
    }

    /// The identities of every variable now (to find the ones a constructor adds).
    pub(crate) fn variable_ids(&self) -> HashSet<VariableId> {
        let vars = self.vs.variables_.lock().unwrap_or_else(|p| p.into_inner());
        vars.named_variables.values().map(VariableId::of).collect()
    }

    /// The variables not in `before`, sorted by name.
    pub(crate) fn added_since(&self, before: &HashSet<VariableId>) -> Vec<(String, Tensor)> {
        let vars = self.vs.variables_.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, Tensor)> = vars
            .named_variables
            .iter()
            .filter(|(_, t)| !before.contains(&VariableId::of(t)))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}
