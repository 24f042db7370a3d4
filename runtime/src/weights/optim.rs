//! Offloaded AdamW: steps the host copies of trainable streamed weights with libtorch's own
//! AdamW (the kernel behind `tch::nn::AdamW`, so the arithmetic is identical), with gradients
//! and optimizer state in host memory.

use super::WeightRuntime;
use crate::error::Result;
use tch::COptimizer;

/// AdamW over the host copies of a runtime's trainable weights.
pub struct OffloadedAdamW {
    // Field order: the optimizer (which references the host tensors) drops before the runtime
    // handle that keeps their memory alive.
    opt: COptimizer,
    rt: WeightRuntime,
}

impl std::fmt::Debug for OffloadedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadedAdamW").finish_non_exhaustive()
    }
}

impl OffloadedAdamW {
    /// AdamW with `tch::nn::AdamW`'s settings over every trainable managed parameter.
    pub fn new(rt: &WeightRuntime, lr: f64, cfg: tch::nn::AdamW) -> Result<OffloadedAdamW> {
        let mut opt = COptimizer::adamw(lr, cfg.beta1, cfg.beta2, cfg.wd, cfg.eps, cfg.amsgrad)?;
        for t in rt.trainable_host_params() {
            opt.add_parameters(&t, 0)?;
        }
        Ok(OffloadedAdamW {
            opt,
            rt: rt.clone(),
        })
    }

    /// Collects gradients to the host, then steps.
    pub fn step(&mut self) -> Result<()> {
        self.rt.collect_grads()?;
        self.opt.step()?;
        Ok(())
    }

    /// Zeroes the host gradients (and flushes device ones first, so none survive).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.rt.collect_grads()?;
        self.rt.zero_grads()
    }

    /// Sets the learning rate.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.opt.set_learning_rate(lr)?;
        Ok(())
    }
}
