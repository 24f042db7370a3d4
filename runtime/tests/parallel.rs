//! Data parallel on the host device: two simulated devices behind the same collectives as CUDA
//! ranks (NCCL's place taken by the in-process exchange) train bit-identically to one device
//! running the same global batch in two micro-batches, in fp32 (libtorch's exact optimizer) and
//! in bf16 (Stagehand's mixed kernel); a checkpoint saved by the group (model and optimizer
//! state) loads into one device and back; a rank that fails (an error, a panic, out of memory)
//! or stalls stops every rank with an error naming it. With two GPUs, the same over NCCL.

use stagehand::device::Device;
use stagehand::events::{Direction, EventKind, Phase};
use stagehand::nn as snn;
use stagehand::optim::Kernel;
use stagehand::parallel::Devices;
use stagehand::{Error, Precision, Stagehand};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 33;
const LAYERS: i64 = 4;
const OUT: i64 = 4;
/// The global batch: each of two ranks (or micro-batches) takes half.
const BATCH: i64 = 8;
const STEPS: usize = 4;
const LR: f64 = 1e-2;

struct Net {
    blocks: Vec<Box<dyn Module>>,
    /// Not streamed: lives on each device and trains there (its gradients all-reduced).
    norm: nn::LayerNorm,
    head: Box<dyn Module>,
}

fn build(sh: &Stagehand) -> Net {
    let root = sh.root();
    Net {
        blocks: (0..LAYERS).map(|i| Box::new(snn::linear(&root / "blocks" / i / "fc", D, D, Default::default())) as Box<dyn Module>).collect(),
        norm: nn::layer_norm(&*root / "norm", vec![D], Default::default()),
        head: Box::new(snn::linear(&root / "head", D, OUT, Default::default())),
    }
}

fn loss(net: &Net, x: &Tensor, y: &Tensor) -> Tensor {
    let h = net.blocks.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).tanh());
    net.head.forward(&net.norm.forward(&h)).mse_loss(y, tch::Reduction::Mean)
}

/// The global batches, drawn once (plain data: the training closures run on several threads).
fn batches() -> Vec<(Vec<f32>, Vec<f32>)> {
    let _g = rng();
    tch::manual_seed(77);
    (0..STEPS)
        .map(|_| {
            let x = Tensor::randn([BATCH, D], (Kind::Float, tch::Device::Cpu));
            let y = Tensor::randn([BATCH, OUT], (Kind::Float, tch::Device::Cpu));
            (Vec::<f32>::try_from(&x.flatten(0, -1)).expect("x"), Vec::<f32>::try_from(&y.flatten(0, -1)).expect("y"))
        })
        .collect()
}

fn batch(b: &(Vec<f32>, Vec<f32>)) -> (Tensor, Tensor) {
    (Tensor::from_slice(&b.0).view([BATCH, D]), Tensor::from_slice(&b.1).view([BATCH, OUT]))
}

/// Every variable's value, by name.
fn values(sh: &Stagehand) -> HashMap<String, Vec<f32>> {
    let snap = sh.var_store().expect("snapshot");
    snap.variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).expect("floats")))
        .collect()
}

/// A budget small enough that the blocks stream (the host optimizer steps them).
const BUDGET: u64 = 160 << 10;

fn builder(precision: Precision) -> stagehand::StagehandBuilder {
    let b = Stagehand::builder().budget_bytes(BUDGET).precision(precision);
    if precision == Precision::Fp32 {
        b.kernel(Kernel::Exact)
    } else {
        b
    }
}

/// One device, step `s`'s global batch in `micro[s]` micro-batches: the losses and the final
/// values.
fn one_device(precision: Precision, data: &[(Vec<f32>, Vec<f32>)], micro: &[usize]) -> (Vec<f64>, HashMap<String, Vec<f32>>) {
    let sh = builder(precision).device(Device::host(BUDGET)).build().expect("handle");
    let model = {
        let _g = rng();
        tch::manual_seed(3);
        build(&sh)
    };
    let mut opt = sh.optimizer(nn::AdamW::default(), LR).expect("optimizer");
    let mut losses = Vec::new();
    for (b, &n) in data.iter().zip(micro) {
        let (x, y) = batch(b);
        let rows = BATCH / n as i64;
        let r = sh
            .train_step_micro(&mut opt, n, |i| loss(&model, &x.narrow(0, i as i64 * rows, rows), &y.narrow(0, i as i64 * rows, rows)))
            .expect("step");
        losses.push(r.loss);
    }
    assert!(sh.plan().expect("plan").streams(), "the blocks stream");
    (losses, values(&sh))
}

