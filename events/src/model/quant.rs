//! The formats frozen weights are stored in when quantized: part of the vocabulary because the
//! `model_registered` and `quantized` events name them.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How a frozen block's weights are stored on the host and cross PCIe when they are quantized
/// (the runtime's `weights::quant`): 8 bits an element in groups of [`QUANT_GROUP`] consecutive elements,
/// each group with a float32 scale (its largest magnitude over the format's largest value),
/// dequantized on the device into the compute dtype just before the block is used. Trained
/// weights are never quantized.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantFormat {
    /// Signed integers -127..=127, rounded to nearest: an element's error is at most half a
    /// step, 1/254 of its group's largest magnitude.
    Int8,
    /// FP8 E4M3 (4 exponent bits, 3 mantissa bits, largest value 448), rounded to nearest: an
    /// element's error is at most 1/16 of its own magnitude; small elements keep more of their
    /// precision than under INT8, large ones less.
    Fp8E4m3,
}

impl QuantFormat {
    /// Every format, in the order `--help` lists them.
    pub const ALL: [QuantFormat; 2] = [QuantFormat::Int8, QuantFormat::Fp8E4m3];

    /// "int8", "fp8_e4m3".
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Int8 => "int8",
            QuantFormat::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// The largest magnitude the format stores: a group's scale maps its largest element to it.
    pub fn max_value(self) -> f64 {
        match self {
            QuantFormat::Int8 => 127.0,
            QuantFormat::Fp8E4m3 => 448.0,
        }
    }

    /// The most an element's quantization error may be, as a fraction of its group's largest
    /// magnitude, before the compute dtype rounds the dequantized value: half an integer step
    /// for INT8 (1/254), half a mantissa step of the element itself for FP8 E4M3 (1/16).
    pub fn max_relative_error(self) -> f64 {
        match self {
            QuantFormat::Int8 => 1.0 / 254.0,
            QuantFormat::Fp8E4m3 => 1.0 / 16.0,
        }
    }
}

impl fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        QuantFormat::ALL
            .into_iter()
            .find(|q| q.name().eq_ignore_ascii_case(s) || (*q == QuantFormat::Fp8E4m3 && s.eq_ignore_ascii_case("fp8")))
            .ok_or_else(|| format!("quantization '{s}': one of int8, fp8_e4m3"))
    }
}

/// Elements sharing one scale in a quantized frozen block ([`QuantFormat`]): a group lies
/// within one row of any matrix whose rows are a multiple of 128 wide, and its float32 scale
/// adds 1/32 byte an element.
pub const QUANT_GROUP: usize = 128;
