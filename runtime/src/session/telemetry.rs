//! The handle's telemetry, numeric guards and checksums of spilled activations, chosen on the
//! builder.
//!
//! Telemetry goes through [`crate::events::telemetry::attach`]: a file at a [`Level`] (plain or
//! zstd, rotated by size) and the flight recorder, which keeps the last steps in full detail
//! and writes them to a file of their own when a step stalls, a pool runs out, a copy falls back
//! to pageable memory, the device runs out of memory or a guard finds a NaN. The default
//! configuration (summary level, recorder on) keeps a long run small while the moments that need
//! explaining keep every event.
//!
//! [`Level`]: crate::events::Level

use super::{Stagehand, StagehandBuilder};
use crate::events::telemetry::{Level, Telemetry, TelemetryConfig};
use crate::events::{EventKind, VramByOwner};

impl StagehandBuilder {
    /// Attaches telemetry when the handle is built, before anything is published: the file
    /// `config` describes and the flight recorder. Building fails when the file cannot be made
    /// (it exists, its folder is missing).
    ///
    /// ```no_run
    /// use stagehand::events::{Level, TelemetryConfig};
    /// # fn main() -> stagehand::Result<()> {
    /// let sh = stagehand::Stagehand::builder()
    ///     .budget_mib(4096)
    ///     .telemetry(TelemetryConfig {
    ///         level: Level::Summary,
    ///         path: Some("runs/today.jsonl.zst".into()),
    ///         compress: true,
    ///         rotate_bytes: Some(1 << 30),
    ///         ..Default::default()
    ///     })
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn telemetry(mut self, config: TelemetryConfig) -> Self {
        self.telemetry = Some(config);
        self
    }

    /// Writes every event (level `full`) to a new JSONL file at `path`, never overwritten, with
    /// the flight recorder on; [`telemetry`](Self::telemetry) chooses the level and the rest.
    pub fn telemetry_file(self, path: impl Into<std::path::PathBuf>) -> Self {
        self.telemetry(TelemetryConfig {
            level: Level::Full,
            path: Some(path.into()),
            ..TelemetryConfig::default()
        })
    }

    /// Checks block outputs, gradients and the loss for NaN and infinity on the device, read
    /// once per step, and publishes the first one found as `non_finite` (default off; see
    /// [`crate::guards`]).
    pub fn guards(mut self, on: bool) -> Self {
        self.guards = on;
        self
    }

    /// Checksums spilled activations: a CRC32C of each spill once its copy has landed, verified
    /// before its restore, which is refused with
    /// [`Error::SpillCorrupted`](crate::Error::SpillCorrupted) (naming the tensor and its
    /// region) when the bytes changed in host memory (default off).
    ///
    /// It reads every spilled byte twice more on the host, in the step (once when the spill
    /// lands, once before its restore). CRC32C runs at 11 to 13 GB/s over 64 MiB buffers on the
    /// 2-core development host, bound by memory (`benches/integrity.rs`), so the GPU
    /// benchmark's 3.9 GiB of spills per 228 ms step would cost about 0.7 s more a step, three
    /// times the step: a debugging aid for suspected memory corruption, not a default.
    pub fn checksums(mut self, on: bool) -> Self {
        self.checksums = on;
        self
    }
}

impl Stagehand {
    /// Publishes device memory now, one reading for both events: `vram_sample` (with the
    /// step's peak so far) and `vram_owners` (who holds it). The handle takes one at the step's
    /// start and at the end of the forward, the backward and the step: the shape of memory
    /// within a step, which a summary file keeps.
    pub(super) fn publish_reading(&self) -> crate::device::MemoryReading {
        let mem = self.device.memory();
        let owners = VramByOwner { allocated_bytes: mem.allocated, ..self.vram_owners() }.with_other();
        self.bus.publish(EventKind::VramSample {
            allocated_bytes: mem.allocated,
            reserved_bytes: mem.reserved,
            peak_allocated_bytes: mem.peak,
        });
        self.bus.publish(EventKind::VramOwners(owners));
        self.publish_models();
        mem
    }

    /// What the numeric guards checked over the run so far (`None` when they are off).
    pub fn guard_checks(&self) -> Option<crate::guards::Checked> {
        self.guards.as_ref().map(|g| g.checked())
    }

    /// Spills checksummed and restores verified over the run (`None` unless checksums are on
    /// and activations spill).
    pub fn checksum_counts(&self) -> Option<(u64, u64)> {
        if !self.checksums {
            return None;
        }
        self.activations().map(|a| a.checksums())
    }

    /// The telemetry attached by the builder (its files, dumps on request, losses), if any.
    pub fn telemetry(&self) -> Option<&Telemetry> {
        self.telemetry.as_ref()
    }
}
