use super::*;
use stagehand_events::model::{BlockId, Owner, StepTimeBreakdown, TransferId, VramByOwner};

fn ev(seq: u64, t_ns: u64, step: u64, kind: EventKind) -> Event {
    Event::new(seq, t_ns, step, Phase::Forward, kind)
}

fn phase(seq: u64, t: u64, step: u64, from: Phase, to: Phase) -> Event {
    ev(seq, t, step, EventKind::PhaseChanged { from, to, duration_s: 0.0 })
}

fn issue(seq: u64, t: u64, id: u64, owner: Owner, subject: &str) -> Event {
    ev(seq, t, 1, EventKind::TransferIssued { id: TransferId(id), dir: Direction::H2d, owner, bytes: 1 << 20, subject: subject.into() })
}

fn complete(seq: u64, t: u64, id: u64, owner: Owner, duration_ns: u64) -> Event {
    ev(seq, t, 1, EventKind::TransferCompleted {
        id: TransferId(id),
        dir: Direction::H2d,
        owner,
        bytes: 1 << 20,
        duration_ms: Some(duration_ns as f64 / 1e6),
    })
}

fn slices(t: &Value) -> Vec<&Value> {
    t["traceEvents"].as_array().expect("array").iter().filter(|e| e["ph"] == "X").collect()
}

#[test]
fn overlapping_copies_get_their_own_lanes_and_phases_nest_in_steps() {
    let mut es = vec![phase(1, 1_000, 1, Phase::Idle, Phase::StepBegin), phase(2, 2_000, 1, Phase::StepBegin, Phase::Forward)];
    for (i, (start, end)) in [(2_000u64, 9_000u64), (3_000, 5_000), (9_500, 12_000)].into_iter().enumerate() {
        es.push(issue(10 + i as u64, start, i as u64, Owner::Weights, &format!("blocks.{i}")));
        es.push(complete(20 + i as u64, end, i as u64, Owner::Weights, end - start));
    }
    es.sort_by_key(|e| e.t_ns);
    es.push(phase(30, 13_000, 1, Phase::Forward, Phase::StepEnd));
    es.push(phase(31, 14_000, 1, Phase::StepEnd, Phase::Idle));
    let t = to_chrome_trace(&es);
    validate(&t).expect("valid trace");
    let xs = slices(&t);
    let tid_of = |name: &str| xs.iter().find(|e| e["name"] == name).map(|e| e["tid"].as_u64());
    // Copies take lanes as they complete: blocks.1 first, then blocks.0, which overlaps it.
    assert_eq!(tid_of("blocks.1"), Some(Some(H2D_TID)));
    assert_eq!(tid_of("blocks.0"), Some(Some(H2D_TID + 1)));
    assert_eq!(tid_of("blocks.2"), Some(Some(H2D_TID)));
    assert_eq!(tid_of("step 1"), Some(Some(COMPUTE_TID)));
    let step = xs.iter().find(|e| e["name"] == "step 1").expect("step slice");
    assert_eq!(step["ts"], 1.0);
    assert_eq!(step["dur"], 13.0);
    for p in ["step_begin", "forward", "step_end"] {
        assert!(xs.iter().any(|e| e["name"] == p), "missing phase {p}");
    }
    // The step's slice is written before its phases: parents first in the file.
    let at = |name: &str| xs.iter().position(|e| e["name"] == name).expect("slice");
    assert!(at("step 1") < at("step_begin") && at("step 1") < at("forward"));
    let evs = t["traceEvents"].as_array().expect("array");
    assert!(evs.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "H2D 2"));
}

