//! The optimizer's state as a sidecar file beside a model checkpoint (tch itself cannot save
//! an optimizer), so a run resumes exactly: same moments, same step counts, same group options.
//!
//! The file is a safetensors file (format version 1):
//!
//! - a tensor `<variable>/<field>` for each state tensor of each variable, in the variable's
//!   dtype and shape, `<field>` one of the names [`Algorithm::state_fields`](super::Algorithm::state_fields) gives (`exp_avg`,
//!   `exp_avg_sq`, `max_exp_avg_sq` for Adam and AdamW; `momentum_buffer` for SGD;
//!   `square_avg`, `momentum_buffer`, `grad_avg` for RMSprop), and `<variable>/step`, an int64
//!   scalar, its step count (0 for SGD);
//! - header metadata: `format` = `stagehand-optimizer-state`, `version` = `1`, `algorithm`
//!   (`SGD`, `Adam`, `AdamW`, `RMSprop`), `groups` (JSON: the defaults and each group's `lr`,
//!   `weight_decay` and `momentum`), `variables` (JSON list of every variable the optimizer
//!   covers; one without tensors had not been stepped yet).
//!
//! `<variable>` is the VarStore name, so the state belongs to the model, not to how Stagehand
//! split it: the exact and the fused host kernels read each other's files (the fused kernel's
//! float step counter is stored as the step count), and a variable may move between the host
//! and the device optimizer.

use super::groups::Groups;
use super::host::lock_groups;
use super::optimizer::{trainable, Optimizer};
use super::fit::fit_state;
use crate::tensorfile::{cpu_contiguous, write, Bytes, Entry, Reader};
use crate::error::{Error, Result};
use crate::torch::ParamState;
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use tch::Tensor;

/// The `format` metadata of an optimizer state file.
pub const FORMAT: &str = "stagehand-optimizer-state";
/// The format version this build writes and reads.
pub const VERSION: &str = "1";

fn share(st: &ParamState) -> ParamState {
    ParamState {
        step: st.step,
        tensors: st.tensors.each_ref().map(|t| t.as_ref().map(|t| t.shallow_clone())),
    }
}

impl Optimizer {
    /// The names of every variable this optimizer covers (registering the model's blocks if
    /// it has not run yet).
    fn covered(&self) -> Result<BTreeSet<String>> {
        if let Some(o) = &self.origin {
            o.seal()?;
        }
        let mut names: BTreeSet<String> = self
            .rt
            .blocks()
            .into_iter()
            .flat_map(|b| b.params.into_iter().filter(|p| p.trainable).map(|p| p.name))
            .collect();
        let managed = names.clone();
        names.extend(self.device_params.iter().filter_map(|p| p.name.clone()));
        if let Some(o) = &self.origin {
            let given = self.given_ids();
            for t in trainable(o) {
                let covered = match &given {
                    None => t.var.requires_grad() && !managed.contains(&t.name),
                    Some(ids) => ids.contains(&t.id),
                };
                if covered {
                    names.insert(t.name);
                }
            }
        }
        Ok(names)
    }

    /// Every parameter's current state, by name (host steps finished first).
    fn states(&self) -> Result<Vec<(String, ParamState)>> {
        self.wait()?;
        let mut out = Vec::new();
        for b in self.host.values() {
            let b = b.lock().unwrap_or_else(|p| p.into_inner());
            for i in 0..b.params().len() {
                if let Some(st) = b.state(i)? {
                    out.push((b.params()[i].name.clone(), st));
                }
            }
        }
        if let Some(d) = &self.device {
            for p in &self.device_params {
                if let Some(st) = d.state(&p.var)? {
                    let name = p.name.clone().ok_or_else(|| {
                        Error::misuse(
                            "saving the optimizer state of a variable with no VarStore name",
                            "variables from the runtime's VarStore (the state file names each one)",
                        )
                    })?;
                    out.push((name, st));
                }
            }
        }
        out.extend(self.pending.iter().map(|(n, st)| (n.clone(), share(st))));
        Ok(out)
    }

