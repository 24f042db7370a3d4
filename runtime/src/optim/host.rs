//! One streamed block's optimizer on the host: its parameters' host values, their host
//! gradients, and the optimizer state, stepped by the worker thread with libtorch's own
//! optimizer (bit-identical with `tch::nn`'s on the CPU) or libtorch's fused Adam kernel.

use super::stepper::Job;
use super::{Algorithm, Kernel};
use crate::error::{Error, Result};
use crate::torch::optim::{fused_adam, set_grad, AdamStep, FusedAdam};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::{COptimizer, Tensor};

/// The learning rate shared by the host optimizers and the device one (`set_lr` changes all).
#[derive(Debug, Default)]
pub(crate) struct SharedLr(AtomicU64);

impl SharedLr {
    pub(crate) fn new(lr: f64) -> Arc<SharedLr> {
        Arc::new(SharedLr(AtomicU64::new(lr.to_bits())))
    }
    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
    pub(crate) fn set(&self, lr: f64) {
        self.0.store(lr.to_bits(), Ordering::Relaxed)
    }
}

struct Fused {
    kind: FusedAdam,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    steps: Vec<Tensor>,
}

/// A block's host optimizer state.
pub(crate) struct BlockOptimizer {
    /// (host value, host gradient) of each trainable parameter, in the block's order.
    params: Vec<(Tensor, Tensor)>,
    exact: Option<(COptimizer, f64)>,
    fused: Option<Fused>,
    algorithm: Algorithm,
    lr: Arc<SharedLr>,
}

impl BlockOptimizer {
    pub(crate) fn new(
        params: Vec<(Tensor, Tensor)>,
        algorithm: Algorithm,
        kernel: Kernel,
        lr: Arc<SharedLr>,
    ) -> Result<BlockOptimizer> {
        let mut o = BlockOptimizer {
            params,
            exact: None,
            fused: None,
            algorithm,
            lr,
        };
        match (kernel, algorithm.fused()) {
            (Kernel::Fused, Some(kind)) => {
                let zeros = |v: &Vec<(Tensor, Tensor)>| -> Result<Vec<Tensor>> {
                    v.iter().map(|(p, _)| Ok(p.f_zeros_like()?)).collect()
                };
                o.fused = Some(Fused {
                    kind,
                    exp_avg: zeros(&o.params)?,
                    exp_avg_sq: zeros(&o.params)?,
                    steps: o
                        .params
                        .iter()
                        .map(|_| Ok(Tensor::f_zeros([], (tch::Kind::Float, tch::Device::Cpu))?))
                        .collect::<Result<_>>()?,
                });
            }
            (Kernel::Fused, None) => {
                return Err(Error::Config {
                    field: "kernel",
                    value: "fused".into(),
                    expected: format!("the exact kernel for {} (only Adam and AdamW have a fused one)", algorithm.name()),
                })
            }
            (Kernel::Exact, _) => {
                let lr = o.lr.get();
                let mut opt = algorithm.build(lr)?;
                for (p, _) in &mut o.params {
                    // libtorch's optimizers step leaves that require grad.
                    *p = p.set_requires_grad(true);
                    opt.add_parameters(p, 0)?;
                }
                o.exact = Some((opt, lr));
            }
        }
        Ok(o)
    }

    /// Steps the parameters whose gradient arrived (`received[i]`); the others are left alone,
    /// as libtorch does for a parameter without a gradient.
    pub(crate) fn step(&mut self, received: &[bool]) -> Result<()> {
        let lr = self.lr.get();
        if let Some((opt, at)) = &mut self.exact {
            if *at != lr {
                opt.set_learning_rate(lr)?;
                *at = lr;
            }
            for ((p, g), &got) in self.params.iter().zip(received) {
                set_grad(p, got.then_some(g))?;
            }
            tch::no_grad(|| opt.step())?;
            return Ok(());
        }
        let Some(f) = &self.fused else {
            return Err(Error::internal("a host optimizer with no kernel"));
        };
        let pick = |v: &[Tensor]| -> Vec<Tensor> {
            v.iter().zip(received).filter(|(_, &r)| r).map(|(t, _)| t.shallow_clone()).collect()
        };
        let values: Vec<Tensor> = self.params.iter().map(|(p, _)| p.shallow_clone()).collect();
        let grads: Vec<Tensor> = self.params.iter().map(|(_, g)| g.shallow_clone()).collect();
        let h = self.algorithm.adam_step(lr)?;
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
        })
    }
}

/// A queued step of one block.
pub(crate) struct BlockJob {
    pub(crate) state: Arc<Mutex<BlockOptimizer>>,
    pub(crate) received: Vec<bool>,
    /// Copies that must complete before the step touches the block's host memory (its
    /// gradients landing, a load still reading its weights).
    pub(crate) ready: Vec<crate::device::Event>,
}

impl Job for BlockJob {
    fn run(&mut self) -> Result<()> {
        for e in &self.ready {
            e.synchronize()?;
        }
        self.state.lock().unwrap_or_else(|p| p.into_inner()).step(&self.received)
    }
}

/// The step hyper-parameters of an Adam-family algorithm.
impl Algorithm {
    fn adam_step(&self, lr: f64) -> Result<AdamStep> {
        match *self {
            Algorithm::Adam { beta1, beta2, wd, eps, .. } | Algorithm::AdamW { beta1, beta2, wd, eps, .. } => Ok(AdamStep {
                lr,
                beta1,
                beta2,
                weight_decay: wd,
                eps,
            }),
            _ => Err(Error::internal("fused step of a non-Adam algorithm")),
        }
    }
}