/// Two simulated devices, each its half of the global batch: each rank's losses and values.
/// A rank's losses and final values.
type Trained = (Vec<f64>, HashMap<String, Vec<f32>>);

fn two_devices(precision: Precision, data: &[(Vec<f32>, Vec<f32>)], bus: Option<stagehand::events::Bus>) -> Vec<Trained> {
    two_devices_micro(precision, data, bus, &[1; STEPS])
}

/// As [`two_devices`], each rank's half of step `s`'s batch in `micro[s]` micro-batches.
fn two_devices_micro(precision: Precision, data: &[(Vec<f32>, Vec<f32>)], bus: Option<stagehand::events::Bus>, micro: &[usize]) -> Vec<Trained> {
    let mut b = builder(precision).devices(Devices::host(2, BUDGET)).collective_timeout(Duration::from_secs(120));
    if let Some(bus) = bus {
        b = b.bus(bus);
    }
    let group = b.build_group().expect("group");
    let _g = rng();
    tch::manual_seed(3);
    group
        .run(build, |sh, model| -> stagehand::Result<_> {
            let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
            let mut losses = Vec::new();
            for (b, &n) in data.iter().zip(micro) {
                let (x, y) = batch(b);
                let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                let r = if n == 1 {
                    sh.train_step(&mut opt, || loss(model, &x, &y))?
                } else {
                    let rows = x.size()[0] / n as i64;
                    sh.train_step_micro(&mut opt, n, |i| loss(model, &x.narrow(0, i as i64 * rows, rows), &y.narrow(0, i as i64 * rows, rows)))?
                };
                losses.push(r.loss);
            }
            assert!(sh.plan().expect("plan").streams(), "the blocks stream");
            Ok((losses, values(sh)))
        })
        .expect("the group trains")
}

fn assert_same_values(got: &HashMap<String, Vec<f32>>, want: &HashMap<String, Vec<f32>>, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: the same variables");
    for (name, w) in want {
        let g = got.get(name).unwrap_or_else(|| panic!("{what}: no variable {name}"));
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: '{name}' differs: {:?} vs {:?}", &g[..4.min(g.len())], &w[..4.min(w.len())]);
    }
}

#[test]
fn two_host_devices_train_bit_identically_to_one_device_over_micro_batches() {
    let data = batches();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let (want_losses, want) = one_device(precision, &data, &[2; STEPS]);
        let ranks = two_devices(precision, &data, None);
        assert_eq!(ranks.len(), 2);
        for (rank, (losses, got)) in ranks.iter().enumerate() {
            assert_eq!(losses, &want_losses, "{precision}: rank {rank}'s losses");
            assert_same_values(got, &want, &format!("{precision}: rank {rank}"));
        }
        // Something trained: every variable moved from its initial value.
        let initial = {
            let sh = builder(precision).device(Device::host(BUDGET)).build().expect("handle");
            let _g = rng();
            tch::manual_seed(3);
            let _model = build(&sh);
            values(&sh)
        };
        for (name, v) in &want {
            assert!(v != &initial[name], "{precision}: '{name}' did not train");
        }
    }
}

