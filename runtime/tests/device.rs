//! The device layer on real tensors: the host device everywhere, the CUDA backend where a GPU is
//! present (skipped with a message otherwise).

use stagehand::device::{Device, Order};
use tch::{Kind, Tensor};

fn cuda() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipping CUDA checks: {e}");
            None
        }
    }
}

#[test]
fn round_trip_through_pinned_memory_on_copy_streams() {
    // 4 MiB (pinned with one call) and 20 MiB and a bit (a mapping page-locked in place).
    let devices = [Some(Device::host(1 << 30)), cuda()].into_iter().flatten();
    for (dev, n) in devices.flat_map(|d| [(d.clone(), 1 << 20), (d, (5 << 20) + 3)]) {
        let src = Tensor::arange(n, (Kind::Float, dev.tch_device())) * 0.5;
        let stream = dev.copy_stream().expect("stream");
        let buf = dev.alloc_host((n * 4) as usize).expect("buffer");
        assert_eq!(buf.is_pinned(), dev.is_cuda());
        // d2h is ordered after the kernel that produced `src`.
        let (buf, ms) = stream.d2h(buf, 0, &src, Order::AfterCompute).expect("d2h").wait().expect("wait");
        assert!(ms.is_some_and(|ms| ms > 0.0), "a stream's first copy is timed: {ms:?} ms");
        let back = buf.to_tensor(0, Kind::Float, &[n]).expect("host view");
        assert!(back.equal(&src.to_device(tch::Device::Cpu)), "d2h bytes");
        let dst = Tensor::full([n], -1.0, (Kind::Float, dev.tch_device()));
        let copy = stream.h2d(&dst, buf, 0, Order::AfterCompute).expect("h2d");
        // The compute stream waits on the copy's event, with no host synchronisation.
        let probe = dev.compute_wait_timed(copy.done()).expect("compute waits");
        let sum = (&dst - &src).abs().sum(Kind::Float).double_value(&[]);
        assert_eq!(sum, 0.0, "compute saw the copied data");
        let (_buf, h2d_ms) = copy.wait().expect("h2d done");
        // Every host copy is timed; on CUDA the second copy of a stream is not (one in 16).
        assert_eq!(h2d_ms.is_some(), !dev.is_cuda(), "{h2d_ms:?}");
        assert!(probe.stall_ms().is_some_and(|ms| ms >= 0.0), "the compute stream's wait is measured");
    }
}

#[test]
fn copies_are_timed_by_sample_and_on_request() {
    for dev in [Some(Device::host(1 << 30)), cuda()].into_iter().flatten() {
        let stream = dev.copy_stream().expect("stream");
        let every = stream.timed_every();
        assert_eq!(every, if dev.is_cuda() { 16 } else { 1 });
        let src = Tensor::ones([1 << 16], (Kind::Float, dev.tch_device()));
        let mut buf = dev.alloc_host(1 << 18).expect("buffer");
        let mut timed = Vec::new();
        for i in 0..2 * every + 1 {
            if i == 3 {
                stream.time_next();
            }
            let (b, ms) = stream.d2h(buf, 0, &src, Order::AfterCompute).expect("d2h").wait().expect("wait");
            buf = b;
            if let Some(ms) = ms {
                assert!(ms >= 0.0 && ms.is_finite(), "{ms}");
                timed.push(i);
            }
        }
        let expected: Vec<u64> = if dev.is_cuda() { vec![0, 3, 16, 32] } else { (0..2 * every + 1).collect() };
        assert_eq!(timed, expected, "the copies that reported a duration");
    }
}

#[test]
fn copy_waits_for_pending_compute_work() {
    // A poisoned-buffer check: the source is produced by a long chain of kernels; a d2h that
    // did not wait for them would read stale or partial data.
    let Some(dev) = cuda() else { return };
    let n = 1 << 22;
    let mut x = Tensor::zeros([n], (Kind::Float, dev.tch_device()));
    for _ in 0..50 {
        x = (&x + 1.0).sqrt() * (&x + 1.0).sqrt();
    }
    let expect = x.to_device(tch::Device::Cpu);
    let stream = dev.copy_stream().expect("stream");
    let buf = dev.alloc_host((n * 4) as usize).expect("buffer");
    let (buf, _) = stream.d2h(buf, 0, &x, Order::AfterCompute).expect("d2h").wait().expect("wait");
    let got = buf.to_tensor(0, Kind::Float, &[n]).expect("host view");
    assert!(got.allclose(&expect, 1e-6, 1e-6, false));
}

#[test]
fn device_reports_memory_and_identity() {
    let host = Device::host(1 << 20);
    assert_eq!(host.info().total_bytes, 1 << 20);
    assert_eq!(host.info().name, "host (simulated)");
    if let Some(dev) = cuda() {
        let before = dev.memory().allocated;
        let t = Tensor::zeros([64 << 20], (Kind::Uint8, dev.tch_device()));
        let during = dev.memory();
        assert!(during.allocated >= before + (64 << 20), "{during:?}");
        assert!(during.peak >= during.allocated);
        drop(t);
        assert!(dev.info().total_bytes > 1 << 30);
        println!("cuda device: {}", dev.info().name);
    }
}

#[test]
fn a_host_wait_costs_idle_time_only_once_the_gpu_has_run_dry() {
    let Some(dev) = cuda() else { return };
    let a = Tensor::randn([4096, 4096], (Kind::Float, dev.tch_device()));
    // Queue some hundreds of ms of matmuls; a short host wait behind them costs the GPU nothing.
    let mut x = a.shallow_clone();
    for _ in 0..200 {
        x = x.matmul(&a).tanh();
    }
    let probe = dev.idle_probe().expect("probe");
    std::thread::sleep(std::time::Duration::from_millis(2));
    let busy = probe.end(&dev).expect("end");
    // Now the GPU has nothing queued: a wait of 50 ms leaves it idle about as long.
    dev.synchronize().expect("sync");
    let probe = dev.idle_probe().expect("probe");
    std::thread::sleep(std::time::Duration::from_millis(50));
    let dry = probe.end(&dev).expect("end");
    let _ = x.sum(Kind::Float).double_value(&[]);
    let busy = busy.idle_ms_blocking().expect("read");
    let dry = dry.idle_ms_blocking().expect("read");
    assert!(busy < 1.0, "a wait while the GPU was busy is not idle: {busy} ms");
    assert!((45.0..500.0).contains(&dry), "a wait on an empty queue is idle: {dry} ms");
}

/// The warm-up runs a backward, and must under `no_grad` too: a frozen model's first forward or
/// an evaluation before any training step warms the device there (on CUDA it failed with
/// "element 0 of tensors does not require grad"). Nothing to warm on the host device.
#[test]
fn warm_up_runs_inside_no_grad() {
    for dev in [Some(Device::host(1 << 30)), cuda()].into_iter().flatten() {
        tch::no_grad(|| dev.warm_up()).expect("warm-up under no_grad");
        dev.warm_up().expect("warm-up");
    }
}
