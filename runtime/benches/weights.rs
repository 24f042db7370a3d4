//! Weight streaming benchmark: trains (frozen weights, forward and backward, input requiring
//! grad) a model larger than the weight budget, and compares the streamed step time with the
//! floor max(resident step, bytes moved / pinned H2D bandwidth), all measured in this run.
//! Variants: telemetry on (a JSONL sink), the bus disabled, forward only, every block
//! checkpointed (a recompute scope over the block's input and weights: only the input is kept,
//! backward runs the block's forward again with the block resident), and streaming units of a
//! third of a block (the attention projections, the MLP's up and its down projection, each
//! registered as its own unit in the same bytes of room, prefetched as far ahead in bytes): at
//! the forward/backward turn and at the step's start the copy engine waits for a slot to free,
//! which a smaller unit frees sooner. The forward-only variants run with the runtime's cyclic
//! pins (its default in inference mode) and, marked "Belady only", without them.
//!
//! On a GPU the default is the 16-block d=4096 bf16 model at 4096 tokens (6.4 GB of weights,
//! 4 blocks resident); on the host device a small f32 model. Override with env variables:
//! `SH_BLOCKS`, `SH_D`, `SH_TOKENS`, `SH_STEPS`, `SH_BUDGET_BLOCKS`, `SH_PREFETCH`,
//! `SH_INFLIGHT`, `SH_KIND` (`bf16`, `f16`, `f32`); `SH_VARIANTS` runs only the variants whose
//! names contain one of its comma-separated parts (`SH_VARIANTS="forward only"`);
//! `SH_INFER_WINDOW` sets the forward-only variants' window in positions (units or blocks).
//!
//! Run: `cargo bench -p stagehand-runtime --bench weights`.

use stagehand::activations::{recompute, ActivationConfig, ActivationRuntime};
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::events::BlockId;
use stagehand::weights::{BlockGuard, WeightConfig, WeightRuntime};
use stagehand::torch::SavedTensorHooks;
use stagehand::weights::WeightStore;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

mod common;
use common::{env, weights_of};

// One block: four d×d projections in a chain with a residual, then a 4d MLP with a residual
// (12 d² weights, the parameter count of a transformer block), in the three parts that the
// third-block units stream separately.
const NONE: Option<&Tensor> = None;

/// The attention part's output (before its residual): weights 0..4.
fn attn(w: &[Tensor], x: &Tensor) -> Tensor {
    x.linear(&w[0], NONE).linear(&w[1], NONE).linear(&w[2], NONE).linear(&w[3], NONE)
}

/// The MLP's hidden activation: weight 4.
fn mlp_up(w: &[Tensor], x: &Tensor) -> Tensor {
    x.linear(&w[4], NONE).gelu("tanh")
}

/// The block's output from its MLP hidden activation and residual: weight 5.
fn mlp_down(w: &[Tensor], x: &Tensor, m: &Tensor) -> Tensor {
    x + m.linear(&w[5], NONE)
}

fn block_fwd(w: &[Tensor], x: &Tensor) -> Tensor {
    let x = x + attn(w, x);
    mlp_down(w, &x, &mlp_up(w, &x))
}

/// The same block through three streaming units (attention, MLP up, MLP down), each resident
/// while its part of the forward runs.
fn block_fwd_units(rt: &WeightRuntime, units: &[BlockId], w: &[Tensor], x: &Tensor) -> anyhow::Result<Tensor> {
    let enter = |u: usize| -> anyhow::Result<BlockGuard> { Ok(rt.block(units[u])?) };
    let a = {
        let _g = enter(0)?;
        attn(w, x)
    };
    let x = x + a;
    let m = {
        let _g = enter(1)?;
        mlp_up(w, &x)
    };
    let _g = enter(2)?;
    Ok(mlp_down(w, &x, &m))
}

