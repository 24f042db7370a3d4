//! libtorch's optimizers (SGD, Adam, AdamW, RMSprop), made by the shim exactly as tch makes them
//! (same classes, same options, parameters added to groups the same way), so a step is
//! bit-identical with `tch::nn::Optimizer`'s. Unlike tch's `COptimizer`, this one also sets the
//! options of one group at a time, says how many groups it has, and reads and writes each
//! parameter's state (for optimizer checkpoints).

use super::ffi;
use crate::error::{Error, Result};
use std::os::raw::{c_char, c_int};
use std::ptr::NonNull;
use tch::Tensor;
use torch_sys::C_tensor;

fn check(rc: c_int, err: &[c_char], what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Torch(tch::TchError::Torch(format!("{what}: {}", ffi::message(err)))))
    }
}

/// A libtorch optimizer class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerClass {
    Sgd,
    Adam,
    AdamW,
    RmsProp,
}

impl OptimizerClass {
    /// libtorch's name for it.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerClass::Sgd => "SGD",
            OptimizerClass::Adam => "Adam",
            OptimizerClass::AdamW => "AdamW",
            OptimizerClass::RmsProp => "RMSprop",
        }
    }
}

/// A new libtorch optimizer's options, as the shim takes them: the class and every option any
/// class has (a class ignores those it does not have). The optimizer module makes them from its
/// `Algorithm`, so the shim knows nothing above it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerOptions {
    pub class: OptimizerClass,
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub alpha: f64,
    pub nesterov: bool,
    pub amsgrad: bool,
    pub centered: bool,
}

/// One parameter's optimizer state: its step count (Adam, AdamW, RMSprop; 0 for SGD) and up to
/// three tensors, in the order the optimizer module's `Algorithm::state_fields` names them
/// (`None` where absent).
#[derive(Debug)]
pub struct ParamState {
    pub step: i64,
    pub tensors: [Option<Tensor>; 3],
}

/// A libtorch optimizer owned by Rust.
pub struct TorchOptimizer {
    ptr: NonNull<ffi::COptim>,
}

// SAFETY: the optimizer is plain C++ state with no thread affinity; `&mut self` methods give
// exclusive access, and the runtime keeps each optimizer behind a lock or on one thread.
unsafe impl Send for TorchOptimizer {}

impl std::fmt::Debug for TorchOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchOptimizer").field("groups", &self.groups()).finish()
    }
}

impl Drop for TorchOptimizer {
    fn drop(&mut self) {
        // SAFETY: made by `stagehand_optim_new`, freed once here.
        unsafe { ffi::stagehand_optim_free(self.ptr.as_ptr()) }
    }
}

impl TorchOptimizer {
    /// A new optimizer made from `options`, with one empty group (group 0).
    pub fn new(options: &OptimizerOptions) -> Result<TorchOptimizer> {
        let c = ffi::OptimConfig {
            algorithm: match options.class {
                OptimizerClass::Sgd => 0,
                OptimizerClass::Adam => 1,
                OptimizerClass::AdamW => 2,
                OptimizerClass::RmsProp => 3,
            },
            lr: options.lr,
            momentum: options.momentum,
            dampening: options.dampening,
            weight_decay: options.weight_decay,
            beta1: options.beta1,
            beta2: options.beta2,
            eps: options.eps,
            alpha: options.alpha,
            nesterov: c_int::from(options.nesterov),
            amsgrad: c_int::from(options.amsgrad),
            centered: c_int::from(options.centered),
        };
        let mut err = [0 as c_char; 1024];
        // SAFETY: `c` is a valid config for the call; the shim returns a new optimizer or null
        // with a message.
        let ptr = unsafe { ffi::stagehand_optim_new(&c, err.as_mut_ptr(), err.len()) };
        NonNull::new(ptr)
            .map(|ptr| TorchOptimizer { ptr })
            .ok_or_else(|| Error::Torch(tch::TchError::Torch(format!("making {}: {}", options.class.name(), ffi::message(&err)))))
    }

