//! Options of the activation runtime, validated once by a builder. The defaults suit a 24 GB card
//! used on its own; the `Stagehand` handle derives every one of them from its budget instead.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// One mebibyte, the unit the `_mib` options are written in.
pub const MIB: u64 = 1 << 20;
/// Spilling switches on when device memory reaches this (a 24 GB card with 4 GB left for spikes).
pub const DEFAULT_HIGH_WATERMARK_BYTES: u64 = 20_000 * MIB;
/// Spilling switches off when device memory falls under this (4 GB of hysteresis, so it does not
/// flap around one level).
pub const DEFAULT_LOW_WATERMARK_BYTES: u64 = 16_000 * MIB;
/// Slab size of each class of the pinned pool, in MiB: powers of four, so no spill wastes more than
/// three quarters of its slab.
pub const DEFAULT_CLASS_SIZES_MIB: [u64; 5] = [1, 4, 16, 64, 256];
/// Slabs in each class: many small ones (most saved tensors are small), two of each larger class;
/// about 1.2 GB pinned. The handle sizes the pool from a traced step instead.
pub const DEFAULT_SLABS_PER_CLASS: [u32; 5] = [512, 2, 2, 2, 2];
/// Spill copies in flight before pack waits for the oldest. One would make every pack wait for the
/// previous copy, which serialises the forward on PCIe; copies queue on their own stream, so many
/// may fly while the compute stream runs on.
pub const DEFAULT_MAX_INFLIGHT_D2H: u32 = 64;
/// Predictive restores in flight (one would leave the copy engine idle between restores).
pub const DEFAULT_MAX_INFLIGHT_H2D: u32 = 4;
/// Tensors smaller than this are kept: a tiny spill is pure overhead.
pub const DEFAULT_MIN_SPILL_BYTES: u64 = 64 * 1024;
/// Fraction of the eligible bytes that may be spilled (Megatron's default: all of them).
pub const DEFAULT_SPILL_FRACTION: f64 = 1.0;
/// Region groups at the end of the forward kept on the device once the order is learned
/// (Megatron reserves a margin so the first backward ops never wait on a reload).
pub const DEFAULT_KEEP_TAIL_GROUPS: u32 = 1;
/// Spilled tensors the predictive restorer brings back ahead of backward.
pub const DEFAULT_RESTORE_LOOKAHEAD: u32 = 4;
/// Device bytes that restores issued ahead of need may occupy at once.
pub const DEFAULT_RESTORE_ALLOWANCE_BYTES: u64 = 512 * MIB;
/// CRC32C of every spill, verified at restore (off: a debugging aid: it
/// reads every spilled byte twice more on the training thread, see
/// [`crate::StagehandBuilder::checksums`] for what that costs).
pub const DEFAULT_DEBUG_CHECKSUMS: bool = false;
/// Publish events and per-step metrics (on: the runtime is observed by default).
pub const DEFAULT_TELEMETRY_ENABLED: bool = true;
/// When every fitting class is exhausted, spill into a buffer of its own, counted as a miss:
/// pinned on the spot on CUDA while the pinned limit allows (a pause to pin, the copy stays
/// asynchronous), else pageable memory (slower); either way the tensor still leaves the device.
pub const DEFAULT_PAGEABLE_FALLBACK: bool = true;
/// Rebuild the pool after the first step that spills, holding exactly what it held at once.
pub const DEFAULT_SIZE_POOL_FROM_TRACE: bool = true;
/// Most size classes a traced pool has.
pub const DEFAULT_MAX_POOL_CLASSES: u32 = 32;
/// Spilled tensors smaller than this are copied in batches: on an H100 a copy's fixed cost is a
/// quarter of a 1 MiB copy's time and 6% of a 4 MiB one's (`copies` bench, spill pattern).
pub const DEFAULT_BATCH_SPILLS_BELOW_BYTES: u64 = 4 * MIB;
/// Most bytes one batch of spills gathers.
pub const DEFAULT_SPILL_BATCH_BYTES: u64 = 16 * MIB;

