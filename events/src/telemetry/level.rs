//! Telemetry levels: what the file keeps.
//!
//! The bus always carries every event in memory (the live views and the flight recorder need the
//! detail); the level decides what is written:
//!
//! - `full`: everything.
//! - `summary` (the default): the run's lifecycle, phases, limits, registrations and itinerary,
//!   the per-step aggregates (from which the snapshot's totals, breakdowns, step records and the
//!   exporters' counters and histograms are exact), the Conductor's hints, spilling switched on
//!   and off, every VRAM reading (a few a step, by owner and by model) and every warning and
//!   incident; models declared and their quantization reports. About 5 KB a step.
//! - `off`: no file.

use super::super::model::{Event, EventKind};
use serde::{Deserialize, Serialize};
use std::str::FromStr;

/// How much of the run the telemetry file keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// No file.
    Off,
    /// Per-step aggregates, context and incidents; the default.
    #[default]
    Summary,
    /// Every event.
    Full,
}

impl Level {
    /// The name used in configuration and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Summary => "summary",
            Level::Full => "full",
        }
    }
}

impl FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Level, String> {
        match s {
            "off" => Ok(Level::Off),
            "summary" => Ok(Level::Summary),
            "full" => Ok(Level::Full),
            other => Err(format!("telemetry level '{other}': expected off, summary or full")),
        }
    }
}

/// Decides, event by event, what a file at a level keeps.
#[derive(Debug, Clone, Default)]
pub struct LevelFilter {
    level: Level,
}

impl LevelFilter {
    /// A filter for `level`.
    pub fn new(level: Level) -> LevelFilter {
        LevelFilter { level }
    }

    /// Whether the file keeps `e`.
    pub fn keeps(&mut self, e: &Event) -> bool {
        match self.level {
            Level::Off => false,
            Level::Full => true,
            Level::Summary => summary_keeps(e),
        }
    }
}

/// What a summary file keeps: everything but the detail that the per-step aggregates count
/// (`weight_step`, `activation_step`, `conductor_step`, `transfer_step`, `step_counts`). VRAM
/// readings are kept, all of them (by model too): the runtimes take a few a step (the step's
/// start, each phase's end, each time spilling switches), and they are the shape of memory
/// within a step.
fn summary_keeps(e: &Event) -> bool {
    use EventKind::*;
    match &e.kind {
        RunStarted { .. } | RunEnded { .. } | PhaseChanged { .. } | LimitsSet { .. }
        | BlockRegistered { .. } | ItineraryLearned { .. } | ItineraryChanged { .. }
        | PoolConfigured { .. } | WeightStep(_) | ActivationStep(_) | ConductorStep(_)
        | TrainStep(_) | StepTime(_) | TransferStep(_) | StepCounts(_) | Evaluation(_) | HintsChanged { .. }
        | SpillingToggled { .. } | Warning { .. } | OutOfMemory { .. } | NonFinite { .. }
        | TelemetryLost { .. } | EventsDropped { .. } | FlightRecorded { .. } | VramSample { .. }
        | VramOwners(_) | WatermarksMoved { .. } | Quantized(_) | ModelRegistered { .. }
        | ModelMemory { .. } => true,
        Residency { .. } | PrefetchHit { .. } | PrefetchMiss { .. } | Eviction { .. }
        | PrefetchWindow { .. } | Protection { .. } | HostStep { .. } | TransferIssued { .. }
        | TransferCompleted { .. } | SlabAcquired { .. } | SlabReleased { .. }
        | PoolExhausted { .. } | PageableFallback { .. } | Pack { .. }
        | SpillFinalized { .. } | Restored { .. } | Reservation { .. }
        | ReservationReleased { .. } | SlotGranted { .. } | SlotDenied { .. }
        | SlotReleased { .. } => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BlockId, Phase, VramByOwner};

    fn at(t_ns: u64, step: u64, kind: EventKind) -> Event {
        Event::new(1, t_ns, step, Phase::Forward, kind)
    }

    #[test]
    fn summary_keeps_aggregates_and_every_reading() {
        let mut f = LevelFilter::new(Level::Summary);
        assert!(!f.keeps(&at(0, 1, EventKind::PrefetchHit { block: BlockId(0) })), "detail");
        assert!(f.keeps(&at(0, 1, EventKind::RunEnded { steps: 1 })));
        assert!(f.keeps(&at(0, 1, EventKind::StepCounts(Box::default()))));
        // Readings close together are all kept: they are the step's shape.
        let ms = 1_000_000;
        for t in [0, ms, 2 * ms] {
            assert!(f.keeps(&at(t, 1, EventKind::VramSample { allocated_bytes: 1, reserved_bytes: 1, peak_allocated_bytes: 1 })));
            assert!(f.keeps(&at(t, 1, EventKind::VramOwners(VramByOwner::default()))));
        }
        assert!(LevelFilter::new(Level::Full).keeps(&at(0, 1, EventKind::PrefetchHit { block: BlockId(0) })));
        assert!(!LevelFilter::new(Level::Off).keeps(&at(0, 1, EventKind::RunEnded { steps: 1 })));
    }
}
