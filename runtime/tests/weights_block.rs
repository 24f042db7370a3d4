//! Block mode end to end: equality with the unwrapped model, eviction order, gradient
//! accumulation, offloaded AdamW, file-backed blocks, shutdown. Runs on the host device, and on
//! CUDA where present (`Device::auto`).

use stagehand::device::Device;
use stagehand::events::{BlockId, BlockState, Bus, EventKind};
use stagehand::optim::{Kernel, Optimizer};
use stagehand::weights::{WeightConfig, WeightRuntime};
use stagehand::Error;
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::blocks::{block_bytes, block_fwd, Block, D, H};
use common::{rng, Collected};

/// A reference model on the device and an identical managed one (its VarStore on the CPU).
fn pair(n: usize, trainable: bool) -> (nn::VarStore, Vec<Block>, nn::VarStore, Vec<Block>) {
    common::blocks::pair(Device::auto(1 << 30).tch_device(), n, trainable)
}

fn runtime(vm: &nn::VarStore, device: Device, budget_blocks: u64, k: u32, bus: Bus, inference: bool) -> WeightRuntime {
    let cfg = WeightConfig::builder()
        .pool(4 << 20, 1 << 20)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(budget_blocks * block_bytes())
        .prefetch_window(k)
        .inference_mode(inference)
        .build()
        .expect("config");
    WeightRuntime::from_var_store(vm, r"^blocks\.\d+$", device, cfg, bus).expect("runtime")
}

fn input(dev: tch::Device, seed: i64) -> Tensor {
    let _g = rng();
    tch::manual_seed(seed);
    Tensor::randn([8, D], (Kind::Float, dev))
}

fn managed_forward(rt: &WeightRuntime, ids: &[BlockId], m: &[Block], x: &Tensor) -> Tensor {
    let _hooks = rt.hooks().expect("hooks");
    let mut h = x.shallow_clone();
    for (id, b) in ids.iter().zip(m) {
        h = rt.run_block(*id, || block_fwd(b, &h)).expect("block");
    }
    h
}

fn ids(rt: &WeightRuntime, n: usize) -> Vec<BlockId> {
    (0..n).map(|i| rt.block_id(&format!("blocks.{i}")).expect("id")).collect()
}

#[test]
fn frozen_outputs_and_input_grads_equal_the_unwrapped_model_on_every_step() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let n = 6;
    let (_vr, r, vm, m) = pair(n, false);
    let rt = runtime(&vm, device.clone(), 3, 2, Bus::disabled(), false);
    let ids = ids(&rt, n);
    let mut misses0 = 0;
    for step in 0..4 {
        let x = input(dev, 100 + step).set_requires_grad(true);
        let xr = x.detach().set_requires_grad(true);
        let want = r.iter().fold(xr.shallow_clone(), |h, b| block_fwd(b, &h));
        want.sum(Kind::Float).backward();

        rt.begin_step().expect("begin");
        let got = managed_forward(&rt, &ids, &m, &x);
        got.sum(Kind::Float).backward();
        rt.end_step().expect("end");

        assert!(got.equal(&want), "step {step}: outputs differ");
        assert!(x.grad().equal(&xr.grad()), "step {step}: input grads differ");
        assert!(rt.resident_bytes() as u64 <= 3 * block_bytes(), "over the weight budget");
        let mx = rt.last_step_metrics();
        assert!(mx.evictions > 0, "step {step}: a 3-block budget for 6 blocks must evict");
        if step == 0 {
            // Tracing: no prefetch, so every forward block is a demand load.
            assert!(mx.prefetch_misses >= n as u64, "{mx:?}");
            misses0 = mx.prefetch_misses;
        } else {
            assert!(mx.prefetch_hits > 0, "step {step}: the itinerary drives prefetch: {mx:?}");
            if !device.is_cuda() {
                // Host copies land at once, so every prefetched block is a hit.
                assert!(mx.prefetch_misses < misses0, "step {step}: prefetch must cut misses: {mx:?}");
            }
        }
    }
    let it = rt.itinerary().expect("learned after step 0");
    assert_eq!(it.forward(), ids.as_slice());
}

