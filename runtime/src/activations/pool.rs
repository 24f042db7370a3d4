//! The size-class host pool that spills land in (seed section 5.2).
//!
//! Each class is one host allocation (pinned on CUDA) cut into equal slabs, made once at start:
//! pinning is far too slow for the hot path. A request takes a slab of the smallest class that
//! fits; when that class is empty it tries each larger class; when all are empty it falls back
//! to a pageable buffer (a counted miss and a warning), or refuses when the fallback is off.
//! A lease remembers its class and slab, so release returns it to exactly where it came from.

use super::Telemetry;
use crate::device::{Device, HostBuffer};
use crate::error::{Error, Result};
use crate::events::{EventKind, Owner, PoolClass, PoolKind, SlabId};

/// Where a spill's bytes live.
#[derive(Debug)]
pub enum PoolLease {
    /// A slab of a size class: `offset` bytes into that class's buffer.
    Slab {
        /// Class index.
        class: u32,
        /// Slab index within the class.
        slab: SlabId,
        /// Byte offset of the slab in the class buffer.
        offset: usize,
    },
    /// A pageable buffer made because no slab fitted.
    Fallback(HostBuffer),
}

impl PoolLease {
    /// The size class, for slabs.
    pub fn class(&self) -> Option<u32> {
        match self {
            PoolLease::Slab { class, .. } => Some(*class),
            PoolLease::Fallback(_) => None,
        }
    }
}

#[derive(Debug)]
struct SizeClass {
    slab_bytes: usize,
    slabs: u32,
    buffer: HostBuffer,
    /// Free slab indices; popped from the end so the most recently freed slab (warm in cache
    /// and TLB) is reused first.
    free: Vec<u32>,
}

/// Occupancy of the pool, for tests and dashboards.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Free slabs per class.
    pub free: Vec<u32>,
    /// Slabs per class.
    pub total: Vec<u32>,
    /// Pageable fallback buffers handed out since the pool was made.
    pub fallbacks: u64,
    /// Fallback buffers not yet released.
    pub fallbacks_live: u64,
}

/// The size-class pool.
#[derive(Debug)]
pub struct SpillPool {
    classes: Vec<SizeClass>,
    pageable_fallback: bool,
    fallbacks: u64,
    fallbacks_live: u64,
    telemetry: Telemetry,
}

impl SpillPool {
    /// Allocates every class at once (`class_sizes` ascending, `slabs` parallel to it).
    pub fn new(
        device: &Device,
        class_sizes: &[u64],
        slabs: &[u32],
        pageable_fallback: bool,
        telemetry: Telemetry,
    ) -> Result<SpillPool> {
        if class_sizes.len() != slabs.len() {
            return Err(Error::Config {
                field: "slabs_per_class",
                value: format!("{slabs:?}"),
                expected: format!("one count per class ({} classes)", class_sizes.len()),
            });
        }
        let mut classes = Vec::with_capacity(class_sizes.len());
        for (&size, &count) in class_sizes.iter().zip(slabs) {
            let slab_bytes = usize::try_from(size).map_err(|_| Error::TooLarge {
                what: "pool class".into(),
                needed: size,
                limit: "the address space is smaller".into(),
            })?;
            let total = slab_bytes.checked_mul(count as usize).ok_or_else(|| Error::TooLarge {
                what: "pool class".into(),
                needed: size.saturating_mul(count as u64),
                limit: "the address space is smaller".into(),
            })?;
            classes.push(SizeClass {
                slab_bytes,
                slabs: count,
                buffer: device.alloc_host(total)?,
                free: (0..count).rev().collect(),
            });
        }
        let pinned = classes.iter().any(|c| c.buffer.is_pinned());
        telemetry.publish_with(|| EventKind::PoolConfigured {
            pool: PoolKind::Activations,
            classes: classes
                .iter()
                .map(|c| PoolClass {
                    slab_bytes: c.slab_bytes as u64,
                    slabs: c.slabs,
                })
                .collect(),
            pinned,
        });
        Ok(SpillPool {
            classes,
            pageable_fallback,
            fallbacks: 0,
            fallbacks_live: 0,
            telemetry,
        })
    }

    /// A buffer of at least `bytes`; the flag says whether it came from a slab (a pool hit).
    pub fn acquire(&mut self, bytes: u64) -> Result<(PoolLease, bool)> {
        let first = self.classes.iter().position(|c| c.slab_bytes as u64 >= bytes);
        if let Some(first) = first {
            for (i, class) in self.classes.iter_mut().enumerate().skip(first) {
                if let Some(slab) = class.free.pop() {
                    let offset = slab as usize * class.slab_bytes;
                    self.telemetry.publish_with(|| EventKind::SlabAcquired {
                        pool: PoolKind::Activations,
                        class: i as u32,
                        slab: SlabId(slab),
                        bytes,
                        waited_ms: 0.0,
                    });
                    return Ok((
                        PoolLease::Slab {
                            class: i as u32,
                            slab: SlabId(slab),
                            offset,
                        },
                        true,
                    ));
                }
            }
        }
        let class = first.unwrap_or(self.classes.len()) as u32;
        self.telemetry.publish_with(|| EventKind::PoolExhausted {
            pool: PoolKind::Activations,
            class,
            requested_bytes: bytes,
        });
        if !self.pageable_fallback {
            return Err(Error::TooLarge {
                what: "activation spill".into(),
                needed: bytes,
                limit: "no pool slab is free or large enough and the pageable fallback is off".into(),
            });
        }
        let len = usize::try_from(bytes).map_err(|_| Error::TooLarge {
            what: "activation spill".into(),
            needed: bytes,
            limit: "the address space is smaller".into(),
        })?;
        self.fallbacks += 1;
        self.fallbacks_live += 1;
        self.telemetry.publish_with(|| EventKind::PageableFallback {
            pool: PoolKind::Activations,
            bytes,
        });
        if self.fallbacks == 1 {
            // One warning per pool: the counters carry the rest.
            self.telemetry.publish_with(|| EventKind::Warning {
                source: Owner::Activations,
                message: format!(
                    "activation pool has no free slab for {bytes} bytes; spilling to pageable memory (slower copies); consider more slabs"
                ),
            });
        }
        Ok((PoolLease::Fallback(HostBuffer::pageable(len)), false))
    }

