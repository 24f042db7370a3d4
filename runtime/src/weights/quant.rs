//! Quantized frozen blocks: the layout of a block's quantized payload, quantizing values into
//! it, and dequantizing it on the device in the block's own slot.
//!
//! A frozen block stored quantized keeps one **payload** on the host: each parameter worth
//! quantizing (floating, at least two dimensions, at least one group, smaller once quantized) as
//! 8-bit elements ([`QuantFormat`]) in groups of [`QUANT_GROUP`] consecutive elements with a
//! float32 scale each, the others (vectors, integers, tensors smaller than a group) as they are
//! in the block's dtype. A load copies the payload alone, so PCIe moves about half a bf16
//! block's bytes (a quarter of a float32 one).
//!
//! **Where it is dequantized.** A slot holds the block at full width in its compute dtype, as
//! for any block: the payload lands at the end of the block's own device bytes, and just before
//! the block is used (when the compute stream has waited for the copy) it is dequantized in
//! place, front to back, into the parameters' full-width views. No second copy of the block is
//! held: a slot is the block's size whether it is quantized or not, so a room holds as many
//! quantized blocks as full-width ones. Writing full-width values overtakes the payload they are
//! read from (two bytes written for each byte read, in bf16), so the dequantization runs in
//! chunks ([`DequantOp`]), each writing only below the first payload byte not read yet; the gap
//! halves with every chunk, and once a chunk would be under [`MIN_CHUNK_BYTES`] the payload
//! still unread (about that much) is first copied to a **stash**, a small device buffer the
//! last chunks read from. The plan counts the largest stash. The chunk plan is computed once
//! per block (`plan`) and checked by a test that simulates every byte.
//!
//! Dequantization computes `q * scale` in float32 and rounds it to the compute dtype (to
//! nearest), the same on the host (a checkpoint's values) and on the device, so a model
//! trained over a quantized base computes exactly what it would over the dequantized values.

pub use super::payload::{DequantOp, QuantLayout, QuantParam};
use super::registry::{param_tensor, BlockSpec, ParamSpec, PARAM_ALIGNMENT};
use crate::error::{Error, Result};
pub use crate::precision::{QuantFormat, QUANT_GROUP};
use tch::{Kind, Tensor};

/// The smallest chunk dequantized in place, in bytes written: below it the rest of the payload
/// is stashed (one device copy of about this many bytes) and dequantized from there.
pub const MIN_CHUNK_BYTES: usize = 1 << 20;

/// The libtorch dtype of a format's stored elements.
pub fn element_kind(format: QuantFormat) -> Kind {
    match format {
        QuantFormat::Int8 => Kind::Int8,
        QuantFormat::Fp8E4m3 => Kind::Float8e4m3fn,
    }
}

/// Views of a block's payload in host memory `buf` (`layout.bytes` long), per parameter: its
/// elements (flat, in the format's dtype) and scales (float32) when quantized, its full-width
/// tensor (its shape and dtype) when not.
pub(crate) fn payload_views(spec: &BlockSpec, layout: &QuantLayout, buf: &crate::device::HostBuffer) -> Result<Vec<(Tensor, Option<Tensor>)>> {
    spec.params
        .iter()
        .zip(&layout.params)
        .map(|(p, q)| match q.groups {
            Some(g) => Ok((
                param_tensor(buf, q.data, &[p.numel()], element_kind(layout.format))?,
                Some(param_tensor(buf, q.scales, &[g as i64], Kind::Float)?),
            )),
            None => Ok((param_tensor(buf, q.data, &p.shape, p.kind)?, None)),
        })
        .collect()
}

/// Writes `value` (the parameter's shape, any floating dtype) into parameter `i`'s payload
/// views, quantized when the layout quantizes it; its error (none for a full-width one).
pub(crate) fn write_param(spec: &BlockSpec, layout: &QuantLayout, i: usize, value: &Tensor, views: &(Tensor, Option<Tensor>)) -> Result<ErrorSums> {
    let p = &spec.params[i];
    if value.size() != p.shape {
        return Err(Error::internal(format!("quantizing '{}' of shape {:?} from a value of shape {:?}", p.name, p.shape, value.size())));
    }
    tch::no_grad(|| -> Result<ErrorSums> {
        match &views.1 {
            None => {
                views.0.shallow_clone().f_copy_(value)?;
                Ok(ErrorSums::default())
            }
            Some(scales) => {
                let q = quantize(value, layout.format, layout.group, p.kind, &p.name)?;
                views.0.shallow_clone().f_copy_(&q.q)?;
                scales.shallow_clone().f_copy_(&q.scales)?;
                Ok(q.error)
            }
        }
    })
}

