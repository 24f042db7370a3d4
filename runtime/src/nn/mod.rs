//! Layer mode: drop-in replacements for every `tch::nn` layer that holds weights, with tch's
//! constructors, names and conventions. Existing model code changes an import and the line that
//! makes its `VarStore`:
//!
//! ```no_run
//! use stagehand::nn::{self as snn, LayerOptions, ManagedVarStore};
//! use tch::nn::{Module, OptimizerConfig};
//! let vs = ManagedVarStore::new(tch::nn::VarStore::new(tch::Device::Cpu), LayerOptions::default())?;
//! let root = vs.root();
//! let fc = snn::linear(&root / "fc", 784, 10, Default::default());
//! // tch's own constructors take Stagehand paths: this layer norm stays on the device.
//! let ln = tch::nn::layer_norm(&root / "ln", vec![10], Default::default());
//! let mut opt = vs.optimizer(tch::nn::AdamW::default(), 1e-3)?;
//! let x = tch::Tensor::zeros([1, 784], (tch::Kind::Float, vs.device()));
//! opt.backward_step(&ln.forward(&fc.forward(&x)).mean(tch::Kind::Float))?;
//! vs.save("model.safetensors")?; // real values, tch's names; plain tch loads it
//! # Ok::<(), stagehand::Error>(())
//! ```
//!
//! - **Drop-ins** ([`layers`]): `linear`, `conv1d/2d/3d`, `conv_transpose1d/2d/3d`, `embedding`,
//!   `layer_norm`, `group_norm`, `batch_norm1d/2d/3d` (`ModuleT`; the running statistics stay on
//!   the device, where training updates them in place). Each makes the tch layer on the path and
//!   manages its weights.
//! - **Any custom layer** ([`Path::manage`]): the variables a constructor makes on a path (a
//!   linear built with `p.var`, say) become one managed block.
//! - **tch's conventions** ([`Path`]): `Borrow<tch::nn::Path>` so tch's constructors accept
//!   Stagehand paths, groups kept (`set_group`), duplicate names renamed as tch renames them
//!   (`weight__3`), [`Path::device`] the compute device, on which every variable Stagehand does
//!   not manage is placed when the model first runs.
//! - **Values, never placeholders**: between uses a managed variable points at a placeholder
//!   (NaN), so reading a weight goes through [`Managed::run`] (the block resident, for tied
//!   weights), [`Managed::variables`], [`ManagedVarStore::var_store`] (a snapshot), or
//!   [`ManagedVarStore::save`]; a handle of a managed variable kept elsewhere is refused at the
//!   next optimizer step, naming it.
//! - **Layers made later**: a layer made after the model first ran is a block of its own.
//!
//! Layers are grouped into blocks when the model first runs, from the model's repeated structure
//! ([`Grouping::Repeated`]: every layer under `blocks.N` joins block `blocks.N`), so a transformer
//! block streams as one copy, prefetched along the itinerary, exactly as block mode does. Step 1
//! traces the execution order; a step ends by itself when a forward starts after a backward.
//! Saved-tensor hooks go on for the thread on the first forward, so weights autograd saves are
//! handles and eviction frees them.

pub mod layers;
mod managed;
mod path;
pub(crate) mod raise;
mod store;

pub use layers::{
    batch_norm1d, batch_norm2d, batch_norm3d, conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d,
    embedding, group_norm, layer_norm, linear, BatchNorm, Conv1D, Conv2D, Conv3D, ConvTranspose1D, ConvTranspose2D,
    ConvTranspose3D, Embedding, GroupNorm, LayerNorm, Linear,
};
pub use managed::{release_hooks, Managed, ManagedT};
pub use path::Path;
pub use store::ManagedVarStore;
pub(crate) use store::Table;

use crate::events::Bus;
use crate::device::Device;
use std::collections::{BTreeMap, BTreeSet};
use tch::Kind;