#[test]
fn eviction_picks_the_farthest_next_use() {
    let device = Device::host(1 << 30);
    let n = 4;
    let (_vr, _r, vm, m) = pair(n, false);
    let bus = Bus::new();
    let sub = Collected::on(&bus);
    let rt = runtime(&vm, device, 3, 0, bus.clone(), true);
    let ids = ids(&rt, n);
    let x = input(tch::Device::Cpu, 1);
    for _ in 0..2 {
        rt.begin_step().expect("begin");
        let _ = tch::no_grad(|| managed_forward(&rt, &ids, &m, &x));
        rt.end_step().expect("end");
    }
    bus.flush();
    let mut evicted = Vec::new();
    for e in sub.take() {
        if let EventKind::Eviction { block, .. } = &e.kind {
            evicted.push(block.0);
        }
    }
    // Step 0 (no itinerary yet): block 0 makes room for block 3. Step 1, forward-only
    // itinerary 0,1,2,3: loading 0 evicts 3 (next use farthest), loading 3 evicts 2.
    assert_eq!(evicted, [0, 3, 2]);
}

/// Forward-only steps of `n` blocks through room for `slots`: the outputs (all equal to the
/// unwrapped model's), each steady step's loads, and the blocks evicted after the first two
/// steps.
fn inference_steps(n: usize, slots: u64, pins: bool, steps: usize) -> (Vec<u64>, Vec<u32>, Vec<u32>) {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let (_vr, r, vm, m) = pair(n, false);
    let bus = Bus::new();
    let sub = Collected::on(&bus);
    let cfg = WeightConfig::builder()
        .pool(4 << 20, 1 << 20)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(slots * block_bytes())
        .prefetch_window(3)
        .inference_mode(true)
        .cyclic_pins(pins)
        .build()
        .expect("config");
    let rt = WeightRuntime::from_var_store(&vm, r"^blocks\.\d+$", device, cfg, bus.clone()).expect("runtime");
    let ids = ids(&rt, n);
    let x = input(dev, 1);
    let want = tch::no_grad(|| r.iter().fold(x.shallow_clone(), |h, b| block_fwd(b, &h)));
    let mut loads = Vec::new();
    let mut late_evictions = Vec::new();
    let mut protected = Vec::new();
    for step in 0..steps {
        rt.begin_step().expect("begin");
        let y = tch::no_grad(|| managed_forward(&rt, &ids, &m, &x));
        rt.end_step().expect("end");
        assert!(y.equal(&want), "step {step}: output differs from the unwrapped model");
        loads.push(rt.last_step_metrics().h2d_bytes / block_bytes());
        bus.flush();
        for e in sub.take() {
            match &e.kind {
                EventKind::Eviction { block, .. } if step >= 2 => late_evictions.push(block.0),
                EventKind::Protection { block, protected: true } => protected.push(block.0),
                _ => {}
            }
        }
    }
    (loads, late_evictions, protected)
}

#[test]
fn inference_pins_blocks_spread_along_the_cycle_and_streams_the_rest_through_two_slots() {
    // 10 blocks through 5 slots: 3 pinned (0, 3, 6) once the first step has traced the cycle,
    // the other 7 streamed through 2 slots, each loaded once a step.
    let (loads, late, pinned) = inference_steps(10, 5, true, 6);
    assert_eq!(pinned, [0, 3, 6]);
    assert_eq!(loads[2..], [7, 7, 7, 7], "loads a step: {loads:?}");
    assert!(late.iter().all(|b| ![0, 3, 6].contains(b)), "a pinned block was evicted: {late:?}");
    // Without pins Belady's choice turns other blocks: nothing is protected, and blocks 0, 3 or 6
    // leave the device in steady state.
    let (_, late, pinned) = inference_steps(10, 5, false, 6);
    assert!(pinned.is_empty());
    assert!(late.iter().any(|b| [0, 3, 6].contains(b)), "{late:?}");
}

