//! The loop of `train-before.rs` under Stagehand: one handle with a device budget, the model built
//! on its root with Stagehand's layers, its optimizer, and `train_step` in place of
//! `backward_step`. Weights stream from host memory, activations spill above the plan's
//! watermark, and every decision goes to a telemetry file. The changed lines are marked
//! `// stagehand:`.
//!
//! Run: `cargo run --release -p stagehand-examples --bin train-after -- 50 run.jsonl`
//! then `stagehand-top --replay run.jsonl`.

use clap::Parser;
use stagehand::Stagehand;
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Gpt, GptConfig, StreamedLayers};
use tch::nn::{self, Module};

/// The loop of train-before under Stagehand, with a telemetry file.
#[derive(Parser)]
struct Args {
    /// Training steps.
    #[arg(default_value_t = 50)]
    steps: u64,
    /// Telemetry file (never overwritten).
    #[arg(default_value = "train-after.jsonl")]
    out: String,
}

fn main() -> anyhow::Result<()> {
    let Args { steps, out } = Args::parse();
    let device = tch::Device::cuda_if_available();
    let cfg = GptConfig { vocab: 128, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128, attention: Default::default(), checkpoint: false };
    tch::manual_seed(0);
    // stagehand: one handle with an 8 MiB device budget and a telemetry file.
    let sh = Stagehand::builder().budget_mib(8).telemetry_file(&out).build()?;
    let model = Gpt::new(&StreamedLayers(sh.store()), cfg); // stagehand: the layer factory
    let mut opt = sh.optimizer(nn::AdamW::default(), 3e-3)?; // stagehand
    for step in 1..=steps {
        let batch = progression_batch(16, cfg.block_size, cfg.vocab, device);
        // stagehand: the step (zero_grad, backward, step) through the handle.
        let loss = sh.train_step(&mut opt, || Gpt::loss(&model.forward(&batch.inputs), &batch.targets))?.loss;
        if step % 10 == 0 || step == steps {
            println!("step {step:4}  loss {loss:.3}");
        }
    }
    sh.finish()?;
    let m = sh.weights().last_step_metrics();
    println!("last step: {} evictions, {} prefetch hits, {} misses; telemetry in {out}", m.evictions, m.prefetch_hits, m.prefetch_misses);
    Ok(())
}
