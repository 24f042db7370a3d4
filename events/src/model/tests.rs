use super::*;

#[test]
fn wire_format_is_flat_and_tagged() {
    let e = Event::new(
        42,
        1_200_345,
        3,
        Phase::Forward,
        EventKind::Residency {
            block: BlockId(5),
            from: BlockState::Prefetching,
            to: BlockState::GpuReady,
            refcount: 0,
        },
    );
    let json = serde_json::to_value(&e).expect("serializes");
    assert_eq!(json["kind"], "residency");
    assert_eq!(json["to"], "gpu_ready");
    assert_eq!(json["block"], 5);
    assert_eq!(json["phase"], "forward");
    let back: Event = serde_json::from_value(json).expect("round-trips");
    assert_eq!(back, e);
    assert_eq!(back.kind.name(), "residency");
}

#[test]
fn per_step_metrics_keep_the_original_field_names() {
    let e = EventKind::ActivationStep(ActivationStepMetrics {
        activations_spilled: 7,
        ..Default::default()
    });
    let json = serde_json::to_value(&e).expect("serializes");
    for field in [
        "activations_saved",
        "activations_kept",
        "activations_spilled",
        "activations_restored",
        "spill_bytes",
        "restore_bytes",
        "stall_time_ms",
        "stall_count",
        "pool_hits",
        "pool_misses",
        "vram_peak_mb",
    ] {
        assert!(json.get(field).is_some(), "missing {field}");
    }
    assert_eq!(json["kind"], "activation_step");
}

#[test]
fn copies_read_with_and_without_their_timing() {
    // Files written before copies were timed by sample: every copy has its duration, per-step
    // copy stats have no `untimed_bytes`.
    let old = r#"{"v":2,"seq":1,"t_ns":5,"step":1,"phase":"forward","kind":"transfer_completed","id":3,"dir":"h2d","owner":"weights","bytes":1024,"duration_ms":0.5}"#;
    let e: Event = serde_json::from_str(old).expect("an old completed copy reads");
    assert!(matches!(e.kind, EventKind::TransferCompleted { duration_ms: Some(ms), .. } if ms == 0.5));
    let old_step = r#"{"v":2,"seq":2,"t_ns":6,"step":1,"phase":"idle","kind":"transfer_step","h2d":{"count":1,"bytes":1024,"busy_ms":0.5,"last_gbps":2.0},"d2h":{"count":0,"bytes":0,"busy_ms":0.0,"last_gbps":0.0}}"#;
    let e: Event = serde_json::from_str(old_step).expect("an old step aggregate reads");
    let EventKind::TransferStep(m) = e.kind else { panic!("a transfer step: {:?}", e.kind) };
    assert_eq!((m.h2d.untimed_bytes, m.h2d.bytes), (0, 1024), "every copy of an old file was timed");
    // A copy that was not timed writes no duration and reads back as such.
    let untimed = Event::new(3, 7, 1, Phase::Forward, EventKind::TransferCompleted {
        id: TransferId(4),
        dir: Direction::H2d,
        owner: Owner::Weights,
        bytes: 1024,
        duration_ms: None,
    });
    let json = serde_json::to_value(&untimed).expect("serializes");
    assert!(json.get("duration_ms").is_none(), "{json}");
    assert_eq!(serde_json::from_value::<Event>(json).expect("reads back"), untimed);
}