#[test]
fn a_demand_beyond_the_streaming_slots_lifts_a_pin_instead_of_failing() {
    let device = Device::host(1 << 30);
    let n = 10;
    let (_vr, _r, vm, m) = pair(n, false);
    let bus = Bus::new();
    let sub = Collected::on(&bus);
    let rt = runtime(&vm, device, 5, 3, bus.clone(), true);
    let ids = ids(&rt, n);
    let x = input(tch::Device::Cpu, 1);
    for _ in 0..3 {
        rt.begin_step().expect("begin");
        let _ = tch::no_grad(|| managed_forward(&rt, &ids, &m, &x));
        rt.end_step().expect("end");
    }
    // Three unpinned blocks held at once: two streaming slots are not enough, so a pin goes.
    rt.begin_step().expect("begin");
    let _g1 = rt.block(ids[1]).expect("block 1");
    let _g2 = rt.block(ids[2]).expect("block 2");
    let _g4 = rt.block(ids[4]).expect("block 4 takes a pinned block's slot");
    bus.flush();
    let mut lifted = Vec::new();
    for e in sub.take() {
        if let EventKind::Protection { block, protected: false } = &e.kind {
            lifted.push(block.0);
        }
    }
    assert_eq!(lifted.len(), 1, "{lifted:?}");
    // An explicit eviction of a block still pinned says why it is refused and how to lift it.
    let pinned = [0usize, 3, 6].into_iter().find(|&b| !lifted.contains(&(b as u32))).expect("two pins left");
    let e = rt.evict(ids[pinned]).expect_err("pinned");
    assert!(e.to_string().contains("cyclic pins"), "{e}");
    rt.keep_resident(&[ids[pinned]], false).expect("lift");
    rt.evict(ids[pinned]).expect("lifted, so it may go");
}

#[test]
fn an_evicted_block_points_at_placeholders_made_once_and_writes_there_never_reach_its_values() {
    let device = Device::auto(1 << 30);
    let cfg = WeightConfig::builder()
        .pool(4 << 20, 1 << 20)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(1 << 20)
        .build()
        .expect("config");
    let rt = WeightRuntime::new(device.clone(), cfg, Bus::disabled()).expect("runtime");
    let w = Tensor::ones([4, 3], (Kind::Float, tch::Device::Cpu));
    let s = Tensor::full([1], 2.0, (Kind::Float, tch::Device::Cpu));
    let id = rt.register_block("b", vec![("w".into(), w.shallow_clone()), ("s".into(), s.shallow_clone())]).expect("register");
    let use_and_evict = || {
        rt.begin_step().expect("begin");
        let (wv, sv) = rt
            .run_block(id, || {
                device.synchronize().expect("sync");
                (w.to_device(tch::Device::Cpu).copy(), s.to_device(tch::Device::Cpu).copy())
            })
            .expect("use");
        rt.end_step().expect("end");
        rt.evict(id).expect("evict");
        assert_eq!((wv.sum(Kind::Float).double_value(&[]), sv.double_value(&[0])), (12.0, 2.0), "the values while resident");
    };
    use_and_evict();
    // Holding the first placeholders keeps their memory from going back to the allocator, so a
    // placeholder made again could not land at the same address.
    let held = (w.detach(), s.detach());
    let first = (held.0.data_ptr(), held.1.data_ptr());
    assert_eq!(w.size(), [4, 3]);
    // A write into an evicted variable lands in its placeholder, not in the parameter: the next
    // use sees the parameter's values (checked in `use_and_evict`).
    let _ = w.shallow_clone().f_fill_(5.0).expect("a write into a placeholder");
    let _ = s.shallow_clone().f_fill_(7.0).expect("a write into a placeholder");
    use_and_evict();
    // Evicting allocates nothing: each variable points at the placeholder made at registration.
    assert_eq!((w.data_ptr(), s.data_ptr()), first, "the placeholders are made once and pointed at again");
}

#[test]
fn keep_resident_blocks_are_never_evicted() {
    let device = Device::host(1 << 30);
    let n = 4;
    let (_vr, _r, vm, m) = pair(n, false);
    let rt = runtime(&vm, device, 2, 0, Bus::disabled(), true);
    let ids = ids(&rt, n);
    let x = input(tch::Device::Cpu, 1);
    rt.begin_step().expect("begin");
    rt.run_block(ids[0], || ()).expect("load 0");
    rt.keep_resident(&[ids[0]], true).expect("protect");
    for _ in 0..2 {
        let _ = tch::no_grad(|| managed_forward(&rt, &ids, &m, &x));
    }
    assert_eq!(rt.state(ids[0]).expect("state"), BlockState::GpuReady);
    rt.keep_resident(&[ids[0]], false).expect("unprotect");
    rt.end_step().expect("end");
    // With 1 free slot of 2 and block 0 protected, a block in use plus a needed one cannot fit.
    rt.keep_resident(&[ids[0]], true).expect("protect");
    rt.begin_step().expect("begin");
    let _g1 = rt.block(ids[1]).expect("block 1 in use");
    let e = rt.block(ids[2]).expect_err("no room: 0 protected, 1 in use");
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
}

