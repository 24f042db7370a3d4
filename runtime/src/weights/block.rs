//! One managed block: the model's variables, the canonical copy of their values (host memory or
//! a safetensors file), where the block is on the device, and for trainable streamed blocks the
//! host buffers their gradients land in.
//!
//! Between uses a streamed block's variables point at a placeholder (their shape, every stride 0,
//! one element), so reading them outside a forward never sees stale device memory; the weight
//! runtime materialises real values on request.

use super::file::FileSource;
use super::quant::{self, ErrorSums, QuantLayout};
use super::registry::{param_tensor, BlockSpec, ParamSpec};
use crate::device::{Device, HostBuffer, HostPool};
use crate::error::{Error, Result};
use crate::events::QuantizationReport;
use crate::precision::{QuantFormat, QUANT_GROUP};
use std::sync::Arc;
use tch::{COptimizer, Kind, Tensor};

/// The canonical host copy of a block: one buffer (pinned on CUDA) in the block's layout and a
/// CPU tensor viewing each parameter in it. Copies to the device read the buffer through an
/// `Arc` clone, so `Arc::strong_count(&buf) == 1` proves no copy reads it: only then may the
/// host optimizer write it. Field order matters: the views drop before the buffer.
///
/// A parameter streamed in 16 bits that trains ([`ParamSpec::has_master`]) also has a float32
/// **master**, an ordinary CPU tensor: the optimizer updates the master and writes its 16-bit
/// rounding into the view, so 16-bit weights are never updated in 16 bits.
pub(crate) struct HostCopy {
    pub views: Vec<Tensor>,
    pub masters: Vec<Option<Tensor>>,
    pub buf: Arc<HostBuffer>,
}

impl HostCopy {
    /// A new host copy of `params` in `spec`'s layout (pinned on CUDA), with a float32 master
    /// for each trained 16-bit parameter.
    fn of(spec: &BlockSpec, params: &[(String, Tensor)], pool: &HostPool) -> Result<HostCopy> {
        let buf = pool.alloc(spec.bytes)?;
        let mut views = Vec::with_capacity(params.len());
        let mut masters = Vec::with_capacity(params.len());
        for (p, (_, var)) in spec.params.iter().zip(params) {
            let mut view = host_view(&buf, p)?;
            // Rounded to the view's dtype (to nearest, libtorch's rule) where it differs.
            tch::no_grad(|| view.f_copy_(var))?;
            views.push(view);
            masters.push(if p.has_master() { Some(master_of(var)?) } else { None });
        }
        Ok(HostCopy { views, masters, buf: Arc::new(buf) })
    }

    /// The same copy, for another rank of a data-parallel group (one host copy for all: the
    /// buffer is shared, the views and masters are handles of the same memory).
    pub(crate) fn share(&self) -> HostCopy {
        HostCopy {
            views: self.views.iter().map(Tensor::shallow_clone).collect(),
            masters: self.masters.iter().map(|m| m.as_ref().map(Tensor::shallow_clone)).collect(),
            buf: self.buf.clone(),
        }
    }
}

/// A frozen block's quantized payload on the host (see [`super::quant`]): one buffer (pinned on
/// CUDA) in the layout's order, each parameter's views in it (its elements and scales, or its
/// full-width tensor), and each parameter's quantization error. Loads read the buffer through
/// an `Arc` clone, as a host copy's. Field order: the views drop before the buffer.
pub(crate) struct QuantCopy {
    pub views: Vec<(Tensor, Option<Tensor>)>,
    pub errors: Vec<ErrorSums>,
    pub buf: Arc<HostBuffer>,
}

/// Where a block's canonical values live.
pub(crate) enum Source {
    Host(HostCopy),
    File(FileSource),
    /// Frozen and quantized: the payload the device dequantizes.
    Quantized(QuantCopy),
    /// Given back to the pool at a shutdown that keeps it (the variables hold CPU copies).
    Released,
}

/// Where a block is on the device while it is there.
#[derive(Debug)]
pub(crate) enum Placement {
    /// In slot `i` of the streaming room.
    Slot(usize),
    /// In its own device buffer, for good (a block the plan keeps resident).
    Own(Tensor),
}

