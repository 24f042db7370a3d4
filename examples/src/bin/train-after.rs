//! The loop of `train-before.rs` under Stagehand: weights live in host memory and stream to the
//! device layer by layer, trainable weights are stepped by the offloaded AdamW on the host, and
//! every decision goes to a telemetry file. Four lines change (marked `// stagehand:`).
//!
//! Run: `cargo run --release -p stagehand-examples --bin train-after -- 50 run.jsonl`
//! then `stagehand-top --replay run.jsonl`.

use stagehand::events::{Bus, JsonlSink, OpenMode};
use stagehand::nn::{LayerOptions, ManagedVarStore};
use stagehand::weights::OffloadedAdamW;
use stagehand_examples::data::progression_batch;
use stagehand_examples::gpt::{Gpt, GptConfig, StreamedLayers};
use tch::nn;

fn main() -> anyhow::Result<()> {
    let steps: u64 = std::env::args().nth(1).map_or(Ok(50), |s| s.parse())?;
    let out = std::env::args().nth(2).unwrap_or_else(|| "train-after.jsonl".into());
    stagehand::torch::init(); // stagehand: load CUDA, install the saved-tensor hooks
    let device = tch::Device::cuda_if_available();
    let cfg = GptConfig { vocab: 128, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128 };
    tch::manual_seed(0);
    let bus = Bus::new();
    if let Some(hub) = bus.hub() {
        hub.add_sink(Box::new(JsonlSink::open(&out, OpenMode::CreateNew)?));
    }
    // stagehand: the VarStore lives in host memory; 1 MiB of device room for weights.
    let vs = ManagedVarStore::new(
        nn::VarStore::new(tch::Device::Cpu),
        LayerOptions { vram_budget: Some(1 << 20), telemetry: bus.clone(), ..LayerOptions::default() },
    )?;
    let model = Gpt::new(&StreamedLayers(&vs), cfg); // stagehand: the layer factory
    let mut opt = OffloadedAdamW::new(vs.runtime(), 3e-3, nn::AdamW::default())?; // stagehand
    for step in 1..=steps {
        let batch = progression_batch(16, cfg.block_size, cfg.vocab, device);
        let loss = Gpt::loss(&model.logits(&model.blocks.iter().fold(model.embed(&batch.inputs), |x, b| tch::nn::Module::forward(b, &x))), &batch.targets);
        opt.zero_grad()?;
        loss.backward();
        opt.step()?;
        if step % 10 == 0 || step == steps {
            println!("step {step:4}  loss {:.3}", loss.double_value(&[]));
        }
    }
    vs.runtime().finish()?;
    bus.close();
    let m = vs.runtime().last_step_metrics();
    println!("last step: {} evictions, {} prefetch hits, {} misses; telemetry in {out}", m.evictions, m.prefetch_hits, m.prefetch_misses);
    Ok(())
}
