//! Tests of the facade: events on the bus, adapters, tokens, disabled mode.
//! One file, as the facade is one type: each test drives it the way a runtime does.

use super::*;
use crate::events::model::{Event, ReservationMode};
use crate::test_support::Collect;
use std::sync::atomic::{AtomicU64, Ordering};

const MIB: u64 = 1 << 20;

struct Rig {
    bus: Bus,
    events: Collect,
    vram: Arc<AtomicU64>,
    conductor: Conductor,
}

impl Rig {
    /// Soft cap 1000 MiB, hard 1200, pinned 500, reserve 10, 2+2 slots.
    fn new() -> Rig {
        Rig::with(ConductorConfig::builder())
    }

    fn with(b: ConductorConfigBuilder) -> Rig {
        let config = b
            .vram_soft_cap_mib(1000)
            .vram_hard_cap_mib(1200)
            .pinned_cap_mib(500)
            .priority_reserve_mib(10)
            .build()
            .expect("valid config");
        let bus = Bus::new();
        let events = Collect::default();
        bus.hub()
            .expect("enabled bus")
            .add_sink(Box::new(events.clone()));
        let vram = Arc::new(AtomicU64::new(0));
        let reader = vram.clone();
        let conductor = Conductor::new(config, bus.clone(), move || reader.load(Ordering::Relaxed))
            .expect("conductor");
        Rig {
            bus,
            events,
            vram,
            conductor,
        }
    }

    fn set_vram_mib(&self, mb: u64) {
        self.vram.store(mb * MIB, Ordering::Relaxed);
    }

    fn events(&self) -> Vec<Event> {
        self.bus.flush();
        self.events.0.lock().expect("collector lock").clone()
    }

    fn kinds(&self) -> Vec<EventKind> {
        self.events().into_iter().map(|e| e.kind).collect()
    }

    /// Registers a weight and an activation adapter; returns their knobs.
    fn attach_both(&self) -> (Arc<Knobs>, Arc<Knobs>) {
        let (wk, ak) = (weight_knobs(), activation_knobs());
        self.conductor.register(WeightAdapter::new(wk.clone())).expect("weights");
        self.conductor.register(ActivationAdapter::new(ak.clone())).expect("activations");
        (wk, ak)
    }

    fn hint_rules(&self) -> Vec<PolicyRule> {
        self.kinds()
            .into_iter()
            .filter_map(|k| match k {
                EventKind::HintsChanged { rule, .. } => Some(rule),
                _ => None,
            })
            .collect()
    }
}

fn weight_knobs() -> Arc<Knobs> {
    Knobs::new(KnobValues {
        max_inflight_h2d: 2,
        max_inflight_d2h: 0,
        prefetch_window: 3,
        suppress_speculative: false,
    })
}

fn activation_knobs() -> Arc<Knobs> {
    Knobs::new(KnobValues {
        max_inflight_h2d: 1,
        max_inflight_d2h: 2,
        prefetch_window: 0,
        suppress_speculative: false,
    })
}

/// Records every phase it is told about.
struct Recorder {
    name: &'static str,
    seen: Arc<Mutex<Vec<(u64, Phase)>>>,
}

impl RuntimeAdapter for Recorder {
    fn name(&self) -> &'static str {
        self.name
    }
    fn owner(&self) -> Owner {
        Owner::Trainer
    }
    fn attach(&mut self) {}
    fn on_phase(&mut self, step: u64, phase: Phase) {
        self.seen.lock().expect("recorder lock").push((step, phase));
    }
    fn apply_hints(&mut self, _hints: &Hints, _phase: Phase) {}
    fn detach(&mut self) {}
    fn runtime_snapshot(&self) -> serde_json::Value {
        serde_json::json!({})
    }
}

fn full_step(c: &Conductor, step: u64) {
    c.begin_step(step).expect("begin");
    c.enter_forward().expect("forward");
    c.enter_backward().expect("backward");
    c.enter_optimizer().expect("optimizer");
    c.end_step().expect("end");
}