    /// Adds `param` to group `group` (groups up to it are made from the defaults, as tch does).
    pub fn add(&mut self, param: &Tensor, group: usize) -> Result<()> {
        let mut err = [0 as c_char; 1024];
        // SAFETY: a live optimizer and tensor; the shim copies the tensor handle.
        let rc = unsafe { ffi::stagehand_optim_add(self.ptr.as_ptr(), param.as_ptr(), group, err.as_mut_ptr(), err.len()) };
        check(rc, &err, "adding a parameter")
    }

    /// How many parameter groups it has.
    pub fn groups(&self) -> usize {
        // SAFETY: a live optimizer; the call only reads.
        unsafe { ffi::stagehand_optim_groups(self.ptr.as_ptr()) }
    }

    /// Sets the learning rate, weight decay and momentum (Adam's `beta1`) of group `group`.
    pub fn set_group(&mut self, group: usize, lr: f64, weight_decay: f64, momentum: f64) -> Result<()> {
        let mut err = [0 as c_char; 1024];
        // SAFETY: a live optimizer; the shim checks the group index.
        let rc = unsafe {
            ffi::stagehand_optim_set_group(self.ptr.as_ptr(), group, lr, weight_decay, momentum, err.as_mut_ptr(), err.len())
        };
        check(rc, &err, "setting a parameter group's options")
    }

    /// One step over every parameter that has a gradient.
    pub fn step(&mut self) -> Result<()> {
        let mut err = [0 as c_char; 1024];
        // SAFETY: a live optimizer.
        let rc = unsafe { ffi::stagehand_optim_step(self.ptr.as_ptr(), err.as_mut_ptr(), err.len()) };
        check(rc, &err, "optimizer step")
    }

    /// Clears every parameter's gradient (libtorch's `zero_grad(set_to_none)`, as tch's).
    pub fn zero_grad(&mut self) -> Result<()> {
        let mut err = [0 as c_char; 1024];
        // SAFETY: a live optimizer.
        let rc = unsafe { ffi::stagehand_optim_zero_grad(self.ptr.as_ptr(), err.as_mut_ptr(), err.len()) };
        check(rc, &err, "zeroing gradients")
    }

    /// The state of `param` (handles sharing the optimizer's tensors), or `None` when it has
    /// none yet (never stepped).
    pub fn state(&self, param: &Tensor) -> Result<Option<ParamState>> {
        let mut err = [0 as c_char; 1024];
        let (mut present, mut step) = (0 as c_int, 0i64);
        let mut out: [*mut C_tensor; 3] = [std::ptr::null_mut(); 3];
        // SAFETY: a live optimizer and tensor; the shim writes three new tensor handles (or
        // null) that we take ownership of below.
        let rc = unsafe {
            ffi::stagehand_optim_state_get(
                self.ptr.as_ptr(),
                param.as_ptr(),
                &mut present,
                &mut step,
                out.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        // SAFETY: each non-null pointer is a heap at::Tensor made for us (taken even on error).
        let tensors = out.map(|p| (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p) }));
        check(rc, &err, "reading optimizer state")?;
        Ok((present != 0).then_some(ParamState { step, tensors }))
    }

    /// Replaces the state of `param`, one of this optimizer's parameters. The tensors are used
    /// as given: make them copies on the parameter's device with its dtype and shape.
    pub fn set_state(&mut self, param: &Tensor, state: &ParamState) -> Result<()> {
        let mut err = [0 as c_char; 1024];
        let ins: Vec<*mut C_tensor> = state
            .tensors
            .iter()
            .map(|t| t.as_ref().map_or(std::ptr::null_mut(), |t| t.as_ptr() as *mut C_tensor))
            .collect();
        // SAFETY: a live optimizer and tensors; the shim copies the handles it keeps.
        let rc = unsafe {
            ffi::stagehand_optim_state_set(self.ptr.as_ptr(), param.as_ptr(), state.step, ins.as_ptr(), err.as_mut_ptr(), err.len())
        };
        check(rc, &err, "writing optimizer state")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::Algorithm;
    use crate::torch::optim::set_grad;
    use tch::nn::OptimizerConfig;
    use tch::{Device, Kind};

    fn algorithms() -> Vec<Algorithm> {
        vec![
            tch::nn::Sgd { momentum: 0.9, dampening: 0.1, wd: 1e-3, nesterov: false }.into(),
            tch::nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 0.0, nesterov: true }.into(),
            tch::nn::Adam { amsgrad: true, ..Default::default() }.into(),
            tch::nn::AdamW::default().into(),
            tch::nn::RmsProp { momentum: 0.5, centered: true, ..Default::default() }.into(),
        ]
    }

