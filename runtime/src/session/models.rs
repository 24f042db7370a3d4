//! Several models on one handle: a trained one and frozen ones (a teacher, a reference policy)
//! under one budget, one pinned pool, one room and one Conductor, and the pool handed to the
//! next handle when a model is done.
//!
//! A model declared with [`Stagehand::model`] is a path prefix: the layers made under it are its
//! blocks. Its blocks join the same weight runtime as the main model's (built on
//! [`Stagehand::root`]), so the memory plan counts them all and Belady's rule sees the step's
//! interleaved itinerary (a teacher's forward, then the student's forward and backward): one
//! room of slots, shared by whichever blocks are used soonest. A frozen model's variables stop
//! requiring gradients when the model first runs; its forward under `tch::no_grad` inside
//! [`Stagehand::train_step`] reads its blocks forward only. Telemetry names each model's blocks
//! (`model_registered`), its device memory and residency (`model_memory`, beside
//! `vram_owners`), and its share of each step's copies (`weight_step.models`).

use super::Stagehand;
use crate::device::HostPool;
use crate::error::{Error, Result};
use crate::events::{EventKind, ModelMemory};
use crate::nn::Path;
use crate::precision::QuantFormat;
use crate::weights::scheduler::ModelEntry;

/// How a model declared on a handle is kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Frozen: no gradients, no optimizer; its forward only (a teacher, a reference model).
    pub frozen: bool,
    /// Its frozen blocks stored quantized on the host, copied at that width and dequantized on
    /// the device just before use ([`crate::weights::quant`]). Only for a frozen model.
    pub quantize: Option<QuantFormat>,
}

impl ModelOptions {
    /// A model that trains with the main one (the handle's one optimizer covers it).
    pub fn trained() -> ModelOptions {
        ModelOptions::default()
    }

    /// A frozen model.
    pub fn frozen() -> ModelOptions {
        ModelOptions { frozen: true, quantize: None }
    }

    /// Its blocks stored quantized in `format`.
    pub fn quantized(mut self, format: QuantFormat) -> ModelOptions {
        self.quantize = Some(format);
        self
    }
}

impl Stagehand {
    /// Declares model `name` on this handle and returns the path to build it on (`root() /
    /// name`): its layers become its blocks, streamed under the handle's one budget beside
    /// every other model's. Declare every model before the first step. A quantized model must
    /// be frozen: trained weights are never quantized.
    ///
    /// ```no_run
    /// # use stagehand::{Stagehand, session::ModelOptions, QuantFormat, nn as snn};
    /// # fn main() -> stagehand::Result<()> {
    /// let sh = Stagehand::builder().budget_mib(8192).build()?;
    /// let teacher = sh.model("teacher", ModelOptions::frozen().quantized(QuantFormat::Int8))?;
    /// let t = snn::linear(&teacher / "blocks" / 0 / "fc", 1024, 1024, Default::default());
    /// let student = snn::linear(&sh.root() / "blocks" / 0 / "fc", 1024, 1024, Default::default());
    /// # Ok(()) }
    /// ```
    pub fn model(&self, name: &str, options: ModelOptions) -> Result<Path<'_>> {
        if options.quantize.is_some() && !options.frozen {
            return Err(Error::Config {
                field: "model",
                value: format!("'{name}' quantized and trained"),
                expected: "a quantized model that is frozen (ModelOptions::frozen().quantized(..)): trained weights are never quantized".into(),
            });
        }
        self.store.table().declare(ModelEntry { name: name.to_owned(), frozen: options.frozen, quantize: options.quantize })?;
        Ok(self.root() / name)
    }

    /// Device memory and residency by model.
    pub fn model_memory(&self) -> Vec<ModelMemory> {
        self.weights().model_memory()
    }

    /// Publishes device memory by model (beside `vram_owners`) when the handle runs several.
    pub(super) fn publish_models(&self) {
        if self.weights().model_entries().len() > 1 {
            self.bus.publish(EventKind::ModelMemory { models: self.model_memory() });
        }
    }

    /// Writes every quantized block's payload (elements, scales, errors; names as the model's
    /// variables) to a safetensors file [`load_quantized`](Self::load_quantized) reads back as
    /// it is, without quantizing again.
    pub fn save_quantized(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.store.table().seal()?;
        self.weights().save_quantized(path)
    }

    /// Loads the quantized models' blocks from a safetensors file before the first step: one
    /// [`save_quantized`](Self::save_quantized) wrote is taken as it is; a full-width one is
    /// quantized as it is read (as [`load_partial`](Self::load_partial) does). Blocks of
    /// models that are not quantized are left as they are. Returns the blocks' reports.
    pub fn load_quantized(&self, path: impl AsRef<std::path::Path>) -> Result<Vec<crate::events::QuantizationReport>> {
        self.store.table().seal()?;
        let rt = self.weights();
        let mut out = Vec::new();
        for b in rt.blocks() {
            if let Some(q) = &b.quant {
                out.push(rt.quantize_from_file(b.id, path.as_ref(), "", q.format)?);
            }
        }
        Ok(out)
    }

    /// The host pool the handle's blocks are cut from.
    pub fn host_pool(&self) -> HostPool {
        self.weights().host_pool()
    }

    /// [`shutdown`](Self::shutdown), handing the pinned host pool on: every block's host copy
    /// and gradient buffers go back to it, and a handle built with
    /// [`StagehandBuilder::host_pool`](super::StagehandBuilder::host_pool) cuts its model's
    /// blocks from the same memory, nothing freed and pinned again (the original's
    /// `shutdown_keep_pool`). The model's values stay in its variables (CPU copies; save a
    /// checkpoint first to keep them on disk); its optimizer is finished.
    pub fn shutdown_keep_pool(&self) -> Result<HostPool> {
        if let Some(r) = &self.run().ready {
            r.conductor.shutdown();
        }
        self.weights().shutdown_keep_pool()
    }
}
