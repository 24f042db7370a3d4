//! Plain-language findings about a run: the reason the dashboards exist.
//!
//! [`findings`] reads a [`Snapshot`] and says, in a sentence each, what is off (weights
//! thrashing, prefetches landing late, the activation pool too small, copies through pageable
//! memory, telemetry lost, ...) and which knob fixes it. It is a pure function of the snapshot, so
//! stagehand-top, the web page and the API say the same thing live and in replay.
//!
//! Judgements use the newest *finished* step after the first ([`Snapshot::last_finished_step`]),
//! live and in a replay alike: never the step in progress, whose record fills only as it ends,
//! and never step 1, which traces the itinerary and warms the pools, so its misses say nothing
//! about the configuration.
//!
//! Every knob a finding names is one of [`KNOBS`]: a method of the `Stagehand` builder (or, for
//! the learning rate, of the handle's optimizer, for micro-batches, of its step, and for
//! checkpointed blocks, of the model) and a flag of the demo with the same name.

use super::snapshot::{Snapshot, StepRecord};
use serde::{Deserialize, Serialize};

/// How much a finding matters.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth knowing; nothing is wrong.
    Info,
    /// The run is slower or larger than it needs to be.
    Warn,
    /// Something failed or data was lost.
    Error,
}

/// One finding: what is off, by how much, and the knob that fixes it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// Stable identifier ("weights_thrashing", "prefetch_late", ...), for tests and filters.
    pub id: String,
    pub severity: Severity,
    /// The sentence a user reads.
    pub message: String,
    /// The setting that changes it (empty when none does).
    pub knob: String,
}

/// A setting a finding can name: where it is set in a program and on the demo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knob {
    /// The name findings use (the builder method's name).
    pub name: &'static str,
    /// How a program sets it.
    pub code: &'static str,
    /// The demo's flag.
    pub flag: &'static str,
}

/// Every setting a finding names.
pub const KNOBS: &[Knob] = &[
    Knob { name: "budget_mib", code: "Stagehand::builder().budget_mib(mib)", flag: "--budget-mib" },
    Knob { name: "prefetch_window", code: "Stagehand::builder().prefetch_window(blocks)", flag: "--prefetch-window" },
    Knob { name: "max_inflight_h2d", code: "Stagehand::builder().max_inflight_h2d(copies)", flag: "--max-inflight-h2d" },
    Knob { name: "max_inflight_d2h", code: "Stagehand::builder().max_inflight_d2h(copies)", flag: "--max-inflight-d2h" },
    Knob { name: "restore_lookahead", code: "Stagehand::builder().restore_lookahead(tensors)", flag: "--restore-lookahead" },
    Knob { name: "slabs_per_class", code: "Stagehand::builder().slabs_per_class(slabs)", flag: "--slabs-per-class" },
    Knob {
        name: "activation_pool_limit",
        code: "Stagehand::builder().activation_pool_limit_bytes(bytes)",
        flag: "--activation-pool-limit",
    },
    Knob { name: "learning_rate", code: "sh.optimizer(config, learning_rate)", flag: "--learning-rate" },
    Knob { name: "optimizer_state", code: "Stagehand::builder().optimizer_state(StateStorage::Bf16)", flag: "--optimizer-state" },
    Knob {
        name: "checkpoint",
        code: "activations::recompute over each block's input and weights (the demo's GptConfig::checkpoint)",
        flag: "--checkpoint",
    },
    Knob { name: "micro_batches", code: "sh.train_step_micro(opt, micro_batches, |i| loss_i)", flag: "--micro-batches" },
    Knob {
        name: "telemetry_level",
        code: "Stagehand::builder().telemetry(TelemetryConfig { level, .. })",
        flag: "--telemetry-level",
    },
];

/// A finding's knob text: the settings that change it (each one of [`KNOBS`]), then how.
fn knob(names: &[&str], how: &str) -> String {
    debug_assert!(names.iter().all(|n| KNOBS.iter().any(|k| k.name == *n)), "{names:?}");
    format!("{}: {how}", names.join(" or "))
}

/// A share of the step above which a wait is worth a finding.
const WAIT_SHARE: f64 = 0.05;
/// A share of the step waiting for the host optimizer above which its pass is the step's wall.
const OPTIMIZER_SHARE: f64 = 0.25;
/// Prefetch hit rate below which the weights count as thrashing.
const HIT_RATE_FLOOR: f64 = 0.9;