    fn tch_config_step(a: &Algorithm, vs: &tch::nn::VarStore, lr: f64) -> tch::nn::Optimizer {
        match *a {
            Algorithm::Sgd { momentum, dampening, wd, nesterov } => {
                tch::nn::Sgd { momentum, dampening, wd, nesterov }.build(vs, lr).expect("sgd")
            }
            Algorithm::Adam { beta1, beta2, wd, eps, amsgrad } => {
                tch::nn::Adam { beta1, beta2, wd, eps, amsgrad }.build(vs, lr).expect("adam")
            }
            Algorithm::AdamW { beta1, beta2, wd, eps, amsgrad } => {
                tch::nn::AdamW { beta1, beta2, wd, eps, amsgrad }.build(vs, lr).expect("adamw")
            }
            Algorithm::RmsProp { alpha, eps, wd, momentum, centered } => {
                tch::nn::RmsProp { alpha, eps, wd, momentum, centered }.build(vs, lr).expect("rmsprop")
            }
        }
    }

    #[test]
    fn steps_equal_tchs_and_state_round_trips() {
        for a in algorithms() {
            let vs = tch::nn::VarStore::new(Device::Cpu);
            let w = vs.root().var("w", &[16], tch::nn::Init::Const(0.5));
            let mut reference = tch_config_step(&a, &vs, 0.05);
            let p = Tensor::full([16], 0.5, (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let mut o = TorchOptimizer::new(&a.torch_options(0.05)).expect("optimizer");
            o.add(&p, 0).expect("add");
            assert!(o.state(&p).expect("state").is_none(), "no state before the first step");
            for i in 0..4 {
                let g = Tensor::arange(16, (Kind::Float, Device::Cpu)) * (0.1 * f64::from(i + 1)) - 0.7;
                set_grad(&w, Some(&g)).expect("grad");
                set_grad(&p, Some(&g)).expect("grad");
                reference.step();
                o.step().expect("step");
            }
            assert!(p.detach().equal(&w.detach()), "{}: steps differ from tch's", a.name());
            let st = o.state(&p).expect("state").expect("present after steps");
            if !matches!(a, Algorithm::Sgd { .. }) {
                assert_eq!(st.step, 4, "{}", a.name());
            }
            // A second optimizer given this state continues exactly as the first.
            let q = p.detach().copy().set_requires_grad(true);
            let mut o2 = TorchOptimizer::new(&a.torch_options(0.05)).expect("optimizer");
            o2.add(&q, 0).expect("add");
            let copied = ParamState { step: st.step, tensors: st.tensors.each_ref().map(|t| t.as_ref().map(|t| t.copy())) };
            o2.set_state(&q, &copied).expect("set state");
            let g = Tensor::ones([16], (Kind::Float, Device::Cpu));
            set_grad(&p, Some(&g)).expect("grad");
            set_grad(&q, Some(&g)).expect("grad");
            o.step().expect("step");
            o2.step().expect("step");
            assert!(p.detach().equal(&q.detach()), "{}: a restored state steps differently", a.name());
        }
    }

    #[test]
    fn groups_are_made_up_to_the_one_asked_and_set_one_at_a_time() {
        let a: Algorithm = tch::nn::AdamW::default().into();
        let mut o = TorchOptimizer::new(&a.torch_options(0.1)).expect("optimizer");
        assert_eq!(o.groups(), 1);
        let p = Tensor::zeros([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        o.add(&p, 2).expect("add");
        assert_eq!(o.groups(), 3);
        o.set_group(1, 0.5, 0.0, 0.8).expect("group 1");
        let e = o.set_group(3, 0.5, 0.0, 0.8).expect_err("no group 3");
        assert!(e.to_string().contains("setting a parameter group"), "{e}");
        let stranger = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let e = o
            .set_state(&stranger, &ParamState { step: 1, tensors: [Some(stranger.copy()), Some(stranger.copy()), None] })
            .expect_err("not a parameter");
        assert!(e.to_string().contains("not a parameter"), "{e}");
    }
}
