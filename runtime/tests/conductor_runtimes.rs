//! The weight and activation runtimes under a Conductor: every copy takes a transfer slot
//! (required ones are never refused, speculative ones may be), the runtimes read the knobs the
//! Conductor writes (no copying at phase boundaries), and detaching restores them. Results stay
//! bit-identical to training without the Conductor. Runs on the host device, and on CUDA where
//! present (`Device::auto`); exact slot counts are checked on the host device, where copies
//! land as they are issued.

use stagehand::activations::{ActivationConfig, ActivationRuntime};
use stagehand::conductor::{Conductor, ConductorConfig};
use stagehand::device::Device;
use stagehand::events::{
    BlockId, Bus, DenyReason, Direction, Event, EventKind, EventSink, Hub, KeepReason, Owner,
    PackDecision,
};
use stagehand::weights::{WeightConfig, WeightRuntime};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

mod common;
use common::blocks::{block_bytes, block_fwd, Block, D};
use common::{device, grads, rng};

/// A sink keeping every event, and a bus feeding it.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Event>>>);

impl EventSink for Recorder {
    fn on_event(&mut self, event: &Event) {
        self.0.lock().expect("recorder").push(event.clone());
    }
}

impl Recorder {
    fn bus(&self) -> Bus {
        let hub = Arc::new(Hub::new());
        hub.add_sink(Box::new(self.clone()));
        Bus::with_hub(hub, stagehand::events::bus::DEFAULT_QUEUE_CAPACITY)
    }

    fn take(&self, bus: &Bus) -> Vec<EventKind> {
        bus.flush();
        self.0.lock().expect("recorder").drain(..).map(|e| e.kind).collect()
    }
}

/// A Conductor that publishes every slot grant and release, with `h2d` and `d2h` slots and
/// caps far above anything these models use.
fn conductor(bus: &Bus, device: &Device, h2d: u32, d2h: u32) -> Conductor {
    let dev = device.clone();
    Conductor::new(
        ConductorConfig::builder()
            .vram_soft_cap_mib(1 << 20)
            .vram_hard_cap_mib(1 << 21)
            .h2d_slots(h2d)
            .d2h_slots(d2h)
            .debug_event_trace(true)
            .build()
            .expect("conductor config"),
        bus.clone(),
        move || dev.memory().allocated,
    )
    .expect("conductor")
}

fn count(events: &[EventKind], f: impl Fn(&EventKind) -> bool) -> usize {
    events.iter().filter(|e| f(e)).count()
}

fn grants(events: &[EventKind], who: Owner, d: Direction) -> usize {
    count(events, |e| matches!(e, EventKind::SlotGranted { owner, dir, .. } if *owner == who && *dir == d))
}

fn issued(events: &[EventKind], who: Owner, d: Direction) -> usize {
    count(events, |e| matches!(e, EventKind::TransferIssued { owner, dir, .. } if *owner == who && *dir == d))
}

/// No required (non-speculative) request was ever refused.
fn assert_required_never_refused(events: &[EventKind]) {
    for e in events {
        if let EventKind::SlotDenied { speculative, .. } = e {
            assert!(*speculative, "a required copy was refused: {e:?}");
        }
    }
}

// ---- weights ---------------------------------------------------------------------------------

/// A frozen reference model on the device and an identical one in host memory, streamed by a
/// weight runtime that holds 4 blocks and prefetches 3 ahead with 3 copies in flight.
fn weights(n: usize, device: &Device, bus: Bus) -> (Vec<Block>, Vec<Block>, WeightRuntime, nn::VarStore) {
    let (_vr, r, vm, m) = common::blocks::pair(device.tch_device(), n, false);
    let cfg = WeightConfig::builder()
        .pool(4 << 20, 1 << 20)
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(4 * block_bytes())
        .prefetch_window(3)
        .max_inflight_h2d(3)
        .build()
        .expect("config");
    let rt = WeightRuntime::from_var_store(&vm, r"^blocks\.\d+$", device.clone(), cfg, bus).expect("runtime");
    (r, m, rt, vm)
}

fn ids(rt: &WeightRuntime, n: usize) -> Vec<BlockId> {
    (0..n).map(|i| rt.block_id(&format!("blocks.{i}")).expect("id")).collect()
}

