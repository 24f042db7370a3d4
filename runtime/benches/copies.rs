//! Pinned host <-> device copy bandwidth through the device layer (the PCIe floor every other
//! benchmark is measured against). On a machine without CUDA it measures the host device's
//! memcpy path.
//!
//! Then the spill pattern: a region's saved tensors copied to the host one copy each (what the
//! activation runtime does) against the same bytes in one copy (what batching a region into one
//! transfer could at best do), for each `SIZExCOUNT` in `STAGEHAND_SPILL_SIZES` (MiB; default
//! `22x12,4x64,1x128` on CUDA, the first the 16 x 1024 main job's average spill).
//!
//! Then the weight-streaming pattern: a step's weights loaded one copy per streaming unit (each
//! ordered after compute, with its timing events, as the weight runtime issues them) against the
//! same bytes in one copy, for each `SIZExCOUNT` in `STAGEHAND_UNIT_SIZES` (MiB; default
//! `384x12,128x37,64x73,32x146,16x292` on CUDA: the weights benchmark's forward-only bytes in
//! units of a block, a third, a sixth, one d×d matrix and half of one). What a unit's copy costs
//! beyond its bytes is what makes smaller units pay for the bytes they save.
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

    let sizes = std::env::var("STAGEHAND_SPILL_SIZES")
        .unwrap_or_else(|_| if dev.is_cuda() { "22x12,4x64,1x128" } else { "4x8,1x16" }.to_string());
    for spec in sizes.split(',') {
        let Some((mib, count)) = spec.split_once('x').and_then(|(a, b)| Some((a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?)))
        else {
            anyhow::bail!("STAGEHAND_SPILL_SIZES: '{spec}' is not SIZExCOUNT (MiB x tensors)");
        };
        let (each, whole) = spill_pattern(&dev, &d2h_stream, mib << 20, count, reps)?;
        println!(
            "spill {count} x {mib} MiB: one copy per tensor {each:.1} GB/s, one copy of all {whole:.1} GB/s ({:.3}x)",
            whole / each
        );
    }
    let sizes = std::env::var("STAGEHAND_UNIT_SIZES")
        .unwrap_or_else(|_| if dev.is_cuda() { "384x12,128x37,64x73,32x146,16x292" } else { "4x8,1x32" }.to_string());
    for spec in sizes.split(',') {
        let Some((mib, count)) = spec.split_once('x').and_then(|(a, b)| Some((a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?)))
        else {
            anyhow::bail!("STAGEHAND_UNIT_SIZES: '{spec}' is not SIZExCOUNT (MiB x units)");
        };
        let (each, whole) = unit_pattern(&dev, &h2d_stream, mib << 20, count, reps.min(5))?;
        println!(
            "units {count} x {mib} MiB: one copy per unit {each:.2} GB/s, one copy of all {whole:.2} GB/s ({:.2} us a copy beyond its bytes)",
            (mib << 20) as f64 / 1e3 * (1.0 / each - 1.0 / whole)
        );
    }
    Ok(())
}

/// H2D GB/s of `count` units of `bytes` loaded one copy each from one pinned buffer into their
/// own device buffers, all issued then all awaited, and of the same bytes as one copy.
fn unit_pattern(
    dev: &Device,
    stream: &stagehand::device::CopyStream,
    bytes: usize,
    count: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let host = Arc::new(dev.alloc_host(bytes * count)?);
    let dsts: Vec<Tensor> = (0..count).map(|_| Tensor::empty([bytes as i64], (Kind::Uint8, dev.tch_device()))).collect();
    let whole_dst = Tensor::empty([(bytes * count) as i64], (Kind::Uint8, dev.tch_device()));
    dev.synchronize()?;
    let mut each_s = f64::MAX;
    let mut whole_s = f64::MAX;
    // One warm-up round, then the best of `reps`.
    for _ in 0..=reps {
        let t = Instant::now();
        let pending = dsts
            .iter()
            .enumerate()
            .map(|(i, d)| stream.h2d(d, host.clone(), i * bytes, Order::AfterCompute).map_err(|f| f.error))
            .collect::<Result<Vec<_>, _>>()?;
        for p in pending {
            p.wait()?;
        }
        each_s = each_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        stream.h2d(&whole_dst, host.clone(), 0, Order::AfterCompute).map_err(|f| f.error)?.wait()?;
        whole_s = whole_s.min(t.elapsed().as_secs_f64());
    }
    let total = (bytes * count) as f64;
    Ok((total / each_s / 1e9, total / whole_s / 1e9))
}

/// D2H GB/s of `count` tensors of `bytes` copied one copy each into their own pinned buffers,
/// all issued then all awaited, and of the same bytes as one copy.
fn spill_pattern(
    dev: &Device,
    stream: &stagehand::device::CopyStream,
    bytes: usize,
    count: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let srcs: Vec<Tensor> = (0..count).map(|_| Tensor::ones([bytes as i64], (Kind::Uint8, dev.tch_device()))).collect();
    let mut hosts = (0..count).map(|_| dev.alloc_host(bytes)).collect::<Result<Vec<_>, _>>()?;
    let whole_src = Tensor::ones([(bytes * count) as i64], (Kind::Uint8, dev.tch_device()));
    let mut whole_host = dev.alloc_host(bytes * count)?;
    dev.synchronize()?;
    let mut each_s = f64::MAX;
    let mut whole_s = f64::MAX;
    // One warm-up round, then the best of `reps`.
    for _ in 0..=reps {
        let t = Instant::now();
        let pending = hosts
            .drain(..)
            .zip(&srcs)
            .map(|(h, src)| stream.d2h(h, 0, src, Order::AfterCompute).map_err(|f| f.error))
            .collect::<Result<Vec<_>, _>>()?;
        for p in pending {
            hosts.push(p.wait()?.0);
        }
        each_s = each_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        whole_host = stream.d2h(whole_host, 0, &whole_src, Order::AfterCompute).map_err(|f| f.error)?.wait()?.0;
        whole_s = whole_s.min(t.elapsed().as_secs_f64());
    }
    let total = (bytes * count) as f64;
    Ok((total / each_s / 1e9, total / whole_s / 1e9))
}