/// The host gradient of one trainable parameter: a buffer (pinned on CUDA) the device gradient
/// is copied into, and a CPU view of it for the optimizer. While a copy into it flies, the
/// buffer is owned by the copy (`buf` is `None`).
pub(crate) struct ParamGrad {
    pub param: usize,
    pub view: Tensor,
    pub buf: Option<HostBuffer>,
    /// A gradient arrived in the current accumulation window (cleared by `zero_grad`).
    pub received: bool,
}

/// One managed block.
pub(crate) struct Block {
    pub spec: BlockSpec,
    /// The block's name, shared with the activation store's regions.
    pub name: Arc<str>,
    /// The model's variables (shared TensorImpls: `set_data` re-points every handle).
    pub vars: Vec<Tensor>,
    /// What each variable points at while the block is off the device, made once at
    /// registration: an eviction re-points the variables without allocating or launching a
    /// kernel (one per parameter per eviction otherwise, on the training thread).
    placeholders: Vec<Tensor>,
    pub source: Source,
    /// Where it is on the device (`None` while unloaded or landing).
    pub placement: Option<Placement>,
    /// Kept on the device for good: never evicted, trained on the device.
    pub resident: bool,
    /// Recorded on the compute stream right after the kernels of the block's latest use were
    /// queued: its slot may be refilled once this completes (not everything queued since).
    pub last_use: Option<crate::device::StreamEvent>,
    /// Host gradients of trainable parameters (streamed trainable blocks). In a data-parallel
    /// group each one views its piece of `shard` and has no buffer of its own.
    pub grads: Vec<ParamGrad>,
    /// A data-parallel rank's shard of the reduced gradients (see `super::shard`).
    pub shard: Option<super::shard::ShardGrad>,
    /// Sets the device gradients of the trainable parameters to none (libtorch's
    /// `zero_grad(set_to_none)`), so flushed gradients free their memory at once.
    pub grad_release: Option<COptimizer>,
    /// The model it belongs to (an index into the runtime's model names; 0: the main model).
    pub model: u32,
}

impl Block {
    /// A module-backed block: copies `params` into a new host buffer cut from `pool` (quantized
    /// when `spec` has a quantized layout: the block is frozen) and leaves the variables
    /// pointing at placeholders on `device` until the block is first needed.
    pub(crate) fn from_module(spec: BlockSpec, params: Vec<(String, Tensor)>, device: &Device, pool: &HostPool) -> Result<Block> {
        Block::make(spec, params, device, pool, None, None)
    }

    /// A block of rank `rank` of a data-parallel group of `world`: the host copy `shared` (rank
    /// 0's, which every rank streams from) or a new one (rank 0), and for its trained parameters
    /// a pinned buffer for this rank's shard of their reduced gradients alone.
    pub(crate) fn for_rank(
        spec: BlockSpec,
        params: Vec<(String, Tensor)>,
        device: &Device,
        pool: &HostPool,
        shared: Option<HostCopy>,
        (rank, world): (usize, usize),
    ) -> Result<Block> {
        let shard = super::shard::ShardLayout::new(&spec, rank, world)?;
        Block::make(spec, params, device, pool, shared, shard)
    }

    fn make(
        spec: BlockSpec,
        params: Vec<(String, Tensor)>,
        device: &Device,
        pool: &HostPool,
        shared: Option<HostCopy>,
        shard: Option<super::shard::ShardLayout>,
    ) -> Result<Block> {
        let source = match (&spec.quant, shared) {
            (_, Some(h)) => Source::Host(h),
            (Some(layout), None) => Source::Quantized(QuantCopy::fill(&spec, layout, pool, |i| Ok(params[i].1.shallow_clone()))?),
            (None, None) => Source::Host(HostCopy::of(&spec, &params, pool)?),
        };
        let shard = shard.map(|l| super::shard::ShardGrad::new(l, device)).transpose()?;
        let mut grads = Vec::new();
        let mut grad_release = None;
        for (i, (p, (_, var))) in spec.params.iter().zip(&params).enumerate() {
            if !p.trainable {
                continue;
            }
            let (view, buf) = match &shard {
                Some(s) => (s.piece_view(i)?, None),
                None => {
                    let gbuf = pool.alloc(p.bytes.max(1))?;
                    (param_tensor(&gbuf, 0, &p.shape, p.kind)?, Some(gbuf))
                }
            };
            grads.push(ParamGrad {
                param: i,
                view,
                buf,
                received: false,
            });
            let opt = match &mut grad_release {
                Some(o) => o,
                None => grad_release.insert(COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?),
            };
            opt.add_parameters(var, 0)?;
        }
        let dev = device.tch_device();
        let mut vars = Vec::with_capacity(params.len());
        let mut placeholders = Vec::with_capacity(params.len());
        for (p, (_, mut var)) in spec.params.iter().zip(params) {
            let ph = placeholder(p.kind, &p.shape, dev)?;
            var.set_data(&ph);
            vars.push(var);
            placeholders.push(ph);
        }
        Ok(Block {
            name: Arc::from(spec.name.as_str()),
            spec,
            vars,
            placeholders,
            source,
            placement: None,
            resident: false,
            last_use: None,
            grads,
            shard,
            grad_release,
            model: 0,
        })
    }

