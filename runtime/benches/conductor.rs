//! Weights and activations together, with and without the Conductor: a frozen stack of
//! transformer-style blocks (the weights benchmark's, with GELUs in the projection chain so
//! that autograd saves activations), trained with input gradients, its weights streamed
//! in block mode through a budget of a few blocks and its activations spilled above a
//! watermark. Steps with and without the Conductor alternate on the same runtimes (attached
//! for one step, detached for the next), so drift in clocks or caches hits both alike.
//!
//! For the resident model and each mode it prints step time, weight and activation stalls,
//! peak allocated, bytes moved each way, the ratio to the floor max(resident step, H2D bytes /
//! H2D bandwidth, D2H bytes / D2H bandwidth) with bandwidths measured in the same run, and for
//! the Conductor its slot grants, refusals, grants over the limit and the rules that fired.
//!
//! On a GPU the default is 16 blocks, d=4096, bf16, 8192 tokens (6.4 GB of weights, 4 blocks
//! resident, about half of the 7.5 GB of activations spilled); on the host device a small f32
//! model. Override with env variables: `SH_BLOCKS`, `SH_D`, `SH_TOKENS`, `SH_STEPS`,
//! `SH_BUDGET_BLOCKS`, `SH_SPILL_FRACTION` (of the activation bytes kept on the device),
//! `SH_H2D_SLOTS`, `SH_D2H_SLOTS`, `SH_KIND` (`bf16`, `f16`, `f32`).
//!
//! Run: `cargo bench -p stagehand-runtime --bench conductor`.

use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::conductor::{Conductor, ConductorConfig};
use stagehand::device::Device;
use stagehand::events::{BlockId, Bus, Event, EventKind, EventSink, Hub, PolicyRule};
use stagehand::weights::{WeightConfig, WeightRuntime};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::{Kind, Tensor};

mod common;
use common::{env, weights_of};

const MIB: f64 = (1u64 << 20) as f64;

/// One block: four d×d projections in a chain with GELUs between them and a residual, then a
/// 4d MLP with a residual. With frozen weights autograd saves only what the input gradient
/// needs: the GELU inputs, 7 tensors' worth of tokens×d elements per block (3 + 4).
fn block_fwd(w: &[Tensor], x: &Tensor) -> Tensor {
    let none: Option<&Tensor> = None;
    let a = x
        .linear(&w[0], none)
        .gelu("tanh")
        .linear(&w[1], none)
        .gelu("tanh")
        .linear(&w[2], none)
        .gelu("tanh")
        .linear(&w[3], none);
    let x = x + a;
    let m = x.linear(&w[4], none).gelu("tanh");
    &x + m.linear(&w[5], none)
}

/// Counts the Conductor's hint changes by rule.
#[derive(Clone, Default)]
struct Rules(Arc<Mutex<BTreeMap<String, u64>>>);

impl EventSink for Rules {
    fn on_event(&mut self, e: &Event) {
        if let EventKind::HintsChanged { rule, .. } = &e.kind {
            if *rule != PolicyRule::Reset {
                let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
                *m.entry(stagehand::events::wire_name(rule)).or_default() += 1;
            }
        }
    }
}

/// Sums of one mode's timed steps.
#[derive(Default)]
struct Totals {
    steps: u32,
    seconds: f64,
    weight_stall_ms: f64,
    act_stall_ms: f64,
    peak: u64,
    h2d: u64,
    d2h: u64,
    spilled: u64,
    grants: u64,
    denials: u64,
    over_limit: u64,
}

impl Totals {
    fn mean(&self, v: f64) -> f64 {
        v / f64::from(self.steps.max(1))
    }
}

