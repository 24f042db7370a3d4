//! Configuration of the weight runtime: defaults for a 24 GB card used on its own, as named
//! constants (the `Stagehand` handle derives its own from the budget), a builder that validates
//! once, and the layer-mode auto-sizing rules.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;

fn on() -> bool {
    true
}

/// Total pinned staging pool (8 GiB: room to stage a large model's blocks ahead).
pub const DEFAULT_PINNED_POOL_BYTES: u64 = 8192 * MIB;
/// One slab of the pinned pool (256 MiB: a transformer block of a few billion parameters).
pub const DEFAULT_PINNED_SLAB_BYTES: u64 = 256 * MIB;
/// Slab sizes are rounded up to this many bytes (DMA-friendly offsets).
pub const DEFAULT_SLAB_ALIGNMENT: u64 = 512;
/// Evict at or above this many allocated device bytes (a 24 GB card with 2 GB left).
pub const DEFAULT_VRAM_HIGH_WATERMARK_BYTES: u64 = 22000 * MIB;
/// Evict until strictly below this many allocated device bytes (4 GB of hysteresis).
pub const DEFAULT_VRAM_LOW_WATERMARK_BYTES: u64 = 18000 * MIB;
/// H2D copies in flight at once before speculative prefetch holds back (two keep the copy engine
/// busy while one lands).
pub const DEFAULT_MAX_INFLIGHT_H2D: u32 = 2;
/// Blocks prefetched ahead of the one running.
pub const DEFAULT_PREFETCH_WINDOW: u32 = 3;
// The layout's alignment is the registry's (it lays blocks out); named here too, beside the
// other constants a configuration is made of.
pub use super::registry::PARAM_ALIGNMENT;
/// Layer mode: high watermark as a fraction of the VRAM budget.
pub const LAYER_HIGH_WATERMARK_FRACTION: f64 = 0.8;
/// Layer mode: low watermark as a fraction of the VRAM budget.
pub const LAYER_LOW_WATERMARK_FRACTION: f64 = 0.6;
/// Layer mode: pool slabs beyond the prefetch window (`pool = slab × (prefetch_k + 4)`).
pub const LAYER_POOL_EXTRA_SLABS: u64 = 4;

/// Settings of one weight runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightConfig {
    /// Bytes of the pinned staging pool (file-backed blocks are staged through it).
    pub pinned_pool_bytes: u64,
    /// Bytes of one slab; must divide the pool. A block larger than a slab is refused.
    pub pinned_slab_bytes: u64,
    /// Slab size rounding.
    pub slab_alignment: u64,
    /// Allocated device bytes at which eviction starts and prefetch stops.
    pub vram_high_watermark_bytes: u64,
    /// Eviction continues until allocated device bytes are below this.
    pub vram_low_watermark_bytes: u64,
    /// Most device bytes that resident and in-flight blocks may hold together (the hard
    /// budget that eviction enforces before every load). `None`: the high watermark.
    pub weight_budget_bytes: Option<u64>,
    /// H2D copies in flight before speculative prefetch holds back.
    pub max_inflight_h2d: u32,
    /// Blocks prefetched ahead along the itinerary.
    pub prefetch_window: u32,
    /// No backward: the itinerary is the forward order alone.
    pub inference_mode: bool,
    /// In inference mode, keep all but two of the room's slots on blocks spread evenly along the
    /// forward (never evicted while the itinerary holds) and stream the rest through the other
    /// two, so every copy overlaps compute (the choice is `weights::evictor::spread_pins`). Off: Belady's
    /// choice alone, which moves fewer bytes but leaves the copy engine idle while the blocks it
    /// keeps compute.
    #[serde(default = "on")]
    pub cyclic_pins: bool,
    /// Device bytes of gradients on their way to the host at most: past it, the training
    /// thread waits for the oldest copies (`None`: no bound). A copy holds its gradient's
    /// device memory until it lands, and with the training thread far ahead of the GPU every
    /// block backward has left would otherwise hold its gradients at once.
    #[serde(default)]
    pub max_inflight_grad_bytes: Option<u64>,
    /// Gradient accumulation (micro-batches, a weight used twice): a later gradient of the
    /// window is copied to the host and added there into the sum so far by a worker thread (on),
    /// or the sum comes back to the device to take it in there and is copied home again (off,
    /// the default). On saves the link a copy each way per gradient and costs host memory
    /// bandwidth and cores: on an H100's 16-core host it was the slower of the two (the
    /// benchmark notes, "Gradient sums on the host").
    #[serde(default)]
    pub host_gradient_sums: bool,
    /// Where the weights' room came from, for error messages ("a quarter of the 4096 MiB
    /// budget"); empty: the field it was set by.
    #[serde(default)]
    pub room_origin: String,
    /// What the blocks stream and compute in: under mixed precision (bf16, fp16) floating
    /// parameters are registered in the 16-bit dtype, trained ones with a float32 master on the
    /// host ([`crate::precision`]).
    #[serde(default)]
    pub precision: crate::precision::Precision,
    /// How file-backed blocks' bytes are checked at each load against their first read:
    /// sampled (the default) or every byte (see [`FileCheck`](super::file::FileCheck)).
    #[serde(default)]
    pub file_check: super::file::FileCheck,
}

