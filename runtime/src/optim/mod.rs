//! One optimizer over every trainable variable of a model, whether Stagehand streams it or not,
//! with the surface tch users know: the configs (`nn::Sgd`, `nn::Adam`, `nn::AdamW`,
//! `nn::RmsProp`), `zero_grad`, `step`, `backward_step`, `backward_step_clip`,
//! `backward_step_clip_norm`, `clip_grad_value`, `clip_grad_norm`, `set_lr`, `set_momentum`,
//! `set_weight_decay` and their `_group` forms for the groups made with `Path::set_group`.
//!
//! - Streamed blocks are stepped **on the host**: their gradients reach host memory as backward
//!   leaves each block, and the weights' worker thread (`weights::stepper`) runs each block's
//!   step, a job this module makes, as soon as the optimizer is asked to, in the order the next
//!   forward needs them; the weight runtime does not load a block before its step has run, so
//!   the next forward overlaps the optimizer.
//! - Everything else (variables the runtime does not manage, blocks kept resident) is stepped
//!   **on its device** by libtorch's optimizer, exactly as `tch::nn::Optimizer` would.
//!
//! On the host, [`Kernel::Exact`] runs libtorch's own optimizer (bit-identical with `tch::nn`'s on
//! the CPU); [`Kernel::Fused`] runs libtorch's fused Adam/AdamW kernel (one vectorized pass over
//! each parameter, several times faster, equal within float rounding).
//!
//! The optimizer's state (moments, momentum buffers, step counts) and group options save to a
//! safetensors sidecar file ([`Optimizer::save_state`], format in [`state`]).

mod clip;
mod fit;
pub(crate) mod groups;
mod host;
pub mod kernel;
pub mod moments;
mod optimizer;
pub mod state;

pub use groups::GroupOptions;
pub use optimizer::Optimizer;

use crate::error::Error;
use crate::torch::optim::FusedAdam;
use crate::torch::{OptimizerClass, OptimizerOptions};

/// An optimizer algorithm with its hyper-parameters (tch's `nn::Sgd`, `nn::Adam`, `nn::AdamW`,
/// `nn::RmsProp` convert into it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    Sgd { momentum: f64, dampening: f64, wd: f64, nesterov: bool },
    Adam { beta1: f64, beta2: f64, wd: f64, eps: f64, amsgrad: bool },
    AdamW { beta1: f64, beta2: f64, wd: f64, eps: f64, amsgrad: bool },
    RmsProp { alpha: f64, eps: f64, wd: f64, momentum: f64, centered: bool },
}

impl From<tch::nn::Sgd> for Algorithm {
    fn from(c: tch::nn::Sgd) -> Self {
        Algorithm::Sgd { momentum: c.momentum, dampening: c.dampening, wd: c.wd, nesterov: c.nesterov }
    }
}

impl From<tch::nn::Adam> for Algorithm {
    fn from(c: tch::nn::Adam) -> Self {
        Algorithm::Adam { beta1: c.beta1, beta2: c.beta2, wd: c.wd, eps: c.eps, amsgrad: c.amsgrad }
    }
}

impl From<tch::nn::AdamW> for Algorithm {
    fn from(c: tch::nn::AdamW) -> Self {
        Algorithm::AdamW { beta1: c.beta1, beta2: c.beta2, wd: c.wd, eps: c.eps, amsgrad: c.amsgrad }
    }
}

impl From<tch::nn::RmsProp> for Algorithm {
    fn from(c: tch::nn::RmsProp) -> Self {
        Algorithm::RmsProp { alpha: c.alpha, eps: c.eps, wd: c.wd, momentum: c.momentum, centered: c.centered }
    }
}

impl Algorithm {
    /// The fused kernel for it, if libtorch has one.
    fn fused(&self) -> Option<FusedAdam> {
        match self {
            Algorithm::Adam { amsgrad: false, .. } => Some(FusedAdam::Adam),
            Algorithm::AdamW { amsgrad: false, .. } => Some(FusedAdam::AdamW),
            _ => None,
        }
    }

    fn no_fused_kernel(&self) -> Error {
        Error::Config {
            field: "kernel",
            value: "fused".into(),
            expected: format!(
                "the exact kernel for {} (only Adam and AdamW without amsgrad have a fused one)",
                self.name()
            ),
        }
    }

