//! The pinned host pool both runtimes copy through: size classes of equal slabs, pinned when the
//! pool is made (never on a hot path) and cut from an arena (a [`HostPool`]), handed out as RAII
//! [`Lease`]s that return to their class when dropped.
//!
//! A request takes a slab of the smallest class that fits, then of each larger class. When every
//! class is empty, [`SlabPool::acquire`] falls back to a buffer of its own (a counted miss and
//! one warning) if the pool allows it, or refuses: pinned on the spot on CUDA, where pinning
//! large buffers is fast enough (`device/pinning.rs`) that the copy staying asynchronous is worth
//! it, pageable over the pinned limit, where pinning fails, or on the host device.
//! [`SlabPool::acquire_wait`] waits for a slab instead, in slices so shutdown is noticed.
//!
//! The weight runtime stages file-backed blocks through a one-class pool; the activation runtime
//! spills into a pool whose classes were sized from a traced step, in an arena it keeps across
//! the pools it makes.

use crate::device::{Device, HostBuffer, HostMemory, HostPool, HostTarget};
use crate::error::{Error, Result};
use crate::events::{Bus, EventKind, Owner, PoolClass, PoolKind, SlabId};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long one wait slice lasts; a waiter re-checks shutdown and its deadline after each.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Occupancy of a pool, for tests and dashboards.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PoolStats {
    /// Slabs per class.
    pub total: Vec<u32>,
    /// Free slabs per class.
    pub free: Vec<u32>,
    /// Most slabs of each class in use at once.
    pub peak_in_use: Vec<u32>,
    /// Buffers handed out because no slab was free, and bytes of them.
    pub fallbacks: u64,
    pub fallback_bytes: u64,
    /// Bytes of those that were pinned on the spot (the rest were pageable), and of those not
    /// yet dropped.
    pub pinned_fallback_bytes: u64,
    pub pinned_fallback_live_bytes: u64,
    /// Fallback buffers not yet dropped.
    pub fallbacks_live: u64,
    /// Acquisitions that had to wait, and for how long in all.
    pub wait_count: u64,
    pub total_wait_ms: f64,
}

impl PoolStats {
    /// Slabs in use now, over all classes.
    pub fn in_use(&self) -> u32 {
        self.total.iter().zip(&self.free).map(|(t, f)| t - f).sum()
    }
}

#[derive(Debug)]
struct Class {
    slab_bytes: usize,
    /// Slabs in each range (the last may hold fewer).
    per_range: usize,
    /// The class's memory, cut from the arena in ranges (see [`SlabPool::in_arena`]).
    ranges: Vec<HostBuffer>,
}

impl Class {
    fn range_of(&self, slab: u32) -> (&HostBuffer, usize) {
        let s = slab as usize;
        (&self.ranges[s / self.per_range], (s % self.per_range) * self.slab_bytes)
    }
}

#[derive(Debug)]
struct State {
    /// Free slab indices per class, most recently freed last (warm in cache and TLB).
    free: Vec<Vec<u32>>,
    shutdown: bool,
    stats: PoolStats,
}

#[derive(Debug)]
struct Shared {
    kind: PoolKind,
    /// Where the slabs and the fallback buffers are cut from.
    arena: HostPool,
    /// Bytes the arena may hold in use (this pool's slabs, its live fallbacks, a pool being
    /// replaced) with a new fallback pinned; a fallback over it is pageable (`u64::MAX`: no
    /// limit).
    pinned_limit: std::sync::atomic::AtomicU64,
    classes: Vec<Class>,
    pageable_fallback: bool,
    /// Warn on the first pageable fallback (off for a provisional pool, which a traced step
    /// replaces).
    warn: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    cv: Condvar,
    bus: Bus,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a push, a pop or a counter: a panic elsewhere leaves it consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The size-class pool. Cheap to clone; clones share it.
#[derive(Debug, Clone)]
pub struct SlabPool {
    shared: Arc<Shared>,
}

/// What a lease points at.
#[derive(Debug)]
enum Memory {
    Slab { class: u32, slab: SlabId },
    Fallback(HostBuffer),
}

/// Host memory on loan from a [`SlabPool`]: a slab (or a fallback buffer) of at least
/// the requested size, returned when the lease drops.
#[derive(Debug)]
pub struct Lease {
    memory: Memory,
    len: usize,
    /// The bytes asked for (a slab may be larger).
    requested: usize,
    pool: Arc<Shared>,
}

impl SlabPool {
    /// Allocates every class at once: `slabs[i]` slabs of `class_bytes[i]` bytes (ascending),
    /// pinned on CUDA, in one allocation of its own.
    pub fn new(
        device: &Device,
        kind: PoolKind,
        class_bytes: &[u64],
        slabs: &[u32],
        pageable_fallback: bool,
        bus: Bus,
    ) -> Result<SlabPool> {
        let layout = Layout::of(class_bytes, slabs, usize::MAX)?;
        let arena = HostPool::new(device);
        arena.reserve(layout.bytes())?;
        SlabPool::build(&arena, kind, layout, pageable_fallback, bus)
    }

