//! Weight streaming benchmark: trains (frozen weights, forward and backward, input requiring
//! grad) a model larger than the weight budget, and compares the streamed step time with the
//! floor max(resident step, bytes moved / pinned H2D bandwidth), all measured in this run.
//!
//! On a GPU the default is the 16-block d=4096 bf16 model at 4096 tokens (6.4 GB of weights,
//! 4 blocks resident); on the host device a small f32 model. Override with env variables:
//! `SH_BLOCKS`, `SH_D`, `SH_TOKENS`, `SH_STEPS`, `SH_BUDGET_BLOCKS`, `SH_PREFETCH`,
//! `SH_INFLIGHT`, `SH_KIND` (`bf16`, `f16`, `f32`).
//!
//! Run: `cargo bench -p stagehand-runtime --bench weights`.

use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::events::BlockId;
use stagehand::weights::{WeightConfig, WeightRuntime};
use stagehand::torch::SavedTensorHooks;
use stagehand::weights::WeightStore;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

mod common;
use common::{env, weights_of};

/// One block: four d×d projections in a chain with a residual, then a 4d MLP with a residual
/// (12 d² weights, the parameter count of a transformer block).
fn block_fwd(w: &[Tensor], x: &Tensor) -> Tensor {
    let none: Option<&Tensor> = None;
    let a = x.linear(&w[0], none).linear(&w[1], none).linear(&w[2], none).linear(&w[3], none);
    let x = x + a;
    let m = x.linear(&w[4], none).gelu("tanh");
    &x + m.linear(&w[5], none)
}