/// Everything the activation runtime can be told. Build it with [`ActivationConfig::builder`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActivationConfig {
    /// Spilling turns on when allocated device bytes are at or above this.
    pub high_watermark_bytes: u64,
    /// Spilling turns off when allocated device bytes are below this.
    pub low_watermark_bytes: u64,
    /// Slab size of each pool class, ascending.
    pub class_sizes_bytes: Vec<u64>,
    /// Slabs in each class, parallel to `class_sizes_bytes`.
    pub slabs_per_class: Vec<u32>,
    /// Spill copies in flight before pack finalizes inline.
    pub max_inflight_d2h: u32,
    /// Predictive restores in flight.
    pub max_inflight_h2d: u32,
    /// Device bytes spills in flight may hold (their memory is freed only when their copy has
    /// landed): over it, pack waits for the oldest. Bounds how far memory overshoots the high
    /// watermark when the forward produces activations faster than PCIe moves them. `None`:
    /// only the count cap.
    pub max_inflight_spill_bytes: Option<u64>,
    /// Smaller saved tensors are kept.
    pub min_spill_bytes: u64,
    /// Fraction in [0, 1] of the eligible bytes that may be spilled.
    pub spill_fraction: f64,
    /// Spilled tensors smaller than this are copied in batches: each waits on the device with
    /// the other small tensors of its region until the region changes, the batch is full or
    /// backward begins; then one kernel gathers them into one buffer and one copy moves it into
    /// one slab, which saves each small copy's fixed cost on the copy engine. 0: every tensor is
    /// copied on its own.
    pub batch_spills_below_bytes: u64,
    /// Most bytes one batch gathers. While the gather runs the device holds a batch twice, so
    /// this bounds what batching adds to the peak.
    pub spill_batch_bytes: u64,
    /// Fraction in [0, 1] of the step's recompute scopes that recompute in backward, spread
    /// evenly over the step (1: every scope; 0: none). A scope that does not recompute runs as
    /// plain code: what it saves is kept or spilled like any saved tensor. Trades recomputation
    /// (GPU time) for spill traffic (PCIe time and pinned memory).
    #[serde(default = "all")]
    pub recompute_fraction: f64,
    /// A recomputation whose scope's output nothing saved stops at the function's last saved
    /// tensor (what the function computes after it is not needed in backward: a checkpointed
    /// block's last matmul). False runs every function to its end.
    #[serde(default = "yes")]
    pub recompute_early_stop: bool,
    /// Regions where spilling is allowed (empty: everywhere). A pattern matches a region path
    /// when it equals a run of its dotted segments: `mlp` matches `blocks.3.mlp`.
    pub regions: Vec<String>,
    /// Region groups at the end of the forward that stay on the device once learned (0: off).
    pub keep_tail_groups: u32,
    /// Most bytes those groups may hold together: fewer groups are kept when the last ones are
    /// larger (`None`: no limit). Bounds what the tail adds above the high watermark.
    pub tail_max_bytes: Option<u64>,
    /// Spilled tensors restored ahead of need (0: restore on demand only).
    pub restore_lookahead: u32,
    /// Device bytes restores ahead of need may hold at once.
    pub restore_allowance_bytes: u64,
    /// CRC32C of every spill, verified before its restore.
    pub debug_checksums: bool,
    /// Publish events and per-step metrics.
    pub telemetry_enabled: bool,
    /// Spill into a buffer of its own when the pool has no fitting slab (pinned on the spot on
    /// CUDA within `pinned_limit_bytes`, else pageable).
    pub pageable_fallback: bool,
    /// Rebuild the pool from the spills of the first step that spills (and again after a step
    /// that fell back to pageable memory), so steady-state steps find a slab for every spill.
    pub size_pool_from_trace: bool,
    /// Most size classes a traced pool has (more sizes share the next larger class).
    pub max_pool_classes: u32,
    /// Pinned bytes a traced pool, with the fallback buffers pinned beside it, may take at most
    /// (`None`: no limit).
    pub pinned_limit_bytes: Option<u64>,
    /// The least slabs each size class of a traced pool has (0: as many as the traced step
    /// held at once).
    pub min_slabs_per_class: u32,
}

