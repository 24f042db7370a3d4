//! Per-block residency: the six-state machine with validated transitions, refcounts and
//! `keep_resident` protection. Every transition is published.

use crate::error::{Error, Result};
use crate::events::{BlockId, BlockState, Bus, EventKind};

/// One block's residency record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    pub state: BlockState,
    /// Users of the block right now (between `before_block` and `after_block`).
    pub refcount: u32,
    /// Pinned by `keep_resident`: never evicted.
    pub protected: bool,
    /// Step of the last use.
    pub last_used_step: Option<u64>,
}

/// The residency table of every block.
#[derive(Debug, Default)]
pub struct Residency {
    names: Vec<String>,
    entries: Vec<Entry>,
}

impl Residency {
    /// An empty table.
    pub fn new() -> Residency {
        Residency::default()
    }

    /// Adds a block in `Unloaded`; returns its id.
    pub fn add(&mut self, name: &str) -> BlockId {
        self.names.push(name.to_string());
        self.entries.push(Entry::default());
        BlockId((self.entries.len() - 1) as u32)
    }

    /// The record of `id`.
    pub fn get(&self, id: BlockId) -> Result<&Entry> {
        self.entries
            .get(id.0 as usize)
            .ok_or_else(|| Error::UnknownBlock(id.to_string()))
    }

    fn get_mut(&mut self, id: BlockId) -> Result<&mut Entry> {
        self.entries
            .get_mut(id.0 as usize)
            .ok_or_else(|| Error::UnknownBlock(id.to_string()))
    }

    /// The state of `id`.
    pub fn state(&self, id: BlockId) -> Result<BlockState> {
        Ok(self.get(id)?.state)
    }

    /// Moves `id` to `to`, rejecting anything outside the eight valid edges.
    pub fn transition(&mut self, id: BlockId, to: BlockState, bus: &Bus) -> Result<()> {
        let name = self
            .names
            .get(id.0 as usize)
            .cloned()
            .ok_or_else(|| Error::UnknownBlock(id.to_string()))?;
        let e = self.get_mut(id)?;
        let from = e.state;
        if !from.can_transition_to(to) {
            return Err(Error::InvalidTransition {
                block: name,
                from,
                to,
            });
        }
        e.state = to;
        let refcount = e.refcount;
        bus.publish(EventKind::Residency {
            block: id,
            from,
            to,
            refcount,
        });
        Ok(())
    }

    /// One more user of `id`.
    pub fn acquire(&mut self, id: BlockId, step: u64) -> Result<u32> {
        let e = self.get_mut(id)?;
        e.refcount += 1;
        e.last_used_step = Some(step);
        Ok(e.refcount)
    }

    /// One user fewer; an error when nobody held it.
    pub fn release(&mut self, id: BlockId) -> Result<u32> {
        let e = self.get_mut(id)?;
        if e.refcount == 0 {
            return Err(Error::misuse(
                format!("releasing block {id}"),
                "a block released as often as it was acquired (its refcount is 0)",
            ));
        }
        e.refcount -= 1;
        Ok(e.refcount)
    }

    /// Protects or unprotects `id` from eviction.
    pub fn set_protected(&mut self, id: BlockId, on: bool, bus: &Bus) -> Result<()> {
        let e = self.get_mut(id)?;
        if e.protected != on {
            e.protected = on;
            bus.publish(EventKind::Protection {
                block: id,
                protected: on,
            });
        }
        Ok(())
    }

    /// Resident, unused and unprotected.
    pub fn can_evict(&self, id: BlockId) -> bool {
        self.get(id)
            .is_ok_and(|e| e.state == BlockState::GpuReady && e.refcount == 0 && !e.protected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_valid_edge_passes_and_every_other_pair_is_a_typed_error() {
        let bus = Bus::disabled();
        let mut valid = 0;
        for from in BlockState::ALL {
            for to in BlockState::ALL {
                let mut r = Residency::new();
                let id = r.add("b");
                r.entries[0].state = from;
                match r.transition(id, to, &bus) {
                    Ok(()) => {
                        assert!(from.can_transition_to(to));
                        assert_eq!(r.state(id).expect("state"), to);
                        valid += 1;
                    }
                    Err(Error::InvalidTransition { block, from: f, to: t }) => {
                        assert!(!from.can_transition_to(to));
                        assert_eq!((block.as_str(), f, t), ("b", from, to));
                        assert_eq!(r.state(id).expect("state"), from, "state unchanged");
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
        }
        assert_eq!(valid, 8);
    }

    #[test]
    fn refcounts_forbid_eviction_and_underflow_is_an_error() {
        let bus = Bus::disabled();
        let mut r = Residency::new();
        let id = r.add("b");
        for s in [BlockState::HostStaged, BlockState::Prefetching, BlockState::GpuReady] {
            r.transition(id, s, &bus).expect("load path");
        }
        assert!(r.can_evict(id));
        r.acquire(id, 0).expect("acquire");
        assert!(!r.can_evict(id));
        r.release(id).expect("release");
        assert!(r.can_evict(id));
        assert!(matches!(r.release(id), Err(Error::Misuse { .. })));
        r.set_protected(id, true, &bus).expect("protect");
        assert!(!r.can_evict(id));
        assert!(matches!(r.state(BlockId(9)), Err(Error::UnknownBlock(_))));
    }
}
