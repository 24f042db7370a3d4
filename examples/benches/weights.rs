//! Weight streaming benchmark: trains (frozen weights, forward and backward, input requiring
//! grad) a model larger than the weight budget, and compares the streamed step time with the
//! floor max(resident step, bytes moved / pinned H2D bandwidth), all measured in this run.
//! Variants: telemetry on (a JSONL sink), the bus disabled, forward only, every block
//! checkpointed (a recompute scope over the block's input and weights: only the input is kept,
//! backward runs the block's forward again with the block resident), and streaming units of a
//! third of a block (the attention projections, the MLP's up and its down projection, each
//! registered as its own unit in the same bytes of room, prefetched as far ahead in bytes): at
//! the forward/backward turn and at the step's start the copy engine waits for a slot to free,
//! which a smaller unit frees sooner; and units of one d×d matrix (twelve a block, the MLP a
//! quarter of its hidden features at a time), which forward only move the fewest bytes. The
//! forward-only variants run with the runtime's cyclic pins (its default in inference mode)
//! and, marked "Belady only", without them. Each variant's output is checked against the
//! resident model's. Each step is timed three ways: waited for by the whole device at its end
//! (the headline: the copy engine idles from then until the host issues the next step's first
//! copy), waited for by its output only (the compute stream, as a loop reading each result
//! does; copies already queued for the next step go on), and queued back to back (one wait for
//! the device at the end instead of one a step).
//!
//! On a GPU the default is the 16-block d=4096 bf16 model at 4096 tokens (6.4 GB of weights,
//! 4 blocks resident); on the host device a small f32 model. Override with env variables:
//! `SH_BLOCKS`, `SH_D`, `SH_TOKENS`, `SH_STEPS`, `SH_BUDGET_BLOCKS`, `SH_PREFETCH`,
//! `SH_INFLIGHT`, `SH_KIND` (`bf16`, `f16`, `f32`); `SH_VARIANTS` runs only the variants whose
//! names contain one of its comma-separated parts (`SH_VARIANTS="forward only"`);
//! `SH_INFER_WINDOW` sets the forward-only variants' window in positions (units or blocks).
//!
//! Quantized frozen weights: the variants marked "int8" (and "fp8") store every block quantized
//! (`WeightRuntime::quantize`): each load copies its payload (about half a bf16 block's bytes)
//! into the block's slot, where it is dequantized in place just before use. Their floor is
//! max(the resident step with dequantization: every block's payload on the device, dequantized
//! into a full-width buffer before its forward, then forward and backward; the quantized bytes'
//! Belady minimum / H2D bandwidth); they are also compared with the bf16 stream of the same
//! units at the same room, both measured in this command: choosing a quantized variant chooses
//! that stream too, so `SH_VARIANTS=int8` runs the INT8 variants (whole blocks, thirds, d×d
//! units) and their bf16 streams.
//!
//! Each fwd+bwd variant also prints its phase floor: max(the resident forward, the forward's
//! loads / bandwidth) + max(the resident backward, the backward's loads / bandwidth), with a
//! quantized stream's dequantization of the units each phase loads added to its compute. The
//! floor above lets the link carry one phase's loads while the other computes; at a full room
//! it cannot (see `phase_floor`), so a stream with one phase bound by the link and the other by
//! compute stays above that floor by the difference.
//!
//! Run: `cargo bench -p stagehand-examples --bench weights`. It lives beside the examples because
//! its telemetry-on runs attach the live server (`stagehand-web`), which the runtime's own
//! benches and tests do not build.

use stagehand::activations::{recompute, ActivationConfig, ActivationRuntime};
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::events::BlockId;
use stagehand::weights::quant::{dequantize_tensor, quantize_tensor};
use stagehand::weights::{BlockGuard, WeightConfig, WeightRuntime};
use stagehand::QuantFormat;
use stagehand::torch::SavedTensorHooks;
use stagehand::weights::WeightStore;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

