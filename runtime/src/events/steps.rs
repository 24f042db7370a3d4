//! Step aggregates the spine adds itself.
//!
//! The runtimes publish their own per-step aggregates (`weight_step`, `activation_step`, ...).
//! Copies belong to no single runtime, so the spine sums each step's `transfer_completed` events
//! into a `transfer_step` when the step closes: the next step begins, the run goes idle or ends,
//! or the bus closes. The bus runs a [`StepCloser`] on its dispatcher; [`close_steps`] does the
//! same to a recorded list, so a recorded run and a live one carry the same aggregates.

use super::model::*;

/// Sums a step's copies and says when to publish them.
#[derive(Debug, Default, Clone)]
pub struct StepCloser {
    step: u64,
    open: TransferStepMetrics,
}

impl StepCloser {
    /// A closer with nothing open.
    pub fn new() -> StepCloser {
        StepCloser::default()
    }

    fn take(&mut self) -> Option<(u64, TransferStepMetrics)> {
        if self.open.is_empty() {
            return None;
        }
        Some((self.step, std::mem::take(&mut self.open)))
    }

    /// An aggregate to publish *before* `e`: a copy of a new step while the last step's copies
    /// were never closed (a loop that publishes no phases).
    pub fn before(&mut self, e: &Event) -> Option<(u64, TransferStepMetrics)> {
        match e.kind {
            EventKind::TransferCompleted { .. } if e.step != self.step && e.phase != Phase::Eval => self.take(),
            _ => None,
        }
    }

    /// Counts `e`; an aggregate to publish right *after* it when it closes a step.
    pub fn after(&mut self, e: &Event) -> Option<(u64, TransferStepMetrics)> {
        match &e.kind {
            // An evaluation's copies belong to no step (its `evaluation` event counts them).
            EventKind::TransferCompleted { .. } if e.phase == Phase::Eval => None,
            EventKind::TransferCompleted { dir, bytes, duration_ms, .. } => {
                self.step = e.step;
                self.open.dir_mut(*dir).record(*bytes, *duration_ms);
                None
            }
            // Someone else already summed this step (a recorded run played onto a bus).
            EventKind::TransferStep(_) if e.step == self.step => {
                self.open = TransferStepMetrics::default();
                None
            }
            EventKind::PhaseChanged { to: Phase::Idle | Phase::StepBegin | Phase::Eval, .. }
            | EventKind::RunEnded { .. } => self.take(),
            _ => None,
        }
    }

    /// What is still open when the stream ends.
    pub fn finish(&mut self) -> Option<(u64, TransferStepMetrics)> {
        self.take()
    }
}

/// `events` with the `transfer_step` aggregates a live bus would have added, renumbered so
/// that sequence numbers stay 1, 2, 3, ... (times are kept; an added event takes the time of the
/// event that closed its step).
pub fn close_steps(events: Vec<Event>) -> Vec<Event> {
    // One closer per device lane (a data-parallel run's GPUs step on their own).
    let mut closers: std::collections::BTreeMap<Option<u32>, StepCloser> = std::collections::BTreeMap::new();
    let mut out = Vec::with_capacity(events.len() + events.len() / 64);
    let aggregate = |out: &mut Vec<Event>, at: &Event, device: Option<u32>, (step, m): (u64, TransferStepMetrics)| {
        out.push(Event::new(0, at.t_ns, step, at.phase, EventKind::TransferStep(m)).on_device(device));
    };
    let mut last: Option<Event> = None;
    for e in events {
        let closer = closers.entry(e.device).or_default();
        if let Some(agg) = closer.before(&e) {
            aggregate(&mut out, &e, e.device, agg);
        }
        let after = closer.after(&e);
        out.push(e.clone());
        if let Some(agg) = after {
            aggregate(&mut out, &e, e.device, agg);
        }
        last = Some(e);
    }
    if let Some(at) = last {
        for (device, closer) in closers.iter_mut() {
            if let Some(agg) = closer.finish() {
                aggregate(&mut out, &at, *device, agg);
            }
        }
    }
    for (i, e) in out.iter_mut().enumerate() {
        e.seq = i as u64 + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(step: u64, bytes: u64) -> Event {
        Event::new(
            0,
            step * 100,
            step,
            Phase::Forward,
            EventKind::TransferCompleted {
                id: TransferId(bytes),
                dir: Direction::H2d,
                owner: Owner::Weights,
                bytes,
                duration_ms: Some(1.0),
            },
        )
    }

    fn idle(step: u64) -> Event {
        Event::new(
            0,
            step * 100 + 50,
            step,
            Phase::Idle,
            EventKind::PhaseChanged { from: Phase::StepEnd, to: Phase::Idle, duration_s: 0.0 },
        )
    }

    #[test]
    fn each_step_gets_one_aggregate_of_its_copies() {
        let out = close_steps(vec![copy(1, 10), copy(1, 20), idle(1), copy(2, 5), copy(3, 7)]);
        let aggs: Vec<(u64, u64, u64)> = out
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::TransferStep(m) => Some((e.step, m.h2d.count, m.h2d.bytes)),
                _ => None,
            })
            .collect();
        assert_eq!(aggs, [(1, 2, 30), (2, 1, 5), (3, 1, 7)]);
        assert!(out.iter().enumerate().all(|(i, e)| e.seq == i as u64 + 1));
        // Step 2 had no phases: its aggregate comes before step 3's first copy.
        assert!(matches!(out[5].kind, EventKind::TransferStep(_)) && out[5].step == 2);
    }
}