#[test]
fn gradient_accumulation_over_four_micro_batches_equals_the_unwrapped_model() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let n = 4;
    let (vr, r, vm, m) = pair(n, true);
    let rt = runtime(&vm, device, 2, 1, Bus::disabled(), false);
    let ids = ids(&rt, n);
    for mb in 0..4 {
        let x = input(dev, 200 + mb);
        let want = r.iter().fold(x.shallow_clone(), |h, b| block_fwd(b, &h));
        want.square().mean(Kind::Float).backward();
        rt.begin_step().expect("begin");
        let got = managed_forward(&rt, &ids, &m, &x);
        got.square().mean(Kind::Float).backward();
        rt.end_step().expect("end");
        assert!(got.equal(&want), "micro-batch {mb}: outputs differ");
    }
    rt.collect_grads().expect("collect");
    let refs = vr.variables();
    let exact = !dev.is_cuda();
    for (bi, id) in ids.iter().enumerate() {
        for (pi, p) in rt.blocks()[bi].params.iter().enumerate() {
            let g = rt.host_grad(*id, pi).expect("grad").expect("trainable");
            let want = refs[&p.name].grad().to_device(tch::Device::Cpu);
            if exact {
                assert!(g.equal(&want), "{}: accumulated grads differ", p.name);
            } else {
                assert!(g.allclose(&want, 1e-5, 1e-6, false), "{}: accumulated grads differ", p.name);
            }
        }
    }
}

#[test]
fn host_adamw_equals_nn_adamw_over_twenty_steps() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let n = 3;
    let (vr, r, vm, m) = pair(n, true);
    let rt = runtime(&vm, device, 2, 1, Bus::disabled(), false);
    let ids = ids(&rt, n);
    let lr = 1e-2;
    let mut ref_opt = nn::AdamW::default().build(&vr, lr).expect("adamw");
    let mut opt = Optimizer::new(&rt, vec![], nn::AdamW::default(), lr, Kernel::Exact).expect("optimizer");
    let target = input(dev, 999);
    let mut last = (0.0, 0.0);
    for step in 0..20 {
        let x = input(dev, 300 + step);
        let loss_r = (r.iter().fold(x.shallow_clone(), |h, b| block_fwd(b, &h)) - &target)
            .square()
            .mean(Kind::Float);
        ref_opt.zero_grad();
        loss_r.backward();
        ref_opt.step();

        opt.zero_grad().expect("zero");
        rt.begin_step().expect("begin");
        let loss = (managed_forward(&rt, &ids, &m, &x) - &target).square().mean(Kind::Float);
        loss.backward();
        rt.end_step().expect("end");
        opt.step().expect("step");
        last = (loss.double_value(&[]), loss_r.double_value(&[]));
        if !dev.is_cuda() {
            assert_eq!(last.0, last.1, "step {step}: losses differ");
        }
    }
    let refs = vr.variables();
    for (bi, id) in ids.iter().enumerate() {
        for (pi, p) in rt.blocks()[bi].params.iter().enumerate() {
            let got = rt.host_param(*id, pi).expect("param");
            let want = refs[&p.name].to_device(tch::Device::Cpu);
            if dev.is_cuda() {
                assert!(got.allclose(&want, 1e-4, 1e-5, false), "{} differs", p.name);
            } else {
                assert!(got.equal(&want), "{}: parameters differ after 20 AdamW steps", p.name);
            }
        }
    }
    assert!(last.0 < 10.0, "training diverged: {last:?}");
}