// The GPU benchmarks' shared model and floors, one copy for the runtime's benches and this one.
#[path = "../../runtime/benches/common/mod.rs"]
mod common;
use common::{env, weights_of};

// One block: four d×d projections in a chain with a residual, then a 4d MLP with a residual
// (12 d² weights, the parameter count of a transformer block), in the three parts that the
// third-block units stream separately.
const NONE: Option<&Tensor> = None;

/// The full-width forward+backward stream the quantized variants are compared with.
const FULL_WIDTH_STREAM: &str = "fwd+bwd, telemetry on";

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
fn block_fwd_thirds(rt: &WeightRuntime, units: &[BlockId], w: &[Tensor], x: &Tensor) -> anyhow::Result<Tensor> {
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

/// How many d×d matrices the MLP's up (and its down) projection is cut into.
const MLP_SLICES: i64 = 4;

/// The block's weights as twelve d×d matrices, in the order [`block_fwd_matrices`] uses them:
/// the four attention projections, then for each quarter of the MLP's hidden features its rows
/// of the up projection and its columns of the down projection. The same numbers as the
/// block's six tensors, cut (copies in host memory).
fn matrices_of(w: &[Tensor], d: i64) -> Vec<Tensor> {
    let mut m: Vec<Tensor> = w[..4].iter().map(|t| t.shallow_clone()).collect();
    for i in 0..MLP_SLICES {
        m.push(w[4].narrow(0, i * d, d).contiguous());
        m.push(w[5].narrow(1, i * d, d).contiguous());
    }
    m
}

/// The same block through twelve streaming units of one d×d matrix each: the attention chain a
/// projection at a time, then the MLP a quarter of its hidden features at a time (up slice,
/// GELU, down slice, summed into the residual): the block's math with the down projection's sum
/// split in four, so equal to [`block_fwd`] up to rounding.
fn block_fwd_matrices(rt: &WeightRuntime, units: &[BlockId], w: &[Tensor], x: &Tensor) -> anyhow::Result<Tensor> {
    let enter = |u: usize| -> anyhow::Result<BlockGuard> { Ok(rt.block(units[u])?) };
    let mut a = x.shallow_clone();
    for (u, wu) in w[..4].iter().enumerate() {
        let _g = enter(u)?;
        a = a.linear(wu, NONE);
    }
    let x = x + a;
    let mut out = x.shallow_clone();
    for i in 0..MLP_SLICES as usize {
        let m = {
            let _g = enter(4 + 2 * i)?;
            x.linear(&w[4 + 2 * i], NONE).gelu("tanh")
        };
        let _g = enter(5 + 2 * i)?;
        // out + m·Wᵀ in one kernel: the product accumulated into the sum before it is rounded.
        out = out.addmm(&m, &w[5 + 2 * i].tr());
    }
    Ok(out)
}

/// What one streaming unit holds.
#[derive(Clone, Copy, PartialEq)]
enum Units {
    /// A whole block (12 d²).
    Blocks,
    /// A third of a block: the attention projections, the MLP's up, its down (4 d² each).
    Thirds,
    /// One d×d matrix ([`matrices_of`]): twelve units a block.
    Matrices,
}

impl Units {
    fn per_block(self) -> u32 {
        self.layout().len() as u32
    }

    /// A block's units in the order the step enters them: each one's name after the block's
    /// (`blocks.3` + `.attn`) and the names of the weights it holds, in the order the block's
    /// forward takes them ([`common::NAMES`], or [`matrices_of`]'s order).
    fn layout(self) -> Vec<(String, Vec<String>)> {
        let names = |ns: &[&str]| ns.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        match self {
            Units::Blocks => vec![(String::new(), names(&common::NAMES))],
            Units::Thirds => vec![
                (".attn".into(), names(&common::NAMES[..4])),
                (".up".into(), names(&common::NAMES[4..5])),
                (".down".into(), names(&common::NAMES[5..])),
            ],
            Units::Matrices => {
                let mlp = (0..MLP_SLICES).flat_map(|i| [format!("up.{i}"), format!("down.{i}")]);
                common::NAMES[..4].iter().map(|n| n.to_string()).chain(mlp).map(|n| (format!(".{n}"), vec![n])).collect()
            }
        }
    }
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
    // The link's rate, measured before the variants and again after them: the floor takes the
    // higher, so a link slower at one of the two times never lowers the floor.
    let bw_bytes = (block_bytes as usize).clamp(64 << 20, 1 << 30);
    let (bw_before, _) = common::pinned_bandwidth(&probe, bw_bytes)?;
    // Every streamed variant's output is checked against the resident model's.
    let y_ref = tch::no_grad(|| resident_w.iter().fold(x0.shallow_clone(), |h, bw| block_fwd(bw, &h)));

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
    // (name, forward only, telemetry, checkpointed blocks, streaming units, cyclic pins in
    // inference mode)
    // (name, forward only, telemetry, checkpointed blocks, streaming units, cyclic pins) and,
    // in `quantized` below, the variants that stream every block quantized.
    let quantized = |name: &str| {
        if name.contains("int8") {
            Some(QuantFormat::Int8)
        } else if name.contains("fp8") {
            Some(QuantFormat::Fp8E4m3)
        } else {
            None
        }
    };
    let variants = [
        ("fwd+bwd, int8, telemetry on", false, true, false, Units::Blocks, true),
        ("fwd+bwd, int8, third-block units, telemetry on", false, true, false, Units::Thirds, true),
        ("fwd+bwd, int8, d×d units, telemetry on", false, true, false, Units::Matrices, true),
        ("fwd+bwd, fp8, telemetry on", false, true, false, Units::Blocks, true),
        (FULL_WIDTH_STREAM, false, true, false, Units::Blocks, true),
        ("fwd+bwd, bus disabled", false, false, false, Units::Blocks, true),
        ("forward only, telemetry on", true, true, false, Units::Blocks, true),
        ("forward only, Belady only, telemetry on", true, true, false, Units::Blocks, false),
        ("fwd+bwd, checkpointed blocks, telemetry on", false, true, true, Units::Blocks, true),
        ("fwd+bwd, third-block units, telemetry on", false, true, false, Units::Thirds, true),
        ("forward only, third-block units, telemetry on", true, true, false, Units::Thirds, true),
        ("forward only, third-block units, Belady only, telemetry on", true, true, false, Units::Thirds, false),
        ("fwd+bwd, d×d units, telemetry on", false, true, false, Units::Matrices, true),
        ("forward only, d×d units, telemetry on", true, true, false, Units::Matrices, true),
        ("forward only, d×d units, Belady only, telemetry on", true, true, false, Units::Matrices, false),
    ];
    // SH_VARIANTS: run only the variants whose names contain one of these comma-separated parts.
    let only = std::env::var("SH_VARIANTS").ok();
    let picked = |name: &str| only.as_deref().is_none_or(|o| o.split(',').any(|part| name.contains(part.trim())));
    // A quantized variant is compared with the full-width stream of the same units at the same
    // room, in the same command: choosing one chooses that stream too (`SH_VARIANTS=int8` runs
    // them all).
    let quantized_units: Vec<Units> = variants.iter().filter(|v| quantized(v.0).is_some() && picked(v.0)).map(|v| v.4).collect();
    // The streams a quantized variant is compared with: full width, fwd+bwd, telemetry on, not
    // checkpointed (one of each units).
    let full_width_stream = |name: &str, inference: bool, checkpoint: bool| {
        quantized(name).is_none() && !inference && !checkpoint && name.contains("telemetry on")
    };
    let counterpart = |name: &str, inference: bool, checkpoint: bool, units: Units| {
        full_width_stream(name, inference, checkpoint) && quantized_units.contains(&units)
    };
    let mut results = Vec::new();
    for (i, (name, inference, telemetry, checkpoint, units, pins)) in variants.into_iter().enumerate() {
        if !picked(name) && !counterpart(name, inference, checkpoint, units) {
            continue;
        }
        // Telemetry on: every event to a JSONL file, the Prometheus metrics, and the live server
        // with a client reading its event stream, as a user watching the dashboard would.
        let (bus, live) = if telemetry {
            let hub = Arc::new(stagehand::events::Hub::new());
            let file = out_dir.join(format!("weights-{}-{i}.jsonl", std::process::id()));
            hub.add_sink(Box::new(stagehand::events::JsonlSink::open(&file, stagehand::events::OpenMode::CreateNew)?));
            let live = Live::start(hub.clone())?;
            (Bus::with_hub(hub, 1 << 20), Some(live))
        } else {
            (Bus::disabled(), None)
        };
        let mode = Mode { inference, checkpoint, units, pins, d, quant: quantized(name) };
        let window = match (inference, infer_window) {
            (true, Some(w)) => w,
            _ => prefetch * units.per_block(),
        };
        // A runtime leaves its blocks' values in the variables when it finishes, a quantized
        // block's dequantized ones: a quantized variant streams a copy of the weights, so the
        // variants after it stream (and check their output against) the model's own values.
        let copy = mode.quant.map(|_| common::host_copy(&vs, blocks));
        let (r, output) = run_streamed(&probe, copy.as_ref().unwrap_or(&vs), blocks, block_bytes, budget_blocks, window, inflight, steps, &x0, bus.clone(), mode)?;
        drop(copy);
        bus.close();
        if let Some(live) = live {
            println!("{name}: {}", live.finish()?);
        }
        // Largest difference from the resident model's output, relative to its largest value:
        // rounding only (the d×d units sum the MLP in four parts); a unit streamed wrong or not
        // at all shows as a difference of the outputs' own size.
        let diff = f64::try_from((&output - &y_ref).abs().max().to_kind(Kind::Float))?
            / f64::try_from(y_ref.abs().max().to_kind(Kind::Float))?;
        drop(output);
        // Quantized weights add their own error (INT8 under 0.4% of a group's largest weight,
        // FP8 under 6.25%), still far from a block streamed wrong.
        let tolerance = match mode.quant {
            Some(QuantFormat::Fp8E4m3) => 0.25,
            Some(QuantFormat::Int8) => 0.1,
            None => 0.05,
        };
        anyhow::ensure!(diff < tolerance, "{name}: output differs from the resident model's by {diff:.3e} of its largest value");
        println!(
            "{name}: {:.4} s/step ({:.4} output ready, {:.4} back to back), h2d {:.3} GB (minimum {:.3} GB), hits {} misses {}, peak {:.2} GB, output vs resident {diff:.1e}",
            r.step_s,
            r.output_s,
            r.back_to_back_s,
            r.bytes as f64 / 1e9,
            r.min_bytes as f64 / 1e9,
            r.metrics.prefetch_hits,
            r.metrics.prefetch_misses,
            r.peak as f64 / 1e9
        );
        results.push((name, inference, checkpoint, mode.quant, units, r));
    }
    let (bw_after, _) = common::pinned_bandwidth(&probe, bw_bytes)?;
    let bw = bw_before.max(bw_after);
    println!(
        "pinned H2D bandwidth: {:.2} GB/s (before the variants {:.2}, after {:.2}; the floor takes the higher)",
        bw / 1e9,
        bw_before / 1e9,
        bw_after / 1e9
    );
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
    // The quantized variants' resident term: every block's payload on the device, dequantized
    // into full-width buffers before its forward, then forward and backward.
    let mut resident_dequant: Vec<(QuantFormat, f64)> = Vec::new();
    for format in results.iter().filter_map(|r| r.3) {
        if resident_dequant.iter().any(|(f, _)| *f == format) {
            continue;
        }
        let vr3 = common::resident_stack(dev, blocks, d, kind);
        let payloads: Vec<Vec<(Tensor, Tensor, Vec<i64>)>> = weights_of(&vr3, blocks)
            .iter()
            .map(|w| {
                w.iter()
                    .map(|t| {
                        let (q, s) = quantize_tensor(t, format).expect("quantize");
                        (q.to_device(dev), s.to_device(dev), t.size())
                    })
                    .collect()
            })
            .collect();
        drop(vr3);
        let mut best = f64::MAX;
        for _ in 0..=steps {
            let x = x0.detach().set_requires_grad(true);
            sync()?;
            let t0 = Instant::now();
            let mut h = x.shallow_clone();
            for block in &payloads {
                let w: Vec<Tensor> = block
                    .iter()
                    .map(|(q, s, shape)| {
                        let out = Tensor::empty(shape.as_slice(), (kind, dev));
                        dequantize_tensor(&out, q, s, format).expect("dequantize");
                        out
                    })
                    .collect();
                h = block_fwd(&w, &h);
            }
            h.to_kind(Kind::Float).mean(Kind::Float).backward();
            sync()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("resident step with {format} dequantization: {best:.4} s (fwd+bwd, each block dequantized once before its forward)");
        resident_dequant.push((format, best));
    }
    // A quantized variant's full-width counterpart of the same units (chosen with it, so it ran).
    let full_width = |units: Units| {
        results
            .iter()
            .find(|r| full_width_stream(r.0, r.1, r.2) && r.4 == units)
            .map(|r| (r.0, r.5.step_s))
    };
    // What no unit size can beat: every byte beyond the room moved once per pass (twice with
    // backward), as if units were infinitely fine.
    let beyond_room = (blocks as u64 * block_bytes as u64).saturating_sub(budget_blocks * block_bytes as u64);
    for (name, inference, _, quant, units, r) in &results {
        let base = match quant {
            Some(f) => resident_dequant.iter().find(|(g, _)| g == f).map_or(resident, |(_, s)| *s),
            None if *inference => resident_fwd,
            None => resident,
        };
        let floor = base.max(r.min_bytes as f64 / bw);
        let passes = if *inference { 1 } else { 2 };
        println!(
            "{name}: floor max(resident {:.4}, minimum bytes / bandwidth {:.4}) = {floor:.4} s; ratio {:.3} (output ready {:.3}, back to back {:.3}); bytes moved / minimum {:.3}; / weights beyond the room {:.3}",
            base,
            r.min_bytes as f64 / bw,
            r.step_s / floor,
            r.output_s / floor,
            r.back_to_back_s / floor,
            if r.min_bytes > 0 { r.bytes as f64 / r.min_bytes as f64 } else { 0.0 },
            r.bytes as f64 / (passes * beyond_room).max(1) as f64
        );
        if !*inference {
            let dequant = if quant.is_some() { base - resident } else { 0.0 };
            let loaded = blocks.saturating_sub(budget_blocks as i64) as f64 / blocks.max(1) as f64;
            let p = phase_floor(resident, resident_fwd, dequant, loaded, r.min_bytes as f64 / bw);
            println!(
                "{name}: phase floor max(forward {:.4}, its bytes {:.4}) + max(backward {:.4}, its bytes {:.4}) = {:.4} s; ratio {:.3} (the floor above lets the link carry one phase's loads in the other)",
                p.forward,
                p.bytes,
                p.backward,
                p.bytes,
                p.total(),
                r.step_s / p.total()
            );
        }
        if let (Some(f), Some((full_name, full))) = (quant, full_width(*units)) {
            println!(
                "{name}: {:.4} s/step against {full_name}'s {full:.4} ({kind:?}) at the same room: {:.3}x its time ({f} payloads, {:.3} GB a step against the minimum {:.3} GB)",
                r.step_s,
                r.step_s / full,
                r.bytes as f64 / 1e9,
                r.min_bytes as f64 / 1e9
            );
        }
    }
    Ok(())
}

/// A training step's floor taken phase by phase: each phase's compute or its own loads,
/// whichever is longer, summed.
#[derive(Debug, Clone, Copy)]
struct PhaseFloor {
    forward: f64,
    backward: f64,
    /// One phase's loads over the link (seconds).
    bytes: f64,
}

impl PhaseFloor {
    fn total(&self) -> f64 {
        self.forward.max(self.bytes) + self.backward.max(self.bytes)
    }
}

/// The phase floor of a fwd+bwd stream of equal units whose Belady minimum takes `min_bytes_s`
/// on the link, from the resident step (`step`), its forward alone (`forward`), the
/// dequantization a resident step adds (`dequant`, 0 for full-width units; it dequantizes every
/// unit once) and the share of the units a phase loads (`loaded`: the units beyond the room).
///
/// Why the link cannot carry one phase's loads in the other without more room: at the
/// forward/backward turn the room holds the forward's last units, which backward needs first,
/// and at the step's end the backward's last units, which the next forward needs first. Every
/// slot holds a unit needed sooner than any unit outside the room, so a load can start only
/// once a unit of the new phase is done; each phase loads the units beyond the room, half the
/// step's minimum, and dequantizes each one it loads.
fn phase_floor(step: f64, forward: f64, dequant: f64, loaded: f64, min_bytes_s: f64) -> PhaseFloor {
    let dequant = dequant.max(0.0) * loaded;
    PhaseFloor { forward: forward + dequant, backward: (step - forward).max(0.0) + dequant, bytes: min_bytes_s / 2.0 }
}

/// The live server on a loopback port, its metrics sink on the hub, and one client reading the
/// server's event stream (`/api/stream`) for the whole run.
struct Live {
    server: stagehand_web::ServerHandle,
    /// The server's `host:port`.
    host: String,
    reader: std::thread::JoinHandle<std::io::Result<u64>>,
}

impl Live {
    fn start(hub: Arc<stagehand::events::Hub>) -> anyhow::Result<Live> {
        let server = stagehand_web::Server::live(hub, "127.0.0.1:0")?;
        let host = server.url().trim_start_matches("http://").to_owned();
        let mut stream = std::net::TcpStream::connect(&host)?;
        let request = format!("GET /api/stream HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n");
        let reader = std::thread::spawn(move || -> std::io::Result<u64> {
            use std::io::{Read, Write};
            stream.write_all(request.as_bytes())?;
            let mut buf = vec![0u8; 1 << 16];
            let mut total = 0u64;
            loop {
                match stream.read(&mut buf)? {
                    0 => return Ok(total),
                    n => total += n as u64,
                }
            }
        });
        Ok(Live { server, host, reader })
    }

    /// Scrapes `/metrics` once, stops the server, and says what the client and the scrape read.
    fn finish(self) -> anyhow::Result<String> {
        use std::io::{Read, Write};
        let mut scrape = std::net::TcpStream::connect(&self.host)?;
        write!(scrape, "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.host)?;
        let mut text = String::new();
        scrape.read_to_string(&mut text)?;
        let series = text.lines().filter(|l| l.starts_with("stagehand_")).count();
        anyhow::ensure!(text.starts_with("HTTP/1.1 200") && series > 0, "the /metrics scrape returned no stagehand series: {:.200}", text);
        self.server.shutdown()?;
        let streamed = self.reader.join().map_err(|_| anyhow::anyhow!("the stream reader panicked"))??;
        anyhow::ensure!(streamed > 0, "the live stream delivered nothing");
        Ok(format!("live stream client read {:.1} MB; /metrics scrape: {series} stagehand series", streamed as f64 / 1e6))
    }
}

/// How the streamed step runs.
#[derive(Clone, Copy)]
struct Mode {
    /// Forward only, under `no_grad`.
    inference: bool,
    /// Each block in a recompute scope: its activations computed again in backward from the
    /// block's input and its weights (resident again for backward), instead of kept.
    checkpoint: bool,
    /// What one streaming unit holds.
    units: Units,
    /// The runtime's cyclic pins (inference mode only).
    pins: bool,
    /// The model's width (to cut the d×d units).
    d: i64,
    /// Every block stored quantized in this format.
    quant: Option<QuantFormat>,
}

struct Streamed {
    /// Best step waited for by the whole device at its end.
    step_s: f64,
    /// Best step waited for by its output only (the compute stream), as a loop reading each
    /// step's result waits: copies queued for the next step may still run.
    output_s: f64,
    /// Mean step of `steps` steps queued back to back.
    back_to_back_s: f64,
    bytes: u64,
    min_bytes: u64,
    peak: u64,
    metrics: stagehand::events::WeightStepMetrics,
}

/// What a timed step waits for at its end.
#[derive(Clone, Copy)]
enum Wait {
    /// The whole device: the copy engine idles from the step's last copy until the host issues
    /// the next step's first, so the step also pays that gap.
    Device,
    /// The step's output: the compute stream's work (what reading the result waits for).
    Output,
    /// Nothing: the next step is queued behind this one.
    None,
}

/// Streams the stack through `budget_blocks` blocks of device room for `steps` timed steps after
/// one traced step; the best step and its metrics, and the traced step's output (to check
/// against the resident model's, then drop: kept, the outputs of earlier variants would count
/// in later variants' peaks).
#[allow(clippy::too_many_arguments)]
fn run_streamed(
    probe: &Device,
    vs: &tch::nn::VarStore,
    blocks: i64,
    block_bytes: i64,
    budget_blocks: u64,
    // Positions ahead: smaller units prefetch as many more units ahead as blocks would, as far
    // in bytes.
    prefetch: u32,
    inflight: u32,
    steps: i64,
    x0: &Tensor,
    bus: Bus,
    mode: Mode,
) -> anyhow::Result<(Streamed, Tensor)> {
    let inference = mode.inference;
    let sync = || probe.synchronize();
    let unit_bytes = block_bytes / mode.units.per_block() as i64;
    let cfg = WeightConfig::builder()
        .pool(unit_bytes as u64 * 2, unit_bytes as u64)
        .watermarks(u64::MAX / 2, u64::MAX / 4)
        .weight_budget(budget_blocks * block_bytes as u64)
        .prefetch_window(prefetch)
        .max_inflight_h2d(inflight)
        .inference_mode(inference)
        .cyclic_pins(mode.pins)
        .build()?;
    // Each block's weights as the step uses them: its six tensors, or its twelve d×d matrices.
    let streamed_w = match mode.units {
        Units::Matrices => weights_of(vs, blocks).iter().map(|w| matrices_of(w, mode.d)).collect(),
        _ => weights_of(vs, blocks),
    };
    let layout = mode.units.layout();
    let rt = if mode.units == Units::Blocks {
        WeightRuntime::from_var_store(vs, r"^blocks\.\d+$", probe.clone(), cfg, bus.clone())?
    } else {
        let rt = WeightRuntime::new(probe.clone(), cfg, bus.clone())?;
        let held: usize = layout.iter().map(|(_, names)| names.len()).sum();
        for (b, w) in streamed_w.iter().enumerate() {
            anyhow::ensure!(w.len() == held, "block {b}: {} weights for units that hold {held}", w.len());
            let mut weights = w.iter();
            for (suffix, names) in &layout {
                let params = names.iter().zip(weights.by_ref()).map(|(n, t)| (format!("blocks.{b}.{n}"), t.shallow_clone())).collect();
                rt.register_block(&format!("blocks.{b}{suffix}"), params)?;
            }
        }
        rt
    };
    // Checkpointing goes through the activation runtime's store (recompute scopes), keeping on
    // the device whatever is saved: only the scopes change what is stored.
    let acts = if mode.checkpoint {
        let keep = ActivationConfig::builder().watermarks_bytes(u64::MAX / 2, u64::MAX / 4).build()?;
        Some(ActivationRuntime::new(probe.clone(), keep, bus, Some(rt.resolver()))?)
    } else {
        None
    };
    if let Some(format) = mode.quant {
        for b in rt.blocks() {
            rt.quantize(b.id, format)?;
        }
    }
    let units: Vec<Vec<BlockId>> = (0..blocks)
        .map(|b| layout.iter().map(|(u, _)| rt.block_id(&format!("blocks.{b}{u}"))).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    let ids: Vec<BlockId> = units.iter().map(|u| u[0]).collect();
    let store = Arc::new(WeightStore::new(rt.resolver()));
    // One step: its time and its output, waited for as `wait` says.
    let step = |wait: Wait| -> anyhow::Result<(f64, Tensor)> {
        let x = if inference { x0.shallow_clone() } else { x0.detach().set_requires_grad(true) };
        let t0 = Instant::now();
        rt.begin_step()?;
        let output = if mode.units != Units::Blocks {
            let forward = || -> anyhow::Result<Tensor> {
                let mut h = x.shallow_clone();
                for (u, w) in units.iter().zip(&streamed_w) {
                    h = match mode.units {
                        Units::Thirds => block_fwd_thirds(&rt, u, w, &h)?,
                        _ => block_fwd_matrices(&rt, u, w, &h)?,
                    };
                }
                Ok(h)
            };
            if inference {
                tch::no_grad(forward)?
            } else {
                let y = {
                    let _hooks = SavedTensorHooks::enable(store.clone())?;
                    forward()?
                };
                y.to_kind(Kind::Float).mean(Kind::Float).backward();
                y.detach()
            }
        } else if inference {
            tch::no_grad(|| -> anyhow::Result<Tensor> {
                let mut h = x.shallow_clone();
                for (id, w) in ids.iter().zip(&streamed_w) {
                    let _g = rt.block(*id)?;
                    h = block_fwd(w, &h);
                }
                Ok(h)
            })?
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
            let output = y.detach();
            drop(y);
            acts.end_step()?;
            output
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
            y.detach()
        };
        rt.end_step()?;
        match wait {
            Wait::Device => sync()?,
            Wait::Output => probe.record_compute()?.synchronize()?,
            Wait::None => {}
        }
        Ok((t0.elapsed().as_secs_f64(), output))
    };
    let (_, output) = step(Wait::Device)?; // traces the itinerary
    probe.reset_peak();
    let mut best = Streamed {
        step_s: f64::MAX,
        output_s: f64::MAX,
        back_to_back_s: 0.0,
        bytes: 0,
        min_bytes: 0,
        peak: 0,
        metrics: Default::default(),
    };
    for _ in 0..steps {
        let (t, _) = step(Wait::Device)?;
        if t < best.step_s {
            best.step_s = t;
            best.metrics = rt.last_step_metrics();
            best.bytes = best.metrics.h2d_bytes;
            best.min_bytes = best.metrics.min_h2d_bytes;
        }
    }
    // The same steps queued back to back, the device waited for once: what a step costs
    // without the wait at its end (the copy engine idles from the last copy of one step until
    // the host issues the next step's first).
    for _ in 0..steps {
        let (t, _) = step(Wait::Output)?;
        best.output_s = best.output_s.min(t);
    }
    sync()?;
    let t0 = Instant::now();
    for _ in 0..steps {
        let _ = step(Wait::None)?;
    }
    sync()?;
    best.back_to_back_s = t0.elapsed().as_secs_f64() / steps as f64;
    best.peak = probe.memory().peak;
    rt.shutdown()?;
    sync()?;
    Ok((best, output))
}
