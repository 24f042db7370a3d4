//! The resident reference: the same GPT in plain tch, every weight, master and optimizer state on
//! the device, trained in the run's precision and micro-batches (or its forward and backward
//! alone, timed).

use super::{micro, Hooks, Summary, TrainConfig};
use crate::data::progression_batch;
use crate::gpt::{Gpt, TchLayers};
use anyhow::Result;
use stagehand::device::Device;
use stagehand::events::{Bus, EventKind, Phase, TrainStepMetrics};
use stagehand::Precision;
use std::time::Instant;
use tch::nn::{self, OptimizerConfig};

pub(super) fn train_resident(
    cfg: &TrainConfig,
    device: &Device,
    bus: &Bus,
    mut on_step: impl FnMut(u64, f64, f64),
    hooks: Hooks<'_>,
) -> Result<Summary> {
    tch::manual_seed(cfg.seed);
    // Built on the CPU, as the streamed model is, so both start from the same weights.
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Gpt::new(&TchLayers(vs.root()), cfg.model);
    vs.set_device(device.tch_device());
    let mut opt = ResidentOptimizer::new(&vs, cfg, device)?;
    let tf32 = (cfg.precision == Precision::Tf32 && device.is_cuda()).then(|| stagehand::torch::amp::set_tf32(true));
    let mut s = Summary::default();
    // On the host device plain tch's tensors are not counted in the simulated VRAM: there is
    // no reading to publish.
    let measured = device.is_cuda();
    for step in 1..=cfg.steps {
        if hooks.stopped() {
            s.stopped = true;
            break;
        }
        let t0 = Instant::now();
        device.reset_peak();
        bus.enter_phase(step, Phase::StepBegin);
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        opt.zero_grad()?;
        // Each micro-batch adds its share of the batch's mean loss to the gradients.
        let n = cfg.micro_batches;
        let mut loss_sum = tch::Tensor::zeros([], (tch::Kind::Double, device.tch_device()));
        for i in 0..n {
            bus.enter_phase(step, Phase::Forward);
            let loss = resident_loss(&model, cfg, device, &batch, i)?;
            bus.enter_phase(step, Phase::Backward);
            if n > 1 { &loss / n as f64 } else { loss.shallow_clone() }.backward();
            loss_sum += loss.detach().to_kind(tch::Kind::Double);
        }
        bus.enter_phase(step, Phase::Optimizer);
        opt.step()?;
        let loss_v = loss_sum.double_value(&[]) / n as f64;
        device.synchronize()?;
        bus.enter_phase(step, Phase::StepEnd);
        let dt = t0.elapsed().as_secs_f64();
        let mem = device.memory();
        if measured {
            bus.publish(EventKind::VramSample {
                allocated_bytes: mem.allocated,
                reserved_bytes: mem.reserved,
                peak_allocated_bytes: mem.peak,
            });
        }
        bus.publish(EventKind::TrainStep(TrainStepMetrics {
            loss: loss_v,
            step_time_s: dt,
            tokens: cfg.tokens(),
            vram_peak_bytes: mem.peak,
            ..Default::default()
        }));
        s.peak_bytes = s.peak_bytes.max(mem.peak);
        s.step_peaks.push(mem.peak);
        s.losses.push(loss_v);
        s.step_times.push(dt);
        s.steps = step;
        on_step(step, loss_v, dt);
    }
    bus.enter_phase(s.steps, Phase::Idle);
    bus.publish(EventKind::RunEnded { steps: s.steps });
    if let Some(was) = tf32 {
        stagehand::torch::amp::set_tf32(was);
    }
    Ok(s)
}

/// Micro-batch `i`'s loss through the resident model, under `cfg.precision`'s autocast.
fn resident_loss(model: &Gpt, cfg: &TrainConfig, device: &Device, batch: &crate::data::Batch, i: usize) -> Result<tch::Tensor> {
    let _autocast = match cfg.precision.compute_kind() {
        Some(k) => Some(stagehand::torch::amp::Autocast::enter(device.is_cuda(), k)?),
        None => None,
    };
    let n = cfg.micro_batches;
    Ok(Gpt::loss(&tch::nn::Module::forward(model, &micro(&batch.inputs, i, n)), &micro(&batch.targets, i, n)))
}

/// The resident run's optimizer: tch's AdamW over the model in fp32 and tf32; under 16-bit
/// precisions the standard recipe: the model's weights in 16 bits, float32 masters beside them
/// on the device, AdamW over the masters (libtorch's fused kernel on CUDA, its exact optimizer
/// on the host device, as the handle's host optimizer there), and the masters' rounding copied
/// back into the weights after each step.
enum ResidentOptimizer {
    Plain(nn::Optimizer),
    Mixed {
        weights: Vec<tch::Tensor>,
        master_list: Vec<tch::Tensor>,
        exact: Option<nn::Optimizer>,
        fused: Option<(Vec<tch::Tensor>, Vec<tch::Tensor>, Vec<tch::Tensor>)>,
        lr: f64,
    },
}