/// One step: forward through the managed blocks, backward into the input.
fn weight_step(c: &Conductor, rt: &WeightRuntime, ids: &[BlockId], m: &[Block], x: &Tensor, step: u64) -> Tensor {
    c.begin_step(step).expect("begin");
    rt.begin_step().expect("runtime begin");
    c.enter_forward().expect("forward");
    let out = {
        let _hooks = rt.hooks().expect("hooks");
        let mut h = x.shallow_clone();
        for (id, b) in ids.iter().zip(m) {
            h = rt.run_block(*id, || block_fwd(b, &h)).expect("block");
        }
        h
    };
    c.enter_backward().expect("backward");
    out.sum(Kind::Float).backward();
    rt.end_step().expect("runtime end");
    c.end_step().expect("end");
    out
}

#[test]
fn weight_loads_take_slots_and_only_speculative_prefetches_are_refused() {
    let device = device();
    let rec = Recorder::default();
    let bus = rec.bus();
    let n = 6;
    let (r, m, rt, _vm) = weights(n, &device, bus.clone());
    let ids = ids(&rt, n);
    // One H2D slot for a runtime that would keep three copies in flight.
    let c = conductor(&bus, &device, 1, 1);
    rt.attach_conductor(&c).expect("attach");
    let mut competitor = None;
    let mut before_competition = Vec::new();
    for step in 0..4 {
        if step == 2 {
            // Another runtime's copy holds the only slot for the rest of the run.
            before_competition = rec.take(&bus);
            let token = c
                .acquire_slot(Direction::H2d, Owner::Activations, stagehand::events::Priority::Required)
                .expect("required slot");
            competitor = Some(token);
        }
        let x = {
            let _g = rng();
            tch::manual_seed(100 + step as i64);
            Tensor::randn([8, D], (Kind::Float, device.tch_device())).set_requires_grad(true)
        };
        let xr = x.detach().set_requires_grad(true);
        let want = r.iter().fold(xr.shallow_clone(), |h, b| block_fwd(b, &h));
        want.sum(Kind::Float).backward();
        let got = weight_step(&c, &rt, &ids, &m, &x, step);
        assert!(got.equal(&want), "step {step}: outputs differ under the Conductor");
        assert!(x.grad().equal(&xr.grad()), "step {step}: input grads differ");
    }
    let last = rt.last_step_metrics();
    drop(competitor);
    rt.shutdown().expect("runtime shutdown");
    let metrics = c.metrics().expect("enabled");
    assert_eq!((metrics.h2d_inflight, metrics.d2h_inflight), (0, 0), "every slot given back");
    c.shutdown();
    let competed = rec.take(&bus);
    let all: Vec<EventKind> = before_competition.iter().chain(&competed).cloned().collect();

    // Every weight copy took exactly one slot, and gave it back.
    let granted = grants(&all, Owner::Weights, Direction::H2d);
    assert_eq!(granted, issued(&all, Owner::Weights, Direction::H2d));
    assert!(granted > 2 * n, "{granted} loads: blocks were streamed, not held");
    let released = count(&all, |e| {
        matches!(e, EventKind::SlotReleased { owner: Owner::Weights, dir: Direction::H2d, .. })
    });
    assert_eq!(released, granted);
    assert_required_never_refused(&all);

    // With the slot taken, loads further ahead are refused, and the required ones (the next
    // block, demand loads) pass over the limit.
    let refused = count(&competed, |e| {
        matches!(
            e,
            EventKind::SlotDenied {
                owner: Owner::Weights,
                dir: Direction::H2d,
                speculative: true,
                reason: DenyReason::H2dSlotsExhausted,
            }
        )
    });
    assert!(refused >= 2, "{refused} speculative prefetches refused");
    let over_limit = count(&competed, |e| {
        matches!(
            e,
            EventKind::SlotGranted { owner: Owner::Weights, speculative: false, inflight, .. } if *inflight > 1
        )
    });
    assert_eq!(over_limit, grants(&competed, Owner::Weights, Direction::H2d), "all over the limit");
    assert!(over_limit >= 2, "{over_limit} required loads passed the full pool");
    assert!(metrics.slot_over_limit_count >= 1, "the last step counted them: {metrics:?}");
    if !device.is_cuda() {
        // Host copies land as issued: loading only the next block ahead still hides them all.
        assert_eq!(last.prefetch_misses, 0, "{last:?}");
    }
}