#[test]
fn file_backed_blocks_stream_from_safetensors() {
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    let n = 3;
    let (_vr, r, vm, m) = pair(n, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.safetensors");
    let named: Vec<(String, Tensor)> = vm.variables().into_iter().map(|(k, v)| (format!("model.{k}"), v)).collect();
    Tensor::write_safetensors(&named, &path).expect("write");
    let bus = Bus::new();
    let sub = Collected::on(&bus);
    let rt = runtime(&vm, device, 2, 1, bus.clone(), false);
    let ids = ids(&rt, n);
    for id in &ids {
        rt.back_with_file(*id, &path, "model.").expect("file-backed");
    }
    let e = rt.back_with_file(ids[0], &path, "nope.").expect_err("missing keys");
    assert!(e.to_string().contains("nope.blocks.0"), "{e}");
    // The registration that a block is backed by the file reaches the telemetry.
    bus.flush();
    let mut file_backed = std::collections::BTreeMap::new();
    for e in sub.take() {
        if let EventKind::BlockRegistered { block, file_backed: f, .. } = &e.kind {
            file_backed.insert(block.0, *f);
        }
    }
    assert_eq!(file_backed.values().filter(|f| **f).count(), n, "{file_backed:?}");
    for step in 0..3 {
        let x = input(dev, 400 + step).set_requires_grad(true);
        let want = r.iter().fold(x.shallow_clone(), |h, b| block_fwd(b, &h));
        rt.begin_step().expect("begin");
        let got = managed_forward(&rt, &ids, &m, &x);
        got.sum(Kind::Float).backward();
        rt.end_step().expect("end");
        assert!(got.equal(&want), "step {step}: outputs differ");
        assert!(rt.last_step_metrics().host_pool_in_use <= 4);
    }
}

/// A file-backed run of `n` frozen blocks on the file `path` holds (keys `model.`), its weights
/// dated an hour back so that a rewrite gets a later modification time even on filesystems
/// with coarse timestamps.
fn file_backed(n: usize, path: &std::path::Path) -> (Vec<Block>, Vec<Block>, WeightRuntime, Vec<BlockId>) {
    let device = Device::auto(1 << 30);
    let (_vr, r, vm, m) = pair(n, false);
    let named: Vec<(String, Tensor)> = vm.variables().into_iter().map(|(k, v)| (format!("model.{k}"), v)).collect();
    Tensor::write_safetensors(&named, path).expect("write");
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options().write(true).open(path).expect("open").set_modified(hour_ago).expect("date");
    let rt = runtime(&vm, device, 2, 1, Bus::disabled(), false);
    let ids = ids(&rt, n);
    for id in &ids {
        rt.back_with_file(*id, path, "model.").expect("file-backed");
    }
    (r, m, rt, ids)
}

/// One training step through the file-backed blocks: the output, or the first error (from the
/// runtime, or from backward's weight reloads, which reach it through autograd as text).
fn file_step(rt: &WeightRuntime, ids: &[BlockId], m: &[Block], x: &Tensor) -> Result<Tensor, String> {
    rt.begin_step().map_err(|e| e.to_string())?;
    let out = {
        let _hooks = rt.hooks().map_err(|e| e.to_string())?;
        let mut h = x.shallow_clone();
        for (id, b) in ids.iter().zip(m) {
            h = rt.run_block(*id, || block_fwd(b, &h)).map_err(|e| e.to_string())?;
        }
        h
    };
    out.sum(Kind::Float).f_backward().map_err(|e| e.to_string())?;
    rt.end_step().map_err(|e| e.to_string())?;
    Ok(out)
}

/// Runs steps until one fails (at most `steps`), returning the failure.
fn first_failure(rt: &WeightRuntime, ids: &[BlockId], m: &[Block], steps: i64) -> Option<String> {
    let dev = rt.device().tch_device();
    (0..steps).find_map(|step| file_step(rt, ids, m, &input(dev, 500 + step).set_requires_grad(true)).err())
}

#[test]
fn a_weights_file_truncated_between_steps_is_a_clear_error_not_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.safetensors");
    let (_r, m, rt, ids) = file_backed(3, &path);
    assert_eq!(first_failure(&rt, &ids, &m, 2), None, "the file is intact");
    let len = std::fs::metadata(&path).expect("size").len();
    std::fs::File::options().write(true).open(&path).expect("open").set_len(len / 2).expect("truncate");
    let e = first_failure(&rt, &ids, &m, 2).expect("a truncated file is an error, not SIGBUS");
    assert!(e.contains("w.safetensors") && e.contains("changed under the running job"), "{e}");
    assert!(e.contains(&format!("{} bytes", len / 2)) && e.contains(&format!("{len} when the run opened it")), "{e}");
    assert!(e.contains("restore it"), "says what to do: {e}");
}

