//! The itinerary and the decisions made from it: the prefetch window (the next k blocks in
//! the current direction) and the eviction score (distance to the next use × size).

use crate::events::BlockId;

/// The order blocks are used in one training step: the traced forward order, then (unless
/// inference) the same reversed for backward. Positions are cyclic: after the last position
/// comes the next step's first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Itinerary {
    forward: Vec<BlockId>,
    with_backward: bool,
}

impl Itinerary {
    /// An itinerary from the forward order.
    pub fn new(forward: Vec<BlockId>, with_backward: bool) -> Itinerary {
        Itinerary {
            forward,
            with_backward,
        }
    }

    /// The forward order.
    pub fn forward(&self) -> &[BlockId] {
        &self.forward
    }

    /// Positions in a full step.
    pub fn len(&self) -> usize {
        self.forward.len() * if self.with_backward { 2 } else { 1 }
    }

    /// True for an itinerary without blocks.
    pub fn is_empty(&self) -> bool {
        self.forward.is_empty()
    }

    /// The block at position `pos` (cyclic).
    pub fn at(&self, pos: usize) -> BlockId {
        let n = self.forward.len();
        let p = pos % self.len();
        if p < n {
            self.forward[p]
        } else {
            self.forward[2 * n - 1 - p]
        }
    }

    /// The position of `block` in the forward half (or the backward half). With a block used
    /// twice, the first use after `after` wins (cyclically), which keeps a walk monotone.
    pub fn position(&self, block: BlockId, backward: bool, after: Option<usize>) -> Option<usize> {
        if self.is_empty() || (backward && !self.with_backward) {
            return None;
        }
        let n = self.forward.len();
        let half = if backward { n..2 * n } else { 0..n };
        let start = after.map(|a| a + 1).unwrap_or(half.start);
        (0..self.len())
            .map(|i| (start + i) % self.len())
            .find(|p| half.contains(p) && self.at(*p) == block)
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

/// The eviction score: farther next use and larger size evict first. A block the itinerary
/// never uses scores as if it were a full step away.
pub fn eviction_score(itinerary: Option<&Itinerary>, pos: Option<usize>, block: BlockId, bytes: usize) -> f64 {
    let d = match (itinerary, pos) {
        (Some(it), Some(p)) => it.distance(p, block).unwrap_or(it.len()),
        (Some(it), None) => it.len(),
        _ => 1,
    };
    d as f64 * bytes as f64
}

/// Candidates ordered for eviction, highest score first; ties go to the lower id.
pub fn rank_victims(
    itinerary: Option<&Itinerary>,
    pos: Option<usize>,
    candidates: &[(BlockId, usize)],
) -> Vec<(BlockId, f64)> {
    let mut v: Vec<_> = candidates
        .iter()
        .map(|&(b, bytes)| (b, eviction_score(itinerary, pos, b, bytes)))
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn it(n: u32) -> Itinerary {
        Itinerary::new((0..n).map(BlockId).collect(), true)
    }

    #[test]
    fn the_itinerary_runs_forward_then_backward_and_wraps() {
        let i = it(3);
        let order: Vec<_> = (0..7).map(|p| i.at(p).0).collect();
        assert_eq!(order, [0, 1, 2, 2, 1, 0, 0]);
        assert_eq!(i.position(BlockId(1), false, None), Some(1));
        assert_eq!(i.position(BlockId(1), true, None), Some(4));
        assert_eq!(Itinerary::new(vec![BlockId(0)], false).position(BlockId(0), true, None), None);
    }

    #[test]
    fn the_window_looks_ahead_in_the_current_direction() {
        let i = it(4);
        assert_eq!(i.window(0, 2), [BlockId(1), BlockId(2)]);
        // Near the end of forward the window runs into backward (which starts with block 3).
        assert_eq!(i.window(2, 2), [BlockId(3), BlockId(1)]);
        // In backward (position 5 is block 2) the window walks down.
        assert_eq!(i.window(5, 2), [BlockId(1), BlockId(0)]);
        // At the end of backward it wraps to the next forward.
        assert_eq!(i.window(7, 2), [BlockId(1), BlockId(2)]);
        assert!(i.window(0, 0).is_empty());
    }

    #[test]
    fn eviction_prefers_the_farthest_next_use_weighted_by_size() {
        let i = it(4);
        // In forward at block 2 (pos 2): next uses: 3 at +1, 1 at +3 (backward), 0 at +5.
        let r = rank_victims(Some(&i), Some(2), &[(BlockId(3), 10), (BlockId(1), 10), (BlockId(0), 10)]);
        let order: Vec<_> = r.iter().map(|v| v.0 .0).collect();
        assert_eq!(order, [0, 1, 3]);
        assert_eq!(r[0].1, 50.0);
        // Size weighs in: a 4x larger near block outranks a farther small one.
        let r = rank_victims(Some(&i), Some(2), &[(BlockId(0), 10), (BlockId(1), 40)]);
        assert_eq!(r[0].0, BlockId(1));
        // In backward at block 1 (pos 6): block 0 is next (+1), block 3 is farthest (next step).
        let r = rank_victims(Some(&i), Some(6), &[(BlockId(0), 1), (BlockId(3), 1), (BlockId(2), 1)]);
        let order: Vec<_> = r.iter().map(|v| v.0 .0).collect();
        assert_eq!(order, [3, 2, 0]);
    }
}
