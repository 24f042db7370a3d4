//! What the numeric guards cost: the same small transformer-shaped model trained through the
//! handle with guards off (the default) and on, interleaved, on CUDA where present and on the
//! host device otherwise. Prints the median step time of each, the difference, and how many
//! tensors the guards check a step (each one a few kernels, read once at the step's end).
//!
//! Run: `cargo bench -p stagehand-runtime --bench guards` (`GUARDS_STEPS`, `GUARDS_D` override
//! the steps per round and the width).

use stagehand::device::Device;
use stagehand::nn as snn;
use stagehand::Stagehand;
use tch::nn::Module;
use tch::{Kind, Tensor};

fn env(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Run {
    sh: Stagehand,
    layers: Vec<(snn::Linear, snn::Linear)>,
    opt: stagehand::optim::Optimizer,
}

fn run(guards: bool, d: i64, layers: i64) -> Run {
    let probe = Device::auto(1 << 30);
    let budget = if probe.is_cuda() { 8u64 << 30 } else { 1 << 30 };
    let device = if probe.is_cuda() { probe } else { Device::host(budget) };
    let sh = Stagehand::builder().budget_bytes(budget).device(device).guards(guards).build().expect("handle");
    tch::manual_seed(0);
    let r = sh.root();
    let layers = (0..layers)
        .map(|i| {
            let p = &r / "blocks" / i;
            (
                snn::linear(&p / "fc1", d, 4 * d, Default::default()),
                snn::linear(&p / "fc2", 4 * d, d, Default::default()),
            )
        })
        .collect();
    drop(r);
    let opt = sh.optimizer(tch::nn::AdamW::default(), 1e-4).expect("optimizer");
    Run { sh, layers, opt }
}

fn step(r: &mut Run, x: &Tensor) -> f64 {
    let layers = &r.layers;
    let rep = r
        .sh
        .train_step(&mut r.opt, || {
            layers
                .iter()
                .fold(x.shallow_clone(), |h, (a, b)| &h + b.forward(&a.forward(&h).gelu("none")))
                .square()
                .mean(Kind::Float)
        })
        .expect("step");
    assert!(rep.non_finite.is_none(), "a finite model");
    rep.step_ms
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    stagehand::torch::init();
    let (steps, d, layers) = (env("GUARDS_STEPS", 15) as usize, env("GUARDS_D", 128), 8);
    let mut off = run(false, d, layers);
    let mut on = run(true, d, layers);
    let x = Tensor::randn([16, 64, d], (Kind::Float, off.sh.device().tch_device()));
    // Warm-up: the first step traces the model and sizes the pools.
    step(&mut off, &x);
    step(&mut on, &x);
    // Alternating step by step, so a busy machine slows both alike.
    let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
    for i in 0..2 * steps {
        if i % 2 == 0 {
            t_off.push(step(&mut off, &x));
            t_on.push(step(&mut on, &x));
        } else {
            t_on.push(step(&mut on, &x));
            t_off.push(step(&mut off, &x));
        }
    }
    let (a, b) = (median(t_off), median(t_on));
    println!(
        "guards on {} ({} layers, d={d}, {} steps each, alternating)",
        on.sh.device().info().name,
        2 * layers,
        2 * steps
    );
    println!("  off  {a:8.3} ms/step (median)");
    println!("  on   {b:8.3} ms/step (median), {:+.1}% ; {} tensors checked a step", 100.0 * (b / a - 1.0), 2 * layers + 1 + 4 * layers);
    println!("  off: no guards armed where the hooks read them: {}", off.sh.weights().guards().get().is_none());
}
