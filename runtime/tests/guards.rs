//! Numeric guards through the handle, on the host device: a NaN or infinity in a block's output,
//! in the gradients, or in the loss is published once per step as `non_finite`, naming the first
//! block that produced it; the flight recorder dumps around it; with guards off nothing is
//! checked at all.

use stagehand::device::Device;
use stagehand::events::jsonl::read_file;
use stagehand::events::{BlockId, EventKind, TelemetryConfig};
use stagehand::guards::Site;
use stagehand::nn as snn;
use stagehand::Stagehand;
use tch::nn::Module;
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

mod common;
use common::rng;

const D: i64 = 16;
const BUDGET: u64 = 1 << 20;
/// Small enough that no block stays resident.
const STREAMING_BUDGET: u64 = 12 << 10;

/// The `non_finite` events seen: block and tensor.
type Seen = Arc<Mutex<Vec<(Option<BlockId>, String)>>>;

struct Collect(Seen);

impl stagehand::events::EventSink for Collect {
    fn on_event(&mut self, e: &stagehand::events::Event) {
        if let EventKind::NonFinite { block, tensor } = &e.kind {
            self.0.lock().expect("events").push((*block, tensor.clone()));
        }
    }
}

struct Run {
    sh: Stagehand,
    seen: Seen,
    layers: Vec<snn::Linear>,
    opt: stagehand::optim::Optimizer,
    _dir: tempfile::TempDir,
}

fn run(guards: bool) -> Run {
    run_with(guards, BUDGET)
}

fn run_with(guards: bool, budget: u64) -> Run {
    let dir = tempfile::tempdir().expect("tempdir");
    let sh = Stagehand::builder()
        .budget_bytes(budget)
        .device(Device::host(budget))
        .guards(guards)
        .telemetry(TelemetryConfig { path: Some(dir.path().join("run.jsonl")), ..Default::default() })
        .build()
        .expect("handle");
    let layers = {
        let _g = rng();
        tch::manual_seed(2);
        let r = sh.root();
        (0..3).map(|i| snn::linear(&r / "blocks" / i / "fc", D, D, Default::default())).collect()
    };
    let opt = sh.optimizer(tch::nn::Sgd::default(), 1e-3).expect("optimizer");
    let seen = Arc::default();
    sh.hub().expect("hub").add_sink(Box::new(Collect(Arc::clone(&seen))));
    Run { sh, seen, layers, opt, _dir: dir }
}

fn x() -> Tensor {
    Tensor::ones([2, D], (Kind::Float, tch::Device::Cpu))
}

fn non_finite_events(r: &Run) -> Vec<(Option<BlockId>, String)> {
    r.sh.bus().flush();
    r.seen.lock().expect("events").clone()
}

#[test]
fn a_nan_born_in_a_block_is_named_as_that_blocks_output() {
    let mut r = run(true);
    let l = &r.layers;
    let ids: Vec<BlockId> = l.iter().map(|l| l.block()).collect();
    let poison = Tensor::from(f32::INFINITY);
    let rep = r
        .sh
        .train_step(&mut r.opt, || {
            let h0 = l[0].forward(&x());
            // Block 1 gets an infinity in its input: its output is the first non-finite one.
            let h1 = l[1].forward(&(&h0 * &poison - &h0 * &poison));
            l[2].forward(&h1).sum(Kind::Float)
        })
        .expect("the step runs");
    let f = rep.non_finite.expect("found");
    assert_eq!((f.block, f.site), (Some(ids[1]), Site::Output), "{f:?}");
    assert!(f.count >= 3, "block 2's output, the loss and gradients followed: {f:?}");
    assert_eq!(non_finite_events(&r), [(Some(ids[1]), "output".to_owned())], "one event per step");
    // The flight recorder dumped around it.
    let t = r.sh.telemetry().expect("telemetry");
    let dump = t.last_dump().expect("a dump");
    assert_eq!(dump.reason, "non_finite");
    let (events, _) = read_file(&dump.path).expect("dump reads");
    assert!(events.iter().any(|e| matches!(&e.kind, EventKind::NonFinite { block: Some(b), .. } if *b == ids[1])));
}

#[test]
fn gradients_are_checked_as_they_leave_the_device_when_blocks_stream() {
    let mut r = run_with(true, STREAMING_BUDGET);
    let l = &r.layers;
    let ids: Vec<BlockId> = l.iter().map(|l| l.block()).collect();
    let rep = r
        .sh
        .train_step(&mut r.opt, || (l[2].forward(&l[1].forward(&l[0].forward(&x()))) * 0.0).abs().sqrt().sum(Kind::Float))
        .expect("the step runs");
    let plan = r.sh.plan().expect("planned");
    assert!(plan.streams() && plan.resident_blocks.is_empty(), "every block streams: {plan:?}");
    // Backward leaves block 2 first: its gradients are the first to leave the device.
    assert_eq!(rep.non_finite.map(|f| (f.block, f.site)), Some((Some(ids[2]), Site::Gradient)));
}

#[test]
fn a_nan_born_in_backward_is_a_gradient_and_a_nan_loss_is_the_loss() {
    let mut r = run(true);
    let l = &r.layers;
    let ids: Vec<BlockId> = l.iter().map(|l| l.block()).collect();
    // sqrt(|0 * y|) is 0, but its derivative at 0 is infinite: the forward is finite and the
    // gradients are not.
    let rep = r
        .sh
        .train_step(&mut r.opt, || (l[2].forward(&l[1].forward(&l[0].forward(&x()))) * 0.0).abs().sqrt().sum(Kind::Float))
        .expect("the step runs");
    let f = rep.non_finite.expect("found");
    assert_eq!(f.site, Site::Gradient, "{f:?}");
    assert!(f.block.is_some_and(|b| ids.contains(&b)), "a block's gradient: {f:?}");
    assert!(rep.loss.is_finite());
    assert_eq!(non_finite_events(&r), [(f.block, "gradient".to_owned())]);

    // (A fresh run: the NaN gradients above made every weight NaN.)
    let mut r = run(true);
    let l = &r.layers;
    let rep = r
        .sh
        .train_step(&mut r.opt, || l[2].forward(&l[1].forward(&l[0].forward(&x()))).sum(Kind::Float) + Tensor::from(-1.0f32).log())
        .expect("the step runs");
    assert_eq!(rep.non_finite.map(|f| (f.block, f.site)), Some((None, Site::Loss)));
    assert_eq!(non_finite_events(&r), [(None, "loss".to_owned())]);
}

#[test]
fn a_finite_step_finds_nothing_and_guards_off_check_nothing() {
    let mut r = run(true);
    let l = &r.layers;
    let rep = r
        .sh
        .train_step(&mut r.opt, || l[2].forward(&l[1].forward(&l[0].forward(&x()))).square().mean(Kind::Float))
        .expect("step");
    assert_eq!(rep.non_finite, None);
    assert!(r.sh.weights().guards().get().is_some());

    let mut off = run(false);
    let l = &off.layers;
    let poison = Tensor::from(f32::NAN);
    let rep = off
        .sh
        .train_step(&mut off.opt, || l[1].forward(&(l[0].forward(&x()) * &poison)).sum(Kind::Float))
        .expect("step");
    assert_eq!(rep.non_finite, None, "guards are off by default");
    assert!(off.sh.weights().guards().get().is_none(), "nothing is armed, so the hooks return at once");
    assert!(non_finite_events(&off).is_empty());
}