// The payload's types are `payload.rs`'s (the registry's block specs hold a layout); how a
// layout is made is here.
impl QuantLayout {
    /// The payload of a block laid out as `spec` (its parameters at full width in `spec.bytes`),
    /// or `None` when no parameter is worth quantizing (the payload would not be smaller).
    pub fn new(spec: &BlockSpec, format: QuantFormat, group: usize) -> Option<QuantLayout> {
        let group = group.max(1);
        let align = |b: usize| b.div_ceil(PARAM_ALIGNMENT) * PARAM_ALIGNMENT;
        let mut offset = 0usize;
        let mut params = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let n = p.numel().max(0) as usize;
            let groups = n.div_ceil(group);
            let quantized = is_float(p.kind) && p.shape.len() >= 2 && n >= group && align(n) + align(4 * groups) < align(p.bytes);
            let qp = if quantized {
                let data = offset;
                let scales = data + align(n);
                offset = scales + align(4 * groups);
                QuantParam { groups: Some(groups), data, data_bytes: n, scales }
            } else {
                let data = offset;
                offset += align(p.bytes);
                QuantParam { groups: None, data, data_bytes: p.bytes, scales: data }
            };
            params.push(qp);
        }
        if params.iter().all(|q| q.groups.is_none()) || offset >= spec.bytes {
            return None;
        }
        let mut layout = QuantLayout {
            format,
            group,
            params,
            bytes: offset,
            offset: spec.bytes - offset,
            ops: Vec::new(),
            stash_bytes: 0,
        };
        let (ops, stash) = plan(spec, &layout);
        layout.ops = ops;
        layout.stash_bytes = stash;
        Some(layout)
    }

    /// Parameters stored quantized.
    pub fn quantized_params(&self) -> usize {
        self.params.iter().filter(|q| q.groups.is_some()).count()
    }

    /// The block byte where element `e` of parameter `i`'s payload starts.
    fn src_byte(&self, spec: &BlockSpec, i: usize, e: usize) -> usize {
        let q = &self.params[i];
        match q.groups {
            Some(_) => self.offset + q.data + e,
            None => self.offset + q.data + e * spec.params[i].kind.elt_size_in_bytes(),
        }
    }
}

