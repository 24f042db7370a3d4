//! Checkpoints in tch's names and formats, never silently wrong.
//!
//! A checkpoint of a model whose weights Stagehand manages holds exactly what a plain
//! `tch::nn::VarStore::save` of the same model would: every variable by its VarStore name, in
//! the format the extension names (`.safetensors`, or libtorch's archive for `.ot` and anything
//! else), as CPU tensors. Plain tch loads it with `VarStore::load`, and Stagehand loads what
//! plain tch saved, both bit-identical.
//!
//! - **Values, not placeholders.** Between uses a managed variable points at a placeholder; a
//!   checkpoint reads each managed parameter's canonical value instead: the host copy of a
//!   streamed block (after its pending host optimizer step), the device copy of a resident
//!   block (which trains there), the file of a file-backed block.
//! - **Atomic.** The file is written beside its destination and renamed over it once flushed:
//!   a crash mid-save leaves the previous checkpoint whole.
//! - **Checked before written.** Loading checks every name, shape and (for managed parameters)
//!   dtype before it changes anything; a missing variable is an error unless the load is
//!   partial. Loading writes managed parameters' canonical values (a stale copy on the device is
//!   dropped first); a file-backed block is frozen and refuses a value other than its file's.
//! - **Streamed.** safetensors checkpoints are written tensor by tensor from the host copies, so
//!   saving needs no second copy of the model in memory; they are read through a memory map.
//!
//! Optimizer state saves to a sidecar file: see [`crate::optim::state`].

mod store;

pub use store::VarStoreCopy;

use crate::error::Result;
use crate::weights::WeightRuntime;
use std::path::Path;

/// A checkpoint format, chosen by extension exactly as tch's `VarStore::save`/`load` choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `.safetensors`.
    Safetensors,
    /// `.bin` and `.pt`: loaded as a pickled file (`Tensor::loadz_multi`); saved as libtorch's
    /// archive, as tch does.
    Pickle,
    /// Anything else (`.ot`): libtorch's archive (`Tensor::save_multi`).
    Libtorch,
}

impl Format {
    /// The format of `path`.
    pub fn of(path: &Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => Format::Safetensors,
            Some("bin") | Some("pt") => Format::Pickle,
            _ => Format::Libtorch,
        }
    }
}

/// Saves every variable of `vs` to `path`: managed ones (by `rt`, made from `vs` in block mode)
/// from their canonical values, the others as they are. See the module docs.
pub fn save(path: impl AsRef<Path>, vs: &tch::nn::VarStore, rt: Option<&WeightRuntime>) -> Result<()> {
    store::save(path.as_ref(), &vs.variables_, rt)
}

/// Loads every variable of `vs` from `path` (managed ones into `rt`'s canonical copies);
/// a variable the file lacks is an error that changes nothing.
pub fn load(path: impl AsRef<Path>, vs: &tch::nn::VarStore, rt: Option<&WeightRuntime>) -> Result<()> {
    store::load(path.as_ref(), &vs.variables_, rt, false).map(|_| ())
}

/// Loads the variables of `vs` that `path` has; returns the names it lacks (tch's
/// `load_partial`).
pub fn load_partial(path: impl AsRef<Path>, vs: &tch::nn::VarStore, rt: Option<&WeightRuntime>) -> Result<Vec<String>> {
    store::load(path.as_ref(), &vs.variables_, rt, true)
}

/// A copy of `vs`'s variables with their real values (managed ones from `rt`).
pub fn snapshot(vs: &tch::nn::VarStore, rt: Option<&WeightRuntime>) -> Result<VarStoreCopy> {
    VarStoreCopy::take(&vs.variables_, rt)
}

pub(crate) use store::{load as load_vars, save as save_vars};