#[test]
fn duplicate_ids_pair_by_owner_and_with_the_most_recent_issue() {
    let es = [
        // The same id for a weight copy and an activation copy: paired by owner.
        issue(1, 1_000, 7, Owner::Weights, "blocks.1"),
        issue(2, 2_000, 7, Owner::Activations, "t12"),
        complete(3, 3_000, 7, Owner::Activations, 1_000),
        complete(4, 5_000, 7, Owner::Weights, 4_000),
        // A reused id of one owner: the most recent issue completes first.
        issue(5, 6_000, 9, Owner::Weights, "blocks.2"),
        issue(6, 7_000, 9, Owner::Weights, "blocks.3"),
        complete(7, 8_000, 9, Owner::Weights, 1_000),
        // A completion without an issue starts at its completion less its duration.
        complete(8, 20_000, 99, Owner::Weights, 2_000),
    ];
    let mut out = Vec::new();
    let text: Vec<u8> = es.iter().flat_map(|e| {
        let mut l = serde_json::to_vec(e).expect("json");
        l.push(b'\n');
        l
    }).collect();
    let summary = convert(text.as_slice(), &mut out).expect("converts");
    let t: Value = serde_json::from_slice(&out).expect("json");
    validate(&t).expect("valid");
    let xs = slices(&t);
    let find = |name: &str| xs.iter().find(|e| e["name"] == name).map(|e| (e["ts"].as_f64(), e["dur"].as_f64()));
    assert_eq!(find("t12"), Some((Some(2.0), Some(1.0))));
    assert_eq!(find("blocks.1"), Some((Some(1.0), Some(4.0))));
    assert_eq!(find("blocks.3"), Some((Some(7.0), Some(1.0))), "the most recent issue of id 9");
    assert_eq!(find("h2d weights"), Some((Some(18.0), Some(2.0))));
    // blocks.2 never completed, and id 99 never was issued.
    assert_eq!(summary.unpaired, 2);
    assert_eq!(t["otherData"]["copies_unpaired"], 2);
}

#[test]
fn new_event_kinds_become_counters_and_instants() {
    let es = vec![
        ev(1, 1_000, 1, EventKind::VramOwners(VramByOwner { allocated_bytes: 10, weights_bytes: 6, other_bytes: 4, ..Default::default() })),
        ev(2, 2_000, 1, EventKind::StepTime(StepTimeBreakdown { step_ms: 10.0, compute_ms: 7.0, h2d_wait_ms: 1.5, ..Default::default() })),
        ev(3, 3_000, 1, EventKind::OutOfMemory { requested_bytes: 1 << 30, owners: VramByOwner::default(), doing: "loading block 'blocks.3'".into(), dump: None, held: None }),
        ev(4, 4_000, 1, EventKind::NonFinite { block: Some(BlockId(3)), tensor: "gradient".into() }),
        ev(5, 5_000, 1, EventKind::PrefetchMiss { block: BlockId(2), stall_ms: 3.4 }),
        ev(6, 6_000, 1, EventKind::LimitsSet { owner: Owner::Activations, budget_bytes: 100, high_watermark_bytes: Some(90), low_watermark_bytes: Some(70) }),
    ];
    let t = to_chrome_trace(&es);
    validate(&t).expect("valid");
    let evs = t["traceEvents"].as_array().expect("array");
    let by_name = |n: &str| evs.iter().find(|e| e["name"] == n).unwrap_or_else(|| panic!("no {n}"));
    assert_eq!(by_name("VRAM by owner")["args"]["weights"], 6);
    assert_eq!(by_name("step time (ms)")["args"]["compute"], 7.0);
    assert_eq!(by_name("step time (ms)")["args"]["h2d_wait"], 1.5);
    assert_eq!(by_name("out of memory")["ph"], "i");
    assert_eq!(by_name("non-finite")["args"]["block"], 3);
    assert_eq!(by_name("prefetch miss")["tid"], COMPUTE_TID);
    assert_eq!(by_name("VRAM limits")["args"]["spill high"], 90);
}

#[test]
fn host_steps_are_slices_on_the_host_optimizers_track_after_their_waits() {
    let ms = 1_000_000;
    let es = vec![
        // Waited 2 ms for its copies, then ran 5 ms, ending at 10 ms.
        ev(1, 10 * ms, 1, EventKind::HostStep { block: BlockId(4), queued_ms: 0.5, waited_ms: 2.0, ran_ms: 5.0 }),
        // Ran 3 ms without waiting.
        ev(2, 14 * ms, 1, EventKind::HostStep { block: BlockId(3), queued_ms: 6.0, waited_ms: 0.0, ran_ms: 3.0 }),
        // Hostile durations clamp to the run's start instead of wrapping.
        ev(3, 15 * ms, 1, EventKind::HostStep { block: BlockId(2), queued_ms: -5.0, waited_ms: 1e300, ran_ms: -1.0 }),
    ];
    let t = to_chrome_trace(&es);
    validate(&t).expect("valid");
    let evs = t["traceEvents"].as_array().expect("array");
    let by_name = |n: &str| evs.iter().find(|e| e["name"] == n).unwrap_or_else(|| panic!("no {n}"));
    let wait = by_name("#4 waits for its copies");
    let step = by_name("#4 step");
    assert_eq!((wait["ts"].as_f64(), wait["dur"].as_f64()), (Some(3_000.0), Some(2_000.0)));
    assert_eq!((step["ts"].as_f64(), step["dur"].as_f64()), (Some(5_000.0), Some(5_000.0)));
    assert_eq!(step["tid"], HOST_TID);
    assert_eq!(step["args"]["queued_ms"], 0.5);
    assert_eq!(by_name("#3 step")["ts"].as_f64(), Some(11_000.0));
    assert!(evs.iter().all(|e| e["name"] != "#3 waits for its copies"), "no wait, no slice");
    assert_eq!(by_name("#2 step")["dur"].as_f64(), Some(0.0));
    let track = evs.iter().find(|e| e["name"] == "thread_name" && e["tid"] == HOST_TID).expect("named track");
    assert_eq!(track["args"]["name"], "host optimizer");
}

