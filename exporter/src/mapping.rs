//! The one mapping from a run's events to metric values, shared by the Prometheus and the
//! OpenTelemetry exporters ([`Mapper::on_event`]), gauges from the run's [`Snapshot`]
//! ([`gauges`]), and the series that exist from the start ([`initial`]). Each exporter
//! applies the [`Observation`]s to its own instruments, built from [`crate::catalog`].
//!
//! The mapper keeps no copy of the run: it reads the snapshot the hub reduced each event into
//! (`stagehand_events::SnapshotSink`), so a run is reduced once however many exporters watch it.
//!
//! Counters and histograms of what the runtimes count (prefetch hits, copies, spills,
//! evictions, the Conductor's grants and refusals, copy and stall durations) count *finished
//! steps*: they are taken from the snapshot's tallies as each step's aggregate commits there
//! (`weight_step`, `activation_step`, `conductor_step`, `transfer_step`, `step_counts`), never
//! from detail events. A summary-level file has the aggregates and no detail, so the live run
//! and a replay of either file level add the same numbers in the same order: `/metrics` and
//! OTLP agree with the page and the TUI step by step. A histogram's bucket is recorded again
//! from its count and the mean of its values ([`Buckets::representatives`]), which fills the
//! same bucket with the same sum. Events of the run's lifecycle and health (phases, steps,
//! hints, incidents) are in every file and count as they come.

use crate::catalog::Metric;
use stagehand_events::model::{
    BlockState, Buckets, DenyReason, Direction, Event, EventKind, EvictionReason, Owner, PackDecision, Phase, PolicyRule, PoolKind, ReservationMode,
    ReservationOutcome, StepCounts, StepTimeBreakdown, VramByOwner, COPY_SECONDS_BOUNDS, SCHEMA_VERSION,
    STALL_SECONDS_BOUNDS,
};
use stagehand_events::snapshot::StepRecord;
use stagehand_events::{wire_name, Snapshot};
use strum::VariantArray;

/// What to do to a series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// Add to a counter.
    Add(f64),
    /// Set a gauge.
    Set(f64),
    /// Record an observation into a histogram.
    Observe(f64),
    /// Make the series exist (at zero, or empty) without changing it.
    Touch,
}

/// One change to one series: the instrument, its label values (in the catalog's label order)
/// and the value.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub metric: Metric,
    pub labels: Vec<String>,
    pub value: Value,
}

fn obs(metric: Metric, labels: &[&str], value: Value) -> Observation {
    Observation { metric, labels: labels.iter().map(|s| (*s).to_owned()).collect(), value }
}