    /// [`SlabPool::new`] with the classes cut from `arena`, and the fallback buffers as well:
    /// what one pool gives back (a step's fallbacks restored, a pool replaced) serves the next
    /// without pinning again. A class is cut in ranges of at most the arena's smallest chunk (or
    /// one slab), so that they fill the chunks a growing arena pinned, small ones included.
    pub fn in_arena(
        arena: &HostPool,
        kind: PoolKind,
        class_bytes: &[u64],
        slabs: &[u32],
        pageable_fallback: bool,
        bus: Bus,
    ) -> Result<SlabPool> {
        let layout = Layout::of(class_bytes, slabs, arena.chunk_bytes())?;
        SlabPool::build(arena, kind, layout, pageable_fallback, bus)
    }

    fn build(arena: &HostPool, kind: PoolKind, layout: Layout, pageable_fallback: bool, bus: Bus) -> Result<SlabPool> {
        let mut classes = Vec::with_capacity(layout.classes.len());
        for &(slab_bytes, count, per_range) in &layout.classes {
            let ranges = range_slabs(count, per_range).map(|n| arena.alloc(n * slab_bytes)).collect::<Result<Vec<_>>>()?;
            classes.push(Class { slab_bytes, per_range, ranges });
        }
        let pinned = classes.iter().flat_map(|c| &c.ranges).any(|r| r.is_pinned());
        let slabs: Vec<u32> = layout.classes.iter().map(|&(_, n, _)| n as u32).collect();
        bus.publish(EventKind::PoolConfigured {
            pool: kind,
            classes: layout.classes.iter().map(|&(b, n, _)| PoolClass { slab_bytes: b as u64, slabs: n as u32 }).collect(),
            pinned,
        });
        Ok(SlabPool::with_classes(arena, kind, classes, &slabs, pageable_fallback, bus))
    }

    fn with_classes(arena: &HostPool, kind: PoolKind, classes: Vec<Class>, slabs: &[u32], pageable_fallback: bool, bus: Bus) -> SlabPool {
        SlabPool {
            shared: Arc::new(Shared {
                kind,
                arena: arena.clone(),
                pinned_limit: std::sync::atomic::AtomicU64::new(u64::MAX),
                classes,
                pageable_fallback,
                warn: std::sync::atomic::AtomicBool::new(true),
                state: Mutex::new(State {
                    free: slabs.iter().map(|&n| (0..n).rev().collect()).collect(),
                    shutdown: false,
                    stats: PoolStats {
                        total: slabs.to_vec(),
                        free: slabs.to_vec(),
                        peak_in_use: vec![0; slabs.len()],
                        ..PoolStats::default()
                    },
                }),
                cv: Condvar::new(),
                bus,
            }),
        }
    }

    /// A pool of no slabs in this one's arena, with its fallback, limit and warning: what stands
    /// in while a pool is replaced, so the old one's memory goes back to the arena before the
    /// new one is cut from it. Publishes nothing.
    pub fn vacant(&self) -> SlabPool {
        let sh = &self.shared;
        let pool = SlabPool::with_classes(&sh.arena, sh.kind, Vec::new(), &[], sh.pageable_fallback, sh.bus.clone());
        pool.shared.pinned_limit.store(sh.pinned_limit.load(std::sync::atomic::Ordering::Relaxed), std::sync::atomic::Ordering::Relaxed);
        pool.set_warn_on_fallback(sh.warn.load(std::sync::atomic::Ordering::Relaxed));
        pool
    }

    /// The arena its slabs and fallbacks are cut from.
    pub fn arena(&self) -> &HostPool {
        &self.shared.arena
    }

    /// Bytes of every slab together (pinned on CUDA), free or leased.
    #[cfg(test)]
    pub fn capacity_bytes(&self) -> u64 {
        let st = self.shared.lock();
        self.shared.classes.iter().zip(&st.stats.total).map(|(c, &n)| c.slab_bytes as u64 * n as u64).sum()
    }