fn finding(id: &str, severity: Severity, message: String, knob: &str) -> Finding {
    Finding {
        id: id.to_owned(),
        severity,
        message,
        knob: knob.to_owned(),
    }
}

/// The newest finished step after the first (steady state), if any: never the step in
/// progress, whose record fills only as it ends.
fn steady_step(s: &Snapshot) -> Option<&StepRecord> {
    s.steps.iter().rev().filter(|r| r.step > 1).find(|r| s.is_finished(r))
}

/// Everything worth saying about the run so far, most severe first.
pub fn findings(s: &Snapshot) -> Vec<Finding> {
    let mut out = Vec::new();
    incidents(s, &mut out);
    if let Some(r) = steady_step(s) {
        time(r, &mut out);
        weights(s, r, &mut out);
        activations(r, &mut out);
    }
    memory(s, &mut out);
    out.sort_by_key(|f| std::cmp::Reverse(f.severity));
    out
}

/// How weights reach the device when the run has no weight pool (blocks kept in host memory
/// load straight from their pinned host copies; only blocks streamed from a file stage through
/// a pool), with the pinned bytes that takes; `None` without such blocks.
pub fn weights_without_pool(s: &Snapshot) -> Option<String> {
    let host: Vec<_> = s.blocks.iter().filter(|b| !b.file_backed).collect();
    if host.is_empty() {
        return None;
    }
    let bytes = host.iter().fold(0u64, |t, b| t.saturating_add(b.bytes));
    let grads = host.iter().filter(|b| b.trainable).fold(0u64, |t, b| t.saturating_add(b.bytes));
    Some(format!(
        "no staging pool: {} blocks load straight from their pinned host copies ({} pinned{})",
        host.len(),
        human_bytes(bytes),
        if grads > 0 { format!(", and {} for their gradients", human_bytes(grads)) } else { String::new() }
    ))
}

/// What the screens say when there are no findings.
pub fn nothing_found(s: &Snapshot) -> &'static str {
    if s.ended {
        "Nothing looked off in this run."
    } else if s.last_finished_step().is_none() {
        "No step has finished yet: findings judge finished steps."
    } else {
        "Nothing looks off so far."
    }
}

fn incidents(s: &Snapshot, out: &mut Vec<Finding>) {
    let refused = s.refused_total();
    if refused > 0 {
        let reasons: Vec<String> = s.refused.iter().map(|(r, n)| format!("{n} {r}")).collect();
        out.push(finding(
            "events_refused",
            Severity::Warn,
            format!(
                "{refused} events were refused as out of bounds ({}): the source is damaged or \
                 not a run of this version, and the views leave those events out",
                reasons.join(", ")
            ),
            "",
        ));
    }
    if s.dropped_events > 0 {
        out.push(finding(
            "events_dropped",
            Severity::Warn,
            format!(
                "{} events were dropped because a consumer fell behind; totals miss them",
                s.dropped_events
            ),
            &knob(&["telemetry_level"], "summary writes a few KB a step where full writes every event, and keeps up"),
        ));
    }
    if s.telemetry_lost > 0 {
        out.push(finding(
            "telemetry_lost",
            Severity::Error,
            format!(
                "{} events could not be written to the telemetry file (disk full or closed)",
                s.telemetry_lost
            ),
            "free disk space, or a telemetry file on another disk",
        ));
    }
    if let Some(o) = s.out_of_memory.back() {
        out.push(finding(
            "out_of_memory",
            Severity::Error,
            format!(
                "the device ran out of memory at step {} ({}) asking for {} while {}; weights held {}, activations {}, other {}",
                o.step,
                o.phase,
                human_bytes(o.requested_bytes),
                o.doing,
                human_bytes(o.owners.weights_bytes),
                human_bytes(o.owners.activations_kept_bytes.saturating_add(o.owners.activations_restored_bytes)),
                human_bytes(o.owners.other_bytes)
            ),
            &knob(&["budget_mib"], "a budget further under the device's memory leaves the allocator room"),
        ));
    }
    let nonfinite = s.non_finite.values().fold(0u64, |t, n| t.saturating_add(*n));
    if nonfinite > 0 {
        let first = s
            .first_non_finite_block
            .and_then(|b| s.block(b))
            .map(|b| format!(", first in block '{}'", b.name))
            .unwrap_or_default();
        out.push(finding(
            "non_finite",
            Severity::Error,
            format!("{nonfinite} non-finite values (NaN or infinity){first}"),
            &knob(&["learning_rate"], "a smaller one (or clip the gradients in your loop)"),
        ));
    }
}