    /// Saves the optimizer's state and group options to `path` (a safetensors file, format in
    /// [`crate::optim::state`]), atomically. Waits for pending host steps.
    ///
    /// In a data-parallel group every rank calls it: each rank's pieces of the streamed
    /// parameters' state are gathered and rank 0 writes one file of whole tensors, the same file
    /// one device writes (so a run resumes on one GPU or on N).
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        match self.member.clone() {
            Some(m) => self.save_state_group(&m, path),
            None => self.write_states(path, self.states()?),
        }
    }

    /// Gathers every rank's state on rank 0, which writes it; every rank learns whether it did.
    fn save_state_group(&self, m: &crate::collective::Membership, path: &Path) -> Result<()> {
        let mine: Vec<Piece> = self
            .states()?
            .into_iter()
            .map(|(name, st)| {
                let piece = self.pieces.get(&name).cloned();
                (name, st, piece)
            })
            .collect();
        let tag = format!("saving the optimizer state to {}", path.display());
        let all: Option<Vec<Vec<Piece>>> = m.exchange.round(m.rank, &tag, Box::new(mine), |all| {
            (m.rank == 0).then(|| {
                all.iter()
                    .filter_map(|d| d.as_ref().and_then(|(_, v)| v.downcast_ref::<Vec<Piece>>()))
                    .map(|v| v.iter().map(|(n, st, p)| (n.clone(), share(st), p.clone())).collect())
                    .collect()
            })
        })?;
        let written = match all {
            Some(ranks) => assemble(ranks).and_then(|states| self.write_states(path, states)).map_err(|e| e.to_string()),
            None => Ok(()),
        };
        let outcome = m.exchange.all_gather(m.rank, &format!("{tag}: written"), written.clone().err())?;
        match outcome.into_iter().flatten().next() {
            Some(e) if written.is_ok() => Err(Error::misuse(format!("saving the optimizer state to {}", path.display()), format!("rank 0 could write it: {e}"))),
            _ => written.map_err(|e| Error::misuse(format!("saving the optimizer state to {}", path.display()), e)),
        }
    }

    fn write_states(&self, path: &Path, states: Vec<(String, ParamState)>) -> Result<()> {
        let fields = self.algorithm.state_fields();
        let failed = RefCell::new(None);
        let mut entries = Vec::new();
        for (name, st) in states {
            for (i, t) in st.tensors.iter().enumerate() {
                if let Some(t) = t {
                    let key = format!("{name}/{}", fields[i]);
                    let t = cpu_contiguous(t)?;
                    entries.push((key.clone(), Entry::new(&key, t.kind(), &t.size(), Bytes::Ready(t), &failed)?));
                }
            }
            let key = format!("{name}/step");
            let step = Tensor::from(st.step);
            entries.push((key.clone(), Entry::new(&key, tch::Kind::Int64, &[], Bytes::Ready(step), &failed)?));
        }
        let json = |v: serde_json::Result<String>| v.map_err(|e| Error::internal(format!("encoding optimizer metadata: {e}")));
        let metadata: HashMap<String, String> = [
            ("format".to_string(), FORMAT.to_string()),
            ("version".to_string(), VERSION.to_string()),
            ("algorithm".to_string(), self.algorithm.name().to_string()),
            ("groups".to_string(), json(serde_json::to_string(&*lock_groups(&self.groups)))?),
            ("variables".to_string(), json(serde_json::to_string(&self.covered()?))?),
        ]
        .into();
        write(path, entries, Some(metadata), &failed)
    }

    /// Loads the state and group options saved by [`save_state`](Self::save_state) into this
    /// optimizer, which must cover the same variables with the same algorithm. Everything is
    /// checked before anything changes. Parameters whose optimizer is not made yet (before the
    /// first step) get their state when it is.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let bad = |what: String| Error::Corrupt(format!("{shown}: {what}"));
        let r = Reader::open(path)?;
        let meta = r.metadata()?;
        let get = |k: &str| meta.get(k).ok_or_else(|| bad(format!("no '{k}' in the header; not a {FORMAT} file")));
        if get("format")? != FORMAT {
            return Err(bad(format!("format '{}', expected '{FORMAT}'", get("format")?)));
        }
        if get("version")? != VERSION {
            return Err(bad(format!("format version '{}'; this build reads version {VERSION}", get("version")?)));
        }
        if get("algorithm")? != self.algorithm.name() {
            return Err(Error::misuse(
                format!("loading {} optimizer state from {shown}", get("algorithm")?),
                format!("state saved by the same algorithm as this optimizer's, {}", self.algorithm.name()),
            ));
        }
        let groups: Groups = serde_json::from_str(get("groups")?).map_err(|e| bad(format!("groups: {e}")))?;
        groups.check_loaded(lock_groups(&self.groups).len()).map_err(|e| bad(format!("groups: {e}")))?;
        let listed: BTreeSet<String> = serde_json::from_str(get("variables")?).map_err(|e| bad(format!("variables: {e}")))?;
        let covered = self.covered()?;
        if let Some(n) = listed.difference(&covered).next() {
            return Err(Error::misuse(
                format!("loading optimizer state for '{n}' from {shown}"),
                "state for the variables this optimizer covers (a state file of this model)",
            ));
        }
        if let Some(n) = covered.difference(&listed).next() {
            return Err(Error::misuse(
                format!("loading optimizer state from {shown}, which does not cover '{n}'"),
                "a state file saved from an optimizer over the same variables",
            ));
        }
        let fields = self.algorithm.state_fields();
        let shapes: HashMap<String, Vec<i64>> = self
            .origin
            .as_ref()
            .map(|o| o.vars.lock().unwrap_or_else(|p| p.into_inner()).named_variables.iter().map(|(n, t)| (n.clone(), t.size())).collect())
            .unwrap_or_default();
        let mut loaded: Vec<(String, ParamState)> = Vec::new();
        for name in &listed {
            let mut st = ParamState { step: 0, tensors: [None, None, None] };
            let mut any = false;
            for (i, f) in fields.iter().enumerate() {
                if f.is_empty() {
                    continue;
                }
                let key = format!("{name}/{f}");
                if r.describe(&key)?.is_some() {
                    let t = r.read(&key)?;
                    if let Some(want) = shapes.get(name) {
                        if t.size() != *want {
                            return Err(bad(format!("'{key}' has shape {:?}, the variable {:?}", t.size(), want)));
                        }
                    }
                    st.tensors[i] = Some(t);
                    any = true;
                }
            }
            let key = format!("{name}/step");
            if r.describe(&key)?.is_some() {
                let t = r.read(&key)?;
                if t.numel() != 1 {
                    return Err(bad(format!("'{key}' is not a scalar")));
                }
                st.step = t.f_int64_value(&[])?;
                any = true;
            }
            if any {
                loaded.push((name.clone(), st));
            }
        }
        self.apply_loaded(loaded)?;
        lock_groups(&self.groups).replace(&groups);
        Ok(())
    }

    /// Gives each loaded state to its optimizer, or keeps it until that optimizer is made.
    fn apply_loaded(&mut self, loaded: Vec<(String, ParamState)>) -> Result<()> {
        let mut by_name: HashMap<String, ParamState> = loaded.into_iter().collect();
        // A stepped parameter cannot lose its state: refuse before changing anything.
        for (name, _) in self.states()? {
            if !by_name.contains_key(&name) && !self.pending.contains_key(&name) {
                return Err(Error::misuse(
                    format!("loading optimizer state without state for '{name}', which has stepped"),
                    "load optimizer state before the first step, or a file in which it has state",
                ));
            }
        }
        for b in self.host.values() {
            let mut b = b.lock().unwrap_or_else(|p| p.into_inner());
            for i in 0..b.params().len() {
                let name = b.params()[i].name.clone();
                if let Some(st) = by_name.remove(&name) {
                    let st = self.own_piece(&name, st)?;
                    let st = fit_state(&self.algorithm, &name, &st, &b.params()[i].value)?;
                    b.set_state(i, &st)?;
                }
            }
        }
        if let Some(d) = &mut self.device {
            for p in &self.device_params {
                if let Some(st) = p.name.as_ref().and_then(|n| by_name.remove(n)) {
                    let st = fit_state(&self.algorithm, p.name.as_deref().unwrap_or("?"), &st, &p.var)?;
                    d.set_state(&p.var, &st)?;
                }
            }
        }
        self.pending = by_name;
        Ok(())
    }
}

