//! What a reader needs to make sense of a file that starts mid-run: the run's `run_started`, each
//! owner's limits, the pools, the registered blocks and the itinerary, as last published.
//!
//! A rotated telemetry segment and a flight-recorder dump both start with the preamble, so each
//! one opens alone in every reader and shows the run with its blocks and budgets.

use super::model::{BlockId, Event, EventKind, Owner, PoolKind};
use super::snapshot::MAX_BLOCKS;
use std::collections::BTreeMap;

/// The context events seen so far, latest of each.
#[derive(Debug, Clone, Default)]
pub struct Preamble {
    run: Option<Event>,
    limits: BTreeMap<Owner, Event>,
    pools: Vec<(PoolKind, Event)>,
    blocks: BTreeMap<BlockId, Event>,
    itinerary: Option<Event>,
}

impl Preamble {
    /// An empty preamble.
    pub fn new() -> Preamble {
        Preamble::default()
    }

    /// Keeps `e` if it is context. A new `run_started` starts a new run: the rest is dropped.
    pub fn observe(&mut self, e: &Event) {
        match &e.kind {
            EventKind::RunStarted { .. } => {
                *self = Preamble::default();
                self.run = Some(e.clone());
            }
            EventKind::LimitsSet { owner, .. } => {
                self.limits.insert(*owner, e.clone());
            }
            EventKind::PoolConfigured { pool, .. } => {
                self.pools.retain(|(p, _)| p != pool);
                self.pools.push((*pool, e.clone()));
            }
            // Bounded like the snapshot's registry: a file cannot make it grow without end.
            EventKind::BlockRegistered { block, .. }
                if self.blocks.len() < MAX_BLOCKS || self.blocks.contains_key(block) =>
            {
                self.blocks.insert(*block, e.clone());
            }
            EventKind::ItineraryLearned { .. } | EventKind::ItineraryChanged { .. } => {
                self.itinerary = Some(e.clone());
            }
            _ => {}
        }
    }

    /// The context events, in the order a reader needs them (by their original sequence).
    pub fn events(&self) -> Vec<Event> {
        let mut out: Vec<Event> = self
            .run
            .iter()
            .chain(self.limits.values())
            .chain(self.pools.iter().map(|(_, e)| e))
            .chain(self.blocks.values())
            .chain(self.itinerary.iter())
            .cloned()
            .collect();
        out.sort_by_key(|e| e.seq);
        out
    }

    /// True when no context was seen.
    pub fn is_empty(&self) -> bool {
        self.run.is_none() && self.limits.is_empty() && self.pools.is_empty() && self.blocks.is_empty()
    }

    /// Whether `kind` is a context event (kept by [`Preamble::observe`]).
    pub fn is_context(kind: &EventKind) -> bool {
        matches!(
            kind,
            EventKind::RunStarted { .. }
                | EventKind::LimitsSet { .. }
                | EventKind::PoolConfigured { .. }
                | EventKind::BlockRegistered { .. }
                | EventKind::ItineraryLearned { .. }
                | EventKind::ItineraryChanged { .. }
        )
    }
}
