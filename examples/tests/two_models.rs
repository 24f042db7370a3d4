//! A student GPT trained against a frozen teacher GPT on one handle, in steps of micro-batches:
//! each micro-batch runs the teacher's forward, then the student's forward and backward, so the
//! step goes over the combined itinerary once for each. The weights move exactly the Belady
//! minimum of that itinerary once the room has settled, as in a step of one micro-batch.

use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::session::ModelOptions;
use stagehand::Stagehand;
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Attention, Gpt, GptConfig, StreamedLayersAt};
use tch::nn::{self, Module};
use tch::Kind;

mod common;
use common::serial;

/// The two-models bench's host model: 4 blocks of d=128 each, 8 sequences of 64 tokens a
/// step, under 24 MiB (eight blocks stream through six slots).
const BUDGET: u64 = 24 << 20;
const STEPS: usize = 5;

/// The weight metrics of each step: (bytes loaded, the Belady minimum).
fn moved(micro: i64) -> Vec<(u64, u64)> {
    let cfg = GptConfig {
        vocab: 128,
        block_size: 64,
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        attention: Attention::Recomputed,
        checkpoint: false,
    };
    let sh = Stagehand::builder().budget_bytes(BUDGET).device(Device::host(1 << 30)).bus(Bus::disabled()).build().expect("handle");
    tch::manual_seed(1);
    let teacher = Gpt::new(&StreamedLayersAt(sh.model("teacher", ModelOptions::frozen()).expect("teacher")), cfg);
    tch::manual_seed(2);
    let student = Gpt::new(&StreamedLayersAt(sh.root()), cfg);
    let mut opt = sh.optimizer(nn::AdamW::default(), 1e-4).expect("optimizer");
    (0..STEPS)
        .map(|_| {
            let b = progression_batch(8, 64, cfg.vocab, tch::Device::Cpu);
            let parts = b.inputs.chunk(micro, 0);
            sh.train_step_micro(&mut opt, parts.len(), |i| {
                let target = tch::no_grad(|| teacher.forward(&parts[i]).to_kind(Kind::Float));
                student.forward(&parts[i]).mse_loss(&target, tch::Reduction::Mean)
            })
            .expect("step");
            let m = sh.weights().last_step_metrics();
            (m.load_bytes(), m.min_h2d_bytes)
        })
        .collect()
}

#[test]
fn a_frozen_teacher_and_a_student_over_micro_batches_move_the_belady_minimum() {
    let _serial = serial();
    for micro in [1, 2] {
        let steps = moved(micro);
        for (i, &(bytes, min)) in steps.iter().enumerate().skip(2) {
            assert!(min > 0, "{micro} micro-batches, step {}: the weights stream: {steps:?}", i + 1);
            assert_eq!(bytes, min, "{micro} micro-batches, step {}: weights moved against the minimum: {steps:?}", i + 1);
        }
    }
}
