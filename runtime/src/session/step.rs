//! One training step through the handle: the phases tagged for the Conductor and the telemetry,
//! the forward under the saved-tensor hooks, and at the end where the step's time went and who
//! held the device memory.

use super::{Plan, Stagehand};
use crate::activations::ActivationRuntime;
use crate::conductor::Conductor;
use crate::error::Result;
use crate::events::{EventKind, Owner, Phase, StepTimeBreakdown, TrainStepMetrics, VramByOwner};
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
#[derive(Default)]
pub(super) struct Run {
    pub ready: Option<Ready>,
    pub step: u64,
    pub tokens: u64,
    /// Said once: the spill watermarks cannot go lower and steps still exceed the budget.
    pub warned_floor: bool,
    /// Steps whose optimizer step was skipped: a NaN or infinite loss with guards on, or an
    /// fp16 step whose gradients overflowed.
    pub skipped: u64,
    /// fp16's dynamic loss scale.
    pub scaler: crate::precision::LossScaler,
    /// A step that failed once it had begun updating the model (or in a group): the handle
    /// trains no more.
    pub failed: Option<StepFailure>,
    /// The step in progress got past its checks (a failure from then on is a [`StepFailure`]).
    pub began: bool,
}

/// A step that failed once it had begun updating the model (its optimizer phase, or a host step
/// queued as backward left a block), or one a group's rank could not abandon alone. (One that
/// failed before is abandoned and training goes on.) It may have stepped some blocks and not
/// others, so the handle refuses further steps rather than train on from a state no step left.
/// Where it had begun updating, the weight runtime refuses every read of the model's values too
/// ([`WeightRuntime::fail_step`](crate::weights::WeightRuntime::fail_step)); otherwise a
/// checkpoint still writes the values the earlier steps left.
#[derive(Debug, Clone)]
pub(super) struct StepFailure {
    pub step: u64,
    pub cause: String,
    /// A host or device optimizer step had begun: some values may be the next step's.
    pub model_changed: bool,
}

impl StepFailure {
    /// The error in a few hundred characters: an out-of-memory report lists everything the
    /// device held, which the step's own error already said.
    fn cause_of(e: &crate::Error) -> String {
        const MOST: usize = 300;
        let text = e.to_string();
        match text.char_indices().nth(MOST) {
            Some((i, _)) => format!("{}…", &text[..i]),
            None => text,
        }
    }

    /// The error a later step gets.
    pub fn refusal(&self, what: String) -> crate::Error {
        crate::Error::misuse(
            format!("{what}: step {} failed ({})", self.step, self.cause),
            if self.model_changed {
                "a new handle loaded from the last checkpoint saved before that step: it failed while its optimizer steps ran, so some of the model's values are the next step's and others are not"
            } else {
                "a new handle loaded from a checkpoint (this handle's `save` still writes the values of the steps before the failed one, which changed none); after an out-of-memory, a smaller batch or more micro-batches, or a larger budget"
            },
        )
    }
}

/// How far a step got: its first backward, its optimizer phase.
#[derive(Default)]
struct Reached {
    backward: std::cell::Cell<bool>,
    optimizer: std::cell::Cell<bool>,
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
    pub non_finite: Option<crate::guards::NonFinite>,
    /// The optimizer did not step: with guards on the loss was NaN or infinite (no backward
    /// ran), or under fp16 a gradient overflowed (the loss scale was lowered). A `warning` says
    /// which; [`Stagehand::skipped_steps`] counts them.
    pub optimizer_skipped: bool,
    /// fp16: the loss scale the step's backward used.
    pub loss_scale: Option<f64>,
}

impl Stagehand {
    /// Steps whose optimizer step the numeric guards skipped because the loss was NaN or
    /// infinite (guards on only).
    pub fn skipped_steps(&self) -> u64 {
        self.run().skipped
    }

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

