//! The itinerary: the order blocks are used in one step, traced from a real step in both
//! directions (a block whose weights backward never reads, like an embedding, has no backward
//! use, so nothing is loaded for it there), with positions that wrap into the next step.
//!
//! A [`Trace`] records the blocks entered during a step; at the step's end it becomes the
//! itinerary, or is compared with it: a step that ran another order replaces the itinerary and
//! the difference is reported. A step of micro-batches goes over the model once for each: where
//! every pass ran the same order, the itinerary is one pass, which the step follows as many
//! times (positions wrap into the next pass as into the next step).

use crate::events::BlockId;

/// The order blocks are used in one step: `forward` then `backward`. Positions are cyclic: after
/// the last position comes the next step's first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Itinerary {
    order: Vec<BlockId>,
    forward_len: usize,
}

impl Itinerary {
    /// An itinerary from the traced forward and backward orders.
    pub fn new(forward: Vec<BlockId>, backward: Vec<BlockId>) -> Itinerary {
        let forward_len = forward.len();
        let mut order = forward;
        order.extend(backward);
        Itinerary { order, forward_len }
    }

    /// The forward order.
    pub fn forward(&self) -> &[BlockId] {
        &self.order[..self.forward_len]
    }

    /// The backward order.
    pub fn backward(&self) -> &[BlockId] {
        &self.order[self.forward_len..]
    }

    /// Every position of a step, forward then backward.
    pub fn order(&self) -> &[BlockId] {
        &self.order
    }

    /// Positions in a full step.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True for an itinerary without blocks.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The block at position `pos` (cyclic).
    pub fn at(&self, pos: usize) -> BlockId {
        self.order[pos % self.order.len()]
    }

    /// The position of the next use of `block` in the given direction at or after `from` (or
    /// from the start of that direction), cyclically.
    pub fn position(&self, block: BlockId, backward: bool, from: Option<usize>) -> Option<usize> {
        if self.is_empty() {
            return None;
        }
        let half = if backward { self.forward_len..self.len() } else { 0..self.forward_len };
        let start = from.unwrap_or(half.start);
        (0..self.len())
            .map(|i| (start + i) % self.len())
            .find(|p| half.contains(p) && self.order[*p] == block)
    }

    /// The next `k` distinct blocks after `pos`, excluding the block at `pos`.
    pub fn window(&self, pos: usize, k: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(k);
        if self.is_empty() {
            return out;
        }
        let here = self.at(pos);
        for i in 1..self.len() {
            if out.len() == k {
                break;
            }
            let b = self.at(pos + i);
            if b != here && !out.contains(&b) {
                out.push(b);
            }
        }
        out
    }

    /// Positions from `pos` to the next use of `block` (0: used at `pos`); `None` when the
    /// itinerary never uses it.
    pub fn distance(&self, pos: usize, block: BlockId) -> Option<usize> {
        (0..self.len()).find(|i| self.at(pos + i) == block)
    }
}

/// The blocks entered during one step, in order, each direction apart; consecutive uses of the
/// same block count once. A forward use after backward ones starts another pass (the step's next
/// micro-batch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    passes: Vec<Pass>,
}

/// One forward and backward over the model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Pass {
    forward: Vec<BlockId>,
    backward: Vec<BlockId>,
}

/// How a traced step differs from the itinerary it was expected to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The first position where the two disagree.
    pub first_difference: usize,
    /// Blocks in the trace but not the itinerary, and the reverse.
    pub added: Vec<BlockId>,
    pub removed: Vec<BlockId>,
}

impl Trace {
    /// Records a use of `block` in the given direction; true when it starts the step's second
    /// pass (its first is then complete).
    pub fn record(&mut self, block: BlockId, backward: bool) -> bool {
        let next_pass = self.passes.last().is_none_or(|p| !backward && !p.backward.is_empty());
        if next_pass {
            self.passes.push(Pass::default());
        }
        if let Some(p) = self.passes.last_mut() {
            let v = if backward { &mut p.backward } else { &mut p.forward };
            if v.last() != Some(&block) {
                v.push(block);
            }
        }
        next_pass && self.passes.len() == 2
    }

    /// The itinerary of the step's first pass, once a second has started.
    pub fn first_pass(&self) -> Option<Itinerary> {
        match self.passes.as_slice() {
            [first, _, ..] => Some(Itinerary::new(first.forward.clone(), first.backward.clone())),
            _ => None,
        }
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.passes.is_empty()
    }

    /// Starts over.
    pub fn clear(&mut self) {
        self.passes.clear();
    }

    /// How many times the step went over the model in one order: its passes where each ran the
    /// same order (micro-batches), else 1 (the itinerary is then the whole step).
    pub fn passes(&self) -> usize {
        if self.uniform() {
            self.passes.len().max(1)
        } else {
            1
        }
    }

    fn uniform(&self) -> bool {
        self.passes.windows(2).all(|w| w[0] == w[1])
    }

    /// The itinerary this trace describes: one pass where every pass ran the same order;
    /// otherwise every forward use, then every backward use (an order no pass of the step
    /// follows throughout: the route leaves it where the step does).
    pub fn itinerary(&self) -> Itinerary {
        match self.passes.as_slice() {
            [] => Itinerary::new(Vec::new(), Vec::new()),
            [first, ..] if self.uniform() => Itinerary::new(first.forward.clone(), first.backward.clone()),
            all => Itinerary::new(
                all.iter().flat_map(|p| p.forward.iter().copied()).collect(),
                all.iter().flat_map(|p| p.backward.iter().copied()).collect(),
            ),
        }
    }

