//! What a traced step teaches about the spills: how much pinned memory they hold at once, by
//! size (the record from which the pool is rebuilt, so that later steps find a slab for every
//! spill), and the forward's region groups with their spillable bytes.

use std::collections::BTreeMap;

/// What the first step learned about one region group of the forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupProfile {
    /// The region that opened the group.
    pub name: String,
    /// Bytes of the tensors in the group that could be spilled.
    pub bytes: u64,
    /// How many such tensors.
    pub tensors: u32,
}


/// Sizes are rounded up to this (a page: slabs stay page-aligned for DMA).
const ALIGN: u64 = 4096;

fn bucket(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

/// Spilled tensors held at once, by rounded size.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct SizeProfile {
    live: BTreeMap<u64, u32>,
    /// The most held at once of each size, over every step seen (so the pool only grows).
    peak: BTreeMap<u64, u32>,
}

impl SizeProfile {
    /// A spill of `bytes` now holds host memory.
    pub(super) fn spilled(&mut self, bytes: u64) {
        let b = bucket(bytes);
        let n = self.live.entry(b).or_insert(0);
        *n += 1;
        let n = *n;
        let p = self.peak.entry(b).or_insert(0);
        *p = (*p).max(n);
    }

    /// A spill of `bytes` gave its host memory back.
    pub(super) fn released(&mut self, bytes: u64) {
        if let Some(n) = self.live.get_mut(&bucket(bytes)) {
            *n = n.saturating_sub(1);
        }
    }

    /// Nothing was ever spilled.
    pub(super) fn is_empty(&self) -> bool {
        self.peak.is_empty()
    }

    /// A step ended: nothing is held any more (the peaks stay).
    pub(super) fn clear_step(&mut self) {
        self.live.clear();
    }

    /// Pool classes and slab counts that hold every peak at once, in at most `max_classes`
    /// classes: when there are more sizes, the smallest are served by the next larger class.
    /// Each class gets an eighth more (at least one slab): the traced step is usually the first,
    /// whose memory differs from later steps', so a later step may spill a little more; a slab
    /// too few costs a pageable copy and a rebuild of the whole pool.
    pub(super) fn plan(&self, max_classes: usize) -> (Vec<u64>, Vec<u32>) {
        let mut v: Vec<(u64, u32)> = self.peak.iter().map(|(&b, &n)| (b, n)).collect();
        while v.len() > max_classes.max(1) {
            let (_, n) = v.remove(0);
            v[0].1 += n;
        }
        v.into_iter().map(|(b, n)| (b, n.saturating_add(n.div_ceil(8).max(1)))).unzip()
    }

    /// [`SizeProfile::plan`] with room for `extra` more bytes of spills held at once, spread over
    /// the classes as the traced bytes are (lower spill watermarks spill that much more).
    pub(super) fn plan_with(&self, max_classes: usize, extra: u64) -> (Vec<u64>, Vec<u32>) {
        let (classes, mut slabs) = self.plan(max_classes);
        let total: u128 = classes.iter().zip(&slabs).map(|(&c, &n)| c as u128 * n as u128).sum();
        if total > 0 && extra > 0 {
            for (&c, n) in classes.iter().zip(slabs.iter_mut()) {
                let share = c as u128 * *n as u128 * extra as u128 / total;
                let more = share.div_ceil(c.max(1) as u128).min(u32::MAX as u128) as u32;
                *n = n.saturating_add(more);
            }
        }
        (classes, slabs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_holds_the_most_held_at_once_of_each_size() {
        let mut p = SizeProfile::default();
        for _ in 0..3 {
            p.spilled(10_000);
        }
        p.spilled(1 << 20);
        p.released(10_000);
        p.spilled(10_000);
        p.clear_step();
        p.spilled(1 << 20);
        p.spilled(1 << 20);
        // The peaks (3 and 2) with an eighth more, at least one.
        assert_eq!(p.plan(8), (vec![12_288, 1 << 20], vec![4, 3]));
        // One class only: the small spills take slabs of the larger size (5, and one more).
        assert_eq!(p.plan(1), (vec![1 << 20], vec![6]));
        // 1.5 MiB more, spread as the traced bytes are (rounded up to whole slabs in each class).
        assert_eq!(p.plan_with(8, 3 << 19), (vec![12_288, 1 << 20], vec![6, 5]));
        assert_eq!(p.plan_with(8, 0), p.plan(8));
        let mut big = SizeProfile::default();
        for _ in 0..80 {
            big.spilled(4096);
        }
        assert_eq!(big.plan(8).1, vec![90]);
    }
}
