//! Training precision: what the device computes in, what the optimizer updates, and how fp16's
//! gradients are kept in range.
//!
//! - [`Precision::Fp32`] and [`Precision::Tf32`] store and update every weight in float32 (TF32
//!   lets CUDA's matrix units round float32 matmul inputs to 10 mantissa bits).
//! - [`Precision::Bf16`] and [`Precision::Fp16`] are mixed precision: streamed weights live on
//!   the device (and cross PCIe) in the 16-bit type, while **master weights and optimizer state
//!   stay in float32** on the host; gradients come back in the 16-bit type and are applied in
//!   float32, and the host optimizer writes the 16-bit copy the next load streams. Variables that
//!   stay on the device (unmanaged variables, resident blocks) stay float32 there and the forward
//!   runs under autocast, which casts them per op and computes losses, softmaxes and norms in
//!   float32. A model made in a 16-bit dtype trains with float32 masters too: 16-bit weights are
//!   never updated in 16 bits.
//! - fp16 adds dynamic loss scaling ([`LossScaler`], torch's `GradScaler` rules).
//!
//! Host memory per trained parameter is [`Precision::host_bytes_per_param`] plus the optimizer
//! state ([`StateStorage`]).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

// The quantized weights' format is event vocabulary (the events name it), so it lives in the
// events crate; here it stays where users found it.
pub use stagehand_events::model::{QuantFormat, QUANT_GROUP};

/// How a run computes and updates its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Float32 storage and math.
    #[default]
    Fp32,
    /// Float32 storage, TF32 matmuls and convolutions on CUDA.
    Tf32,
    /// Bfloat16 weights and gradients on the device, float32 masters and state on the host.
    Bf16,
    /// Float16 weights and gradients on the device with dynamic loss scaling, float32 masters
    /// and state on the host.
    Fp16,
}

impl Precision {
    /// Every precision, in the order `--help` lists them.
    pub const ALL: [Precision; 4] = [Precision::Fp32, Precision::Tf32, Precision::Bf16, Precision::Fp16];

    /// "fp32", "tf32", "bf16", "fp16".
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// Whether weights live on the device in a 16-bit type with float32 masters elsewhere.
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp16)
    }

    /// Whether gradients need loss scaling to stay in range.
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }

    /// The 16-bit dtype floating weights stream and compute in (`None`: their own).
    pub fn compute_kind(self) -> Option<tch::Kind> {
        match self {
            Precision::Bf16 => Some(tch::Kind::BFloat16),
            Precision::Fp16 => Some(tch::Kind::Half),
            Precision::Fp32 | Precision::Tf32 => None,
        }
    }

    /// Bytes of one streamed weight element on the device and over PCIe.
    pub fn weight_bytes(self) -> u64 {
        if self.is_mixed() {
            2
        } else {
            4
        }
    }

    /// Host bytes per trained parameter besides the optimizer state: the float32 master (mixed
    /// only), the pinned copy that streams and the pinned gradient buffer.
    pub fn host_bytes_per_param(self) -> u64 {
        // (master, copy, gradient): the same 8 bytes either way, split differently.
        let (master, copy, grad) = if self.is_mixed() { (4, 2, 2) } else { (0, 4, 4) };
        master + copy + grad
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("precision '{s}': one of fp32, tf32, bf16, fp16"))
    }
}

/// How the host optimizer stores its per-parameter state (Adam's moments, momentum buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateStorage {
    /// Float32: exact.
    #[default]
    Fp32,
    /// Bfloat16, rounded stochastically at every step (a moment's small steps survive in
    /// expectation, where rounding to nearest would drop them): half the bytes.
    Bf16,
    /// 8 bits an element in blocks of 256 with a float32 scale each (the first moment signed,
    /// 4 exponent and 3 mantissa bits; the second unsigned, 5 and 3), as bitsandbytes' 8-bit
    /// Adam keeps block-wise quantized state: about a quarter of the bytes.
    Int8,
}

impl StateStorage {
    /// "fp32", "bf16", "int8".
    pub fn name(self) -> &'static str {
        match self {
            StateStorage::Fp32 => "fp32",
            StateStorage::Bf16 => "bf16",
            StateStorage::Int8 => "int8",
        }
    }

    /// Host bytes of `tensors` state tensors per parameter, scales included.
    pub fn bytes_per_param(self, tensors: u64) -> f64 {
        let each = match self {
            StateStorage::Fp32 => 4.0,
            StateStorage::Bf16 => 2.0,
            StateStorage::Int8 => 1.0 + 4.0 / QUANT_BLOCK as f64,
        };
        each * tensors as f64
    }
}

impl fmt::Display for StateStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for StateStorage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [StateStorage::Fp32, StateStorage::Bf16, StateStorage::Int8]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("optimizer state '{s}': one of fp32, bf16, int8"))
    }
}

/// Elements sharing one scale in [`StateStorage::Int8`].
pub const QUANT_BLOCK: usize = 256;

/// The loss scale a run starts with (torch's `GradScaler` default).
pub const DEFAULT_INITIAL_SCALE: f64 = 65536.0;
/// Factor the scale grows by after [`DEFAULT_GROWTH_INTERVAL`] clean steps.
pub const DEFAULT_GROWTH_FACTOR: f64 = 2.0;
/// Factor the scale shrinks by after a step with an infinite or NaN gradient.
pub const DEFAULT_BACKOFF_FACTOR: f64 = 0.5;
/// Clean steps in a row before the scale grows.
pub const DEFAULT_GROWTH_INTERVAL: u32 = 2000;

