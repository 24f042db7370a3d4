//! One training step through the handle: the phases tagged for the Conductor and the telemetry,
//! the forward under the saved-tensor hooks, and at the end where the step's time went and who
//! held the device memory.

use super::{Plan, Stagehand};
use crate::activations::ActivationRuntime;
use crate::conductor::Conductor;
use crate::error::Result;
use crate::events::{EventKind, Phase, StepTimeBreakdown, TrainStepMetrics, VramByOwner};
use crate::optim::Optimizer;
use std::time::Instant;
use tch::Tensor;

/// What the handle knows once the model has run.
pub(super) struct Ready {
    pub plan: Plan,
    pub acts: Option<ActivationRuntime>,
    pub conductor: Conductor,
}

/// The handle's mutable state.
pub(super) struct Run {
    pub ready: Option<Ready>,
    pub step: u64,
    /// Optimizer state per trainable byte, from the optimizer made (Adam's 2 until then).
    pub optimizer_state_factor: u64,
    pub tokens: u64,
    /// Said once: the spill watermarks cannot go lower and steps still exceed the budget.
    pub warned_floor: bool,
}

impl Default for Run {
    fn default() -> Self {
        Run {
            ready: None,
            step: 0,
            optimizer_state_factor: 2,
            tokens: 0,
            warned_floor: false,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub step: u64,
    pub loss: f64,
    /// Wall time of the step in milliseconds.
    pub step_ms: f64,
    /// Where that time went.
    pub time: StepTimeBreakdown,
    /// Peak device memory allocated during the step.
    pub vram_peak_bytes: u64,
    /// The first NaN or infinity the numeric guards found in the step (guards on only).
    pub non_finite: Option<crate::guards::Finding>,
}

impl Stagehand {
    /// Tokens (or samples) one step processes, for the throughput figures.
    pub fn set_tokens_per_step(&self, tokens: u64) {
        self.run().tokens = tokens;
    }

    fn enter(&self, conductor: &Conductor, step: u64, phase: Phase) -> Result<()> {
        if !conductor.is_enabled() {
            self.bus.enter_phase(step, phase);
            return Ok(());
        }
        match phase {
            Phase::StepBegin => conductor.begin_step(step)?,
            Phase::Forward => conductor.enter_forward()?,
            Phase::Backward => conductor.enter_backward()?,
            Phase::Optimizer => conductor.enter_optimizer()?,
            _ => conductor.end_step()?,
        }
        Ok(())
    }

    /// Device memory by owner now.
    pub fn vram_owners(&self) -> VramByOwner {
        let w = self.weights();
        let held = self.activations().map(|a| a.held_bytes()).unwrap_or_default();
        VramByOwner {
            allocated_bytes: self.device.memory().allocated,
            weights_bytes: w.device_bytes(),
            activations_kept_bytes: held.kept,
            activations_restored_bytes: held.restored,
            copies_in_flight_bytes: w.in_flight_bytes() + held.spilling,
            other_bytes: 0,
        }
        .with_other()
    }

    /// One training step: `forward` runs under the saved-tensor hooks and returns the loss; then
    /// `zero_grad`, backward and the optimizer's step (tch's `backward_step`). Returns the loss
    /// and where the step's time went. A step that runs out of device memory returns
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory): what held the device, what the runtime
    /// was about to do, and the flight record written for it.
    pub fn train_step(&self, opt: &mut Optimizer, forward: impl FnOnce() -> Tensor) -> Result<StepReport> {
        self.step_inner(opt, forward).map_err(|e| self.explain_failure(e))
    }

    fn step_inner(&self, opt: &mut Optimizer, forward: impl FnOnce() -> Tensor) -> Result<StepReport> {
        let (acts, conductor, step, tokens, (floor, planned)) = {
            let mut run = self.run();
            self.ensure_ready(&mut run)?;
            run.step += 1;
            let r = run.ready.as_ref().ok_or_else(|| crate::Error::internal("a step without a plan"))?;
            (r.acts.clone(), r.conductor.clone(), run.step, run.tokens, (r.plan.spill_floor_bytes, r.plan.spill_high_bytes))
        };
        let weights = self.weights();
        let t0 = Instant::now();
        self.device.reset_peak();
        self.guards_begin();
        self.enter(&conductor, step, Phase::StepBegin)?;
        self.publish_reading();
        weights.begin_step()?;
        if let Some(a) = &acts {
            a.begin_step(step);
        }
        let e0 = self.device.record_compute()?;
        self.enter(&conductor, step, Phase::Forward)?;
        let loss = {
            // The activation runtime's store hands weights to the weight runtime; without
            // spilling the weight runtime's own store is used. Either is on until the forward ends.
            let _hooks: Box<dyn std::any::Any> = match &acts {
                Some(a) => Box::new(a.managed_forward()?),
                None => Box::new(weights.hooks()?),
            };
            super::forensics::catch_oom(forward)?
        };
        self.guard_loss(&loss);
        self.publish_reading();
        self.enter(&conductor, step, Phase::Backward)?;
        opt.zero_grad()?;
        // The host steps of streamed blocks start as backward leaves each one.
        opt.overlap_next_backward()?;
        loss.f_backward()?;
        weights.after_backward()?;
        self.guard_gradients();
        let e2 = self.device.record_compute()?;
        let loss_value = loss.f_double_value(&[])?;
        drop(loss);
        let am = match &acts {
            Some(a) => Some(a.end_step()?),
            None => None,
        };
        self.publish_reading();
        self.enter(&conductor, step, Phase::Optimizer)?;
        let t_opt = Instant::now();
        opt.step()?;
        weights.end_step()?;
        let e3 = self.device.record_compute()?;
        e3.synchronize()?;
        let optimizer_host_ms = t_opt.elapsed().as_secs_f64() * 1e3;
        self.enter(&conductor, step, Phase::StepEnd)?;
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;

        let wm = weights.last_step_metrics();
        let am = am.unwrap_or_default();
        let fwd_bwd = e0.elapsed_ms(&e2).unwrap_or(0.0);
        let opt_ms = e2.elapsed_ms(&e3).unwrap_or(0.0).max(optimizer_host_ms);
        let cuda = self.device.is_cuda();
        let h2d_wait_ms = wm.h2d_wait_ms + am.h2d_wait_ms;
        let weight_stall_ms = (wm.stall_time_ms - wm.update_wait_ms).max(0.0);
        // On a GPU a restore never blocks the host: its wait is the compute stream's (above).
        let restore_stall_ms = if cuda { 0.0 } else { am.stall_time_ms };
        let d2h_wait_ms = am.d2h_wait_ms;
        let optimizer_ms = opt_ms + wm.update_wait_ms;
        let compute_ms =
            (fwd_bwd - h2d_wait_ms - weight_stall_ms - restore_stall_ms - d2h_wait_ms - wm.update_wait_ms).max(0.0);
        let parts = compute_ms + h2d_wait_ms + d2h_wait_ms + weight_stall_ms + restore_stall_ms + optimizer_ms;
        let time = StepTimeBreakdown {
            step_ms,
            compute_ms,
            h2d_wait_ms,
            d2h_wait_ms,
            weight_stall_ms,
            restore_stall_ms,
            optimizer_ms,
            other_ms: (step_ms - parts).max(0.0),
        };
        // The step's last reading carries its peak, which the step's figures repeat.
        let mem = self.publish_reading();
        self.bus.publish(EventKind::TrainStep(TrainStepMetrics {
            loss: loss_value,
            step_time_s: step_ms / 1e3,
            tokens,
            vram_peak_bytes: mem.peak,
        }));
        self.bus.publish(EventKind::StepTime(time));
        if let Some(a) = &acts {
            self.keep_under_budget(a, step, mem.peak, floor, planned);
        }
        Ok(StepReport {
            step,
            loss: loss_value,
            step_ms,
            time,
            vram_peak_bytes: mem.peak,
            non_finite: self.guards_end()?,
        })
    }

    /// Ends the run's telemetry: the last phase is idle and `run_ended` is published.
    pub fn finish(&self) -> Result<()> {
        let run = self.run();
        // The next step's first block may be loading (it is loaded as a step ends).
        self.weights().settle()?;
        if let Some(r) = &run.ready {
            r.conductor.shutdown();
        }
        self.bus.enter_phase(run.step, Phase::Idle);
        self.bus.publish(EventKind::RunEnded { steps: run.step });
        if let Some(t) = &self.telemetry {
            t.flush();
        }
        Ok(())
    }
}