impl Default for ActivationConfig {
    fn default() -> Self {
        ActivationConfig {
            high_watermark_bytes: DEFAULT_HIGH_WATERMARK_BYTES,
            low_watermark_bytes: DEFAULT_LOW_WATERMARK_BYTES,
            class_sizes_bytes: DEFAULT_CLASS_SIZES_MIB.iter().map(|m| m * MIB).collect(),
            slabs_per_class: DEFAULT_SLABS_PER_CLASS.to_vec(),
            max_inflight_d2h: DEFAULT_MAX_INFLIGHT_D2H,
            max_inflight_h2d: DEFAULT_MAX_INFLIGHT_H2D,
            max_inflight_spill_bytes: None,
            min_spill_bytes: DEFAULT_MIN_SPILL_BYTES,
            spill_fraction: DEFAULT_SPILL_FRACTION,
            batch_spills_below_bytes: DEFAULT_BATCH_SPILLS_BELOW_BYTES,
            spill_batch_bytes: DEFAULT_SPILL_BATCH_BYTES,
            recompute_fraction: 1.0,
            recompute_early_stop: true,
            regions: Vec::new(),
            keep_tail_groups: DEFAULT_KEEP_TAIL_GROUPS,
            tail_max_bytes: None,
            restore_lookahead: DEFAULT_RESTORE_LOOKAHEAD,
            restore_allowance_bytes: DEFAULT_RESTORE_ALLOWANCE_BYTES,
            debug_checksums: DEFAULT_DEBUG_CHECKSUMS,
            telemetry_enabled: DEFAULT_TELEMETRY_ENABLED,
            pageable_fallback: DEFAULT_PAGEABLE_FALLBACK,
            size_pool_from_trace: DEFAULT_SIZE_POOL_FROM_TRACE,
            max_pool_classes: DEFAULT_MAX_POOL_CLASSES,
            pinned_limit_bytes: None,
            min_slabs_per_class: 0,
        }
    }
}

fn all() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

/// A fraction setting outside [0, 1] (NaN included) is a config error naming `field`.
pub(crate) fn check_fraction(field: &'static str, value: f64) -> Result<()> {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(invalid(field, value, "a fraction in [0, 1]"))
    }
}

/// Batches of spills that could not take their own members are a config error.
pub(crate) fn check_batches(below_bytes: u64, max_bytes: u64) -> Result<()> {
    if below_bytes > 0 && max_bytes < below_bytes {
        return Err(invalid(
            "spill_batch_bytes",
            max_bytes,
            &format!("at least batch_spills_below_bytes ({below_bytes})"),
        ));
    }
    Ok(())
}

fn invalid(field: &'static str, value: impl std::fmt::Debug, expected: &str) -> Error {
    Error::Config {
        field,
        value: format!("{value:?}"),
        expected: expected.into(),
    }
}

impl ActivationConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> ActivationConfigBuilder {
        ActivationConfigBuilder {
            cfg: ActivationConfig::default(),
            uniform_slabs: None,
        }
    }

    /// Checks every rule; the builder calls this, deserialized configs should too.
    pub fn validate(&self) -> Result<()> {
        if self.high_watermark_bytes <= self.low_watermark_bytes {
            return Err(invalid(
                "high_watermark_bytes",
                self.high_watermark_bytes,
                &format!("greater than low_watermark_bytes ({})", self.low_watermark_bytes),
            ));
        }
        if self.class_sizes_bytes.contains(&0)
            || self.class_sizes_bytes.windows(2).any(|w| w[0] >= w[1])
        {
            return Err(invalid(
                "class_sizes_bytes",
                &self.class_sizes_bytes,
                "non-zero sizes in strictly ascending order",
            ));
        }
        if self.slabs_per_class.len() != self.class_sizes_bytes.len() {
            return Err(invalid(
                "slabs_per_class",
                &self.slabs_per_class,
                &format!("one count per class ({} classes)", self.class_sizes_bytes.len()),
            ));
        }
        check_fraction("spill_fraction", self.spill_fraction)?;
        check_fraction("recompute_fraction", self.recompute_fraction)?;
        check_batches(self.batch_spills_below_bytes, self.spill_batch_bytes)?;
        if self.max_inflight_d2h == 0 {
            return Err(invalid("max_inflight_d2h", 0, "at least 1"));
        }
        if self.max_inflight_h2d == 0 {
            return Err(invalid("max_inflight_h2d", 0, "at least 1"));
        }
        if self.regions.iter().any(|r| r.is_empty()) {
            return Err(invalid("regions", &self.regions, "non-empty region names"));
        }
        Ok(())
    }
}

