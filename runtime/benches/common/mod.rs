//! What the GPU benchmarks share: env-variable knobs, the transformer-style weight stack (six
//! projections per block, 12 d² weights), its host copy for streaming, and the pinned copy
//! bandwidth the floors are computed from. Each benchmark uses part of it.
#![allow(dead_code)]

use stagehand::device::Device;
use tch::{nn, Kind, Tensor};

/// The projections of one block, in the order `block_fwd` functions take them.
pub const NAMES: [&str; 6] = ["wq", "wk", "wv", "wo", "up", "down"];

/// An integer knob from the environment.
pub fn env(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The element type from `SH_KIND` (`bf16`, `f16`, `f32`): bf16 on CUDA, f32 on the host.
pub fn kind(cuda: bool) -> Kind {
    match std::env::var("SH_KIND").as_deref() {
        Ok("f32") => Kind::Float,
        Ok("f16") => Kind::Half,
        Ok("bf16") => Kind::BFloat16,
        _ if cuda => Kind::BFloat16,
        _ => Kind::Float,
    }
}

/// Shapes of [`NAMES`]: four d×d projections, then the 4d MLP.
pub fn shapes(d: i64) -> [[i64; 2]; 6] {
    [[d, d], [d, d], [d, d], [d, d], [4 * d, d], [d, 4 * d]]
}

/// Bytes of one block's weights.
pub fn block_bytes(d: i64, kind: Kind) -> u64 {
    12 * (d * d) as u64 * kind.elt_size_in_bytes() as u64
}

/// A frozen stack of `blocks` blocks on `dev` (`blocks.{b}.{name}`), seeded, scaled by 1/sqrt(in).
pub fn resident_stack(dev: tch::Device, blocks: i64, d: i64, kind: Kind) -> nn::VarStore {
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(dev);
    for b in 0..blocks {
        for (n, s) in NAMES.iter().zip(shapes(d)) {
            let t = (Tensor::randn(s, (Kind::Float, dev)) * (1.0 / (s[1] as f64).sqrt())).to_kind(kind);
            let _ = (vs.root() / "blocks" / b).add(n, t, false);
        }
    }
    vs.freeze();
    vs
}

/// The same weights in host memory, frozen, for a weight runtime to stream.
pub fn host_copy(resident: &nn::VarStore, blocks: i64) -> nn::VarStore {
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let vars = resident.variables();
    for b in 0..blocks {
        for n in NAMES {
            let v = &vars[&format!("blocks.{b}.{n}")];
            // A copy whatever the source's device (`to_device` to the same device is the same
            // tensor): the copy's values are its own.
            let t = if v.device() == tch::Device::Cpu { v.copy() } else { v.to_device(tch::Device::Cpu) };
            let _ = (vs.root() / "blocks" / b).add(n, t, false);
        }
    }
    vs.freeze();
    vs
}

/// Each block's weights in [`NAMES`] order.
pub fn weights_of(vs: &nn::VarStore, blocks: i64) -> Vec<Vec<Tensor>> {
    let vars = vs.variables();
    (0..blocks)
        .map(|b| NAMES.iter().map(|n| vars[&format!("blocks.{b}.{n}")].shallow_clone()).collect())
        .collect()
}

/// Pinned copy bandwidth through the device layer's copy stream, bytes per second: (H2D, D2H).
pub fn pinned_bandwidth(dev: &Device, bytes: usize) -> anyhow::Result<(f64, f64)> {
    let b = stagehand::device::bandwidth::measure(dev, bytes)?;
    Ok((b.h2d, b.d2h))
}
