//! Conductor configuration and its validating builder.

use super::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Whether a Conductor built from a config coordinates anything. A config is usually built to
/// be used; [`super::Conductor::disabled`] is the explicit off switch.
pub const DEFAULT_ENABLED: bool = true;
/// VRAM soft cap in MiB, for a 24 GB card. HARD, SOFT and FLOOR reservations and the
/// backward-pressure rule are measured against it.
pub const DEFAULT_VRAM_SOFT_CAP_MIB: u64 = 22_000;
/// VRAM hard cap in MiB, for a 24 GB card. Only BURST reservations may reach it.
pub const DEFAULT_VRAM_HARD_CAP_MIB: u64 = 23_500;
/// Pinned host memory the Conductor may grant, in MiB: the weights' default 8 GiB pool plus the
/// activation slab pool, rounded up.
pub const DEFAULT_PINNED_CAP_MIB: u64 = 10_240;
/// Concurrent host-to-device copies (two keep the copy engine busy while one lands).
pub const DEFAULT_H2D_SLOTS: u32 = 2;
/// Concurrent device-to-host copies (the same for the other direction).
pub const DEFAULT_D2H_SLOTS: u32 = 2;
/// Publish a `conductor_step` metrics event every this many steps.
pub const DEFAULT_TELEMETRY_INTERVAL_STEPS: u64 = 1;
/// Publish every slot grant and release, not only decisions that refuse or limit something.
pub const DEFAULT_DEBUG_EVENT_TRACE: bool = true;
/// Headroom, in MiB, that each priority level below CRITICAL must leave for the levels above
/// it: REQUIRED leaves 1x, SPECULATIVE 2x, BACKGROUND 3x.
pub const DEFAULT_PRIORITY_RESERVE_MIB: u64 = 256;
/// Rule 1 fires when VRAM in use exceeds this fraction of the soft cap during backward.
pub const DEFAULT_BACKWARD_PRESSURE_FRACTION: f64 = 0.8;
/// Rule 3 fires when a slot pool was full on more than this many consecutive checks.
pub const DEFAULT_CONTENTION_CHECKS: u32 = 3;
/// Prefetch window that rule 3 starts shrinking from when no attached runtime reports its
/// own (the Python weight runtime's `prefetch_window_blocks`).
pub const DEFAULT_PREFETCH_WINDOW: u32 = 3;

const MIB: u64 = 1 << 20;

/// Configuration of the Conductor. Missing fields take the `DEFAULT_*` values. In JSON the MiB
/// fields keep the original Python Stagehand's names (`vram_soft_cap_mb`, ...), so its config
/// files parse; errors name the field as the file does.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ConductorConfig {
    /// False: the Conductor allocates nothing and every method is a no-op that says proceed.
    pub enabled: bool,
    #[serde(rename = "vram_soft_cap_mb")]
    pub vram_soft_cap_mib: u64,
    #[serde(rename = "vram_hard_cap_mb")]
    pub vram_hard_cap_mib: u64,
    #[serde(rename = "pinned_cap_mb")]
    pub pinned_cap_mib: u64,
    pub h2d_slots: u32,
    pub d2h_slots: u32,
    pub telemetry_interval_steps: u64,
    pub debug_event_trace: bool,
    #[serde(rename = "priority_reserve_mb")]
    pub priority_reserve_mib: u64,
    pub backward_pressure_fraction: f64,
    pub contention_checks: u32,
    pub default_prefetch_window: u32,
}

impl Default for ConductorConfig {
    fn default() -> Self {
        ConductorConfig {
            enabled: DEFAULT_ENABLED,
            vram_soft_cap_mib: DEFAULT_VRAM_SOFT_CAP_MIB,
            vram_hard_cap_mib: DEFAULT_VRAM_HARD_CAP_MIB,
            pinned_cap_mib: DEFAULT_PINNED_CAP_MIB,
            h2d_slots: DEFAULT_H2D_SLOTS,
            d2h_slots: DEFAULT_D2H_SLOTS,
            telemetry_interval_steps: DEFAULT_TELEMETRY_INTERVAL_STEPS,
            debug_event_trace: DEFAULT_DEBUG_EVENT_TRACE,
            priority_reserve_mib: DEFAULT_PRIORITY_RESERVE_MIB,
            backward_pressure_fraction: DEFAULT_BACKWARD_PRESSURE_FRACTION,
            contention_checks: DEFAULT_CONTENTION_CHECKS,
            default_prefetch_window: DEFAULT_PREFETCH_WINDOW,
        }
    }
}