    /// Stores this frozen block quantized in `format` from its canonical values (its host copy
    /// or its file), in a payload cut from `pool`; the full-width host copy goes back to the
    /// pool. The block must be off the device. An error when it trains (trained weights are
    /// never quantized) or holds nothing worth quantizing.
    pub(crate) fn quantize(&mut self, format: QuantFormat, pool: &HostPool) -> Result<()> {
        if self.trainable() {
            let trained: Vec<&str> = self.spec.params.iter().filter(|p| p.trainable).map(|p| p.name.as_str()).collect();
            return Err(Error::Config {
                field: "quantize",
                value: format!("block '{}', whose {} train", self.spec.name, trained.join(", ")),
                expected: "a frozen block: trained weights are never quantized (freeze them, or quantize a frozen model)".into(),
            });
        }
        if self.spec.quant.is_some() {
            return Err(Error::misuse(format!("quantizing block '{}' again", self.spec.name), "a block quantized once"));
        }
        let layout = quantizable(&self.spec, format)?;
        let mut spec = self.spec.clone();
        spec.quant = Some(layout.clone());
        let copy = QuantCopy::fill(&spec, &layout, pool, |i| self.value(i))?;
        self.spec = spec;
        self.source = Source::Quantized(copy);
        Ok(())
    }

    /// What quantizing the block did, when it is quantized.
    pub(crate) fn report(&self) -> Option<QuantizationReport> {
        let (Some(layout), Source::Quantized(q)) = (&self.spec.quant, &self.source) else { return None };
        let mut total = ErrorSums::default();
        for e in &q.errors {
            total.add(e);
        }
        Some(QuantizationReport {
            block: self.spec.id,
            name: self.spec.name.clone(),
            format: layout.format,
            group: layout.group as u32,
            quantized_params: layout.quantized_params() as u32,
            params: self.spec.params.len() as u32,
            full_bytes: self.spec.bytes as u64,
            quantized_bytes: layout.bytes as u64,
            max_rel_error: total.max_rel,
            mean_rel_error: total.mean_rel(),
        })
    }

    /// Whether any parameter is trainable.
    pub(crate) fn trainable(&self) -> bool {
        self.spec.trainable()
    }

    /// Points every variable at its slice of `buf` (the block's device bytes).
    pub(crate) fn point_at(&mut self, buf: &Tensor) -> Result<()> {
        for (i, p) in self.spec.params.iter().enumerate() {
            let v = device_view(buf, p)?;
            self.vars[i].set_data(&v);
        }
        Ok(())
    }

    /// Points every variable back at its placeholder. What a write into an evicted variable
    /// changes is the placeholder, never the parameter: the next load points the variable at
    /// the host copy's bytes again.
    pub(crate) fn point_away(&mut self) {
        for (var, ph) in self.vars.iter_mut().zip(&self.placeholders) {
            var.set_data(ph);
        }
    }

    /// The canonical value of parameter `i`, sharing memory where it can: a resident block on
    /// the device trains there, so its device variable; a streamed block's host copy (never the
    /// placeholder or a slot, which may be stale or reused); a file-backed block's file (read).
    pub(crate) fn value(&self, i: usize) -> Result<Tensor> {
        let p = self
            .spec
            .params
            .get(i)
            .ok_or_else(|| Error::UnknownBlock(format!("{} parameter {i}", self.spec.name)))?;
        if matches!(self.placement, Some(Placement::Own(_))) {
            return declared(self.vars[i].detach(), p);
        }
        match &self.source {
            Source::Host(h) => match &h.masters[i] {
                Some(m) => declared(m.detach(), p),
                None => declared(h.views[i].detach(), p),
            },
            Source::File(f) => declared(f.read_param(i, p)?, p),
            Source::Quantized(q) => {
                let layout = self.spec.quant.as_ref().ok_or_else(|| Error::internal("a quantized block without its layout"))?;
                let (data, scales) = &q.views[i];
                declared(quant::param_value(p, layout, data, scales.as_ref())?, p)
            }
            Source::Released => Err(Error::Shutdown("weight runtime (its host memory went back to the pool)")),
        }
    }

