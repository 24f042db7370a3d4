//! [`Optimizer`]: one optimizer over a model's streamed blocks (stepped on the host) and its
//! other trainable variables (stepped on their device), with tch's surface and groups.
//!
//! Made from a runtime that knows its VarStore ([`Optimizer::for_var_store`], what
//! `Stagehand::optimizer` does), it covers every trainable variable of that store, and adds
//! variables made later at the next step, as tch's optimizer does. Made from an explicit list
//! ([`Optimizer::new`]), it covers the runtime's blocks and that list; a trainable variable of
//! the runtime's VarStore that neither covers is an error at the first step, never a silent
//! freeze.

use super::groups::Groups;
use super::host::{lock_groups, BlockJob, BlockOptimizer, HostParam};
use super::fit::fit_state;
use crate::weights::stepper::{self, Stepper};
use super::{Algorithm, GradClip, Kernel};
use crate::error::{Error, Result};
use crate::precision::StateStorage;
use crate::torch::optim::set_grad;
use crate::torch::{ParamState, TorchOptimizer, VariableId};
use crate::weights::runtime::Origin;
use crate::weights::WeightRuntime;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// The maker of host steps the weight runtime calls (on the training thread, when a block's
/// step is queued), over the blocks' optimizer states and the group options of that moment.
fn job_maker(host: Arc<HashMap<u32, Arc<Mutex<BlockOptimizer>>>>, groups: Arc<Mutex<Groups>>, grad_scale: f32) -> stepper::JobMaker {
    Box::new(move |id, received, ready| {
        let state = host
            .get(&id.0)
            .ok_or_else(|| Error::internal(format!("block {id} trains but has no host optimizer")))?;
        Ok(Box::new(BlockJob {
            state: state.clone(),
            received: received.to_vec(),
            groups: lock_groups(&groups).clone(),
            grad_scale,
            ready,
        }) as Box<dyn stepper::Job>)
    })
}

/// Which variables the optimizer covers besides the runtime's streamed blocks.
enum Cover {
    /// Every trainable variable of the runtime's VarStore.
    All,
    /// Exactly these.
    Given(Vec<Tensor>),
}

/// A variable stepped on the device.
pub(super) struct DeviceParam {
    pub id: VariableId,
    pub var: Tensor,
    pub name: Option<String>,
    /// A 16-bit variable's float32 master on its device: the device optimizer steps the master
    /// and the variable gets its rounding, so 16-bit weights are never updated in 16 bits.
    pub master: Option<Tensor>,
    /// A resident block's variable, whose handles here the runtime was told of.
    pub noted: bool,
}

/// A trainable variable of the origin VarStore, in the store's order (tch's optimizer order).
pub(super) struct Trainable {
    pub id: VariableId,
    pub name: String,
    pub group: usize,
    pub var: Tensor,
}

/// The origin's trainable variables with their names and groups.
pub(super) fn trainable(origin: &Origin) -> Vec<Trainable> {
    let v = origin.vars.lock().unwrap_or_else(|p| p.into_inner());
    let names: HashMap<VariableId, &String> = v.named_variables.iter().map(|(n, t)| (VariableId::of(t), n)).collect();
    v.trainable_variables
        .iter()
        .filter_map(|var| {
            let id = VariableId::of(&var.tensor);
            names.get(&id).map(|n| Trainable {
                id,
                name: (*n).clone(),
                group: var.group,
                var: var.tensor.shallow_clone(),
            })
        })
        .collect()
}

