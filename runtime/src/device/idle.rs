//! How long the compute stream sits idle while the training thread waits on the host.
//!
//! A host wait (for a spill to land, for a block's optimizer step) costs step time only when
//! the GPU runs out of queued work during it; while the host was ahead, the GPU goes on
//! computing and nothing is lost. A timed event is recorded on the compute stream as the wait
//! begins and another as it ends, with nothing queued between them: the GPU reaches the second
//! at `max(when it finished the queued work, when the host resumed)`, so the time between the
//! two is exactly the idle the wait caused. On the host device compute is synchronous, and the
//! span is the wait itself.

use super::{Device, StreamEvent};
use crate::error::Result;
use std::time::Instant;

/// A wait in progress: the compute stream's position as it began.
#[derive(Debug)]
pub struct IdleProbe {
    begin: StreamEvent,
    started: Instant,
}

/// A finished wait; its idle time is known once the compute stream has passed its end.
#[derive(Debug)]
pub struct IdleSpan {
    begin: StreamEvent,
    end: StreamEvent,
    /// How long the host waited.
    host_ms: f64,
}

impl Device {
    /// Marks the start of a host wait (see the module `device::idle`).
    pub fn idle_probe(&self) -> Result<IdleProbe> {
        Ok(IdleProbe { begin: self.record_compute()?, started: Instant::now() })
    }
}

impl IdleProbe {
    /// Marks the end of the wait on `device`'s compute stream.
    pub fn end(self, device: &Device) -> Result<IdleSpan> {
        Ok(IdleSpan {
            begin: self.begin,
            end: device.record_compute()?,
            host_ms: self.started.elapsed().as_secs_f64() * 1e3,
        })
    }
}

impl IdleSpan {
    /// Milliseconds the host waited.
    pub fn host_ms(&self) -> f64 {
        self.host_ms
    }

    /// Milliseconds the compute stream sat idle, once the stream has passed the wait's end
    /// (`None` before).
    pub fn idle_ms(&self) -> Option<f64> {
        self.begin.elapsed_ms(&self.end).map(|ms| ms.max(0.0))
    }

    /// Like [`idle_ms`](Self::idle_ms), blocking until the stream has passed the wait's end
    /// (at a step's end, where nothing is queued after it any more).
    pub fn idle_ms_blocking(&self) -> Result<f64> {
        self.end.synchronize()?;
        Ok(self.idle_ms().unwrap_or(0.0))
    }
}

/// Idle spans of one step, summed at its end.
#[derive(Debug, Default)]
pub struct IdleSpans {
    spans: Vec<IdleSpan>,
    host_ms: f64,
}

impl IdleSpans {
    /// Keeps a finished wait.
    pub fn push(&mut self, span: IdleSpan) {
        self.host_ms += span.host_ms;
        self.spans.push(span);
    }

    /// Milliseconds the host waited in the spans kept since the last [`take_ms`](Self::take_ms).
    pub fn host_ms(&self) -> f64 {
        self.host_ms
    }

    /// The idle milliseconds of every wait kept, emptying the list. Blocks until the compute
    /// stream has passed the last wait's end.
    pub fn take_ms(&mut self) -> Result<f64> {
        self.host_ms = 0.0;
        let mut ms = 0.0;
        for s in self.spans.drain(..) {
            ms += s.idle_ms_blocking()?;
        }
        Ok(ms)
    }

    /// The idle milliseconds of the waits the compute stream has passed, in order up to the
    /// first it has not, which stay for a later call (never blocks).
    pub fn take_passed_ms(&mut self) -> f64 {
        let passed = self.spans.iter().take_while(|s| s.idle_ms().is_some()).count();
        let mut ms = 0.0;
        for s in self.spans.drain(..passed) {
            self.host_ms -= s.host_ms;
            ms += s.idle_ms().unwrap_or(0.0);
        }
        ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_host_device_a_wait_is_all_idle() {
        let d = Device::host(1 << 20);
        let mut spans = IdleSpans::default();
        let p = d.idle_probe().expect("probe");
        std::thread::sleep(std::time::Duration::from_millis(5));
        spans.push(p.end(&d).expect("end"));
        assert!(spans.host_ms() >= 5.0, "{}", spans.host_ms());
        let ms = spans.take_ms().expect("read");
        assert!(ms >= 5.0, "{ms}");
        assert_eq!(spans.host_ms(), 0.0, "taken with the spans");
        assert_eq!(spans.take_ms().expect("read again"), 0.0, "taken once");
        let p = d.idle_probe().expect("probe");
        std::thread::sleep(std::time::Duration::from_millis(2));
        spans.push(p.end(&d).expect("end"));
        assert!(spans.take_passed_ms() >= 2.0, "passed at once on the host device");
        assert_eq!(spans.take_passed_ms(), 0.0, "taken once");
    }
}
