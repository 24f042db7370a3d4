//! Data-parallel training of the demo's GPT over the GPUs of one host: one rank a GPU, each on its
//! slice of the same global batches, one host copy of the model.

use super::{micro, Hooks, Summary, TrainConfig};
use crate::data::progression_batch;
use crate::gpt::{Gpt, StreamedLayers};
use anyhow::Result;
use stagehand::device::Device;
use stagehand::events::Bus;
use std::sync::atomic::Ordering;
use tch::nn;

/// One GPU's record of a data-parallel run ([`train_group`]).
#[derive(Debug, Clone)]
pub struct RankSummary {
    pub rank: usize,
    /// Its device's index.
    pub device: u32,
    /// Its steps: the group's loss (every rank reports the same), its own step times, time
    /// breakdowns and peaks, its plan.
    pub summary: Summary,
    /// Its weight runtime's figures of each step: the copies (H2D weights, D2H gradient
    /// shards) and its gradient reductions' time on the device (`collective_ms`).
    pub weights: Vec<stagehand::events::WeightStepMetrics>,
    /// Host bytes its plan counts: pinned weights (rank 0: the one copy) and gradient shards,
    /// optimizer state, float32 masters.
    pub plan_host_bytes: u64,
}

/// The global batches of a data-parallel run, each drawn once, in step order, from the
/// process's generator (as one device's loop draws them), and shared by the ranks, each of
/// which trains on its slice.
struct SharedBatches {
    world: usize,
    cfg: (i64, i64, i64),
    /// By step: the batch and how many ranks took it.
    drawn: std::sync::Mutex<std::collections::BTreeMap<u64, (crate::data::Batch, usize)>>,
}

impl SharedBatches {
    fn take(&self, step: u64) -> crate::data::Batch {
        let mut d = self.drawn.lock().unwrap_or_else(|p| p.into_inner());
        let (batch, block, vocab) = self.cfg;
        let e = d.entry(step).or_insert_with(|| (progression_batch(batch, block, vocab, tch::Device::Cpu), 0));
        e.1 += 1;
        let out = crate::data::Batch { inputs: e.0.inputs.shallow_clone(), targets: e.0.targets.shallow_clone() };
        if e.1 == self.world {
            d.remove(&step);
        }
        out
    }
}

/// Trains the GPT data parallel over `devices` (one rank each, the budget each device's) on
/// the global batch `cfg.batch`, each rank on its slice: the steps one device trains with
/// [`train_with`] over the same batches (drawn from the same generator). `on_step(rank, step,
/// loss, seconds)` runs on each rank's thread after its steps; `hooks.on_plan` gets rank 0's
/// plan; `hooks.stop` ends every rank after the same step (the ranks decide together). Each
/// rank's host optimizer takes its share of `cfg.thread_count()`. Returns each rank's record.
pub fn train_group(
    cfg: &TrainConfig,
    devices: Vec<Device>,
    bus: &Bus,
    on_step: impl Fn(usize, u64, f64, f64) + Sync,
    hooks: Hooks<'_>,
    customize: impl FnOnce(stagehand::StagehandBuilder) -> stagehand::StagehandBuilder,
) -> Result<Vec<RankSummary>> {
    let world = devices.len();
    anyhow::ensure!(world > 0, "a group of no devices");
    cfg.check(world)?;
    tch::set_num_threads(cfg.thread_count() as i32);
    let group = customize(cfg.builder(bus, (cfg.thread_count() / world).max(1)).devices(devices)).build_group()?;
    let batches = SharedBatches {
        world,
        cfg: (cfg.batch, cfg.model.block_size, cfg.model.vocab),
        drawn: std::sync::Mutex::new(Default::default()),
    };
    let Hooks { on_plan, stop } = hooks;
    let on_plan = std::sync::Mutex::new(on_plan);
    // As one device's loop: seeded before the model is built (rank 0's build draws what one
    // device's would; the group puts the generator back after the other ranks').
    tch::manual_seed(cfg.seed);
    let model_cfg = cfg.model;
    let tokens = cfg.tokens() / world as u64;
    let ranks = group.run(
        |sh| Gpt::new(&StreamedLayers(sh.store()), model_cfg),
        |sh, model| -> Result<RankSummary> {
            sh.set_tokens_per_step(tokens);
            let mut opt = sh.optimizer(nn::AdamW::default(), cfg.learning_rate)?;
            let plan = sh.prepare()?;
            if sh.rank() == 0 {
                if let Some(f) = on_plan.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                    f(&plan);
                }
            }
            let mut s = Summary::default();
            let mut weights = Vec::new();
            for step in 1..=cfg.steps {
                // Every rank stops after the same step, or none does.
                if sh.any_rank(stop.is_some_and(|s| s.load(Ordering::SeqCst)))? {
                    s.stopped = true;
                    break;
                }
                let batch = batches.take(step);
                let (x, y) = (sh.shard(&batch.inputs)?, sh.shard(&batch.targets)?);
                let n = cfg.micro_batches;
                let r = sh.train_step_micro(&mut opt, n, |i| Gpt::loss(&tch::nn::Module::forward(&*model, &micro(&x, i, n)), &micro(&y, i, n)))?;
                s.record(sh, &opt, step, &r);
                weights.push(sh.weights().last_step_metrics());
                on_step(sh.rank(), step, r.loss, r.step_ms / 1e3);
            }
            opt.wait()?;
            s.close(sh)?;
            let plan_host_bytes = s.plan.as_ref().map_or(0, |p| p.pinned_bytes + p.optimizer_state_bytes + p.master_bytes);
            Ok(RankSummary { rank: sh.rank(), device: sh.device().info().index, summary: s, weights, plan_host_bytes })
        },
    )?;
    group.flush();
    Ok(ranks)
}

