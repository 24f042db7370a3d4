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
//! Last, pinning: how long the device layer takes to allocate a pinned buffer of each size in
//! `STAGEHAND_PIN_MIB` (default `16,256,4096` on CUDA) and to free it, against `cuMemHostAlloc`
//! (flags 0, page by page on the calling thread) of the same size in the same run.
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

    for (mib, count) in sizes("STAGEHAND_SPILL_SIZES", if dev.is_cuda() { "22x12,4x64,1x128" } else { "4x8,1x16" })? {
        let (each, whole) = spill_pattern(&dev, &d2h_stream, mib << 20, count, reps)?;
        println!(
            "spill {count} x {mib} MiB: one copy per tensor {each:.1} GB/s, one copy of all {whole:.1} GB/s ({:.3}x)",
            whole / each
        );
    }
    let unit_streams = counts("STAGEHAND_UNIT_STREAMS", "1,2", "a stream count")?;
    let mut streams = vec![h2d_stream];
    for (mib, count) in sizes("STAGEHAND_UNIT_SIZES", if dev.is_cuda() { "384x12,128x37,64x73,32x146,16x292" } else { "4x8,1x32" })? {
        for &n in &unit_streams {
            while streams.len() < n {
                streams.push(dev.copy_stream()?);
            }
            let (each, whole) = unit_pattern(&dev, &streams[..n], mib << 20, count, reps.min(5))?;
            println!(
                "units {count} x {mib} MiB on {n} stream(s): one copy per unit {each:.2} GB/s, one copy of all {whole:.2} GB/s ({:.2} us a copy beyond its bytes)",
                (mib << 20) as f64 / 1e3 * (1.0 / each - 1.0 / whole)
            );
        }
    }
    if dev.is_cuda() {
        for mib in counts("STAGEHAND_PIN_MIB", "16,256,4096", "a size in MiB")? {
            pin_pattern(&dev, mib << 20)?;
        }
    }
    Ok(())
}

/// The numbers of at least 1 in the comma-separated list in `var` (or `default`); an error
/// naming `var` and `what` each should be for anything else.
fn counts(var: &str, default: &str, what: &str) -> anyhow::Result<Vec<usize>> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| anyhow::anyhow!("{var}: '{n}' is not {what}")))
        .collect()
}

/// Allocates and frees a pinned buffer of `bytes` through the device layer, then through
/// `cuMemHostAlloc` directly, and prints both (best of two: the first allocation of a size may
/// pay for the kernel's own bookkeeping).
fn pin_pattern(dev: &Device, bytes: usize) -> anyhow::Result<()> {
    // The plain allocation goes through the same device's context as the device layer's.
    let ordinal = match dev.tch_device() {
        tch::Device::Cuda(n) => n,
        other => anyhow::bail!("pinning on {other:?}: a CUDA device"),
    };
    let ctx = cudarc::driver::CudaContext::new(ordinal)?;
    let (mut ours, mut plain) = ((f64::MAX, f64::MAX), (f64::MAX, f64::MAX));
    for _ in 0..2 {
        let t = Instant::now();
        let buf = dev.alloc_host(bytes)?;
        let alloc = t.elapsed().as_secs_f64() * 1e3;
        anyhow::ensure!(buf.is_pinned(), "the device layer's buffer of {bytes} bytes is not pinned");
        let t = Instant::now();
        drop(buf);
        ours = (ours.0.min(alloc), ours.1.min(t.elapsed().as_secs_f64() * 1e3));
        ctx.bind_to_thread()?;
        let t = Instant::now();
        // SAFETY: a plain allocation, freed below and never read.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }?;
        let alloc = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        // SAFETY: allocated just above; freed once.
        unsafe { cudarc::driver::result::free_host(ptr) }?;
        plain = (plain.0.min(alloc), plain.1.min(t.elapsed().as_secs_f64() * 1e3));
    }
    let rate = |ms: f64| bytes as f64 / (1 << 30) as f64 / (ms / 1e3);
    println!(
        "pin {} MiB: device layer {:.1} ms ({:.2} GiB/s), freed in {:.1} ms; cuMemHostAlloc {:.1} ms ({:.2} GiB/s), freed in {:.1} ms ({:.1}x)",
        bytes >> 20,
        ours.0,
        rate(ours.0),
        ours.1,
        plain.0,
        rate(plain.0),
        plain.1,
        plain.0 / ours.0
    );
    Ok(())
}