/// Each rank in micro-batches, their count changing from step to step (1, 2, 2, 1), against
/// one device taking the same pieces of the global batch in order. The sums add in another
/// order (each rank's own first, then the ranks'), so not bit for bit: in fp32 within float
/// rounding, where a host step queued before a rank's last micro-batch would be off by far
/// more; in bf16, whose gradient sums round to 8 bits of mantissa, the losses within a looser
/// bound (an element whose tiny gradient changes sign in the rounding moves by Adam's whole
/// step the other way, so single values are not compared), and the ranks' values equal bit for
/// bit.
#[test]
fn two_host_devices_in_micro_batches_of_changing_counts_train_as_one_device() {
    let data = batches();
    let micro = [1, 2, 2, 1];
    for (precision, tolerance) in [(Precision::Fp32, 1e-5), (Precision::Bf16, 2e-3)] {
        let whole: Vec<usize> = micro.iter().map(|n| 2 * n).collect();
        let (want_losses, want) = one_device(precision, &data, &whole);
        let ranks = two_devices_micro(precision, &data, None, &micro);
        for (rank, (losses, got)) in ranks.iter().enumerate() {
            for (s, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
                assert!((a - b).abs() <= tolerance * b.abs(), "{precision}: rank {rank}'s loss in step {s}: {a} against {b}");
            }
            if precision == Precision::Fp32 {
                for (name, w) in &want {
                    let worst = got[name].iter().zip(w).map(|(a, b)| (a - b).abs() / b.abs().max(1e-2)).fold(0f32, f32::max);
                    assert!(worst <= 1e-4, "{precision}: rank {rank}'s '{name}' differs by {worst} (relative)");
                }
            }
        }
        assert_same_values(&ranks[1].1, &ranks[0].1, &format!("{precision}: rank 1 against rank 0"));
    }
}

#[test]
fn every_event_carries_its_device_and_the_reductions_are_collectives() {
    let data = batches();
    let bus = stagehand::events::Bus::new();
    let kept = common::Collected::on(&bus);
    let _ = two_devices(Precision::Fp32, &data, Some(bus.clone()));
    bus.flush();
    let events = kept.take();
    let on = |d: u32| events.iter().filter(|e| e.device == Some(d)).count();
    assert!(on(0) > 100 && on(1) > 100, "both lanes publish: {} and {}", on(0), on(1));
    let unlabelled: Vec<&str> = events.iter().filter(|e| e.device.is_none()).map(|e| e.kind.name()).collect();
    assert!(unlabelled.iter().all(|k| *k == "limits_set"), "only the group's own events carry no device: {unlabelled:?}");
    for d in [0, 1] {
        let reduced: u64 = events
            .iter()
            .filter(|e| e.device == Some(d))
            .filter_map(|e| match &e.kind {
                EventKind::TransferCompleted { dir: Direction::Collective, bytes, duration_ms, .. } => {
                    assert!(duration_ms.is_some(), "host collectives are timed");
                    Some(*bytes)
                }
                _ => None,
            })
            .sum();
        assert!(reduced > 0, "device {d} reduced gradients");
        let steps: Vec<u64> = events
            .iter()
            .filter(|e| e.device == Some(d))
            .filter_map(|e| match &e.kind {
                EventKind::TrainStep(_) => Some(e.step),
                _ => None,
            })
            .collect();
        assert_eq!(steps, (1..=STEPS as u64).collect::<Vec<_>>(), "device {d}'s own steps");
        let shards = events
            .iter()
            .filter(|e| e.device == Some(d))
            .any(|e| matches!(&e.kind, EventKind::TransferIssued { dir: Direction::D2h, subject, .. } if subject.contains("gradient shard")));
        assert!(shards, "device {d} copies its shard of the gradients to the host");
        let aggregated = events.iter().filter(|e| e.device == Some(d)).any(|e| matches!(&e.kind, EventKind::TransferStep(m) if m.collective.count > 0));
        assert!(aggregated, "device {d}'s transfer_step counts its collectives");
        // Overlapped with backward: in every step, the blocks' reductions start while backward
        // still runs (each as its block's backward leaves it), not after it.
        for step in 1..=STEPS as u64 {
            let mut backward = false;
            let mut during = 0;
            for e in events.iter().filter(|e| e.device == Some(d) && e.step == step) {
                match &e.kind {
                    EventKind::PhaseChanged { to, .. } => backward = *to == Phase::Backward,
                    EventKind::TransferIssued { dir: Direction::Collective, .. } if backward => during += 1,
                    _ => {}
                }
            }
            assert!(during >= (LAYERS - 1) as usize, "device {d}, step {step}: {during} reductions issued during backward");
        }
    }
}