    /// Returns a lease to its class (fallback buffers are freed).
    pub fn release(&mut self, lease: PoolLease) {
        match lease {
            PoolLease::Slab { class, slab, .. } => {
                if let Some(c) = self.classes.get_mut(class as usize) {
                    debug_assert!(!c.free.contains(&slab.0), "slab {slab} of class {class} released twice");
                    c.free.push(slab.0);
                    self.telemetry.publish_with(|| EventKind::SlabReleased {
                        pool: PoolKind::Activations,
                        class,
                        slab,
                    });
                }
            }
            PoolLease::Fallback(_) => self.fallbacks_live = self.fallbacks_live.saturating_sub(1),
        }
    }

    /// The buffer and byte offset a lease points to.
    pub fn buffer<'a>(&'a self, lease: &'a PoolLease) -> Result<(&'a HostBuffer, usize)> {
        match lease {
            PoolLease::Slab { class, offset, .. } => self
                .classes
                .get(*class as usize)
                .map(|c| (&c.buffer, *offset))
                .ok_or_else(|| Error::State(format!("pool class {class} does not exist"))),
            PoolLease::Fallback(b) => Ok((b, 0)),
        }
    }

    /// The buffer and byte offset a lease points to, writable.
    pub fn buffer_mut<'a>(&'a mut self, lease: &'a mut PoolLease) -> Result<(&'a mut HostBuffer, usize)> {
        match lease {
            PoolLease::Slab { class, offset, .. } => self
                .classes
                .get_mut(*class as usize)
                .map(|c| (&mut c.buffer, *offset))
                .ok_or_else(|| Error::State(format!("pool class {class} does not exist"))),
            PoolLease::Fallback(b) => Ok((b, 0)),
        }
    }

    /// Occupancy.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            free: self.classes.iter().map(|c| c.free.len() as u32).collect(),
            total: self.classes.iter().map(|c| c.slabs).collect(),
            fallbacks: self.fallbacks,
            fallbacks_live: self.fallbacks_live,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(fallback: bool) -> SpillPool {
        SpillPool::new(&Device::host(0), &[1024, 4096], &[2, 1], fallback, Telemetry::off()).expect("pool")
    }

    #[test]
    fn smallest_fitting_class_then_larger_then_fallback() {
        let mut p = pool(true);
        let (a, hit_a) = p.acquire(100).expect("a");
        let (b, hit_b) = p.acquire(1024).expect("b");
        assert_eq!((a.class(), hit_a, b.class(), hit_b), (Some(0), true, Some(0), true));
        // Class 0 is empty: the next small request goes to class 1.
        let (c, hit_c) = p.acquire(10).expect("c");
        assert_eq!((c.class(), hit_c), (Some(1), true));
        // Everything is taken: pageable fallback, a miss.
        let (d, hit_d) = p.acquire(10).expect("d");
        assert_eq!((d.class(), hit_d), (None, false));
        // Larger than every class: straight to the fallback.
        let (e, hit_e) = p.acquire(1 << 20).expect("e");
        assert_eq!((e.class(), hit_e), (None, false));
        assert_eq!(p.buffer(&e).expect("buffer").0.len(), 1 << 20);
        assert_eq!(p.stats().fallbacks, 2);
        assert_eq!(p.stats().free, vec![0, 0]);
        for l in [a, b, c, d, e] {
            p.release(l);
        }
        let s = p.stats();
        assert_eq!((s.free, s.fallbacks_live), (vec![2, 1], 0));
    }

    #[test]
    fn slabs_do_not_overlap_and_return_to_their_class() {
        let mut p = pool(false);
        let (a, _) = p.acquire(1000).expect("a");
        let (b, _) = p.acquire(1000).expect("b");
        let off = |l: &PoolLease| match l {
            PoolLease::Slab { offset, .. } => *offset,
            PoolLease::Fallback(_) => usize::MAX,
        };
        assert_ne!(off(&a), off(&b));
        assert!(off(&a).abs_diff(off(&b)) >= 1024);
        p.release(b);
        let (c, _) = p.acquire(10).expect("c");
        assert_eq!(c.class(), Some(0), "a released slab goes back to its own class");
        p.release(a);
        p.release(c);
    }

    #[test]
    fn without_fallback_an_exhausted_pool_refuses() {
        let mut p = pool(false);
        let _big = p.acquire(4096).expect("class 1");
        let err = p.acquire(2000).expect_err("nothing fits");
        assert!(err.to_string().contains("pageable fallback is off"), "{err}");
        assert!(p.acquire(1 << 20).is_err());
    }
}
