//! An ordinary tch training loop: the GPT of this crate, resident on one device, plain AdamW.
//! Compare with `train-after.rs`, the same loop under Stagehand: the diff is what a user changes.
//!
//! Run: `cargo run --release -p stagehand-examples --bin train-before -- 50`

use clap::Parser;
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Gpt, GptConfig, TchLayers};
use tch::nn::{self, Module, OptimizerConfig};

/// An ordinary tch training loop (compare with train-after).
#[derive(Parser)]
struct Args {
    /// Training steps.
    #[arg(default_value_t = 50)]
    steps: u64,
}

fn main() -> anyhow::Result<()> {
    let Args { steps } = Args::parse();
    let device = tch::Device::cuda_if_available();
    let cfg = GptConfig { vocab: 128, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128, attention: Default::default(), checkpoint: false };
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Gpt::new(&TchLayers(vs.root()), cfg);
    vs.set_device(device);
    let mut opt = nn::AdamW::default().build(&vs, 3e-3)?;
    for step in 1..=steps {
        let batch = progression_batch(16, cfg.block_size, cfg.vocab, device);
        let loss = Gpt::loss(&model.forward(&batch.inputs), &batch.targets);
        opt.backward_step(&loss);
        if step % 10 == 0 || step == steps {
            println!("step {step:4}  loss {:.3}", loss.double_value(&[]));
        }
    }
    Ok(())
}
