//! One streamed block's optimizer on the host: its parameters' host values, their host
//! gradients, their groups, and the optimizer state, stepped by the worker thread with libtorch's
//! own optimizer (bit-identical with `tch::nn`'s on the CPU) or libtorch's fused Adam kernel.

use super::groups::Groups;
use super::stepper::Job;
use super::{Algorithm, Kernel};
use crate::error::{Error, Result};
use crate::torch::optim::{fused_adam, set_grad, AdamStep, FusedAdam};
use crate::torch::{ParamState, TorchOptimizer};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Kind, Tensor};

/// One trainable parameter of a streamed block, as its host optimizer sees it.
pub(crate) struct HostParam {
    /// The VarStore path.
    pub name: String,
    /// A CPU view of its canonical value in the block's host copy.
    pub value: Tensor,
    /// A CPU view of its host gradient buffer.
    pub grad: Tensor,
    pub group: usize,
}

/// The fused kernel's state: moments and float32 step counters, one of each per parameter.
struct Fused {
    kind: FusedAdam,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: Vec<Tensor>,
}

/// A block's host optimizer state.
pub(crate) struct BlockOptimizer {
    params: Vec<HostParam>,
    exact: Option<TorchOptimizer>,
    fused: Option<Fused>,
    algorithm: Algorithm,
    /// The version of the group options the exact optimizer's were last copied from.
    applied: u64,
}

pub(crate) fn lock_groups(g: &Mutex<Groups>) -> MutexGuard<'_, Groups> {
    g.lock().unwrap_or_else(|p| p.into_inner())
}

impl BlockOptimizer {
    /// The optimizer of `params`; their groups' options are copied in at each step.
    pub(crate) fn new(params: Vec<HostParam>, algorithm: Algorithm, kernel: Kernel) -> Result<BlockOptimizer> {
        let mut o = BlockOptimizer {
            params,
            exact: None,
            fused: None,
            algorithm,
            applied: 0,
        };
        match (kernel, algorithm.fused()) {
            (Kernel::Fused, Some(kind)) => {
                let zeros = |v: &[HostParam]| -> Result<Vec<Tensor>> { v.iter().map(|p| Ok(p.value.f_zeros_like()?)).collect() };
                o.fused = Some(Fused {
                    kind,
                    exp_avg: zeros(&o.params)?,
                    exp_avg_sq: zeros(&o.params)?,
                    steps: o
                        .params
                        .iter()
                        .map(|_| Ok(Tensor::f_zeros([], (Kind::Float, tch::Device::Cpu))?))
                        .collect::<Result<_>>()?,
                });
            }
            (Kernel::Fused, None) => return Err(algorithm.no_fused_kernel()),
            (Kernel::Exact, _) => {
                // The learning rate is a placeholder: every group's options are set before a step.
                let mut opt = TorchOptimizer::new(&algorithm, 0.0)?;
                for p in &mut o.params {
                    // libtorch's optimizers step leaves that require grad.
                    p.value = p.value.set_requires_grad(true);
                    opt.add(&p.value, p.group)?;
                }
                o.exact = Some(opt);
            }
        }
        Ok(o)
    }

    /// The parameters, in the block's order.
    pub(crate) fn params(&self) -> &[HostParam] {
        &self.params
    }

    /// Steps the parameters whose gradient arrived (`received[i]`) with the group options
    /// `groups` (those in effect when the step was asked for); the others are left alone, as
    /// libtorch does for a parameter without a gradient.
    pub(crate) fn step(&mut self, received: &[bool], groups: &Groups) -> Result<()> {
        if let Some(opt) = &mut self.exact {
            if self.applied != groups.version() {
                for g in 0..opt.groups() {
                    let o = groups.get(g);
                    opt.set_group(g, o.lr, o.weight_decay, o.momentum)?;
                }
                self.applied = groups.version();
            }
            for (p, &got) in self.params.iter().zip(received) {
                set_grad(&p.value, got.then_some(&p.grad))?;
            }
            return tch::no_grad(|| opt.step());
        }
        let Some(f) = &self.fused else {
            return Err(Error::internal("a host optimizer with no kernel"));
        };
        let mut by_group: Vec<usize> = self.params.iter().map(|p| p.group).collect();
        by_group.sort_unstable();
        by_group.dedup();
        for g in by_group {
            let take = |i: usize| received.get(i).copied().unwrap_or(false) && self.params[i].group == g;
            let pick = |v: &[Tensor]| -> Vec<Tensor> {
                v.iter().enumerate().filter(|(i, _)| take(*i)).map(|(_, t)| t.shallow_clone()).collect()
            };
            let values: Vec<Tensor> = self.params.iter().map(|p| p.value.shallow_clone()).collect();
            let grads: Vec<Tensor> = self.params.iter().map(|p| p.grad.shallow_clone()).collect();
            let h = self.algorithm.adam_step(groups.get(g))?;
            tch::no_grad(|| {
                fused_adam(
                    f.kind,
                    &pick(&values),
                    &pick(&grads),
                    &pick(&f.exp_avg),
                    &pick(&f.exp_avg_sq),
                    &pick(&f.steps),
                    h,
                )
            })?;
        }
        Ok(())
    }

    /// Parameter `i`'s state (handles sharing it), `None` before its first step.
    pub(crate) fn state(&self, i: usize) -> Result<Option<ParamState>> {
        let p = self.params.get(i).ok_or_else(|| Error::internal(format!("host parameter {i} out of range")))?;
        if let Some(opt) = &self.exact {
            return opt.state(&p.value);
        }
        let f = self.fused.as_ref().ok_or_else(|| Error::internal("a host optimizer with no kernel"))?;
        let step = f.steps[i].f_double_value(&[])? as i64;
        Ok((step > 0).then(|| ParamState {
            step,
            tensors: [Some(f.exp_avg[i].shallow_clone()), Some(f.exp_avg_sq[i].shallow_clone()), None],
        }))
    }

    /// Replaces parameter `i`'s state (tensors already checked against the parameter).
    pub(crate) fn set_state(&mut self, i: usize, st: &ParamState) -> Result<()> {
        let p = self.params.get(i).ok_or_else(|| Error::internal(format!("host parameter {i} out of range")))?;
        if let Some(opt) = &mut self.exact {
            return opt.set_state(&p.value, st);
        }
        let f = self.fused.as_mut().ok_or_else(|| Error::internal("a host optimizer with no kernel"))?;
        let (Some(m), Some(v)) = (&st.tensors[0], &st.tensors[1]) else {
            return Err(Error::internal("fused Adam state without both moments"));
        };
        tch::no_grad(|| -> Result<()> {
            f.exp_avg[i].f_copy_(m)?;
            f.exp_avg_sq[i].f_copy_(v)?;
            let _ = f.steps[i].f_fill_(st.step as f64)?;
            Ok(())
        })
    }
}

/// A queued step of one block.
pub(crate) struct BlockJob {
    pub(crate) state: Arc<Mutex<BlockOptimizer>>,
    pub(crate) received: Vec<bool>,
    /// The group options when the step was queued: a later `set_lr` is for later steps, even
    /// though this one runs on the worker after it.
    pub(crate) groups: Groups,
    /// Copies that must complete before the step touches the block's host memory (its
    /// gradients landing, a load still reading its weights).
    pub(crate) ready: Vec<crate::device::StreamEvent>,
}

impl Job for BlockJob {
    fn run(&mut self) -> Result<()> {
        for e in &self.ready {
            e.synchronize()?;
        }
        self.state.lock().unwrap_or_else(|p| p.into_inner()).step(&self.received, &self.groups)
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
}