#[test]
fn a_weights_file_rewritten_in_place_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.safetensors");
    let (_r, m, rt, ids) = file_backed(3, &path);
    assert_eq!(first_failure(&rt, &ids, &m, 2), None, "the file is intact");
    // The same size, the tensors' bytes zeroed (what an export of other weights to the same
    // path does), written now.
    let bytes = std::fs::read(&path).expect("read");
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut zeroed = bytes.clone();
    zeroed[header..].fill(0);
    std::fs::write(&path, &zeroed).expect("rewrite");
    let e = first_failure(&rt, &ids, &m, 2).expect("a rewritten file is an error, not other weights");
    assert!(e.contains("w.safetensors") && e.contains("modified after the run opened it"), "{e}");
}

#[test]
fn a_rewrite_that_keeps_size_and_modification_time_is_caught_by_the_checksum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.safetensors");
    let (_r, m, rt, ids) = file_backed(3, &path);
    assert_eq!(first_failure(&rt, &ids, &m, 2), None, "the file is intact");
    let when = std::fs::metadata(&path).expect("meta").modified().expect("mtime");
    let bytes = std::fs::read(&path).expect("read");
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut zeroed = bytes.clone();
    zeroed[header..].fill(0);
    std::fs::write(&path, &zeroed).expect("rewrite");
    std::fs::File::options().write(true).open(&path).expect("open").set_modified(when).expect("restore mtime");
    let e = first_failure(&rt, &ids, &m, 2).expect("a rewritten file is an error, not other weights");
    assert!(e.contains("w.safetensors") && e.contains("differ from their first read"), "{e}");
}

#[test]
fn an_unchanged_or_replaced_weights_file_keeps_training_on_the_weights_it_opened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.safetensors");
    let (r, m, rt, ids) = file_backed(3, &path);
    let dev = rt.device().tch_device();
    for step in 0..5 {
        // Halfway, other weights are published under the same name the safe way: a new file
        // renamed over it. The run keeps reading the file it opened.
        if step == 2 {
            let other = dir.path().join("w.safetensors.new");
            let zeros: Vec<(String, Tensor)> = Tensor::read_safetensors(&path)
                .expect("read")
                .into_iter()
                .map(|(k, v)| (k, v.zeros_like()))
                .collect();
            Tensor::write_safetensors(&zeros, &other).expect("write");
            std::fs::rename(&other, &path).expect("rename over");
        }
        let x = input(dev, 600 + step).set_requires_grad(true);
        let want = r.iter().fold(x.shallow_clone(), |h, b| block_fwd(b, &h));
        let got = file_step(&rt, &ids, &m, &x).expect("the file is as the run opened it");
        assert!(got.equal(&want), "step {step}: outputs differ");
    }
}

#[test]
fn resolver_recognises_resident_weights_by_storage() {
    let device = Device::auto(1 << 30);
    let (_vr, _r, vm, m) = pair(2, false);
    let rt = runtime(&vm, device, 2, 0, Bus::disabled(), false);
    let ids = ids(&rt, 2);
    rt.begin_step().expect("begin");
    let _g = rt.block(ids[1]).expect("resident");
    let res = rt.resolver();
    let w = &m[1].1.ws;
    let save = res.resolve(&w.tr()).expect("a transposed weight is a managed weight");
    // Parameters in natural name order: fc1.bias, fc1.weight, fc2.bias, fc2.weight.
    assert_eq!((save.block, save.param), (ids[1], 3));
    assert_eq!(save.sizes, [H, D]);
    let back = res.materialize(&save).expect("materialize");
    assert!(back.equal(&w.tr()));
    assert!(res.resolve(&w.copy()).is_none(), "a copy is not the weight");
    assert!(res.resolve(&m[0].0.ws).is_none(), "an evicted block resolves to nothing");
}

