//! One streamed block's optimizer on the host: its parameters' host values, their host
//! gradients, their groups, and the optimizer state, stepped by the worker thread.
//!
//! Three kernels, by what the block needs:
//! - **exact**: libtorch's own optimizer (bit-identical with `tch::nn`'s on the CPU), over
//!   float32 values; a 16-bit gradient is converted to a float32 scratch first and a 16-bit
//!   copy written after;
//! - **libtorch's fused Adam**: one vectorized pass, where every tensor is float32 and the state
//!   is float32 (the fp32 path, unchanged);
//! - **the mixed kernel** ([`super::kernel`]): one pass that reads 16-bit gradients, updates
//!   float32 masters and moments stored in float32, bfloat16 or 8 bits, and writes the 16-bit
//!   copy the next load streams.

use super::groups::Groups;
use super::kernel::{self, AdamHyper, Copy16, Grad};
use super::moments::StoredMoments;
use crate::weights::stepper::Job;
use super::{Algorithm, Kernel};
use crate::error::{Error, Result};
use crate::precision::StateStorage;
use crate::torch::optim::{fused_adam, set_grad, AdamStep, FusedAdam};
use crate::torch::{ParamState, TorchOptimizer};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Kind, Tensor};

/// One trainable parameter of a streamed block, as its host optimizer sees it.
pub(crate) struct HostParam {
    /// The VarStore path.
    pub name: String,
    /// A CPU tensor the update applies to: the float32 master, or the host copy itself.
    pub value: Tensor,
    /// A CPU view of its host gradient buffer (in the dtype the block streams in).
    pub grad: Tensor,
    /// The 16-bit host copy written from `value` after each update (`None`: `value` is it).
    pub copy: Option<Tensor>,
    pub group: usize,
}

/// libtorch's fused kernel's state: moments and float32 step counters, one of each per parameter.
struct Fused {
    kind: FusedAdam,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: Vec<Tensor>,
}


/// The mixed kernel's state.
struct Mixed {
    decoupled: bool,
    moments: Vec<StoredMoments>,
    /// Steps taken by each parameter.
    steps: Vec<u64>,
}

/// Which kernel steps the block, with its state.
enum Stepping {
    Exact {
        opt: TorchOptimizer,
        /// Float32 gradients handed to libtorch where the landed one is in another dtype or
        /// needs unscaling (made at the first such step).
        scratch: Vec<Option<Tensor>>,
    },
    Fused(Fused),
    Mixed(Mixed),
}

/// A block's host optimizer state.
pub(crate) struct BlockOptimizer {
    params: Vec<HostParam>,
    stepping: Stepping,
    algorithm: Algorithm,
    /// The version of the group options the exact optimizer's were last copied from.
    applied: u64,
}

pub(crate) fn lock_groups(g: &Mutex<Groups>) -> MutexGuard<'_, Groups> {
    g.lock().unwrap_or_else(|p| p.into_inner())
}

/// A CPU float32 tensor's elements.
///
/// # Safety
/// `t` must be a contiguous CPU tensor of `kind` whose memory nobody else touches while the
/// slice lives.
#[allow(clippy::mut_from_ref, reason = "a tensor is a handle to memory it does not borrow; the caller's contract above is what makes the slice exclusive")]
unsafe fn slice_mut<T>(t: &Tensor, kind: Kind) -> Result<&mut [T]> {
    if t.kind() != kind || t.device() != tch::Device::Cpu || !t.is_contiguous() || std::mem::size_of::<T>() != kind.elt_size_in_bytes() {
        return Err(Error::internal(format!("host optimizer: a {:?} {:?} tensor where a contiguous CPU {kind:?} one was expected", t.kind(), t.device())));
    }
    let n = t.numel();
    if n == 0 {
        return Ok(&mut []);
    }
    // SAFETY: the tensor holds `n` contiguous elements of `T`'s size (checked); the caller
    // guarantees exclusive access for the slice's life.
    Ok(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, n) })
}

