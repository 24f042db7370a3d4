//! Inference-only streaming: a model four times larger than its device budget generates logits
//! with weights streamed block by block (no backward, no saved-tensor hooks). The room holds a
//! few of its 16 blocks: all but two of those slots stay pinned across passes, two stream, and
//! from the third pass every block is prefetched.
//!
//! Run: `cargo run --release -p stagehand-examples --bin inference -- 8`

use clap::Parser;
use stagehand::device::Device;
use stagehand::nn::{LayerOptions, ManagedVarStore};
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Gpt, GptConfig, StreamedLayers};
use tch::nn::{self, Module};

/// Inference with weights streamed through a budget a quarter of their size.
#[derive(Parser)]
struct Args {
    /// Batches to run.
    #[arg(default_value_t = 8)]
    batches: u64,
}

fn main() -> anyhow::Result<()> {
    let Args { batches } = Args::parse();
    stagehand::torch::init();
    // The runtime's device: CUDA where there is one (else the host device); the VarStore stays
    // on the CPU, where the streamed weights' host copies live.
    let runtime_device = Device::auto(1 << 30);
    let device = runtime_device.tch_device();
    let cfg = GptConfig { vocab: 128, block_size: 64, n_layer: 16, n_head: 4, n_embd: 256, attention: Default::default(), checkpoint: false };
    let weights = (cfg.parameters() * 4) as u64;
    let budget = weights / 4;
    tch::manual_seed(0);
    let vs = ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        LayerOptions {
            vram_budget: Some(budget),
            inference_mode: true,
            device: Some(runtime_device),
            ..LayerOptions::default()
        },
    )?;
    let model = Gpt::new(&StreamedLayers(&vs), cfg);
    println!("{:.1} MiB of weights through a {:.1} MiB budget", weights as f64 / 1048576.0, budget as f64 / 1048576.0);
    tch::no_grad(|| -> anyhow::Result<()> {
        for i in 1..=batches {
            let batch = progression_batch(8, cfg.block_size, cfg.vocab, device);
            let logits = model.forward(&batch.inputs);
            println!("batch {i}: logits {:?}, mean {:.4}", logits.size(), logits.mean(tch::Kind::Float).double_value(&[]));
        }
        Ok(())
    })?;
    let rt = vs.runtime();
    rt.finish()?;
    let m = rt.last_step_metrics();
    println!("last pass: {} evictions, {} hits, {} misses; {} bytes resident (budget {budget})", m.evictions, m.prefetch_hits, m.prefetch_misses, rt.resident_bytes());
    Ok(())
}