impl ConductorConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> ConductorConfigBuilder {
        ConductorConfigBuilder {
            config: ConductorConfig::default(),
        }
    }

    /// Checks every field once; the Conductor only accepts validated configs.
    pub fn validate(&self) -> Result<()> {
        fn bad(field: &'static str, value: impl ToString, expected: &'static str) -> Error {
            Error::InvalidConfig {
                field,
                value: value.to_string(),
                expected,
            }
        }
        if !self.enabled {
            return Ok(());
        }
        if self.vram_soft_cap_mib == 0 {
            return Err(bad("vram_soft_cap_mb", 0, "a positive number of MiB"));
        }
        if self.vram_hard_cap_mib < self.vram_soft_cap_mib {
            return Err(bad(
                "vram_hard_cap_mb",
                self.vram_hard_cap_mib,
                "at least vram_soft_cap_mb",
            ));
        }
        if self.h2d_slots == 0 {
            return Err(bad("h2d_slots", 0, "at least 1"));
        }
        if self.d2h_slots == 0 {
            return Err(bad("d2h_slots", 0, "at least 1"));
        }
        if self.telemetry_interval_steps == 0 {
            return Err(bad("telemetry_interval_steps", 0, "at least 1"));
        }
        if !(self.backward_pressure_fraction > 0.0 && self.backward_pressure_fraction <= 1.0) {
            return Err(bad(
                "backward_pressure_fraction",
                self.backward_pressure_fraction,
                "a fraction in (0, 1]",
            ));
        }
        if self.default_prefetch_window == 0 {
            return Err(bad("default_prefetch_window", 0, "at least 1"));
        }
        Ok(())
    }

    /// The VRAM soft cap in bytes.
    pub fn vram_soft_cap_bytes(&self) -> u64 {
        self.vram_soft_cap_mib.saturating_mul(MIB)
    }

    /// The VRAM hard cap in bytes.
    pub fn vram_hard_cap_bytes(&self) -> u64 {
        self.vram_hard_cap_mib.saturating_mul(MIB)
    }

    /// The pinned host cap in bytes.
    pub fn pinned_cap_bytes(&self) -> u64 {
        self.pinned_cap_mib.saturating_mul(MIB)
    }

    /// The priority reserve unit in bytes.
    pub fn priority_reserve_bytes(&self) -> u64 {
        self.priority_reserve_mib.saturating_mul(MIB)
    }
}

/// Builds a [`ConductorConfig`], validating once in [`ConductorConfigBuilder::build`].
#[derive(Debug, Clone)]
pub struct ConductorConfigBuilder {
    config: ConductorConfig,
}

macro_rules! setter {
    ($($(#[$m:meta])* $name:ident: $ty:ty),* $(,)?) => {
        $(
            $(#[$m])*
            pub fn $name(mut self, v: $ty) -> Self {
                self.config.$name = v;
                self
            }
        )*
    };
}

impl ConductorConfigBuilder {
    setter!(
        /// See [`ConductorConfig::enabled`].
        enabled: bool,
        /// VRAM soft cap in MiB.
        vram_soft_cap_mib: u64,
        /// VRAM hard cap in MiB.
        vram_hard_cap_mib: u64,
        /// Pinned host cap in MiB.
        pinned_cap_mib: u64,
        /// H2D slot count.
        h2d_slots: u32,
        /// D2H slot count.
        d2h_slots: u32,
        /// Steps between `conductor_step` events.
        telemetry_interval_steps: u64,
        /// Publish every slot grant and release.
        debug_event_trace: bool,
        /// Priority reserve unit in MiB.
        priority_reserve_mib: u64,
        /// Rule 1 threshold as a fraction of the soft cap.
        backward_pressure_fraction: f64,
        /// Rule 3 consecutive full checks.
        contention_checks: u32,
        /// Rule 3 starting window when no runtime reports one.
        default_prefetch_window: u32,
    );

    /// Validates and returns the config.
    pub fn build(self) -> Result<ConductorConfig> {
        self.config.validate()?;
        Ok(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_python_originals_example_and_valid() {
        let c = ConductorConfig::default();
        assert_eq!((c.vram_soft_cap_mib, c.vram_hard_cap_mib), (22_000, 23_500));
        assert_eq!((c.h2d_slots, c.d2h_slots), (2, 2));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn builder_rejects_hard_cap_below_soft_cap() {
        let err = ConductorConfig::builder()
            .vram_soft_cap_mib(1000)
            .vram_hard_cap_mib(900)
            .build()
            .expect_err("hard < soft");
        assert!(matches!(
            err,
            Error::InvalidConfig {
                field: "vram_hard_cap_mb",
                ..
            }
        ));
        assert!(err.to_string().contains("900"));
    }

    #[test]
    fn builder_rejects_zero_slots_and_bad_fraction() {
        assert!(ConductorConfig::builder().h2d_slots(0).build().is_err());
        assert!(ConductorConfig::builder().d2h_slots(0).build().is_err());
        assert!(ConductorConfig::builder()
            .backward_pressure_fraction(1.5)
            .build()
            .is_err());
        assert!(ConductorConfig::builder()
            .telemetry_interval_steps(0)
            .build()
            .is_err());
    }

    #[test]
    fn python_json_config_parses_with_defaults_for_the_rest() {
        let c: ConductorConfig = serde_json::from_str(
            r#"{"enabled": true, "vram_soft_cap_mb": 22000, "vram_hard_cap_mb": 23500,
                "h2d_slots": 2, "d2h_slots": 2}"#,
        )
        .expect("parses");
        assert_eq!(c.telemetry_interval_steps, DEFAULT_TELEMETRY_INTERVAL_STEPS);
        assert!(c.validate().is_ok());
        let off: ConductorConfig = serde_json::from_str(r#"{"enabled": false, "h2d_slots": 0}"#)
            .expect("parses");
        assert!(off.validate().is_ok(), "a disabled config is never used");
    }
}