#[test]
fn the_runtimes_read_the_knobs_the_conductor_writes_and_get_them_back_on_detach() {
    let device = device();
    let (_r, _m, rt, _vm) = weights(2, &device, Bus::disabled());
    let acts = ActivationRuntime::new(device.clone(), spill_all(), Bus::disabled(), None).expect("acts");
    let c = conductor(&Bus::disabled(), &device, 2, 2);
    let (w0, a0) = (rt.knobs().load(), acts.knobs().load());
    assert_eq!((w0.prefetch_window, w0.max_inflight_h2d), (3, 3), "the configured values");
    assert_eq!((a0.max_inflight_d2h, a0.max_inflight_h2d, a0.prefetch_window), (2, 2, 4));
    rt.attach_conductor(&c).expect("attach weights");
    acts.attach_conductor(&c).expect("attach activations");
    assert!(
        matches!(rt.attach_conductor(&c), Err(stagehand::Error::Conductor(_))),
        "one weight runtime per Conductor"
    );
    c.begin_step(1).expect("begin");
    c.enter_forward().expect("forward");
    c.enter_backward().expect("backward");
    c.enter_optimizer().expect("optimizer");
    // Optimizer protection, read straight from the runtimes' own knobs.
    assert_eq!(rt.knobs().max_inflight_h2d(), 1);
    assert_eq!(rt.knobs().prefetch_window(), 1);
    assert!(rt.knobs().suppress_speculative());
    assert_eq!(acts.knobs().max_inflight_d2h(), 0, "spills paused in OPTIMIZER");
    assert_eq!(acts.knobs().max_inflight_h2d(), 1);
    c.end_step().expect("end");
    c.begin_step(2).expect("begin");
    assert_eq!((rt.knobs().load(), acts.knobs().load()), (w0, a0), "reset at step begin");
    c.enter_forward().expect("forward");
    c.enter_backward().expect("backward");
    c.enter_optimizer().expect("optimizer");
    rt.detach_conductor();
    acts.detach_conductor();
    assert_eq!((rt.knobs().load(), acts.knobs().load()), (w0, a0), "restored on detach");
    // Detached runtimes take no slots: a forward now changes no Conductor count.
    let before = c.metrics().expect("enabled");
    let ids = ids(&rt, 2);
    rt.begin_step().expect("runtime begin");
    tch::no_grad(|| rt.run_block(ids[0], || ()).expect("block"));
    rt.end_step().expect("runtime end");
    let after = c.metrics().expect("enabled");
    assert_eq!(after.slot_grant_count, before.slot_grant_count);
    c.shutdown();
}

// ---- activations -----------------------------------------------------------------------------

/// Spill everything eligible, restore up to 4 ahead, 2 copies in flight each way.
fn spill_all() -> ActivationConfig {
    common::spill_all_builder().restore_ahead(4, 64 << 20).max_inflight(2, 2).build().expect("config")
}

fn mlp(vs: &nn::Path<'_>) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 32, 128, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "l2", 128, 128, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs / "l3", 128, 128, Default::default()))
        .add_fn(|x| x.sigmoid())
        .add(nn::linear(vs / "l4", 128, 8, Default::default()))
}

/// Three MLP steps, each phase announced to `c`; returns the final gradients.
fn train_mlp(device: &Device, rt: Option<&ActivationRuntime>, c: &Conductor) -> Vec<(String, Tensor)> {
    let _g = rng();
    tch::manual_seed(11);
    let vs = nn::VarStore::new(device.tch_device());
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 1e-2).expect("optimizer");
    let x = Tensor::randn([64, 32], (Kind::Float, device.tch_device()));
    let y = Tensor::randn([64, 8], (Kind::Float, device.tch_device()));
    for step in 1..=3 {
        c.begin_step(step).expect("begin");
        if let Some(rt) = rt {
            rt.begin_step(step);
        }
        c.enter_forward().expect("forward");
        let loss = {
            let _hooks = rt.map(|r| r.managed_forward().expect("hooks"));
            net.forward(&x).mse_loss(&y, tch::Reduction::Mean)
        };
        c.enter_backward().expect("backward");
        opt.zero_grad();
        loss.backward();
        drop(loss);
        if let Some(rt) = rt {
            rt.end_step().expect("step end");
        }
        c.enter_optimizer().expect("optimizer");
        opt.step();
        c.end_step().expect("end");
    }
    grads(&vs)
}

