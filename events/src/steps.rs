//! Step aggregates the spine adds itself.
//!
//! The runtimes publish their own per-step aggregates (`weight_step`, `activation_step`, ...).
//! Copies belong to no single runtime, and the views' breakdowns by label (evictions by reason,
//! the Conductor's refusals by reason, copy and stall durations) come from detail events that a
//! summary file leaves out, so the spine sums each step's detail into a `transfer_step` and a
//! `step_counts` when the step closes: the next step begins, the run goes idle or ends, or the
//! bus closes. The bus runs a [`StepCloser`] on its dispatcher; [`close_steps`] does the same to
//! a recorded list, so a recorded run and a live one carry the same aggregates.

use super::model::*;
use super::snapshot::Snapshot;

/// A step's aggregates, ready to publish.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Closed {
    pub step: u64,
    pub transfers: Option<TransferStepMetrics>,
    pub counts: Option<StepCounts>,
}

impl Closed {
    /// The events to publish, in order.
    pub fn kinds(self) -> Vec<EventKind> {
        let mut out = Vec::with_capacity(2);
        if let Some(t) = self.transfers {
            out.push(EventKind::TransferStep(t));
        }
        if let Some(c) = self.counts {
            out.push(EventKind::StepCounts(Box::new(c)));
        }
        out
    }
}

/// Sums a step's copies and counts its detail, and says when to publish them.
#[derive(Debug, Default, Clone)]
pub struct StepCloser {
    step: u64,
    open: TransferStepMetrics,
    counts: StepCounts,
}

impl StepCloser {
    /// A closer with nothing open.
    pub fn new() -> StepCloser {
        StepCloser::default()
    }

    fn take(&mut self) -> Option<Closed> {
        let transfers = (!self.open.is_empty()).then(|| std::mem::take(&mut self.open));
        let counts = (!self.counts.is_empty()).then(|| std::mem::take(&mut self.counts));
        (transfers.is_some() || counts.is_some()).then_some(Closed { step: self.step, transfers, counts })
    }

    /// Aggregates to publish *before* `e`: detail of a new step while the last step's was never
    /// closed (a loop that publishes no phases).
    pub fn before(&mut self, e: &Event) -> Option<Closed> {
        if e.step == self.step || e.phase == Phase::Eval || !StepCounts::counts(e) {
            return None;
        }
        self.take()
    }

    /// Counts `e`; aggregates to publish right *after* it when it closes a step.
    pub fn after(&mut self, e: &Event) -> Option<Closed> {
        // An evaluation's detail belongs to no training step (its `evaluation` event counts
        // it); its beginning closes the step before it.
        if e.phase == Phase::Eval {
            return match &e.kind {
                EventKind::PhaseChanged { to: Phase::Eval, .. } => self.take(),
                _ => None,
            };
        }
        if let EventKind::TransferCompleted { dir, bytes, duration_ms, .. } = &e.kind {
            self.step = e.step;
            self.open.dir_mut(*dir).record(*bytes, *duration_ms);
        }
        if self.counts.count(e) {
            self.step = e.step;
            return None;
        }
        match &e.kind {
            // Someone else already summed this step (a recorded run played onto a bus).
            EventKind::TransferStep(_) if e.step == self.step => {
                self.open = TransferStepMetrics::default();
                None
            }
            EventKind::StepCounts(_) if e.step == self.step => {
                self.counts = StepCounts::default();
                None
            }
            EventKind::PhaseChanged { to: Phase::Idle | Phase::StepBegin | Phase::Eval, .. } | EventKind::RunEnded { .. } => {
                self.take()
            }
            _ => None,
        }
    }

    /// What is still open when the stream ends.
    pub fn finish(&mut self) -> Option<Closed> {
        self.take()
    }
}

/// `events` with the aggregates a live bus would have added, renumbered so that sequence
/// numbers stay 1, 2, 3, ... (times are kept; an added event takes the time of the event that
/// closed its step).
pub fn close_steps(events: Vec<Event>) -> Vec<Event> {
    // One closer per device lane (a data-parallel run's GPUs step on their own).
    let mut closers: std::collections::BTreeMap<Option<u32>, StepCloser> = std::collections::BTreeMap::new();
    // The state each step leaves behind, as a live hub's snapshot has it.
    let mut snap = Snapshot::new();
    let mut out = Vec::with_capacity(events.len() + events.len() / 32);
    let aggregate = |out: &mut Vec<Event>, snap: &mut Snapshot, at: &Event, device: Option<u32>, mut closed: Closed| {
        if let Some(c) = &mut closed.counts {
            c.end = Some(snap.end_state());
        }
        let step = closed.step;
        for kind in closed.kinds() {
            let e = Event::new(0, at.t_ns, step, at.phase, kind).on_device(device);
            snap.apply(&e);
            out.push(e);
        }
    };
    let mut last: Option<Event> = None;
    for e in events {
        let closer = closers.entry(e.device).or_default();
        if let Some(agg) = closer.before(&e) {
            aggregate(&mut out, &mut snap, &e, e.device, agg);
        }
        let after = closer.after(&e);
        snap.apply(&e);
        out.push(e.clone());
        if let Some(agg) = after {
            aggregate(&mut out, &mut snap, &e, e.device, agg);
        }
        last = Some(e);
    }
    if let Some(at) = last {
        for (device, closer) in closers.iter_mut() {
            if let Some(agg) = closer.finish() {
                aggregate(&mut out, &mut snap, &at, *device, agg);
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
        // Step 2 had no phases: its aggregates come before step 3's first copy.
        assert!(matches!(out[6].kind, EventKind::TransferStep(_)) && out[6].step == 2);
        assert!(matches!(out[7].kind, EventKind::StepCounts(_)) && out[7].step == 2);
        let counts: Vec<(u64, u64)> = out
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::StepCounts(c) => Some((e.step, c.copies[&Direction::H2d][&Owner::Weights].count)),
                _ => None,
            })
            .collect();
        assert_eq!(counts, [(1, 2), (2, 1), (3, 1)], "each step's copies counted by owner");
    }
}
