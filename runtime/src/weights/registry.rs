//! The block registry: which parameters form each block, and where each one sits in the
//! block's flat byte layout (real dtypes, 256-byte-aligned offsets).

use super::payload::QuantLayout;
use crate::device::HostBuffer;
use crate::error::{Error, Result};
use crate::events::BlockId;
use regex::Regex;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// Every parameter starts on a multiple of this many bytes inside its block (GEMM-friendly).
pub const PARAM_ALIGNMENT: usize = 256;

/// One parameter of a block.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Full VarStore path of the parameter.
    pub name: String,
    /// Its dtype on the device and in the host copy that streams: the variable's own, or the
    /// run's 16-bit compute dtype under mixed precision.
    pub kind: Kind,
    /// The dtype the model made it in (checkpoints read and write this one).
    pub declared: Kind,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Byte offset inside the block (a multiple of [`PARAM_ALIGNMENT`]).
    pub offset: usize,
    /// Bytes of the parameter.
    pub bytes: usize,
    /// Whether it receives gradients.
    pub trainable: bool,
}

impl ParamSpec {
    /// Whether its host copy is a 16-bit copy of a float32 master: a trainable parameter
    /// streamed in 16 bits, which is never updated in 16 bits.
    pub fn has_master(&self) -> bool {
        self.trainable && matches!(self.kind, Kind::BFloat16 | Kind::Half)
    }

    /// Offset in elements of its own dtype (the storage offset of its view).
    pub fn elem_offset(&self) -> i64 {
        (self.offset / self.kind.elt_size_in_bytes()) as i64
    }

    /// Number of elements.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// An immutable description of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockSpec {
    pub id: BlockId,
    /// The block's path prefix (or layer path in layer mode).
    pub name: String,
    pub params: Vec<ParamSpec>,
    /// Bytes of the flat layout, padding included: what the block takes on the device.
    pub bytes: usize,
    /// A frozen block stored quantized: its payload, which the host holds and each load copies
    /// (it lands in the block's own device bytes, where it is dequantized before use).
    pub quant: Option<QuantLayout>,
}

impl BlockSpec {
    /// Lays out `params` (name, tensor) back to back with aligned offsets, each in its own dtype.
    pub fn layout(id: BlockId, name: &str, params: &[(String, Tensor)]) -> Result<BlockSpec> {
        BlockSpec::layout_as(id, name, params, None)
    }

    /// [`layout`](Self::layout) with floating parameters in `compute` (a mixed-precision run's
    /// 16-bit dtype) when given.
    pub fn layout_as(id: BlockId, name: &str, params: &[(String, Tensor)], compute: Option<Kind>) -> Result<BlockSpec> {
        if params.is_empty() {
            return Err(Error::Config {
                field: "block",
                value: format!("'{name}'"),
                expected: "at least one parameter".into(),
            });
        }
        let mut offset = 0usize;
        let mut specs = Vec::with_capacity(params.len());
        for (pname, t) in params {
            let declared = t.kind();
            let kind = match compute {
                Some(c) if t.is_floating_point() => c,
                _ => declared,
            };
            let bytes = t.numel() * kind.elt_size_in_bytes();
            specs.push(ParamSpec {
                name: pname.clone(),
                kind,
                declared,
                shape: t.size(),
                offset,
                bytes,
                trainable: t.requires_grad(),
            });
            offset = (offset + bytes).div_ceil(PARAM_ALIGNMENT) * PARAM_ALIGNMENT;
        }
        Ok(BlockSpec {
            id,
            name: name.to_string(),
            params: specs,
            bytes: offset.max(PARAM_ALIGNMENT),
            quant: None,
        })
    }

    /// Bytes the block's host copy holds and each load copies: its quantized payload, or its
    /// layout.
    pub fn transfer_bytes(&self) -> usize {
        self.quant.as_ref().map_or(self.bytes, |q| q.bytes)
    }

    /// Whether any parameter is trainable.
    pub fn trainable(&self) -> bool {
        self.params.iter().any(|p| p.trainable)
    }

    /// The parameter whose bytes contain `byte_offset`.
    pub fn param_at(&self, byte_offset: usize) -> Option<usize> {
        self.params
            .iter()
            .position(|p| byte_offset >= p.offset && byte_offset < p.offset + p.bytes.max(1))
    }
}

/// The shortest dot-prefix of `name` that `pattern` matches entirely (the block it belongs to).
pub fn block_prefix<'a>(name: &'a str, pattern: &Regex) -> Option<&'a str> {
    name.match_indices('.')
        .map(|(i, _)| &name[..i])
        .chain(std::iter::once(name))
        .find(|p| pattern.find(p).is_some_and(|m| m.start() == 0 && m.end() == p.len()))
}

/// Compares names with embedded numbers numerically (`blocks.2` before `blocks.10`).
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(s: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut text = String::new();
        let mut digits = String::new();
        for c in s.chars() {
            if c.is_ascii_digit() {
                digits.push(c);
            } else {
                if !digits.is_empty() {
                    out.push((std::mem::take(&mut text), digits.parse().unwrap_or(u64::MAX)));
                    digits.clear();
                }
                text.push(c);
            }
        }
        out.push((text, digits.parse().unwrap_or(0)));
        out
    }
    parts(a).cmp(&parts(b))
}

