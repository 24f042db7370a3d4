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

/// Measures pinned copies of `bytes` through a copy stream: H2D copies queued back to back,
/// D2H copies waited one by one (as a spill is). Allocates `bytes` on the device and twice on
/// the host while it runs.
pub fn measure(dev: &Device, bytes: usize) -> Result<Bandwidth> {
    let host = Arc::new(dev.alloc_host(bytes)?);
    let t = Tensor::f_empty([bytes as i64], (Kind::Uint8, dev.tch_device()))?;
    let stream = dev.copy_stream()?;
    stream.h2d(&t, host.clone(), 0, Order::AfterCompute)?.wait()?;
    let reps = 5;
    let t0 = Instant::now();
    let pending = (0..reps)
        .map(|_| stream.h2d(&t, host.clone(), 0, Order::AfterCompute))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    for p in pending {
        p.wait()?;
    }
    let h2d = (bytes * reps) as f64 / t0.elapsed().as_secs_f64();
    let mut buf = dev.alloc_host(bytes)?;
    buf = stream.d2h(buf, 0, &t, Order::AfterCompute)?.wait()?.0;
    let t0 = Instant::now();
    for _ in 0..reps {
        buf = stream.d2h(buf, 0, &t, Order::AfterCompute)?.wait()?.0;
    }
    let d2h = (bytes * reps) as f64 / t0.elapsed().as_secs_f64();
    drop(buf);
    Ok(Bandwidth { h2d, d2h })
}