impl Default for WeightConfig {
    fn default() -> Self {
        WeightConfig {
            pinned_pool_bytes: DEFAULT_PINNED_POOL_BYTES,
            pinned_slab_bytes: DEFAULT_PINNED_SLAB_BYTES,
            slab_alignment: DEFAULT_SLAB_ALIGNMENT,
            vram_high_watermark_bytes: DEFAULT_VRAM_HIGH_WATERMARK_BYTES,
            vram_low_watermark_bytes: DEFAULT_VRAM_LOW_WATERMARK_BYTES,
            weight_budget_bytes: None,
            max_inflight_h2d: DEFAULT_MAX_INFLIGHT_H2D,
            prefetch_window: DEFAULT_PREFETCH_WINDOW,
            inference_mode: false,
            cyclic_pins: true,
            max_inflight_grad_bytes: None,
            host_gradient_sums: false,
            room_origin: String::new(),
            precision: crate::precision::Precision::Fp32,
            file_check: super::file::FileCheck::Sampled,
        }
    }
}

impl WeightConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> WeightConfigBuilder {
        WeightConfigBuilder {
            cfg: WeightConfig::default(),
        }
    }

    /// The slab size after alignment rounding.
    pub fn slab_bytes(&self) -> u64 {
        let a = self.slab_alignment.max(1);
        self.pinned_slab_bytes.div_ceil(a) * a
    }

    /// Number of slabs in the pool.
    pub fn num_slabs(&self) -> u64 {
        self.pinned_pool_bytes / self.pinned_slab_bytes.max(1)
    }

    /// The hard budget for resident blocks.
    pub fn weight_budget(&self) -> u64 {
        self.weight_budget_bytes
            .unwrap_or(self.vram_high_watermark_bytes)
    }

    /// Where the weights' room comes from, in words.
    pub fn room_source(&self) -> String {
        if !self.room_origin.is_empty() {
            self.room_origin.clone()
        } else if self.weight_budget_bytes.is_some() {
            "weight_budget_bytes".into()
        } else {
            format!("the high watermark vram_high_watermark_bytes = {}", self.vram_high_watermark_bytes)
        }
    }

    /// Checks every field; the error names the field, the value and what was expected.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: u64, expected: &str| Error::Config {
            field,
            value: value.to_string(),
            expected: expected.into(),
        };
        if self.pinned_slab_bytes == 0 {
            return Err(bad("pinned_slab_bytes", 0, "more than 0"));
        }
        if self.pinned_pool_bytes == 0 || self.pinned_pool_bytes % self.pinned_slab_bytes != 0 {
            return Err(bad(
                "pinned_pool_bytes",
                self.pinned_pool_bytes,
                &format!("a positive multiple of the slab size {}", self.pinned_slab_bytes),
            ));
        }
        if self.slab_alignment == 0 {
            return Err(bad("slab_alignment", 0, "more than 0"));
        }
        if self.vram_high_watermark_bytes <= self.vram_low_watermark_bytes {
            return Err(bad(
                "vram_high_watermark_bytes",
                self.vram_high_watermark_bytes,
                &format!(
                    "more than the low watermark {}",
                    self.vram_low_watermark_bytes
                ),
            ));
        }
        if self.weight_budget_bytes == Some(0) {
            return Err(bad("weight_budget_bytes", 0, "more than 0"));
        }
        if self.max_inflight_h2d == 0 {
            return Err(bad("max_inflight_h2d", 0, "at least 1"));
        }
        Ok(())
    }

    /// Layer mode's auto-sizing: slab = next power of two MiB at or above the largest
    /// layer (at least 1 MiB); pool = slab × (prefetch_k + 4), or with a pinned RAM budget
    /// `max(slab, ⌊ram / slab⌋ · slab)`; watermarks 80 % / 60 % of the VRAM budget (else of the
    /// device's memory, else the block-mode defaults).
    pub fn layer_auto(
        largest_layer_bytes: u64,
        prefetch_k: u32,
        vram_budget: Option<u64>,
        ram_budget: Option<u64>,
        device_total: Option<u64>,
    ) -> WeightConfig {
        let slab_mib = largest_layer_bytes.div_ceil(MIB).max(1).next_power_of_two();
        let slab = slab_mib * MIB;
        let pool = match ram_budget {
            Some(ram) => ((ram / slab) * slab).max(slab),
            None => slab * (u64::from(prefetch_k) + LAYER_POOL_EXTRA_SLABS),
        };
        let (high, low) = match vram_budget.or(device_total) {
            Some(total) => {
                let high = (total as f64 * LAYER_HIGH_WATERMARK_FRACTION) as u64;
                let low = (total as f64 * LAYER_LOW_WATERMARK_FRACTION) as u64;
                (high.max(low + 1), low)
            }
            None => (
                DEFAULT_VRAM_HIGH_WATERMARK_BYTES,
                DEFAULT_VRAM_LOW_WATERMARK_BYTES,
            ),
        };
        WeightConfig {
            pinned_pool_bytes: pool,
            pinned_slab_bytes: slab,
            vram_high_watermark_bytes: high,
            vram_low_watermark_bytes: low,
            prefetch_window: prefetch_k,
            ..WeightConfig::default()
        }
    }
}

