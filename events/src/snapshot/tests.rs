//! Tests of the reducer: behaviour, hostile input, and continuation.

use super::*;
use crate::synthetic::{self, SyntheticRun};

fn ev(seq: u64, step: u64, kind: EventKind) -> Event {
    Event::new(seq, seq * 1000, step, Phase::Forward, kind)
}

#[test]
fn blocks_follow_residency_and_counts_add_up() {
    let mut s = Snapshot::new();
    for i in 0..3 {
        s.apply(&ev(
            i + 1,
            0,
            EventKind::BlockRegistered {
                block: BlockId(i as u32),
                name: format!("blocks.{i}"),
                bytes: 100,
                exec_order: i as u32,
                file_backed: false,
                trainable: false,
            },
        ));
    }
    s.apply(&ev(
        4,
        1,
        EventKind::Residency {
            block: BlockId(1),
            from: BlockState::Unloaded,
            to: BlockState::HostStaged,
            refcount: 0,
        },
    ));
    s.apply(&ev(5, 1, EventKind::PrefetchHit { block: BlockId(1) }));
    s.apply(&ev(
        6,
        1,
        EventKind::PrefetchMiss {
            block: BlockId(2),
            stall_ms: 1.5,
        },
    ));
    assert_eq!(s.blocks.len(), 3);
    assert_eq!(s.block(BlockId(1)).map(|b| b.state), Some(BlockState::HostStaged));
    assert_eq!(s.residency_counts()[&BlockState::Unloaded], 2);
    assert_eq!(s.weights.hit_rate(), 0.5);
    assert_eq!(s.weights.stall_time_ms, 1.5);
    assert_eq!(s.last_seq, 6);
    assert_eq!(s.step, 1);
    assert_eq!(s.event_counts["block_registered"], 3);
}

#[test]
fn pools_track_slabs_by_class() {
    let mut s = Snapshot::new();
    s.apply(&ev(
        1,
        0,
        EventKind::PoolConfigured {
            pool: PoolKind::Activations,
            classes: vec![
                PoolClass { slab_bytes: 1 << 20, slabs: 4 },
                PoolClass { slab_bytes: 4 << 20, slabs: 2 },
            ],
            pinned: true,
        },
    ));
    for seq in 2..4 {
        s.apply(&ev(
            seq,
            0,
            EventKind::SlabAcquired {
                pool: PoolKind::Activations,
                class: 1,
                slab: SlabId(seq as u32),
                bytes: 3 << 20,
                waited_ms: 0.0,
            },
        ));
    }
    s.apply(&ev(
        4,
        0,
        EventKind::SlabReleased {
            pool: PoolKind::Activations,
            class: 1,
            slab: SlabId(2),
        },
    ));
    let p = s.activation_pool.as_ref().expect("pool configured");
    assert_eq!(p.classes[1].in_use, 1);
    assert_eq!(p.classes[1].peak_in_use, 2);
    assert_eq!(p.capacity_bytes(), (4 << 20) + (8 << 20));
}

#[test]
fn phase_changes_build_spans_and_step_records() {
    let mut s = Snapshot::new();
    let mut seq = 0;
    let mut phase = |s: &mut Snapshot, t: u64, from, to| {
        seq += 1;
        s.apply(&Event::new(
            seq,
            t,
            7,
            to,
            EventKind::PhaseChanged {
                from,
                to,
                duration_s: 0.0,
            },
        ));
    };
    phase(&mut s, 10, Phase::Idle, Phase::StepBegin);
    phase(&mut s, 20, Phase::StepBegin, Phase::Forward);
    phase(&mut s, 50, Phase::Forward, Phase::Backward);
    assert_eq!(s.phase, Phase::Backward);
    assert_eq!(s.phase_spans.len(), 2);
    let fwd = &s.phase_spans[1];
    assert_eq!((fwd.phase, fwd.start_ns, fwd.end_ns), (Phase::Forward, 20, 50));
    assert!(s.step_record(7).is_some());
}


fn register(seq: u64, id: u32) -> Event {
    ev(
        seq,
        0,
        EventKind::BlockRegistered {
            block: BlockId(id),
            name: format!("blocks.{id}"),
            bytes: 100,
            exec_order: 0,
            file_backed: false,
            trainable: false,
        },
    )
}

#[test]
fn the_largest_ids_cost_one_entry_and_an_unknown_class_is_refused() {
    let mut s = Snapshot::new();
    s.apply(&register(1, u32::MAX));
    s.apply(&register(2, 20_000_000));
    s.apply(&register(3, 0));
    assert_eq!(s.blocks.iter().map(|b| b.id.0).collect::<Vec<_>>(), [u32::MAX, 20_000_000, 0]);
    assert_eq!(s.block(BlockId(20_000_000)).map(|b| b.name.as_str()), Some("blocks.20000000"));
    s.apply(&ev(
        4,
        1,
        EventKind::Residency {
            block: BlockId(u32::MAX),
            from: BlockState::Unloaded,
            to: BlockState::HostStaged,
            refcount: 0,
        },
    ));
    assert_eq!(s.block(BlockId(u32::MAX)).map(|b| b.state), Some(BlockState::HostStaged));
    assert_eq!(s.residency_counts()[&BlockState::Unloaded], 2);
    s.apply(&ev(
        5,
        1,
        EventKind::SlabAcquired {
            pool: PoolKind::Activations,
            class: u32::MAX,
            slab: SlabId(u32::MAX),
            bytes: 1,
            waited_ms: 0.0,
        },
    ));
    assert_eq!(s.refused["pool_class_out_of_range"], 1);
    assert!(s.activation_pool.as_ref().is_none_or(|p| p.classes.is_empty()));
    s.apply(&ev(6, 1, EventKind::PrefetchHit { block: BlockId(7) }));
    assert_eq!(s.refused["unknown_block"], 1);
    assert_eq!(s.refused_total(), 2);
}

