//! libtorch's fused attention kernels called by name, which tch does not bind.
//!
//! `Tensor::scaled_dot_product_attention` lets libtorch's dispatcher pick a backend per call,
//! from the inputs and from global and per-thread switches, so the same call can run one kernel
//! in the forward and another when backward's thread recomputes it; a recompute scope refuses a
//! recomputation that saves other tensors than the forward did. Calling a kernel by name keeps
//! both the same. tch binds only the memory-efficient kernel's forward
//! (`Tensor::internal_scaled_dot_product_efficient_attention`); these are the faster two on
//! current GPUs (on an H100 at a 6.5 B GPT's shape, forward and backward: cuDNN 2.7 ms, flash
//! 4.4, memory-efficient 8.3; docs/benchmarks.md).

use super::ffi;
use crate::error::{Error, HookError, Result};
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;
use tch::{Kind, Tensor};

/// A fused attention kernel of libtorch's CUDA build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// FlashAttention-2 (compute capability 8.0 or later, head dims up to 256).
    Flash,
    /// cuDNN's fused attention (its own limits, by cuDNN version and GPU). Its backward is not
    /// bitwise reproducible from run to run (on an H100, losses of two runs of the 1.21 B main
    /// job differed by up to 8.1e-4 over 8 steps, where the memory-efficient kernel's repeated).
    Cudnn,
}

/// Causal (or full) attention over `(batch, heads, time, head dim)` query, key and value with
/// one fused kernel, scaled by 1/sqrt(head dim), without dropout, recorded for autograd. CUDA
/// tensors in bfloat16 or float16 only: anything the kernel does not take is an error with
/// libtorch's reason, never another kernel.
pub fn fused_attention(kernel: AttentionKernel, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let code = match kernel {
        AttentionKernel::Flash => 0,
        AttentionKernel::Cudnn => 1,
    };
    let mut err = [0 as c_char; 1024];
    // SAFETY: three live tensors borrowed for the call and an error buffer of its length; the
    // shim returns a new tensor handle or null.
    let out = unsafe {
        ffi::stagehand_fused_attention(code, q.as_ptr(), k.as_ptr(), v.as_ptr(), c_int::from(causal), err.as_mut_ptr(), err.len())
    };
    if out.is_null() {
        return Err(Error::Torch(tch::TchError::Torch(format!("{kernel:?} attention: {}", ffi::message(&err)))));
    }
    // SAFETY: a tensor the shim allocated for us, owned from here.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// The fused kernels [`fixed_kernel_attention`] tries on CUDA, fastest first.
const KERNELS: [AttentionKernel; 2] = [AttentionKernel::Cudnn, AttentionKernel::Flash];

/// Attention that runs one kernel for every call of the same device, dtype, shape and
/// causality, forward or recomputation on another thread: on CUDA the first of cuDNN's and flash
/// attention that takes the inputs, else the memory-efficient kernel; on the host, libtorch's
/// `scaled_dot_product_attention` (its choice there follows the inputs alone). Which kernel
/// runs is learnt from the first such call and kept for the process. `(batch, heads, time, head
/// dim)` inputs, scaled by 1/sqrt(head dim), no dropout.
pub fn fixed_kernel_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    /// A call's device index, dtype, query shape and causality, and the kernel it got (`None`:
    /// memory-efficient).
    type Choice = ((usize, Kind, Vec<i64>, bool), Option<AttentionKernel>);
    static CHOSEN: Mutex<Vec<Choice>> = Mutex::new(Vec::new());
    let tch::Device::Cuda(index) = q.device() else {
        return Ok(Tensor::f_scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, causal, None, false)?);
    };
    let efficient = || -> Result<Tensor> {
        Ok(Tensor::f_internal_scaled_dot_product_efficient_attention(q, k, v, None::<&Tensor>, true, 0.0, causal, None)?.0)
    };
    let key = (index, q.f_kind()?, q.size(), causal);
    let known = |chosen: &[Choice]| chosen.iter().find(|(known, _)| *known == key).map(|&(_, kernel)| kernel);
    let found = known(&CHOSEN.lock().unwrap_or_else(|e| e.into_inner()));
    let kernel = match found {
        Some(kernel) => kernel,
        None => {
            // Tried without the lock held (a trial runs a backward); where two threads tried
            // the same call at once, the first choice recorded is everyone's.
            let runs = KERNELS.iter().copied().find(|&kernel| trains(kernel, q, k, v, causal));
            let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
            known(&chosen).unwrap_or_else(|| {
                chosen.push((key.clone(), runs));
                runs
            })
        }
    };
    match kernel {
        Some(kernel) => fused_attention(kernel, q, k, v, causal),
        None => efficient(),
    }
}