    /// How this trace differs from `it`; `None` when it followed it exactly.
    pub fn difference(&self, it: &Itinerary) -> Option<Difference> {
        let mine = self.itinerary();
        if mine.order == it.order && mine.forward_len == it.forward_len {
            return None;
        }
        let first_difference = mine
            .order
            .iter()
            .zip(&it.order)
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| mine.order.len().min(it.order.len()));
        let mut added: Vec<BlockId> = mine.order.iter().copied().filter(|b| !it.order.contains(b)).collect();
        let mut removed: Vec<BlockId> = it.order.iter().copied().filter(|b| !mine.order.contains(b)).collect();
        added.sort();
        added.dedup();
        removed.sort();
        removed.dedup();
        Some(Difference {
            first_difference,
            added,
            removed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    fn mirrored(n: u32) -> Itinerary {
        let f = ids(&(0..n).collect::<Vec<_>>());
        let mut b = f.clone();
        b.reverse();
        Itinerary::new(f, b)
    }

    #[test]
    fn the_itinerary_runs_forward_then_backward_and_wraps() {
        let i = mirrored(3);
        let order: Vec<_> = (0..7).map(|p| i.at(p).0).collect();
        assert_eq!(order, [0, 1, 2, 2, 1, 0, 0]);
        assert_eq!(i.position(BlockId(1), false, None), Some(1));
        assert_eq!(i.position(BlockId(1), true, None), Some(4));
        let fwd_only = Itinerary::new(ids(&[0]), vec![]);
        assert_eq!(fwd_only.position(BlockId(0), true, None), None);
    }

    #[test]
    fn a_block_without_backward_use_is_not_in_backward() {
        // An embedding (block 0) is read in forward only: backward never needs it loaded.
        let i = Itinerary::new(ids(&[0, 1, 2]), ids(&[2, 1]));
        assert_eq!(i.len(), 5);
        assert_eq!(i.window(3, 3), [BlockId(1), BlockId(0)], "after 1 comes the next step's 0");
        assert_eq!(i.distance(3, BlockId(0)), Some(2));
    }

    #[test]
    fn the_window_looks_ahead_in_the_current_direction() {
        let i = mirrored(4);
        assert_eq!(i.window(0, 2), [BlockId(1), BlockId(2)]);
        assert_eq!(i.window(2, 2), [BlockId(3), BlockId(1)]);
        assert_eq!(i.window(5, 2), [BlockId(1), BlockId(0)]);
        assert_eq!(i.window(7, 2), [BlockId(1), BlockId(2)]);
        assert!(i.window(0, 0).is_empty());
    }

    #[test]
    fn traces_collapse_repeats_and_report_their_difference() {
        let mut t = Trace::default();
        for b in [0, 0, 1, 1, 1, 2] {
            t.record(BlockId(b), false);
        }
        for b in [2, 1, 0] {
            t.record(BlockId(b), true);
        }
        let it = t.itinerary();
        assert_eq!(it.forward(), ids(&[0, 1, 2]));
        assert_eq!(t.difference(&it), None);
        let mut other = Trace::default();
        for b in [0, 3, 2] {
            other.record(BlockId(b), false);
        }
        let d = other.difference(&it).expect("differs");
        assert_eq!((d.first_difference, d.added, d.removed), (1, ids(&[3]), ids(&[1])));
    }

    fn passes(t: &mut Trace, passes: &[(&[u32], &[u32])]) {
        t.clear();
        for (f, b) in passes {
            for &x in *f {
                t.record(BlockId(x), false);
            }
            for &x in *b {
                t.record(BlockId(x), true);
            }
        }
    }

    #[test]
    fn micro_batches_that_repeat_one_order_are_one_pass_taken_as_many_times() {
        let mut t = Trace::default();
        // Three micro-batches over a model of one block and two: a repeat of the block across
        // a pass's end is another pass, not a repeat.
        passes(&mut t, &[(&[0], &[0]), (&[0], &[0]), (&[0], &[0])]);
        assert_eq!((t.itinerary(), t.passes()), (Itinerary::new(ids(&[0]), ids(&[0])), 3));
        passes(&mut t, &[(&[0, 1, 2], &[2, 1]), (&[0, 1, 2], &[2, 1])]);
        assert_eq!((t.itinerary(), t.passes()), (Itinerary::new(ids(&[0, 1, 2]), ids(&[2, 1])), 2));
        assert_eq!(t.difference(&Itinerary::new(ids(&[0, 1, 2]), ids(&[2, 1]))), None, "one step's pass");
        // Passes that differ: every forward use, then every backward use, as one step.
        passes(&mut t, &[(&[0, 1], &[1]), (&[0, 2], &[2])]);
        assert_eq!((t.itinerary(), t.passes()), (Itinerary::new(ids(&[0, 1, 0, 2]), ids(&[1, 2])), 1));
        // A forward alone (evaluation, a frozen model) is one pass.
        passes(&mut t, &[(&[0, 1], &[])]);
        assert_eq!(t.passes(), 1);
    }
}