#[test]
fn phases_are_broadcast_to_every_adapter_and_published() {
    let rig = Rig::new();
    let a = Arc::new(Mutex::new(Vec::new()));
    let b = Arc::new(Mutex::new(Vec::new()));
    for (name, seen) in [("a", &a), ("b", &b)] {
        rig.conductor
            .register(Recorder {
                name,
                seen: seen.clone(),
            })
            .expect("register");
    }
    full_step(&rig.conductor, 4);
    let expected: Vec<(u64, Phase)> = [
        Phase::Idle, // on attach
        Phase::StepBegin,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::StepEnd,
    ]
    .iter()
    .enumerate()
    .map(|(i, p)| (if i == 0 { 0 } else { 4 }, *p))
    .collect();
    assert_eq!(*a.lock().expect("lock"), expected);
    assert_eq!(*b.lock().expect("lock"), expected);
    let phases: Vec<(Phase, Phase)> = rig
        .kinds()
        .into_iter()
        .filter_map(|k| match k {
            EventKind::PhaseChanged { from, to, .. } => Some((from, to)),
            _ => None,
        })
        .collect();
    assert_eq!(phases.len(), 5);
    assert_eq!(phases[0], (Phase::Idle, Phase::StepBegin));
    assert_eq!(phases[4], (Phase::Optimizer, Phase::StepEnd));
    assert_eq!(rig.conductor.phase(), (4, Phase::StepEnd));
}

#[test]
fn an_invalid_order_is_a_typed_error_and_a_warning() {
    let rig = Rig::new();
    rig.conductor.begin_step(1).expect("begin");
    let err = rig.conductor.enter_optimizer().expect_err("skipped forward");
    assert!(matches!(
        err,
        Error::InvalidPhaseTransition {
            from: Phase::StepBegin,
            to: Phase::Optimizer,
            ..
        }
    ));
    assert_eq!(rig.conductor.phase(), (1, Phase::StepBegin));
    let warned = rig.kinds().into_iter().any(|k| {
        matches!(k, EventKind::Warning { source: Owner::Conductor, ref message }
            if message.contains("step_begin -> optimizer"))
    });
    assert!(warned);
    let dup = rig
        .conductor
        .register(WeightAdapter::new(weight_knobs()))
        .and_then(|_| rig.conductor.register(WeightAdapter::new(weight_knobs())));
    assert_eq!(dup, Err(Error::DuplicateAdapter("stagehand".into())));
}

#[test]
fn rules_fire_through_the_step_and_reset_at_step_begin() {
    let rig = Rig::new();
    let (wk, ak) = rig.attach_both();

    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    assert_eq!(wk.prefetch_window(), 3);
    rig.set_vram_mib(900); // 90% of the soft cap
    rig.conductor.enter_backward().expect("backward");
    assert_eq!(wk.prefetch_window(), 1, "backward pressure");
    assert!(wk.suppress_speculative());
    assert_eq!(ak.max_inflight_d2h(), 2, "spills continue in backward");
    rig.set_vram_mib(100);
    rig.conductor.enter_optimizer().expect("optimizer");
    assert_eq!(wk.max_inflight_h2d(), 1, "optimizer protection");
    assert_eq!(ak.max_inflight_d2h(), 0, "no spills in the optimizer");
    assert_eq!(wk.prefetch_window(), 1, "low VRAM does not loosen within the step");
    rig.conductor.end_step().expect("end");
    assert_eq!(ak.max_inflight_d2h(), 2);
    assert_eq!(wk.max_inflight_h2d(), 1, "still tight until step begin");

    rig.conductor.begin_step(2).expect("begin");
    assert_eq!(wk.load(), weight_knobs().load(), "reset to configured");
    assert_eq!(rig.conductor.hints(), Hints::default());
    assert_eq!(
        rig.hint_rules(),
        vec![
            PolicyRule::BackwardPressure,
            PolicyRule::OptimizerProtection,
            PolicyRule::Reset
        ]
    );
    let pressure = rig.events().into_iter().find_map(|e| match e.kind {
        EventKind::HintsChanged {
            hints,
            rule: PolicyRule::BackwardPressure,
        } => Some((e.step, e.phase, hints)),
        _ => None,
    });
    let (step, phase, hints) = pressure.expect("backward pressure event");
    assert_eq!((step, phase), (1, Phase::Backward));
    assert_eq!(hints.prefetch_window_cap, Some(1));
}