    /// Bytes of the largest slab.
    pub fn largest_slab(&self) -> usize {
        self.shared.classes.last().map_or(0, |c| c.slab_bytes)
    }


    /// A slab of at least `bytes` now, from the smallest class that has one; when none is free,
    /// a fallback buffer (if the pool allows it: pinned on CUDA, else pageable) or an error. The
    /// flag says whether it is a slab (a pool hit).
    pub fn acquire(&self, bytes: usize) -> Result<(Lease, bool)> {
        if let Some(lease) = self.take(bytes, Duration::ZERO)? {
            return Ok((lease, true));
        }
        let sh = &self.shared;
        if !sh.pageable_fallback {
            return Err(Error::TooLarge {
                what: format!("{} pool slab", wire(sh.kind)),
                needed: bytes as u64,
                limit: "no slab is free or large enough and the pageable fallback is off".into(),
            });
        }
        // The arena's bytes in use: this pool's slabs, its live fallbacks, and a pool being replaced.
        let held = sh.arena.stats().in_use_bytes;
        let may_pin = held.saturating_add(bytes as u64) <= sh.pinned_limit.load(std::sync::atomic::Ordering::Relaxed);
        // Over the pinned limit, or where pinning fails, pageable memory takes the copy (counted
        // and reported as such below). On the host device the arena's memory is plain memory.
        let buf = match may_pin.then(|| sh.arena.alloc(bytes)) {
            Some(Ok(b)) => b,
            _ => HostBuffer::pageable(bytes)?,
        };
        let pinned = buf.is_pinned();
        let first = {
            let mut st = sh.lock();
            st.stats.fallbacks += 1;
            st.stats.fallbacks_live += 1;
            st.stats.fallback_bytes += bytes as u64;
            if pinned {
                st.stats.pinned_fallback_bytes += bytes as u64;
                st.stats.pinned_fallback_live_bytes += bytes as u64;
            }
            st.stats.fallbacks == 1
        };
        if !pinned {
            sh.bus.publish(EventKind::PageableFallback {
                pool: sh.kind,
                bytes: bytes as u64,
            });
        }
        if first && sh.warn.load(std::sync::atomic::Ordering::Relaxed) {
            // One warning per pool: the counters carry the rest.
            let how = if pinned {
                "pinning a buffer for it on the spot (a pause on the calling thread)"
            } else {
                "copying through pageable memory (slower)"
            };
            sh.bus.publish(EventKind::Warning {
                source: owner(sh.kind),
                message: format!("the {} pool had no free slab for {bytes} bytes; {how}; give it more slabs", wire(sh.kind)),
            });
        }
        Ok((
            Lease {
                memory: Memory::Fallback(buf),
                len: bytes,
                requested: bytes,
                pool: sh.clone(),
            },
            false,
        ))
    }

    /// A slab of at least `bytes`, waiting up to `timeout` (forever with `None`) for one to be
    /// freed. `Ok(None)` when the deadline passed.
    pub fn acquire_wait(&self, bytes: usize, timeout: Option<Duration>) -> Result<Option<Lease>> {
        self.take(bytes, timeout.unwrap_or(Duration::MAX))
    }