    /// Runs `f` under the run's autocast (bf16 and fp16: matmuls in 16 bits, losses, softmaxes
    /// and norms in float32, float32 variables cast per op); other precisions run it as it is.
    /// Every forward through [`train_step`](Self::train_step) runs so; call it for a forward of
    /// your own (an evaluation) under mixed precision.
    pub fn autocast<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _guard = match self.precision.compute_kind() {
            Some(kind) => Some(crate::torch::amp::Autocast::enter(self.device.is_cuda(), kind)?),
            None => None,
        };
        Ok(f())
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
        let mut once = Some(forward);
        let forward = move |_: usize| once.take().map(|f| f());
        self.step_inner(opt, 1, forward)
    }

    /// One training step over `micro_batches` micro-batches (gradient accumulation): for each
    /// `i`, `forward(i)` runs under the saved-tensor hooks and returns micro-batch `i`'s loss,
    /// whose backward adds `loss / micro_batches` to the gradients; after the last, one
    /// optimizer step. The update equals one step over the whole batch when each loss is its
    /// micro-batch's mean; the report's loss is the mean of the micro-batches' losses. Streamed
    /// weights are loaded for every micro-batch, so a micro-batch should hold enough tokens to
    /// cover its weights' copies; the host optimizer's step, run once, is spread over all of them.
    pub fn train_step_micro(&self, opt: &mut Optimizer, micro_batches: usize, mut forward: impl FnMut(usize) -> Tensor) -> Result<StepReport> {
        if micro_batches == 0 {
            return Err(crate::Error::Config {
                field: "micro_batches",
                value: "0".into(),
                expected: "at least 1".into(),
            });
        }
        self.step_inner(opt, micro_batches, |i| Some(forward(i)))
    }

    /// In a data-parallel group a step that fails on one rank stops every rank (the others
    /// would wait for its collectives): the group's fault is raised with this error as the
    /// cause (unless another rank failed first). The error itself is returned as it is.
    fn stop_group(&self, e: crate::Error) -> crate::Error {
        if let Some(m) = self.member() {
            m.faults.raise(m.rank, e.to_string());
        }
        e
    }

    fn step_inner(&self, opt: &mut Optimizer, micro_batches: usize, forward: impl FnMut(usize) -> Option<Tensor>) -> Result<StepReport> {
        let reached = Reached::default();
        let r = self.step_body(opt, micro_batches, forward, &reached).map_err(|e| self.stop_group(self.explain_failure(e)));
        if let Err(e) = &r {
            let (began, failed, step) = {
                let run = self.run();
                (run.began, run.failed.is_some(), run.step)
            };
            // A step that never began (a check before it) leaves nothing behind.
            if began && !failed {
                let cause = StepFailure::cause_of(e);
                // Before any update (the optimizer phase, a host step queued as backward left
                // a block) nothing changed: the step is abandoned, its gradients dropped, and
                // the next one begins as if it had not run (one device; in a group every rank
                // has stopped).
                let unchanged = !reached.optimizer.get() && !self.weights().updates_queued();
                let abandoned = unchanged
                    && self.member().is_none()
                    && self.abandon_step(step, &cause, reached.backward.get()).is_ok();
                if !abandoned {
                    // Where it had begun updating, the weight runtime refuses every later use
                    // of the model, a checkpoint's read of its values included.
                    let model_changed = self.weights().fail_step(reached.optimizer.get(), || cause.clone());
                    self.run().failed = Some(StepFailure { step, cause, model_changed });
                }
            }
        }
        r
    }

    /// Closes step `step`, which failed before it updated anything: each runtime back between
    /// steps, its saved tensors released, its gradients dropped (`backward`: it had begun its
    /// backward), a warning that says so.
    fn abandon_step(&self, step: u64, cause: &str, backward: bool) -> Result<()> {
        let (acts, conductor) = {
            let run = self.run();
            let r = run.ready.as_ref().ok_or_else(|| crate::Error::internal("a step without a plan"))?;
            (r.acts.clone(), r.conductor.clone())
        };
        self.weights().abandon_step()?;
        if let Some(a) = &acts {
            a.abandon_step();
        }
        if conductor.is_enabled() {
            conductor.abandon_step()?;
        } else {
            self.bus.enter_phase(step, Phase::Idle);
        }
        self.bus.publish(EventKind::Warning {
            source: Owner::Trainer,
            message: format!(
                "step {step} failed {} and was abandoned; nothing was changed: {cause}",
                if backward { "in its backward, before any update, its gradients dropped," } else { "before its backward" }
            ),
        });
        Ok(())
    }

    /// The step; `reached` says how far it got.
    fn step_body(
        &self,
        opt: &mut Optimizer,
        micro_batches: usize,
        mut forward: impl FnMut(usize) -> Option<Tensor>,
        reached: &Reached,
    ) -> Result<StepReport> {
        let (acts, conductor, step, tokens, limits, loss_scale) = {
            let mut run = self.run();
            run.began = false;
            if let Some(f) = &run.failed {
                return Err(f.refusal(format!("step {}", run.step + 1)));
            }
            self.ensure_ready(&mut run)?;
            // An evaluation since the last step (forwards outside a step) ends before this one.
            self.weights().end_evaluation()?;
            // No handle of a managed variable kept where it would read a placeholder.
            self.store.table().check_references()?;
            run.step += 1;
            let r = run.ready.as_ref().ok_or_else(|| crate::Error::internal("a step without a plan"))?;
            let scale = self.precision.scales_loss().then(|| run.scaler.scale());
            (r.acts.clone(), r.conductor.clone(), run.step, run.tokens, super::adapt::Limits::of(&r.plan), scale)
        };
        // The host optimizers and their state are made now, with the plan, not in the step.
        opt.prepare()?;
        // From here a failure leaves the runtimes mid-step.
        self.run().began = true;
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
        // The micro-batches' losses, summed on the device and read once after the last: a read
        // per micro-batch would drain the device's queue between micro-batches.
        let mut loss_sum: Option<Tensor> = None;
        // With guards on, a loss that is NaN or infinite: its value.
        let mut non_finite_loss = None;
        for i in 0..micro_batches {
            let last = i + 1 == micro_batches;
            self.enter(&conductor, step, Phase::Forward)?;
            if micro_batches > 1 {
                weights.begin_pass(last)?;
            }
            if i == 0 {
                // The plan's resident blocks take their memory before the forward's activations
                // can.
                weights.load_residents()?;
            }
            let loss = {
                // The activation runtime's store hands weights to the weight runtime; without
                // spilling the weight runtime's own store is used. Either is on until the
                // forward ends.
                let _hooks: Box<dyn std::any::Any> = match &acts {
                    Some(a) => Box::new(a.managed_forward()?),
                    None => Box::new(weights.hooks()?),
                };
                self.autocast(|| super::forensics::catch_oom(|| forward(i)))??
                    .ok_or_else(|| crate::Error::internal("a step's forward ran twice"))?
            };
            self.guard_loss(&loss);
            // With guards on, a loss that is NaN or infinite is read before backward (one wait
            // for the forward): its gradients would be too, and the host steps start during
            // backward.
            if self.guards.is_some() {
                let v = loss.f_double_value(&[])?;
                if !v.is_finite() {
                    non_finite_loss = Some(v);
                }
                // In a group every rank skips the step, or none does.
                if let Some(m) = self.member() {
                    if m.exchange.any(m.rank, "the loss check", !v.is_finite())? && non_finite_loss.is_none() {
                        non_finite_loss = Some(f64::NAN);
                    }
                }
            }
            self.publish_reading();
            reached.backward.set(true);
            self.enter(&conductor, step, Phase::Backward)?;
            if non_finite_loss.is_some() {
                break;
            }
            if i == 0 {
                opt.zero_grad()?;
            }
            // Each micro-batch adds its share: one step over the whole batch. In a group each
            // rank's gradients are summed over the ranks, so each rank's share is of the
            // group's batch (the same operation as a micro-batch's on one device).
            let shares = micro_batches * self.world_size();
            let share = if shares > 1 { &loss / shares as f64 } else { loss.shallow_clone() };
            match loss_scale {
                // fp16: whether the step updates is known once every gradient is in, so the
                // host steps wait for the end of backward.
                Some(scale) => (&share * scale).f_backward()?,
                None => {
                    // The host steps of streamed blocks start as the last backward leaves each
                    // one.
                    if last {
                        opt.overlap_next_backward()?;
                    }
                    share.f_backward()?;
                }
            }
            if !last {
                if let Some(a) = &acts {
                    a.between_micro_batches()?;
                }
            }
            let l = loss.detach().f_to_kind(tch::Kind::Double)?;
            loss_sum = Some(match loss_sum {
                Some(sum) => sum.f_add(&l)?,
                None => l,
            });
        }
        if non_finite_loss.is_none() {
            weights.after_backward()?;
            self.guard_gradients();
        }
        let e2 = self.device.record_compute()?;
        let mut loss_value = match (non_finite_loss, &loss_sum) {
            (Some(v), _) => v,
            (None, Some(sum)) => sum.f_double_value(&[])? / micro_batches as f64,
            (None, None) => return Err(crate::Error::internal("a step with no micro-batch")),
        };
        // In a group, the group's loss: the ranks' means averaged (in rank order, as one device
        // averages its micro-batches).
        if let Some(m) = self.member() {
            let sum = m.exchange.sum_f64(m.rank, "the loss", loss_value)?;
            loss_value = sum / m.world as f64;
        }
        let am = match &acts {
            Some(a) => Some(a.end_step()?),
            None => None,
        };
        self.publish_reading();
        let t_opt = Instant::now();
        let skip = |why: String| {
            let total = {
                let mut run = self.run();
                run.skipped += 1;
                run.skipped
            };
            self.bus.publish(EventKind::Warning {
                source: Owner::Trainer,
                message: format!("step {step}: {why} ({total} step(s) skipped so far)"),
            });
        };
        let optimizer_skipped = match (non_finite_loss, loss_scale) {
            (Some(v), _) => {
                skip(format!("the loss is {v}: no backward, the optimizer step was skipped"));
                true
            }
            (None, Some(scale)) => {
                reached.optimizer.set(true);
                self.enter(&conductor, step, Phase::Optimizer)?;
                weights.collect_grads()?;
                let overflow = opt.found_inf()?;
                let update = self.run().scaler.update(overflow);
                if overflow {
                    skip(format!(
                        "an infinite or NaN gradient at loss scale {scale}: the update was skipped and the scale lowered to {}",
                        update.next_scale
                    ));
                } else {
                    opt.set_grad_scale((1.0 / scale) as f32);
                    let stepped = opt.step();
                    opt.set_grad_scale(1.0);
                    stepped?;
                }
                overflow
            }
            (None, None) => {
                reached.optimizer.set(true);
                self.enter(&conductor, step, Phase::Optimizer)?;
                opt.step()?;
                false
            }
        };
        weights.end_step()?;
        let e3 = self.device.record_compute()?;
        e3.synchronize()?;
        let optimizer_host_ms = t_opt.elapsed().as_secs_f64() * 1e3;
        self.enter(&conductor, step, Phase::StepEnd)?;
        // The step's last reading carries its peak, which the step's figures repeat. Moving the
        // watermarks may grow the pinned pool (seconds after a first step): the step's time
        // includes it, as the caller waits for it.
        let mem = self.publish_reading();
        if let Some(a) = &acts {
            self.keep_under_budget(a, step, mem.peak, limits);
        }
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
        self.bus.publish(EventKind::TrainStep(TrainStepMetrics {
            loss: loss_value,
            step_time_s: step_ms / 1e3,
            tokens,
            vram_peak_bytes: mem.peak,
            loss_scale,
            skipped: optimizer_skipped,
        }));
        self.bus.publish(EventKind::StepTime(time));
        Ok(StepReport {
            step,
            loss: loss_value,
            step_ms,
            time,
            vram_peak_bytes: mem.peak,
            non_finite: self.guards_end()?,
            optimizer_skipped,
            loss_scale,
        })
    }

    /// Ends the run's telemetry: the last phase is idle and `run_ended` is published.
    pub fn finish(&self) -> Result<()> {
        self.weights().end_evaluation()?;
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