    /// "AdamW", "SGD", ...
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Sgd { .. } => "SGD",
            Algorithm::Adam { .. } => "Adam",
            Algorithm::AdamW { .. } => "AdamW",
            Algorithm::RmsProp { .. } => "RMSprop",
        }
    }

    /// libtorch's optimizer for this algorithm at learning rate `lr`, in the shim's terms.
    pub fn torch_options(&self, lr: f64) -> OptimizerOptions {
        let plain = OptimizerOptions {
            class: OptimizerClass::Sgd,
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
            alpha: 0.0,
            nesterov: false,
            amsgrad: false,
            centered: false,
        };
        match *self {
            Algorithm::Sgd { momentum, dampening, wd, nesterov } => {
                OptimizerOptions { momentum, dampening, weight_decay: wd, nesterov, ..plain }
            }
            Algorithm::Adam { beta1, beta2, wd, eps, amsgrad } => {
                OptimizerOptions { class: OptimizerClass::Adam, beta1, beta2, weight_decay: wd, eps, amsgrad, ..plain }
            }
            Algorithm::AdamW { beta1, beta2, wd, eps, amsgrad } => {
                OptimizerOptions { class: OptimizerClass::AdamW, beta1, beta2, weight_decay: wd, eps, amsgrad, ..plain }
            }
            Algorithm::RmsProp { alpha, eps, wd, momentum, centered } => {
                OptimizerOptions { class: OptimizerClass::RmsProp, alpha, eps, weight_decay: wd, momentum, centered, ..plain }
            }
        }
    }

    /// The options every group starts from at learning rate `lr`.
    pub fn group_defaults(&self, lr: f64) -> GroupOptions {
        let (weight_decay, momentum) = match *self {
            Algorithm::Sgd { momentum, wd, .. } | Algorithm::RmsProp { momentum, wd, .. } => (wd, momentum),
            Algorithm::Adam { beta1, wd, .. } | Algorithm::AdamW { beta1, wd, .. } => (wd, beta1),
        };
        GroupOptions { lr, weight_decay, momentum }
    }

    /// The names of a parameter's state tensors, in [`crate::torch::ParamState`]'s order
    /// (empty where the algorithm has none in that place).
    pub fn state_fields(&self) -> [&'static str; 3] {
        match self {
            Algorithm::Adam { .. } | Algorithm::AdamW { .. } => ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            Algorithm::Sgd { .. } => ["momentum_buffer", "", ""],
            Algorithm::RmsProp { .. } => ["square_avg", "momentum_buffer", "grad_avg"],
        }
    }

    /// Optimizer state bytes per trainable byte (2 for Adam's moments, 1 for SGD's momentum).
    pub fn state_factor(&self) -> u64 {
        match *self {
            Algorithm::Adam { amsgrad, .. } | Algorithm::AdamW { amsgrad, .. } => 2 + u64::from(amsgrad),
            Algorithm::Sgd { momentum, .. } => u64::from(momentum > 0.0),
            Algorithm::RmsProp { momentum, centered, .. } => 1 + u64::from(momentum > 0.0) + u64::from(centered),
        }
    }
}

/// How streamed blocks are stepped on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernel {
    /// libtorch's optimizer: bit-identical with `tch::nn`'s on the CPU.
    #[default]
    Exact,
    /// libtorch's fused Adam/AdamW kernel: one vectorized pass per parameter.
    Fused,
}

impl Kernel {
    /// Fused where the algorithm has a fused kernel and the weights train on a GPU (where the
    /// host step bounds the step time), exact otherwise.
    pub fn auto(algorithm: &Algorithm, cuda: bool) -> Kernel {
        if cuda && algorithm.fused().is_some() {
            Kernel::Fused
        } else {
            Kernel::Exact
        }
    }
}

/// Gradient clipping applied by every [`Optimizer::step`] (so also inside
/// `Stagehand::train_step`), the counterpart of tch's `backward_step_clip` (by value) and
/// `backward_step_clip_norm` (by total norm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradClip {
    /// Every gradient element clamped to `[-max, max]` (tch's `clip_grad_value`).
    Value(f64),
    /// Every gradient scaled so that their total 2-norm is at most `max` (tch's `clip_grad_norm`).
    Norm(f64),
}
