//! Evaluation: forwards outside a training step (an evaluation pass, sampling, inference
//! through the handle), written as tch users write them (`tch::no_grad`, `ModuleT` with
//! `train = false`, or a plain forward).
//!
//! A block used while no step is open starts an evaluation. It keeps its own itinerary, learned
//! from its forwards (a forward ends when the first block of the last one is entered again, as
//! in inference mode) and, before one is learned, the forward part of the training itinerary,
//! so blocks are prefetched along the order evaluation uses them; the training itinerary is
//! left as it was. Its phase is `eval`: the events it publishes belong to the last training step
//! and never count as a step; its totals are published as one `evaluation` event when it ends
//! (the next step begins, the run finishes or shuts down). Blocks it loaded stay on the device,
//! as any block between steps. Nothing an evaluation does changes a value: blocks load from
//! their canonical host copy, after any pending host optimizer step.

use super::super::itinerary::Itinerary;
use super::super::route::Route;
use super::{Scheduler, StepState};
use crate::error::Result;
use crate::events::{BlockId, EvaluationMetrics, EventKind, Phase, WeightStepMetrics};
use std::time::Instant;

/// An evaluation under way.
#[derive(Debug)]
pub(super) struct Evaluation {
    began: Instant,
}

impl Scheduler {
    /// Whether forwards run outside a step now.
    pub(crate) fn evaluating(&self) -> bool {
        self.state == StepState::Eval
    }

    /// Starts an evaluation: its own route, the `eval` phase, its own counts.
    pub(super) fn begin_evaluation(&mut self) -> Result<()> {
        if self.conductor.is_enabled() {
            self.conductor.enter_eval()?;
        } else {
            self.bus.enter_phase(self.step, Phase::Eval);
        }
        std::mem::swap(&mut self.route, &mut self.other_route);
        if self.route.itinerary().is_none() {
            // Until an evaluation forward is traced, the training forward is the best guess.
            if let Some(it) = self.other_route.itinerary() {
                self.route = Route::with_itinerary(Itinerary::new(it.forward().to_vec(), Vec::new()));
            }
        }
        self.route.begin();
        self.first_entered = None;
        self.update_expected = false;
        self.metrics = WeightStepMetrics::default();
        self.state = StepState::Eval;
        self.evaluation = Some(Evaluation { began: Instant::now() });
        Ok(())
    }

    /// A block entered during an evaluation: the first block of the forward entered again
    /// (after others) starts the next forward.
    pub(super) fn next_forward(&mut self, id: BlockId) {
        if self.first_entered == Some(id) && self.route.current() != Some(id) {
            self.end_forward();
            self.first_entered = None;
        }
    }

    /// Ends one evaluation forward: its trace becomes the evaluation's itinerary. (With a head
    /// tied to the embedding, a forward ends at the head, whose block the next forward enters
    /// first: the itinerary is the same cycle.)
    fn end_forward(&mut self) {
        // The evaluation's itinerary is its own: learning it publishes nothing, so the
        // training itinerary the views show stays the training one.
        let _ = self.route.end();
        self.route.begin();
    }

    /// Ends the evaluation under way, if any: publishes its totals and goes back to the
    /// training route, between steps.
    pub(crate) fn end_evaluation(&mut self) -> Result<()> {
        if self.state != StepState::Eval {
            return Ok(());
        }
        self.reap();
        // The forward under way may be a part of one (with a tied head, the head alone): the
        // itinerary keeps what the finished forwards taught it.
        self.route.begin();
        std::mem::swap(&mut self.route, &mut self.other_route);
        let m = std::mem::take(&mut self.metrics);
        let h2d_wait_ms = self.loads.take_wait_ms(false);
        // Waits for the host optimizer are in the misses' stalls already.
        let _ = self.update_waits.take_ms()?;
        let e = self.evaluation.take();
        self.bus.publish(EventKind::Evaluation(EvaluationMetrics {
            block_uses: m.prefetch_hits + m.prefetch_misses,
            prefetch_hits: m.prefetch_hits,
            prefetch_misses: m.prefetch_misses,
            stall_time_ms: m.stall_time_ms,
            h2d_bytes: m.h2d_bytes,
            evictions: m.evictions,
            h2d_wait_ms,
            duration_ms: e.map_or(0.0, |e| e.began.elapsed().as_secs_f64() * 1e3),
        }));
        self.first_entered = None;
        self.state = StepState::Closed;
        Ok(())
    }
}
