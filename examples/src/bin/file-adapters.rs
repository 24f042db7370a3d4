//! Frozen-weight (adapter-style) fine-tuning with file-backed weights, in block mode.
//!
//! A stack of frozen MLP blocks is written to a safetensors file; block mode then streams each
//! block's weights from that file through the pinned pool (eviction simply drops them, the file
//! is the canonical copy), while a small trainable low-rank adapter per block stays resident and
//! trains with plain AdamW.
//!
//! Run: `cargo run --release -p stagehand-examples --bin file-adapters -- 100 [--full-check]`

use clap::Parser;
use stagehand::device::Device;
use stagehand::events::Bus;
use stagehand::weights::file::FileCheck;
use stagehand::weights::{WeightConfig, WeightRuntime};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};

const BLOCKS: i64 = 8;
const D: i64 = 256;
const RANK: i64 = 8;

/// Frozen base blocks streamed from a safetensors file, trainable low-rank adapters.
#[derive(Parser)]
struct Args {
    /// Training steps.
    #[arg(default_value_t = 100)]
    steps: u64,
    /// Check every byte of the weights file at every load (default: sampled windows; see
    /// `WeightConfig::file_check`).
    #[arg(long)]
    full_check: bool,
}

fn main() -> anyhow::Result<()> {
    let Args { steps, full_check } = Args::parse();
    stagehand::torch::init();
    let device = Device::auto(1 << 30);
    let dev = device.tch_device();
    tch::manual_seed(0);

    // The frozen base model, in host memory, written once to a safetensors file.
    let base = nn::VarStore::new(tch::Device::Cpu);
    let blocks: Vec<(nn::Linear, nn::Linear)> = (0..BLOCKS)
        .map(|i| {
            let p = base.root() / "blocks" / i;
            (nn::linear(&p / "up", D, 4 * D, Default::default()), nn::linear(&p / "down", 4 * D, D, Default::default()))
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("stagehand-adapter-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("base.safetensors");
    let named: Vec<(String, Tensor)> = base.variables().into_iter().collect();
    Tensor::write_safetensors(&named, &file)?;
    let mut base = base;
    base.freeze();

    // Block mode: blocks named by a pattern over the VarStore paths, streamed from the file.
    let block_bytes = (2 * 4 * D * D + 5 * D) as u64 * 4;
    let cfg = WeightConfig::builder()
        .pool(8 * block_bytes.next_power_of_two(), block_bytes.next_power_of_two())
        .watermarks(1 << 40, 1 << 39)
        .weight_budget(3 * block_bytes)
        .prefetch_window(2)
        .file_check(if full_check { FileCheck::Full } else { FileCheck::Sampled })
        .build()?;
    let rt = WeightRuntime::from_var_store(&base, r"^blocks\.\d+$", device.clone(), cfg, Bus::disabled())?;
    let ids: Vec<_> = (0..BLOCKS).map(|i| rt.block_id(&format!("blocks.{i}"))).collect::<Result<_, _>>()?;
    for id in &ids {
        rt.back_with_file(*id, &file, "")?;
    }

    // The trainable adapters: resident, small.
    let adapters = nn::VarStore::new(dev);
    let lora: Vec<(nn::Linear, nn::Linear)> = (0..BLOCKS)
        .map(|i| {
            let p = adapters.root() / "lora" / i;
            let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
            let b = nn::linear(&p / "b", RANK, D, nn::LinearConfig { ws_init: nn::Init::Const(0.0), bias: false, ..Default::default() });
            (nn::linear(&p / "a", D, RANK, no_bias), b)
        })
        .collect();
    let mut opt = nn::AdamW::default().build(&adapters, 1e-2)?;

    // A task the frozen base cannot do alone: map x to a fixed rotation of x.
    let target_map = Tensor::randn([D, D], (Kind::Float, dev)) / (D as f64).sqrt();
    let (mut first, mut last) = (None, 0.0);
    for step in 1..=steps {
        let x = Tensor::randn([32, D], (Kind::Float, dev));
        let y = x.matmul(&target_map);
        rt.begin_step()?;
        let out = {
            let _hooks = rt.hooks()?;
            let mut h = x.shallow_clone();
            for ((id, (up, down)), (a, b)) in ids.iter().zip(&blocks).zip(&lora) {
                let frozen = rt.run_block(*id, || down.forward(&up.forward(&h).gelu("none")))?;
                h = &h + frozen * 0.1 + b.forward(&a.forward(&h));
            }
            h
        };
        let loss = out.mse_loss(&y, tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        opt.step();
        rt.end_step()?;
        let l = loss.double_value(&[]);
        first.get_or_insert(l);
        last = l;
        if step % 20 == 0 || step == steps {
            let m = rt.last_step_metrics();
            println!(
                "step {step:4}  loss {l:.4}  h2d {:.1} MiB  evictions {}  pool in use {}",
                m.h2d_bytes as f64 / 1048576.0,
                m.evictions,
                m.host_pool_in_use
            );
        }
    }
    rt.shutdown()?;
    std::fs::remove_dir_all(&dir)?;
    println!("loss {:.4} -> {last:.4}; the base never left its file, only adapters trained", first.unwrap_or(f64::NAN));
    Ok(())
}