fn is_float(k: Kind) -> bool {
    matches!(k, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

/// The dequantization's steps for `layout` in the device bytes of a block laid out as `spec`:
/// chunks in parameter order, each writing only below the first payload byte no earlier step
/// has read (a kernel's reads and writes run in any order, so they must not overlap, and no
/// later step's reads may be overwritten); once the room in place is under [`MIN_CHUNK_BYTES`],
/// the unread payload is stashed. Returns the steps and the stash's bytes.
fn plan(spec: &BlockSpec, layout: &QuantLayout) -> (Vec<DequantOp>, usize) {
    // A small block chunks in sixteenths: its stash stays a fraction of it.
    plan_with(spec, layout, MIN_CHUNK_BYTES.min(spec.bytes / 16).max(PARAM_ALIGNMENT))
}

/// [`plan`] with chunks of at least `min_chunk` bytes written (or a parameter's last).
fn plan_with(spec: &BlockSpec, layout: &QuantLayout, min_chunk: usize) -> (Vec<DequantOp>, usize) {
    let mut ops = Vec::new();
    let mut stash_from: Option<usize> = None;
    for (i, p) in spec.params.iter().enumerate() {
        let n = p.numel().max(0) as usize;
        let c = p.kind.elt_size_in_bytes();
        // Chunk boundaries fall on whole groups (a chunk's scales are whole) or on whole aligned
        // runs of a full-width parameter (the stash keeps every offset's alignment).
        let unit = match layout.params[i].groups {
            Some(_) => layout.group,
            None => (PARAM_ALIGNMENT / c).max(1),
        };
        let mut e = 0usize;
        while e < n {
            if stash_from.is_none() {
                let r = layout.src_byte(spec, i, e);
                let w = p.offset + e * c;
                let mut k = if r > w { ((r - w) / c).min(n - e) } else { 0 };
                if e + k < n {
                    k -= k % unit;
                }
                if k > 0 && (e + k == n || k * c >= min_chunk) {
                    ops.push(DequantOp::Chunk { param: i, start: e, len: k, stashed: false });
                    e += k;
                    continue;
                }
                // Aligned down: offsets in the stash keep the payload's alignment (the bytes
                // before `r` it copies were read already; their values do not matter).
                let from = r - r % PARAM_ALIGNMENT;
                stash_from = Some(from);
                ops.push(DequantOp::Stash { from });
            }
            ops.push(DequantOp::Chunk { param: i, start: e, len: n - e, stashed: true });
            e = n;
        }
    }
    let stash = stash_from.map_or(0, |f| spec.bytes - f);
    (ops, stash)
}

/// How far a block's dequantized values are from the ones it was quantized from (see
/// [`crate::events::QuantizationReport`]), summed over parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ErrorSums {
    /// The largest element error over its group's largest magnitude.
    pub max_rel: f64,
    /// Sum of the elements' errors and of their magnitudes.
    pub sum_err: f64,
    pub sum_abs: f64,
}

impl ErrorSums {
    pub(crate) fn add(&mut self, o: &ErrorSums) {
        self.max_rel = self.max_rel.max(o.max_rel);
        self.sum_err += o.sum_err;
        self.sum_abs += o.sum_abs;
    }

    /// Sum of errors over sum of magnitudes (0 for all-zero values).
    pub(crate) fn mean_rel(&self) -> f64 {
        if self.sum_abs > 0.0 {
            self.sum_err / self.sum_abs
        } else {
            0.0
        }
    }
}

/// The largest unit roundoff of `kind` (rounding to nearest): what the compute dtype adds to an
/// element's error, relative to the element.
pub fn unit_roundoff(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 2f64.powi(-8),
        Kind::Half => 2f64.powi(-11),
        Kind::Float => 2f64.powi(-24),
        _ => 2f64.powi(-53),
    }
}

/// The most a block's `max_rel_error` may be when quantized in `format` and dequantized into
/// `kind`: the format's own bound plus the compute dtype's rounding of a value at most the
/// group's largest magnitude (and a float32 rounding of the product).
pub fn error_bound(format: QuantFormat, kind: Kind) -> f64 {
    let q = format.max_relative_error();
    q + (unit_roundoff(kind) + 2f64.powi(-24)) * (1.0 + q)
}

/// One parameter quantized: its elements (flat, in the format's dtype), its scales (float32, one
/// a group) and its error.
pub(crate) struct Quantized {
    pub q: Tensor,
    pub scales: Tensor,
    pub error: ErrorSums,
}

/// Quantizes `value` (any floating dtype, any device) in `format` with groups of `group`
/// consecutive elements; the error is that of dequantizing into `kind`. A NaN or infinite value
/// is an error (it has no scale), naming `name`.
pub(crate) fn quantize(value: &Tensor, format: QuantFormat, group: usize, kind: Kind, name: &str) -> Result<Quantized> {
    tch::no_grad(|| -> Result<Quantized> {
        let x = value.f_detach()?.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Float)?.f_reshape([-1])?.f_contiguous()?;
        let n = x.numel();
        let groups = n.div_ceil(group.max(1)) as i64;
        let g = group as i64;
        let padded = pad_to(&x, groups * g)?;
        let v = padded.f_view([groups, g])?;
        let absmax = v.f_abs()?.f_amax([1], false)?;
        let top = f64::try_from(absmax.f_max()?)?;
        if !top.is_finite() {
            return Err(Error::Config {
                field: "quantize",
                value: format!("'{name}', which holds a NaN or infinite value"),
                expected: "finite weights (a group's scale is set from its largest magnitude)".into(),
            });
        }
        let positive = absmax.f_gt(0.0)?;
        let scales = (&absmax / format.max_value()).f_where_self(&positive, &Tensor::f_ones_like(&absmax)?)?;
        let y = v.f_div(&scales.f_unsqueeze(1)?)?;
        let q = match format {
            QuantFormat::Int8 => y.f_round()?.f_clamp(-127.0, 127.0)?,
            QuantFormat::Fp8E4m3 => y.f_clamp(-448.0, 448.0)?,
        }
        .f_to_kind(element_kind(format))?
        .f_reshape([-1])?
        .f_narrow(0, 0, n as i64)?
        .f_contiguous()?;
        // The error of what dequantizing into `kind` gives back.
        let back = Tensor::f_empty([n as i64], (kind, tch::Device::Cpu))?;
        dequantize_into(&back, &q, &scales, group, format)?;
        let err = (&x - back.f_to_kind(Kind::Float)?).f_abs()?;
        let group_err = pad_to(&err, groups * g)?.f_view([groups, g])?.f_amax([1], false)?;
        let rel = group_err.f_div(&absmax.f_where_self(&positive, &Tensor::f_ones_like(&absmax)?)?)?;
        let error = ErrorSums {
            max_rel: f64::try_from(rel.f_max()?)?,
            sum_err: f64::try_from(err.f_sum(Kind::Double)?)?,
            sum_abs: f64::try_from(x.f_abs()?.f_sum(Kind::Double)?)?,
        };
        Ok(Quantized { q, scales, error })
    })
}