#[test]
fn spills_and_restores_take_slots_and_gradients_stay_bit_identical() {
    let device = device();
    let resident = train_mlp(&device, None, &Conductor::disabled());
    let rec = Recorder::default();
    let bus = rec.bus();
    let rt = ActivationRuntime::new(device.clone(), spill_all(), bus.clone(), None).expect("runtime");
    // One H2D slot for restores that would run four ahead.
    let c = conductor(&bus, &device, 1, 2);
    rt.attach_conductor(&c).expect("attach");
    let spilled = train_mlp(&device, Some(&rt), &c);
    let m = c.metrics().expect("enabled");
    assert_eq!((m.h2d_inflight, m.d2h_inflight), (0, 0), "every slot given back");
    c.shutdown();
    let events = rec.take(&bus);

    assert_eq!(resident.len(), spilled.len());
    for ((n, a), (_, b)) in resident.iter().zip(&spilled) {
        assert!(a.equal(b), "gradient of {n} differs under the Conductor");
    }
    let spills = count(&events, |e| matches!(e, EventKind::Pack { decision: PackDecision::Spilled, .. }));
    let restores = count(&events, |e| matches!(e, EventKind::Restored { .. }));
    assert!(spills >= 3 * 4, "{spills} spills");
    assert_eq!(restores, spills, "every spill came back");
    // Small spills travel in batches: a slot per copy, fewer copies than spills.
    let copies = issued(&events, Owner::Activations, Direction::D2h);
    assert!(copies > 0 && copies < spills, "{copies} copies for {spills} spills");
    assert_eq!(grants(&events, Owner::Activations, Direction::D2h), copies, "a slot per spill copy");
    assert_eq!(grants(&events, Owner::Activations, Direction::H2d), restores, "a slot per restore");
    assert_eq!(issued(&events, Owner::Activations, Direction::H2d), restores);
    assert_required_never_refused(&events);
    let refused = count(&events, |e| {
        matches!(
            e,
            EventKind::SlotDenied { owner: Owner::Activations, dir: Direction::H2d, speculative: true, .. }
        )
    });
    let ahead = count(&events, |e| matches!(e, EventKind::Restored { predicted: true, .. }));
    if !device.is_cuda() {
        // Host restores land at once and are completed at the next unpack: the first tensor
        // ahead always gets the slot (required), the ones behind it are refused.
        assert!(refused > 0, "speculative restores were refused");
        assert!(ahead > 0, "the next tensor ahead was still restored early");
    }
}

#[test]
fn a_paused_spill_knob_keeps_saved_tensors_on_the_device() {
    let device = device();
    let rec = Recorder::default();
    let bus = rec.bus();
    let rt = ActivationRuntime::new(device.clone(), spill_all(), bus.clone(), None).expect("runtime");
    rt.knobs().set_max_inflight_d2h(0);
    let resident = train_mlp(&device, None, &Conductor::disabled());
    let kept = train_mlp(&device, Some(&rt), &Conductor::disabled());
    for ((n, a), (_, b)) in resident.iter().zip(&kept) {
        assert!(a.equal(b), "gradient of {n} differs");
    }
    let events = rec.take(&bus);
    assert_eq!(count(&events, |e| matches!(e, EventKind::Pack { decision: PackDecision::Spilled, .. })), 0);
    let paused = count(&events, |e| {
        matches!(e, EventKind::Pack { reason: Some(KeepReason::SpillsPaused), .. })
    });
    assert!(paused >= 3 * 4, "{paused} saves kept because spills were paused");
    rt.knobs().set_max_inflight_d2h(2);
    let _ = train_mlp(&device, Some(&rt), &Conductor::disabled());
    let events = rec.take(&bus);
    assert!(count(&events, |e| matches!(e, EventKind::Pack { decision: PackDecision::Spilled, .. })) > 0);
}
