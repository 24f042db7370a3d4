//! The uniform-slab pinned pool: every slab allocated once at creation, acquisition waits on a
//! condition variable (in slices, so shutdown is noticed), shutdown wakes every waiter.

use crate::device::{Device, HostBuffer};
use crate::error::{Error, Result};
use crate::events::{Bus, EventKind, PoolClass, PoolKind, SlabId};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long one wait slice lasts; a waiter re-checks shutdown and its deadline after each.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Counters of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolStats {
    pub total: u32,
    pub free: u32,
    pub in_use: u32,
    pub peak_in_use: u32,
    /// Acquisitions that had to wait.
    pub wait_count: u64,
    pub total_wait_ms: f64,
}

#[derive(Debug)]
struct State {
    free: VecDeque<(SlabId, HostBuffer)>,
    shutdown: bool,
    stats: PoolStats,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    slab_bytes: usize,
    bus: Bus,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A slab on loan; it goes back to its pool when dropped.
#[derive(Debug)]
pub struct Slab {
    id: SlabId,
    buf: Option<HostBuffer>,
    pool: Arc<Shared>,
}

impl Slab {
    /// Which slab.
    pub fn id(&self) -> SlabId {
        self.id
    }

    /// The memory.
    pub fn buffer(&self) -> &HostBuffer {
        self.buf.as_ref().expect("a slab holds its buffer until dropped")
    }