fn main() -> anyhow::Result<()> {
    let probe = Device::auto(1 << 40);
    // Before the first backward of the process (see the hook engine's docs).
    stagehand::torch::hooks::install()?;
    let cuda = probe.is_cuda();
    let blocks = env("SH_BLOCKS", if cuda { 16 } else { 4 });
    let d = env("SH_D", if cuda { 4096 } else { 128 });
    let tokens = env("SH_TOKENS", if cuda { 8192 } else { 256 });
    let steps = env("SH_STEPS", if cuda { 6 } else { 3 }).max(2) as u32;
    let budget_blocks = env("SH_BUDGET_BLOCKS", if cuda { 4 } else { 2 }) as u64;
    let kept_fraction = std::env::var("SH_SPILL_FRACTION").ok().and_then(|v| v.parse().ok()).unwrap_or(0.5f64);
    let kind = common::kind(cuda);
    let dev = probe.tch_device();
    let elt = kind.elt_size_in_bytes() as u64;
    let block_bytes = common::block_bytes(d, kind);
    let t_bytes = (tokens * d) as u64 * elt;
    let act_estimate = blocks as u64 * 7 * t_bytes;
    println!("device: {} ({})", probe.info().name, if cuda { "cuda" } else { "host-simulated" });
    println!(
        "model: {blocks} blocks, d={d}, {kind:?}, {:.2} GB of weights, {tokens} tokens, about {:.2} GB of activations",
        (blocks as u64 * block_bytes) as f64 / 1e9,
        act_estimate as f64 / 1e9
    );
    let sync = || probe.synchronize();

    // ---- resident reference ---------------------------------------------------------------
    let vr = common::resident_stack(dev, blocks, d, kind);
    let x0 = (Tensor::randn([tokens, d], (Kind::Float, dev)) * 0.1).to_kind(kind);
    let resident_w = weights_of(&vr, blocks);
    let mut resident = f64::MAX;
    let mut resident_peak = 0;
    for _ in 0..=steps {
        sync()?;
        probe.reset_peak();
        let x = x0.detach().set_requires_grad(true);
        let t0 = Instant::now();
        let y = resident_w.iter().fold(x.shallow_clone(), |h, bw| block_fwd(bw, &h));
        y.to_kind(Kind::Float).mean(Kind::Float).backward();
        drop(y);
        sync()?;
        resident = resident.min(t0.elapsed().as_secs_f64());
        resident_peak = resident_peak.max(probe.memory().peak);
    }

    // ---- the same weights in host memory, streamed; activations spilled -------------------
    let vs = common::host_copy(&vr, blocks);
    drop(resident_w);
    drop(vr);
    sync()?;

    let rules = Rules::default();
    let hub = Arc::new(Hub::new());
    hub.add_sink(Box::new(rules.clone()));
    let bus = Bus::with_hub(hub, 1 << 20);
    let weight_budget = budget_blocks * block_bytes;
    let wcfg = WeightConfig::builder()
        .pool(block_bytes * 2, block_bytes)
        .watermarks(u64::MAX / 2, u64::MAX / 4)
        .weight_budget(weight_budget)
        .prefetch_window(2)
        .max_inflight_h2d(2)
        .build()?;
    let rt = WeightRuntime::from_var_store(&vs, r"^blocks\.\d+$", probe.clone(), wcfg, bus.clone())?;
    let ids: Vec<BlockId> = (0..blocks).map(|b| rt.block_id(&format!("blocks.{b}"))).collect::<Result<_, _>>()?;
    let streamed_w = weights_of(&vs, blocks);
    // Spill above: the weights' room and two blocks landing, plus a fraction of the activations.
    let high = weight_budget + 2 * block_bytes + (act_estimate as f64 * kept_fraction) as u64;
    let low = high.saturating_sub(act_estimate / 10);
    let acfg = ActivationConfig::builder()
        .watermarks_bytes(high, low)
        .classes_bytes(&[t_bytes, 4 * t_bytes])
        .slabs_per_class(&[(blocks as u32 * 3).max(4), (blocks as u32).max(4)])
        .min_spill_bytes(t_bytes.min(1 << 20))
        .max_inflight(4, 2)
        .restore_ahead(4, 8 * t_bytes)
        .keep_tail_groups(1)
        .build()?;
    let acts = ActivationRuntime::new(probe.clone(), acfg, bus.clone(), Some(rt.resolver()))?;
    let soft_mib = ((high as f64 * 1.25) / MIB).ceil() as u64;
    let conductor = {
        let p = probe.clone();
        Conductor::new(
            ConductorConfig::builder()
                .vram_soft_cap_mib(soft_mib)
                .vram_hard_cap_mib(soft_mib + soft_mib / 10)
                .h2d_slots(env("SH_H2D_SLOTS", 2) as u32)
                .d2h_slots(env("SH_D2H_SLOTS", 4) as u32)
                .debug_event_trace(false)
                .build()?,
            bus.clone(),
            move || p.memory().allocated,
        )?
    };

    // One step; `c` is the attached Conductor or a disabled one.
    let step = |n: u64, c: &Conductor, totals: Option<&mut Totals>| -> anyhow::Result<()> {
        sync()?;
        probe.reset_peak();
        let x = x0.detach().set_requires_grad(true);
        let t0 = Instant::now();
        c.begin_step(n)?;
        rt.begin_step()?;
        acts.begin_step(n);
        c.enter_forward()?;
        let y = {
            let _hooks = acts.managed_forward()?;
            let mut h = x.shallow_clone();
            for (i, (id, w)) in ids.iter().zip(&streamed_w).enumerate() {
                let _region = acts.region(&format!("blocks.{i}"));
                let _g = rt.block(*id)?;
                h = block_fwd(w, &h);
            }
            h
        };
        c.enter_backward()?;
        y.to_kind(Kind::Float).mean(Kind::Float).backward();
        drop(y);
        let am = acts.end_step()?;
        if std::env::var("SH_VERBOSE").is_ok() {
            println!("  step {n}: {am:?}");
        }
        rt.end_step()?;
        c.end_step()?;
        sync()?;
        let dt = t0.elapsed().as_secs_f64();
        if let Some(t) = totals {
            let wm = rt.last_step_metrics();
            t.steps += 1;
            t.seconds += dt;
            t.weight_stall_ms += wm.stall_time_ms;
            t.act_stall_ms += am.stall_time_ms;
            t.peak = t.peak.max(probe.memory().peak);
            t.h2d += wm.h2d_bytes + am.restore_bytes;
            t.d2h += am.spill_bytes;
            t.spilled += am.activations_spilled;
            if let Some(m) = c.metrics() {
                t.grants += m.slot_grant_count;
                t.denials += m.slot_deny_count;
                t.over_limit += m.slot_over_limit_count;
            }
        }
        Ok(())
    };
    // Warm-up: the first step traces the itinerary and learns the activation groups.
    let disabled = Conductor::disabled();
    step(0, &disabled, None)?;
    step(1, &disabled, None)?;
    let (mut without, mut with) = (Totals::default(), Totals::default());
    for i in 0..2 * steps {
        let n = u64::from(i) + 2;
        if i % 2 == 1 {
            rt.attach_conductor(&conductor)?;
            acts.attach_conductor(&conductor)?;
            step(n, &conductor, Some(&mut with))?;
            rt.detach_conductor();
            acts.detach_conductor();
        } else {
            step(n, &disabled, Some(&mut without))?;
        }
    }
    conductor.shutdown();
    bus.flush();

    let (bw_h2d, bw_d2h) = common::pinned_bandwidth(&probe, (block_bytes as usize).clamp(64 << 20, 1 << 30))?;
    println!("pinned bandwidth: H2D {:.2} GB/s, D2H {:.2} GB/s", bw_h2d / 1e9, bw_d2h / 1e9);
    println!(
        "budget: weights {} blocks = {:.0} MiB; activations spill above {:.0} MiB down to {:.0} MiB; Conductor soft cap {soft_mib} MiB",
        budget_blocks,
        weight_budget as f64 / MIB,
        high as f64 / MIB,
        low as f64 / MIB
    );
    println!("resident: step {:.1} ms, peak allocated {:.0} MiB", resident * 1e3, resident_peak as f64 / MIB);
    for (name, t) in [("without Conductor", &without), ("with Conductor", &with)] {
        let (h2d, d2h) = (t.mean(t.h2d as f64), t.mean(t.d2h as f64));
        let floor = resident.max(h2d / bw_h2d).max(d2h / bw_d2h);
        let step_s = t.mean(t.seconds);
        println!(
            "{name}: step {:.1} ms, weight stalls {:.1} ms, activation stalls {:.1} ms, peak allocated {:.0} MiB, \
             H2D {:.3} GB, D2H {:.3} GB ({:.0} tensors spilled) per step, floor {:.1} ms, ratio {:.3}",
            step_s * 1e3,
            t.mean(t.weight_stall_ms),
            t.mean(t.act_stall_ms),
            t.peak as f64 / MIB,
            h2d / 1e9,
            d2h / 1e9,
            t.mean(t.spilled as f64),
            floor * 1e3,
            step_s / floor
        );
    }
    println!(
        "Conductor per step: {:.1} slot grants, {:.1} refusals, {:.1} over the limit; rules fired over {} steps: {:?}",
        with.mean(with.grants as f64),
        with.mean(with.denials as f64),
        with.mean(with.over_limit as f64),
        with.steps,
        rules.0.lock().unwrap_or_else(|p| p.into_inner())
    );
    rt.shutdown()?;
    Ok(())
}
