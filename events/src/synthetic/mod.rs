//! A deterministic synthetic run: every kind of event a real run emits, with realistic shapes
//! (blocks streaming through their residency states, copies, pool slabs, spills and restores,
//! Conductor reservations, denials and hints, VRAM samples, per-step metrics, a warning and a
//! bus drop), and no wall-clock values, without libtorch.
//!
//! For every consumer's tests (snapshot, stagehand-top, metrics, traces, the HTTP server, the
//! web page), for trying the dashboards without a model (`stagehand-top --demo`), and for
//! benchmarks. [`events`] gives the run as recorded events (what a telemetry file holds);
//! [`publish`] plays it onto a live [`Bus`] with pauses between steps, so a live consumer sees it
//! unfold.

// The runtime's metric structs gain fields over time; `..Default::default()` keeps this
// generator building when they do.
#![allow(clippy::needless_update)]

mod gen;
mod run;

use super::bus::Bus;
use super::model::*;
use std::time::Duration;

/// Shape of a synthetic run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticRun {
    /// Managed weight blocks.
    pub blocks: u32,
    /// Complete training steps.
    pub steps: u64,
    /// End with a partial step that leaves blocks in each of the six residency states (a run
    /// caught mid-step) instead of a `run_ended` event.
    pub end_mid_step: bool,
}

impl SyntheticRun {
    /// A run of `steps` steps over 12 blocks that ends with `run_ended`.
    pub fn finished(steps: u64) -> SyntheticRun {
        SyntheticRun { blocks: 12, steps, end_mid_step: false }
    }
}

impl Default for SyntheticRun {
    fn default() -> Self {
        SyntheticRun {
            blocks: 8,
            steps: 3,
            end_mid_step: true,
        }
    }
}
/// The events of a synthetic run, in order, numbered from 1.
pub fn events(run: SyntheticRun) -> Vec<Event> {
    run::generate(run)
}

/// The events of a synthetic run as JSONL text, one event a line.
pub fn jsonl(run: SyntheticRun) -> String {
    let mut s = String::new();
    for e in events(run) {
        // An Event always serializes: every field is plain data.
        if let Ok(line) = serde_json::to_string(&e) {
            s.push_str(&line);
            s.push('\n');
        }
    }
    s
}

/// Plays the run onto `bus` as a training loop would publish it: phase changes through
/// [`Bus::enter_phase`] (the bus times them), everything else through [`Bus::publish`], with
/// the bus's own sequence numbers and clock, sleeping `pause` after each step. Returns the
/// number of events consumers will see (the `transfer_step` aggregates are added by the bus).
pub fn publish(run: SyntheticRun, bus: &Bus, pause: Duration) -> u64 {
    let mut n = 0;
    for e in events(run) {
        match e.kind {
            EventKind::PhaseChanged { to, .. } => {
                bus.enter_phase(e.step, to);
                if to == Phase::Idle && !pause.is_zero() {
                    std::thread::sleep(pause);
                }
            }
            // The bus sums each step's copies and counts itself (and they count: consumers see
            // them).
            EventKind::TransferStep(_) | EventKind::StepCounts(_) => {}
            mut kind => {
                // The run starts now, on the bus's wall clock.
                if let EventKind::RunStarted { wall_clock_unix_ms, .. } = &mut kind {
                    *wall_clock_unix_ms = bus.wall_clock_unix_ms();
                }
                bus.publish(kind);
            }
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Snapshot;

    #[test]
    fn every_residency_transition_is_valid_and_all_six_states_show_at_the_end() {
        let ev = events(SyntheticRun::default());
        for e in &ev {
            if let EventKind::Residency { from, to, .. } = e.kind {
                assert!(from.can_transition_to(to), "seq {}: {from} -> {to}", e.seq);
            }
        }
        let s = Snapshot::from_events(&ev);
        let counts = s.residency_counts();
        for st in BlockState::ALL {
            assert!(counts.get(&st).copied().unwrap_or(0) > 0, "no block {st}: {counts:?}");
        }
        assert_eq!(s.dropped_events, 17);
        assert_eq!(s.warnings.len(), 1);
    }

    #[test]
    fn sequence_and_time_only_grow() {
        let ev = events(SyntheticRun {
            blocks: 12,
            steps: 5,
            end_mid_step: false,
        });
        for w in ev.windows(2) {
            assert_eq!(w[1].seq, w[0].seq + 1);
            assert!(w[1].t_ns >= w[0].t_ns);
        }
        assert!(matches!(ev.last().map(|e| &e.kind), Some(EventKind::RunEnded { steps: 5 })));
    }

    #[test]
    fn a_finished_run_leaves_nothing_in_flight() {
        let ev = events(SyntheticRun { blocks: 12, steps: 3, end_mid_step: false });
        let snap = Snapshot::from_events(&ev);
        assert!(snap.ended);
        assert_eq!(snap.steps.len(), 3);
        assert_eq!((snap.transfers.h2d.inflight, snap.transfers.d2h.inflight), (0, 0));
        assert!(snap.activations.counts.spilled > 0 && snap.activations.counts.restored == snap.activations.counts.spilled);
        assert!(snap.weights.prefetch_hits > 0 && snap.weights.prefetch_misses > 0);
    }

    #[test]
    fn publishing_on_a_bus_gives_the_same_run() {
        let run = SyntheticRun { blocks: 6, steps: 2, end_mid_step: false };
        #[derive(Clone, Default)]
        struct Keep(std::sync::Arc<std::sync::Mutex<Vec<Event>>>);
        impl crate::EventSink for Keep {
            fn on_event(&mut self, e: &Event) {
                self.0.lock().expect("keep").push(e.clone());
            }
        }
        let keep = Keep::default();
        let bus = Bus::new();
        bus.hub().expect("enabled bus").add_sink(Box::new(keep.clone()));
        let n = publish(run, &bus, Duration::ZERO);
        bus.flush();
        let live = keep.0.lock().expect("keep").clone();
        let recorded = events(run);
        assert_eq!(n as usize, recorded.len());
        assert_eq!(live.len(), recorded.len());
        for (l, r) in live.iter().zip(&recorded) {
            assert_eq!((l.step, l.phase), (r.step, r.phase), "seq {}", r.seq);
            match (&l.kind, &r.kind) {
                (EventKind::PhaseChanged { from: lf, to: lt, .. }, EventKind::PhaseChanged { from: rf, to: rt, .. }) => {
                    assert_eq!((lf, lt), (rf, rt));
                }
                (EventKind::RunStarted { model: lm, .. }, EventKind::RunStarted { model: rm, .. }) => {
                    assert_eq!(lm, rm);
                }
                (a, b) => assert_eq!(a, b),
            }
        }
    }
}