    /// The memory, writable.
    pub fn buffer_mut(&mut self) -> &mut HostBuffer {
        self.buf.as_mut().expect("a slab holds its buffer until dropped")
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let mut st = self.pool.lock();
        st.stats.in_use = st.stats.in_use.saturating_sub(1);
        if !st.shutdown {
            st.free.push_back((self.id, buf));
            st.stats.free += 1;
        }
        drop(st);
        self.pool.bus.publish(EventKind::SlabReleased {
            pool: PoolKind::Weights,
            class: 0,
            slab: self.id,
        });
        self.pool.cv.notify_all();
    }
}

/// Fixed-size pinned slabs, allocated once.
#[derive(Debug, Clone)]
pub struct PinnedPool {
    shared: Arc<Shared>,
}

impl PinnedPool {
    /// Allocates `num_slabs` slabs of `slab_bytes` (pinned on CUDA) at once.
    pub fn new(device: &Device, slab_bytes: usize, num_slabs: u32, bus: Bus) -> Result<PinnedPool> {
        if slab_bytes == 0 || num_slabs == 0 {
            return Err(Error::Config {
                field: "pinned_pool",
                value: format!("{num_slabs} slabs of {slab_bytes} bytes"),
                expected: "at least one slab of at least one byte".into(),
            });
        }
        let mut free = VecDeque::with_capacity(num_slabs as usize);
        let mut pinned = false;
        for i in 0..num_slabs {
            let b = device.alloc_host(slab_bytes)?;
            pinned = b.is_pinned();
            free.push_back((SlabId(i), b));
        }
        bus.publish(EventKind::PoolConfigured {
            pool: PoolKind::Weights,
            classes: vec![PoolClass {
                slab_bytes: slab_bytes as u64,
                slabs: num_slabs,
            }],
            pinned,
        });
        Ok(PinnedPool {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    free,
                    shutdown: false,
                    stats: PoolStats {
                        total: num_slabs,
                        free: num_slabs,
                        ..PoolStats::default()
                    },
                }),
                cv: Condvar::new(),
                slab_bytes,
                bus,
            }),
        })
    }

    /// Bytes of one slab.
    pub fn slab_bytes(&self) -> usize {
        self.shared.slab_bytes
    }

    /// Takes a slab for `bytes`, waiting up to `timeout` (forever with `None`) for one to be
    /// free. Errors: larger than a slab (`TooLarge`), shut down before or while waiting
    /// (`Shutdown`), or the deadline passed (`State`).
    pub fn acquire(&self, bytes: usize, timeout: Option<Duration>) -> Result<Slab> {
        let sh = &self.shared;
        if bytes > sh.slab_bytes {
            return Err(Error::TooLarge {
                what: "slab request".into(),
                needed: bytes as u64,
                limit: format!("a slab has {} bytes", sh.slab_bytes),
            });
        }
        let start = Instant::now();
        let mut st = sh.lock();
        let mut waited = false;
        loop {
            if st.shutdown {
                return Err(Error::Shutdown("pinned pool"));
            }
            if let Some((id, buf)) = st.free.pop_front() {
                let waited_ms = start.elapsed().as_secs_f64() * 1e3;
                st.stats.free -= 1;
                st.stats.in_use += 1;
                st.stats.peak_in_use = st.stats.peak_in_use.max(st.stats.in_use);
                if waited {
                    st.stats.wait_count += 1;
                    st.stats.total_wait_ms += waited_ms;
                }
                drop(st);
                sh.bus.publish(EventKind::SlabAcquired {
                    pool: PoolKind::Weights,
                    class: 0,
                    slab: id,
                    bytes: bytes as u64,
                    waited_ms,
                });
                return Ok(Slab {
                    id,
                    buf: Some(buf),
                    pool: sh.clone(),
                });
            }
            if !waited {
                waited = true;
                sh.bus.publish(EventKind::PoolExhausted {
                    pool: PoolKind::Weights,
                    class: 0,
                    requested_bytes: bytes as u64,
                });
            }
            let slice = match timeout {
                Some(t) => match t.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left.min(WAIT_SLICE),
                    _ => {
                        return Err(Error::State(format!(
                            "no free slab within {} ms",
                            t.as_millis()
                        )))
                    }
                },
                None => WAIT_SLICE,
            };
            st = sh
                .cv
                .wait_timeout(st, slice)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// A slab if one is free now.
    pub fn try_acquire(&self, bytes: usize) -> Result<Option<Slab>> {
        match self.acquire(bytes, Some(Duration::ZERO)) {
            Ok(s) => Ok(Some(s)),
            Err(Error::State(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        self.shared.lock().stats
    }

    /// Frees the free slabs, refuses new acquisitions and wakes every waiter. Idempotent.
    pub fn shutdown(&self) {
        let mut st = self.shared.lock();
        st.shutdown = true;
        st.free.clear();
        st.stats.free = 0;
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Whether [`shutdown`](PinnedPool::shutdown) happened.
    pub fn is_shut_down(&self) -> bool {
        self.shared.lock().shutdown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_come_back_on_drop_and_oversize_is_refused() {
        let pool = PinnedPool::new(&Device::host(0), 1024, 2, Bus::disabled()).expect("pool");
        let a = pool.acquire(1000, None).expect("a");
        let b = pool.acquire(10, None).expect("b");
        assert_ne!(a.id(), b.id());
        assert_eq!(pool.stats().in_use, 2);
        assert!(pool.try_acquire(1).expect("try").is_none(), "exhausted");
        drop(a);
        assert_eq!(pool.stats().free, 1);
        assert_eq!(pool.stats().peak_in_use, 2);
        let e = pool.acquire(1025, None).expect_err("larger than a slab");
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
        let e = pool.acquire(1, Some(Duration::ZERO));
        assert!(e.is_ok());
        drop(b);
    }

    #[test]
    fn shutdown_wakes_every_waiter() {
        let pool = PinnedPool::new(&Device::host(0), 64, 1, Bus::disabled()).expect("pool");
        let held = pool.acquire(64, None).expect("held");
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let p = pool.clone();
                std::thread::spawn(move || p.acquire(8, None).map(|_| ()))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        pool.shutdown();
        for w in waiters {
            let r = w.join().expect("waiter thread");
            assert!(matches!(r, Err(Error::Shutdown(_))), "{r:?}");
        }
        assert!(matches!(pool.acquire(1, None), Err(Error::Shutdown(_))));
        drop(held);
        assert_eq!(pool.stats().free, 0, "slabs are not returned after shutdown");
    }

    #[test]
    fn a_waiter_gets_a_released_slab_and_times_out_otherwise() {
        let pool = PinnedPool::new(&Device::host(0), 64, 1, Bus::disabled()).expect("pool");
        let held = pool.acquire(64, None).expect("held");
        let e = pool.acquire(8, Some(Duration::from_millis(20))).expect_err("timeout");
        assert!(matches!(e, Error::State(_)));
        let p = pool.clone();
        let t = std::thread::spawn(move || p.acquire(8, None).map(|s| s.id()));
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert_eq!(t.join().expect("thread").expect("slab"), SlabId(0));
        assert_eq!(pool.stats().wait_count, 1, "only the waiter that got a slab counts");
    }
}