/// Quantizes `value` (any floating dtype and device) in `format` with groups of
/// [`QUANT_GROUP`] consecutive elements of its flattened order: its elements (flat, on the CPU,
/// in the format's dtype) and its scales (float32, one a group). What a quantized block's
/// payload holds for a matrix; for benchmarks and tools that dequantize with
/// [`dequantize_tensor`].
pub fn quantize_tensor(value: &Tensor, format: QuantFormat) -> Result<(Tensor, Tensor)> {
    let q = quantize(value, format, QUANT_GROUP, Kind::Float, "tensor")?;
    Ok((q.q, q.scales))
}

/// Writes the dequantized values of `q` and `scales` (from [`quantize_tensor`], on `dst`'s
/// device) into `dst` (contiguous, any floating dtype, as many elements as `q`), as a
/// quantized block's dequantization does: `q * scale` in float32, rounded to `dst`'s dtype.
pub fn dequantize_tensor(dst: &Tensor, q: &Tensor, scales: &Tensor, format: QuantFormat) -> Result<()> {
    if dst.numel() != q.numel() || !dst.is_contiguous() {
        return Err(Error::Config {
            field: "dequantize",
            value: format!("a destination of {} elements (contiguous: {}) for {} quantized ones", dst.numel(), dst.is_contiguous(), q.numel()),
            expected: "a contiguous destination of as many elements".into(),
        });
    }
    dequantize_into(&dst.f_view([-1])?, &q.f_view([-1])?, scales, QUANT_GROUP, format)
}

/// `x` (flat) with zeros appended up to `len` elements.
fn pad_to(x: &Tensor, len: i64) -> Result<Tensor> {
    let n = x.numel() as i64;
    if n == len {
        return Ok(x.shallow_clone());
    }
    let zeros = Tensor::f_zeros([len - n], (x.kind(), x.device()))?;
    Ok(Tensor::f_cat(&[x, &zeros], 0)?)
}

/// Writes `q * scales` into `dst` (flat, its dtype the compute dtype): `q` holds whole groups
/// of `group` elements but perhaps the last, `scales` one float32 a group. Computed in float32
/// and rounded to `dst`'s dtype, whatever the device.
pub(crate) fn dequantize_into(dst: &Tensor, q: &Tensor, scales: &Tensor, group: usize, format: QuantFormat) -> Result<()> {
    // On CUDA, Stagehand's own kernel: the same values as libtorch's below, in one pass at the
    // device's memory bandwidth.
    if format == QuantFormat::Int8 && crate::device::dequant::dequantize_int8(dst, q, scales, group)? {
        return Ok(());
    }
    let len = q.numel();
    let full = (len / group) as i64;
    let rem = (len % group) as i64;
    let g = group as i64;
    let one = |d: &Tensor, q: &Tensor, s: &Tensor| -> Result<()> {
        match format {
            // int8 times float32 is float32, rounded into the destination in one pass.
            QuantFormat::Int8 => {
                let _ = q.f_mul_out(d, s)?;
            }
            // libtorch does not promote float8 with other dtypes: the elements first (exact in
            // any compute dtype), then the scales.
            QuantFormat::Fp8E4m3 => {
                d.shallow_clone().f_copy_(q)?;
                let _ = d.shallow_clone().f_mul_(s)?;
            }
        }
        Ok(())
    };
    tch::no_grad(|| -> Result<()> {
        if full > 0 {
            let d = dst.f_narrow(0, 0, full * g)?.f_view([full, g])?;
            let qv = q.f_narrow(0, 0, full * g)?.f_view([full, g])?;
            let s = scales.f_narrow(0, 0, full)?.f_unsqueeze(1)?;
            one(&d, &qv, &s)?;
        }
        if rem > 0 {
            let d = dst.f_narrow(0, full * g, rem)?;
            let qv = q.f_narrow(0, full * g, rem)?;
            let s = scales.f_narrow(0, full, 1)?;
            one(&d, &qv, &s)?;
        }
        Ok(())
    })
}

