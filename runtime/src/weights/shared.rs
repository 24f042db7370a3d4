//! One host copy of the model for every rank of a data-parallel group (one process, a thread
//! per device): rank 0 registers each block and publishes its host copy (the pinned weights
//! that stream, the float32 masters); every other rank's block of the same name points at that
//! copy instead of making its own, so the model is in host memory once whatever the number of
//! GPUs. Each rank streams its blocks from it into its own device room.
//!
//! The host optimizer updates that copy in place, each rank its shard of every trained block
//! (`super::shard`), and the [`UpdateBoard`] counts the shard steps done: a rank loads a trained
//! block only once every rank's step of it has run, so no GPU reads a half-updated block.

use super::block::HostCopy;
use super::registry::BlockSpec;
use crate::collective::faults::Faults;
use crate::error::{Error, Result};
use crate::events::BlockId;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank looks at the group's fault state.
const FAULT_POLL: Duration = Duration::from_millis(50);

struct Published {
    id: BlockId,
    spec: BlockSpec,
    copy: HostCopy,
}

/// The host copies rank 0 made, by block name.
pub(crate) struct SharedModel {
    blocks: Mutex<HashMap<String, Published>>,
    cv: Condvar,
    faults: Arc<Faults>,
    board: Arc<UpdateBoard>,
}

impl std::fmt::Debug for SharedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedModel").field("blocks", &self.lock().len()).finish_non_exhaustive()
    }
}

impl SharedModel {
    /// The shared model of the group whose failure state is `faults`.
    pub(crate) fn new(faults: Arc<Faults>) -> Arc<SharedModel> {
        let board = UpdateBoard::new(faults.clone());
        let m = Arc::new(SharedModel { blocks: Mutex::new(HashMap::new()), cv: Condvar::new(), faults, board });
        let weak = Arc::downgrade(&m);
        m.faults.on_raise(move || {
            if let Some(m) = weak.upgrade() {
                let _g = m.lock();
                m.cv.notify_all();
            }
        });
        m
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Published>> {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The group's count of host optimizer steps done.
    pub(crate) fn board(&self) -> &Arc<UpdateBoard> {
        &self.board
    }

    /// Rank 0 publishes the host copy of block `id` (`spec.name`).
    pub(crate) fn publish(&self, id: BlockId, spec: &BlockSpec, copy: &HostCopy) -> Result<()> {
        let mut m = self.lock();
        if m.contains_key(&spec.name) {
            return Err(Error::internal(format!("block '{}' published twice", spec.name)));
        }
        m.insert(spec.name.clone(), Published { id, spec: spec.clone(), copy: copy.share() });
        self.cv.notify_all();
        Ok(())
    }

    /// Rank `rank`'s block `id` of layout `spec`: rank 0's host copy of the block of that name
    /// (waiting for rank 0 to register it, within the group's timeout). The layouts and ids
    /// must be rank 0's: every rank builds the same model.
    pub(crate) fn attach(&self, rank: usize, id: BlockId, spec: &BlockSpec) -> Result<HostCopy> {
        let t0 = Instant::now();
        let mut m = self.lock();
        loop {
            self.faults.check()?;
            if let Some(p) = m.get(&spec.name) {
                if p.id != id || p.spec != *spec {
                    let why = if p.id != id {
                        format!("it is block {id} there and block {} on rank 0", p.id)
                    } else {
                        format!("its parameters differ: {:?} there, {:?} on rank 0", brief(spec), brief(&p.spec))
                    };
                    drop(m);
                    return Err(self.faults.raise(
                        rank,
                        format!("rank {rank} built block '{}' differently from rank 0 ({why}): every rank must build the same model", spec.name),
                    )
                    .error());
                }
                return Ok(p.copy.share());
            }
            if t0.elapsed() > self.faults.timeout() {
                drop(m);
                return Err(self.faults.raise(
                    rank,
                    format!("rank {rank} has block '{}', which rank 0 did not register within {:.0} s: every rank must build the same model", spec.name, self.faults.timeout().as_secs_f64()),
                )
                .error());
            }
            m = self.cv.wait_timeout(m, FAULT_POLL).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Each parameter's name, shape, dtype and whether it trains (what ranks must agree on).
fn brief(spec: &BlockSpec) -> Vec<(String, Vec<i64>, tch::Kind, bool)> {
    spec.params.iter().map(|p| (p.name.clone(), p.shape.clone(), p.kind, p.trainable)).collect()
}

/// Host optimizer steps finished for each block, summed over the ranks (each steps its shard).
pub(crate) struct UpdateBoard {
    done: Mutex<HashMap<BlockId, u64>>,
    cv: Condvar,
    faults: Arc<Faults>,
}

impl std::fmt::Debug for UpdateBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpdateBoard").finish_non_exhaustive()
    }
}

impl UpdateBoard {
    fn new(faults: Arc<Faults>) -> Arc<UpdateBoard> {
        let b = Arc::new(UpdateBoard { done: Mutex::new(HashMap::new()), cv: Condvar::new(), faults });
        let weak = Arc::downgrade(&b);
        b.faults.on_raise(move || {
            if let Some(b) = weak.upgrade() {
                let _g = b.lock();
                b.cv.notify_all();
            }
        });
        b
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<BlockId, u64>> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One rank's step of `block` finished.
    pub(crate) fn finished(&self, block: BlockId) {
        *self.lock().entry(block).or_default() += 1;
        self.cv.notify_all();
    }

    /// Whether a rank that has queued `submitted` steps of `block` must still wait before it
    /// reads the block's host copy: every rank's step of each of them has not run yet.
    pub(crate) fn pending(&self, block: BlockId, submitted: u64) -> bool {
        self.lock().get(&block).copied().unwrap_or(0) < submitted.saturating_mul(self.faults.world() as u64)
    }

    /// Waits until every rank's step of `block` up to `submitted` has run; returns how long it
    /// waited. Fails when the group stopped or past its timeout.
    pub(crate) fn wait(&self, rank: usize, block: BlockId, submitted: u64) -> Result<Duration> {
        let t0 = Instant::now();
        let want = submitted.saturating_mul(self.faults.world() as u64);
        let mut d = self.lock();
        while d.get(&block).copied().unwrap_or(0) < want {
            if self.faults.is_raised() {
                drop(d);
                self.faults.check()?;
                return Err(Error::internal("the group stopped without a fault"));
            }
            if t0.elapsed() > self.faults.timeout() {
                let have = d.get(&block).copied().unwrap_or(0);
                drop(d);
                return Err(self.faults.raise(
                    rank,
                    format!(
                        "rank {rank} waited {:.0} s for the host optimizer's steps of block {block} ({have} of {want} done): a rank stopped stepping",
                        self.faults.timeout().as_secs_f64()
                    ),
                )
                .error());
            }
            d = self.cv.wait_timeout(d, FAULT_POLL).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(t0.elapsed())
    }
}
