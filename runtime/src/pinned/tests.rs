use super::*;

fn pool(fallback: bool) -> SlabPool {
    SlabPool::new(&Device::host(0), PoolKind::Activations, &[1024, 4096], &[2, 1], fallback, Bus::disabled())
        .expect("pool")
}

#[test]
fn smallest_fitting_class_then_larger_then_fallback() {
    let p = pool(true);
    let (a, hit_a) = p.acquire(100).expect("a");
    let (b, hit_b) = p.acquire(1024).expect("b");
    assert_eq!((a.class(), hit_a, b.class(), hit_b), (Some(0), true, Some(0), true));
    // Class 0 is empty: the next small request goes to class 1.
    let (c, hit_c) = p.acquire(10).expect("c");
    assert_eq!((c.class(), hit_c), (Some(1), true));
    // Everything is taken: pageable fallback, a miss.
    let (d, hit_d) = p.acquire(10).expect("d");
    assert_eq!((d.class(), hit_d, d.is_pinned()), (None, false, false));
    // Larger than every class: straight to the fallback.
    let (e, hit_e) = p.acquire(1 << 20).expect("e");
    assert_eq!((e.class(), hit_e, e.len()), (None, false, 1 << 20));
    let s = p.stats();
    assert_eq!((s.fallbacks, s.free.clone(), s.in_use(), s.pinned_fallback_bytes), (2, vec![0, 0], 3, 0));
    drop((a, b, c, d, e));
    let s = p.stats();
    assert_eq!((s.free, s.fallbacks_live, s.peak_in_use), (vec![2, 1], 0, vec![2, 1]));
}

/// On CUDA a miss pins a buffer of its own while the slabs and the live pinned fallbacks stay
/// within the pool's pinned limit, and takes pageable memory over it (skipped without a GPU).
#[test]
fn on_cuda_a_miss_pins_its_fallback_within_the_pinned_limit() {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => return eprintln!("skipping the CUDA check: {e}"),
    };
    const MIB: usize = 1 << 20;
    let p = SlabPool::new(&dev, PoolKind::Activations, &[MIB as u64], &[1], true, Bus::disabled()).expect("pool");
    p.limit_pinned(Some(18 * MIB as u64));
    let (slab, hit) = p.acquire(MIB).expect("slab");
    assert!(hit && slab.is_pinned());
    // 1 + 16 MiB: within the limit, pinned on the spot (through a registered mapping).
    let (mut a, hit) = p.acquire(16 * MIB).expect("a");
    assert!(!hit && a.is_pinned());
    a.as_mut_slice().fill(7);
    // 1 + 16 + 2 MiB: over it, pageable.
    let (b, hit) = p.acquire(2 * MIB).expect("b");
    assert!(!hit && !b.is_pinned());
    let s = p.stats();
    assert_eq!((s.fallbacks, s.pinned_fallback_bytes, s.pinned_fallback_live_bytes), (2, 16 * MIB as u64, 16 * MIB as u64));
    assert!(a.as_slice().iter().all(|&x| x == 7));
    drop(a);
    assert_eq!(p.stats().pinned_fallback_live_bytes, 0);
    let (c, _) = p.acquire(MIB).expect("c");
    assert!(c.is_pinned(), "the room a dropped fallback left is pinned again");
}

#[test]
fn slabs_do_not_overlap_and_return_to_their_class_on_drop() {
    let p = pool(false);
    let (mut a, _) = p.acquire(1000).expect("a");
    let (mut b, _) = p.acquire(1000).expect("b");
    a.as_mut_slice().fill(1);
    b.as_mut_slice().fill(2);
    assert!(a.as_slice().iter().all(|&x| x == 1), "b's writes did not reach a");
    drop(b);
    let (c, _) = p.acquire(10).expect("c");
    assert_eq!(c.class(), Some(0), "a released slab goes back to its own class");
}

