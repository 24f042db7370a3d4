//! A trained block's gradients cut into one shard per rank of a data-parallel group.
//!
//! The block's trainable parameters are laid out back to back in one flat gradient (each at an
//! offset that is a multiple of [`SHARD_ALIGN`] elements, zeros between), padded to `world`
//! equal shards. After backward leaves the block, each rank packs its device gradients into
//! that layout and the group reduce-scatters it: rank `r` gets the sum over the ranks of shard
//! `r`, copies it to its pinned host buffer (the only copy of it that crosses PCIe), and its host
//! optimizer steps the pieces of the parameters inside that shard, writing the shared host copy.
//!
//! The host optimizer's updates are elementwise, so a piece steps to the bits the whole
//! parameter would. Why the alignment then: a shard boundary inside a parameter lies a multiple
//! of [`SHARD_ALIGN`] elements after the parameter's start, so the CPU kernels that step a piece
//! group its elements into vectors exactly as they group the whole parameter's (their vector
//! body and scalar tail may round differently where a build fuses multiply-adds in one and not
//! the other). With libtorch 2.11 here, odd boundaries gave the same bits too (measured with
//! the alignment set to 1); the alignment keeps that from depending on the build.

use super::registry::{param_tensor, BlockSpec};
use crate::device::{Device, HostBuffer};
use crate::error::{Error, Result};
use tch::{Kind, Tensor};

/// Elements each parameter's gradient is aligned to in the flat layout, and each shard's size
/// a multiple of (wider than any CPU vector the host kernels use, unrolled).
pub(crate) const SHARD_ALIGN: i64 = 128;

/// `a / b` rounded up, for `a >= 0` and `b > 0`.
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Where each trainable parameter's gradient lies in the flat layout, and this rank's shard.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShardLayout {
    pub rank: usize,
    pub world: usize,
    /// The gradients' dtype (every trainable parameter of the block streams in it).
    pub kind: Kind,
    /// (parameter index in the block, flat offset, elements) of each trainable parameter.
    pub params: Vec<(usize, i64, i64)>,
    /// Elements in each rank's shard.
    pub shard: i64,
}

impl ShardLayout {
    /// The layout of `spec`'s trainable parameters for rank `rank` of `world`; `None` for a
    /// frozen block. Every trainable parameter must stream in one dtype (one flat buffer).
    pub(crate) fn new(spec: &BlockSpec, rank: usize, world: usize) -> Result<Option<ShardLayout>> {
        let trained: Vec<(usize, &super::ParamSpec)> = spec.params.iter().enumerate().filter(|(_, p)| p.trainable).collect();
        let Some((_, first)) = trained.first() else { return Ok(None) };
        let kind = first.kind;
        if let Some((_, other)) = trained.iter().find(|(_, p)| p.kind != kind) {
            return Err(Error::Config {
                field: "block",
                value: format!("'{}' trains '{}' in {kind:?} and '{}' in {:?}", spec.name, first.name, other.name, other.kind),
                expected: "one dtype for every trained parameter of a block in a data-parallel group (its gradients are reduced in one buffer)".into(),
            });
        }
        let world = world.max(1);
        let mut params = Vec::with_capacity(trained.len());
        let mut end = 0i64;
        for (i, p) in trained {
            let at = ceil_div(end, SHARD_ALIGN) * SHARD_ALIGN;
            params.push((i, at, p.numel()));
            end = at + p.numel();
        }
        let shard = ceil_div(ceil_div(end, world as i64), SHARD_ALIGN).max(1) * SHARD_ALIGN;
        Ok(Some(ShardLayout { rank, world, kind, params, shard }))
    }

    /// Elements of the flat gradient, padding included (`world` shards).
    pub(crate) fn padded(&self) -> i64 {
        self.shard * self.world as i64
    }

    /// Bytes of one shard.
    pub(crate) fn shard_bytes(&self) -> usize {
        self.shard as usize * self.kind.elt_size_in_bytes()
    }

    /// The piece of parameter `param` (its index in the block) inside this rank's shard:
    /// (offset in the parameter, offset in the shard, elements); `None` when none of it is.
    pub(crate) fn piece(&self, param: usize) -> Option<(i64, i64, i64)> {
        let &(_, at, n) = self.params.iter().find(|(i, _, _)| *i == param)?;
        let (lo, hi) = (self.rank as i64 * self.shard, (self.rank as i64 + 1) * self.shard);
        let (start, end) = (at.max(lo), (at + n).min(hi));
        (start < end).then_some((start - at, start - lo, end - start))
    }

