//! Activation spilling benchmark: a stack of transformer-style MLP blocks trained resident, with
//! Activation Stagehand spilling under a budget, and with a naive synchronous spill to pageable
//! host memory (what `torch.autograd.graph.save_on_cpu` does).
//!
//! Prints step times, bytes spilled, the D2H bandwidth measured in the same run, peak allocated
//! with and without spilling, and the ratio of the spilled step time to
//! max(resident step, spilled bytes / bandwidth). Small defaults on the host device; on CUDA a
//! model whose activations are large enough that the budget forces more than half of them out.
//!
//! `cargo bench -p stagehand-runtime --bench activations -- [--blocks N] [--dim D] [--tokens T]
//!  [--steps S] [--budget-fraction F]`

use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::device::Device;
use stagehand::events::{Bus, Event, EventKind, EventSink, Hub, KeepReason, PackDecision};
use stagehand::torch::{SavedTensorHooks, SavedTensorStore};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::nn;
use tch::{Kind, Tensor};

mod common;

const MB: f64 = (1u64 << 20) as f64;

struct Args {
    blocks: usize,
    dim: i64,
    tokens: i64,
    steps: usize,
    budget_fraction: f64,
}

fn args(cuda: bool) -> Args {
    let mut a = if cuda {
        Args { blocks: 16, dim: 2048, tokens: 16384, steps: 4, budget_fraction: 0.4 }
    } else {
        Args { blocks: 4, dim: 256, tokens: 1024, steps: 3, budget_fraction: 0.4 }
    };
    let v: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i + 1 < v.len() {
        let val = &v[i + 1];
        match v[i].as_str() {
            "--blocks" => a.blocks = val.parse().unwrap_or(a.blocks),
            "--dim" => a.dim = val.parse().unwrap_or(a.dim),
            "--tokens" => a.tokens = val.parse().unwrap_or(a.tokens),
            "--steps" => a.steps = val.parse().unwrap_or(a.steps),
            "--budget-fraction" => a.budget_fraction = val.parse().unwrap_or(a.budget_fraction),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

struct Model {
    blocks: Vec<(nn::LayerNorm, nn::Linear, nn::Linear)>,
}

impl Model {
    fn new(vs: &nn::VarStore, a: &Args) -> Model {
        let root = vs.root();
        let blocks = (0..a.blocks)
            .map(|i| {
                let p = &root / format!("b{i}");
                (
                    nn::layer_norm(&p / "ln", vec![a.dim], Default::default()),
                    nn::linear(&p / "up", a.dim, 4 * a.dim, Default::default()),
                    nn::linear(&p / "down", 4 * a.dim, a.dim, Default::default()),
                )
            })
            .collect();
        Model { blocks }
    }

    fn forward(&self, x: &Tensor, rt: Option<&ActivationRuntime>) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, (ln, up, down)) in self.blocks.iter().enumerate() {
            let _r = rt.map(|r| r.region(&format!("blocks.{i}")));
            h = &h + h.apply(ln).apply(up).gelu("tanh").apply(down);
        }
        h.pow_tensor_scalar(2).mean(Kind::Float)
    }
}

/// `save_on_cpu` in Rust: every saved tensor copied synchronously to pageable host memory.
struct NaiveCpuStore {
    device: tch::Device,
    next: AtomicU64,
    held: Mutex<HashMap<u64, Tensor>>,
}

impl SavedTensorStore for NaiveCpuStore {
    fn pack(&self, t: Tensor) -> Result<u64, stagehand::torch::HookError> {
        let h = self.next.fetch_add(1, Ordering::Relaxed);
        let host = t.detach().to_device(tch::Device::Cpu);
        self.held.lock().map_err(|_| "poisoned")?.insert(h, host);
        Ok(h)
    }
    fn unpack(&self, h: u64) -> Result<Tensor, stagehand::torch::HookError> {
        let held = self.held.lock().map_err(|_| "poisoned")?;
        Ok(held.get(&h).ok_or("unknown handle")?.to_device(self.device))
    }
    fn release(&self, h: u64) {
        if let Ok(mut m) = self.held.lock() {
            m.remove(&h);
        }
    }
}

struct SumKept(Arc<AtomicU64>);
impl EventSink for SumKept {
    fn on_event(&mut self, e: &Event) {
        if let EventKind::Pack { decision: PackDecision::Kept, reason: Some(r), bytes, .. } = &e.kind {
            if !matches!(r, KeepReason::Parameter | KeepReason::NotOnDevice) {
                self.0.fetch_add(*bytes, Ordering::Relaxed);
            }
        }
    }
}

enum Mode<'a> {
    Resident,
    Spilled(&'a ActivationRuntime),
    Naive,
}

/// Mean seconds per step (after one warm-up step) and the peak allocated bytes.
fn run(dev: &Device, model: &Model, x: &Tensor, steps: usize, mode: Mode<'_>) -> (f64, u64) {
    let mut times = Vec::new();
    let mut peak = 0;
    for step in 0..=steps {
        dev.synchronize().expect("sync");
        dev.reset_peak();
        let t0 = Instant::now();
        let rt = if let Mode::Spilled(rt) = mode { Some(rt) } else { None };
        if let Some(rt) = rt {
            rt.begin_step(step as u64 + 1);
        }
        let loss = {
            let _hooks = match &mode {
                Mode::Resident => None,
                Mode::Spilled(rt) => Some(Box::new(rt.managed_forward().expect("hooks")) as Box<dyn std::any::Any>),
                Mode::Naive => Some(Box::new(
                    SavedTensorHooks::enable(Arc::new(NaiveCpuStore {
                        device: dev.tch_device(),
                        next: AtomicU64::new(1),
                        held: Mutex::new(HashMap::new()),
                    }))
                    .expect("hooks"),
                ) as Box<dyn std::any::Any>),
            };
            model.forward(x, rt)
        };
        loss.backward();
        drop(loss);
        if let Some(rt) = rt {
            rt.end_step().expect("step end");
        }
        dev.synchronize().expect("sync");
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
        peak = peak.max(dev.memory().peak);
    }
    (times.iter().sum::<f64>() / times.len().max(1) as f64, peak)
}

fn main() {
    let dev = Device::auto(64 << 30);
    // Before the first backward of the process (see the hook engine's docs).
    stagehand::torch::hooks::install().expect("hook engine");
    let a = args(dev.is_cuda());
    println!(
        "device: {} | model: {} blocks, dim {}, {} tokens, fp32 | {} timed steps",
        dev.info().name,
        a.blocks,
        a.dim,
        a.tokens,
        a.steps
    );
    tch::manual_seed(0);
    let vs = nn::VarStore::new(dev.tch_device());
    let model = Model::new(&vs, &a);
    let x = Tensor::randn([a.tokens, a.dim], (Kind::Float, dev.tch_device()));

    let bw_bytes = if dev.is_cuda() { 256usize << 20 } else { 64 << 20 };
    let (_, bw) = common::pinned_bandwidth(&dev, bw_bytes).expect("pinned bandwidth");
    let (resident_s, resident_peak) = run(&dev, &model, &x, a.steps, Mode::Resident);

    // One counting step with spilling off: the bytes of activations autograd saves.
    let kept = Arc::new(AtomicU64::new(0));
    let hub = Arc::new(Hub::new());
    hub.add_sink(Box::new(SumKept(kept.clone())));
    let bus = Bus::with_hub(hub, 1 << 20);
    let never = ActivationConfig::builder()
        .watermarks_bytes(u64::MAX, u64::MAX - 1)
        .classes_mib(&[1])
        .slabs_per_class(&[1])
        .build()
        .expect("config");
    let counter = ActivationRuntime::new(dev.clone(), never, bus.clone(), None).expect("runtime");
    counter.register_parameters(vs.trainable_variables().iter());
    run(&dev, &model, &x, 0, Mode::Spilled(&counter));
    bus.flush();
    let act_bytes = kept.load(Ordering::Relaxed);
    drop(counter);

    // The budget: what resident training needs without activations, plus a fraction of them.
    let base = if dev.is_cuda() { resident_peak.saturating_sub(act_bytes) } else { 0 };
    let high = base + (act_bytes as f64 * a.budget_fraction) as u64;
    let low = base + (act_bytes as f64 * a.budget_fraction * 0.8) as u64;
    let t = (a.tokens * a.dim * 4) as u64;
    let slabs_small = ((act_bytes / t) as u32).max(4);
    let slabs_big = ((act_bytes / (4 * t)) as u32).max(4);
    let cfg = ActivationConfig::builder()
        .watermarks_bytes(high, low)
        .classes_bytes(&[t, 4 * t])
        .slabs_per_class(&[slabs_small, slabs_big])
        .min_spill_bytes(1 << 20)
        .max_inflight(4, 2)
        .restore_ahead(4, 8 * t)
        .keep_tail_groups(1)
        .telemetry(false)
        .build()
        .expect("config");
    let rt = ActivationRuntime::new(dev.clone(), cfg, Bus::disabled(), None).expect("runtime");
    rt.register_parameters(vs.trainable_variables().iter());
    let (spilled_s, spilled_peak) = run(&dev, &model, &x, a.steps, Mode::Spilled(&rt));
    let m = rt.last_step_metrics().unwrap_or_default();
    let (naive_s, naive_peak) = run(&dev, &model, &x, a.steps.min(2), Mode::Naive);

    let transfer_s = m.spill_bytes as f64 / bw;
    let ratio = spilled_s / resident_s.max(transfer_s);
    println!("activation bytes saved per step : {:.1} MB", act_bytes as f64 / MB);
    println!("budget (high / low watermark)   : {:.1} / {:.1} MB", high as f64 / MB, low as f64 / MB);
    println!("D2H bandwidth (pinned)          : {:.2} GB/s", bw / 1e9);
    println!("resident step                   : {:.1} ms, peak allocated {:.1} MB", resident_s * 1e3, resident_peak as f64 / MB);
    println!("spilled step                    : {:.1} ms, peak allocated {:.1} MB", spilled_s * 1e3, spilled_peak as f64 / MB);
    println!("naive save-on-cpu step          : {:.1} ms, peak allocated {:.1} MB ({:.2}x resident)", naive_s * 1e3, naive_peak as f64 / MB, naive_s / resident_s);
    println!(
        "bytes spilled per step          : {:.1} MB ({:.0}% of activation bytes), {} spilled, {} kept, {} predicted, {} stalls ({:.2} ms), pool hits/misses {}/{}",
        m.spill_bytes as f64 / MB,
        100.0 * m.spill_bytes as f64 / act_bytes.max(1) as f64,
        m.activations_spilled,
        m.activations_kept,
        m.activations_predicted,
        m.stall_count,
        m.stall_time_ms,
        m.pool_hits,
        m.pool_misses
    );
    println!("ratio spilled / max(resident, spilled bytes / bandwidth) = {ratio:.3}");
}