#[test]
fn without_fallback_an_exhausted_pool_refuses() {
    let p = pool(false);
    let _big = p.acquire(4096).expect("class 1");
    let err = p.acquire(2000).expect_err("nothing fits");
    assert!(err.to_string().contains("pageable fallback is off"), "{err}");
    let err = p.acquire(1 << 20).expect_err("larger than every slab");
    assert!(err.to_string().contains("largest slab has 4096"), "{err}");
}

#[test]
fn a_waiter_gets_a_released_slab_and_shutdown_wakes_waiters() {
    let p = SlabPool::new(&Device::host(0), PoolKind::Weights, &[64], &[1], false, Bus::disabled()).expect("pool");
    let held = p.acquire_wait(64, None).expect("acquire").expect("free");
    assert!(p.acquire_wait(8, Some(Duration::from_millis(5))).expect("no error").is_none(), "times out");
    let q = p.clone();
    let t = std::thread::spawn(move || q.acquire_wait(8, None).map(|l| l.map(|l| l.class())));
    // The waiter either already waits or will find the slab free: both end with the slab.
    drop(held);
    assert_eq!(t.join().expect("thread").expect("slab"), Some(Some(0)));
    let q = p.clone();
    let held = p.acquire_wait(64, None).expect("acquire").expect("free");
    let t = std::thread::spawn(move || q.acquire_wait(8, None).map(|_| ()));
    p.shutdown();
    assert!(matches!(t.join().expect("thread"), Err(Error::Shutdown(_))));
    drop(held);
}

#[test]
fn a_class_larger_than_the_arenas_chunks_is_cut_in_ranges_whose_slabs_do_not_overlap() {
    let arena = HostPool::growing(&Device::host(0), 64 << 10, 64 << 10);
    // 10 slabs of 16 KiB in ranges of at most 64 KiB: 4 + 4 + 2.
    let p = SlabPool::in_arena(&arena, PoolKind::Activations, &[16 << 10], &[10], false, Bus::disabled()).expect("pool");
    assert_eq!(p.shared.classes[0].ranges.len(), 3);
    assert_eq!(p.capacity_bytes(), 160 << 10);
    let mut leases: Vec<Lease> = (0..10).map(|_| p.acquire(16 << 10).expect("slab").0).collect();
    for (i, l) in leases.iter_mut().enumerate() {
        l.as_mut_slice().fill(i as u8);
    }
    for (i, l) in leases.iter().enumerate() {
        assert!(l.as_slice().iter().all(|&x| x == i as u8), "slab {i} was overwritten");
    }
    assert!(p.acquire(1).is_err(), "every slab is taken and there is no fallback");
}

#[test]
fn a_pool_replaced_in_its_arena_is_cut_from_what_the_old_one_and_its_fallbacks_gave_back() {
    let arena = HostPool::growing(&Device::host(0), 64 << 10, 1 << 20);
    let mut p = SlabPool::in_arena(&arena, PoolKind::Activations, &[4096], &[2], true, Bus::disabled()).expect("pool");
    // A first step's spills: the two slabs, then fallbacks cut from the arena.
    let slabs: Vec<Lease> = (0..2).map(|_| p.acquire(4096).expect("slab").0).collect();
    let fallbacks: Vec<Lease> = (0..3).map(|_| p.acquire(100 << 10).expect("fallback").0).collect();
    assert!(fallbacks.iter().all(|l| l.class().is_none()));
    assert_eq!(p.stats().fallback_bytes, 3 * (100 << 10));
    drop((slabs, fallbacks));
    let pinned = arena.stats().pinned_bytes;
    // The traced pool replaces it: the old slabs go back first, then the new classes are cut.
    let vacant = p.vacant();
    drop(std::mem::replace(&mut p, vacant));
    let q = SlabPool::in_arena(&arena, PoolKind::Activations, &[4096, 100 << 10], &[2, 3], true, Bus::disabled()).expect("traced pool");
    assert_eq!(arena.stats().pinned_bytes, pinned, "nothing more was pinned");
    assert_eq!(q.capacity_bytes(), 2 * 4096 + 3 * (100 << 10));
    let (l, hit) = q.acquire(100 << 10).expect("slab");
    assert!(hit && l.class() == Some(1));
}