fn time(r: &StepRecord, out: &mut Vec<Finding>) {
    let Some(t) = r.time else { return };
    if t.step_ms <= 0.0 {
        return;
    }
    let share = |ms: f64| ms / t.step_ms;
    if share(t.h2d_wait_ms) > WAIT_SHARE {
        out.push(finding(
            "prefetch_late",
            Severity::Warn,
            format!(
                "step {}: the GPU waited {:.1} ms ({:.0}%) for weight and restore copies still landing",
                r.step,
                t.h2d_wait_ms,
                100.0 * share(t.h2d_wait_ms)
            ),
            &knob(&["prefetch_window", "budget_mib"], "load further ahead, or give the weights more room"),
        ));
    }
    if share(t.weight_stall_ms) > WAIT_SHARE {
        out.push(finding(
            "weight_stalls",
            Severity::Warn,
            format!(
                "step {}: {:.1} ms ({:.0}%) spent loading weight blocks on demand",
                r.step,
                t.weight_stall_ms,
                100.0 * share(t.weight_stall_ms)
            ),
            &knob(&["prefetch_window", "max_inflight_h2d"], "prefetch further ahead, or more loads in flight at once"),
        ));
    }
    if share(t.restore_stall_ms) > WAIT_SHARE {
        out.push(finding(
            "restore_stalls",
            Severity::Warn,
            format!(
                "step {}: {:.1} ms ({:.0}%) spent restoring spilled activations on demand",
                r.step,
                t.restore_stall_ms,
                100.0 * share(t.restore_stall_ms)
            ),
            &knob(&["restore_lookahead"], "restore more tensors ahead of backward"),
        ));
    }
    if share(t.optimizer_ms) > OPTIMIZER_SHARE {
        out.push(finding(
            "optimizer_wait",
            Severity::Info,
            format!(
                "step {}: the GPU waited {:.1} ms ({:.0}%) for the host optimizer, whose pass over the masters and moments host memory bandwidth bounds",
                r.step,
                t.optimizer_ms,
                100.0 * share(t.optimizer_ms)
            ),
            &knob(
                &["micro_batches", "optimizer_state", "checkpoint"],
                "more tokens a step for the same host pass (micro-batches), or fewer host bytes a step: moments stored in bf16 or int8, or checkpointed blocks, whose activations do not cross the same memory",
            ),
        ));
    }
    if share(t.d2h_wait_ms) > WAIT_SHARE {
        out.push(finding(
            "d2h_wait",
            Severity::Warn,
            format!(
                "step {}: {:.1} ms ({:.0}%) waiting on spills and gradients leaving the device",
                r.step,
                t.d2h_wait_ms,
                100.0 * share(t.d2h_wait_ms)
            ),
            &knob(&["max_inflight_d2h", "budget_mib"], "more spills in flight, or a larger budget (the plan then spills less)"),
        ));
    }
}

fn weights(s: &Snapshot, r: &StepRecord, out: &mut Vec<Finding>) {
    let Some(w) = &r.weights else { return };
    let seen = w.prefetch_hits.saturating_add(w.prefetch_misses);
    if seen > 0 && w.hit_rate < HIT_RATE_FLOOR {
        out.push(finding(
            "weights_thrashing",
            Severity::Warn,
            format!(
                "step {}: only {:.0}% of weight blocks were prefetched in time ({} misses, {} evictions)",
                r.step,
                100.0 * w.hit_rate,
                w.prefetch_misses,
                w.evictions
            ),
            &knob(&["budget_mib", "prefetch_window"], "more room for the weights, or a smaller window if evictions are high"),
        ));
    }
    let blocks = s.blocks.len() as u64;
    if blocks > 0 && w.evictions > blocks.saturating_mul(2) {
        out.push(finding(
            "evictions_high",
            Severity::Warn,
            format!(
                "step {}: {} evictions for {} blocks: blocks are loaded more than twice per step",
                r.step, w.evictions, blocks
            ),
            &knob(&["budget_mib", "prefetch_window"], "more room for the weights, or a smaller window"),
        ));
    }
}

fn activations(r: &StepRecord, out: &mut Vec<Finding>) {
    let Some(a) = &r.activations else { return };
    if a.pool_misses > 0 {
        out.push(finding(
            "pool_too_small",
            Severity::Warn,
            format!(
                "step {}: {} spills found no free pinned slab and went to pageable memory (slower copies)",
                r.step, a.pool_misses
            ),
            // The pool is cut from what the traced step held, within its pinned limit: slabs
            // are missing either because the step spilled more than the trace, or because the
            // limit kept the pool from growing to it.
            &knob(
                &["slabs_per_class", "activation_pool_limit"],
                "more pinned slabs in each size class of the activation pool, or a higher limit on its pinned memory",
            ),
        ));
    }
}