/// Builds a [`WeightConfig`], validating once in [`build`](WeightConfigBuilder::build).
#[derive(Debug, Clone)]
pub struct WeightConfigBuilder {
    cfg: WeightConfig,
}

impl WeightConfigBuilder {
    /// Pool and slab sizes in bytes.
    pub fn pool(mut self, pool_bytes: u64, slab_bytes: u64) -> Self {
        self.cfg.pinned_pool_bytes = pool_bytes;
        self.cfg.pinned_slab_bytes = slab_bytes;
        self
    }
    /// High and low VRAM watermarks in bytes.
    pub fn watermarks(mut self, high: u64, low: u64) -> Self {
        self.cfg.vram_high_watermark_bytes = high;
        self.cfg.vram_low_watermark_bytes = low;
        self
    }
    /// The hard budget for resident blocks in bytes.
    pub fn weight_budget(mut self, bytes: u64) -> Self {
        self.cfg.weight_budget_bytes = Some(bytes);
        self
    }
    /// Prefetch depth in blocks.
    pub fn prefetch_window(mut self, k: u32) -> Self {
        self.cfg.prefetch_window = k;
        self
    }
    /// H2D copies in flight at once.
    pub fn max_inflight_h2d(mut self, n: u32) -> Self {
        self.cfg.max_inflight_h2d = n;
        self
    }
    /// Forward only (no backward part in the itinerary).
    pub fn inference_mode(mut self, on: bool) -> Self {
        self.cfg.inference_mode = on;
        self
    }
    /// In inference mode, blocks pinned along the forward so that copies overlap compute
    /// (default on; see [`WeightConfig::cyclic_pins`]).
    pub fn cyclic_pins(mut self, on: bool) -> Self {
        self.cfg.cyclic_pins = on;
        self
    }
    /// How file-backed blocks' bytes are checked at each load (default sampled; see
    /// [`WeightConfig::file_check`]).
    pub fn file_check(mut self, check: super::file::FileCheck) -> Self {
        self.cfg.file_check = check;
        self
    }
    /// Most device bytes of gradients in flight to the host.
    pub fn max_inflight_grad_bytes(mut self, bytes: Option<u64>) -> Self {
        self.cfg.max_inflight_grad_bytes = bytes;
        self
    }
    /// Where later gradients of an accumulation window are added ([`WeightConfig::host_gradient_sums`]).
    pub fn host_gradient_sums(mut self, on: bool) -> Self {
        self.cfg.host_gradient_sums = on;
        self
    }
    /// The validated config.
    pub fn build(self) -> Result<WeightConfig> {
        self.cfg.validate()?;
        Ok(self.cfg)
    }
}