impl BlockOptimizer {
    /// The optimizer of `params`; their groups' options are copied in at each step.
    pub(crate) fn new(params: Vec<HostParam>, algorithm: Algorithm, kernel: Kernel, storage: StateStorage) -> Result<BlockOptimizer> {
        let plain = params.iter().all(|p| p.copy.is_none() && p.value.kind() == Kind::Float && p.grad.kind() == Kind::Float);
        let stepping = match (kernel, algorithm.fused()) {
            (Kernel::Exact, _) if storage != StateStorage::Fp32 => return Err(algorithm.no_compressed_state(storage)),
            (Kernel::Fused, None) => return Err(algorithm.no_fused_kernel()),
            (Kernel::Fused, Some(kind)) if plain && storage == StateStorage::Fp32 => {
                let zeros = |v: &[HostParam]| -> Result<Vec<Tensor>> { v.iter().map(|p| Ok(p.value.f_zeros_like()?)).collect() };
                Stepping::Fused(Fused {
                    kind,
                    exp_avg: zeros(&params)?,
                    exp_avg_sq: zeros(&params)?,
                    steps: params.iter().map(|_| Ok(Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu))?)).collect::<Result<_>>()?,
                })
            }
            (Kernel::Fused, Some(kind)) => Stepping::Mixed(Mixed {
                decoupled: kind == FusedAdam::AdamW,
                moments: params.iter().map(|p| StoredMoments::zeros(storage, p.value.numel())).collect(),
                steps: vec![0; params.len()],
            }),
            (Kernel::Exact, _) => {
                // The learning rate is a placeholder: every group's options are set before a step.
                let mut opt = TorchOptimizer::new(&algorithm.torch_options(0.0))?;
                let mut params = params;
                for p in &mut params {
                    // libtorch's optimizers step leaves that require grad.
                    p.value = p.value.set_requires_grad(true);
                    opt.add(&p.value, p.group)?;
                }
                let n = params.len();
                return Ok(BlockOptimizer {
                    params,
                    stepping: Stepping::Exact { opt, scratch: (0..n).map(|_| None).collect() },
                    algorithm,
                    applied: 0,
                });
            }
        };
        Ok(BlockOptimizer { params, stepping, algorithm, applied: 0 })
    }

    /// The parameters, in the block's order.
    pub(crate) fn params(&self) -> &[HostParam] {
        &self.params
    }

    /// Steps the parameters whose gradient arrived (`received[i]`) with the group options
    /// `groups` (those in effect when the step was asked for); the others are left alone, as
    /// libtorch does for a parameter without a gradient. Gradients are multiplied by
    /// `grad_scale` first (1 / the loss scale under fp16). `pool`: the threads of the mixed
    /// kernel.
    pub(crate) fn step(&mut self, received: &[bool], groups: &Groups, grad_scale: f32, pool: Option<&rayon::ThreadPool>) -> Result<()> {
        let got = |i: usize| received.get(i).copied().unwrap_or(false);
        match &mut self.stepping {
            Stepping::Exact { opt, scratch } => {
                if self.applied != groups.version() {
                    for g in 0..opt.groups() {
                        let o = groups.get(g);
                        opt.set_group(g, o.lr, o.weight_decay, o.momentum)?;
                    }
                    self.applied = groups.version();
                }
                for (i, p) in self.params.iter().enumerate() {
                    if !got(i) {
                        set_grad(&p.value, None)?;
                        continue;
                    }
                    if p.grad.kind() == p.value.kind() && grad_scale == 1.0 {
                        set_grad(&p.value, Some(&p.grad))?;
                        continue;
                    }
                    let s = match &mut scratch[i] {
                        Some(s) => s,
                        None => scratch[i].insert(p.value.f_empty_like()?),
                    };
                    tch::no_grad(|| -> Result<()> {
                        s.f_copy_(&p.grad)?;
                        if grad_scale != 1.0 {
                            let _ = s.f_mul_scalar_(f64::from(grad_scale))?;
                        }
                        Ok(())
                    })?;
                    set_grad(&p.value, Some(s))?;
                }
                tch::no_grad(|| opt.step())?;
            }
            Stepping::Fused(f) => {
                if grad_scale != 1.0 {
                    return Err(Error::internal("a scaled gradient for libtorch's fused kernel"));
                }
                let mut by_group: Vec<usize> = self.params.iter().map(|p| p.group).collect();
                by_group.sort_unstable();
                by_group.dedup();
                for g in by_group {
                    let take = |i: usize| got(i) && self.params[i].group == g;
                    let pick = |v: &[Tensor]| -> Vec<Tensor> {
                        v.iter().enumerate().filter(|(i, _)| take(*i)).map(|(_, t)| t.shallow_clone()).collect()
                    };
                    let values: Vec<Tensor> = self.params.iter().map(|p| p.value.shallow_clone()).collect();
                    let grads: Vec<Tensor> = self.params.iter().map(|p| p.grad.shallow_clone()).collect();
                    let h = self.algorithm.adam_step(groups.get(g))?;
                    tch::no_grad(|| {
                        fused_adam(f.kind, &pick(&values), &pick(&grads), &pick(&f.exp_avg), &pick(&f.exp_avg_sq), &pick(&f.steps), h)
                    })?;
                }
                return Ok(());
            }
            Stepping::Mixed(mx) => {
                for (i, p) in self.params.iter().enumerate() {
                    if !got(i) {
                        continue;
                    }
                    let a = self.algorithm.adam_step(groups.get(p.group))?;
                    mx.steps[i] += 1;
                    let h = AdamHyper {
                        lr: a.lr,
                        beta1: a.beta1,
                        beta2: a.beta2,
                        weight_decay: a.weight_decay,
                        eps: a.eps,
                        decoupled: mx.decoupled,
                        step: mx.steps[i],
                        grad_scale,
                    };
                    // SAFETY: the worker holds this block's optimizer lock, the only writer of
                    // the master and the copy; the runtime guarantees no load reads the copy
                    // and no gradient copy writes the gradient while a step runs (its job waits
                    // for their events first).
                    unsafe {
                        let value = slice_mut::<f32>(&p.value, Kind::Float)?;
                        let grad = match p.grad.kind() {
                            Kind::Float => Grad::F32(slice_mut::<f32>(&p.grad, Kind::Float)?),
                            Kind::BFloat16 => Grad::Bf16(slice_mut::<u16>(&p.grad, Kind::BFloat16)?),
                            Kind::Half => Grad::F16(slice_mut::<u16>(&p.grad, Kind::Half)?),
                            k => return Err(Error::internal(format!("a {k:?} gradient for the mixed kernel"))),
                        };
                        let out = match &p.copy {
                            None => Copy16::None,
                            Some(c) => match c.kind() {
                                Kind::BFloat16 => Copy16::Bf16(slice_mut::<u16>(c, Kind::BFloat16)?),
                                Kind::Half => Copy16::F16(slice_mut::<u16>(c, Kind::Half)?),
                                k => return Err(Error::internal(format!("a {k:?} copy for the mixed kernel"))),
                            },
                        };
                        kernel::adam(value, grad, mx.moments[i].moments(), out, &h, pool).map_err(|e| Error::internal(e.to_string()))?;
                    }
                }
                return Ok(());
            }
        }
        // The exact kernel updated float32 values: their 16-bit copies follow.
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                if let (true, Some(c)) = (got(i), &p.copy) {
                    c.detach().f_copy_(&p.value)?;
                }
            }
            Ok(())
        })
    }

    /// Parameter `i`'s state (handles sharing it where the kernel keeps float32 tensors, a
    /// decoded copy otherwise), `None` before its first step.
    pub(crate) fn state(&self, i: usize) -> Result<Option<ParamState>> {
        let p = self.params.get(i).ok_or_else(|| Error::internal(format!("host parameter {i} out of range")))?;
        match &self.stepping {
            Stepping::Exact { opt, .. } => opt.state(&p.value),
            Stepping::Fused(f) => {
                let step = f.steps[i].f_double_value(&[])? as i64;
                Ok((step > 0).then(|| ParamState {
                    step,
                    tensors: [Some(f.exp_avg[i].shallow_clone()), Some(f.exp_avg_sq[i].shallow_clone()), None],
                }))
            }
            Stepping::Mixed(mx) => {
                if mx.steps[i] == 0 {
                    return Ok(None);
                }
                let (m, v) = mx.moments[i].decoded();
                let shape = p.value.size();
                Ok(Some(ParamState {
                    step: mx.steps[i] as i64,
                    tensors: [Some(Tensor::from_slice(&m).f_reshape(shape.as_slice())?), Some(Tensor::from_slice(&v).f_reshape(shape.as_slice())?), None],
                }))
            }
        }
    }

    /// Replaces parameter `i`'s state (tensors already checked against the parameter).
    pub(crate) fn set_state(&mut self, i: usize, st: &ParamState) -> Result<()> {
        let p = self.params.get(i).ok_or_else(|| Error::internal(format!("host parameter {i} out of range")))?;
        let (Some(m), Some(v)) = (&st.tensors[0], &st.tensors[1]) else {
            if let Stepping::Exact { opt, .. } = &mut self.stepping {
                return opt.set_state(&p.value, st);
            }
            return Err(Error::internal("fused Adam state without both moments"));
        };
        match &mut self.stepping {
            Stepping::Exact { opt, .. } => opt.set_state(&p.value, st),
            Stepping::Fused(f) => tch::no_grad(|| -> Result<()> {
                f.exp_avg[i].f_copy_(m)?;
                f.exp_avg_sq[i].f_copy_(v)?;
                let _ = f.steps[i].f_fill_(st.step as f64)?;
                Ok(())
            }),
            Stepping::Mixed(mx) => {
                let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(Vec::<f32>::try_from(t.f_to_kind(Kind::Float)?.f_flatten(0, -1)?)?) };
                let (m, v) = (flat(m)?, flat(v)?);
                if m.len() != p.value.numel() || v.len() != p.value.numel() {
                    return Err(Error::internal(format!("optimizer state of {} elements for a parameter of {}", m.len(), p.value.numel())));
                }
                mx.moments[i].encode(&m, &v);
                mx.steps[i] = u64::try_from(st.step).unwrap_or(0);
                Ok(())
            }
        }
    }
}