#[test]
fn registrations_past_the_bound_are_refused_and_counted() {
    let mut s = Snapshot::new();
    // Descending ids: the worst order for a vector kept sorted (quadratic); an index keeps each
    // registration O(log n).
    let n = MAX_BLOCKS as u32 + 3;
    for (i, id) in (0..n).rev().enumerate() {
        s.apply(&register(i as u64 + 1, id * 7));
    }
    assert_eq!(s.blocks.len(), MAX_BLOCKS);
    assert_eq!(s.refused["too_many_blocks"], 3);
    assert_eq!(s.residency_counts()[&BlockState::Unloaded] as usize, MAX_BLOCKS);
    // Registering a known id again replaces it and keeps the counts right.
    s.apply(&register(n as u64 + 1, 7));
    assert_eq!(s.residency_counts()[&BlockState::Unloaded] as usize, MAX_BLOCKS);
}

#[test]
fn huge_numbers_saturate_instead_of_overflowing() {
    let mut s = Snapshot::new();
    for seq in 1..=3 {
        s.apply(&ev(
            seq,
            1,
            EventKind::TransferCompleted {
                id: TransferId(seq),
                dir: Direction::H2d,
                owner: Owner::Weights,
                bytes: u64::MAX,
                duration_ms: Some(f64::MAX),
            },
        ));
        s.apply(&ev(seq, 1, EventKind::PageableFallback { pool: PoolKind::Weights, bytes: u64::MAX }));
        s.apply(&ev(
            seq,
            1,
            EventKind::PoolConfigured {
                pool: PoolKind::Activations,
                classes: vec![PoolClass { slab_bytes: u64::MAX, slabs: u32::MAX }; 2],
                pinned: true,
            },
        ));
        s.apply(&ev(seq, 1, EventKind::TelemetryLost { sink: "f".into(), lost: u64::MAX, total: 0, reason: String::new() }));
    }
    assert_eq!(s.transfers.h2d.bytes, u64::MAX);
    assert_eq!(s.weights.h2d_bytes, u64::MAX);
    assert_eq!(s.telemetry_lost, u64::MAX);
    assert_eq!(s.activation_pool.as_ref().map(|p| p.capacity_bytes()), Some(u64::MAX));
    assert_eq!(s.weight_pool.as_ref().map(|p| p.pageable_bytes), Some(u64::MAX));
}

#[test]
fn stored_text_is_clipped() {
    let mut s = Snapshot::new();
    let long = "é".repeat(10 * MAX_TEXT);
    s.apply(&ev(1, 0, EventKind::Warning { source: Owner::Trainer, message: long.clone() }));
    for i in 0..(2 * MAX_TEXT_KEYS) {
        s.apply(&ev(2, 0, EventKind::NonFinite { block: None, tensor: format!("{i}{long}") }));
    }
    assert!(s.warnings[0].message.len() <= MAX_TEXT + 3);
    assert_eq!(s.non_finite.len(), MAX_TEXT_KEYS + 1);
    assert_eq!(s.non_finite["other"], MAX_TEXT_KEYS as u64);
}

#[test]
fn a_deserialized_snapshot_finds_its_blocks_and_goes_on() {
    let mut s = Snapshot::new();
    for (seq, id) in [(1, 9), (2, 3), (3, 400)] {
        s.apply(&register(seq, id));
    }
    let mut back: Snapshot = serde_json::from_str(&serde_json::to_string(&s).expect("json")).expect("parses");
    assert_eq!(back.block(BlockId(3)).map(|b| b.id), Some(BlockId(3)), "found before any apply");
    back.apply(&ev(4, 1, EventKind::PrefetchHit { block: BlockId(400) }));
    assert_eq!(back.block(BlockId(400)).map(|b| b.last.as_str()), Some("prefetch hit"));
    assert!(back.refused.is_empty());
}

/// The whole state of the reducer travels in the snapshot: a client that receives a snapshot
/// mid-run (as JSON) and applies the rest reaches exactly what applying everything reaches.
#[test]
fn a_serialized_prefix_continues_to_the_same_snapshot() {
    let events = synthetic::events(SyntheticRun { blocks: 10, steps: 4, end_mid_step: true });
    let whole = Snapshot::from_events(&events);
    for cut in [1, events.len() / 3, events.len() / 2, events.len() - 1] {
        let prefix = Snapshot::from_events(&events[..cut]);
        let json = serde_json::to_string(&prefix).expect("serializes");
        let mut s: Snapshot = serde_json::from_str(&json).expect("parses");
        for e in &events[cut..] {
            s.apply(e);
        }
        assert_eq!(s, whole, "continuing from event {cut}");
    }
    assert!(whole.weights.prefetch_hits > 0 && whole.transfers.h2d.count > 0);
}