impl ResidentOptimizer {
    fn new(vs: &nn::VarStore, cfg: &TrainConfig, device: &Device) -> Result<ResidentOptimizer> {
        let Some(kind) = cfg.precision.compute_kind() else {
            return Ok(ResidentOptimizer::Plain(nn::AdamW::default().build(vs, cfg.learning_rate)?));
        };
        let masters = nn::VarStore::new(device.tch_device());
        let mut weights = Vec::new();
        let mut master_list = Vec::new();
        let mut named: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut w) in named {
            let m = masters.root().var_copy(&name.replace('.', "_"), &w);
            tch::no_grad(|| w.set_data(&w.to_kind(kind)));
            weights.push(w);
            master_list.push(m);
        }
        let (exact, fused) = if device.is_cuda() {
            let z = || master_list.iter().map(|m| m.zeros_like()).collect::<Vec<_>>();
            let steps = master_list.iter().map(|_| tch::Tensor::zeros([], (tch::Kind::Float, device.tch_device()))).collect();
            (None, Some((z(), z(), steps)))
        } else {
            (Some(nn::AdamW::default().build(&masters, cfg.learning_rate)?), None)
        };
        Ok(ResidentOptimizer::Mixed { weights, master_list, exact, fused, lr: cfg.learning_rate })
    }

    fn zero_grad(&mut self) -> Result<()> {
        match self {
            ResidentOptimizer::Plain(o) => o.zero_grad(),
            ResidentOptimizer::Mixed { weights, .. } => {
                for w in weights {
                    let mut g = w.grad();
                    if g.defined() {
                        let _ = g.zero_();
                    }
                }
            }
        }
        Ok(())
    }

    fn step(&mut self) -> Result<()> {
        match self {
            ResidentOptimizer::Plain(o) => o.step(),
            ResidentOptimizer::Mixed { weights, master_list, exact, fused, lr } => {
                for (w, m) in weights.iter().zip(master_list.iter()) {
                    let g = w.grad();
                    let g32 = if g.defined() { Some(g.to_kind(tch::Kind::Float)) } else { None };
                    stagehand::torch::optim::set_grad(m, g32.as_ref())?;
                }
                if let Some(o) = exact {
                    o.step();
                }
                if let Some((m1, m2, steps)) = fused {
                    let d = nn::AdamW::default();
                    let grads: Vec<tch::Tensor> = master_list.iter().map(|m| m.grad()).collect();
                    let h = stagehand::torch::optim::AdamStep { lr: *lr, beta1: d.beta1, beta2: d.beta2, weight_decay: d.wd, eps: d.eps };
                    tch::no_grad(|| stagehand::torch::optim::fused_adam(stagehand::torch::optim::FusedAdam::AdamW, master_list, &grads, m1, m2, steps, h))?;
                }
                tch::no_grad(|| {
                    for (w, m) in weights.iter().zip(master_list.iter()) {
                        w.detach().copy_(m);
                    }
                });
            }
        }
        Ok(())
    }
}

/// The resident model's forward and backward alone, no optimizer (for a model whose optimizer
/// does not fit on the device beside it): each step's wall time, the device synchronized at its
/// end. The model is in `cfg.precision`'s compute dtype under its autocast.
pub fn time_forward_backward(cfg: &TrainConfig, device: &Device) -> Result<Vec<f64>> {
    cfg.check(1)?;
    tch::manual_seed(cfg.seed);
    let vs = nn::VarStore::new(device.tch_device());
    let model = Gpt::new(&TchLayers(vs.root()), cfg.model);
    if let Some(kind) = cfg.precision.compute_kind() {
        tch::no_grad(|| {
            for (_, mut w) in vs.variables() {
                w.set_data(&w.to_kind(kind));
            }
        });
    }
    let mut times = Vec::new();
    for _ in 0..cfg.steps {
        let batch = progression_batch(cfg.batch, cfg.model.block_size, cfg.model.vocab, device.tch_device());
        let t0 = Instant::now();
        for (_, w) in vs.variables() {
            let mut g = w.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let n = cfg.micro_batches;
        for i in 0..n {
            let loss = resident_loss(&model, cfg, device, &batch, i)?;
            if n > 1 { &loss / n as f64 } else { loss }.backward();
        }
        device.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(times)
}