/// Blocks grouped from VarStore variables by `pattern`, in natural name order, each with its
/// parameters sorted by name; and the variables that belong to no block.
pub type Grouped = (Vec<(String, Vec<(String, Tensor)>)>, Vec<(String, Tensor)>);

/// Groups `variables` into blocks by the regex `pattern` over their path prefixes.
pub fn group_by_pattern(
    variables: impl IntoIterator<Item = (String, Tensor)>,
    pattern: &Regex,
) -> Grouped {
    let mut blocks: BTreeMap<String, Vec<(String, Tensor)>> = BTreeMap::new();
    let mut rest = Vec::new();
    for (name, t) in variables {
        match block_prefix(&name, pattern) {
            Some(p) => {
                let p = p.to_string();
                blocks.entry(p).or_default().push((name, t));
            }
            None => rest.push((name, t)),
        }
    }
    let mut out: Vec<_> = blocks.into_iter().collect();
    out.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    for (_, params) in &mut out {
        params.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    }
    rest.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    (out, rest)
}

/// A CPU tensor over `bytes` of `buf` at `offset`, with `shape` and `kind`.
pub(crate) fn param_tensor(buf: &HostBuffer, offset: usize, shape: &[i64], kind: Kind) -> Result<Tensor> {
    let numel: i64 = shape.iter().product();
    let bytes = numel as usize * kind.elt_size_in_bytes();
    buf.range(offset, bytes)?;
    let strides = contiguous_strides(shape);
    // SAFETY: the view covers `bytes` bytes at `offset` inside `buf` (checked above); the owner
    // keeps `buf` alive longer than the view (field order in `HostCopy` and `ParamGrad`), and
    // the view never leaves the runtime.
    let t = unsafe {
        Tensor::f_from_blob(
            buf.as_slice().as_ptr().add(offset),
            shape,
            &strides,
            kind,
            tch::Device::Cpu,
        )
    }?;
    Ok(t)
}

fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1].max(1);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_aligns_offsets_and_keeps_real_dtypes() {
        let w = Tensor::zeros([3, 5], (Kind::BFloat16, tch::Device::Cpu));
        let b = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let spec = BlockSpec::layout(BlockId(0), "l", &[("l.w".into(), w), ("l.b".into(), b)])
            .expect("layout");
        assert_eq!(spec.params[0].bytes, 30);
        assert_eq!(spec.params[0].kind, Kind::BFloat16);
        assert_eq!(spec.params[1].offset, 256);
        assert_eq!(spec.params[1].elem_offset(), 64);
        assert_eq!(spec.bytes, 512);
        assert!(spec.trainable());
        assert_eq!(spec.param_at(10), Some(0));
        assert_eq!(spec.param_at(100), None, "padding belongs to no parameter");
        assert_eq!(spec.param_at(260), Some(1));
        assert!(!spec.params[0].has_master() && !spec.params[1].has_master());
    }

    #[test]
    fn mixed_precision_lays_floating_parameters_out_in_the_compute_dtype() {
        let w = Tensor::zeros([3, 5], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let frozen = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
        let ids = Tensor::zeros([2], (Kind::Int64, tch::Device::Cpu));
        let spec = BlockSpec::layout_as(
            BlockId(0),
            "l",
            &[("l.w".into(), w), ("l.f".into(), frozen), ("l.i".into(), ids)],
            Some(Kind::BFloat16),
        )
        .expect("layout");
        let p = &spec.params;
        assert_eq!((p[0].kind, p[0].declared, p[0].bytes), (Kind::BFloat16, Kind::Float, 30));
        assert!(p[0].has_master(), "a trained 16-bit parameter has a float32 master");
        assert_eq!((p[1].kind, p[1].declared), (Kind::BFloat16, Kind::Float));
        assert!(!p[1].has_master(), "a frozen one streams its 16-bit copy alone");
        assert_eq!((p[2].kind, p[2].declared), (Kind::Int64, Kind::Int64), "integers keep their dtype");
    }

    #[test]
    fn pattern_groups_blocks_in_natural_order() {
        let re = Regex::new(r"blocks\.\d+").expect("regex");
        let t = || Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
        let vars = vec![
            ("blocks.10.w".to_string(), t()),
            ("blocks.2.w".to_string(), t()),
            ("blocks.2.b".to_string(), t()),
            ("head.w".to_string(), t()),
            ("xblocks.1.w".to_string(), t()),
        ];
        let (blocks, rest) = group_by_pattern(vars, &re);
        let names: Vec<_> = blocks.iter().map(|b| b.0.as_str()).collect();
        assert_eq!(names, ["blocks.2", "blocks.10"]);
        assert_eq!(blocks[0].1[0].0, "blocks.2.b");
        let rest: Vec<_> = rest.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(rest, ["head.w", "xblocks.1.w"], "a match must cover the whole prefix");
    }
}