/// Whether `kernel` takes these inputs forward and backward: run on detached aliases of their
/// first sequence (the same storage, layout and shape but the batch, so that the trial's memory
/// is a sequence's), with the saved-tensor hooks off, since a recompute scope's forward would
/// otherwise count the trial's saves as its own (autograd saves an operation's inputs before its
/// kernel can refuse them), and with a gradient laid out as a GPT block's projection sends it.
fn trains(kernel: AttentionKernel, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> bool {
    super::hooks::outside_hooks("trying an attention kernel", || {
        let _grad = super::grad_mode::GradMode::set(true);
        let leaves = [q, k, v].iter().map(|t| Ok(t.f_narrow(0, 0, 1)?.detach().set_requires_grad(true))).collect::<std::result::Result<Vec<Tensor>, HookError>>()?;
        let y = fused_attention(kernel, &leaves[0], &leaves[1], &leaves[2], causal).map_err(|e| -> HookError { Box::new(e) })?;
        let out = y.f_transpose(1, 2)?.f_contiguous()?;
        let weights = out.f_ones_like()?;
        let loss = (&out * &weights).f_sum(Kind::Float)?;
        let grads = Tensor::f_run_backward(&[loss], &leaves, false, false)?;
        Ok(grads.len() == 3)
    })
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// On the host it is libtorch's own attention, to the bit.
    #[test]
    fn on_the_host_the_fixed_kernel_is_libtorchs_attention() {
        let q = Tensor::randn([2, 3, 16, 8], (Kind::Float, Device::Cpu));
        let k = Tensor::randn([2, 3, 16, 8], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([2, 3, 16, 8], (Kind::Float, Device::Cpu));
        for causal in [true, false] {
            let want = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, causal, None, false);
            let got = fixed_kernel_attention(&q, &k, &v, causal).expect("attention");
            assert!(got.equal(&want), "causal {causal}");
        }
    }

    #[test]
    fn host_tensors_are_refused_with_the_reason() {
        let q = Tensor::randn([1, 2, 8, 16], (Kind::BFloat16, Device::Cpu));
        for kernel in [AttentionKernel::Flash, AttentionKernel::Cudnn] {
            let e = fused_attention(kernel, &q, &q, &q, true).expect_err("the fused kernels are CUDA's");
            assert!(e.to_string().contains(&format!("{kernel:?} attention")), "{e}");
        }
    }

    /// Counts the tensors autograd saves while it is the thread's store.
    struct Counting(std::sync::atomic::AtomicU64);

    impl crate::torch::SavedTensorStore for Counting {
        fn pack(&self, _: Tensor) -> std::result::Result<u64, HookError> {
            Ok(self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        }
        fn unpack(&self, handle: u64) -> std::result::Result<Tensor, HookError> {
            Err(format!("never unpacked ({handle})").into())
        }
        fn release(&self, _: u64) {}
    }

    /// A kernel that refuses its inputs does so after autograd saved them (on the host, where
    /// both fused kernels refuse every input): the trial of a kernel saves nothing into the
    /// thread's store, so a recompute scope open around it counts nothing of it.
    #[test]
    fn trying_a_kernel_saves_nothing_where_calling_it_would() {
        let store = std::sync::Arc::new(Counting(0.into()));
        let _hooks = crate::torch::SavedTensorHooks::enable(store.clone()).expect("hooks");
        let q = Tensor::randn([1, 2, 8, 16], (Kind::BFloat16, Device::Cpu)).set_requires_grad(true);
        let saved = || store.0.load(std::sync::atomic::Ordering::Relaxed);
        assert!(!trains(AttentionKernel::Cudnn, &q, &q, &q, true), "the host has no fused kernel");
        assert_eq!(saved(), 0, "the trial saved nothing");
        assert!(fused_attention(AttentionKernel::Cudnn, &q, &q, &q, true).is_err());
        assert!(saved() > 0, "a refused call saves its inputs first: the hazard the trial avoids");
    }

    /// On CUDA: the same values and gradients as the memory-efficient kernel, within bf16's
    /// rounding, causal and not (the two differ, so the flag reaches the kernel), for q, k and v
    /// that are strided views of one projection, as a GPT block makes them.
    #[test]
    fn on_cuda_each_computes_what_the_efficient_kernel_does_forward_and_backward() {
        crate::torch::init();
        if !crate::torch::cuda_available() {
            return;
        }
        let opts = (Kind::BFloat16, Device::Cuda(0));
        let (b, h, t, hd) = (2, 4, 256, 64);
        let qkv = Tensor::randn([b, t, 3, h, hd], opts).set_requires_grad(true);
        let g = Tensor::randn([b, h, t, hd], opts);
        let run = |kernel: Option<AttentionKernel>, causal: bool| {
            let part = |i: i64| qkv.select(2, i).transpose(1, 2);
            let (q, k, v) = (part(0), part(1), part(2));
            let y = match kernel {
                Some(kernel) => fused_attention(kernel, &q, &k, &v, causal).expect("a fused kernel on CUDA"),
                None => Tensor::internal_scaled_dot_product_efficient_attention(&q, &k, &v, None::<&Tensor>, true, 0.0, causal, None).0,
            };
            let grad = Tensor::run_backward(&[(&y * &g).sum(Kind::Float)], &[&qkv], false, false);
            (y.to_kind(Kind::Float), grad[0].to_kind(Kind::Float))
        };
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) <= 3e-2 * (1.0 + b.abs().max().double_value(&[]));
        for kernel in [AttentionKernel::Flash, AttentionKernel::Cudnn] {
            for causal in [true, false] {
                let (y, dy) = run(Some(kernel), causal);
                let (ye, dye) = run(None, causal);
                assert!(close(&y, &ye), "{kernel:?}: outputs differ (causal {causal})");
                assert!(close(&dy, &dye), "{kernel:?}: gradients differ (causal {causal})");
            }
            let (causal, _) = run(Some(kernel), true);
            let (full, _) = run(Some(kernel), false);
            assert!(!close(&causal, &full), "{kernel:?}: the causal flag made no difference");
        }
        // The fixed kernel: one of them (an H100 takes cuDNN's), the same values call after call.
        let part = |i: i64| qkv.select(2, i).transpose(1, 2).detach();
        let (q, k, v) = (part(0), part(1), part(2));
        let first = fixed_kernel_attention(&q, &k, &v, true).expect("fixed");
        let again = fixed_kernel_attention(&q, &k, &v, true).expect("fixed again");
        assert!(close(&first.to_kind(Kind::Float), &run(None, true).0), "the fixed kernel computes attention");
        assert!(first.equal(&again), "the same kernel, the same values");
    }
}
