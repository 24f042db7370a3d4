//! Where the scheduler is in a step: the itinerary learned from a traced step, the trace of the
//! step running now, the position along the itinerary and the direction.

use super::itinerary::{Difference, Itinerary, Trace};
use crate::events::BlockId;

/// What the end of a step did to the itinerary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Learned {
    /// Nothing new: the step followed the itinerary (or used no block).
    Same,
    /// The first itinerary, from the first step that used blocks.
    First(Vec<BlockId>),
    /// The step ran another order: the itinerary now follows it.
    Changed(Vec<BlockId>, Difference),
}

#[derive(Debug, Default)]
pub(crate) struct Route {
    itinerary: Option<Itinerary>,
    trace: Trace,
    pos: Option<usize>,
    backward: bool,
    /// The block entered last, in either direction.
    current: Option<BlockId>,
    /// The step left the itinerary: a block came that was not the next one on it.
    diverged: bool,
    /// Times the last step ended went over the itinerary (its micro-batches).
    passes: usize,
    /// The itinerary is the first step's first pass, followed by that step's later passes until
    /// the step's end learns one.
    provisional: bool,
}

impl Route {
    /// A route that starts with `itinerary` (a guess, replaced by the first traced step).
    pub(crate) fn with_itinerary(itinerary: Itinerary) -> Route {
        Route {
            itinerary: Some(itinerary),
            ..Route::default()
        }
    }

    /// The itinerary, once learned.
    pub(crate) fn itinerary(&self) -> Option<&Itinerary> {
        self.itinerary.as_ref()
    }

    /// The position along the itinerary.
    pub(crate) fn pos(&self) -> Option<usize> {
        self.pos
    }

    /// Whether the step is in backward.
    pub(crate) fn backward(&self) -> bool {
        self.backward
    }

    /// The block entered last.
    pub(crate) fn current(&self) -> Option<BlockId> {
        self.current
    }

    /// Whether this step has followed the itinerary so far (false before one is learned, and
    /// once a block came that was not the next on it): only then does the itinerary tell what
    /// the rest of the step will use.
    pub(crate) fn following(&self) -> bool {
        self.itinerary.is_some() && !self.diverged
    }

    /// Starts a step: forward, at no position yet.
    pub(crate) fn begin(&mut self) {
        self.trace.clear();
        self.pos = None;
        self.backward = false;
        self.current = None;
        self.diverged = false;
    }

    /// Enters `block` in the given direction; returns the block left behind when this is a
    /// different block than the last one (in the same direction or across the turn).
    pub(crate) fn enter(&mut self, block: BlockId, backward: bool) -> Option<BlockId> {
        if self.trace.record(block, backward) && self.itinerary.is_none() {
            // The first step's first micro-batch is over: the ones after it follow its order,
            // as later steps will (and leave it where they do not).
            self.itinerary = self.trace.first_pass();
            self.provisional = true;
            self.pos = None;
            self.diverged = false;
        }
        let left = self.current.filter(|&c| c != block);
        let moved = left.is_some() || backward != self.backward || self.current.is_none();
        self.backward = backward;
        // Idempotent for a block entered again: its next use in this direction is where it is.
        let found = self.itinerary.as_ref().and_then(|it| it.position(block, backward, self.pos));
        if moved && !self.diverged {
            let next = match (&self.itinerary, self.pos) {
                (Some(it), Some(p)) => Some((p + 1) % it.len().max(1)),
                (Some(it), None) => Some(if backward { it.forward().len() } else { 0 }),
                (None, _) => None,
            };
            self.diverged = found.is_none() || found != next;
        }
        if let Some(p) = found {
            self.pos = Some(p);
        }
        self.current = Some(block);
        left
    }

    /// The next `k` blocks after the position, and how far ahead each one is.
    pub(crate) fn window(&self, k: usize) -> Vec<(BlockId, usize)> {
        let (Some(it), Some(pos)) = (&self.itinerary, self.pos) else {
            return Vec::new();
        };
        it.window(pos, k)
            .into_iter()
            .map(|b| (b, it.distance(pos, b).unwrap_or(it.len())))
            .collect()
    }

    /// Positions until the next use of `block` (the whole step when unknown).
    pub(crate) fn distance(&self, block: BlockId) -> usize {
        match (&self.itinerary, self.pos) {
            (Some(it), Some(p)) => it.distance(p, block).unwrap_or(it.len()),
            (Some(it), None) => it.len(),
            _ => usize::MAX,
        }
    }