fn main() -> anyhow::Result<()> {
    let probe = Device::auto(1 << 40);
    let cuda = probe.is_cuda();
    let blocks = env("SH_BLOCKS", if cuda { 16 } else { 4 });
    let d = env("SH_D", if cuda { 4096 } else { 128 });
    let tokens = env("SH_TOKENS", if cuda { 4096 } else { 256 });
    let steps = env("SH_STEPS", if cuda { 6 } else { 3 }).max(3);
    let budget_blocks = env("SH_BUDGET_BLOCKS", if cuda { 4 } else { 2 }) as u64;
    let prefetch = env("SH_PREFETCH", 2) as u32;
    let inflight = env("SH_INFLIGHT", 2) as u32;
    let kind = common::kind(cuda);
    let dev = probe.tch_device();
    let block_bytes = common::block_bytes(d, kind) as i64;
    println!("device: {} ({})", probe.info().name, if cuda { "cuda" } else { "host-simulated" });
    println!(
        "model: {blocks} blocks, d={d}, {kind:?}, {:.2} GB of weights, {tokens} tokens",
        (blocks * block_bytes) as f64 / 1e9
    );
    let sync = || probe.synchronize();

    // ---- resident reference: all weights on the device -----------------------------------
    let vr = common::resident_stack(dev, blocks, d, kind);
    let x0 = (Tensor::randn([tokens, d], (Kind::Float, dev)) * 0.1).to_kind(kind);
    let resident_w = weights_of(&vr, blocks);
    let step_resident = |w: &[Vec<Tensor>]| -> anyhow::Result<f64> {
        let x = x0.detach().set_requires_grad(true);
        let t0 = Instant::now();
        let y = w.iter().fold(x.shallow_clone(), |h, bw| block_fwd(bw, &h));
        y.to_kind(Kind::Float).mean(Kind::Float).backward();
        sync()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    step_resident(&resident_w)?;
    let mut resident = f64::MAX;
    for _ in 0..steps {
        resident = resident.min(step_resident(&resident_w)?);
    }
    println!("resident step: {resident:.4} s (fwd+bwd, best of {steps})");

    // ---- streamed: weights in pinned host memory, a few blocks on the device -------------
    let vs = common::host_copy(&vr, blocks);
    drop(resident_w);
    drop(vr);
    sync()?;
    println!(
        "allocated after dropping the resident model: {:.3} GB",
        probe.memory().allocated as f64 / 1e9
    );
    let cfg = WeightConfig::builder()
        .pool(block_bytes as u64 * 2, block_bytes as u64)
        .watermarks(u64::MAX / 2, u64::MAX / 4)
        .weight_budget(budget_blocks * block_bytes as u64)
        .prefetch_window(prefetch)
        .max_inflight_h2d(inflight)
        .build()?;
    let rt = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", probe.clone(), cfg, Bus::disabled())?;
    let ids: Vec<BlockId> = (0..blocks).map(|b| rt.block_id(&format!("blocks.{b}"))).collect::<Result<_, _>>()?;
    let streamed_w = weights_of(&vs, blocks);
    // The weight runtime's own store (what `rt.hooks()` installs), kept here to count entries.
    let store = Arc::new(WeightStore::new(rt.resolver()));
    let saved_after_forward = std::cell::Cell::new(0usize);
    let saved_after_backward = std::cell::Cell::new(0usize);
    let step_streamed = || -> anyhow::Result<f64> {
        let x = x0.detach().set_requires_grad(true);
        let t0 = Instant::now();
        rt.begin_step()?;
        let y = {
            let _hooks = SavedTensorHooks::enable(store.clone())?;
            let mut h = x.shallow_clone();
            for (id, w) in ids.iter().zip(&streamed_w) {
                let _g = rt.block(*id)?;
                h = block_fwd(w, &h);
            }
            h
        };
        saved_after_forward.set(store.len());
        y.to_kind(Kind::Float).mean(Kind::Float).backward();
        drop(y);
        saved_after_backward.set(store.len());
        rt.end_step()?;
        sync()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    step_streamed()?; // step 0: traces the itinerary
    probe.reset_peak();
    let mut streamed = f64::MAX;
    let mut bytes = 0u64;
    let mut last = Default::default();
    let mut after_step = Vec::new();
    for _ in 0..steps {
        let t = step_streamed()?;
        after_step.push(probe.memory().allocated);
        if std::env::var("SH_VERBOSE").is_ok() {
            println!(
                "  step {t:.4} s: allocated {:.3} GB, resident blocks {:.3} GB, copies in flight {:?}",
                probe.memory().allocated as f64 / 1e9,
                rt.resident_bytes() as f64 / 1e9,
                rt.copies_in_flight()
            );
        }
        if t < streamed {
            streamed = t;
            last = rt.last_step_metrics();
            bytes = last.h2d_bytes;
        }
    }
    let peak = probe.memory().peak;

    // ---- pinned H2D bandwidth, same run -----------------------------------------------------
    let (bw, _) = common::pinned_bandwidth(&probe, (block_bytes as usize).clamp(64 << 20, 1 << 30))?;

    let floor = resident.max(bytes as f64 / bw);
    println!(
        "streamed step: {streamed:.4} s (budget {budget_blocks} blocks = {:.2} GB, prefetch {prefetch}, in flight {inflight})",
        (budget_blocks * block_bytes as u64) as f64 / 1e9
    );
    println!("bytes moved per step: {:.3} GB (h2d)", bytes as f64 / 1e9);
    println!("pinned H2D bandwidth: {:.2} GB/s", bw / 1e9);
    println!("floor max(resident, bytes/bandwidth): {floor:.4} s");
    println!(
        "prefetch hits {} misses {} stall {:.1} ms evictions {}",
        last.prefetch_hits, last.prefetch_misses, last.stall_time_ms, last.evictions
    );
    println!(
        "saved-tensor store entries: {} after forward, {} after backward",
        saved_after_forward.get(),
        saved_after_backward.get()
    );
    println!("peak allocated during streamed steps: {:.2} GB", peak as f64 / 1e9);
    let (first, lastm) = (after_step[0], after_step[after_step.len() - 1]);
    println!(
        "allocated after each step: first {:.3} GB, last {:.3} GB, max {:.3} GB ({} steps; growth {} bytes)",
        first as f64 / 1e9,
        lastm as f64 / 1e9,
        after_step.iter().max().copied().unwrap_or(0) as f64 / 1e9,
        after_step.len(),
        lastm as i64 - first as i64
    );
    println!("ratio streamed / floor: {:.3} (target <= 1.15 on the GPU)", streamed / floor);
    rt.shutdown()?;
    sync()?;
    println!("allocated after shutdown: {:.3} GB", probe.memory().allocated as f64 / 1e9);
    Ok(())
}