/// The `SIZExCOUNT` pairs (MiB, copies) of the comma-separated list in `var`, or `default`.
fn sizes(var: &str, default: &str) -> anyhow::Result<Vec<(usize, usize)>> {
    let list = std::env::var(var).unwrap_or_else(|_| default.to_string());
    list.split(',')
        .map(|spec| {
            spec.split_once('x')
                .and_then(|(a, b)| Some((a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?)))
                .ok_or_else(|| anyhow::anyhow!("{var}: '{spec}' is not SIZExCOUNT (MiB x copies)"))
        })
        .collect()
}

/// GB/s of `bytes` moved by `each` (one copy per tensor) and by `whole` (one copy), the best of
/// `reps` rounds after a warm-up round.
fn best_of(
    bytes: usize,
    reps: usize,
    mut each: impl FnMut() -> anyhow::Result<()>,
    mut whole: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(f64, f64)> {
    let mut each_s = f64::MAX;
    let mut whole_s = f64::MAX;
    for _ in 0..=reps {
        let t = Instant::now();
        each()?;
        each_s = each_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        whole()?;
        whole_s = whole_s.min(t.elapsed().as_secs_f64());
    }
    Ok((bytes as f64 / each_s / 1e9, bytes as f64 / whole_s / 1e9))
}

/// H2D GB/s of `count` units of `bytes` loaded one copy each from one pinned buffer into their
/// own device buffers, the copies taking `streams` in turn (so one copy's start can overlap
/// another's end), all issued then all awaited, and of the same bytes as one copy.
fn unit_pattern(
    dev: &Device,
    streams: &[stagehand::device::CopyStream],
    bytes: usize,
    count: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let host = Arc::new(dev.alloc_host(bytes * count)?);
    let dsts: Vec<Tensor> = (0..count).map(|_| Tensor::empty([bytes as i64], (Kind::Uint8, dev.tch_device()))).collect();
    let whole_dst = Tensor::empty([(bytes * count) as i64], (Kind::Uint8, dev.tch_device()));
    dev.synchronize()?;
    best_of(
        bytes * count,
        reps,
        || {
            let pending = dsts
                .iter()
                .enumerate()
                .map(|(i, d)| streams[i % streams.len()].h2d(d, host.clone(), i * bytes, Order::AfterCompute).map_err(|f| f.error))
                .collect::<Result<Vec<_>, _>>()?;
            for p in pending {
                p.wait()?;
            }
            Ok(())
        },
        || {
            streams[0].h2d(&whole_dst, host.clone(), 0, Order::AfterCompute).map_err(|f| f.error)?.wait()?;
            Ok(())
        },
    )
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
    let mut whole_host = Some(dev.alloc_host(bytes * count)?);
    dev.synchronize()?;
    best_of(
        bytes * count,
        reps,
        || {
            let pending = hosts
                .drain(..)
                .zip(&srcs)
                .map(|(h, src)| stream.d2h(h, 0, src, Order::AfterCompute).map_err(|f| f.error))
                .collect::<Result<Vec<_>, _>>()?;
            for p in pending {
                hosts.push(p.wait()?.0);
            }
            Ok(())
        },
        || {
            let h = whole_host.take().ok_or_else(|| anyhow::anyhow!("the pinned buffer was lost by a failed copy"))?;
            whole_host = Some(stream.d2h(h, 0, &whole_src, Order::AfterCompute).map_err(|f| f.error)?.wait()?.0);
            Ok(())
        },
    )
}
