//! The layout of a frozen block stored quantized: where each parameter is in the block's
//! payload, and the steps that dequantize it in the block's device bytes. Plain data, below the
//! registry (a block's spec holds its layout); `quant.rs` makes layouts and their steps and
//! re-exports these types.

use crate::precision::QuantFormat;

/// The quantized payload of a block: its format, each parameter's place in it, and how it is
/// dequantized in the block's device bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantLayout {
    pub format: QuantFormat,
    /// Elements sharing one scale.
    pub group: usize,
    pub params: Vec<QuantParam>,
    /// Bytes of the payload: what the host holds and each load copies.
    pub bytes: usize,
    /// Where the payload lands in the block's device bytes: their last `bytes`.
    pub offset: usize,
    /// The dequantization's steps, in order.
    pub ops: Vec<DequantOp>,
    /// Bytes of the stash the last steps read from (0 when every chunk runs in place).
    pub stash_bytes: usize,
}

/// Where one parameter is in a block's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParam {
    /// Groups of a quantized parameter; `None`: stored at full width in its dtype.
    pub groups: Option<usize>,
    /// Offset of its elements in the payload, and their bytes.
    pub data: usize,
    pub data_bytes: usize,
    /// Offset of its float32 scales in the payload (quantized parameters).
    pub scales: usize,
}

/// One step of dequantizing a block in its device bytes (see `weights::quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DequantOp {
    /// Copies the payload from block byte `from` to the block's end into the stash.
    Stash { from: usize },
    /// Dequantizes elements `start..start + len` of parameter `param`, reading the slot's payload
    /// or (`stashed`) the stash.
    Chunk { param: usize, start: usize, len: usize, stashed: bool },
}