    /// The gradients of the trainable parameters (in `params` order; `None` for one that got
    /// none, which counts as zeros) packed into one flat tensor on `device`.
    pub(crate) fn pack(&self, grads: &[Option<Tensor>], device: tch::Device) -> Result<Tensor> {
        if grads.len() != self.params.len() {
            return Err(Error::internal(format!("packing {} gradients into a layout of {}", grads.len(), self.params.len())));
        }
        let zeros = |n: i64| Tensor::f_zeros([n], (self.kind, device));
        let mut parts = Vec::with_capacity(2 * grads.len() + 1);
        let mut cursor = 0i64;
        for (g, &(_, at, n)) in grads.iter().zip(&self.params) {
            if at > cursor {
                parts.push(zeros(at - cursor)?);
            }
            parts.push(match g {
                Some(g) if g.numel() as i64 == n => {
                    let flat = g.f_reshape([n])?;
                    if flat.kind() == self.kind {
                        flat
                    } else {
                        flat.f_to_kind(self.kind)?
                    }
                }
                Some(g) => return Err(Error::internal(format!("a gradient of {} elements for a parameter of {n}", g.numel()))),
                None => zeros(n)?,
            });
            cursor = at + n;
        }
        if self.padded() > cursor {
            parts.push(zeros(self.padded() - cursor)?);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }
}

/// A rank's shard of a trained block's reduced gradients in host memory.
pub(crate) struct ShardGrad {
    pub layout: ShardLayout,
    /// A CPU view of the whole shard (drops before `buf`).
    pub view: Tensor,
    /// The pinned host buffer; lent to the copy while one flies.
    pub buf: Option<HostBuffer>,
    /// A reduced shard landed (or is landing) in this accumulation window: a later one of the
    /// same window is added to it.
    pub received: bool,
}

impl ShardGrad {
    /// A pinned buffer (on CUDA) for `layout`'s shard.
    pub(crate) fn new(layout: ShardLayout, device: &Device) -> Result<ShardGrad> {
        let buf = device.alloc_host(layout.shard_bytes())?;
        let view = param_tensor(&buf, 0, &[layout.shard], layout.kind)?;
        Ok(ShardGrad { layout, view, buf: Some(buf), received: false })
    }

    /// A CPU view of parameter `param`'s piece of the shard (1-D; empty when the shard holds
    /// none of it).
    pub(crate) fn piece_view(&self, param: usize) -> Result<Tensor> {
        match self.layout.piece(param) {
            Some((_, at, n)) => Ok(self.view.f_narrow(0, at, n)?),
            None => Ok(Tensor::f_empty([0], (self.layout.kind, tch::Device::Cpu))?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::BlockId;

    fn spec(sizes: &[(i64, bool)]) -> BlockSpec {
        let params: Vec<(String, Tensor)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &(n, t))| (format!("b.p{i}"), Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)).set_requires_grad(t)))
            .collect();
        BlockSpec::layout(BlockId(0), "b", &params).expect("layout")
    }

    #[test]
    fn shards_cover_every_trained_element_once() {
        let s = spec(&[(300, true), (7, false), (1000, true), (1, true)]);
        for world in [1, 2, 3, 4, 8] {
            let layouts: Vec<ShardLayout> = (0..world).map(|r| ShardLayout::new(&s, r, world).expect("ok").expect("trains")).collect();
            let l0 = &layouts[0];
            assert_eq!(l0.shard % SHARD_ALIGN, 0);
            assert!(l0.params.iter().all(|&(_, at, _)| at % SHARD_ALIGN == 0));
            assert!(l0.params.iter().all(|&(i, _, _)| i != 1), "the frozen parameter has no gradient");
            for &(p, _, n) in &l0.params {
                let mut covered = 0;
                for l in &layouts {
                    if let Some((in_param, in_shard, len)) = l.piece(p) {
                        assert!(in_shard + len <= l.shard);
                        // A boundary inside a parameter is aligned from its start.
                        assert_eq!(in_param % SHARD_ALIGN, 0, "world {world} param {p}");
                        covered += len;
                    }
                }
                assert_eq!(covered, n, "world {world} param {p}");
            }
        }
    }

    #[test]
    fn packing_puts_each_gradient_at_its_offset_and_zeros_between() {
        let s = spec(&[(3, true), (5, true)]);
        let l = ShardLayout::new(&s, 1, 2).expect("ok").expect("trains");
        let g0 = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let flat = l.pack(&[Some(g0), None], tch::Device::Cpu).expect("packs");
        assert_eq!(flat.numel() as i64, l.padded());
        let v = Vec::<f32>::try_from(&flat).expect("floats");
        assert_eq!(&v[..4], &[1.0, 2.0, 3.0, 0.0]);
        assert!(v[3..].iter().all(|&x| x == 0.0), "a missing gradient is zeros");
        let frozen = spec(&[(4, false)]);
        assert!(ShardLayout::new(&frozen, 0, 2).expect("ok").is_none());
    }
}
