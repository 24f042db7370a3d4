//! Saving and loading a VarStore whose variables a weight runtime may manage: every variable by
//! its VarStore name, managed ones from their canonical values (the host copy of a streamed
//! block, the device copy of a resident one, the file of a file-backed one), never from the
//! placeholder a managed variable points at between uses.

use crate::tensorfile::{cpu_contiguous, Bytes, Entry, Reader};
use super::Format;
use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::torch::VariableId;
use crate::weights::WeightRuntime;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use tch::{Kind, Tensor};

/// Where a variable's value lives.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// Parameter `.1` of block `.0` of the runtime.
    Managed(BlockId, usize),
    /// In the variable itself.
    Plain,
}

/// A variable of the store, with what a checkpoint needs to know about it.
struct Var {
    name: String,
    var: Tensor,
    place: Place,
    trainable: bool,
    group: usize,
    kind: Kind,
    shape: Vec<i64>,
}

/// Every variable of `vars`, sorted by name, each placed (managed by `rt` or plain).
fn variables(vars: &Mutex<tch::nn::Variables>, rt: Option<&WeightRuntime>) -> Vec<Var> {
    let mut managed: HashMap<String, (BlockId, usize, Kind, Vec<i64>)> = HashMap::new();
    if let Some(rt) = rt {
        for b in rt.blocks() {
            for (i, p) in b.params.iter().enumerate() {
                managed.insert(p.name.clone(), (b.id, i, p.declared, p.shape.clone()));
            }
        }
    }
    let v = vars.lock().unwrap_or_else(|p| p.into_inner());
    let groups: HashMap<VariableId, usize> = v.trainable_variables.iter().map(|t| (VariableId::of(&t.tensor), t.group)).collect();
    let mut out: Vec<Var> = v
        .named_variables
        .iter()
        .map(|(name, t)| {
            let group = groups.get(&VariableId::of(t)).copied();
            let (place, kind, shape) = match managed.get(name) {
                Some((id, i, kind, shape)) => (Place::Managed(*id, *i), *kind, shape.clone()),
                None => (Place::Plain, t.kind(), t.size()),
            };
            Var {
                name: name.clone(),
                var: t.shallow_clone(),
                place,
                trainable: group.is_some(),
                group: group.unwrap_or(0),
                kind,
                shape,
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn runtime(rt: Option<&WeightRuntime>) -> Result<&WeightRuntime> {
    rt.ok_or_else(|| Error::internal("a managed variable without its runtime"))
}

/// The value of `v` now: zero-copy where it can be (a host copy, the variable itself).
fn value(v: &Var, rt: Option<&WeightRuntime>) -> Result<Tensor> {
    match v.place {
        Place::Managed(id, i) => runtime(rt)?.param_value(id, i),
        Place::Plain => Ok(v.var.detach()),
    }
}

/// Saves every variable of `vars` to `path` in tch's format for its extension (`.safetensors`,
/// else libtorch's `.ot` archive), atomically, as CPU tensors.
pub(crate) fn save(path: &Path, vars: &Mutex<tch::nn::Variables>, rt: Option<&WeightRuntime>) -> Result<()> {
    let all = variables(vars, rt);
    match Format::of(path) {
        Format::Safetensors => {
            let failed = RefCell::new(None);
            let mut entries = Vec::with_capacity(all.len());
            for v in &all {
                let t = value(v, rt)?;
                let bytes = if t.device() == tch::Device::Cpu && t.is_contiguous() {
                    Bytes::Ready(t)
                } else {
                    // A device copy, made when the writer reaches it.
                    Bytes::Later(Box::new(move || cpu_contiguous(&t)))
                };
                entries.push((v.name.clone(), Entry::new(&v.name, v.kind, &v.shape, bytes, &failed)?));
            }
            crate::tensorfile::write(path, entries, None, &failed)
        }
        Format::Libtorch | Format::Pickle => {
            let tensors = all
                .iter()
                .map(|v| Ok((v.name.clone(), cpu_contiguous(&value(v, rt)?)?)))
                .collect::<Result<Vec<_>>>()?;
            crate::tensorfile::atomic::write_atomic(path, |tmp| Ok(Tensor::save_multi(&tensors, tmp)?))
        }
    }
}

/// A checkpoint opened for loading.
enum Source {
    /// libtorch formats: loaded whole, on the CPU.
    Loaded(HashMap<String, Tensor>),
    /// safetensors: mapped, read tensor by tensor.
    Mapped(Reader),
}

impl Source {
    fn open(path: &Path) -> Result<Source> {
        Ok(match Format::of(path) {
            Format::Safetensors => Source::Mapped(Reader::open(path)?),
            Format::Pickle => Source::Loaded(Tensor::loadz_multi_with_device(path, tch::Device::Cpu)?.into_iter().collect()),
            Format::Libtorch => Source::Loaded(Tensor::load_multi_with_device(path, tch::Device::Cpu)?.into_iter().collect()),
        })
    }

    fn describe(&self, name: &str) -> Result<Option<(Kind, Vec<i64>)>> {
        match self {
            Source::Loaded(m) => Ok(m.get(name).map(|t| (t.kind(), t.size()))),
            Source::Mapped(r) => r.describe(name),
        }
    }

    fn read(&self, name: &str) -> Result<Tensor> {
        match self {
            Source::Loaded(m) => m.get(name).map(|t| t.shallow_clone()).ok_or_else(|| Error::internal(format!("'{name}' vanished"))),
            Source::Mapped(r) => r.read(name),
        }
    }

    fn count(&self) -> Result<usize> {
        match self {
            Source::Loaded(m) => Ok(m.len()),
            Source::Mapped(r) => Ok(r.names()?.len()),
        }
    }
}

/// Loads every variable of `vars` from `path` (tch's formats by extension, as `VarStore::load`).
/// Everything is checked before anything is written: a variable missing from the file (unless
/// `partial`), a shape that differs, or a managed variable stored in another dtype is an error
/// that changes nothing. Plain variables take the file's dtype, as tch's load does. Returns the
/// names the file lacks (only with `partial`).
pub(crate) fn load(path: &Path, vars: &Mutex<tch::nn::Variables>, rt: Option<&WeightRuntime>, partial: bool) -> Result<Vec<String>> {
    let src = Source::open(path)?;
    let shown = path.display();
    let mut missing = Vec::new();
    let mut found = Vec::new();
    for v in variables(vars, rt) {
        let Some((kind, shape)) = src.describe(&v.name)? else {
            missing.push(v.name);
            continue;
        };
        if shape != v.shape {
            return Err(Error::misuse(
                format!("loading '{}' from {shown}, where it has shape {shape:?}", v.name),
                format!("the variable's shape {:?} (a checkpoint of this model)", v.shape),
            ));
        }
        if matches!(v.place, Place::Managed(..)) && kind != v.kind {
            return Err(Error::misuse(
                format!("loading '{}' from {shown}, where it is {kind:?}", v.name),
                format!(
                    "{:?}, the dtype its managed block stores (convert the checkpoint, or build the model with LayerOptions::dtype = {kind:?})",
                    v.kind
                ),
            ));
        }
        found.push(v);
    }
    if !partial && !missing.is_empty() {
        let more = if missing.len() > 1 { format!(" and {} more", missing.len() - 1) } else { String::new() };
        return Err(Error::misuse(
            format!("loading {shown}: it has no tensor '{}'{more} ({} tensors in the file)", missing[0], src.count()?),
            "a checkpoint with every variable of the model (load_partial loads what it has)",
        ));
    }
    for v in found {
        let t = src.read(&v.name)?;
        match v.place {
            Place::Managed(id, i) => runtime(rt)?.set_param(id, i, &t)?,
            Place::Plain => {
                let mut var = v.var.shallow_clone();
                // tch's load: the variable takes the file's dtype, then its values.
                if var.kind() != t.kind() {
                    let cast = var.f_to_kind(t.kind())?;
                    var.set_data(&cast);
                }
                tch::no_grad(|| var.detach().f_copy_(&t))?;
            }
        }
    }
    Ok(missing)
}

/// A copy of a store's variables with their real values, in a plain `tch::nn::VarStore` on the
/// CPU: same names, trainability and groups. Changing it does not change the model (load a
/// checkpoint for that), and an optimizer built on it would train the copy.
#[derive(Debug)]
pub struct VarStoreCopy {
    vs: tch::nn::VarStore,
}

impl VarStoreCopy {
    pub(crate) fn take(vars: &Mutex<tch::nn::Variables>, rt: Option<&WeightRuntime>) -> Result<VarStoreCopy> {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let mut all = variables(vars, rt);
        // Trainable variables first, in the store's order (the order tch's optimizers use).
        let order: HashMap<VariableId, usize> = {
            let v = vars.lock().unwrap_or_else(|p| p.into_inner());
            v.trainable_variables.iter().enumerate().map(|(i, t)| (VariableId::of(&t.tensor), i)).collect()
        };
        all.sort_by_key(|v| order.get(&VariableId::of(&v.var)).copied().unwrap_or(usize::MAX));
        for v in all {
            let value = cpu_contiguous(&value(&v, rt)?)?;
            let copy = Tensor::f_empty(v.shape.as_slice(), (value.kind(), tch::Device::Cpu))?;
            tch::no_grad(|| copy.detach().f_copy_(&value))?;
            let parts: Vec<&str> = v.name.split('.').collect();
            let (leaf, dirs) = parts.split_last().ok_or_else(|| Error::internal("an empty variable name"))?;
            let p = dirs.iter().fold(vs.root(), |p, d| p.sub(*d)).set_group(v.group);
            let _ = p.add(leaf, copy, v.trainable);
        }
        Ok(VarStoreCopy { vs })
    }

    /// Saves it like [`crate::nn::ManagedVarStore::save`] (atomically, tch's formats).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        save(path.as_ref(), &self.vs.variables_, None)
    }

    /// Every variable by name (copies with the model's values at the time of the snapshot).
    pub fn variables(&self) -> HashMap<String, Tensor> {
        self.vs.variables()
    }

    /// The trainable variables, in the store's order.
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    /// How many variables.
    pub fn len(&self) -> usize {
        self.vs.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.vs.is_empty()
    }

    /// The plain VarStore holding the copies.
    pub fn into_var_store(self) -> tch::nn::VarStore {
        self.vs
    }
}