/// How layers become blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Grouping {
    /// The model's repeated structure: a layer whose path runs through `<prefix>.<N>` where
    /// `<prefix>` has at least two numbered children joins block `<prefix>.<N>`; every other
    /// layer is a block of its own.
    #[default]
    Repeated,
    /// Every layer is its own block.
    Layer,
    /// The repeated structure, each block split into this many parts of about equal bytes, its
    /// layers kept in the order they were made (a transformer block's attention, MLP up and MLP
    /// down, say). A part frees its device slot as soon as its own layers are done, so at the
    /// step's start and at the forward/backward turn the next load waits for a part's compute,
    /// not a block's. The prefetch window counts parts; the handle scales it by the count.
    Parts(u32),
}

impl Grouping {
    /// Streaming units per repeated block (1 unless [`Grouping::Parts`]).
    pub fn parts(&self) -> u32 {
        match self {
            Grouping::Parts(n) => (*n).max(1),
            _ => 1,
        }
    }
}

/// Layer-mode options.
#[derive(Debug, Clone)]
pub struct LayerOptions {
    /// Device memory cap in bytes; the weights' room is 80 % of it. Default: the device's
    /// memory (the block-mode defaults on the host device).
    pub vram_budget: Option<u64>,
    /// The weights' device room in bytes, when a plan has decided it (overrides `vram_budget`).
    pub weight_room: Option<u64>,
    /// Pinned RAM cap for the staging pool.
    pub ram_budget: Option<u64>,
    /// Lookahead depth (default 3).
    pub prefetch_k: u32,
    /// Storage dtype for managed weights. Default `None`: keep the VarStore's dtype (a cast is
    /// opt-in so an f32 model stays exact).
    pub dtype: Option<Kind>,
    /// What managed weights stream and compute in: under mixed precision (bf16, fp16)
    /// floating weights stream in 16 bits and trained ones keep a float32 master on the host
    /// ([`crate::precision`]). Default fp32: the VarStore's dtypes.
    pub precision: crate::precision::Precision,
    /// Forward only: no backward in the itinerary, no saved-tensor hooks.
    pub inference_mode: bool,
    /// In inference mode, blocks pinned along the forward so that every copy overlaps compute
    /// (default on; [`crate::weights::WeightConfig::cyclic_pins`]).
    pub cyclic_pins: bool,
    /// Where events go (default: nowhere).
    pub telemetry: Bus,
    /// The device (default: CUDA when the VarStore is on CUDA, else the host device, with a
    /// warning when CUDA is available: the VarStore holds the host copies and is usually on the
    /// CPU, so set this to compute on the GPU).
    pub device: Option<Device>,
    /// Turn saved-tensor hooks on for the forward thread (turn off when another store, such as
    /// the activation runtime's, is installed and uses this runtime's resolver).
    pub install_hooks: bool,
    /// How layers become blocks.
    pub grouping: Grouping,
    /// Steps begin and end by themselves (off when something else, such as the `Stagehand`
    /// handle, runs the steps).
    pub auto_step: bool,
    /// Move the variables Stagehand does not manage to the runtime's device when the layers are
    /// registered (off when something else places them: the `Stagehand` handle measures the
    /// device first, for its plan).
    pub place_unmanaged: bool,
}

impl Default for LayerOptions {
    fn default() -> Self {
        LayerOptions {
            vram_budget: None,
            weight_room: None,
            ram_budget: None,
            prefetch_k: crate::weights::config::DEFAULT_PREFETCH_WINDOW,
            dtype: None,
            precision: crate::precision::Precision::Fp32,
            inference_mode: false,
            cyclic_pins: true,
            telemetry: Bus::disabled(),
            device: None,
            install_hooks: true,
            grouping: Grouping::Repeated,
            auto_step: true,
            place_unmanaged: true,
        }
    }
}

/// The block name of each layer path under `grouping`, given each layer's bytes (pure; see
/// [`Grouping`]).
pub fn group_layers(paths: &[String], bytes: &[u64], grouping: &Grouping) -> Vec<String> {
    let blocks = repeated_blocks(paths, grouping);
    match grouping {
        Grouping::Parts(n) if *n > 1 => split_parts(&blocks, bytes, *n),
        _ => blocks,
    }
}

