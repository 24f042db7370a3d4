//! Checkpoints through the handle: the model's variables in tch's names and formats (see
//! [`crate::checkpoint`]), interoperable both ways with a plain `tch::nn::VarStore`.

use super::Stagehand;
use crate::checkpoint::Snapshot;
use crate::error::Result;
use std::path::Path;

impl Stagehand {
    /// Saves every variable of the model to `path` with tch's names, in tch's format for the
    /// extension (`.safetensors`, else libtorch's archive, as `VarStore::save`), atomically:
    /// managed weights from their real values (waiting for pending host optimizer steps), never
    /// the placeholders they point at between steps. Plain tch's `VarStore::load` reads it.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.store().save(path)
    }

    /// Loads every variable of the model from `path` (saved by Stagehand or by plain tch's
    /// `VarStore::save`), between steps. Every name, shape and dtype is checked before anything
    /// changes; a variable the file lacks is an error.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        self.store().load(path)
    }

    /// Loads the variables `path` has; returns the names it lacks (tch's `load_partial`).
    pub fn load_partial(&self, path: impl AsRef<Path>) -> Result<Vec<String>> {
        self.store().load_partial(path)
    }

    /// A copy of every variable with its real value in a plain `tch::nn::VarStore` (see
    /// [`crate::nn::ManagedVarStore::var_store`]).
    pub fn var_store(&self) -> Result<Snapshot> {
        self.store().var_store()
    }
}
