//! Checkpoints through the handle: the model's variables in tch's names and formats (see
//! [`crate::checkpoint`]), interoperable both ways with a plain `tch::nn::VarStore`.

use super::Stagehand;
use crate::checkpoint::VarStoreCopy;
use crate::error::Result;
use std::path::Path;

impl Stagehand {
    /// Saves every variable of the model to `path` with tch's names, in tch's format for the
    /// extension (`.safetensors`, else libtorch's archive, as `VarStore::save`), atomically:
    /// managed weights from their real values (waiting for pending host optimizer steps), never
    /// the placeholders they point at between steps. Plain tch's `VarStore::load` reads it.
    ///
    /// In a data-parallel group every rank calls it at the same point of the loop: rank 0 writes
    /// the one model (the host copy is the ranks' one, the other variables are the same on every
    /// rank) while the others wait, and every rank returns whether it was written.
    ///
    /// After a step that failed while its optimizer steps ran, it refuses: some values would be
    /// the next step's and others not (the weight runtime refuses to read them).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        match self.member() {
            None => self.store().save(path),
            Some(m) => {
                let what = format!("saving {}", path.display());
                m.exchange.barrier(m.rank, &what)?;
                let mine = if m.rank == 0 { self.store().save(path) } else { Ok(()) };
                agree(m, &what, mine)
            }
        }
    }

    /// Loads every variable of the model from `path` (saved by Stagehand or by plain tch's
    /// `VarStore::save`), between steps. Every name, shape and dtype is checked before anything
    /// changes; a variable the file lacks is an error.
    ///
    /// In a data-parallel group every rank calls it at the same point of the loop: rank 0
    /// writes the managed weights into the one host copy, each rank its own copies of the other
    /// variables, and each drops the copies of blocks on its device; a checkpoint saved by one
    /// device loads into N, and back.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        self.load_group(path.as_ref(), |p| self.store().load(p))
    }

    /// Loads the variables `path` has; returns the names it lacks (tch's `load_partial`).
    pub fn load_partial(&self, path: impl AsRef<Path>) -> Result<Vec<String>> {
        self.load_group(path.as_ref(), |p| self.store().load_partial(p))
    }

    fn load_group<T>(&self, path: &Path, load: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
        let Some(m) = self.member() else { return load(path) };
        let what = format!("loading {}", path.display());
        // No rank is in a step, so no load of the host copy is in flight while rank 0 writes it.
        m.exchange.barrier(m.rank, &what)?;
        let r = load(path);
        let (ok, value) = match r {
            Ok(v) => (Ok(()), Some(v)),
            Err(e) => (Err(e), None),
        };
        agree(m, &what, ok)?;
        value.ok_or_else(|| crate::error::Error::internal("a load that failed agreed"))
    }

    /// A copy of every variable with its real value in a plain `tch::nn::VarStore` (see
    /// [`crate::nn::ManagedVarStore::var_store`]).
    pub fn var_store(&self) -> Result<VarStoreCopy> {
        self.store().var_store()
    }
}

/// Every rank's outcome of `what`, exchanged so that all ranks return an error when one failed
/// (rank `r`'s error, or this rank's own).
fn agree(m: &crate::collective::Membership, what: &str, mine: Result<()>) -> Result<()> {
    let mine_text = mine.as_ref().err().map(|e| e.to_string());
    let all = m.exchange.all_gather(m.rank, &format!("{what}: done"), mine_text)?;
    mine?;
    match all.into_iter().enumerate().find_map(|(r, e)| e.map(|e| (r, e))) {
        Some((r, e)) => Err(crate::error::Error::misuse(what.to_owned(), format!("rank {r} to succeed too: {e}"))),
        None => Ok(()),
    }
}
