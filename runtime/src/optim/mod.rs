//! One optimizer over every trainable variable of a model, whether Stagehand streams it or not,
//! with the surface tch users know (`zero_grad`, `step`, `backward_step`, `clip_grad_norm`,
//! `set_lr`).
//!
//! - Streamed blocks are stepped **on the host**: their gradients reach host memory as backward
//!   leaves each block, and a worker thread ([`stepper`]) steps each block as soon as the
//!   optimizer is asked to, in the order the next forward needs them; the weight runtime does not
//!   load a block before its step has run, so the next forward overlaps the optimizer.
//! - Everything else (variables the runtime does not manage, blocks kept resident) is stepped
//!   **on its device** by libtorch's optimizer, exactly as `tch::nn::Optimizer` would.
//!
//! On the host, [`Kernel::Exact`] runs libtorch's own optimizer (bit-identical with `tch::nn`'s on
//! the CPU); [`Kernel::Fused`] runs libtorch's fused Adam/AdamW kernel (one vectorized pass over
//! each parameter, several times faster, equal within float rounding).

mod host;
pub(crate) mod stepper;

use crate::error::{Error, Result};
use crate::torch::optim::FusedAdam;
use crate::weights::WeightRuntime;
use host::{BlockJob, BlockOptimizer, SharedLr};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use stepper::Stepper;
use tch::{COptimizer, Tensor};