/// Sets options one by one; [`build`](ActivationConfigBuilder::build) validates them once.
#[derive(Debug, Clone)]
pub struct ActivationConfigBuilder {
    cfg: ActivationConfig,
    uniform_slabs: Option<u32>,
}

impl ActivationConfigBuilder {
    /// High and low watermarks in MiB (saturating: a huge value is refused by `build`, not wrapped).
    pub fn watermarks_mib(self, high: u64, low: u64) -> Self {
        self.watermarks_bytes(high.saturating_mul(MIB), low.saturating_mul(MIB))
    }
    /// High and low watermarks in bytes.
    pub fn watermarks_bytes(mut self, high: u64, low: u64) -> Self {
        self.cfg.high_watermark_bytes = high;
        self.cfg.low_watermark_bytes = low;
        self
    }
    /// Pool class sizes in MiB (saturating, as the watermarks).
    pub fn classes_mib(self, sizes: &[u64]) -> Self {
        let bytes: Vec<u64> = sizes.iter().map(|m| m.saturating_mul(MIB)).collect();
        self.classes_bytes(&bytes)
    }
    /// Pool class sizes in bytes.
    pub fn classes_bytes(mut self, sizes: &[u64]) -> Self {
        self.cfg.class_sizes_bytes = sizes.to_vec();
        self
    }
    /// Slabs per class, parallel to the classes.
    pub fn slabs_per_class(mut self, counts: &[u32]) -> Self {
        self.cfg.slabs_per_class = counts.to_vec();
        self.uniform_slabs = None;
        self
    }
    /// The same slab count for every class.
    pub fn uniform_slabs(mut self, count: u32) -> Self {
        self.uniform_slabs = Some(count);
        self
    }
    /// In-flight caps for spills (D2H) and predictive restores (H2D).
    pub fn max_inflight(mut self, d2h: u32, h2d: u32) -> Self {
        self.cfg.max_inflight_d2h = d2h;
        self.cfg.max_inflight_h2d = h2d;
        self
    }
    /// Device bytes spills in flight may hold before pack waits for the oldest.
    pub fn max_inflight_spill_bytes(mut self, bytes: Option<u64>) -> Self {
        self.cfg.max_inflight_spill_bytes = bytes;
        self
    }
    /// Minimum bytes of a tensor to spill.
    pub fn min_spill_bytes(mut self, bytes: u64) -> Self {
        self.cfg.min_spill_bytes = bytes;
        self
    }
    /// Fraction of the eligible bytes to spill.
    pub fn spill_fraction(mut self, fraction: f64) -> Self {
        self.cfg.spill_fraction = fraction;
        self
    }
    /// Batches of spills: tensors under `below_bytes` are copied together, up to `max_bytes` a
    /// batch (see [`ActivationConfig::batch_spills_below_bytes`]; 0: every tensor alone).
    pub fn spill_batches(mut self, below_bytes: u64, max_bytes: u64) -> Self {
        self.cfg.batch_spills_below_bytes = below_bytes;
        self.cfg.spill_batch_bytes = max_bytes;
        self
    }
    /// Fraction of the recompute scopes that recompute (see
    /// [`ActivationConfig::recompute_fraction`]).
    pub fn recompute_fraction(mut self, fraction: f64) -> Self {
        self.cfg.recompute_fraction = fraction;
        self
    }
    /// Whether recomputations stop at their last saved tensor (see
    /// [`ActivationConfig::recompute_early_stop`]).
    pub fn recompute_early_stop(mut self, on: bool) -> Self {
        self.cfg.recompute_early_stop = on;
        self
    }
    /// Regions where spilling is allowed.
    pub fn regions<S: Into<String>>(mut self, regions: impl IntoIterator<Item = S>) -> Self {
        self.cfg.regions = regions.into_iter().map(Into::into).collect();
        self
    }
    /// Region groups at the end of the forward kept on the device (0: off).
    pub fn keep_tail_groups(mut self, groups: u32) -> Self {
        self.cfg.keep_tail_groups = groups;
        self
    }
    /// Most bytes the kept tail groups may hold together.
    pub fn tail_max_bytes(mut self, bytes: Option<u64>) -> Self {
        self.cfg.tail_max_bytes = bytes;
        self
    }
    /// Predictive restore depth and its device allowance.
    pub fn restore_ahead(mut self, lookahead: u32, allowance_bytes: u64) -> Self {
        self.cfg.restore_lookahead = lookahead;
        self.cfg.restore_allowance_bytes = allowance_bytes;
        self
    }
    /// CRC32C on spill, verified before restore.
    pub fn debug_checksums(mut self, on: bool) -> Self {
        self.cfg.debug_checksums = on;
        self
    }
    /// Events and per-step metrics.
    pub fn telemetry(mut self, on: bool) -> Self {
        self.cfg.telemetry_enabled = on;
        self
    }
    /// Spill into a buffer of its own when the pool has no fitting slab (pinned on the spot on
    /// CUDA within the pinned limit, else pageable).
    pub fn pageable_fallback(mut self, on: bool) -> Self {
        self.cfg.pageable_fallback = on;
        self
    }
    /// Rebuild the pool from a traced step (on by default), at most `limit` pinned bytes.
    pub fn size_pool_from_trace(mut self, on: bool, limit: Option<u64>) -> Self {
        self.cfg.size_pool_from_trace = on;
        self.cfg.pinned_limit_bytes = limit;
        self
    }
    /// The least slabs each size class of a traced pool has.
    pub fn min_slabs_per_class(mut self, slabs: u32) -> Self {
        self.cfg.min_slabs_per_class = slabs;
        self
    }
    /// Validates and returns the configuration.
    pub fn build(mut self) -> Result<ActivationConfig> {
        if let Some(n) = self.uniform_slabs {
            self.cfg.slabs_per_class = vec![n; self.cfg.class_sizes_bytes.len()];
        }
        self.cfg.validate()?;
        Ok(self.cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let c = ActivationConfig::default();
        c.validate().expect("defaults are valid");
        assert_eq!(c.high_watermark_bytes, 20_000 * MIB);
        assert_eq!(c.low_watermark_bytes, 16_000 * MIB);
        assert_eq!(c.class_sizes_bytes, vec![MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]);
        assert_eq!(c.slabs_per_class, vec![512, 2, 2, 2, 2]);
        assert_eq!((c.max_inflight_d2h, c.max_inflight_h2d), (64, 4));
        assert!(!c.debug_checksums && c.telemetry_enabled);
    }

    #[test]
    fn builder_rejects_bad_values_with_the_field_named() {
        let e = ActivationConfig::builder().watermarks_mib(10, 10).build().expect_err("high == low");
        assert!(e.to_string().contains("high_watermark_bytes"), "{e}");
        let e = ActivationConfig::builder()
            .classes_mib(&[1, 4])
            .slabs_per_class(&[1, 2, 3])
            .build()
            .expect_err("not parallel");
        assert!(e.to_string().contains("slabs_per_class"), "{e}");
        let e = ActivationConfig::builder().classes_mib(&[4, 1]).uniform_slabs(1).build().expect_err("descending");
        assert!(e.to_string().contains("class_sizes_bytes"), "{e}");
        let e = ActivationConfig::builder().spill_fraction(1.5).build().expect_err("fraction");
        assert!(e.to_string().contains("spill_fraction"), "{e}");
        for bad in [-0.1, 1.01, f64::NAN] {
            let e = ActivationConfig::builder().recompute_fraction(bad).build().expect_err("fraction");
            assert!(e.to_string().contains("recompute_fraction"), "{e}");
        }
        let e = ActivationConfig::builder().max_inflight(0, 1).build().expect_err("cap");
        assert!(e.to_string().contains("max_inflight_d2h"), "{e}");
    }

    #[test]
    fn uniform_slabs_follow_the_classes() {
        let c = ActivationConfig::builder().classes_mib(&[1, 2, 8]).uniform_slabs(3).build().expect("valid");
        assert_eq!(c.slabs_per_class, vec![3, 3, 3]);
    }
}