/// The parts of a step's time, as `part` label values, with their values in seconds.
pub fn time_parts(t: &StepTimeBreakdown) -> [(&'static str, f64); 7] {
    [
        ("compute", t.compute_ms / 1e3),
        ("h2d_wait", t.h2d_wait_ms / 1e3),
        ("d2h_wait", t.d2h_wait_ms / 1e3),
        ("weight_stall", t.weight_stall_ms / 1e3),
        ("restore_stall", t.restore_stall_ms / 1e3),
        ("optimizer", t.optimizer_ms / 1e3),
        ("other", t.other_ms / 1e3),
    ]
}

/// The owners of device memory, as `owner` label values, with their bytes.
pub fn owner_parts(o: &VramByOwner) -> [(&'static str, u64); 5] {
    [
        ("weights", o.weights_bytes),
        ("activations_kept", o.activations_kept_bytes),
        ("activations_restored", o.activations_restored_bytes),
        ("copies_in_flight", o.copies_in_flight_bytes),
        ("other", o.other_bytes),
    ]
}

// The label values a series takes from the first scrape: every variant of the events' enums
// (`strum::VariantArray`), and these subsets, which name what the exporter counts: PCIe copies
// (not collectives) by the two runtimes that copy, the phases a step is timed in, and the
// tensors the guards name (anything else is `other`).
const DIRECTIONS: [Direction; 2] = [Direction::H2d, Direction::D2h];

/// The gauges whose series follow the shape of the run's state (the pools' classes, the owners'
/// limits) rather than fixed label values: an exporter that keeps series between refreshes drops
/// theirs before each one, so a class a pool no longer has (resized to other slabs) does not
/// linger beside the current ones.
pub const SHAPED_GAUGES: [Metric; 4] = [Metric::PoolCapacity, Metric::PoolUsed, Metric::PoolSlabsInUse, Metric::MemoryLimit];
const COPY_OWNERS: [Owner; 2] = [Owner::Weights, Owner::Activations];
const NON_FINITE: [&str; 4] = ["output", "gradient", "loss", "other"];
const STEP_PHASES: [Phase; 5] = [Phase::StepBegin, Phase::Forward, Phase::Backward, Phase::Optimizer, Phase::StepEnd];

fn pool_name(p: PoolKind) -> &'static str {
    match p {
        PoolKind::Weights => "weights",
        PoolKind::Activations => "activations",
    }
}

/// The series that exist from the first scrape, before any event: every counter and histogram
/// series a dashboard queries, at zero, and the gauges whose zero is true before the run has
/// said anything (nothing in flight, nothing reserved), and the loss as NaN until the first step
/// has one (a dashboard's query finds the series, and no false zero). Gauges of what only the
/// run knows (the limits, the pools) appear with their first value.
pub fn initial() -> Vec<Observation> {
    use Metric::*;
    let mut out = vec![
        obs(BuildInfo, &[env!("CARGO_PKG_VERSION"), &SCHEMA_VERSION.to_string()], Value::Set(1.0)),
        obs(Loss, &[], Value::Set(f64::NAN)),
        obs(EventsDropped, &[], Value::Touch),
        obs(TelemetryLost, &[], Value::Touch),
        obs(Step, &[], Value::Set(0.0)),
        obs(StepDuration, &[], Value::Touch),
        obs(PrefetchHits, &[], Value::Touch),
        obs(PrefetchMisses, &[], Value::Touch),
        obs(HostSteps, &["true"], Value::Touch),
        obs(HostSteps, &["false"], Value::Touch),
        obs(ActivationSpill, &[], Value::Touch),
        obs(ActivationRestore, &[], Value::Touch),
        obs(ConductorReserved, &[], Value::Set(0.0)),
        obs(ItineraryChanges, &[], Value::Touch),
        obs(OutOfMemory, &[], Value::Touch),
        obs(FlightRecords, &[], Value::Touch),
    ];
    for (part, _) in time_parts(&StepTimeBreakdown::default()) {
        out.push(obs(StepTime, &[part], Value::Touch));
        out.push(obs(LastStepTime, &[part], Value::Set(0.0)));
    }
    for d in DIRECTIONS {
        out.push(obs(TransferDuration, &[d.as_str()], Value::Touch));
        out.push(obs(TransfersInflight, &[d.as_str()], Value::Set(0.0)));
        for o in COPY_OWNERS {
            out.push(obs(TransferBytes, &[d.as_str(), o.as_str()], Value::Touch));
            out.push(obs(Transfers, &[d.as_str(), o.as_str()], Value::Touch));
        }
    }
    for src in ["weights", "activations"] {
        out.push(obs(StallDuration, &[src], Value::Touch));
    }
    for r in EvictionReason::VARIANTS {
        out.push(obs(Evictions, &[r.into()], Value::Touch));
    }
    for s in BlockState::ALL {
        out.push(obs(ResidencyBlocks, &[s.as_str()], Value::Set(0.0)));
    }
    for &p in PoolKind::VARIANTS {
        out.push(obs(PoolExhausted, &[pool_name(p)], Value::Touch));
        out.push(obs(PoolPageableFallback, &[pool_name(p)], Value::Touch));
    }
    for d in PackDecision::VARIANTS {
        out.push(obs(ActivationsPacked, &[d.into()], Value::Touch));
    }
    for p in ["true", "false"] {
        out.push(obs(ActivationRestores, &[p], Value::Touch));
    }
    for k in ["allocated", "reserved", "peak"] {
        out.push(obs(Vram, &[k], Value::Set(0.0)));
    }
    for (o, _) in owner_parts(&VramByOwner::default()) {
        out.push(obs(VramOwner, &[o], Value::Set(0.0)));
        out.push(obs(VramAtPeak, &[o], Value::Set(0.0)));
    }
    for oc in ReservationOutcome::VARIANTS {
        for m in ReservationMode::VARIANTS {
            out.push(obs(ConductorReservations, &[oc.into(), m.into()], Value::Touch));
        }
    }
    for w in ["reservation", "slot"] {
        out.push(obs(ConductorGrants, &[w], Value::Touch));
        for r in DenyReason::VARIANTS {
            out.push(obs(ConductorDenials, &[w, r.as_str()], Value::Touch));
        }
    }
    for r in PolicyRule::VARIANTS {
        out.push(obs(ConductorHintChanges, &[r.into()], Value::Touch));
    }
    for p in STEP_PHASES {
        out.push(obs(PhaseDuration, &[p.as_str()], Value::Touch));
    }
    for t in NON_FINITE {
        out.push(obs(NonFinite, &[t], Value::Touch));
    }
    out
}

/// A duration in seconds that can be observed: finite and not negative.
fn seconds(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// The newest finished step ([`Snapshot::is_finished`]) that has a reading by owner, with its
/// fullest one.
pub fn last_finished_peak(s: &Snapshot) -> Option<(&StepRecord, VramByOwner)> {
    s.steps.iter().rev().filter(|r| r.step > 0 && s.is_finished(r)).find_map(|r| r.vram_at_peak.map(|p| (r, p)))
}

/// How many commits of each tally the mapper has turned into observations.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    weights: u64,
    activations: u64,
    counts: u64,
}

/// Events to observations. It reads the run's state from the snapshot it is handed and keeps
/// only how much of it was already turned into observations.
#[derive(Debug, Default)]
pub struct Mapper {
    /// The bus's running total of dropped events seen so far.
    dropped_seen: u64,
    seen: Seen,
}

impl Mapper {
    /// A mapper before any event.
    pub fn new() -> Mapper {
        Mapper::default()
    }

    /// A mapper that starts watching a run whose state is `state` already: what the tallies
    /// committed before counts as seen, so counters count from here on.
    pub fn at(state: &Snapshot) -> Mapper {
        let t = &state.tallies;
        Mapper {
            dropped_seen: state.dropped_events,
            seen: Seen { weights: t.weights.commits, activations: t.activations.commits, counts: t.counts.commits },
        }
    }

    /// Appends what event `e` adds to counters and histograms; `state` is the run's snapshot
    /// after it.
    pub fn on_event(&mut self, e: &Event, state: &Snapshot, out: &mut Vec<Observation>) {
        use Metric::*;
        out.push(obs(Events, &[e.kind.name()], Value::Add(1.0)));
        let one = Value::Add(1.0);
        match &e.kind {
            EventKind::PhaseChanged { from, duration_s, .. } if *from != Phase::Idle => {
                if let Some(s) = seconds(*duration_s) {
                    out.push(obs(PhaseDuration, &[from.as_str()], Value::Observe(s)));
                }
            }
            EventKind::HintsChanged { rule, .. } => out.push(obs(ConductorHintChanges, &[&wire_name(rule)], one)),
            EventKind::TrainStep(m) => {
                if let Some(s) = seconds(m.step_time_s) {
                    out.push(obs(StepDuration, &[], Value::Observe(s)));
                }
            }
            EventKind::StepTime(t) => {
                for (part, s) in time_parts(t) {
                    if let Some(s) = seconds(s) {
                        out.push(obs(StepTime, &[part], Value::Add(s)));
                    }
                }
            }
            EventKind::EventsDropped { total } if *total > self.dropped_seen => {
                out.push(obs(EventsDropped, &[], Value::Add((*total - self.dropped_seen) as f64)));
                self.dropped_seen = *total;
            }
            EventKind::TelemetryLost { lost, .. } => out.push(obs(TelemetryLost, &[], Value::Add(*lost as f64))),
            EventKind::ItineraryChanged { .. } => out.push(obs(ItineraryChanges, &[], one)),
            EventKind::OutOfMemory { .. } => out.push(obs(OutOfMemory, &[], one)),
            EventKind::NonFinite { tensor, .. } => {
                // A label from the run: only known values, so a bad file cannot add series.
                let t = NON_FINITE.iter().find(|k| **k == tensor.as_str()).copied().unwrap_or("other");
                out.push(obs(NonFinite, &[t], one));
            }
            EventKind::FlightRecorded { .. } => out.push(obs(FlightRecords, &[], one)),
            _ => {}
        }
        self.finished_steps(state, out);
    }

    /// What the tallies committed with this event (a step's aggregate, or the detail of a step
    /// that got none): at most one commit per tally and event.
    fn finished_steps(&mut self, state: &Snapshot, out: &mut Vec<Observation>) {
        use Metric::*;
        let t = &state.tallies;
        let add = |out: &mut Vec<Observation>, m: Metric, labels: &[&str], n: u64| {
            if n > 0 {
                out.push(obs(m, labels, Value::Add(n as f64)));
            }
        };
        if t.weights.commits != self.seen.weights {
            self.seen.weights = t.weights.commits;
            let w = &t.weights.last;
            add(out, PrefetchHits, &[], w.prefetch_hits);
            add(out, PrefetchMisses, &[], w.prefetch_misses);
            add(out, HostSteps, &["true"], w.host_steps_overlapped);
            add(out, HostSteps, &["false"], w.host_steps.saturating_sub(w.host_steps_overlapped));
        }
        if t.activations.commits != self.seen.activations {
            self.seen.activations = t.activations.commits;
            let a = &t.activations.last;
            add(out, ActivationSpill, &[], a.spill_bytes);
            add(out, ActivationRestore, &[], a.restore_bytes);
            add(out, ActivationRestores, &["true"], a.predicted);
            add(out, ActivationRestores, &["false"], a.restored.saturating_sub(a.predicted));
        }
        if t.counts.commits != self.seen.counts {
            self.seen.counts = t.counts.commits;
            step_counts(&t.counts.last, out);
        }
    }
}

/// Appends the gauges of the run as `s` has it.
pub fn gauges(s: &Snapshot, out: &mut Vec<Observation>) {
    use Metric::*;
    out.push(obs(Step, &[], Value::Set(s.step as f64)));
    if let Some((_, t)) = s.last_train_step() {
        out.push(obs(Loss, &[], Value::Set(t.loss)));
    }
    if let Some(t) = s.steps.iter().rev().find_map(|r| r.time) {
        for (part, v) in time_parts(&t) {
            out.push(obs(LastStepTime, &[part], Value::Set(v)));
        }
    }
    for d in DIRECTIONS {
        out.push(obs(TransfersInflight, &[d.as_str()], Value::Set(s.transfers.dir(d).inflight as f64)));
    }
    let counts = s.residency_counts();
    for st in BlockState::ALL {
        let n = counts.get(&st).copied().unwrap_or(0);
        out.push(obs(ResidencyBlocks, &[st.as_str()], Value::Set(n as f64)));
    }
    for (kind, pool) in [(PoolKind::Weights, &s.weight_pool), (PoolKind::Activations, &s.activation_pool)] {
        let Some(pool) = pool else { continue };
        for (i, c) in pool.classes.iter().enumerate() {
            let l = [pool_name(kind), &i.to_string(), &c.slab_bytes.to_string()];
            out.push(obs(PoolCapacity, &l, Value::Set(c.slab_bytes as f64 * c.slabs as f64)));
            out.push(obs(PoolUsed, &l, Value::Set(c.slab_bytes as f64 * c.in_use as f64)));
            out.push(obs(PoolSlabsInUse, &l, Value::Set(c.in_use as f64)));
        }
    }
    if let Some(v) = &s.vram {
        // The peak is the run's, as on every other surface.
        for (k, b) in [("allocated", v.allocated_bytes), ("reserved", v.reserved_bytes), ("peak", s.vram_peak_bytes)] {
            out.push(obs(Vram, &[k], Value::Set(b as f64)));
        }
    }
    for (owner, l) in &s.limits {
        out.push(obs(MemoryLimit, &[owner.as_str(), "budget"], Value::Set(l.budget_bytes as f64)));
        if let Some(h) = l.high_watermark_bytes {
            out.push(obs(MemoryLimit, &[owner.as_str(), "high"], Value::Set(h as f64)));
        }
        if let Some(lo) = l.low_watermark_bytes {
            out.push(obs(MemoryLimit, &[owner.as_str(), "low"], Value::Set(lo as f64)));
        }
    }
    if let Some(r) = &s.vram_owners {
        for (o, b) in owner_parts(&r.owners) {
            out.push(obs(VramOwner, &[o], Value::Set(b as f64)));
        }
    }
    if let Some((_, p)) = last_finished_peak(s) {
        for (o, b) in owner_parts(&p) {
            out.push(obs(VramAtPeak, &[o], Value::Set(b as f64)));
        }
    }
    out.push(obs(ConductorReserved, &[], Value::Set(s.conductor.active_bytes as f64)));
}

/// The counters and histograms of one step's [`StepCounts`].
fn step_counts(c: &StepCounts, out: &mut Vec<Observation>) {
    use Metric::*;
    let add = |out: &mut Vec<Observation>, m: Metric, labels: &[&str], n: u64| {
        if n > 0 {
            out.push(obs(m, labels, Value::Add(n as f64)));
        }
    };
    for (r, n) in &c.evictions {
        add(out, Evictions, &[&wire_name(r)], *n);
    }
    for (d, owners) in &c.copies {
        for (o, n) in owners {
            let l = [d.as_str(), o.as_str()];
            add(out, TransferBytes, &l, n.bytes);
            add(out, Transfers, &l, n.count);
        }
    }
    let record = |out: &mut Vec<Observation>, m: Metric, label: &str, b: &Buckets, bounds: &[f64]| {
        for (n, v) in b.representatives(bounds) {
            // Bounded: a snapshot refuses an aggregate with more values (`MAX_STEP_OBSERVATIONS`).
            for _ in 0..n {
                out.push(obs(m, &[label], Value::Observe(v)));
            }
        }
    };
    for (d, b) in &c.copy_seconds {
        record(out, TransferDuration, d.as_str(), b, COPY_SECONDS_BOUNDS);
    }
    for (src, b) in &c.stall_seconds {
        // Only the two sources the catalog labels; a file's other owners are not series.
        if matches!(src, Owner::Weights | Owner::Activations) {
            record(out, StallDuration, src.as_str(), b, STALL_SECONDS_BOUNDS);
        }
    }
    for (kind, p) in &c.pools {
        let exhausted = p.classes.values().fold(0u64, |t, c| t.saturating_add(c.exhausted));
        add(out, PoolExhausted, &[pool_name(*kind)], exhausted);
        add(out, PoolPageableFallback, &[pool_name(*kind)], p.pageable_bytes);
    }
    for (d, n) in &c.packed {
        add(out, ActivationsPacked, &[&wire_name(d)], *n);
    }
    for (oc, modes) in &c.reservations {
        for (m, n) in modes {
            add(out, ConductorReservations, &[&wire_name(oc), &wire_name(m)], *n);
        }
    }
    add(out, ConductorGrants, &["reservation"], c.reservation_grants());
    add(out, ConductorGrants, &["slot"], c.slot_grants);
    for (r, n) in &c.reservation_denials {
        add(out, ConductorDenials, &["reservation", r.as_str()], *n);
    }
    for (r, n) in &c.slot_denials {
        add(out, ConductorDenials, &["slot", r.as_str()], *n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::CATALOG;
    use stagehand_events::synthetic::{events, SyntheticRun};

    #[test]
    fn every_observation_matches_its_definition() {
        let (mut m, mut state) = (Mapper::new(), Snapshot::new());
        let mut out = initial();
        for e in events(SyntheticRun::finished(3)) {
            state.apply(&e);
            m.on_event(&e, &state, &mut out);
        }
        gauges(&state, &mut out);
        for o in &out {
            let d = o.metric.def();
            assert_eq!(o.labels.len(), d.labels.len(), "{} {:?}", d.stem, o.labels);
            match (d.kind, o.value) {
                (crate::catalog::Kind::Counter, Value::Add(v)) => assert!(v >= 0.0, "{}", d.stem),
                (crate::catalog::Kind::Gauge, Value::Set(_))
                | (crate::catalog::Kind::Histogram(_), Value::Observe(_))
                | (_, Value::Touch) => {}
                (k, v) => panic!("{}: {v:?} for a {k:?}", d.stem),
            }
        }
        // Every instrument gets a value from a full run.
        for d in CATALOG {
            assert!(out.iter().any(|o| o.metric == d.id), "{} never observed", d.stem);
        }
    }

    #[test]
    fn the_bus_s_running_total_of_drops_becomes_increments() {
        let (mut m, mut state) = (Mapper::new(), Snapshot::new());
        let mut out = Vec::new();
        for (i, total) in [3u64, 3, 10].into_iter().enumerate() {
            let e = Event::new(i as u64 + 1, 0, 0, Phase::Idle, EventKind::EventsDropped { total });
            state.apply(&e);
            m.on_event(&e, &state, &mut out);
        }
        let added: f64 = out
            .iter()
            .filter(|o| o.metric == Metric::EventsDropped)
            .map(|o| match o.value {
                Value::Add(v) => v,
                _ => 0.0,
            })
            .sum();
        assert_eq!(added, 10.0);
    }
}