/// A rank's state of one variable: its name, the state, and for a streamed parameter the piece
/// the rank steps (offset in the parameter, elements, the parameter's shape).
type Piece = (String, ParamState, Option<(i64, i64, Vec<i64>)>);

/// Whole parameters' state from every rank's pieces (in rank order): each streamed parameter's
/// pieces put back at their offsets (then given its shape), each other variable's state taken
/// from the first rank that has it (every rank holds the same).
fn assemble(ranks: Vec<Vec<Piece>>) -> Result<Vec<(String, ParamState)>> {
    let mut out: Vec<(String, ParamState, Option<Vec<i64>>)> = Vec::new();
    let mut at_index: HashMap<String, usize> = HashMap::new();
    for (name, st, piece) in ranks.into_iter().flatten() {
        let Some((at, n, shape)) = piece else {
            if !at_index.contains_key(&name) {
                at_index.insert(name.clone(), out.len());
                out.push((name, st, None));
            }
            continue;
        };
        let i = match at_index.get(&name) {
            Some(&i) => i,
            None => {
                at_index.insert(name.clone(), out.len());
                out.push((name.clone(), ParamState { step: st.step, tensors: [None, None, None] }, Some(shape.clone())));
                out.len() - 1
            }
        };
        let numel: i64 = shape.iter().product();
        for (f, t) in st.tensors.iter().enumerate() {
            let Some(t) = t else { continue };
            let full = match &out[i].1.tensors[f] {
                Some(full) => full.shallow_clone(),
                None => {
                    let full = Tensor::f_zeros([numel], (t.kind(), tch::Device::Cpu))?;
                    out[i].1.tensors[f] = Some(full.shallow_clone());
                    full
                }
            };
            tch::no_grad(|| full.f_narrow(0, at, n)?.f_copy_(&t.f_reshape([-1])?))?;
        }
        out[i].1.step = st.step;
    }
    out.into_iter()
        .map(|(name, mut st, shape)| {
            if let Some(shape) = shape {
                for t in st.tensors.iter_mut().flatten() {
                    *t = t.f_reshape(shape.as_slice())?;
                }
            }
            Ok((name, st))
        })
        .collect()
}
