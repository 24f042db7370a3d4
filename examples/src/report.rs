//! The demo's printed summary: each figure read from the run's snapshot (the one the page,
//! `stagehand-top`, `/api/*` and `/metrics` show), never computed a second way. The loss and
//! the mean step time, which no view keeps for every step, come from the run's own record.

use crate::trainer::{Memory, Summary};
use stagehand::events::Snapshot;

/// What the summary is made from.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    pub summary: &'a Summary,
    /// The run's snapshot once the bus closed.
    pub snapshot: &'a Snapshot,
    pub memory: Memory,
    /// The device budget (Stagehand runs).
    pub budget: u64,
    /// Whether device memory was measured (not for plain tch on the host device, whose
    /// simulated VRAM does not count its tensors).
    pub vram_measured: bool,
    pub steps_asked: u64,
    /// The signal that stopped the run early, if one did.
    pub stopped_by: Option<&'a str>,
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl Report<'_> {
    /// The summary's lines, as the demo prints them under `summary`.
    pub fn lines(&self) -> Vec<String> {
        let (s, snap) = (self.summary, self.snapshot);
        let mut out = Vec::new();
        if let Some(name) = self.stopped_by {
            out.push(format!("  stopped    by {name} after step {} of {}", s.steps, self.steps_asked));
        }
        if s.losses.is_empty() {
            out.push("  loss       no step finished".into());
        } else {
            let (first, last) = s.loss_drop();
            out.push(format!("  loss       {first:.3} -> {last:.3} (mean of the first and last tenth)"));
        }
        out.push(format!(
            "  step time  {:.1} ms mean over steps 2 and later (step 1: {:.1} ms)",
            s.steady_step_s() * 1e3,
            s.step_times.first().copied().unwrap_or(0.0) * 1e3
        ));
        // The run's peak, as every surface shows it.
        out.push(match (self.memory, self.vram_measured) {
            (Memory::Stagehand, _) => {
                format!("  peak VRAM  {:.1} MiB of a {:.0} MiB budget", mib(snap.vram_peak_bytes), mib(self.budget))
            }
            (Memory::Resident, true) => format!("  peak VRAM  {:.1} MiB (resident: no budget)", mib(snap.vram_peak_bytes)),
            (Memory::Resident, false) => {
                "  peak VRAM  not measured: on the host device plain tch's tensors are outside the simulated VRAM".into()
            }
        });
        if self.memory == Memory::Stagehand {
            out.push(format!(
                "  moved      {:.1} MiB H2D, {:.1} MiB D2H (weights, gradients, activations)",
                mib(snap.transfers.h2d.bytes),
                mib(snap.transfers.d2h.bytes)
            ));
            let w = &snap.weights;
            out.push(format!(
                "  weights    {} prefetch hits, {} misses ({:.1}% hit rate), {} evictions",
                w.prefetch_hits,
                w.prefetch_misses,
                100.0 * w.hit_rate(),
                w.evictions
            ));
            let a = &snap.activations;
            out.push(format!(
                "  activations {} saved, {} spilled ({:.1} MiB), {} restored ({} predicted), {} through pageable memory, {} recomputed ({:.1} MiB never stored)",
                a.counts.saved,
                a.counts.spilled,
                mib(a.counts.spill_bytes),
                a.counts.restored,
                a.counts.predicted,
                a.counts.pool_misses,
                a.counts.recomputed,
                mib(a.counts.recompute_bytes)
            ));
            if let Some(g) = s.guards {
                let found = snap.non_finite.values().fold(0u64, |t, n| t.saturating_add(*n));
                out.push(format!(
                    "  guards     checked {} block outputs, {} gradients and {} losses in {} steps: {}",
                    g.outputs,
                    g.gradients,
                    g.losses,
                    g.steps,
                    if found == 0 { "no NaN or infinity".to_owned() } else { format!("{found} non-finite values (see the findings)") }
                ));
            }
            if let Some((written, verified)) = s.checksums {
                out.push(format!(
                    "  checksums  {written} spills checksummed, {verified} restores checked against them: every one unchanged"
                ));
            }
            if let Some((step, t)) = snap.last_finished_step().and_then(|r| r.time.map(|t| (r.step, t))) {
                out.push(format!(
                    "  last step  {step}: {:.1} ms, compute {:.1}, waiting on copies {:.1} in / {:.1} out, stalls {:.1}, optimizer {:.1}",
                    t.step_ms,
                    t.compute_ms,
                    t.h2d_wait_ms,
                    t.d2h_wait_ms,
                    t.weight_stall_ms + t.restore_stall_ms,
                    t.optimizer_ms
                ));
            }
        }
        out.push(format!(
            "  events     {} recorded, {} dropped, {} lost writing the telemetry",
            snap.events_applied, snap.dropped_events, snap.telemetry_lost
        ));
        out
    }
}

/// The mean of `steps`' breakdowns, as the benches print it: "time per step: compute .., H2D
/// wait .., ... other .. ms".
pub fn time_per_step(steps: &[stagehand::events::StepTimeBreakdown]) -> String {
    let avg = |f: fn(&stagehand::events::StepTimeBreakdown) -> f64| steps.iter().map(f).sum::<f64>() / steps.len().max(1) as f64;
    format!(
        "time per step: compute {:.1}, H2D wait {:.1}, D2H wait {:.1}, weight stalls {:.1}, restore stalls {:.1}, optimizer {:.1}, other {:.1} ms",
        avg(|b| b.compute_ms),
        avg(|b| b.h2d_wait_ms),
        avg(|b| b.d2h_wait_ms),
        avg(|b| b.weight_stall_ms),
        avg(|b| b.restore_stall_ms),
        avg(|b| b.optimizer_ms),
        avg(|b| b.other_ms)
    )
}