    fn take(&self, bytes: usize, timeout: Duration) -> Result<Option<Lease>> {
        let sh = &self.shared;
        let Some(first) = sh.classes.iter().position(|c| c.slab_bytes >= bytes) else {
            if sh.pageable_fallback && timeout.is_zero() {
                return Ok(None);
            }
            return Err(Error::TooLarge {
                what: format!("{} pool slab", wire(sh.kind)),
                needed: bytes as u64,
                limit: format!("the largest slab has {} bytes", self.largest_slab()),
            });
        };
        let start = Instant::now();
        let mut st = sh.lock();
        let mut exhausted = false;
        loop {
            if st.shutdown {
                return Err(Error::Shutdown("pinned pool"));
            }
            let found = (first..sh.classes.len()).find_map(|i| st.free[i].pop().map(|s| (i, s)));
            if let Some((class, slab)) = found {
                let waited_ms = if exhausted { start.elapsed().as_secs_f64() * 1e3 } else { 0.0 };
                st.stats.free[class] -= 1;
                let in_use = st.stats.total[class] - st.stats.free[class];
                st.stats.peak_in_use[class] = st.stats.peak_in_use[class].max(in_use);
                if exhausted {
                    st.stats.wait_count += 1;
                    st.stats.total_wait_ms += waited_ms;
                }
                drop(st);
                let slab = SlabId(slab);
                sh.bus.publish(EventKind::SlabAcquired {
                    pool: sh.kind,
                    class: class as u32,
                    slab,
                    bytes: bytes as u64,
                    waited_ms,
                });
                return Ok(Some(Lease {
                    memory: Memory::Slab { class: class as u32, slab },
                    len: sh.classes[class].slab_bytes,
                    requested: bytes,
                    pool: sh.clone(),
                }));
            }
            if !exhausted {
                exhausted = true;
                sh.bus.publish(EventKind::PoolExhausted {
                    pool: sh.kind,
                    class: first as u32,
                    requested_bytes: bytes as u64,
                });
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            st = sh
                .cv
                .wait_timeout(st, left.min(WAIT_SLICE))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Caps the pinned bytes the slabs and the fallback buffers pinned on the spot hold together
    /// (`None`: no cap); a fallback over it is pageable.
    pub fn limit_pinned(&self, limit: Option<u64>) {
        self.shared.pinned_limit.store(limit.unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the first pageable fallback publishes a warning (on by default; a provisional
    /// pool that a traced step will replace is quiet).
    pub fn set_warn_on_fallback(&self, on: bool) {
        self.shared.warn.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        self.shared.lock().stats.clone()
    }

    /// Refuses new acquisitions and wakes every waiter; leases out now stay valid until they
    /// drop (the memory is freed with the last clone of the pool). Idempotent.
    pub fn shutdown(&self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
    }
}

/// A pool's classes checked and laid out: (slab bytes, slabs, slabs per range).
struct Layout {
    classes: Vec<(usize, usize, usize)>,
}

impl Layout {
    /// Checks the classes (one count each, sizes ascending above zero, totals that fit the
    /// address space) and lays each out in ranges of at most `max_range` bytes (a slab larger
    /// than that gets a range of its own).
    fn of(class_bytes: &[u64], slabs: &[u32], max_range: usize) -> Result<Layout> {
        if class_bytes.len() != slabs.len() || class_bytes.is_empty() {
            return Err(Error::Config {
                field: "slabs_per_class",
                value: format!("{slabs:?} for classes {class_bytes:?}"),
                expected: "one slab count per class, at least one class".into(),
            });
        }
        if class_bytes.windows(2).any(|w| w[0] >= w[1]) || class_bytes.first() == Some(&0) {
            return Err(Error::Config {
                field: "class_sizes",
                value: format!("{class_bytes:?}"),
                expected: "sizes above zero in ascending order".into(),
            });
        }
        let too_large = |needed: u64| Error::TooLarge {
            what: "pinned pool class".into(),
            needed,
            limit: "the address space is smaller".into(),
        };
        let mut classes = Vec::with_capacity(class_bytes.len());
        for (&size, &count) in class_bytes.iter().zip(slabs) {
            let slab_bytes = usize::try_from(size).map_err(|_| too_large(size))?;
            slab_bytes.checked_mul(count as usize).ok_or_else(|| too_large(size.saturating_mul(count as u64)))?;
            let per_range = (max_range / slab_bytes).clamp(1, (count as usize).max(1));
            classes.push((slab_bytes, count as usize, per_range));
        }
        Ok(Layout { classes })
    }

    /// Bytes of every range, as the arena cuts them.
    fn bytes(&self) -> usize {
        self.classes.iter().flat_map(|&(b, n, per)| range_slabs(n, per).map(move |k| HostPool::range_bytes(k * b))).sum()
    }
}

/// The slabs in each range of a class of `count` slabs cut `per` to a range (at least 1): `per`
/// each, the last the rest. The one rule for cutting a class, which building a pool and sizing
/// its arena both follow.
fn range_slabs(count: usize, per: usize) -> impl Iterator<Item = usize> {
    let per = per.max(1);
    (0..count.div_ceil(per)).map(move |i| per.min(count - i * per))
}

fn wire(kind: PoolKind) -> &'static str {
    match kind {
        PoolKind::Weights => "weight",
        PoolKind::Activations => "activation",
    }
}

fn owner(kind: PoolKind) -> Owner {
    match kind {
        PoolKind::Weights => Owner::Weights,
        PoolKind::Activations => Owner::Activations,
    }
}

impl Lease {
    /// The bytes asked for when it was acquired (a slab may hold more).
    pub fn requested_bytes(&self) -> usize {
        self.requested
    }

    /// The size class, for slabs (`None` for a fallback buffer).
    pub fn class(&self) -> Option<u32> {
        match self.memory {
            Memory::Slab { class, .. } => Some(class),
            Memory::Fallback(_) => None,
        }
    }

    /// Whether the memory is page-locked (its copies run asynchronously).
    pub fn is_pinned(&self) -> bool {
        match &self.memory {
            Memory::Slab { class, slab } => self.pool.classes[*class as usize].range_of(slab.0).0.is_pinned(),
            Memory::Fallback(b) => b.is_pinned(),
        }
    }

    /// Bytes available.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    fn ptr(&self) -> *mut u8 {
        match &self.memory {
            Memory::Slab { class, slab } => {
                let (range, offset) = self.pool.classes[*class as usize].range_of(slab.0);
                // SAFETY: the slab lies inside its range (offset + len <= the range's length).
                unsafe { (range.host_ptr() as *mut u8).add(offset) }
            }
            Memory::Fallback(b) => b.host_ptr() as *mut u8,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the lease is the only user of its slab, which is valid for `len` bytes while
        // the pool (held by the lease) lives.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

// SAFETY: the slab's memory is owned by the pool's class buffer, which the lease keeps alive and
// which never moves; a slab is leased to one lease at a time.
unsafe impl HostMemory for Lease {
    fn host_ptr(&self) -> *const u8 {
        self.ptr()
    }
    fn host_len(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; the lease is the only handle to its slab.
unsafe impl HostTarget for Lease {
    fn host_ptr_mut(&mut self) -> *mut u8 {
        self.ptr()
    }
}

/// A range of a lease that several holders may share: one spilled tensor of a batch copied into
/// one slab. The slab goes back to the pool when the last part drops.
#[derive(Debug, Clone)]
pub struct LeasePart {
    lease: Arc<Lease>,
    offset: usize,
    len: usize,
}

impl LeasePart {
    /// `len` bytes of `lease` from `offset`; an error when they do not lie inside it.
    pub fn new(lease: Arc<Lease>, offset: usize, len: usize) -> Result<LeasePart> {
        if offset.checked_add(len).is_none_or(|end| end > lease.len) {
            return Err(Error::internal(format!(
                "a part of {len} bytes at {offset} of a lease of {} bytes",
                lease.len
            )));
        }
        Ok(LeasePart { lease, offset, len })
    }

    /// The part's bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.lease.as_slice()[self.offset..self.offset + self.len]
    }

    /// The part's bytes, writable while no other part shares the lease.
    #[cfg(test)]
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        let (offset, len) = (self.offset, self.len);
        Arc::get_mut(&mut self.lease).map(|l| &mut l.as_mut_slice()[offset..offset + len])
    }

    /// The bytes the whole lease was acquired for.
    pub fn requested_bytes(&self) -> usize {
        self.lease.requested
    }

    /// Whether this is the last part holding the lease (dropping it returns the slab).
    pub fn is_last(&self) -> bool {
        Arc::strong_count(&self.lease) == 1
    }
}

// SAFETY: the part lies inside its lease (checked at construction), which the `Arc` keeps alive
// and whose memory never moves; parts are only read once the copy that wrote the lease landed.
unsafe impl HostMemory for LeasePart {
    fn host_ptr(&self) -> *const u8 {
        // SAFETY: offset + len <= the lease's length.
        unsafe { self.lease.ptr().add(self.offset) }
    }
    fn host_len(&self) -> usize {
        self.len
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let sh = &self.pool;
        match &self.memory {
            Memory::Slab { class, slab, .. } => {
                {
                    let mut st = sh.lock();
                    let c = *class as usize;
                    debug_assert!(!st.free[c].contains(&slab.0), "slab {slab} of class {class} released twice");
                    st.free[c].push(slab.0);
                    st.stats.free[c] += 1;
                }
                sh.bus.publish(EventKind::SlabReleased {
                    pool: sh.kind,
                    class: *class,
                    slab: *slab,
                });
                sh.cv.notify_one();
            }
            Memory::Fallback(b) => {
                let mut st = sh.lock();
                st.stats.fallbacks_live = st.stats.fallbacks_live.saturating_sub(1);
                if b.is_pinned() {
                    st.stats.pinned_fallback_live_bytes = st.stats.pinned_fallback_live_bytes.saturating_sub(b.len() as u64);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