/// Parses a byte size as the config files write it: `"8GB"` (×2^30, fractions allowed), `"512MB"`
/// (×2^20), `"100B"`, or a bare number of bytes; case-insensitive.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("GB") {
        (n, 1u64 << 30)
    } else if let Some(n) = t.strip_suffix("MB") {
        (n, MIB)
    } else if let Some(n) = t.strip_suffix('B') {
        (n, 1)
    } else {
        (t.as_str(), 1)
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok((v * mult as f64) as u64),
        _ => Err(Error::Config {
            field: "budget",
            value: format!("'{s}'"),
            expected: "a size like '8GB', '512MB', '100B' or a number of bytes".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_python_originals_and_valid() {
        let c = WeightConfig::default();
        c.validate().expect("defaults are valid");
        assert_eq!(c.num_slabs(), 32);
        assert_eq!(c.weight_budget(), 22000 * MIB);
    }

    #[test]
    fn builder_rejects_bad_values_with_the_field_named() {
        let e = WeightConfig::builder().watermarks(10, 20).build().expect_err("high <= low");
        assert!(e.to_string().contains("vram_high_watermark_bytes = 10"), "{e}");
        let e = WeightConfig::builder().pool(1000, 300).build().expect_err("not a multiple");
        assert!(e.to_string().contains("pinned_pool_bytes = 1000"), "{e}");
        let e = WeightConfig::builder().max_inflight_h2d(0).build().expect_err("zero");
        assert!(e.to_string().contains("max_inflight_h2d"), "{e}");
    }

    #[test]
    fn layer_auto_sizing_follows_the_python_original() {
        let c = WeightConfig::layer_auto(3 * MIB + 1, 3, Some(10_000 * MIB), None, None);
        assert_eq!(c.pinned_slab_bytes, 4 * MIB);
        assert_eq!(c.pinned_pool_bytes, 4 * MIB * 7);
        assert_eq!(c.vram_high_watermark_bytes, 8000 * MIB);
        assert_eq!(c.vram_low_watermark_bytes, 6000 * MIB);
        let c = WeightConfig::layer_auto(10, 3, None, Some(9 * MIB), None);
        assert_eq!(c.pinned_slab_bytes, MIB);
        assert_eq!(c.pinned_pool_bytes, 9 * MIB);
        c.validate().expect("auto config is valid");
    }

    #[test]
    fn byte_sizes_parse_like_the_python_original() {
        assert_eq!(parse_bytes("8GB").expect("gb"), 8 << 30);
        assert_eq!(parse_bytes("1.5gb").expect("gb"), 3 << 29);
        assert_eq!(parse_bytes("512MB").expect("mb"), 512 << 20);
        assert_eq!(parse_bytes("100B").expect("b"), 100);
        assert_eq!(parse_bytes("4096").expect("n"), 4096);
        assert!(parse_bytes("lots").is_err());
    }
}