    /// The canonical value of parameter `i` as a fresh CPU tensor.
    pub(crate) fn host_param(&self, i: usize) -> Result<Tensor> {
        let v = self.value(i)?;
        let out = Tensor::f_empty(v.size().as_slice(), (v.kind(), tch::Device::Cpu))?;
        tch::no_grad(|| out.detach().f_copy_(&v))?;
        Ok(out)
    }
}

impl QuantCopy {
    /// A payload for `spec` (laid out as `layout`) cut from `pool`, each parameter written from
    /// `value(i)` (quantized where the layout says).
    pub(crate) fn fill(spec: &BlockSpec, layout: &QuantLayout, pool: &HostPool, value: impl Fn(usize) -> Result<Tensor>) -> Result<QuantCopy> {
        let buf = pool.alloc(layout.bytes)?;
        let views = quant::payload_views(spec, layout, &buf)?;
        let mut errors = Vec::with_capacity(views.len());
        for (i, v) in views.iter().enumerate() {
            errors.push(quant::write_param(spec, layout, i, &value(i)?, v)?);
        }
        Ok(QuantCopy { views, errors, buf: Arc::new(buf) })
    }
}

/// The quantized layout of `spec` in `format`, or an error saying why there is none.
pub(crate) fn quantizable(spec: &BlockSpec, format: QuantFormat) -> Result<QuantLayout> {
    QuantLayout::new(spec, format, QUANT_GROUP).ok_or_else(|| Error::Config {
        field: "quantize",
        value: format!("block '{}'", spec.name),
        expected: format!(
            "a block with a floating parameter of two or more dimensions and at least {QUANT_GROUP} elements, smaller once quantized (vectors and integers stay at full width)"
        ),
    })
}

/// `t` in the parameter's declared dtype (a conversion only where its copy is in another).
fn declared(t: Tensor, p: &ParamSpec) -> Result<Tensor> {
    if t.kind() == p.declared {
        Ok(t)
    } else {
        Ok(t.f_to_kind(p.declared)?)
    }
}

/// A float32 copy of a variable's value, detached from it (the variable is re-pointed at a
/// placeholder afterwards, so the copy must not share its memory).
fn master_of(var: &Tensor) -> Result<Tensor> {
    let m = Tensor::f_empty(var.size().as_slice(), (Kind::Float, tch::Device::Cpu))?;
    tch::no_grad(|| m.detach().f_copy_(var))?;
    Ok(m)
}

fn host_view(buf: &HostBuffer, p: &ParamSpec) -> Result<Tensor> {
    param_tensor(buf, p.offset, &p.shape, p.kind)
}

/// Parameter `p`'s view of a block's flat device bytes.
pub(crate) fn device_view(buf: &Tensor, p: &ParamSpec) -> Result<Tensor> {
    let t = buf.f_narrow(0, p.offset as i64, p.bytes as i64)?;
    let t = t.f_view_dtype(p.kind)?;
    Ok(t.f_view(p.shape.as_slice())?)
}

/// What an evicted parameter points at: its full shape with every stride 0 over one element.
/// Keeping the shape matters: autograd's gradient accumulation may still run for a parameter
/// whose block is evicted (an embedding's weight is never read in backward), and it lays the new
/// gradient out after the parameter; an expanded tensor is not dense, so libtorch keeps a
/// contiguous gradient, which the next flush moves to the host.
///
/// The element is NaN (zero for integer kinds): anything that reads a placeholder (a handle of
/// the variable used outside its layer, which the step boundaries refuse when it is kept)
/// computes NaN, never a plausible result from zeros.
pub(crate) fn placeholder(kind: Kind, shape: &[i64], dev: tch::Device) -> Result<Tensor> {
    let one = match kind {
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double => Tensor::f_full([1], f64::NAN, (kind, dev))?,
        _ => Tensor::f_zeros([1], (kind, dev))?,
    };
    let t = one.f_view(vec![1i64; shape.len()].as_slice())?;
    Ok(t.f_expand(shape, false)?)
}