#[test]
fn a_file_without_events_is_an_error_not_an_empty_trace() {
    let mut out = Vec::new();
    let err = convert(&b"not json\n\n{\"v\":1}\n"[..], &mut out).expect_err("nothing to convert");
    assert!(err.to_string().contains("no events"), "{err}");
    assert!(convert(&b""[..], &mut Vec::new()).is_err());
}

#[test]
fn a_compressed_file_converts_like_the_plain_one() {
    let events = stagehand_events::synthetic::events(Default::default());
    let mut text = Vec::new();
    for e in &events {
        serde_json::to_writer(&mut text, e).expect("serializes");
        text.push(b'\n');
    }
    let dir = tempfile::tempdir().expect("dir");
    let plain = dir.path().join("run.jsonl");
    let packed = dir.path().join("run.jsonl.zst");
    std::fs::write(&plain, &text).expect("writes");
    std::fs::write(&packed, zstd::encode_all(text.as_slice(), 3).expect("compresses")).expect("writes");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let sa = convert_file(&plain, &mut a).expect("plain converts");
    let sb = convert_file(&packed, &mut b).expect("compressed converts");
    assert_eq!(sa.report.events, events.len() as u64);
    assert_eq!(sb.report.events, sa.report.events);
    assert_eq!(a, b, "the same trace");
}

#[test]
fn each_device_of_a_data_parallel_run_is_a_process_with_its_lanes() {
    let mut es = Vec::new();
    for (d, t0) in [(0u32, 1_000u64), (1, 1_500)] {
        let on = |e: Event| e.on_device(Some(d));
        es.push(on(phase(1, t0, 1, Phase::Idle, Phase::StepBegin)));
        es.push(on(phase(2, t0 + 100, 1, Phase::StepBegin, Phase::Backward)));
        let id = TransferId(u64::from(d));
        es.push(on(ev(3, t0 + 200, 1, EventKind::TransferIssued { id, dir: Direction::Collective, owner: Owner::Weights, bytes: 1 << 20, subject: "block 'blocks.0' gradients".into() })));
        es.push(on(ev(4, t0 + 900, 1, EventKind::TransferCompleted { id, dir: Direction::Collective, owner: Owner::Weights, bytes: 1 << 20, duration_ms: Some(0.0007) })));
        es.push(on(phase(5, t0 + 1_000, 1, Phase::Backward, Phase::StepEnd)));
        es.push(on(phase(6, t0 + 1_100, 1, Phase::StepEnd, Phase::Idle)));
    }
    es.sort_by_key(|e| e.t_ns);
    let t = to_chrome_trace(&es);
    validate(&t).expect("valid trace");
    let evs = t["traceEvents"].as_array().expect("array");
    for d in [0u64, 1] {
        let pid = DEVICE_PID + d;
        let name = format!("GPU {d}");
        assert!(evs.iter().any(|e| e["ph"] == "M" && e["pid"] == pid && e["args"]["name"] == name.as_str()), "{name} is named");
        let xs: Vec<&Value> = slices(&t).into_iter().filter(|e| e["pid"] == pid).collect();
        assert!(xs.iter().any(|e| e["name"] == "step 1" && e["tid"] == COMPUTE_TID), "{name}'s step");
        assert!(xs.iter().any(|e| e["name"] == "block 'blocks.0' gradients" && e["tid"] == COLLECTIVE_TID), "{name}'s collective");
        assert!(evs.iter().any(|e| e["ph"] == "M" && e["pid"] == pid && e["args"]["name"] == "collective"), "{name}'s collective lane is named");
    }
    // Each GPU's step is its own: two step slices, one per process.
    assert_eq!(slices(&t).iter().filter(|e| e["name"] == "step 1").count(), 2);
}
