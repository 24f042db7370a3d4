//! What the host optimizer needs from libtorch beyond tch: pointing a parameter's `.grad` at a
//! buffer the runtime owns, and libtorch's fused Adam/AdamW kernels (one vectorized, multi-threaded
//! pass over each parameter instead of the dozen passes of the unfused optimizer).

use super::ffi;
use crate::error::{Error, Result};
use std::os::raw::c_char;
use tch::Tensor;
use torch_sys::C_tensor;

fn check(rc: i32, err: &[c_char], what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Internal(format!("{what}: {}", ffi::message(err))))
    }
}

/// Sets `param.grad` to `grad` (shared storage, no copy), or clears it with `None`.
pub fn set_grad(param: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let mut err = [0 as c_char; 1024];
    let g = grad.map_or(std::ptr::null(), |g| g.as_ptr());
    // SAFETY: both are live tensors; the shim assigns the grad field of `param`'s TensorImpl
    // (the handle itself is not written) and copies the `grad` handle, taking a reference.
    let rc = unsafe { ffi::stagehand_set_grad(param.as_ptr() as *mut C_tensor, g, err.as_mut_ptr(), err.len()) };
    check(rc, &err, "setting a gradient")
}

/// Sets how many threads libtorch's CPU kernels use when called from this thread, leaving every
/// other thread's count (and the process-wide default) as it is; `n` at least 1.
pub fn set_local_intra_op_threads(n: usize) {
    let n = n.clamp(1, i32::MAX as usize) as i32;
    // SAFETY: sets an OpenMP per-thread setting; no memory is passed.
    unsafe { ffi::stagehand_set_local_intra_op_threads(n) }
}

/// Which of libtorch's fused Adam kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedAdam {
    /// L2 weight decay added to the gradient.
    Adam,
    /// Decoupled weight decay.
    AdamW,
}

/// Hyper-parameters of one fused Adam step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One fused Adam(W) step over parallel lists: parameters, their gradients, first and second
/// moments, and float32 step counters (incremented by the kernel).
pub fn fused_adam(
    kind: FusedAdam,
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    h: AdamStep,
) -> Result<()> {
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().any(|&l| l != n) {
        return Err(Error::internal("fused Adam: lists of different lengths"));
    }
    if n == 0 {
        return Ok(());
    }
    let ptrs = |v: &[Tensor]| v.iter().map(|t| t.as_ptr() as *mut C_tensor).collect::<Vec<_>>();
    let (p, g, m, v, s) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs), ptrs(steps));
    let mut err = [0 as c_char; 1024];
    // SAFETY: five arrays of `n` live tensors each; the kernel updates params, moments and steps
    // in place and reads the gradients.
    let rc = unsafe {
        ffi::stagehand_fused_adam(
            i32::from(kind == FusedAdam::AdamW),
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            0,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    check(rc, &err, "fused Adam step")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, nn::OptimizerConfig};

    #[test]
    fn a_set_gradient_is_what_the_optimizer_steps_with() {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var("w", &[4], tch::nn::Init::Const(1.0));
        let mut opt = tch::nn::Sgd::default().build(&vs, 0.5).expect("sgd");
        let g = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        set_grad(&w, Some(&g)).expect("set");
        opt.step();
        let got = Vec::<f32>::try_from(&w).expect("values");
        assert_eq!(got, [0.5, 0.0, -0.5, -1.0]);
        set_grad(&w, None).expect("clear");
        assert!(!w.grad().defined());
    }

    #[test]
    fn fused_adamw_matches_libtorchs_adamw_closely() {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var("w", &[1000], tch::nn::Init::Const(0.3));
        let mut opt = tch::nn::AdamW::default().build(&vs, 1e-2).expect("adamw");
        let p = Tensor::full([1000], 0.3, (Kind::Float, tch::Device::Cpu));
        let (m, v) = (p.zeros_like(), p.zeros_like());
        let s = Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
        let d = tch::nn::AdamW::default();
        for i in 0..5 {
            let g = Tensor::arange(1000, (Kind::Float, tch::Device::Cpu)) * (0.001 * (i + 1) as f64);
            set_grad(&w, Some(&g)).expect("set");
            opt.step();
            let h = AdamStep { lr: 1e-2, beta1: d.beta1, beta2: d.beta2, weight_decay: d.wd, eps: d.eps };
            fused_adam(FusedAdam::AdamW, &[p.shallow_clone()], &[g], &[m.shallow_clone()], &[v.shallow_clone()], &[s.shallow_clone()], h)
                .expect("fused step");
        }
        let diff = (&p - w.detach()).abs().max().double_value(&[]);
        assert!(p.allclose(&w.detach(), 1e-6, 1e-7, false), "fused and unfused AdamW differ by {diff}: {:?} vs {:?}", p.get(999), w.get(999));
        assert_eq!(s.double_value(&[]), 5.0);
    }
}