/// serde lists every tag it accepts when it meets an unknown one; the derived names must be
/// exactly that list, in order, so a new kind can never get a name serde does not use.
fn serde_tags() -> Vec<String> {
    tags_of::<EventKind>(r#"{"kind":"~"}"#)
}

fn tags_of<T: serde::de::DeserializeOwned + std::fmt::Debug>(unknown: &str) -> Vec<String> {
    let err = serde_json::from_str::<T>(unknown).expect_err("an unknown variant");
    let msg = err.to_string();
    // "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, `c`": the quoted
    // names after "expected".
    let list = msg.split("expected").nth(1).expect("serde lists the variants");
    list.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

#[test]
fn every_kind_name_matches_its_serde_tag() {
    let tags = serde_tags();
    assert_eq!(tags.len(), EventKind::names().len(), "{tags:?}");
    assert_eq!(tags, EventKind::names(), "derived names differ from serde's tags");
    // And the name of a value is its tag on the wire.
    let k = EventKind::HintsChanged { hints: Hints::default(), rule: PolicyRule::Contention };
    assert_eq!(serde_json::to_value(&k).expect("serializes")["kind"], k.name());
    let k = EventKind::TransferStep(TransferStepMetrics::default());
    assert_eq!(serde_json::to_value(&k).expect("serializes")["kind"], k.name());
}

#[test]
fn every_value_name_is_its_serde_tag() {
    fn check<T: serde::de::DeserializeOwned + std::fmt::Debug + strum::VariantNames>() {
        assert_eq!(tags_of::<T>(r#""~""#), T::VARIANTS, "{}", std::any::type_name::<T>());
    }
    check::<Phase>();
    check::<BlockState>();
    check::<Direction>();
    check::<Owner>();
    check::<DeviceKind>();
    check::<EvictionReason>();
    check::<PoolKind>();
    check::<PackDecision>();
    check::<KeepReason>();
    check::<ReservationMode>();
    check::<Priority>();
    check::<Resource>();
    check::<ReservationOutcome>();
    check::<DenyReason>();
    check::<PolicyRule>();
    for p in Phase::ALL {
        assert_eq!(p.as_str(), wire_name(&p));
    }
    assert_eq!(DenyReason::H2dSlotsExhausted.as_str(), "h2d_slots_exhausted");
}

#[test]
fn wire_names_are_serde_tags() {
    assert_eq!(wire_name(&EvictionReason::Watermark), "watermark");
    assert_eq!(wire_name(&KeepReason::TailOfForward), "tail_of_forward");
    assert_eq!(wire_name(&42u32), "");
}

#[test]
fn residency_has_exactly_eight_valid_edges() {
    let valid = BlockState::ALL
        .iter()
        .flat_map(|a| BlockState::ALL.iter().map(move |b| (*a, *b)))
        .filter(|(a, b)| a.can_transition_to(*b))
        .count();
    assert_eq!(valid, 8);
    assert!(!BlockState::GpuReady.can_transition_to(BlockState::GpuReady));
}

#[test]
fn an_events_device_round_trips_beside_the_runs_own_device() {
    // A data-parallel run's events carry `dev`; `run_started` keeps its `device`, the run's.
    let started = Event::new(1, 0, 0, Phase::Idle, EventKind::RunStarted {
        run_id: "r".into(),
        wall_clock_unix_ms: 0,
        device: DeviceInfo { kind: DeviceKind::Cuda, index: 0, name: "NVIDIA H100".into(), total_bytes: 1 },
        model: "m".into(),
        versions: Default::default(),
        config: serde_json::Value::Null,
    })
    .on_device(Some(1));
    let text = serde_json::to_string(&started).expect("serializes");
    assert!(text.contains(r#""dev":1"#) && text.contains(r#""device":{"#), "{text}");
    assert_eq!(serde_json::from_str::<Event>(&text).expect("reads back"), started);
    let collective = Event::new(2, 5, 3, Phase::Backward, EventKind::TransferCompleted {
        id: TransferId(9),
        dir: Direction::Collective,
        owner: Owner::Weights,
        bytes: 4096,
        duration_ms: Some(0.25),
    })
    .on_device(Some(0));
    let text = serde_json::to_string(&collective).expect("serializes");
    assert!(text.contains(r#""dir":"collective""#), "{text}");
    assert_eq!(serde_json::from_str::<Event>(&text).expect("reads back"), collective);
    // Files of one device (and older files) have no `dev`.
    let one = Event::new(3, 6, 1, Phase::Forward, EventKind::RunEnded { steps: 1 });
    assert!(!serde_json::to_string(&one).expect("serializes").contains("dev"));
    let old = r#"{"v":2,"seq":1,"t_ns":5,"step":1,"phase":"forward","kind":"run_ended","steps":1}"#;
    assert_eq!(serde_json::from_str::<Event>(old).expect("an old event reads").device, None);
}
