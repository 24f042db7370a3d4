//! Frozen blocks stored quantized after registration (block mode): from their host copy or
//! their file, from a safetensors file (quantized as it is read, or already quantized), and
//! saved as a quantized file. A handle's models declared quantized are quantized as their blocks
//! are registered (`Scheduler::register_in`).

use super::super::block::{quantizable, QuantCopy, Source};
use super::super::quant::file::{self, Saved};
use super::super::quant::QuantFormat;
use super::Scheduler;
use crate::error::{Error, Result};
use crate::events::{BlockId, BlockState, EventKind, QuantizationReport};
use std::path::Path;

impl Scheduler {
    /// Checks that `id` may be quantized now: off the device, not kept resident, the room not
    /// made yet or the block no larger than its slots (a quantized block takes the same device
    /// bytes).
    fn quantizable_now(&self, id: BlockId) -> Result<()> {
        self.check_live()?;
        let b = self.block(id)?;
        if self.residency.state(id)? != BlockState::Unloaded || b.placement.is_some() {
            return Err(Error::misuse(
                format!("quantizing block '{}' while it is on the device", b.spec.name),
                "a block off the device: quantize before the first step",
            ));
        }
        Ok(())
    }

    /// Stores frozen block `id` quantized in `format` from its canonical values (its host copy or
    /// its file); publishes and returns its report.
    pub(crate) fn quantize(&mut self, id: BlockId, format: QuantFormat) -> Result<QuantizationReport> {
        self.quantizable_now(id)?;
        let pool = self.pool.clone();
        self.blocks[id.0 as usize].quantize(format, &pool)?;
        self.published_report(id)
    }

    /// Stores frozen block `id` quantized from the safetensors file at `path`, its parameter
    /// `name` read from `key_prefix + name`: an already quantized file (written by
    /// [`save_quantized`](Self::save_quantized)) is taken as it is, in its own format; a
    /// full-width one is quantized in `format` as it is read. A block quantized already takes
    /// the file's values in its own format.
    pub(crate) fn quantize_from_file(&mut self, id: BlockId, path: &Path, key_prefix: &str, format: QuantFormat) -> Result<QuantizationReport> {
        self.quantizable_now(id)?;
        let src = file::Source::open(path)?;
        let b = &self.blocks[id.0 as usize];
        if b.trainable() {
            return Err(Error::Config {
                field: "quantize",
                value: format!("block '{}', which trains", b.spec.name),
                expected: "a frozen block: trained weights are never quantized".into(),
            });
        }
        if let (Some(layout), Source::Quantized(_)) = (&b.spec.quant, &b.source) {
            // Quantized already (a model declared quantized): the file's values replace its
            // payload, in the same format and groups.
            let (f, g) = src.format().unwrap_or((layout.format, layout.group));
            if (f, g) != (layout.format, layout.group) {
                return Err(Error::Config {
                    field: "quantize_from_file",
                    value: format!("{} in groups of {g} for block '{}'", f, b.spec.name),
                    expected: format!("the block's own {} in groups of {}", layout.format, layout.group),
                });
            }
            return self.refill(id, &src, key_prefix);
        }
        if b.spec.quant.is_some() {
            return Err(Error::misuse(format!("quantizing block '{}' again", b.spec.name), "a block quantized once"));
        }
        let format = src.format().map_or(format, |(f, _)| f);
        let mut layout = quantizable(&b.spec, format)?;
        if let Some((f, g)) = src.format() {
            if g != layout.group {
                layout = super::super::quant::QuantLayout::new(&b.spec, f, g).ok_or_else(|| Error::internal("a layout for the file's group"))?;
            }
        }
        let mut spec = b.spec.clone();
        spec.quant = Some(layout.clone());
        let buf = self.pool.alloc(layout.bytes)?;
        let views = super::super::quant::payload_views(&spec, &layout, &buf)?;
        let mut errors = Vec::with_capacity(views.len());
        for (i, v) in views.iter().enumerate() {
            let key = format!("{key_prefix}{}", spec.params[i].name);
            errors.push(src.fill(&spec, &layout, i, &key, v)?);
        }
        let b = &mut self.blocks[id.0 as usize];
        b.spec = spec;
        b.source = Source::Quantized(QuantCopy { views, errors, buf: std::sync::Arc::new(buf) });
        self.published_report(id)
    }

    /// Writes a quantized block's payload again from `src` (every parameter checked and
    /// written into a new payload first, so a file that fails leaves the block as it was).
    fn refill(&mut self, id: BlockId, src: &file::Source, key_prefix: &str) -> Result<QuantizationReport> {
        self.loads.reap(&self.loader);
        let spec = self.blocks[id.0 as usize].spec.clone();
        let layout = spec.quant.clone().ok_or_else(|| Error::internal("refilling a block that is not quantized"))?;
        let buf = self.pool.alloc(layout.bytes)?;
        let views = super::super::quant::payload_views(&spec, &layout, &buf)?;
        let mut errors = Vec::with_capacity(views.len());
        for (i, v) in views.iter().enumerate() {
            let key = format!("{key_prefix}{}", spec.params[i].name);
            errors.push(src.fill(&spec, &layout, i, &key, v)?);
        }
        // The old payload goes back to the pool once no copy reads it (a load still in flight
        // keeps its own clone until it completes).
        self.blocks[id.0 as usize].source = Source::Quantized(QuantCopy { views, errors, buf: std::sync::Arc::new(buf) });
        self.published_report(id)
    }

    /// Publishes block `id`'s quantization report and returns it.
    pub(super) fn published_report(&self, id: BlockId) -> Result<QuantizationReport> {
        let r = self.block(id)?.report().ok_or_else(|| Error::internal(format!("block {id} is not quantized")))?;
        self.bus.publish(EventKind::Quantized(r.clone()));
        Ok(r)
    }

    /// Every quantized block's report, in block order.
    pub(crate) fn quantization_reports(&self) -> Vec<QuantizationReport> {
        self.blocks.iter().filter_map(|b| b.report()).collect()
    }

    /// Writes every quantized block's payload to `path` (see [`file`]).
    pub(crate) fn save_quantized(&self, path: &Path) -> Result<()> {
        let saved: Vec<Saved<'_>> = self
            .blocks
            .iter()
            .filter_map(|b| match &b.source {
                Source::Quantized(q) => Some(Saved { spec: &b.spec, views: &q.views, errors: &q.errors }),
                _ => None,
            })
            .collect();
        file::save(path, &saved)
    }
}
