//! Pinned host <-> device copy bandwidth through the device layer (the PCIe floor every other
//! benchmark is measured against). On a machine without CUDA it measures the host device's
//! memcpy path.
//!
//! Run: `cargo bench -p stagehand-runtime --bench copies` (prints GB/s per direction and both at
//! once).

use stagehand::device::{Device, Order};
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

fn main() -> anyhow::Result<()> {
    let dev = Device::auto(1 << 34);
    let mib: usize = std::env::var("STAGEHAND_COPY_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if dev.is_cuda() { 1024 } else { 256 });
    let bytes = mib << 20;
    let reps = if dev.is_cuda() { 20 } else { 5 };
    let info = dev.info();
    println!("device: {} ({:?}), buffer {mib} MiB, {reps} reps", info.name, info.kind);
    let h2d_stream = dev.copy_stream()?;
    let d2h_stream = dev.copy_stream()?;
    let host_a = Arc::new(dev.alloc_host(bytes)?);
    let mut host_b = dev.alloc_host(bytes)?;
    println!("pinned: {}", host_a.is_pinned());
    let dst = Tensor::zeros([bytes as i64], (Kind::Uint8, dev.tch_device()));
    let src = Tensor::ones([bytes as i64], (Kind::Uint8, dev.tch_device()));
    dev.synchronize()?;

    // Warm up both directions.
    h2d_stream.h2d(&dst, host_a.clone(), 0, Order::AfterCompute)?.wait()?;
    host_b = d2h_stream.d2h(host_b, 0, &src, Order::AfterCompute)?.wait()?.0;

    let t = Instant::now();
    for _ in 0..reps {
        h2d_stream.h2d(&dst, host_a.clone(), 0, Order::AfterCompute)?.wait()?;
    }
    let h2d = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;

    let t = Instant::now();
    for _ in 0..reps {
        host_b = d2h_stream.d2h(host_b, 0, &src, Order::AfterCompute)?.wait()?.0;
    }
    let d2h = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;

    let t = Instant::now();
    for _ in 0..reps {
        let a = h2d_stream.h2d(&dst, host_a.clone(), 0, Order::AfterCompute)?;
        let b = d2h_stream.d2h(host_b, 0, &src, Order::AfterCompute)?;
        a.wait()?;
        host_b = b.wait()?.0;
    }
    let both = (2 * bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
    // Keep the buffers alive past the timed loops.
    drop((host_b, dst, src));
    println!("h2d_gbps {h2d:.1}");
    println!("d2h_gbps {d2h:.1}");
    println!("bidirectional_gbps {both:.1}");
    Ok(())
}
