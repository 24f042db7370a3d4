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
    assert_eq!((d.class(), hit_d), (None, false));
    // Larger than every class: straight to the fallback.
    let (e, hit_e) = p.acquire(1 << 20).expect("e");
    assert_eq!((e.class(), hit_e, e.len()), (None, false, 1 << 20));
    let s = p.stats();
    assert_eq!((s.fallbacks, s.free.clone(), s.in_use()), (2, vec![0, 0], 3));
    drop((a, b, c, d, e));
    let s = p.stats();
    assert_eq!((s.free, s.fallbacks_live, s.peak_in_use), (vec![2, 1], 0, vec![2, 1]));
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
