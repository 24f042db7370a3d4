//! Pinned copy bandwidth measured on this device: the PCIe floor benchmarks compare with, and a
//! fact a plan can use.

use super::{Device, Order};
use crate::error::Result;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

/// Copy bandwidth in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidth {
    pub h2d: f64,
    pub d2h: f64,
}

/// Rounds of copies measured; the best round counts (the bandwidth the link can reach, so a
/// floor computed from it is the lowest: a transient slowdown never flatters a ratio).
const ROUNDS: usize = 3;
/// Copies per round.
const REPS: usize = 5;

/// Measures pinned copies of `bytes` through a copy stream: H2D copies queued back to back,
/// D2H copies waited one by one (as a spill is); the best of a few rounds. Allocates `bytes` on
/// the device and twice on the host while it runs.
pub fn measure(dev: &Device, bytes: usize) -> Result<Bandwidth> {
    let host = Arc::new(dev.alloc_host(bytes)?);
    let t = Tensor::f_empty([bytes as i64], (Kind::Uint8, dev.tch_device()))?;
    let stream = dev.copy_stream()?;
    stream.h2d(&t, host.clone(), 0, Order::AfterCompute)?.wait()?;
    let mut h2d: f64 = 0.0;
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        let pending = (0..REPS)
            .map(|_| stream.h2d(&t, host.clone(), 0, Order::AfterCompute))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for p in pending {
            p.wait()?;
        }
        h2d = h2d.max((bytes * REPS) as f64 / t0.elapsed().as_secs_f64());
    }
    let mut buf = dev.alloc_host(bytes)?;
    buf = stream.d2h(buf, 0, &t, Order::AfterCompute)?.wait()?.0;
    let mut d2h: f64 = 0.0;
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        for _ in 0..REPS {
            buf = stream.d2h(buf, 0, &t, Order::AfterCompute)?.wait()?.0;
        }
        d2h = d2h.max((bytes * REPS) as f64 / t0.elapsed().as_secs_f64());
    }
    drop(buf);
    Ok(Bandwidth { h2d, d2h })
}