/// The optimizer over a model's streamed and unstreamed trainable variables.
///
/// Blocks registered after it was made (layer mode registers blocks when the model first runs)
/// get their host optimizer at the first step that sees them; device variables join the device
/// optimizer at the first step that sees them.
pub struct Optimizer {
    // Field order: host state (which views the runtime's host memory) drops before the runtime.
    pub(super) host: Arc<HashMap<u32, Arc<Mutex<BlockOptimizer>>>>,
    pub(super) device: Option<TorchOptimizer>,
    pub(super) device_params: Vec<DeviceParam>,
    device_applied: u64,
    stepper: Arc<Stepper>,
    pub(super) groups: Arc<Mutex<Groups>>,
    pub(super) algorithm: Algorithm,
    kernel: Kernel,
    /// How host optimizer state is stored.
    storage: StateStorage,
    /// Gradients are multiplied by this before the update (1 / the loss scale under fp16).
    grad_scale: f32,
    cover: Cover,
    pub(super) origin: Option<Origin>,
    clip: Option<GradClip>,
    /// Host steps of streamed blocks start during backward (see `overlap_next_backward`).
    overlap: bool,
    /// What the optimizers were last built for: (trainable variables of the VarStore, streamed
    /// trained blocks, resident trained variables); nothing to do while it is unchanged.
    built: Option<(usize, usize, usize)>,
    /// The `built` key the coverage was last checked for.
    checked: Option<(usize, usize, usize)>,
    /// Loaded state of parameters whose optimizer is not made yet, by name.
    pub(super) pending: HashMap<String, ParamState>,
    pub(super) rt: WeightRuntime,
    /// In a data-parallel group: this rank's place in it (see `parallel`).
    pub(super) member: Option<crate::collective::Membership>,
    /// The device variables' gradients of this window were summed over the group.
    device_reduced: bool,
    /// Those sums still in flight (reported once they completed).
    reductions: Vec<crate::collective::InFlight>,
    /// In a group, each streamed parameter's piece this rank steps: (offset in the parameter,
    /// elements, the parameter's shape), by name (for the optimizer state file).
    pub(super) pieces: HashMap<String, (i64, i64, Vec<i64>)>,
}

impl Drop for Optimizer {
    fn drop(&mut self) {
        let mut s = self.rt.lock();
        for p in self.device_params.iter().filter(|p| p.noted) {
            s.note_references(p.id, -2);
        }
    }
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("algorithm", &self.algorithm)
            .field("host_blocks", &self.host.len())
            .field("device_params", &self.device_params.len())
            .field("clip", &self.clip)
            .finish_non_exhaustive()
    }
}

impl Optimizer {
    /// An optimizer over `rt`'s trained blocks and the trainable variables in `unmanaged` (those
    /// the runtime does not stream, e.g. layer norms). When `rt` knows its VarStore, a trainable
    /// variable of it that is neither managed nor in `unmanaged` is an error at the first step.
    pub fn new(
        rt: &WeightRuntime,
        unmanaged: Vec<Tensor>,
        algorithm: impl Into<Algorithm>,
        lr: f64,
        kernel: Kernel,
    ) -> Result<Optimizer> {
        Optimizer::make(rt, Cover::Given(unmanaged), algorithm.into(), lr, kernel)
    }

    /// An optimizer over every trainable variable of the VarStore `rt` was made from
    /// ([`WeightRuntime::from_var_store`], a `ManagedVarStore`), managed or not, including
    /// variables made later (as tch's `OptimizerConfig::build`).
    pub fn for_var_store(rt: &WeightRuntime, algorithm: impl Into<Algorithm>, lr: f64, kernel: Kernel) -> Result<Optimizer> {
        if rt.origin().is_none() {
            return Err(Error::misuse(
                "an optimizer for the runtime's VarStore",
                "a runtime made from a VarStore (WeightRuntime::from_var_store or a ManagedVarStore); for a runtime built block by block, use Optimizer::new with the variables it does not manage",
            ));
        }
        Optimizer::make(rt, Cover::All, algorithm.into(), lr, kernel)
    }

