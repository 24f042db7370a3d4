//! Floors the benches measure their steps against, each term timed alone on this machine.

use stagehand::optim::kernel::{self, AdamHyper, Copy16, Grad};
use stagehand::optim::moments::StoredMoments;
use stagehand::torch::optim::{fused_adam, AdamStep, FusedAdam};
use stagehand::{Precision, StateStorage};
use std::time::Instant;
use tch::{Kind, Tensor};

/// One AdamW step of the handle's host kernel over `params` parameters in `chunks` tensors,
/// timed alone (best of three after a warm-up): the host optimizer's share of the floor. In
/// fp32 libtorch's fused kernel over float32 tensors; under 16-bit precisions Stagehand's mixed
/// kernel, as the handle runs it: 16-bit gradients in, float32 masters, the state in `storage`,
/// the 16-bit copy out.
pub fn host_optimizer_step_s(params: i64, chunks: i64, precision: Precision, storage: StateStorage) -> anyhow::Result<f64> {
    if precision.is_mixed() || storage != StateStorage::Fp32 {
        return mixed_kernel_step_s(params, chunks, precision, storage);
    }
    let per = (params / chunks.max(1)).max(1);
    let mk = |v: f64| (0..chunks).map(|_| Tensor::full([per], v, (Kind::Float, tch::Device::Cpu))).collect::<Vec<_>>();
    let (p, g, m, v) = (mk(0.1), mk(0.01), mk(0.0), mk(0.0));
    let s: Vec<Tensor> = (0..chunks).map(|_| Tensor::zeros([], (Kind::Float, tch::Device::Cpu))).collect();
    let h = AdamStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let mut best = f64::MAX;
    for i in 0..4 {
        let t0 = Instant::now();
        tch::no_grad(|| fused_adam(FusedAdam::AdamW, &p, &g, &m, &v, &s, h))?;
        if i > 0 {
            best = best.min(t0.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

fn mixed_kernel_step_s(params: i64, chunks: i64, precision: Precision, storage: StateStorage) -> anyhow::Result<f64> {
    let per = (params / chunks.max(1)).max(1) as usize;
    let n = chunks.max(1) as usize;
    let mut p: Vec<Vec<f32>> = (0..n).map(|_| vec![0.1; per]).collect();
    let g: Vec<Vec<u16>> = (0..n).map(|_| vec![kernel::f32_to_bf16(0.01); per]).collect();
    let g32: Vec<Vec<f32>> = if precision.is_mixed() { Vec::new() } else { (0..n).map(|_| vec![0.01; per]).collect() };
    let mut copy: Vec<Vec<u16>> = (0..n).map(|_| vec![0; if precision.is_mixed() { per } else { 0 }]).collect();
    let mut moments: Vec<StoredMoments> = (0..n).map(|_| StoredMoments::zeros(storage, per)).collect();
    let mut best = f64::MAX;
    for i in 0..4u64 {
        let h = AdamHyper { lr: 1e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8, decoupled: true, step: i + 1, grad_scale: 1.0 };
        let t0 = Instant::now();
        for c in 0..n {
            let grad = if precision.is_mixed() { Grad::Bf16(&g[c]) } else { Grad::F32(&g32[c]) };
            let out = if precision.is_mixed() { Copy16::Bf16(&mut copy[c]) } else { Copy16::None };
            kernel::adam(&mut p[c], grad, moments[c].moments(), out, &h, None).map_err(|e| anyhow::anyhow!("the mixed kernel: {e}"))?;
        }
        if i > 0 {
            best = best.min(t0.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}