/// Splits every block of several layers into up to `n` parts of about equal bytes: a layer goes
/// to the part its bytes' midpoint falls in, so parts follow the layers' order. A part is named
/// `<block>.part<k>`.
fn split_parts(blocks: &[String], bytes: &[u64], n: u32) -> Vec<String> {
    let mut members: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, name) in blocks.iter().enumerate() {
        members.entry(name).or_default().push(i);
    }
    let mut out = blocks.to_vec();
    for (name, members) in members.into_iter().filter(|(_, m)| m.len() >= 2) {
        let size = |i: usize| bytes.get(i).copied().unwrap_or(0) as f64;
        let total: f64 = members.iter().map(|&i| size(i)).sum();
        let mut before = 0.0;
        for &i in &members {
            let mid = before + size(i) / 2.0;
            before += size(i);
            let k = if total > 0.0 { ((mid / total) * f64::from(n)).floor() as u32 } else { 0 };
            out[i] = format!("{name}.part{}", k.min(n - 1));
        }
    }
    out
}

fn repeated_blocks(paths: &[String], grouping: &Grouping) -> Vec<String> {
    if *grouping == Grouping::Layer {
        return paths.to_vec();
    }
    // Numbered children of every prefix: `blocks` -> {0, 1, ...}.
    let mut children: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for p in paths {
        let parts: Vec<&str> = p.split('.').collect();
        for k in 1..parts.len() {
            if parts[k].parse::<u64>().is_ok() {
                children.entry(parts[..k].join(".")).or_default().insert(parts[k]);
            }
        }
    }
    paths
        .iter()
        .map(|p| {
            let parts: Vec<&str> = p.split('.').collect();
            (1..parts.len())
                .find(|&k| {
                    parts[k].parse::<u64>().is_ok()
                        && children.get(&parts[..k].join(".")).is_some_and(|c| c.len() >= 2)
                        && k + 1 < parts.len()
                })
                .map_or_else(|| p.clone(), |k| parts[..=k].join("."))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn repeated_structure_makes_the_blocks() {
        let paths = names(&[
            "tok",
            "pos",
            "blocks.0.qkv",
            "blocks.0.mlp.fc",
            "blocks.1.qkv",
            "blocks.1.mlp.fc",
            "head",
            "heads.0",
            "single.0.fc",
        ]);
        let bytes = vec![1; paths.len()];
        let got = group_layers(&paths, &bytes, &Grouping::Repeated);
        assert_eq!(
            got,
            names(&["tok", "pos", "blocks.0", "blocks.0", "blocks.1", "blocks.1", "head", "heads.0", "single.0.fc"])
        );
        assert_eq!(group_layers(&paths, &bytes, &Grouping::Layer), paths);
        assert_eq!(group_layers(&paths, &bytes, &Grouping::Parts(1)), got);
    }

    #[test]
    fn parts_split_each_block_by_bytes_in_layer_order() {
        // A GPT block: qkv 3d², proj d², fc 4d², fc_out 4d² make three equal parts.
        let paths = names(&[
            "tok",
            "blocks.0.qkv",
            "blocks.0.proj",
            "blocks.0.fc",
            "blocks.0.fc_out",
            "blocks.1.qkv",
            "blocks.1.proj",
            "blocks.1.fc",
            "blocks.1.fc_out",
            "blocks.2.only",
            "blocks.3.only",
            "head",
        ]);
        let bytes = [50, 3, 1, 4, 4, 3, 1, 4, 4, 7, 7, 50];
        let got = group_layers(&paths, &bytes, &Grouping::Parts(3));
        assert_eq!(
            got,
            names(&[
                "tok",
                "blocks.0.part0",
                "blocks.0.part0",
                "blocks.0.part1",
                "blocks.0.part2",
                "blocks.1.part0",
                "blocks.1.part0",
                "blocks.1.part1",
                "blocks.1.part2",
                "blocks.2",
                "blocks.3",
                "head",
            ])
        );
        // More parts than layers: one layer a part, never an index past the count.
        let eight = group_layers(&paths, &bytes, &Grouping::Parts(8));
        assert_eq!(eight[1..5], names(&["blocks.0.part1", "blocks.0.part2", "blocks.0.part4", "blocks.0.part6"]));
        assert_eq!(Grouping::Parts(0).parts(), 1);
        assert_eq!(Grouping::Repeated.parts(), 1);
    }
}