    fn make(rt: &WeightRuntime, cover: Cover, algorithm: Algorithm, lr: f64, kernel: Kernel) -> Result<Optimizer> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::Config {
                field: "lr",
                value: lr.to_string(),
                expected: "a finite learning rate at or above 0".into(),
            });
        }
        if kernel == Kernel::Fused && algorithm.fused().is_none() {
            return Err(algorithm.no_fused_kernel());
        }
        let origin = rt.origin();
        // tch makes a group for every group number its variables use when the optimizer is built.
        let count = origin.as_ref().map_or(1, |o| trainable(o).iter().map(|t| t.group + 1).max().unwrap_or(1));
        let stepper = Arc::new(Stepper::new(rt.bus().clone())?);
        rt.lock().attach_stepper(stepper.clone())?;
        Ok(Optimizer {
            host: Arc::new(HashMap::new()),
            device: None,
            device_params: Vec::new(),
            device_applied: 0,
            stepper,
            groups: Arc::new(Mutex::new(Groups::new(algorithm.group_defaults(lr), count))),
            algorithm,
            kernel,
            storage: StateStorage::Fp32,
            grad_scale: 1.0,
            cover,
            origin,
            clip: None,
            overlap: true,
            built: None,
            checked: None,
            pending: HashMap::new(),
            rt: rt.clone(),
            member: rt.membership(),
            device_reduced: false,
            reductions: Vec::new(),
            pieces: HashMap::new(),
        })
    }

    /// Threads the host steps of streamed blocks use from the next step on (`None`: libtorch's
    /// default, every core). Their results do not depend on it.
    pub fn set_host_threads(&self, threads: Option<usize>) {
        self.stepper.set_threads(threads);
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Stores the host optimizer's state of streamed blocks in `storage` (default float32):
    /// bfloat16 halves it, 8 bits block-wise quarters it. Compressed state needs the fused
    /// kernel and Adam or AdamW. Only before the first step.
    pub fn set_state_storage(&mut self, storage: StateStorage) -> Result<()> {
        if !self.host.is_empty() {
            return Err(Error::misuse("changing the optimizer state's storage", "set it before the first step"));
        }
        if storage != StateStorage::Fp32 && (self.kernel != Kernel::Fused || self.algorithm.fused().is_none()) {
            return Err(Error::Config {
                field: "optimizer_state",
                value: storage.name().into(),
                expected: format!(
                    "fp32 for {} with the {:?} kernel (compressed state needs Adam or AdamW with the fused kernel)",
                    self.algorithm.name(),
                    self.kernel
                ),
            });
        }
        self.storage = storage;
        Ok(())
    }

    /// How the host optimizer's state is stored.
    pub fn state_storage(&self) -> StateStorage {
        self.storage
    }

    /// Whether a gradient of this window holds an infinity or NaN (fp16's overflow check): the
    /// streamed blocks' host gradients (complete once `collect_grads` returned) and the device
    /// variables' gradients.
    pub(crate) fn found_inf(&mut self) -> Result<bool> {
        let local = self.found_inf_here()?;
        match &self.member {
            // Every rank skips the step, or none does.
            Some(m) => m.exchange.any(m.rank, "the overflow check", local),
            None => Ok(local),
        }
    }

    fn found_inf_here(&mut self) -> Result<bool> {
        self.ensure_built()?;
        self.reduce_device_grads()?;
        let finite = |t: &Tensor| -> Result<bool> { Ok(t.f_isfinite()?.f_all()?.f_int64_value(&[])? != 0) };
        let ids: Vec<u32> = self.host.keys().copied().collect();
        for id in ids {
            for (_, g) in self.rt.received_grads(crate::events::BlockId(id))? {
                if !finite(&g)? {
                    return Ok(true);
                }
            }
        }
        for p in &self.device_params {
            let g = p.var.grad();
            if g.defined() && !finite(&g)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Makes the host optimizers of the blocks registered so far, with their state allocated (the
    /// handle does it while it prepares, so the first step does not).
    pub(crate) fn prepare(&mut self) -> Result<()> {
        self.ensure_built()
    }

    /// Multiplies every gradient by `scale` before the next updates (fp16's 1 / loss scale).
    pub(crate) fn set_grad_scale(&mut self, scale: f32) {
        self.grad_scale = scale;
    }

    /// Clips gradients in every [`step`](Self::step) from now on (`None`: no clipping). Steps
    /// that clip start the host steps of streamed blocks after backward instead of during it.
    pub fn set_grad_clip(&mut self, clip: Option<GradClip>) {
        self.clip = clip;
    }

    /// Whether the host steps of streamed blocks start while backward runs, each as soon as
    /// backward has left its block and its gradients are complete (default on; results are the
    /// same either way). Off, they start when the optimizer steps.
    pub fn set_overlap_backward(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Makes the host optimizers of trained blocks that have none yet, and adds device
    /// variables the device optimizer does not hold yet.
    pub(super) fn ensure_built(&mut self) -> Result<()> {
        if let Some(o) = &self.origin {
            o.seal()?;
        }
        let (streamed, resident) = self.rt.lock().trained();
        let key = (self.trainable_count(), streamed.len(), resident.len());
        if self.built == Some(key) {
            return Ok(());
        }
        let all = self.origin.as_ref().map(trainable).unwrap_or_default();
        let group_by_id: HashMap<VariableId, usize> = all.iter().map(|t| (t.id, t.group)).collect();
        let name_by_id: HashMap<VariableId, &str> = all.iter().map(|t| (t.id, t.name.as_str())).collect();
        let group_by_name: HashMap<&str, usize> = all.iter().map(|t| (t.name.as_str(), t.group)).collect();
        let specs = self.rt.blocks();
        for id in streamed {
            if self.host.contains_key(&id.0) {
                continue;
            }
            let hp = self.rt.lock().host_params(id)?;
            let spec = specs.get(id.0 as usize).ok_or_else(|| Error::UnknownBlock(id.to_string()))?;
            let params: Vec<HostParam> = hp
                .into_iter()
                .map(|p| {
                    let name = spec.params[p.index].name.clone();
                    if let Some((at, n)) = p.piece {
                        self.pieces.insert(name.clone(), (at, n, spec.params[p.index].shape.clone()));
                    }
                    let group = group_by_name.get(name.as_str()).copied().unwrap_or(0);
                    HostParam { name, value: p.value, grad: p.grad, copy: p.copy, group }
                })
                .collect();
            if let Some(g) = params.iter().map(|p| p.group).max() {
                lock_groups(&self.groups).ensure(g);
            }
            let mut state = BlockOptimizer::new(params, self.algorithm, self.kernel, self.storage)?;
            for i in 0..state.params().len() {
                if let Some(st) = self.pending.remove(&state.params()[i].name) {
                    let st = self.own_piece(&state.params()[i].name, st)?;
                    let st = fit_state(&self.algorithm, &state.params()[i].name, &st, &state.params()[i].value)?;
                    state.set_state(i, &st)?;
                }
            }
            Arc::make_mut(&mut self.host).insert(id.0, Arc::new(Mutex::new(state)));
        }
        let managed: HashSet<&str> = specs.iter().flat_map(|b| b.params.iter().map(|p| p.name.as_str())).collect();
        let resident_ids: HashSet<VariableId> = resident.iter().map(VariableId::of).collect();
        let mut want: Vec<Tensor> = resident;
        match &self.cover {
            Cover::All => want.extend(
                all.iter()
                    .filter(|t| !managed.contains(t.name.as_str()))
                    .map(|t| t.var.shallow_clone()),
            ),
            Cover::Given(list) => want.extend(list.iter().map(|t| t.shallow_clone())),
        }
        let have: HashSet<VariableId> = self.device_params.iter().map(|p| p.id).collect();
        for var in want {
            let id = VariableId::of(&var);
            // Frozen variables join too, as in tch (libtorch skips a parameter without a
            // gradient), so unfreezing one later trains it.
            if have.contains(&id) || self.device_params.iter().any(|p| p.id == id) {
                continue;
            }
            let group = group_by_id.get(&id).copied().unwrap_or(0);
            lock_groups(&self.groups).ensure(group);
            let opt = match &mut self.device {
                Some(o) => o,
                None => self.device.insert(TorchOptimizer::new(&self.algorithm.torch_options(lock_groups(&self.groups).get(0).lr))?),
            };
            // A 16-bit variable trains through a float32 master beside it.
            let master = if matches!(var.kind(), Kind::BFloat16 | Kind::Half) && var.requires_grad() {
                let m = tch::no_grad(|| var.f_to_kind(Kind::Float))?.f_detach_copy()?.set_requires_grad(true);
                Some(m)
            } else {
                None
            };
            let stepped = master.as_ref().unwrap_or(&var);
            opt.add(stepped, group)?;
            let name = name_by_id.get(&id).map(|n| n.to_string());
            if let Some(st) = name.as_ref().and_then(|n| self.pending.remove(n)) {
                let st = fit_state(&self.algorithm, name.as_deref().unwrap_or("?"), &st, stepped)?;
                opt.set_state(stepped, &st)?;
            }
            self.device_applied = 0;
            let noted = resident_ids.contains(&id);
            if noted {
                // A resident block's variable: this handle, and the device optimizer's unless
                // it steps a float32 master instead.
                self.rt.lock().note_references(id, if master.is_some() { 1 } else { 2 });
            }
            self.device_params.push(DeviceParam { id, var, name, master, noted });
        }
        self.built = Some(key);
        Ok(())
    }

    /// How many trainable variables the runtime's VarStore has (0 without one).
    fn trainable_count(&self) -> usize {
        self.origin
            .as_ref()
            .map_or(0, |o| o.vars.lock().unwrap_or_else(|p| p.into_inner()).trainable_variables.len())
    }

    /// The variables given to [`Optimizer::new`] (`None` when it covers the whole VarStore).
    pub(super) fn given_ids(&self) -> Option<HashSet<VariableId>> {
        match &self.cover {
            Cover::All => None,
            Cover::Given(list) => Some(list.iter().map(VariableId::of).collect()),
        }
    }

    /// A trainable variable of the runtime's VarStore that nothing steps is an error.
    fn check_coverage(&mut self) -> Result<()> {
        let (Cover::Given(_), Some(origin)) = (&self.cover, &self.origin) else {
            return Ok(());
        };
        if self.checked.is_some() && self.checked == self.built {
            return Ok(());
        }
        let managed: HashSet<String> = self.rt.blocks().into_iter().flat_map(|b| b.params.into_iter().map(|p| p.name)).collect();
        let stepped: HashSet<VariableId> = self.device_params.iter().map(|p| p.id).collect();
        for t in trainable(origin) {
            if t.var.requires_grad() && !managed.contains(&t.name) && !stepped.contains(&t.id) {
                return Err(Error::misuse(
                    format!("variable '{}' is trainable but no optimizer steps it", t.name),
                    "an optimizer that covers it: make it with Stagehand::optimizer, ManagedVarStore::optimizer or Optimizer::for_var_store (they cover every trainable variable), or pass it to Optimizer::new in `unmanaged`",
                ));
            }
        }
        self.checked = self.built;
        Ok(())
    }

    /// Copies changed group options into the device optimizer.
    fn apply_groups(&mut self) -> Result<()> {
        let groups = lock_groups(&self.groups).clone();
        if let Some(d) = &mut self.device {
            if self.device_applied != groups.version() {
                for g in 0..d.groups() {
                    let o = groups.get(g);
                    d.set_group(g, o.lr, o.weight_decay, o.momentum)?;
                }
                self.device_applied = groups.version();
            }
        }
        Ok(())
    }

    /// Clears every gradient (libtorch's `zero_grad(set_to_none)`): device gradients go, the next
    /// gradient of a streamed parameter replaces its host gradient. Never evicts a block.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.device_reduced = false;
        self.finish_reductions(true)?;
        if let Some(d) = &mut self.device {
            d.zero_grad()?;
        }
        // Variables no optimizer holds yet (before the first step, or made since).
        if self.built.is_some_and(|(n, _, _)| n == self.trainable_count()) {
            return self.rt.zero_grads();
        }
        let vars: Vec<Tensor> = match (&self.cover, &self.origin) {
            (Cover::Given(list), _) => list.iter().map(|t| t.shallow_clone()).collect(),
            (Cover::All, Some(o)) => trainable(o).into_iter().map(|t| t.var).collect(),
            (Cover::All, None) => Vec::new(),
        };
        for v in &vars {
            if v.grad().defined() {
                set_grad(v, None)?;
            }
        }
        self.rt.zero_grads()
    }

    /// Steps every trainable variable: device ones now, streamed blocks on the host worker in
    /// the order the next forward needs them (it returns before they finish; a block is not
    /// loaded before its step has run). Clips first when [`set_grad_clip`](Self::set_grad_clip)
    /// asked for it.
    pub fn step(&mut self) -> Result<()> {
        self.ensure_built()?;
        self.check_coverage()?;
        let updating = std::cell::Cell::new(false);
        let r = self.step_checked(&updating);
        if let Err(e) = &r {
            // Once the device's optimizer stepped, or a host step was queued, a failure leaves
            // the model part stepped.
            self.rt.fail_step(updating.get(), || e.to_string());
        }
        r
    }

    fn step_checked(&mut self, updating: &std::cell::Cell<bool>) -> Result<()> {
        self.reduce_device_grads()?;
        self.apply_groups()?;
        match self.clip {
            Some(GradClip::Value(max)) => self.clip_grad_value(max)?,
            Some(GradClip::Norm(max)) => {
                self.clip_grad_norm(max)?;
            }
            None => {}
        }
        if self.device.is_some() {
            self.device_params_in()?;
            if let Some(d) = &mut self.device {
                updating.set(true);
                d.step()?;
            }
            self.device_params_out()?;
        }
        let mut make = job_maker(self.host.clone(), self.groups.clone(), self.grad_scale);
        self.rt.lock().submit_updates(|id, received, ready| make(id, received, ready))
    }

    /// Before the device step: 16-bit variables' gradients go to their masters in float32, and
    /// every gradient is unscaled.
    fn device_params_in(&self) -> Result<()> {
        let scale = f64::from(self.grad_scale);
        tch::no_grad(|| -> Result<()> {
            for p in &self.device_params {
                let mut g = p.var.grad();
                match &p.master {
                    Some(m) if g.defined() => {
                        let mut g32 = g.f_to_kind(Kind::Float)?;
                        if scale != 1.0 {
                            g32 = g32.f_mul_scalar(scale)?;
                        }
                        set_grad(m, Some(&g32))?;
                    }
                    Some(m) => set_grad(m, None)?,
                    None if g.defined() && scale != 1.0 => {
                        let _ = g.f_mul_scalar_(scale)?;
                    }
                    None => {}
                }
            }
            Ok(())
        })
    }

    /// After the device step: 16-bit variables take their masters' rounding.
    fn device_params_out(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for p in &self.device_params {
                if let Some(m) = &p.master {
                    if m.grad().defined() {
                        p.var.detach().f_copy_(m)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Declares that an optimizer step follows the next backward: the host steps of streamed
    /// blocks then start while backward is still running (each as soon as backward has left
    /// its block), instead of when [`step`](Self::step) is called. `step` must follow. A no-op
    /// while gradients are clipped (clipping needs every gradient first).
    pub fn overlap_next_backward(&mut self) -> Result<()> {
        if self.clip.is_some() || !self.overlap {
            return Ok(());
        }
        self.ensure_built()?;
        self.rt.lock().arm_updates(job_maker(self.host.clone(), self.groups.clone(), self.grad_scale))
    }

    /// `zero_grad`, `backward` of `loss`, `step` (tch's `backward_step`), with the host steps
    /// overlapping the backward.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad()?;
        self.overlap_next_backward()?;
        self.failing_step(|o| {
            loss.f_backward()?;
            o.rt.after_backward()
        })?;
        self.step()
    }

    /// `zero_grad`, `backward`, every gradient element clamped to `[-max, max]`, `step` (tch's
    /// `backward_step_clip`).
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) -> Result<()> {
        self.zero_grad()?;
        self.failing_step(|o| {
            loss.f_backward()?;
            o.rt.after_backward()?;
            o.clip_grad_value(max)
        })?;
        self.step()
    }

    /// `zero_grad`, `backward`, gradients scaled to a total norm of at most `max`, `step` (tch's
    /// `backward_step_clip_norm`).
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) -> Result<()> {
        self.zero_grad()?;
        self.failing_step(|o| {
            loss.f_backward()?;
            o.rt.after_backward()?;
            o.clip_grad_norm(max).map(|_| ())
        })?;
        self.step()
    }

    /// Runs part of a step whose backward may already have queued host steps: when it fails
    /// then, the weight runtime holds the model part stepped and refuses every later use of it,
    /// instead of a retried step training on from it.
    fn failing_step(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let r = f(self);
        if let Err(e) = &r {
            self.rt.fail_step(false, || e.to_string());
        }
        r
    }

    /// Sets the learning rate of every group (and of groups made later).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        lock_groups(&self.groups).set_all(|o| o.lr = lr);
        Ok(())
    }

    /// Sets the learning rate of one group.
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        lock_groups(&self.groups).set(group, "set_lr_group", |o| o.lr = lr)
    }

    /// Sets the momentum of every group (Adam's `beta1`, as tch's `set_momentum`).
    pub fn set_momentum(&mut self, momentum: f64) -> Result<()> {
        lock_groups(&self.groups).set_all(|o| o.momentum = momentum);
        Ok(())
    }

    /// Sets the momentum of one group.
    pub fn set_momentum_group(&mut self, group: usize, momentum: f64) -> Result<()> {
        lock_groups(&self.groups).set(group, "set_momentum_group", |o| o.momentum = momentum)
    }

    /// Sets the weight decay of every group.
    pub fn set_weight_decay(&mut self, weight_decay: f64) -> Result<()> {
        lock_groups(&self.groups).set_all(|o| o.weight_decay = weight_decay);
        Ok(())
    }

    /// Sets the weight decay of one group (tch's `set_weight_decay_group`, for the groups made
    /// with `Path::set_group`).
    pub fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) -> Result<()> {
        lock_groups(&self.groups).set(group, "set_weight_decay_group", |o| o.weight_decay = weight_decay)
    }

    /// The options of `group` now.
    pub fn group_options(&self, group: usize) -> super::GroupOptions {
        lock_groups(&self.groups).get(group)
    }

    /// Waits until every host step has run (for reading weights back, or timing).
    pub fn wait(&self) -> Result<std::time::Duration> {
        self.stepper.wait_all()
    }

    /// Time the host worker spent stepping since the last call.
    pub fn take_host_busy(&self) -> std::time::Duration {
        self.stepper.take_busy()
    }

    /// In a data-parallel group: sums the gradients of the variables stepped on the device
    /// (those Stagehand does not stream) over the ranks, once per accumulation window, so that
    /// every rank's device step computes the same values. One all-reduce per dtype, in the
    /// optimizer's order of variables (the same on every rank). The compute stream waits for it.
    pub(crate) fn reduce_device_grads(&mut self) -> Result<()> {
        let Some(m) = self.member.clone() else { return Ok(()) };
        if self.device_reduced {
            return Ok(());
        }
        self.ensure_built()?;
        self.finish_reductions(false)?;
        let grads: Vec<Tensor> = self.device_params.iter().map(|p| p.var.grad()).filter(|g| g.defined()).collect();
        let mut kinds: Vec<Kind> = Vec::new();
        for g in &grads {
            if !kinds.contains(&g.kind()) {
                kinds.push(g.kind());
            }
        }
        let device = self.rt.device().clone();
        for kind in kinds {
            let group: Vec<&Tensor> = grads.iter().filter(|g| g.kind() == kind).collect();
            let flat = Tensor::f_cat(&group.iter().map(|g| g.f_reshape([-1])).collect::<std::result::Result<Vec<_>, _>>()?, 0)?;
            let subject = format!("{} {kind:?} gradients of variables stepped on the device", group.len());
            let op = m.collective.all_reduce(flat.shallow_clone(), crate::events::Owner::Trainer, &subject)?;
            // The copies back run on the compute stream, after the sum.
            device.compute_wait(op.done())?;
            tch::no_grad(|| -> Result<()> {
                let mut at = 0i64;
                for g in &group {
                    let n = g.numel() as i64;
                    g.shallow_clone().f_copy_(&flat.f_narrow(0, at, n)?.f_view(g.size().as_slice())?)?;
                    at += n;
                }
                Ok(())
            })?;
            self.reductions.push(op);
        }
        self.device_reduced = true;
        Ok(())
    }

    /// Reports the device variables' sums that completed (`wait`: waits for every one).
    fn finish_reductions(&mut self, wait: bool) -> Result<()> {
        let Some(m) = &self.member else { return Ok(()) };
        for op in std::mem::take(&mut self.reductions) {
            if wait {
                m.collective.wait(op)?;
            } else if let Err(op) = m.collective.finish(op) {
                self.reductions.push(op);
            }
        }
        Ok(())
    }

    /// In a group, the part of a whole parameter's loaded state that this rank's piece of it
    /// steps (each state tensor flattened and cut like the parameter); `st` itself elsewhere.
    pub(super) fn own_piece(&self, name: &str, st: ParamState) -> Result<ParamState> {
        let Some((at, n, shape)) = self.pieces.get(name) else { return Ok(st) };
        let mut out = ParamState { step: st.step, tensors: [None, None, None] };
        for (i, t) in st.tensors.iter().enumerate() {
            let Some(t) = t else { continue };
            if t.size() != *shape {
                return Err(Error::Corrupt(format!("optimizer state of '{name}' has shape {:?}, but the variable has shape {shape:?}", t.size())));
            }
            out.tensors[i] = Some(t.f_reshape([-1])?.f_narrow(0, *at, *n)?);
        }
        Ok(out)
    }
}