/// Dynamic loss scaling for fp16, with torch's `GradScaler` rules: the loss is multiplied by the
/// scale before backward and the gradients divided by it before the update; a step whose
/// gradients hold an infinity or NaN is skipped and the scale halves; after a run of clean steps
/// it doubles.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    clean_steps: u32,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new(DEFAULT_INITIAL_SCALE, DEFAULT_GROWTH_FACTOR, DEFAULT_BACKOFF_FACTOR, DEFAULT_GROWTH_INTERVAL)
    }
}

/// What one step's overflow check decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleUpdate {
    /// The step's gradients held an infinity or NaN: it is skipped.
    pub skipped: bool,
    /// The scale the step used.
    pub scale_used: f64,
    /// The scale the next step uses.
    pub next_scale: f64,
}

impl LossScaler {
    /// A scaler starting at `initial`, growing by `growth` after `interval` clean steps and
    /// shrinking by `backoff` after an overflow. Values out of range are clamped into it.
    pub fn new(initial: f64, growth: f64, backoff: f64, interval: u32) -> LossScaler {
        let finite_pos = |v: f64, d: f64| if v.is_finite() && v > 0.0 { v } else { d };
        LossScaler {
            scale: finite_pos(initial, DEFAULT_INITIAL_SCALE),
            growth_factor: finite_pos(growth, DEFAULT_GROWTH_FACTOR).max(1.0),
            backoff_factor: finite_pos(backoff, DEFAULT_BACKOFF_FACTOR).min(1.0),
            growth_interval: interval.max(1),
            clean_steps: 0,
        }
    }

    /// The scale the next backward multiplies the loss by.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Records the outcome of a step whose gradients were (`found_inf`) or were not finite.
    pub fn update(&mut self, found_inf: bool) -> ScaleUpdate {
        let used = self.scale;
        if found_inf {
            // Never below the smallest positive normal f32: a scale of 0 would zero every
            // gradient for good.
            self.scale = (self.scale * self.backoff_factor).max(f64::from(f32::MIN_POSITIVE));
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                let grown = self.scale * self.growth_factor;
                // As torch: the scale only grows while it stays finite in f32.
                if grown.is_finite() && grown <= f64::from(f32::MAX) {
                    self.scale = grown;
                }
                self.clean_steps = 0;
            }
        }
        ScaleUpdate {
            skipped: found_inf,
            scale_used: used,
            next_scale: self.scale,
        }
    }
}

// ---- 16-bit conversions ---------------------------------------------------------------------

#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Round to nearest even, as libtorch's float -> bfloat16 conversion (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let nan = ((bits >> 16) | 0x40) as u16;
    let rounding = 0x7fff + ((bits >> 16) & 1);
    let nearest = (bits.wrapping_add(rounding) >> 16) as u16;
    // A select rather than an early return: the loops that call this vectorize.
    if x.is_nan() {
        nan
    } else {
        nearest
    }
}

#[inline(always)]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// Round to nearest even (NaN stays NaN).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_say_what_is_expected() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
        }
        assert_eq!(" BF16 ".parse::<Precision>(), Ok(Precision::Bf16));
        let e = "fp8".parse::<Precision>().expect_err("unknown");
        assert!(e.contains("'fp8'") && e.contains("bf16"), "{e}");
        assert_eq!("int8".parse::<StateStorage>(), Ok(StateStorage::Int8));
        assert!("int4".parse::<StateStorage>().is_err());
        for q in QuantFormat::ALL {
            assert_eq!(q.name().parse::<QuantFormat>(), Ok(q));
        }
        assert_eq!("FP8".parse::<QuantFormat>(), Ok(QuantFormat::Fp8E4m3));
        let e = "nf4".parse::<QuantFormat>().expect_err("unknown");
        assert!(e.contains("'nf4'") && e.contains("int8"), "{e}");
    }

    #[test]
    fn host_bytes_follow_the_precision_and_the_state() {
        assert_eq!(Precision::Bf16.host_bytes_per_param(), 8);
        assert_eq!(Precision::Fp32.host_bytes_per_param(), 8);
        assert_eq!(Precision::Bf16.weight_bytes(), 2);
        assert_eq!(StateStorage::Fp32.bytes_per_param(2), 8.0);
        assert_eq!(StateStorage::Bf16.bytes_per_param(2), 4.0);
        assert!((StateStorage::Int8.bytes_per_param(2) - 2.03125).abs() < 1e-12);
    }

    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_clean_steps() {
        let mut s = LossScaler::new(1024.0, 2.0, 0.5, 3);
        let u = s.update(true);
        assert!(u.skipped);
        assert_eq!((u.scale_used, u.next_scale), (1024.0, 512.0));
        for _ in 0..2 {
            assert_eq!(s.update(false).next_scale, 512.0);
        }
        let u = s.update(false);
        assert_eq!((u.skipped, u.next_scale), (false, 1024.0));
        // An overflow resets the run of clean steps.
        s.update(false);
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
    }

    #[test]
    fn the_scale_stays_positive_and_finite() {
        let mut s = LossScaler::new(f64::NAN, 0.0, 7.0, 0);
        assert_eq!(s.scale(), DEFAULT_INITIAL_SCALE);
        for _ in 0..2000 {
            s.update(true);
        }
        assert!(s.scale() > 0.0);
        let mut s = LossScaler::new(f64::from(f32::MAX), 2.0, 0.5, 1);
        s.update(false);
        assert_eq!(s.scale(), f64::from(f32::MAX));
    }
}
