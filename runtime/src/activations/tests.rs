//! Runtime-level tests that drive the store directly (pack/unpack/release as autograd would),
//! on the host device, with events captured from the bus.

use super::*;
use crate::error::Error;
use crate::device::Device;
use crate::events::{Bus, Event, EventKind, Hub, KeepReason, PackDecision};
use crate::test_support::Collect;
use crate::torch::SavedTensorStore;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

const N: u64 = 64 << 10; // bytes of one test tensor

fn setup(cfg: ActivationConfig) -> (ActivationRuntime, Bus, Arc<Mutex<Vec<Event>>>) {
    let hub = Arc::new(Hub::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    hub.add_sink(Box::new(Collect(seen.clone())));
    let bus = Bus::with_hub(hub, 1 << 16);
    let rt = ActivationRuntime::new(Device::host(1 << 30), cfg, bus.clone(), None).expect("runtime");
    (rt, bus, seen)
}

fn events(bus: &Bus, seen: &Arc<Mutex<Vec<Event>>>) -> Vec<EventKind> {
    bus.flush();
    seen.lock().expect("events").iter().map(|e| e.kind.clone()).collect()
}

fn tensor(seed: f64) -> Tensor {
    Tensor::arange((N / 4) as i64, (Kind::Float, tch::Device::Cpu)) * seed
}

/// Saves each tensor, as autograd's forward would.
fn pack_all(store: &ActivationStore, ts: &[Tensor]) -> Vec<u64> {
    ts.iter().map(|t| store.pack(t.shallow_clone()).expect("pack")).collect()
}

/// Unpacks every handle in reverse (backward's order), checks it gives back its tensor, and
/// releases it.
fn unpack_all_in_reverse(store: &ActivationStore, hs: &[u64], ts: &[Tensor]) {
    for (h, t) in hs.iter().zip(ts).rev() {
        assert!(store.unpack(*h).expect("unpack").equal(t));
        store.release(*h);
    }
}

fn base() -> ActivationConfigBuilder {
    ActivationConfig::builder()
        .watermarks_bytes(1, 0)
        .min_spill_bytes(1)
        .classes_bytes(&[N, 4 * N])
        .slabs_per_class(&[16, 2])
        .keep_tail_groups(0)
        // Each tensor copied on its own: these tests follow single spills (batches: below).
        .spill_batches(0, 0)
}

#[test]
fn landed_spills_are_finalized_without_waiting_whatever_the_cap() {
    // Host copies land at once: each spill is finalized by the next pack without a wait, and
    // the last one, still unseen when backward begins, by the first unpack's look (backward
    // does not wait for spills in flight: it finalizes those that landed).
    for cap in [1u32, 64] {
        let (rt, bus, seen) = setup(base().max_inflight(cap, 1).build().expect("config"));
        let store = rt.store();
        rt.begin_step(1);
        let ts: Vec<Tensor> = (0..11).map(|i| tensor(i as f64)).collect();
        let handles: Vec<u64> = ts.iter().map(|t| store.pack(t.shallow_clone()).expect("pack")).collect();
        let m = rt.metrics();
        // The first pack sees an empty device and is kept; every later one is spilled.
        assert_eq!((m.activations_kept, m.activations_spilled), (1, 10), "cap {cap}");
        for (h, t) in handles.iter().zip(&ts).rev() {
            assert!(store.unpack(*h).expect("unpack").equal(t));
            store.release(*h);
        }
        rt.end_step().expect("step end");
        let fin: Vec<bool> = events(&bus, &seen)
            .into_iter()
            .filter_map(|k| match k {
                EventKind::SpillFinalized { inline, .. } => Some(inline),
                _ => None,
            })
            .collect();
        assert_eq!(fin.len(), 10, "every spill finalized once");
        assert_eq!(fin.iter().filter(|i| **i).count(), 0, "cap {cap}: no spill was waited for");
    }
}

#[test]
fn hysteresis_spills_from_high_until_under_low() {
    let cfg = base().watermarks_bytes(3 * N, 2 * N).max_inflight(1, 1).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let kept: Vec<u64> = (0..3).map(|i| store.pack(tensor(i as f64)).expect("pack")).collect();
    assert!(!rt.is_spilling());
    assert_eq!(rt.device().memory().allocated, 3 * N);
    let s1 = store.pack(tensor(9.0)).expect("pack");
    assert!(rt.is_spilling(), "on at the high watermark");
    // s1 has landed (freed at this pack): 3N kept, between the watermarks: still on.
    let s2 = store.pack(tensor(8.0)).expect("pack");
    assert!(rt.is_spilling());
    // Free two kept tensors: N kept once s2 lands, under low: off again.
    store.release(kept[0]);
    store.release(kept[1]);
    let k = store.pack(tensor(7.0)).expect("pack");
    assert!(!rt.is_spilling());
    let toggles: Vec<bool> = events(&bus, &seen)
        .into_iter()
        .filter_map(|e| match e {
            EventKind::SpillingToggled { on, .. } => Some(on),
            _ => None,
        })
        .collect();
    assert_eq!(toggles, vec![true, false]);
    let m = rt.metrics();
    assert_eq!((m.activations_spilled, m.activations_kept), (2, 4));
    for h in [s1, s2, k, kept[2]] {
        store.release(h);
    }
    rt.end_step().expect("step end");
    assert_eq!(rt.device().memory().allocated, 0);
}

#[test]
fn checksums_refuse_a_corrupted_spill_with_an_error_naming_it() {
    let (rt, bus, seen) = setup(base().debug_checksums(true).build().expect("config"));
    let store = rt.store();
    rt.begin_step(1);
    let t = tensor(2.0);
    let (h, id) = {
        let _r = rt.region("blocks.3.mlp");
        let _first = store.pack(tensor(1.0)).expect("kept");
        let h = store.pack(t.shallow_clone()).expect("spilled");
        let g = rt.shared().lock();
        let id = g.records().index_of(h).and_then(|i| g.records().get(i)).map(|r| r.id);
        (h, id)
    };
    // The test hook: one bit of the spilled slab flipped in host memory.
    let flip = || {
        let shared = rt.shared();
        let mut g = shared.lock();
        let ctx = shared.ctx(&g);
        let (records, spills) = g.records_and_spills();
        spills.drain(records, &ctx).expect("finalize");
        let idx = records.index_of(h).expect("record");
        let host = records.get_mut(idx).and_then(|r| r.host.as_mut()).expect("spilled bytes");
        host.as_mut_slice().expect("the only tensor in its slab")[17] ^= 0x40;
    };
    flip();
    match rt.shared().unpack(h) {
        Err(Error::SpillCorrupted { tensor, region, spilled, found }) => {
            assert_eq!(Some(tensor), id);
            assert_eq!(region.as_deref(), Some("blocks.3.mlp"));
            assert_ne!(spilled, found);
        }
        other => panic!("expected a corrupted spill, got {other:?}"),
    }
    // Autograd sees the same message; the warning carries it too.
    let err = store.unpack(h).expect_err("still refused");
    assert!(err.to_string().contains("in region 'blocks.3.mlp' changed in host memory"), "{err}");
    assert!(events(&bus, &seen)
        .iter()
        .any(|e| matches!(e, EventKind::Warning { message, .. } if message.contains("changed in host memory"))));
    // Refused before anything changed: with the bit flipped back the restore goes through.
    flip();
    assert!(store.unpack(h).expect("restored").equal(&t));
    rt.end_step().expect("step end");
    assert_eq!(rt.pool_stats().free, rt.pool_stats().total);
}

#[test]
fn duplicates_are_spilled_once_and_both_handles_restore() {
    let (rt, bus, seen) = setup(base().build().expect("config"));
    let store = rt.store();
    rt.begin_step(1);
    let _k = store.pack(tensor(1.0)).expect("kept");
    let t = tensor(3.0);
    let a = store.pack(t.shallow_clone()).expect("spill");
    let b = store.pack(t.shallow_clone()).expect("duplicate");
    assert_eq!(rt.metrics().activations_spilled, 1);
    assert!(store.unpack(b).expect("b").equal(&t));
    assert!(store.unpack(a).expect("a").equal(&t));
    let decisions: Vec<PackDecision> = events(&bus, &seen)
        .into_iter()
        .filter_map(|e| match e {
            EventKind::Pack { decision, .. } => Some(decision),
            _ => None,
        })
        .collect();
    assert_eq!(decisions, vec![PackDecision::Kept, PackDecision::Spilled, PackDecision::Duplicate]);
    store.release(a);
    assert_eq!(rt.live_records(), 2, "one handle still holds the spilled record");
    store.release(b);
    assert_eq!(rt.live_records(), 1);
    let m = rt.end_step().expect("step end");
    assert_eq!(m.activations_restored, 1);
}

#[test]
fn exhausted_pool_falls_back_then_is_sized_from_the_step() {
    let cfg = base().classes_bytes(&[N]).slabs_per_class(&[1]).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let ts: Vec<Tensor> = (0..4).map(|i| tensor(i as f64 + 1.0)).collect();
    let hs: Vec<u64> = ts.iter().map(|t| store.pack(t.shallow_clone()).expect("pack")).collect();
    let m = rt.metrics();
    assert_eq!((m.activations_spilled, m.pool_hits, m.pool_misses), (3, 1, 2));
    for (h, t) in hs.iter().zip(&ts).rev() {
        assert!(store.unpack(*h).expect("unpack").equal(t));
    }
    let ev = events(&bus, &seen);
    assert_eq!(ev.iter().filter(|e| matches!(e, EventKind::PageableFallback { .. })).count(), 2);
    // The first pool is provisional (a traced step sizes the real one): no warning for it.
    assert_eq!(ev.iter().filter(|e| matches!(e, EventKind::Warning { .. })).count(), 0);
    let staged = rt.pool_bytes();
    rt.end_step().expect("step end");
    // The traced pool is cut from the arena the fallbacks gave back to: nothing more is held.
    assert_eq!(rt.pool_bytes(), staged);
    assert!(staged >= 4 * N, "{staged}");
    // The step held three spills of this size at once: the pool now holds three slabs of it
    // and one more (an eighth, at least one, for later steps that spill a little more), and the
    // same step again finds a slab for each.
    let s = rt.pool_stats();
    assert_eq!((s.total.clone(), s.free.clone(), s.fallbacks), (vec![4], vec![4], 0));
    rt.begin_step(2);
    let hs: Vec<u64> = ts.iter().map(|t| store.pack(t.shallow_clone()).expect("pack")).collect();
    let m = rt.metrics();
    assert_eq!((m.activations_spilled, m.pool_hits, m.pool_misses), (3, 3, 0));
    for h in hs.iter().rev() {
        store.release(*h);
    }
    rt.end_step().expect("step end");
    assert_eq!(rt.metrics().pin_ms, 0.0);
}

/// The time a step spends pinning for spills is its own: the first step, whose fallbacks
/// outgrow the arena's first chunk, reports it; the next, which finds every slab, pins nothing.
#[test]
fn a_step_reports_the_time_it_spent_pinning_for_spills() {
    let cfg = base().classes_bytes(&[N]).slabs_per_class(&[1]).build().expect("config");
    let (rt, _bus, _seen) = setup(cfg);
    let store = rt.store();
    // 4 MiB tensors, six held at once: more than the arena's first 16 MiB chunk.
    let ts: Vec<Tensor> = (0..6).map(|i| Tensor::full([1 << 20], i as f64, (Kind::Float, tch::Device::Cpu))).collect();
    for step in 1..=2 {
        rt.begin_step(step);
        unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
        rt.end_step().expect("step end");
        let m = rt.metrics();
        if step == 1 {
            assert!(m.pool_misses > 0 && m.pin_ms > 0.0, "{m:?}");
        } else {
            assert_eq!((m.pool_misses, m.pin_ms), (0, 0.0), "{m:?}");
        }
    }
}

/// Two micro-batches in one step, each restoring and releasing what it spilled before the next
/// spills: the traced pool holds what one of them held at once, not what the step spilled in
/// all (restored spills give their memory back; a slab larger than the request still counts
/// as the request's size).
#[test]
fn a_traced_pool_holds_what_is_held_at_once_not_what_the_step_spilled_in_all() {
    let cfg = base().classes_bytes(&[2 * N]).slabs_per_class(&[1]).build().expect("config");
    let (rt, _bus, _seen) = setup(cfg);
    let store = rt.store();
    let ts: Vec<Tensor> = (0..4).map(|i| tensor(i as f64 + 1.0)).collect();
    for step in 1..=2 {
        rt.begin_step(step);
        for _micro in 0..3 {
            unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
        }
        let m = rt.end_step().expect("step end");
        // The first micro-batch keeps its first tensor (under the watermark), the others spill
        // all four.
        assert_eq!((m.activations_spilled, m.activations_restored), (11, 11), "step {step}");
        let s = rt.pool_stats();
        // Four spills held at once, and one more (an eighth, at least one): five slabs, in
        // which the second step finds room for every spill.
        assert_eq!(s.total, vec![5], "step {step}: {s:?}");
        if step == 2 {
            assert_eq!(m.pool_misses, 0, "{m:?}");
        }
    }
}

/// The first step's provisional pool sends its spills through pageable memory; with the step in
/// micro-batches, the pool is sized between the first and the second, whose spills all find
/// slabs, and the step's end does not size it again.
#[test]
fn the_first_steps_later_micro_batches_spill_into_the_pool_the_first_one_sized() {
    let cfg = base().classes_bytes(&[N]).slabs_per_class(&[1]).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    let ts: Vec<Tensor> = (0..4).map(|i| tensor(i as f64 + 1.0)).collect();
    let pools = |ev: &[EventKind]| ev.iter().filter(|e| matches!(e, EventKind::PoolConfigured { .. })).count();
    let before = pools(&events(&bus, &seen));
    rt.begin_step(1);
    unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
    let misses = rt.metrics().pool_misses;
    assert!(misses > 0, "the provisional pool is too small");
    rt.between_micro_batches().expect("between micro-batches");
    assert_eq!(pools(&events(&bus, &seen)), before + 1, "sized once, between the micro-batches");
    for _ in 0..2 {
        unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
        rt.between_micro_batches().expect("between micro-batches");
    }
    let m = rt.end_step().expect("step end");
    assert_eq!(m.pool_misses, misses, "the later micro-batches found slabs: {m:?}");
    assert_eq!(pools(&events(&bus, &seen)), before + 1, "and the pool was not sized again");
}

#[test]
fn a_fixed_pool_warns_once_when_it_falls_back() {
    let cfg = base().classes_bytes(&[N]).slabs_per_class(&[1]).size_pool_from_trace(false, None).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let hs: Vec<u64> = (0..4).map(|i| store.pack(tensor(i as f64 + 1.0)).expect("pack")).collect();
    let ev = events(&bus, &seen);
    assert_eq!(ev.iter().filter(|e| matches!(e, EventKind::Warning { .. })).count(), 1);
    for h in hs.iter().rev() {
        store.release(*h);
    }
    rt.end_step().expect("step end");
    assert_eq!(rt.pool_stats().total, vec![1], "a fixed pool stays as configured");
}

#[test]
fn an_exhausted_pool_without_fallback_keeps_with_its_own_reason_and_warns_once() {
    let cfg = base()
        .classes_bytes(&[N])
        .slabs_per_class(&[1])
        .pageable_fallback(false)
        .size_pool_from_trace(false, None)
        .build()
        .expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    // Kept (an empty device), spilled into the one slab, then two the full pool cannot take,
    // then one larger than every slab.
    let mut hs: Vec<u64> = (0..4).map(|i| store.pack(tensor(i as f64 + 1.0)).expect("pack")).collect();
    let big = Tensor::zeros([(2 * N / 4) as i64], (Kind::Float, tch::Device::Cpu));
    hs.push(store.pack(big).expect("pack"));
    let ev = events(&bus, &seen);
    let reasons: Vec<Option<KeepReason>> = ev
        .iter()
        .filter_map(|e| match e {
            EventKind::Pack { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect();
    assert_eq!(
        reasons,
        vec![
            Some(KeepReason::UnderWatermark),
            None,
            Some(KeepReason::PoolExhausted),
            Some(KeepReason::PoolExhausted),
            Some(KeepReason::TooLarge),
        ]
    );
    let warnings: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            EventKind::Warning { message, .. } => Some(message.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(warnings.len(), 2, "one warning per cause and step: {warnings:?}");
    assert!(warnings[0].contains("no pinned slab is free") && warnings[0].contains("pageable fallback is off"), "{}", warnings[0]);
    assert!(warnings[1].contains("larger than the largest pinned slab"), "{}", warnings[1]);
    for h in hs.iter().rev() {
        store.release(*h);
    }
    rt.end_step().expect("step end");
    // A new step warns again.
    rt.begin_step(2);
    let hs: Vec<u64> = (0..3).map(|i| store.pack(tensor(i as f64 + 1.0)).expect("pack")).collect();
    let again = events(&bus, &seen).iter().filter(|e| matches!(e, EventKind::Warning { .. })).count();
    assert_eq!(again, 3);
    for h in hs.iter().rev() {
        store.release(*h);
    }
    rt.end_step().expect("step end");
}

#[test]
fn predictive_restorer_runs_ahead_so_only_the_first_unpack_stalls() {
    let cfg = base().restore_ahead(2, 8 * N).max_inflight(1, 1).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let ts: Vec<Tensor> = (0..7).map(|i| tensor(i as f64 + 1.0)).collect();
    unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
    let m = rt.end_step().expect("step end");
    assert_eq!(m.activations_spilled, 6);
    assert_eq!(m.stall_count, 1, "{m:?}");
    assert_eq!(m.activations_predicted, 5, "{m:?}");
    assert_eq!(m.activations_restored, 6);
    let restored: Vec<bool> = events(&bus, &seen)
        .into_iter()
        .filter_map(|e| match e {
            EventKind::Restored { predicted, .. } => Some(predicted),
            _ => None,
        })
        .collect();
    assert_eq!(restored, vec![false, true, true, true, true, true]);
}

#[test]
fn nothing_is_left_after_the_step_even_without_backward() {
    let (rt, bus, seen) = setup(base().build().expect("config"));
    let store = rt.store();
    rt.begin_step(1);
    let hs: Vec<u64> = (0..5).map(|i| store.pack(tensor(i as f64)).expect("pack")).collect();
    let _ = store.unpack(hs[4]).expect("restore one");
    assert!(rt.device().memory().allocated > 0);
    let m = rt.end_step().expect("step end");
    assert_eq!(m.activations_saved, 5);
    assert_eq!(rt.live_records(), 0);
    assert_eq!(rt.device().memory().allocated, 0, "every accounted byte given back");
    assert_eq!(rt.pool_stats().free, rt.pool_stats().total);
    // A release arriving after the step ended is ignored; an unpack is a clear error.
    store.release(hs[0]);
    let err = store.unpack(hs[1]).expect_err("cleared");
    assert!(err.to_string().contains("already ended"), "{err}");
    let ev = events(&bus, &seen);
    let step = ev.iter().find_map(|e| match e {
        EventKind::ActivationStep(m) => Some(m.clone()),
        _ => None,
    });
    assert_eq!(step, Some(m));
}

/// The D2H copies the runtime issued, by subject, and whether each one's completion (with its
/// duration) was reported.
fn spill_copies(ev: &[EventKind]) -> Vec<(String, bool)> {
    use crate::events::Direction;
    ev.iter()
        .filter_map(|e| match e {
            EventKind::TransferIssued { id, dir: Direction::D2h, subject, .. } => Some((
                subject.clone(),
                ev.iter().any(|c| matches!(c, EventKind::TransferCompleted { id: done, duration_ms, .. } if done == id && duration_ms.is_some_and(|ms| ms >= 0.0))),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn small_spills_travel_in_one_copy_per_region_batch_and_restore_exactly() {
    // Tensors under 4N gather, 8N a batch at most; checksums verify every restored byte.
    let cfg = base()
        .spill_batches(4 * N, 8 * N)
        .classes_bytes(&[N, 8 * N])
        .slabs_per_class(&[4, 4])
        .debug_checksums(true)
        .build()
        .expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let mut saved: Vec<(u64, Tensor)> = Vec::new();
    let mut pack = |n: usize, seed: f64| {
        for i in 0..n {
            let t = tensor(seed + i as f64);
            saved.push((store.pack(t.shallow_clone()).expect("pack"), t));
        }
    };
    {
        let _r = rt.region("blocks.0");
        pack(6, 1.0); // the first is kept (an empty device), five batched
    }
    {
        let _r = rt.region("blocks.1");
        pack(10, 20.0); // a full batch of eight, then two
    }
    {
        let _r = rt.region("blocks.2");
        pack(1, 40.0); // a batch of one is a single copy
    }
    // Batched tensors wait on the device: the last region's one is not copied yet, and the
    // batch before it not yet seen landed.
    assert_eq!(rt.metrics().activations_spilled, 15);
    assert_eq!(rt.held_bytes().spilling, 3 * N);
    for (h, t) in saved.iter().rev() {
        assert!(store.unpack(*h).expect("unpack").equal(t));
        store.release(*h);
    }
    let m = rt.end_step().expect("step end");
    assert_eq!((m.activations_kept, m.activations_spilled, m.activations_restored), (1, 16, 16));
    assert_eq!((m.spill_bytes, m.pool_misses), (16 * N, 0));
    let ev = events(&bus, &seen);
    let copies = spill_copies(&ev);
    let subjects: Vec<&str> = copies.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        subjects,
        vec![
            "batch of 5 tensors of blocks.0",
            "batch of 8 tensors of blocks.1",
            "batch of 2 tensors of blocks.1",
            "tensor 17",
        ]
    );
    assert!(copies.iter().all(|(_, reported)| *reported), "every copy's duration is reported: {copies:?}");
    // Each spill's pack decision names its region and the batch's slab class.
    let spilled: Vec<(Option<String>, Option<u32>)> = ev
        .iter()
        .filter_map(|e| match e {
            EventKind::Pack { decision: PackDecision::Spilled, region, class, .. } => Some((region.clone(), *class)),
            _ => None,
        })
        .collect();
    assert_eq!(spilled.len(), 16);
    assert!(spilled[..13].iter().all(|(_, class)| *class == Some(1)), "{spilled:?}");
    assert_eq!(spilled[15], (Some("blocks.2".into()), Some(0)));
    assert_eq!(rt.device().memory().allocated, 0);
    assert_eq!(rt.pool_stats().free, rt.pool_stats().total, "every slab back once its last tensor was restored");
}

#[test]
fn a_batched_tensor_released_before_its_copy_leaves_the_batch() {
    let cfg = base().spill_batches(4 * N, 8 * N).classes_bytes(&[N, 8 * N]).slabs_per_class(&[4, 4]).build().expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let _r = rt.region("blocks.0");
    let ts: Vec<Tensor> = (0..4).map(|i| tensor(i as f64 + 1.0)).collect();
    let hs: Vec<u64> = ts.iter().map(|t| store.pack(t.shallow_clone()).expect("pack")).collect();
    store.release(hs[2]);
    assert_eq!(rt.held_bytes().spilling, 2 * N);
    for i in [3, 1, 0] {
        assert!(store.unpack(hs[i]).expect("unpack").equal(&ts[i]));
        store.release(hs[i]);
    }
    let m = rt.end_step().expect("step end");
    // It never left the device: counted as kept, with why.
    assert_eq!((m.activations_saved, m.activations_kept, m.activations_spilled), (4, 2, 2));
    let ev = events(&bus, &seen);
    assert!(ev.iter().any(|e| matches!(e, EventKind::Pack { reason: Some(KeepReason::ReleasedBeforeCopy), .. })));
    let copies = spill_copies(&ev);
    assert_eq!(copies.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), vec!["batch of 2 tensors of blocks.0"]);
    assert_eq!(rt.device().memory().allocated, 0);
    assert_eq!(rt.pool_stats().free, rt.pool_stats().total);
}

#[test]
fn a_batch_no_slab_takes_is_spilled_tensor_by_tensor() {
    // Slabs of one tensor and no pageable fallback: the batch is refused as a whole, its tensors
    // are spilled one by one, and those the pool cannot take either are kept, with the reason.
    let cfg = base()
        .spill_batches(4 * N, 8 * N)
        .classes_bytes(&[N])
        .slabs_per_class(&[2])
        .pageable_fallback(false)
        .size_pool_from_trace(false, None)
        .build()
        .expect("config");
    let (rt, bus, seen) = setup(cfg);
    let store = rt.store();
    rt.begin_step(1);
    let ts: Vec<Tensor> = (0..4).map(|i| tensor(i as f64 + 1.0)).collect();
    unpack_all_in_reverse(&store, &pack_all(&store, &ts), &ts);
    let m = rt.end_step().expect("step end");
    assert_eq!((m.activations_kept, m.activations_spilled), (2, 2));
    let ev = events(&bus, &seen);
    let copies = spill_copies(&ev);
    assert_eq!(copies.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), vec!["tensor 2", "tensor 3"]);
    let reasons: Vec<Option<KeepReason>> = ev
        .iter()
        .filter_map(|e| match e {
            EventKind::Pack { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons, vec![Some(KeepReason::UnderWatermark), None, None, Some(KeepReason::PoolExhausted)]);
    assert_eq!(rt.pool_stats().free, rt.pool_stats().total);
}

#[test]
fn batch_settings_are_checked() {
    let e = ActivationConfig::builder().spill_batches(8 * N, 4 * N).build().expect_err("a batch smaller than its members");
    assert!(e.to_string().contains("spill_batch_bytes"), "{e}");
    ActivationConfig::builder().spill_batches(0, 0).build().expect("off");
}

mod batches {
    //! Any mix of batched and single spills, regions, duplicate saves, early releases and batch
    //! settings gives every tensor back exactly and leaves nothing held.
    use super::*;
    use proptest::prelude::*;

    const UNIT: u64 = 16 << 10;

    fn unit_tensor(units: u64, seed: f64) -> Tensor {
        Tensor::arange((units * UNIT / 4) as i64, (Kind::Float, tch::Device::Cpu)) * seed
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn every_tensor_comes_back_and_nothing_is_held(
            saves in proptest::collection::vec((1u64..=6, 0usize..3, any::<bool>(), any::<bool>()), 1..40),
            below in 0u64..=8,
            extra in 0u64..=8,
            fallback in any::<bool>(),
        ) {
            let cfg = base()
                .spill_batches(below * UNIT, (below + extra) * UNIT)
                .classes_bytes(&[UNIT, 4 * UNIT, 16 * UNIT])
                .slabs_per_class(&[8, 8, 8])
                .pageable_fallback(fallback)
                .size_pool_from_trace(false, None)
                .debug_checksums(true)
                .build()
                .expect("config");
            let (rt, _bus, _seen) = setup(cfg);
            let store = rt.store();
            rt.begin_step(1);
            let mut live = Vec::new();
            // The tensor saved last and how many of its handles are unreleased: a save of it
            // again is a duplicate while one is (its record lives), a new record otherwise.
            let mut previous: Option<(Tensor, u32)> = None;
            let mut duplicates = 0u64;
            for (i, &(units, region, release_early, again)) in saves.iter().enumerate() {
                let t = match previous.as_mut() {
                    Some((p, handles)) if again => {
                        if *handles > 0 {
                            duplicates += 1;
                        }
                        *handles += u32::from(!release_early);
                        p.shallow_clone()
                    }
                    _ => {
                        let t = unit_tensor(units, i as f64 + 1.0);
                        previous = Some((t.shallow_clone(), u32::from(!release_early)));
                        t
                    }
                };
                let h = {
                    let _r = rt.region(&format!("blocks.{region}"));
                    store.pack(t.shallow_clone()).expect("pack")
                };
                if release_early {
                    // Released before backward, possibly while its batch is still open.
                    store.release(h);
                } else {
                    live.push((h, t));
                }
            }
            for (h, t) in live.iter().rev() {
                prop_assert!(store.unpack(*h).expect("unpack").equal(t));
                store.release(*h);
            }
            let m = rt.end_step().expect("step end");
            prop_assert_eq!(m.activations_saved, saves.len() as u64 - duplicates);
            prop_assert_eq!(m.activations_saved, m.activations_kept + m.activations_spilled);
            prop_assert_eq!(rt.live_records(), 0);
            prop_assert_eq!(rt.held_bytes(), HeldBytes::default());
            prop_assert_eq!(rt.device().memory().allocated, 0);
            let pool = rt.pool_stats();
            prop_assert_eq!(pool.free, pool.total);
        }
    }
}

/// A saved tensor of a kind tch cannot name (flash attention's RNG state on CUDA; `kind()`
/// panics on it) is kept as it is, counted at its storage's bytes for its own reason, and given
/// back unchanged, while spilling is on.
#[test]
fn a_tensor_of_an_unnamed_kind_is_kept_as_it_is() {
    let (rt, bus, seen) = setup(base().max_inflight(1, 1).build().expect("config"));
    let store = rt.store();
    rt.begin_step(1);
    // The first pack is kept (an empty device), the second spilled: spilling is on.
    let ts = [tensor(1.0), tensor(2.0)];
    let before = pack_all(&store, &ts);
    assert!(rt.is_spilling());
    let odd = crate::torch::hooks::unsigned_scalar();
    let h = store.pack(odd.shallow_clone()).expect("an unnamed kind packs");
    let back = store.unpack(h).expect("unpack");
    assert_eq!(back.data_ptr(), odd.data_ptr(), "the same tensor, not a copy");
    store.release(h);
    unpack_all_in_reverse(&store, &before, &ts);
    rt.end_step().expect("step end");
    let kept: Vec<(Option<KeepReason>, u64)> = events(&bus, &seen)
        .into_iter()
        .filter_map(|k| match k {
            EventKind::Pack { reason: Some(KeepReason::UnnamedKind), bytes, .. } => Some((Some(KeepReason::UnnamedKind), bytes)),
            _ => None,
        })
        .collect();
    assert_eq!(kept, vec![(Some(KeepReason::UnnamedKind), 8)]);
}