/// A queued step of one block.
pub(crate) struct BlockJob {
    pub(crate) state: Arc<Mutex<BlockOptimizer>>,
    pub(crate) received: Vec<bool>,
    /// The group options when the step was queued: a later `set_lr` is for later steps, even
    /// though this one runs on the worker after it.
    pub(crate) groups: Groups,
    /// What the gradients are multiplied by first (1 / the loss scale of the step).
    pub(crate) grad_scale: f32,
    /// What must complete before the step touches the block's host memory (its gradients
    /// landing and added up, a load still reading its weights).
    pub(crate) ready: Vec<crate::weights::stepper::Ready>,
}

impl Job for BlockJob {
    fn wait_ready(&mut self) -> Result<()> {
        for e in &self.ready {
            e.wait()?;
        }
        Ok(())
    }

    fn run(&mut self, pool: Option<&rayon::ThreadPool>) -> Result<()> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .step(&self.received, &self.groups, self.grad_scale, pool)
    }

    fn is_ready(&self) -> bool {
        self.ready.iter().all(|e| e.is_complete())
    }
}

impl Algorithm {
    /// The fused kernel's hyper-parameters for a group's options.
    fn adam_step(&self, o: super::GroupOptions) -> Result<AdamStep> {
        match *self {
            Algorithm::Adam { beta2, eps, .. } | Algorithm::AdamW { beta2, eps, .. } => Ok(AdamStep {
                lr: o.lr,
                beta1: o.momentum,
                beta2,
                weight_decay: o.weight_decay,
                eps,
            }),
            _ => Err(Error::internal("fused step of a non-Adam algorithm")),
        }
    }

    fn no_compressed_state(&self, storage: StateStorage) -> Error {
        Error::Config {
            field: "optimizer_state",
            value: storage.name().into(),
            expected: format!(
                "fp32 with the exact kernel, or the fused kernel with Adam or AdamW (the {} optimizer keeps its state in float32)",
                self.name()
            ),
        }
    }
}