fn main() -> anyhow::Result<()> {
    let probe = Device::auto(1 << 40);
    let cuda = probe.is_cuda();
    let blocks = env("SH_BLOCKS", if cuda { 16 } else { 4 });
    let d = env("SH_D", if cuda { 4096 } else { 128 });
    let tokens = env("SH_TOKENS", if cuda { 4096 } else { 256 });
    let steps = env("SH_STEPS", if cuda { 6 } else { 3 }).max(3);
    let budget_blocks = env("SH_BUDGET_BLOCKS", if cuda { 4 } else { 2 }) as u64;
    let prefetch = env("SH_PREFETCH", 3) as u32;
    // The forward-only variants' window, in positions (units or blocks); default: as far in
    // bytes as the forward+backward variants.
    let infer_window = std::env::var("SH_INFER_WINDOW").ok().and_then(|v| v.parse::<u32>().ok());
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
    let out_dir = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    // (name, forward only, telemetry, checkpointed blocks, units of a third of a block, cyclic
    // pins in inference mode)
    let variants = [
        ("fwd+bwd, telemetry on", false, true, false, false, true),
        ("fwd+bwd, bus disabled", false, false, false, false, true),
        ("forward only, telemetry on", true, true, false, false, true),
        ("forward only, Belady only, telemetry on", true, true, false, false, false),
        ("fwd+bwd, checkpointed blocks, telemetry on", false, true, true, false, true),
        ("fwd+bwd, third-block units, telemetry on", false, true, false, true, true),
        ("forward only, third-block units, telemetry on", true, true, false, true, true),
        ("forward only, third-block units, Belady only, telemetry on", true, true, false, true, false),
    ];
    // SH_VARIANTS: run only the variants whose names contain one of these comma-separated parts.
    let only = std::env::var("SH_VARIANTS").ok();
    let chosen = |name: &str| only.as_deref().is_none_or(|o| o.split(',').any(|part| name.contains(part.trim())));
    let mut results = Vec::new();
    for (i, (name, inference, telemetry, checkpoint, units, pins)) in variants.into_iter().enumerate() {
        if !chosen(name) {
            continue;
        }
        let bus = if telemetry {
            let hub = Arc::new(stagehand::events::Hub::new());
            let file = out_dir.join(format!("weights-{}-{i}.jsonl", std::process::id()));
            hub.add_sink(Box::new(stagehand::events::JsonlSink::open(&file, stagehand::events::OpenMode::CreateNew)?));
            Bus::with_hub(hub, 1 << 20)
        } else {
            Bus::disabled()
        };
        let mode = Mode { inference, checkpoint, units, pins };
        let window = match (inference, infer_window) {
            (true, Some(w)) => w,
            _ if units => prefetch * 3,
            _ => prefetch,
        };
        let r = run_streamed(&probe, &vs, blocks, block_bytes, budget_blocks, window, inflight, steps, &x0, bus.clone(), mode)?;
        bus.close();
        println!(
            "{name}: {:.4} s/step, h2d {:.3} GB (minimum {:.3} GB), hits {} misses {}, peak {:.2} GB",
            r.step_s,
            r.bytes as f64 / 1e9,
            r.min_bytes as f64 / 1e9,
            r.metrics.prefetch_hits,
            r.metrics.prefetch_misses,
            r.peak as f64 / 1e9
        );
        results.push((name, inference, r));
    }
    let (bw, _) = common::pinned_bandwidth(&probe, (block_bytes as usize).clamp(64 << 20, 1 << 30))?;
    println!("pinned H2D bandwidth: {:.2} GB/s", bw / 1e9);
    // The forward-only resident reference, for the inference floor.
    let vr2 = common::resident_stack(dev, blocks, d, kind);
    let fw = weights_of(&vr2, blocks);
    let mut resident_fwd = f64::MAX;
    for _ in 0..steps {
        let t0 = Instant::now();
        let _ = tch::no_grad(|| fw.iter().fold(x0.shallow_clone(), |h, bw| block_fwd(bw, &h)));
        sync()?;
        resident_fwd = resident_fwd.min(t0.elapsed().as_secs_f64());
    }
    drop(fw);
    drop(vr2);
    sync()?;
    println!("resident forward: {resident_fwd:.4} s");
    for (name, inference, r) in &results {
        let base = if *inference { resident_fwd } else { resident };
        let floor = base.max(r.min_bytes as f64 / bw);
        println!(
            "{name}: floor max(resident {:.4}, minimum bytes / bandwidth {:.4}) = {floor:.4} s; ratio {:.3}; bytes moved / minimum {:.3}",
            base,
            r.min_bytes as f64 / bw,
            r.step_s / floor,
            if r.min_bytes > 0 { r.bytes as f64 / r.min_bytes as f64 } else { 0.0 }
        );
    }
    Ok(())
}

/// How the streamed step runs.
#[derive(Clone, Copy)]
struct Mode {
    /// Forward only, under `no_grad`.
    inference: bool,
    /// Each block in a recompute scope: its activations computed again in backward from the
    /// block's input and its weights (resident again for backward), instead of kept.
    checkpoint: bool,
    /// Three streaming units per block (attention, MLP up, MLP down) instead of one.
    units: bool,
    /// The runtime's cyclic pins (inference mode only).
    pins: bool,
}

struct Streamed {
    step_s: f64,
    bytes: u64,
    min_bytes: u64,
    peak: u64,
    metrics: stagehand::events::WeightStepMetrics,
}

