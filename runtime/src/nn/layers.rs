//! The drop-ins: every `tch::nn` layer that holds weights, made by tch's own constructor on the
//! path (same initialisation, same names, same random draws) and managed by Stagehand.
//!
//! Like tch's constructors they return the layer, not a `Result`: a layer that cannot be managed
//! reports why when it is first used ([`Managed::try_forward`], `ManagedVarStore::seal`,
//! `Stagehand::prepare`), never silently.

use super::managed::{Managed, ManagedT};
use super::path::Path;
use std::borrow::Borrow;
use tch::nn;

/// A managed `tch::nn::Linear`.
pub type Linear = Managed<nn::Linear>;
/// A managed `tch::nn::Conv1D`.
pub type Conv1D = Managed<nn::Conv1D>;
/// A managed `tch::nn::Conv2D`.
pub type Conv2D = Managed<nn::Conv2D>;
/// A managed `tch::nn::Conv3D`.
pub type Conv3D = Managed<nn::Conv3D>;
/// A managed `tch::nn::ConvTranspose1D`.
pub type ConvTranspose1D = Managed<nn::ConvTranspose1D>;
/// A managed `tch::nn::ConvTranspose2D`.
pub type ConvTranspose2D = Managed<nn::ConvTranspose2D>;
/// A managed `tch::nn::ConvTranspose3D`.
pub type ConvTranspose3D = Managed<nn::ConvTranspose3D>;
/// A managed `tch::nn::Embedding`.
pub type Embedding = Managed<nn::Embedding>;
/// A managed `tch::nn::LayerNorm`.
pub type LayerNorm = Managed<nn::LayerNorm>;
/// A managed `tch::nn::GroupNorm`.
pub type GroupNorm = Managed<nn::GroupNorm>;
/// A managed `tch::nn::BatchNorm` (a `ModuleT`): its weight and bias stream; its running
/// statistics stay on the compute device, where training updates them in place.
pub type BatchNorm = ManagedT<nn::BatchNorm>;

fn weights<'t>(ws: &'t tch::Tensor, bs: Option<&'t tch::Tensor>) -> Vec<&'t tch::Tensor> {
    std::iter::once(ws).chain(bs).collect()
}

fn optional<'t>(ws: Option<&'t tch::Tensor>, bs: Option<&'t tch::Tensor>) -> Vec<&'t tch::Tensor> {
    ws.into_iter().chain(bs).collect()
}

/// `tch::nn::linear`, managed.
pub fn linear<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, out_dim: i64, c: nn::LinearConfig) -> Linear {
    let p = vs.borrow();
    let inner = nn::linear(&**p, in_dim, out_dim, c);
    let b = p.register(&weights(&inner.ws, inner.bs.as_ref()));
    Managed::new(inner, b)
}

/// `tch::nn::embedding`, managed.
pub fn embedding<'a, T: Borrow<Path<'a>>>(vs: T, num_embeddings: i64, embedding_dim: i64, c: nn::EmbeddingConfig) -> Embedding {
    let p = vs.borrow();
    let inner = nn::embedding(&**p, num_embeddings, embedding_dim, c);
    let b = p.register(&[&inner.ws]);
    Managed::new(inner, b)
}

macro_rules! conv {
    ($(#[$m:meta])* $name:ident, $tch:ident, $ty:ident, $cfg:ty) => {
        $(#[$m])*
        pub fn $name<'a, T: Borrow<Path<'a>>>(vs: T, in_dim: i64, out_dim: i64, k: i64, c: $cfg) -> $ty {
            let p = vs.borrow();
            let inner = nn::$tch(&**p, in_dim, out_dim, k, c);
            let b = p.register(&weights(&inner.ws, inner.bs.as_ref()));
            Managed::new(inner, b)
        }
    };
}

conv!(
    /// `tch::nn::conv1d`, managed.
    conv1d, conv1d, Conv1D, nn::ConvConfig
);
conv!(
    /// `tch::nn::conv2d`, managed.
    conv2d, conv2d, Conv2D, nn::ConvConfig
);
conv!(
    /// `tch::nn::conv3d`, managed.
    conv3d, conv3d, Conv3D, nn::ConvConfig
);
conv!(
    /// `tch::nn::conv_transpose1d`, managed.
    conv_transpose1d, conv_transpose1d, ConvTranspose1D, nn::ConvTransposeConfig
);
conv!(
    /// `tch::nn::conv_transpose2d`, managed.
    conv_transpose2d, conv_transpose2d, ConvTranspose2D, nn::ConvTransposeConfig
);
conv!(
    /// `tch::nn::conv_transpose3d`, managed.
    conv_transpose3d, conv_transpose3d, ConvTranspose3D, nn::ConvTransposeConfig
);

/// `tch::nn::layer_norm`, managed (nothing to manage without `elementwise_affine`).
pub fn layer_norm<'a, T: Borrow<Path<'a>>>(vs: T, normalized_shape: Vec<i64>, c: nn::LayerNormConfig) -> LayerNorm {
    let p = vs.borrow();
    let inner = nn::layer_norm(&**p, normalized_shape, c);
    let b = p.register(&optional(inner.ws.as_ref(), inner.bs.as_ref()));
    Managed::new(inner, b)
}

/// `tch::nn::group_norm`, managed (nothing to manage without `affine`).
pub fn group_norm<'a, T: Borrow<Path<'a>>>(vs: T, num_groups: i64, num_channels: i64, c: nn::GroupNormConfig) -> GroupNorm {
    let p = vs.borrow();
    let inner = nn::group_norm(&**p, num_groups, num_channels, c);
    let b = p.register(&optional(inner.ws.as_ref(), inner.bs.as_ref()));
    Managed::new(inner, b)
}

macro_rules! batch_norm {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        pub fn $name<'a, T: Borrow<Path<'a>>>(vs: T, out_dim: i64, c: nn::BatchNormConfig) -> BatchNorm {
            let p = vs.borrow();
            let inner = nn::$name(&**p, out_dim, c);
            // The running statistics are not registered: unmanaged, on the device.
            let b = p.register(&optional(inner.ws.as_ref(), inner.bs.as_ref()));
            ManagedT::new(inner, b)
        }
    };
}

batch_norm!(
    /// `tch::nn::batch_norm1d`, managed.
    batch_norm1d
);
batch_norm!(
    /// `tch::nn::batch_norm2d`, managed.
    batch_norm2d
);
batch_norm!(
    /// `tch::nn::batch_norm3d`, managed.
    batch_norm3d
);