#[test]
fn a_checkpoint_of_the_group_loads_into_one_device_and_back() {
    let data = batches();
    // The models draw their initial values from the process's generator: no other test's
    // draws between.
    let _g = rng();
    let dir = tempfile::tempdir().expect("dir");
    let group_file = dir.path().join("group.safetensors");
    let state_file = dir.path().join("group.optimizer.safetensors");
    let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).build_group().expect("group");
    let ranks = {
        tch::manual_seed(3);
        group
            .run(build, |sh, model| -> stagehand::Result<_> {
                let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
                for b in &data[..2] {
                    let (x, y) = batch(b);
                    let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                    sh.train_step(&mut opt, || loss(model, &x, &y))?;
                }
                sh.save(&group_file)?;
                opt.save_state(&state_file)?;
                Ok(values(sh))
            })
            .expect("the group trains")
    };
    // One device loads the group's model and optimizer state.
    let sh = builder(Precision::Fp32).device(Device::host(BUDGET)).build().expect("handle");
    let model = build(&sh);
    sh.load(&group_file).expect("loads");
    assert_same_values(&values(&sh), &ranks[0], "one device after loading the group's checkpoint");
    let mut opt = sh.optimizer(nn::AdamW::default(), LR).expect("optimizer");
    opt.load_state(&state_file).expect("loads the group's optimizer state");
    // ... and trains on from it as the group would have: the next step equals one device's
    // that trained all along.
    let (x, y) = batch(&data[2]);
    let half = BATCH / 2;
    let resumed = sh
        .train_step_micro(&mut opt, 2, |i| loss(&model, &x.narrow(0, i as i64 * half, half), &y.narrow(0, i as i64 * half, half)))
        .expect("step")
        .loss;
    drop(_g);
    let (want_losses, _) = one_device(Precision::Fp32, &data[..3], &[2; 3]);
    let _g = rng();
    assert_eq!(resumed, want_losses[2], "the resumed step's loss");
    let one_file = dir.path().join("one.safetensors");
    let one_state = dir.path().join("one.optimizer.safetensors");
    sh.save(&one_file).expect("saves");
    opt.save_state(&one_state).expect("saves the optimizer state");
    let after_one = values(&sh);
    drop(_g);
    let (want_losses, want_values) = one_device(Precision::Fp32, &data[..4], &[2; 4]);
    let _g = rng();
    // A group loads the one device's checkpoint and optimizer state: every rank has its values,
    // and the group's next step is the one device's.
    let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).build_group().expect("group");
    let loaded = group
        .run(build, |sh, model| -> stagehand::Result<_> {
            sh.load(&one_file)?;
            let loaded = values(sh);
            let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
            opt.load_state(&one_state)?;
            let (x, y) = batch(&data[3]);
            let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
            let next = sh.train_step(&mut opt, || loss(model, &x, &y))?.loss;
            Ok((loaded, next, values(sh)))
        })
        .expect("loads");
    for (rank, (v, next, stepped)) in loaded.iter().enumerate() {
        assert_same_values(v, &after_one, &format!("rank {rank} after loading one device's checkpoint"));
        assert_eq!(*next, want_losses[3], "rank {rank}'s step after loading one device's checkpoint");
        assert_same_values(stepped, &want_values, &format!("rank {rank} stepped from one device's optimizer state"));
    }
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_cause() {
    let data = batches();
    let _g = rng();
    for panics in [false, true] {
        let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).collective_timeout(Duration::from_secs(120)).build_group().expect("group");
        let t0 = Instant::now();
        let e = group
            .run(build, |sh, model| -> stagehand::Result<()> {
                let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
                for (s, b) in data.iter().enumerate() {
                    if sh.rank() == 1 && s == 2 {
                        if panics {
                            panic!("the data loader broke");
                        }
                        return Err(Error::Config { field: "data", value: "batch 2".into(), expected: "a readable batch".into() });
                    }
                    let (x, y) = batch(b);
                    let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                    sh.train_step(&mut opt, || loss(model, &x, &y))?;
                }
                Ok(())
            })
            .expect_err("rank 1 failed");
        let text = e.to_string();
        assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{text}");
        let cause = if panics { "panicked: the data loader broke" } else { "batch 2" };
        assert!(text.contains("rank 1 (host:1 (simulated)) failed") && text.contains(cause), "{text}");
        assert!(t0.elapsed() < Duration::from_secs(60), "no rank waited for the timeout: {:?}", t0.elapsed());
    }
}