#[test]
fn step_end_publishes_metrics_with_runtime_snapshots() {
    let rig = Rig::with(ConductorConfig::builder().telemetry_interval_steps(2));
    rig.conductor
        .register(WeightAdapter::new(weight_knobs()))
        .expect("weights");
    rig.conductor
        .register(ActivationAdapter::new(activation_knobs()))
        .expect("activations");
    rig.set_vram_mib(400);
    for step in 1..=2 {
        rig.conductor.begin_step(step).expect("begin");
        rig.conductor.enter_forward().expect("forward");
        let d = rig.conductor.reserve(
            ReservationRequest::new(Owner::Activations, Resource::PinnedHost, 64 * MIB)
                .mode(ReservationMode::Hard),
        );
        assert!(d.is_granted());
        rig.conductor.reserve(
            ReservationRequest::new(Owner::Weights, Resource::Vram, 700 * MIB)
                .mode(ReservationMode::Hard),
        );
        rig.conductor.enter_backward().expect("backward");
        rig.conductor.enter_optimizer().expect("optimizer");
        rig.conductor.end_step().expect("end");
    }
    let steps: Vec<(u64, ConductorStepMetrics)> = rig
        .events()
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ConductorStep(m) => Some((e.step, m)),
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 1, "every second step");
    let (step, m) = &steps[0];
    assert_eq!(*step, 2);
    assert_eq!((m.grant_count, m.deny_count, m.partial_count), (1, 1, 0));
    assert_eq!(m.pinned_granted_mib, 128.0, "two unscoped grants held");
    assert_eq!(m.vram_allocated_mib, 400.0);
    assert_eq!(m.vram_headroom_mib, 600.0);
    assert_eq!(m.runtime_snapshots["stagehand"]["max_inflight"], 1);
    assert_eq!(m.runtime_snapshots["stagehand"]["prefetch_window"], 1);
    assert_eq!(m.runtime_snapshots["activation_stagehand"]["max_d2h"], 2);
    assert_eq!(m.runtime_snapshots["activation_stagehand"]["max_h2d"], 1);
    let json = serde_json::to_value(EventKind::ConductorStep(m.clone())).expect("json");
    for field in [
        "vram_allocated_mb",
        "vram_headroom_mb",
        "pinned_granted_mb",
        "h2d_inflight",
        "d2h_inflight",
        "grant_count",
        "deny_count",
        "partial_count",
        "phase_durations",
        "runtime_snapshots",
    ] {
        assert!(json.get(field).is_some(), "missing {field}");
    }
    // The dashboards' reducer keeps it.
    let snap = rig.bus.hub().expect("hub").snapshot();
    assert_eq!(snap.conductor.last_step.as_ref(), Some(m));
}

