//! Property tests over hostile input: the JSONL reader and the snapshot reducer never panic,
//! stay bounded, and keep their invariants. Case counts are small so that each property runs in
//! a few seconds on a loaded CI machine.

use super::jsonl::{read_from, SkipReason};
use super::model::*;
use super::snapshot::*;
use proptest::prelude::*;

fn id() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..8, Just(u32::MAX), any::<u32>()]
}

fn big() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..1000, Just(u64::MAX), any::<u64>()]
}

fn ms() -> impl Strategy<Value = f64> {
    prop_oneof![0.0f64..10.0, Just(f64::MAX), Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), any::<f64>()]
}

fn state() -> impl Strategy<Value = BlockState> {
    (0usize..6).prop_map(|i| BlockState::ALL[i])
}

fn phase() -> impl Strategy<Value = Phase> {
    (0usize..Phase::ALL.len()).prop_map(|i| Phase::ALL[i])
}

fn dir() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::H2d), Just(Direction::D2h)]
}

fn pool() -> impl Strategy<Value = PoolKind> {
    prop_oneof![Just(PoolKind::Weights), Just(PoolKind::Activations)]
}

fn kind() -> impl Strategy<Value = EventKind> {
    prop_oneof![
        (id(), ".{0,24}", big()).prop_map(|(b, name, bytes)| EventKind::BlockRegistered {
            block: BlockId(b),
            name,
            bytes,
            exec_order: b,
            file_backed: false,
            trainable: true,
        }),
        (id(), state(), state(), id()).prop_map(|(b, from, to, refcount)| EventKind::Residency {
            block: BlockId(b),
            from,
            to,
            refcount
        }),
        id().prop_map(|b| EventKind::PrefetchHit { block: BlockId(b) }),
        (id(), ms()).prop_map(|(b, stall_ms)| EventKind::PrefetchMiss { block: BlockId(b), stall_ms }),
        (id(), ms(), ms(), ms()).prop_map(|(b, queued_ms, waited_ms, ran_ms)| EventKind::HostStep { block: BlockId(b), queued_ms, waited_ms, ran_ms }),
        (id(), ms(), big()).prop_map(|(b, score, bytes)| EventKind::Eviction {
            block: BlockId(b),
            reason: EvictionReason::Budget,
            score,
            bytes
        }),
        prop::collection::vec(id(), 0..20).prop_map(|v| EventKind::ItineraryLearned {
            order: v.into_iter().map(BlockId).collect()
        }),
        (big(), dir(), big(), prop::option::of(ms())).prop_map(|(i, dir, bytes, duration_ms)| EventKind::TransferCompleted {
            id: TransferId(i),
            dir,
            owner: Owner::Weights,
            bytes,
            duration_ms
        }),
        dir().prop_map(|dir| EventKind::TransferIssued {
            id: TransferId(1),
            dir,
            owner: Owner::Activations,
            bytes: 1,
            subject: String::new()
        }),
        (pool(), prop::collection::vec((big(), id()), 0..5)).prop_map(|(pool, c)| EventKind::PoolConfigured {
            pool,
            classes: c.into_iter().map(|(slab_bytes, slabs)| PoolClass { slab_bytes, slabs }).collect(),
            pinned: true
        }),
        (pool(), id(), ms()).prop_map(|(pool, class, waited_ms)| EventKind::SlabAcquired {
            pool,
            class,
            slab: SlabId(class),
            bytes: 1,
            waited_ms
        }),
        (pool(), id()).prop_map(|(pool, class)| EventKind::SlabReleased { pool, class, slab: SlabId(0) }),
        (pool(), big()).prop_map(|(pool, bytes)| EventKind::PageableFallback { pool, bytes }),
        (big(), any::<bool>()).prop_map(|(bytes, spilled)| EventKind::Pack {
            tensor: TensorId(bytes),
            decision: if spilled { PackDecision::Spilled } else { PackDecision::Kept },
            reason: (!spilled).then_some(KeepReason::TooSmall),
            bytes,
            class: None,
            pool_hit: Some(spilled),
            region: None
        }),
        (big(), ms()).prop_map(|(bytes, stall_ms)| EventKind::Restored {
            tensor: TensorId(1),
            bytes,
            predicted: true,
            stall_ms
        }),
        (big(), big(), big()).prop_map(|(a, r, p)| EventKind::VramSample {
            allocated_bytes: a,
            reserved_bytes: r,
            peak_allocated_bytes: p
        }),
        (big(), big()).prop_map(|(a, w)| EventKind::VramOwners(
            VramByOwner { allocated_bytes: a, weights_bytes: w, activations_kept_bytes: w, ..Default::default() }.with_other()
        )),
        (big(), ms()).prop_map(|(n, t)| EventKind::WeightStep(WeightStepMetrics {
            prefetch_hits: n,
            h2d_bytes: n,
            stall_time_ms: t,
            ..Default::default()
        })),
        big().prop_map(|n| EventKind::ActivationStep(ActivationStepMetrics {
            activations_spilled: n,
            spill_bytes: n,
            ..Default::default()
        })),
        big().prop_map(|n| EventKind::TransferStep(TransferStepMetrics {
            h2d: CopyStats { count: n, bytes: n, untimed_bytes: 0, busy_ms: 1.0, last_gbps: 1.0 },
            ..Default::default()
        })),
        (phase(), phase()).prop_map(|(from, to)| EventKind::PhaseChanged { from, to, duration_s: 0.0 }),
        (big(), big()).prop_map(|(lost, total)| EventKind::TelemetryLost {
            sink: String::new(),
            lost,
            total,
            reason: String::new()
        }),
        (".{0,12}", prop::option::of(id())).prop_map(|(tensor, b)| EventKind::NonFinite {
            block: b.map(BlockId),
            tensor
        }),
        big().prop_map(|total| EventKind::EventsDropped { total }),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    (big(), big(), prop_oneof![0u64..5, Just(u64::MAX)], phase(), kind())
        .prop_map(|(seq, t_ns, step, phase, kind)| Event::new(seq, t_ns, step, phase, kind))
}

fn check_invariants(s: &Snapshot) {
    let ids: std::collections::BTreeSet<BlockId> = s.blocks.iter().map(|b| b.id).collect();
    assert_eq!(ids.len(), s.blocks.len(), "block ids unique");
    for b in &s.blocks {
        assert_eq!(s.block(b.id).map(|f| f.id), Some(b.id), "every block found by its id");
    }
    assert!(s.blocks.len() <= MAX_BLOCKS);
    let counted: u64 = s.residency.values().map(|n| *n as u64).sum();
    assert_eq!(counted, s.blocks.len() as u64, "residency counts cover every block");
    for b in &s.blocks {
        assert!(b.name.len() <= MAX_TEXT + 3);
    }
    for p in [&s.weight_pool, &s.activation_pool].into_iter().flatten() {
        assert!(p.classes.len() <= MAX_POOL_CLASSES);
    }
    assert!(s.vram_history.len() <= VRAM_HISTORY && s.steps.len() <= STEP_HISTORY);
    assert!(s.transfers.recent.len() <= RECENT_TRANSFERS && s.warnings.len() <= RECENT_WARNINGS);
    assert!(s.non_finite.len() <= MAX_TEXT_KEYS + 1);
    let t = s.tallies.weights.total();
    assert_eq!((s.weights.prefetch_hits, s.weights.h2d_bytes), (t.prefetch_hits, t.h2d_bytes));
    let t = s.tallies.transfers.total();
    assert_eq!((s.transfers.h2d.count, s.transfers.d2h.bytes), (t.h2d.count, t.d2h.bytes));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_reducer_never_panics_and_keeps_its_invariants(events in prop::collection::vec(event(), 0..120)) {
        let mut s = Snapshot::new();
        for e in &events {
            s.apply(e);
            check_invariants(&s);
        }
        prop_assert_eq!(s.events_applied, events.len() as u64);
    }

    #[test]
    fn the_reader_never_panics_and_accounts_for_every_line(
        chunks in prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                event().prop_map(|e| serde_json::to_vec(&e).unwrap_or_default()),
                // A valid line with a byte or two changed.
                (event(), any::<usize>(), any::<u8>()).prop_map(|(e, at, b)| {
                    let mut v = serde_json::to_vec(&e).unwrap_or_default();
                    if !v.is_empty() {
                        let i = at % v.len();
                        v[i] = b;
                    }
                    v
                }),
            ],
            0..40,
        )
    ) {
        let mut input = Vec::new();
        for c in &chunks {
            input.extend_from_slice(c);
            input.push(b'\n');
        }
        let (events, report) = read_from(std::io::Cursor::new(&input)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(events.len() as u64, report.events);
        prop_assert_eq!(report.events + report.blank + report.skipped_total + report.repeated, report.lines);
        let by_reason: u64 = SkipReason::ALL.iter().map(|r| report.count(*r)).sum();
        prop_assert_eq!(by_reason, report.skipped_total);
        // Whatever was read applies without a panic.
        let s = Snapshot::from_events(&events);
        check_invariants(&s);
    }

    #[test]
    fn compressed_garbage_never_panics_and_reads_what_is_whole(
        good in prop::collection::vec(event(), 0..20),
        cut in any::<usize>(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        let text = lines(&good);
        let mut raw = compress(&text, good.len(), 0)?;
        raw.extend_from_slice(&compress(&text, good.len(), good.len() as u64)?);
        raw.truncate(cut % (raw.len() + 1));
        for (at, b) in flips {
            if !raw.is_empty() {
                let i = at % raw.len();
                raw[i] ^= b;
            }
        }
        let src = super::jsonl::source::Stream::new(std::io::Cursor::new(raw), "proptest", false)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut reader = super::jsonl::Reader::from_source(src);
        let mut n = 0u64;
        for e in &mut reader {
            prop_assert!(e.is_ok());
            n += 1;
        }
        prop_assert!(n <= 2 * good.len() as u64);
        let r = reader.report();
        prop_assert_eq!(r.events + r.blank + r.skipped_total + r.repeated, r.lines);
    }

    #[test]
    fn damage_inside_frames_costs_exactly_their_events(
        frames in prop::collection::vec(prop::collection::vec(event(), 1..12), 1..8),
        hits in prop::collection::vec((any::<usize>(), any::<usize>(), 1u8..), 0..4),
    ) {
        // Frames written as the sink writes them, then bytes changed inside the data frames
        // (not their records): every event is read or counted as lost, exactly.
        let mut raw = Vec::new();
        let mut spans = Vec::new();
        let mut before = 0;
        // Events that do not serialize are not written (as the sink does).
        let frames: Vec<Vec<Event>> = frames.into_iter().map(|f| f.into_iter().filter(|e| serde_json::to_vec(e).is_ok()).collect()).collect();
        for f in &frames {
            let group = compress(&lines(f), f.len(), before)?;
            before += f.len() as u64;
            let start = raw.len() + super::jsonl::zst::RECORD_BYTES;
            raw.extend_from_slice(&group);
            spans.push((start, raw.len()));
        }
        let read_all = |raw: Vec<u8>| -> Result<(Vec<Event>, super::jsonl::ReadReport), TestCaseError> {
            let src = super::jsonl::source::Stream::new(std::io::Cursor::new(raw), "proptest", false)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut reader = super::jsonl::Reader::from_source(src);
            let read = (&mut reader).collect::<Result<Vec<_>, _>>().map_err(|e| TestCaseError::fail(e.to_string()))?;
            Ok((read, reader.into_report()))
        };
        let (baseline, _) = read_all(raw.clone())?;
        for (frame, at, b) in hits {
            let (a, z) = spans[frame % spans.len()];
            raw[a + at % (z - a)] ^= b;
        }
        let (read, r) = read_all(raw)?;
        let total: usize = frames.iter().map(Vec::len).sum();
        // (Some generated events do not read back: those are skipped lines, counted too.)
        prop_assert_eq!(read.len() as u64 + r.skipped_total + r.damaged_events, total as u64, "{}", r.summary());
        prop_assert_eq!(r.damaged_uncounted, 0);
        prop_assert!(read.iter().all(|e| baseline.contains(e)), "a damaged frame is skipped whole, never read as other events");
    }
}

fn lines(events: &[Event]) -> Vec<u8> {
    let mut text = Vec::new();
    for e in events {
        text.extend_from_slice(&serde_json::to_vec(e).unwrap_or_default());
        text.push(b'\n');
    }
    text
}

fn compress(text: &[u8], events: usize, before: u64) -> Result<Vec<u8>, TestCaseError> {
    super::jsonl::zst::compress_frame(text, events as u64, before).map_err(|e| TestCaseError::fail(e.to_string()))
}