/// Streams the stack through `budget_blocks` blocks of device room for `steps` timed steps after
/// one traced step; the best step and its metrics.
#[allow(clippy::too_many_arguments)]
fn run_streamed(
    probe: &Device,
    vs: &tch::nn::VarStore,
    blocks: i64,
    block_bytes: i64,
    budget_blocks: u64,
    // Positions ahead: units of a third of a block prefetch three times as many units ahead as
    // blocks would, as far in bytes.
    prefetch: u32,
    inflight: u32,
    steps: i64,
    x0: &Tensor,
    bus: Bus,
    mode: Mode,
) -> anyhow::Result<Streamed> {
    let inference = mode.inference;
    let sync = || probe.synchronize();
    let unit_bytes = if mode.units { block_bytes / 3 } else { block_bytes };
    let cfg = WeightConfig::builder()
        .pool(unit_bytes as u64 * 2, unit_bytes as u64)
        .watermarks(u64::MAX / 2, u64::MAX / 4)
        .weight_budget(budget_blocks * block_bytes as u64)
        .prefetch_window(prefetch)
        .max_inflight_h2d(inflight)
        .inference_mode(inference)
        .cyclic_pins(mode.pins)
        .build()?;
    let rt = if mode.units {
        let rt = WeightRuntime::new(probe.clone(), cfg, bus.clone())?;
        let vars = vs.variables();
        let var = |b: i64, n: &str| (format!("blocks.{b}.{n}"), vars[&format!("blocks.{b}.{n}")].shallow_clone());
        for b in 0..blocks {
            rt.register_block(&format!("blocks.{b}.attn"), ["wq", "wk", "wv", "wo"].iter().map(|n| var(b, n)).collect())?;
            rt.register_block(&format!("blocks.{b}.up"), vec![var(b, "up")])?;
            rt.register_block(&format!("blocks.{b}.down"), vec![var(b, "down")])?;
        }
        rt
    } else {
        WeightRuntime::from_var_store(vs, r"^blocks\.\d+$", probe.clone(), cfg, bus.clone())?
    };
    // Checkpointing goes through the activation runtime's store (recompute scopes), keeping on
    // the device whatever is saved: only the scopes change what is stored.
    let acts = if mode.checkpoint {
        let keep = ActivationConfig::builder().watermarks_bytes(u64::MAX / 2, u64::MAX / 4).build()?;
        Some(ActivationRuntime::new(probe.clone(), keep, bus, Some(rt.resolver()))?)
    } else {
        None
    };
    let ids: Vec<BlockId> = if mode.units {
        Vec::new()
    } else {
        (0..blocks).map(|b| rt.block_id(&format!("blocks.{b}"))).collect::<Result<_, _>>()?
    };
    let units: Vec<Vec<BlockId>> = if mode.units {
        (0..blocks)
            .map(|b| ["attn", "up", "down"].iter().map(|u| rt.block_id(&format!("blocks.{b}.{u}"))).collect::<Result<_, _>>())
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let streamed_w = weights_of(vs, blocks);
    let store = Arc::new(WeightStore::new(rt.resolver()));
    let step = || -> anyhow::Result<f64> {
        let x = if inference { x0.shallow_clone() } else { x0.detach().set_requires_grad(true) };
        let t0 = Instant::now();
        rt.begin_step()?;
        if mode.units {
            let forward = || -> anyhow::Result<Tensor> {
                let mut h = x.shallow_clone();
                for (u, w) in units.iter().zip(&streamed_w) {
                    h = block_fwd_units(&rt, u, w, &h)?;
                }
                Ok(h)
            };
            if inference {
                let _ = tch::no_grad(forward)?;
            } else {
                let y = {
                    let _hooks = SavedTensorHooks::enable(store.clone())?;
                    forward()?
                };
                y.to_kind(Kind::Float).mean(Kind::Float).backward();
            }
        } else if inference {
            tch::no_grad(|| -> anyhow::Result<()> {
                let mut h = x.shallow_clone();
                for (id, w) in ids.iter().zip(&streamed_w) {
                    let _g = rt.block(*id)?;
                    h = block_fwd(w, &h);
                }
                Ok(())
            })?;
        } else if let Some(acts) = &acts {
            acts.begin_step(1);
            let y = {
                let _hooks = acts.managed_forward()?;
                let mut h = x.shallow_clone();
                for (id, w) in ids.iter().zip(&streamed_w) {
                    let _g = rt.block(*id)?;
                    let sources: Vec<&Tensor> = std::iter::once(&h).chain(w.iter()).collect();
                    h = recompute(&sources, |s| block_fwd(&s[1..], &s[0]));
                }
                h
            };
            y.to_kind(Kind::Float).mean(Kind::Float).backward();
            drop(y);
            acts.end_step()?;
        } else {
            let y = {
                let _hooks = SavedTensorHooks::enable(store.clone())?;
                let mut h = x.shallow_clone();
                for (id, w) in ids.iter().zip(&streamed_w) {
                    let _g = rt.block(*id)?;
                    h = block_fwd(w, &h);
                }
                h
            };
            y.to_kind(Kind::Float).mean(Kind::Float).backward();
        }
        rt.end_step()?;
        sync()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    step()?; // traces the itinerary
    probe.reset_peak();
    let mut best = Streamed {
        step_s: f64::MAX,
        bytes: 0,
        min_bytes: 0,
        peak: 0,
        metrics: Default::default(),
    };
    for _ in 0..steps {
        let t = step()?;
        if t < best.step_s {
            best.step_s = t;
            best.metrics = rt.last_step_metrics();
            best.bytes = best.metrics.h2d_bytes;
            best.min_bytes = best.metrics.min_h2d_bytes;
        }
    }
    best.peak = probe.memory().peak;
    rt.shutdown()?;
    sync()?;
    Ok(best)
}
