//! The host backend: a device without CUDA. "VRAM" is a budget accounted in host memory, copies
//! are synchronous `memcpy`, and events are complete when made, carrying the host time they were
//! made at (so copy durations are measured, and labelled as simulated by the dashboards).

use super::backend::{Backend, EventBackend, StreamBackend};
use super::{StreamEvent, HostBuffer, MemoryReading};
use crate::error::{Error, Result};
use crate::events::{DeviceInfo, DeviceKind};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug)]
pub(super) struct HostBackend {
    budget: u64,
    /// Which simulated device this is (several simulate the GPUs of a data-parallel group).
    index: u32,
    allocated: AtomicU64,
    peak: AtomicU64,
}

impl HostBackend {
    pub(super) fn new(budget: u64, index: u32) -> HostBackend {
        HostBackend {
            budget,
            index,
            allocated: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }
}

fn now() -> StreamEvent {
    StreamEvent(Arc::new(HostEvent { at: Instant::now() }))
}

impl Backend for HostBackend {
    fn tch_device(&self) -> tch::Device {
        tch::Device::Cpu
    }

    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: DeviceKind::Host,
            index: self.index,
            name: "host (simulated)".into(),
            total_bytes: self.budget,
        }
    }

    fn memory(&self) -> MemoryReading {
        let a = self.allocated.load(Ordering::Relaxed);
        MemoryReading {
            allocated: a,
            reserved: a,
            peak: self.peak.load(Ordering::Relaxed).max(a),
        }
    }

    fn reset_peak(&self) {
        self.peak.store(self.allocated.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn account(&self, delta: i64) {
        let d = delta.unsigned_abs();
        let prev = self
            .allocated
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(if delta >= 0 { v.saturating_add(d) } else { v.saturating_sub(d) })
            })
            .unwrap_or(0);
        let now = if delta >= 0 { prev.saturating_add(d) } else { prev.saturating_sub(d) };
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn claim(&self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        let mut cur = self.allocated.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(bytes).filter(|n| *n <= self.budget) else {
                return Err(Error::DeviceFull {
                    what: what(),
                    requested_bytes: bytes,
                    allocated_bytes: cur,
                    budget_bytes: self.budget,
                });
            };
            match self.allocated.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return Ok(());
                }
                Err(now) => cur = now,
            }
        }
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer> {
        HostBuffer::pageable(bytes)
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        Ok(Box::new(HostStream))
    }

    fn record_compute(&self) -> Result<StreamEvent> {
        Ok(now())
    }

    fn compute_wait(&self, _event: &StreamEvent) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct HostStream;

impl StreamBackend for HostStream {
    fn wait(&self, _event: &StreamEvent) -> Result<()> {
        Ok(())
    }

    fn record(&self, _timed: bool) -> Result<StreamEvent> {
        Ok(now())
    }

    fn timed_every(&self) -> u64 {
        1
    }

    unsafe fn h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are valid for `len` bytes; they are distinct
        // allocations (a host buffer and a tensor's storage).
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
        Ok(())
    }

    unsafe fn d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: as in `h2d`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct HostEvent {
    at: Instant,
}

impl EventBackend for HostEvent {
    fn is_complete(&self) -> bool {
        true
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn elapsed_ms(&self, end: &dyn EventBackend) -> Option<f64> {
        let end = end.as_any().downcast_ref::<HostEvent>()?;
        Some(end.at.saturating_duration_since(self.at).as_secs_f64() * 1e3)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