#[test]
fn a_rank_out_of_memory_stops_every_rank_with_its_report() {
    let data = batches();
    let _g = rng();
    let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).collective_timeout(Duration::from_secs(120)).build_group().expect("group");
    let t0 = Instant::now();
    let e = group
        .run(build, |sh, model| -> stagehand::Result<()> {
            let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
            for (s, b) in data.iter().enumerate() {
                let (x, y) = batch(b);
                let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                sh.train_step(&mut opt, || {
                    if sh.rank() == 1 && s == 2 {
                        // Rank 1's forward needs more than its device holds (the host device
                        // refuses it as CUDA's allocator would; the panic's text is what the
                        // handle reads an out-of-memory from).
                        let _t = sh.device().alloc_slab(2 * BUDGET as usize).unwrap_or_else(|e| panic!("{e}"));
                    }
                    loss(model, &x, &y)
                })?;
            }
            Ok(())
        })
        .expect_err("rank 1 ran out of memory");
    let text = e.to_string();
    assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{text}");
    assert!(text.contains("rank 1 (host:1 (simulated)) failed") && text.contains("out of device memory in the forward of step 3"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(60), "no rank waited for the timeout: {:?}", t0.elapsed());
}

#[test]
fn a_rank_that_stops_calling_is_declared_failed_after_the_timeout() {
    let data = batches();
    let _g = rng();
    let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).collective_timeout(Duration::from_millis(1500)).build_group().expect("group");
    let t0 = Instant::now();
    let e = group
        .run(build, |sh, model| -> stagehand::Result<()> {
            let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
            if sh.rank() == 1 {
                // Stuck in its own code (a data loader that hangs) past the group's timeout.
                std::thread::sleep(Duration::from_secs(4));
            }
            for b in &data {
                let (x, y) = batch(b);
                let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                sh.train_step(&mut opt, || loss(model, &x, &y))?;
            }
            Ok(())
        })
        .expect_err("rank 1 stalled");
    let text = e.to_string();
    assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{text}");
    assert!(text.contains("did not reach"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

#[test]
fn ranks_that_build_different_models_are_refused() {
    let _g = rng();
    let group = builder(Precision::Fp32).devices(Devices::host(2, BUDGET)).build_group().expect("group");
    let e = group
        .run(
            |sh| {
                let root = sh.root();
                let d = if sh.rank() == 0 { D } else { D + 1 };
                snn::linear(&root / "blocks" / 0 / "fc", d, d, Default::default())
            },
            |_, _| -> stagehand::Result<()> { Ok(()) },
        )
        .expect_err("different models");
    assert!(e.to_string().contains("differently from rank 0"), "{e}");
}

/// The GPU tests take the GPUs one at a time: a budget computed from a device's reading must not
/// count the other test's tensors.
static GPUS: Mutex<()> = Mutex::new(());

/// CUDA devices present (after loading libtorch's CUDA backend).
fn gpus() -> usize {
    if !stagehand::torch::init() {
        return 0;
    }
    usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
}

/// On a machine with two GPUs: the same training over NCCL trains as one GPU does over the same
/// global batch in two micro-batches, within float rounding (NCCL sums in its own order, the
/// fused host kernel rounds its own way), in fp32 and bf16; skipped elsewhere.
#[test]
fn two_gpus_train_as_one_gpu_within_float_rounding() {
    if gpus() < 2 {
        eprintln!("skipped: needs 2 CUDA devices, {} here", gpus());
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let data = batches();
    let _g = rng();
    for precision in [Precision::Fp32, Precision::Bf16] {
        // Above what libtorch holds for itself on each device, small enough that blocks stream.
        let base = |d: usize| {
            let dev = Device::cuda(d).expect("cuda");
            dev.warm_up().expect("warm up");
            dev.memory().allocated
        };
        let budget = |d: usize| BUDGET + base(d);
        let one = {
            let dev = Device::cuda(0).expect("cuda");
            let sh = Stagehand::builder().budget_bytes(budget(0)).precision(precision).device(dev).build().expect("handle");
            tch::manual_seed(3);
            let model = build(&sh);
            let mut opt = sh.optimizer(nn::AdamW::default(), LR).expect("optimizer");
            let mut losses = Vec::new();
            for b in &data {
                let (x, y) = batch(b);
                let half = BATCH / 2;
                let dev = sh.device().tch_device();
                let r = sh
                    .train_step_micro(&mut opt, 2, |i| {
                        loss(&model, &x.narrow(0, i as i64 * half, half).to_device(dev), &y.narrow(0, i as i64 * half, half).to_device(dev))
                    })
                    .expect("step");
                losses.push(r.loss);
            }
            (losses, values(&sh))
        };
        let group = Stagehand::builder()
            .budget_bytes(budget(0).max(budget(1)))
            .precision(precision)
            .devices(Devices::cuda(2).expect("two GPUs"))
            .collective_timeout(Duration::from_secs(120))
            .build_group()
            .expect("group");
        tch::manual_seed(3);
        let ranks = group
            .run(build, |sh, model| -> stagehand::Result<_> {
                let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
                let mut losses = Vec::new();
                for b in &data {
                    let (x, y) = batch(b);
                    let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                    losses.push(sh.train_step(&mut opt, || loss(model, &x, &y))?.loss);
                }
                assert!(sh.plan().expect("plan").streams(), "the blocks stream");
                Ok((losses, values(sh)))
            })
            .expect("two GPUs train");
        let tol = if precision == Precision::Fp32 { 1e-4 } else { 2e-2 };
        for (rank, (losses, got)) in ranks.iter().enumerate() {
            for (a, b) in losses.iter().zip(&one.0) {
                assert!((a - b).abs() <= tol * b.abs().max(1e-3), "{precision}: rank {rank}'s losses {losses:?} against {:?}", one.0);
            }
            for (name, w) in &one.1 {
                let g = &got[name];
                let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
                let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 10.0 * tol as f32 * scale, "{precision}: rank {rank}: '{name}' differs by {worst} (scale {scale})");
            }
        }
        // Both ranks hold the same values: one host copy, and the device variables reduced.
        assert_same_values(&ranks[1].1, &ranks[0].1, &format!("{precision}: rank 1 against rank 0"));
    }
}

/// On a machine with two GPUs: a rank that fails mid-run stops the other, whose collectives
/// NCCL aborts, with the failed rank's error and no hang; and a rank that stalls past the
/// timeout is declared failed. Skipped elsewhere.
#[test]
fn a_gpu_rank_that_fails_or_stalls_stops_the_other_without_a_hang() {
    if gpus() < 2 {
        eprintln!("skipped: needs 2 CUDA devices, {} here", gpus());
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let data = batches();
    let _g = rng();
    let budget = 256 << 20;
    for stall in [false, true] {
        let group = Stagehand::builder()
            .budget_bytes(budget)
            .devices(Devices::cuda(2).expect("two GPUs"))
            .collective_timeout(Duration::from_secs(if stall { 5 } else { 120 }))
            .build_group()
            .expect("group");
        let t0 = Instant::now();
        let e = group
            .run(build, |sh, model| -> stagehand::Result<()> {
                let mut opt = sh.optimizer(nn::AdamW::default(), LR)?;
                for (s, b) in data.iter().enumerate() {
                    if sh.rank() == 1 && s == 2 {
                        if stall {
                            std::thread::sleep(Duration::from_secs(15));
                        } else {
                            return Err(Error::Config { field: "data", value: "batch 2".into(), expected: "a readable batch".into() });
                        }
                    }
                    let (x, y) = batch(b);
                    let (x, y) = (sh.shard(&x)?, sh.shard(&y)?);
                    sh.train_step(&mut opt, || loss(model, &x, &y))?;
                }
                Ok(())
            })
            .expect_err("rank 1 failed");
        let text = e.to_string();
        assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{text}");
        assert!(text.contains(if stall { "did not" } else { "batch 2" }), "{text}");
        assert!(t0.elapsed() < Duration::from_secs(90), "{:?}: {text}", t0.elapsed());
    }
}