#[test]
fn reservations_publish_request_outcome_and_phase_scoped_release() {
    let rig = Rig::new();
    rig.set_vram_mib(900);
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    let scoped = rig.conductor.reserve(
        ReservationRequest::new(Owner::Activations, Resource::Vram, 200 * MIB)
            .mode(ReservationMode::Soft)
            .priority(Priority::Critical)
            .scoped_to(Phase::Forward),
    );
    assert_eq!(scoped.outcome, ReservationOutcome::Partial);
    assert_eq!(scoped.granted_bytes, 100 * MIB);
    let denied = rig.conductor.reserve(
        ReservationRequest::new(Owner::Weights, Resource::Vram, 50 * MIB)
            .mode(ReservationMode::Hard)
            .priority(Priority::Speculative),
    );
    assert_eq!(denied.reason, Some(DenyReason::InsufficientHeadroom));
    rig.conductor.enter_backward().expect("backward");
    let id = scoped.id.expect("held");
    assert_eq!(rig.conductor.release(id), 0, "released when forward ended");
    let kinds = rig.kinds();
    let reservations: Vec<_> = kinds
        .iter()
        .filter_map(|k| match k {
            EventKind::Reservation {
                mode,
                priority,
                granted_bytes,
                outcome,
                reason,
                scope,
                ..
            } => Some((*mode, *priority, *granted_bytes, *outcome, *reason, *scope)),
            _ => None,
        })
        .collect();
    assert_eq!(
        reservations,
        vec![
            (
                ReservationMode::Soft,
                Priority::Critical,
                100 * MIB,
                ReservationOutcome::Partial,
                None,
                Some(Phase::Forward)
            ),
            (
                ReservationMode::Hard,
                Priority::Speculative,
                0,
                ReservationOutcome::Denied,
                Some(DenyReason::InsufficientHeadroom),
                None
            ),
        ]
    );
    let released: Vec<_> = rig
        .events()
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ReservationReleased { id, bytes } => Some((id, bytes, e.phase)),
            _ => None,
        })
        .collect();
    assert_eq!(released, vec![(id, 100 * MIB, Phase::Backward)]);
    let snap = rig.bus.hub().expect("hub").snapshot();
    assert_eq!(snap.conductor.active_reservations, 0);
}

#[test]
fn slot_tokens_release_on_drop_and_record_completions() {
    let rig = Rig::new();
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    let t1 = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("slot");
    let t2 = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative)
        .expect("slot");
    let denied = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative)
        .expect_err("pool full");
    assert_eq!(denied.reason, DenyReason::H2dSlotsExhausted);
    let over = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("required never refused");
    assert!(over.is_over_limit() && over.is_tracked());
    let d2h = rig
        .conductor
        .acquire_slot(Direction::D2h, Owner::Activations, Priority::Speculative)
        .expect("separate pool");
    assert_eq!(rig.conductor.metrics().expect("enabled").h2d_inflight, 3);
    t1.complete(4 * MIB);
    drop(t2);
    drop(over);
    d2h.complete(MIB);
    let m = rig.conductor.metrics().expect("enabled");
    assert_eq!((m.h2d_inflight, m.d2h_inflight), (0, 0));
    assert_eq!((m.h2d_bytes, m.d2h_bytes), (4 * MIB, MIB));
    assert_eq!(
        (m.slot_grant_count, m.slot_deny_count, m.slot_over_limit_count),
        (4, 1, 1)
    );
    let kinds = rig.kinds();
    let granted: Vec<u32> = kinds
        .iter()
        .filter_map(|k| match k {
            EventKind::SlotGranted {
                dir: Direction::H2d,
                inflight,
                ..
            } => Some(*inflight),
            _ => None,
        })
        .collect();
    assert_eq!(granted, vec![1, 2, 3]);
    let released = kinds
        .iter()
        .filter(|k| matches!(k, EventKind::SlotReleased { .. }))
        .count();
    assert_eq!(released, 4);
    assert!(kinds.iter().any(|k| matches!(
        k,
        EventKind::SlotDenied {
            dir: Direction::H2d,
            speculative: true,
            reason: DenyReason::H2dSlotsExhausted,
            ..
        }
    )));
}

#[test]
fn asking_whether_slots_are_full_counts_and_publishes_nothing() {
    let rig = Rig::new();
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    assert!(!rig.conductor.slots_full(Direction::H2d));
    let held: Vec<_> = (0..2)
        .map(|_| rig.conductor.acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative).expect("slot"))
        .collect();
    assert!(rig.conductor.slots_full(Direction::H2d), "both H2D slots are held");
    assert!(!rig.conductor.slots_full(Direction::D2h), "a separate pool");
    let m = rig.conductor.metrics().expect("enabled");
    assert_eq!((m.slot_grant_count, m.slot_deny_count), (2, 0));
    assert!(!rig.kinds().iter().any(|k| matches!(k, EventKind::SlotDenied { .. })));
    drop(held);
    assert!(!rig.conductor.slots_full(Direction::H2d));
    assert!(!Conductor::disabled().slots_full(Direction::H2d), "a disabled Conductor holds no slots");
}

