//! Several models on one handle, and frozen blocks stored quantized: which blocks belong to which
//! model, what each model holds on the device, and what quantizing a block cost in accuracy.

use super::BlockId;
use super::QuantFormat;
use serde::{Deserialize, Serialize};

/// What quantizing one frozen block did (`quantized` event, and in the memory plan).
///
/// Errors are measured against the values the block was quantized from: `max_rel_error` is the
/// largest error of any element as a fraction of the largest magnitude in its group of
/// [`QUANT_GROUP`](super::QUANT_GROUP) elements (the group's scale is set from it),
/// `mean_rel_error` the sum of the errors over the sum of the magnitudes (a relative L1 error).
/// Both include the compute dtype's rounding of the dequantized values.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationReport {
    pub block: BlockId,
    pub name: String,
    pub format: QuantFormat,
    /// Elements sharing one scale.
    pub group: u32,
    /// Parameters quantized, of `params`; the others (vectors, tensors smaller than a group,
    /// integers) are stored at full width.
    pub quantized_params: u32,
    pub params: u32,
    /// Bytes of the block at full width in the dtype it computes in: what its host copy held and
    /// each load moved before.
    pub full_bytes: u64,
    /// Bytes of its quantized payload: what the host holds and each load moves now.
    pub quantized_bytes: u64,
    pub max_rel_error: f64,
    pub mean_rel_error: f64,
}

/// Device memory and residency of one model's blocks (`model_memory` event).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ModelMemory {
    pub model: String,
    /// Device bytes its blocks hold now: resident blocks and the room's slots holding its
    /// blocks.
    pub device_bytes: u64,
    /// Its blocks, those on the device (ready or landing) and those kept resident.
    pub blocks: u32,
    pub on_device: u32,
    pub resident: u32,
}

/// One model's share of a step's weight copies (in `weight_step`, when a handle runs several).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ModelWeightStep {
    pub model: String,
    /// Bytes copied in for its blocks in the step.
    pub h2d_bytes: u64,
    /// Its share of the Belady minimum of the step's combined itinerary: the bytes of its blocks
    /// among the fewest loads a scheduler knowing the whole interleaved step would make.
    pub min_h2d_bytes: u64,
    /// Loads of its blocks and evictions of them.
    pub loads: u64,
    pub evictions: u64,
}