#[test]
fn oversized_blocks_and_misuse_are_typed_errors() {
    let (_vr, _r, vm, _m) = pair(2, false);
    let cfg = WeightConfig::builder().weight_budget(1024).build().expect("config");
    let e = WeightRuntime::from_var_store(&vm, r"^blocks\.\d+$", Device::host(1 << 30), cfg, Bus::disabled())
        .expect_err("a block is larger than the weights' room");
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("blocks.0"), "{e}");

    let rt = runtime(&vm, Device::host(1 << 30), 2, 0, Bus::disabled(), false);
    // Outside a step a block use evaluates (a forward with no backward).
    rt.before_block(BlockId(0)).expect("an evaluation outside a step");
    rt.after_block(BlockId(0)).expect("released");
    rt.end_evaluation().expect("evaluation ended");
    assert!(matches!(rt.before_block(BlockId(9)), Err(Error::UnknownBlock(_))));
    assert!(matches!(rt.after_block(BlockId(0)), Err(Error::Misuse { .. })), "refcount underflow");
    assert!(WeightRuntime::from_var_store(&vm, r"^nothing$", Device::host(1), WeightConfig::default(), Bus::disabled()).is_err());
}

#[test]
fn shutdown_refuses_later_use_and_leaves_cpu_weights() {
    let device = Device::auto(1 << 30);
    let (_vr, r, vm, m) = pair(2, false);
    let rt = runtime(&vm, device, 2, 0, Bus::disabled(), false);
    let ids = ids(&rt, 2);
    rt.begin_step().expect("begin");
    rt.run_block(ids[0], || ()).expect("load");
    rt.shutdown().expect("shutdown");
    rt.shutdown().expect("idempotent");
    assert!(matches!(rt.begin_step(), Err(Error::Shutdown(_))));
    assert!(matches!(rt.before_block(ids[0]), Err(Error::Shutdown(_))));
    assert_eq!(m[0].0.ws.device(), tch::Device::Cpu);
    assert!(m[0].0.ws.equal(&r[0].0.ws.to_device(tch::Device::Cpu)));
}

/// After the host waited for the device, every copy of the step before has completed but most
/// were not reported yet (the host ran ahead of them). The next step's first block use must
/// issue its copies first and report those copies a few per use, not all of them before its
/// first copy (which left the copy engine idle for as long, on CUDA 0.3-0.7 ms a step with
/// telemetry on). On the host device copies complete as they are issued, so nothing is left to
/// report late there.
#[test]
fn a_steps_first_copy_goes_out_before_the_last_steps_copies_are_all_reported() {
    let device = Device::auto(1 << 30);
    let cuda = device.is_cuda();
    // Copies long enough on CUDA (16 MiB, about 0.3 ms) that the host enters blocks before
    // their copies land.
    let (n, elems) = (12usize, if cuda { 4 << 20 } else { 1 << 16 });
    let bytes = elems as u64 * 4;
    let cfg = WeightConfig::builder()
        .pool(2 * bytes, bytes)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(4 * bytes)
        .prefetch_window(4)
        .inference_mode(true)
        .build()
        .expect("config");
    let bus = Bus::new();
    let sub = Collected::on(&bus);
    let rt = WeightRuntime::new(device.clone(), cfg, bus.clone()).expect("runtime");
    let ids: Vec<BlockId> = (0..n)
        .map(|i| rt.register_block(&format!("blocks.{i}"), vec![("w".into(), Tensor::full([elems], i as f64, (Kind::Float, tch::Device::Cpu)))]).expect("register"))
        .collect();
    let step = || {
        rt.begin_step().expect("begin");
        for &id in &ids {
            let _g = rt.block(id).expect("block");
        }
        rt.end_step().expect("end");
        device.synchronize().expect("wait for the device");
    };
    for _ in 0..3 {
        step();
    }
    bus.flush();
    sub.take();
    step();
    bus.flush();
    let (mut before_first_issue, mut issued, mut completed) = (0, 0, 0);
    for e in sub.take() {
        match e.kind {
            EventKind::TransferIssued { .. } => issued += 1,
            EventKind::TransferCompleted { .. } if issued == 0 => before_first_issue += 1,
            EventKind::TransferCompleted { .. } => completed += 1,
            _ => {}
        }
    }
    assert!(issued > 0, "a streamed step issues copies");
    assert!(before_first_issue <= 2, "{before_first_issue} copies reported before the step's first copy went out");
    if cuda {
        assert!(before_first_issue + completed > 2, "the step before left copies to report: {before_first_issue} + {completed}");
    }
}