#[test]
fn the_optimizer_suppresses_speculative_slots_but_not_required_ones() {
    let rig = Rig::new();
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    rig.conductor.enter_backward().expect("backward");
    rig.conductor.enter_optimizer().expect("optimizer");
    let denied = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative)
        .expect_err("suppressed");
    assert_eq!(denied.reason, DenyReason::PhaseRuleSuppressedSpeculative);
    let a = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("required");
    assert!(!a.is_over_limit());
    let b = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("required");
    assert!(b.is_over_limit(), "the optimizer limits H2D to one slot");
    let denial = rig.events().into_iter().find_map(|e| match e.kind {
        EventKind::SlotDenied { reason, .. } => Some((e.phase, reason)),
        _ => None,
    });
    assert_eq!(
        denial,
        Some((Phase::Optimizer, DenyReason::PhaseRuleSuppressedSpeculative))
    );
}

#[test]
fn sustained_full_slots_shrink_the_prefetch_window() {
    let rig = Rig::new();
    let wk = weight_knobs();
    rig.conductor
        .register(WeightAdapter::new(wk.clone()))
        .expect("weights");
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    let _held: Vec<SlotToken> = (0..2)
        .map(|_| {
            rig.conductor
                .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
                .expect("slot")
        })
        .collect();
    let mut windows = Vec::new();
    for _ in 0..8 {
        let r = rig
            .conductor
            .acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative);
        assert!(r.is_err());
        windows.push(wk.prefetch_window());
    }
    // Checks 1-3 do nothing, the 4th fires (3 -> 2) and restarts the count; the 8th fires again.
    assert_eq!(windows, vec![3, 3, 3, 2, 2, 2, 2, 1]);
    assert_eq!(
        rig.hint_rules(),
        vec![PolicyRule::Contention, PolicyRule::Contention]
    );
}

#[test]
fn shutdown_restores_knobs_and_releases_everything() {
    let rig = Rig::new();
    let (wk, ak) = rig.attach_both();
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    rig.conductor.enter_backward().expect("backward");
    rig.conductor.enter_optimizer().expect("optimizer");
    let held = rig.conductor.reserve(ReservationRequest::new(
        Owner::Weights,
        Resource::PinnedHost,
        MIB,
    ));
    assert_ne!(wk.load(), weight_knobs().load());
    rig.conductor.shutdown();
    assert_eq!(wk.load(), weight_knobs().load());
    assert_eq!(ak.load(), activation_knobs().load());
    assert_eq!(rig.conductor.phase(), (1, Phase::Idle));
    assert_eq!(
        rig.conductor
            .acquire_slot(Direction::H2d, Owner::Weights, Priority::Speculative)
            .expect_err("shut down")
            .reason,
        DenyReason::Shutdown
    );
    let required = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("required proceeds");
    assert!(!required.is_tracked());
    assert_eq!(
        rig.conductor
            .reserve(ReservationRequest::new(Owner::Weights, Resource::Vram, 1))
            .reason,
        Some(DenyReason::Shutdown)
    );
    assert!(rig.conductor.begin_step(2).is_ok(), "a no-op after shutdown");
    assert!(rig.kinds().iter().any(|k| matches!(
        k,
        EventKind::ReservationReleased { id, bytes: MIB } if Some(*id) == held.id
    )));
}

#[test]
fn dropping_the_last_handle_restores_knobs() {
    let wk = weight_knobs();
    {
        let c = Conductor::new(ConductorConfig::default(), Bus::disabled(), || 0).expect("ok");
        c.register(WeightAdapter::new(wk.clone())).expect("weights");
        let clone = c.clone();
        full_step(&clone, 1);
        assert_eq!(wk.max_inflight_h2d(), 1);
        drop(c);
        assert_eq!(wk.max_inflight_h2d(), 1, "a clone still holds it");
    }
    assert_eq!(wk.load(), weight_knobs().load());
    let c = Conductor::new(ConductorConfig::default(), Bus::disabled(), || 0).expect("ok");
    c.register(WeightAdapter::new(wk.clone())).expect("weights");
    full_step(&c, 1);
    assert!(c.detach("stagehand"));
    assert!(!c.detach("stagehand"));
    assert_eq!(wk.load(), weight_knobs().load());
}