/// The maker of host steps the weight runtime calls, over the blocks' optimizer states.
fn job_maker(host: Arc<HashMap<u32, Arc<Mutex<BlockOptimizer>>>>) -> stepper::JobMaker {
    Box::new(move |id, received, ready| {
        let state = host
            .get(&id.0)
            .ok_or_else(|| Error::internal(format!("block {id} trains but has no host optimizer")))?;
        Ok(Box::new(BlockJob {
            state: state.clone(),
            received: received.to_vec(),
            ready,
        }) as Box<dyn stepper::Job>)
    })
}

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
    /// libtorch's optimizer for it, the one `tch::nn::OptimizerConfig::build` makes.
    pub(crate) fn build(&self, lr: f64) -> Result<COptimizer> {
        Ok(match *self {
            Algorithm::Sgd { momentum, dampening, wd, nesterov } => COptimizer::sgd(lr, momentum, dampening, wd, nesterov)?,
            Algorithm::Adam { beta1, beta2, wd, eps, amsgrad } => COptimizer::adam(lr, beta1, beta2, wd, eps, amsgrad)?,
            Algorithm::AdamW { beta1, beta2, wd, eps, amsgrad } => COptimizer::adamw(lr, beta1, beta2, wd, eps, amsgrad)?,
            Algorithm::RmsProp { alpha, eps, wd, momentum, centered } => {
                COptimizer::rms_prop(lr, alpha, eps, wd, momentum, centered)?
            }
        })
    }

    /// The fused kernel for it, if libtorch has one.
    fn fused(&self) -> Option<FusedAdam> {
        match self {
            Algorithm::Adam { amsgrad: false, .. } => Some(FusedAdam::Adam),
            Algorithm::AdamW { amsgrad: false, .. } => Some(FusedAdam::AdamW),
            _ => None,
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

/// The optimizer over a model's streamed and unstreamed trainable variables.
///
/// Blocks registered after it was made (layer mode registers blocks when the model first runs)
/// get their host optimizer at the first step that sees them; the device optimizer is made at the
/// first step, once the resident blocks are known.
pub struct Optimizer {
    // Field order: host state (which views the runtime's host memory) drops before the runtime.
    host: Arc<HashMap<u32, Arc<Mutex<BlockOptimizer>>>>,
    device: Option<COptimizer>,
    device_params: Vec<Tensor>,
    unmanaged: Vec<Tensor>,
    stepper: Arc<Stepper>,
    lr: Arc<SharedLr>,
    algorithm: Algorithm,
    kernel: Kernel,
    rt: WeightRuntime,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("algorithm", &self.algorithm)
            .field("host_blocks", &self.host.len())
            .field("device_params", &self.device_params.len())
            .finish()
    }
}

impl Optimizer {
    /// An optimizer over `rt`'s trained blocks and the trainable variables in `unmanaged` (those
    /// the runtime does not stream, e.g. layer norms; give every one of them, or they do not
    /// train).
    pub fn new(
        rt: &WeightRuntime,
        unmanaged: Vec<Tensor>,
        algorithm: impl Into<Algorithm>,
        lr: f64,
        kernel: Kernel,
    ) -> Result<Optimizer> {
        let algorithm = algorithm.into();
        if kernel == Kernel::Fused && algorithm.fused().is_none() {
            return Err(Error::Config {
                field: "kernel",
                value: "fused".into(),
                expected: format!("the exact kernel for {} (only Adam and AdamW have a fused one)", algorithm.name()),
            });
        }
        let stepper = Arc::new(Stepper::new()?);
        rt.lock().attach_stepper(stepper.clone())?;
        Ok(Optimizer {
            host: Arc::new(HashMap::new()),
            device: None,
            device_params: Vec::new(),
            unmanaged: unmanaged.into_iter().filter(|t| t.requires_grad()).collect(),
            stepper,
            lr: SharedLr::new(lr),
            algorithm,
            kernel,
            rt: rt.clone(),
        })
    }

    /// Makes the host optimizers of trained blocks that have none yet, and the device
    /// optimizer once.
    fn ensure_built(&mut self) -> Result<()> {
        let (streamed, resident) = self.rt.lock().trained();
        for id in streamed {
            if self.host.contains_key(&id.0) {
                continue;
            }
            let hp = self.rt.lock().host_params(id)?;
            let params = hp
                .params
                .into_iter()
                .map(|(_, v, g)| g.map(|g| (v, g)).ok_or_else(|| Error::internal("a trained parameter without a host gradient")))
                .collect::<Result<Vec<_>>>()?;
            let state = BlockOptimizer::new(params, self.algorithm, self.kernel, self.lr.clone())?;
            Arc::make_mut(&mut self.host).insert(id.0, Arc::new(Mutex::new(state)));
        }
        if self.device.is_none() {
            self.device_params = resident.into_iter().chain(self.unmanaged.iter().map(|t| t.shallow_clone())).collect();
            if !self.device_params.is_empty() {
                let mut opt = self.algorithm.build(self.lr.get())?;
                for p in &self.device_params {
                    opt.add_parameters(p, 0)?;
                }
                self.device = Some(opt);
            }
        }
        Ok(())
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Clears every gradient (libtorch's `zero_grad(set_to_none)`): device gradients go, the next
    /// gradient of a streamed parameter replaces its host gradient. Never evicts a block.
    pub fn zero_grad(&mut self) -> Result<()> {
        match &self.device {
            Some(d) => d.zero_grad()?,
            None => {
                for p in &self.unmanaged {
                    crate::torch::optim::set_grad(p, None)?;
                }
            }
        }
        self.rt.zero_grads()
    }

    /// Steps every trainable variable: device ones now, streamed blocks on the host worker in
    /// the order the next forward needs them (it returns before they finish; a block is not
    /// loaded before its step has run).
    pub fn step(&mut self) -> Result<()> {
        self.ensure_built()?;
        if let Some(d) = &self.device {
            d.step()?;
        }
        let mut make = job_maker(self.host.clone());
        self.rt.lock().submit_updates(|id, received, ready| make(id, received, ready))
    }

    /// Declares that an optimizer step follows the next backward: the host steps of streamed
    /// blocks then start while backward is still running (each as soon as backward has left
    /// its block), instead of when [`step`](Self::step) is called. `step` must follow.
    pub fn overlap_next_backward(&mut self) -> Result<()> {
        self.ensure_built()?;
        self.rt.lock().arm_updates(job_maker(self.host.clone()))
    }

    /// `zero_grad`, `backward` of `loss`, `step` (tch's `backward_step`), with the host steps
    /// overlapping the backward.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad()?;
        self.overlap_next_backward()?;
        loss.f_backward()?;
        self.rt.after_backward()?;
        self.step()
    }

    /// `zero_grad`, `backward`, gradients clipped to a total norm of `max`, `step`.
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) -> Result<()> {
        self.zero_grad()?;
        loss.f_backward()?;
        self.clip_grad_norm(max)?;
        self.step()
    }

    /// Scales every gradient so that their total 2-norm is at most `max` (tch's
    /// `clip_grad_norm`); returns the norm before clipping. Waits for streamed gradients to
    /// reach the host.
    pub fn clip_grad_norm(&mut self, max: f64) -> Result<f64> {
        self.ensure_built()?;
        self.rt.collect_grads()?;
        let grads = self.gradients()?;
        let mut total = 0f64;
        for g in &grads {
            let n = g.f_norm()?.f_double_value(&[])?;
            total += n * n;
        }
        let total = total.sqrt();
        let coef = max / (total + 1e-6);
        if coef < 1.0 {
            for g in &grads {
                let mut g = g.shallow_clone();
                let _ = tch::no_grad(|| g.f_mul_scalar_(coef))?;
            }
        }
        Ok(total)
    }

    /// Every gradient: the device variables' and the streamed parameters' host gradients that
    /// arrived in this accumulation window.
    fn gradients(&self) -> Result<Vec<Tensor>> {
        let mut out: Vec<Tensor> = self.device_params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
        out.extend(self.rt.lock().received_host_grads());
        Ok(out)
    }

    /// Sets the learning rate of every parameter.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.lr.set(lr);
        if let Some(d) = &mut self.device {
            d.set_learning_rate(lr)?;
        }
        Ok(())
    }

    /// Waits until every host step has run (for reading weights back, or timing).
    pub fn wait(&self) -> Result<std::time::Duration> {
        self.stepper.wait_all()
    }

    /// Time the host worker spent stepping since the last call.
    pub fn take_host_busy(&self) -> std::time::Duration {
        self.stepper.take_busy()
    }
}
