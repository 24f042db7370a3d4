//! The panels that say why a step is slow and where VRAM went: the findings, each step's time
//! by cause, and device memory by owner over a step and at its fullest reading.

use super::figures::{bytes_axis, decimal_axis, ms, Axis};
use serde::Serialize;
use stagehand_events::insight::{self, Severity};
use stagehand_events::snapshot::StepRecord;
use stagehand_events::{Phase, Snapshot, StepTimeBreakdown, VramByOwner};

/// Steps shown in the time chart.
pub const TIME_STEPS: usize = 60;
/// Characters of a finding's sentence or knob kept (a replayed file may say anything).
const MAX_FINDING_TEXT: usize = 600;

/// A finding as the page lists it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FindingView {
    pub id: String,
    pub severity: Severity,
    pub message: String,
    pub knob: String,
}

fn cut(s: &str) -> String {
    s.chars().take(MAX_FINDING_TEXT).collect()
}

/// What is off in the run and which knob fixes it, most severe first.
pub(crate) fn findings(s: &Snapshot) -> Vec<FindingView> {
    insight::findings(s)
        .into_iter()
        .map(|f| FindingView {
            id: cut(&f.id),
            severity: f.severity,
            message: cut(&f.message),
            knob: cut(&f.knob),
        })
        .collect()
}

/// One cause of a step's time, or one owner of device memory.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Part {
    pub key: &'static str,
    pub label: &'static str,
}

/// A key, a label, and how to read the figure.
type Reading<T, V> = (&'static str, &'static str, fn(&T) -> V);

/// The causes of a step's time, in the order they stack.
const TIME_PARTS: [Reading<StepTimeBreakdown, f64>; 7] = [
    ("compute", "compute", |t| t.compute_ms),
    ("h2d_wait", "waiting on H2D copies", |t| t.h2d_wait_ms),
    ("d2h_wait", "waiting on D2H copies", |t| t.d2h_wait_ms),
    ("weight_stall", "weight load stalls", |t| t.weight_stall_ms),
    ("restore_stall", "restore stalls", |t| t.restore_stall_ms),
    ("optimizer", "optimizer", |t| t.optimizer_ms),
    ("other", "other", |t| t.other_ms),
];

/// One cause's figures in the newest step.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct PartFigure {
    pub key: &'static str,
    pub ms: f64,
    /// Percent of the step.
    pub share: f64,
}

/// The newest step's breakdown.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NewestStep {
    pub step: u64,
    pub step_ms: f64,
    pub parts: Vec<PartFigure>,
    /// Whether the host optimizer overlapped backward, where it stepped blocks this step.
    pub host_optimizer: Option<HostSteps>,
}

/// The blocks the host optimizer stepped in a step, and how many of them it was given while
/// backward ran (the rest waited for the optimizer's call, after backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct HostSteps {
    pub stepped: u64,
    pub during_backward: u64,
}

/// Where each recent step's time went: a stacked bar per step.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepTimePanel {
    pub parts: Vec<Part>,
    /// The steps shown, oldest first.
    pub steps: Vec<u64>,
    pub step_ms: Vec<f64>,
    /// `ms[part][i]`: milliseconds of part `part` in step `steps[i]`.
    pub ms: Vec<Vec<f64>>,
    pub newest: Option<NewestStep>,
    pub axis: Axis,
}

pub(crate) fn step_time(s: &Snapshot) -> StepTimePanel {
    let timed: Vec<(u64, StepTimeBreakdown)> = s
        .steps
        .iter()
        .filter_map(|r| r.time.map(|t| (r.step, t)))
        .collect();
    let recent = &timed[timed.len().saturating_sub(TIME_STEPS)..];
    let newest = recent.last().map(|(step, t)| NewestStep {
        step: *step,
        step_ms: ms(t.step_ms),
        parts: TIME_PARTS
            .iter()
            .map(|(key, _, get)| PartFigure {
                key,
                ms: ms(get(t)),
                share: if t.step_ms > 0.0 { super::figures::round(100.0 * get(t) / t.step_ms, 1) } else { 0.0 },
            })
            .collect(),
        host_optimizer: s
            .step_record(*step)
            .and_then(|r| r.weights.as_ref())
            .filter(|w| w.host_steps > 0)
            .map(|w| HostSteps { stepped: w.host_steps, during_backward: w.host_steps_during_backward() }),
    });
    let top = recent.iter().map(|(_, t)| t.step_ms).fold(0.0, f64::max);
    StepTimePanel {
        parts: TIME_PARTS.iter().map(|(key, label, _)| Part { key, label }).collect(),
        steps: recent.iter().map(|(s, _)| *s).collect(),
        step_ms: recent.iter().map(|(_, t)| ms(t.step_ms)).collect(),
        ms: TIME_PARTS
            .iter()
            .map(|(_, _, get)| recent.iter().map(|(_, t)| ms(get(t))).collect())
            .collect(),
        newest,
        axis: decimal_axis(top, "ms"),
    }
}

/// The owners of device memory, in the order they stack.
const OWNERS: [Reading<VramByOwner, u64>; 5] = [
    ("weights", "resident weights", |o| o.weights_bytes),
    ("activations_kept", "kept activations", |o| o.activations_kept_bytes),
    ("activations_restored", "restored, waiting for backward", |o| o.activations_restored_bytes),
    ("copies_in_flight", "copies in flight", |o| o.copies_in_flight_bytes),
    ("other", "other", |o| o.other_bytes),
];