/// The newest finished step, the first included: the budget is a promise for every step.
fn memory(s: &Snapshot, out: &mut Vec<Finding>) {
    let Some(budget) = s.vram_budget_bytes() else { return };
    let Some((step, peak)) = s.last_finished_step().and_then(|r| r.train.as_ref().map(|t| (r.step, t.vram_peak_bytes))) else {
        return;
    };
    if budget > 0 && peak > budget {
        out.push(finding(
            "over_budget",
            Severity::Warn,
            format!(
                "step {step}: device memory peaked at {} against a budget of {} (the handle lowers its spill watermarks after such a step)",
                human_bytes(peak),
                human_bytes(budget)
            ),
            &knob(&["budget_mib"], "a budget further under the device's memory leaves the allocator and the ops' temporaries room"),
        ));
    }
}

/// Bytes in binary units, e.g. "1.5 GiB".
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    fn at(seq: u64, step: u64, kind: EventKind) -> Event {
        Event::new(seq, seq * 1000, step, Phase::StepEnd, kind)
    }

    fn ids(s: &Snapshot) -> Vec<String> {
        findings(s).into_iter().map(|f| f.id).collect()
    }

    #[test]
    fn a_healthy_run_has_nothing_to_say() {
        let mut s = Snapshot::new();
        s.apply(&at(1, 2, EventKind::StepTime(StepTimeBreakdown { step_ms: 100.0, compute_ms: 97.0, h2d_wait_ms: 1.0, ..Default::default() })));
        s.apply(&at(
            2,
            2,
            EventKind::WeightStep(WeightStepMetrics { prefetch_hits: 10, hit_rate: 1.0, ..Default::default() }),
        ));
        assert!(findings(&s).is_empty(), "{:?}", findings(&s));
    }

    #[test]
    fn refused_events_are_a_finding() {
        let mut s = Snapshot::new();
        s.apply(&at(1, 1, EventKind::PrefetchHit { block: BlockId(4_000_000_000) }));
        let f = findings(&s);
        assert_eq!(ids(&s), ["events_refused"]);
        assert!(f[0].message.contains("1 unknown_block"), "{}", f[0].message);
    }

    #[test]
    fn the_first_step_is_not_judged() {
        let mut s = Snapshot::new();
        s.apply(&at(
            1,
            1,
            EventKind::WeightStep(WeightStepMetrics { prefetch_misses: 10, hit_rate: 0.0, ..Default::default() }),
        ));
        assert!(ids(&s).is_empty());
        s.apply(&at(
            2,
            2,
            EventKind::WeightStep(WeightStepMetrics { prefetch_hits: 1, prefetch_misses: 9, hit_rate: 0.1, ..Default::default() }),
        ));
        assert_eq!(ids(&s), ["weights_thrashing"]);
    }

    #[test]
    fn a_live_run_is_judged_by_its_newest_finished_step_not_the_one_in_progress() {
        let mut s = Snapshot::new();
        let phase = |seq, step, from, to| Event::new(seq, seq * 1000, step, to, EventKind::PhaseChanged { from, to, duration_s: 0.0 });
        s.apply(&at(
            1,
            2,
            EventKind::WeightStep(WeightStepMetrics { prefetch_hits: 7, prefetch_misses: 3, hit_rate: 0.7, ..Default::default() }),
        ));
        s.apply(&at(2, 2, EventKind::StepTime(StepTimeBreakdown { step_ms: 100.0, weight_stall_ms: 20.0, ..Default::default() })));
        assert_eq!(ids(&s), ["weight_stalls", "weights_thrashing"]);
        // Step 3 begins: its record exists, still empty, while the run goes on.
        s.apply(&phase(3, 3, Phase::Idle, Phase::StepBegin));
        s.apply(&phase(4, 3, Phase::StepBegin, Phase::Forward));
        assert_eq!(ids(&s), ["weight_stalls", "weights_thrashing"], "step 2 is still the newest finished step");
        assert!(findings(&s)[0].message.starts_with("step 2:"), "{:?}", findings(&s));
    }

    #[test]
    fn waits_over_a_twentieth_of_the_step_name_their_knob() {
        let mut s = Snapshot::new();
        s.apply(&at(
            1,
            3,
            EventKind::StepTime(StepTimeBreakdown {
                step_ms: 100.0,
                h2d_wait_ms: 20.0,
                restore_stall_ms: 6.0,
                weight_stall_ms: 4.0,
                ..Default::default()
            }),
        ));
        let f = findings(&s);
        let late = f.iter().find(|f| f.id == "prefetch_late").expect("late prefetch reported");
        assert!(late.message.contains("20%"), "{}", late.message);
        assert!(late.knob.starts_with("prefetch_window or budget_mib: "), "{}", late.knob);
        assert!(f.iter().any(|f| f.id == "restore_stalls"));
        assert!(!f.iter().any(|f| f.id == "weight_stalls"), "4% is under the threshold");
    }

    #[test]
    fn a_step_that_waits_for_the_host_optimizer_says_so() {
        let with = |step: u64, optimizer_ms: f64| {
            let mut s = Snapshot::new();
            s.apply(&at(1, step, EventKind::StepTime(StepTimeBreakdown { step_ms: 300.0, optimizer_ms, ..Default::default() })));
            findings(&s).into_iter().find(|f| f.id == "optimizer_wait")
        };
        let f = with(2, 180.0).expect("60% of the step");
        assert_eq!(f.severity, Severity::Info);
        assert!(f.message.contains("180.0 ms (60%)"), "{}", f.message);
        assert!(f.knob.starts_with("micro_batches or optimizer_state or checkpoint: "), "{}", f.knob);
        assert!(with(2, 60.0).is_none(), "20% is under the threshold");
        assert!(with(1, 180.0).is_none(), "step 1 says nothing about the configuration");
    }

    #[test]
    fn losses_and_failures_come_first() {
        let mut s = Snapshot::new();
        s.apply(&at(
            1,
            2,
            EventKind::ActivationStep(ActivationStepMetrics { pool_misses: 3, ..Default::default() }),
        ));
        s.apply(&at(
            2,
            2,
            EventKind::TelemetryLost { sink: "jsonl".into(), lost: 5, total: 5, reason: "disk full".into() },
        ));
        let f = findings(&s);
        assert_eq!(f[0].id, "telemetry_lost");
        assert_eq!(f[0].severity, Severity::Error);
        assert!(f.iter().any(|f| f.id == "pool_too_small" && f.knob.contains("slabs_per_class") && f.knob.contains("activation_pool_limit")));
    }

    #[test]
    fn every_knob_named_is_a_known_setting() {
        // A run that trips every finding that names a setting.
        let mut s = Snapshot::new();
        s.apply(&at(1, 0, EventKind::LimitsSet { owner: Owner::Device, budget_bytes: 10, high_watermark_bytes: None, low_watermark_bytes: None }));
        s.apply(&at(2, 0, EventKind::BlockRegistered { block: BlockId(0), name: "b".into(), bytes: 1, exec_order: 0, file_backed: false, trainable: true }));
        s.apply(&at(3, 2, EventKind::WeightStep(WeightStepMetrics { prefetch_misses: 9, evictions: 9, hit_rate: 0.0, ..Default::default() })));
        s.apply(&at(4, 2, EventKind::ActivationStep(ActivationStepMetrics { pool_misses: 1, ..Default::default() })));
        s.apply(&at(5, 2, EventKind::TrainStep(TrainStepMetrics { vram_peak_bytes: 11, ..Default::default() })));
        let each = 20.0;
        s.apply(&at(6, 2, EventKind::StepTime(StepTimeBreakdown {
            step_ms: 100.0,
            h2d_wait_ms: each,
            d2h_wait_ms: each,
            weight_stall_ms: each,
            restore_stall_ms: each,
            ..Default::default()
        })));
        s.apply(&at(7, 2, EventKind::NonFinite { block: None, tensor: "loss".into() }));
        let f = findings(&s);
        assert_eq!(f.iter().filter(|f| !f.knob.is_empty()).count(), 9, "{:?}", ids(&s));
        let mut d = s.clone();
        d.apply(&at(8, 2, EventKind::EventsDropped { total: 3 }));
        assert!(findings(&d).iter().any(|f| f.id == "events_dropped" && f.knob.starts_with("telemetry_level: ")));
        for x in f.iter().filter(|f| !f.knob.is_empty()) {
            let (names, how) = x.knob.split_once(": ").expect("names, then how");
            assert!(!how.is_empty());
            for n in names.split(" or ") {
                assert!(KNOBS.iter().any(|k| k.name == n), "{}: '{n}' is not a known setting", x.id);
            }
        }
    }

    #[test]
    fn binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
    }
}