#[test]
fn works_with_only_the_activation_runtime() {
    let rig = Rig::new();
    let ak = activation_knobs();
    rig.conductor
        .register(ActivationAdapter::new(ak.clone()))
        .expect("activations");
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    rig.conductor.enter_backward().expect("backward");
    rig.conductor.enter_optimizer().expect("optimizer");
    assert_eq!(ak.max_inflight_d2h(), 0);
    rig.conductor.end_step().expect("end");
    let m = rig.conductor.metrics().expect("enabled");
    assert_eq!(
        m.runtime_snapshots.keys().collect::<Vec<_>>(),
        vec!["activation_stagehand"]
    );
}

#[test]
fn quiet_trace_publishes_only_limiting_slot_decisions() {
    let rig = Rig::with(ConductorConfig::builder().debug_event_trace(false).h2d_slots(1));
    let a = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("slot");
    let b = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("over the limit");
    let _ = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Background);
    drop((a, b));
    let names: Vec<&str> = rig.kinds().iter().map(|k| k.name()).collect();
    assert_eq!(names, vec!["slot_granted", "slot_denied"]);
}

#[test]
fn disabled_conductor_allocates_nothing_and_says_proceed() {
    let wk = weight_knobs();
    for c in [
        Conductor::disabled(),
        Conductor::new(
            ConductorConfig::builder()
                .enabled(false)
                .build()
                .expect("valid"),
            Bus::new(),
            || u64::MAX,
        )
        .expect("ok"),
    ] {
        assert!(!c.is_enabled());
        assert!(c.inner.is_none(), "no state box");
        c.register(WeightAdapter::new(wk.clone())).expect("no-op");
        full_step(&c, 1);
        // Out of order is fine too: nothing is tracked.
        c.enter_optimizer().expect("no-op");
        assert_eq!(wk.load(), weight_knobs().load(), "knobs untouched");
        let d = c.reserve(
            ReservationRequest::new(Owner::Weights, Resource::Vram, u64::MAX)
                .mode(ReservationMode::Hard),
        );
        assert_eq!(d, ReservationDecision::proceed(u64::MAX));
        let t = c
            .acquire_slot(Direction::H2d, Owner::Weights, Priority::Background)
            .expect("proceed");
        assert!(!t.is_tracked());
        assert_eq!(c.hints(), Hints::default());
        assert_eq!(c.metrics(), None);
        assert_eq!(c.release(ReservationId(1)), 0);
        assert!(!c.detach("stagehand"));
        c.shutdown();
    }
    assert_eq!(
        std::mem::size_of::<Conductor>(),
        std::mem::size_of::<usize>(),
        "a disabled Conductor is one null pointer"
    );
    assert_eq!(Arc::strong_count(&wk), 1, "the disabled Conductor kept no adapter");
}

#[test]
fn tokens_and_handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Conductor>();
    send_sync::<Knobs>();
    fn send<T: Send>() {}
    send::<SlotToken>();

    let rig = Rig::new();
    rig.conductor.begin_step(1).expect("begin");
    rig.conductor.enter_forward().expect("forward");
    rig.conductor.enter_backward().expect("backward");
    // The autograd worker restores while the training thread holds a slot.
    let held = rig
        .conductor
        .acquire_slot(Direction::H2d, Owner::Weights, Priority::Required)
        .expect("slot");
    let worker = {
        let c = rig.conductor.clone();
        std::thread::spawn(move || {
            let t = c
                .acquire_slot(Direction::H2d, Owner::Activations, Priority::Required)
                .expect("slot");
            t.complete(3 * MIB);
            c.metrics().map(|m| m.h2d_bytes)
        })
    };
    let bytes = worker.join().expect("worker");
    assert_eq!(bytes, Some(3 * MIB));
    drop(held);
    assert_eq!(rig.conductor.metrics().expect("enabled").h2d_inflight, 0);
}