/// One owner's bytes at the step's peak.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct OwnerFigure {
    pub key: &'static str,
    pub bytes: u64,
}

/// Device memory by owner at a step's fullest reading (the one with the most allocated).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AtPeak {
    pub step: u64,
    pub allocated_bytes: u64,
    pub parts: Vec<OwnerFigure>,
}

/// Where VRAM went over one step (stacked by owner), and at its fullest reading.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct OwnersPanel {
    /// The step shown: the newest finished one (the one in progress until a step has finished).
    pub step: Option<u64>,
    pub owners: Vec<Part>,
    /// Milliseconds since the step's first reading.
    pub t_ms: Vec<f64>,
    pub phase: Vec<Phase>,
    /// `bytes[owner][i]`.
    pub bytes: Vec<Vec<u64>>,
    pub at_peak: Option<AtPeak>,
    pub axis: Axis,
}

/// The step the owners panel shows: the newest finished one ([`Snapshot::is_finished`]) with
/// readings, else the newest with readings.
pub fn owners_step(s: &Snapshot) -> Option<u64> {
    let finished = |step: u64| s.step_record(step).map_or(step < s.step, |r| s.is_finished(r));
    let mut steps = s.vram_owners_history.iter().map(|r| r.step).filter(|st| *st > 0);
    steps.clone().rev().find(|st| finished(*st)).or_else(|| steps.next_back())
}

pub(crate) fn owners(s: &Snapshot) -> OwnersPanel {
    let step = owners_step(s);
    let readings: Vec<_> = s
        .vram_owners_history
        .iter()
        .filter(|r| Some(r.step) == step)
        .collect();
    let t0 = readings.first().map_or(0, |r| r.t_ns);
    let at_peak = step
        .and_then(|st| s.step_record(st))
        .and_then(|r: &StepRecord| r.vram_at_peak.map(|p| (r.step, p)))
        .map(|(step, p)| AtPeak {
            step,
            allocated_bytes: p.allocated_bytes,
            parts: OWNERS.iter().map(|(key, _, get)| OwnerFigure { key, bytes: get(&p) }).collect(),
        });
    let top = readings
        .iter()
        .map(|r| OWNERS.iter().map(|(_, _, get)| get(&r.owners)).sum::<u64>().max(r.owners.allocated_bytes))
        .max()
        .unwrap_or(0);
    OwnersPanel {
        step,
        owners: OWNERS.iter().map(|(key, label, _)| Part { key, label }).collect(),
        t_ms: readings.iter().map(|r| ms(r.t_ns.saturating_sub(t0) as f64 / 1e6)).collect(),
        phase: readings.iter().map(|r| r.phase).collect(),
        bytes: OWNERS
            .iter()
            .map(|(_, _, get)| readings.iter().map(|r| get(&r.owners)).collect())
            .collect(),
        at_peak,
        axis: bytes_axis(top),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_events::synthetic::{self, SyntheticRun};

    #[test]
    fn panels_carry_the_snapshots_figures() {
        let s = Snapshot::from_events(&synthetic::events(SyntheticRun::finished(5)));
        let t = step_time(&s);
        let newest = t.newest.as_ref().expect("a timed step");
        let rec = s.steps.iter().rev().find(|r| r.time.is_some()).expect("a timed step");
        let want = rec.time.expect("time");
        assert_eq!(newest.step, rec.step);
        assert_eq!(newest.step_ms, ms(want.step_ms));
        assert_eq!(newest.parts[0].ms, ms(want.compute_ms));
        assert_eq!(t.ms.len(), 7);
        assert!(t.ms.iter().all(|p| p.len() == t.steps.len()));
        assert!(t.axis.max >= t.step_ms.iter().copied().fold(0.0, f64::max));

        let o = owners(&s);
        let step = o.step.expect("a step with readings");
        assert_eq!(o.t_ms.len(), s.vram_owners_history.iter().filter(|r| r.step == step).count());
        assert!(o.t_ms.first() == Some(&0.0) && o.t_ms.windows(2).all(|w| w[0] <= w[1]));
        let peak = o.at_peak.expect("the step's peak");
        let want = s.step_record(step).and_then(|r| r.vram_at_peak).expect("peak");
        assert_eq!(peak.allocated_bytes, want.allocated_bytes);
        assert_eq!(peak.parts[0].bytes, want.weights_bytes);
        assert_eq!(peak.parts[4].bytes, want.other_bytes);
        assert_eq!(findings(&s).len(), insight::findings(&s).len());
    }

    #[test]
    fn the_newest_step_says_how_the_host_optimizer_overlapped_backward() {
        let mut events = synthetic::events(SyntheticRun::finished(3));
        assert_eq!(step_time(&Snapshot::from_events(&events)).newest.and_then(|n| n.host_optimizer), None, "no host optimizer ran");
        for (stepped, overlapped, said) in [(27, 24, 24), (4, 9, 4)] {
            for e in &mut events {
                if let stagehand_events::EventKind::WeightStep(w) = &mut e.kind {
                    (w.host_steps, w.host_steps_overlapped) = (stepped, overlapped);
                }
            }
            let got = step_time(&Snapshot::from_events(&events)).newest.and_then(|n| n.host_optimizer);
            // A file claiming more blocks overlapped than stepped shows no more than stepped.
            assert_eq!(got, Some(HostSteps { stepped, during_backward: said }));
        }
    }
}