/// Dequantizes a block whose payload has landed at the end of `buf` (its device bytes, uint8,
/// `spec.bytes` long) into its parameters' full-width views in `buf`, with `spec`'s layout's
/// steps. Queued on the compute stream (on CUDA the kernels run after the copy the compute
/// stream was made to wait for).
pub(crate) fn dequantize_block(buf: &Tensor, spec: &BlockSpec) -> Result<()> {
    let layout = spec
        .quant
        .as_ref()
        .ok_or_else(|| Error::internal(format!("block '{}' has no quantized layout", spec.name)))?;
    let bytes = |t: &Tensor, at: usize, len: usize| t.f_narrow(0, at as i64, len as i64);
    tch::no_grad(|| -> Result<()> {
        let mut stash: Option<(usize, Tensor)> = None;
        for op in &layout.ops {
            match *op {
                DequantOp::Stash { from } => {
                    let len = spec.bytes - from;
                    let mut t = Tensor::f_empty([len as i64], (Kind::Uint8, buf.device()))?;
                    t.f_copy_(&bytes(buf, from, len)?)?;
                    stash = Some((from, t));
                }
                DequantOp::Chunk { param, start, len, stashed } => {
                    // Payload bytes `at..at + n` of the block, from the slot or the stash.
                    let src = |at: usize, n: usize| -> Result<Tensor> {
                        match (&stash, stashed) {
                            (Some((from, t)), true) => Ok(bytes(t, at - from, n)?),
                            (None, true) => Err(Error::internal("a stashed chunk before the stash")),
                            _ => Ok(bytes(buf, at, n)?),
                        }
                    };
                    let p = &spec.params[param];
                    let qp = &layout.params[param];
                    let c = p.kind.elt_size_in_bytes();
                    let mut dst = bytes(buf, p.offset + start * c, len * c)?.f_view_dtype(p.kind)?;
                    match qp.groups {
                        None => {
                            let s = src(layout.offset + qp.data + start * c, len * c)?.f_view_dtype(p.kind)?;
                            dst.f_copy_(&s)?;
                        }
                        Some(_) => {
                            let q = src(layout.offset + qp.data + start, len)?.f_view_dtype(element_kind(layout.format))?;
                            let g0 = start / layout.group;
                            let ng = len.div_ceil(layout.group);
                            let s = src(layout.offset + qp.scales + 4 * g0, 4 * ng)?.f_view_dtype(Kind::Float)?;
                            dequantize_into(&dst, &q, &s, layout.group, layout.format)?;
                        }
                    }
                }
            }
        }
        Ok(())
    })
}

/// The full-width value of parameter `p` from its payload views on the host: `data` (the
/// quantized elements, or the full-width tensor) and `scales`.
pub(crate) fn param_value(p: &ParamSpec, layout: &QuantLayout, data: &Tensor, scales: Option<&Tensor>) -> Result<Tensor> {
    match scales {
        None => Ok(data.f_detach()?),
        Some(s) => {
            let out = Tensor::f_empty([p.numel()], (p.kind, tch::Device::Cpu))?;
            dequantize_into(&out, data, s, layout.group, layout.format)?;
            Ok(out.f_view(p.shape.as_slice())?)
        }
    }
}

pub(crate) mod file;
#[cfg(test)]
mod tests;