    /// Positions from here to the end of the step (the next step's first block is this far
    /// plus one); the whole itinerary before the first block of a step.
    pub(crate) fn to_step_end(&self) -> usize {
        match (&self.itinerary, self.pos) {
            (Some(it), Some(p)) => it.len().saturating_sub(p + 1),
            (Some(it), None) => it.len(),
            _ => usize::MAX,
        }
    }

    /// How many times the last step that ended went over the itinerary (its micro-batches; 1
    /// for a step that used no block).
    pub(crate) fn passes(&self) -> usize {
        self.passes.max(1)
    }

    /// Ends the step: learns the itinerary from its trace, or replaces it when the step ran
    /// another order.
    pub(crate) fn end(&mut self) -> Learned {
        self.passes = self.trace.passes();
        if std::mem::take(&mut self.provisional) {
            self.itinerary = None;
        }
        if self.trace.is_empty() {
            return Learned::Same;
        }
        let learned = match &self.itinerary {
            None => {
                let it = self.trace.itinerary();
                let order = it.order().to_vec();
                self.itinerary = Some(it);
                Learned::First(order)
            }
            Some(it) => match self.trace.difference(it) {
                None => Learned::Same,
                Some(d) => {
                    let it = self.trace.itinerary();
                    let order = it.order().to_vec();
                    self.itinerary = Some(it);
                    Learned::Changed(order, d)
                }
            },
        };
        self.trace.clear();
        learned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(r: &mut Route, fwd: &[u32], bwd: &[u32]) -> Learned {
        r.begin();
        for &b in fwd {
            r.enter(BlockId(b), false);
        }
        for &b in bwd {
            r.enter(BlockId(b), true);
        }
        r.end()
    }

    #[test]
    fn learns_once_then_reports_changes() {
        let mut r = Route::default();
        assert!(matches!(step(&mut r, &[0, 1, 2], &[2, 1]), Learned::First(o) if o.len() == 5));
        assert_eq!(step(&mut r, &[0, 1, 2], &[2, 1]), Learned::Same);
        match step(&mut r, &[0, 2], &[2]) {
            Learned::Changed(order, d) => {
                assert_eq!(order, [BlockId(0), BlockId(2), BlockId(2)]);
                assert_eq!(d.removed, [BlockId(1)]);
            }
            other => panic!("expected a change, got {other:?}"),
        }
    }

    #[test]
    fn the_first_steps_later_micro_batches_follow_its_first_and_the_end_learns_one_pass() {
        let mut r = Route::default();
        r.begin();
        for (f, b) in [([0, 1, 2], [2, 1]), ([0, 1, 2], [2, 1])] {
            for x in f {
                r.enter(BlockId(x), false);
            }
            for x in b {
                r.enter(BlockId(x), true);
            }
        }
        assert!(r.following(), "the second micro-batch followed the first");
        assert_eq!(r.pos(), Some(4));
        assert!(matches!(r.end(), Learned::First(o) if o == [0, 1, 2, 2, 1].map(BlockId)));
        assert_eq!(r.passes(), 2);
        // A first step whose micro-batches differ leaves the first one's order where they do,
        // and learns every use, as one pass.
        let mut r = Route::default();
        r.begin();
        for (f, b) in [(&[0, 1][..], &[1][..]), (&[0, 2][..], &[2][..])] {
            for &x in f {
                r.enter(BlockId(x), false);
            }
            for &x in b {
                r.enter(BlockId(x), true);
            }
        }
        assert!(!r.following());
        assert!(matches!(r.end(), Learned::First(o) if o.len() == 6));
        assert_eq!(r.passes(), 1);
    }

    #[test]
    fn entering_reports_the_block_left_and_moves_along_the_itinerary() {
        let mut r = Route::default();
        step(&mut r, &[0, 1, 2], &[2, 1, 0]);
        r.begin();
        assert_eq!(r.enter(BlockId(0), false), None);
        assert_eq!(r.enter(BlockId(0), false), None, "the same block again is not a move");
        assert_eq!(r.pos(), Some(0));
        assert_eq!(r.enter(BlockId(1), false), Some(BlockId(0)));
        assert_eq!(r.window(2), [(BlockId(2), 1), (BlockId(0), 4)]);
        r.enter(BlockId(2), false);
        assert_eq!(r.enter(BlockId(2), true), None, "the turn stays on the same block");
        assert_eq!(r.pos(), Some(3));
        assert_eq!(r.to_step_end(), 2);
        assert_eq!(r.enter(BlockId(1), true), Some(BlockId(2)));
        assert!(r.following(), "the step followed the itinerary");
        r.enter(BlockId(2), true);
        assert!(!r.following(), "block 2 again is not the next one");
    }
}
