//! Telemetry levels: what the file keeps.
//!
//! The bus always carries every event in memory (the live views and the flight recorder need the
//! detail); the level decides what is written:
//!
//! - `full`: everything.
//! - `summary` (the default): the run's lifecycle, phases, limits, registrations and itinerary,
//!   the per-step aggregates (from which the snapshot's totals and step records are exact), the
//!   Conductor's hints, spilling switched on and off, VRAM readings at a bounded rate (plus each
//!   step's peak reading by owner), and every warning and incident. About 5 KB a step.
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

/// Least run time between two VRAM readings a summary file keeps.
pub const SUMMARY_SAMPLE_INTERVAL_NS: u64 = 100_000_000;

/// Decides, event by event, what a file at a level keeps.
#[derive(Debug, Clone, Default)]
pub struct LevelFilter {
    level: Level,
    last_sample_ns: Option<u64>,
    last_owners_ns: Option<u64>,
    last_models_ns: Option<u64>,
    /// The step and the largest allocation of the owners readings kept in it.
    owners_peak: (u64, u64),
}

impl LevelFilter {
    /// A filter for `level`.
    pub fn new(level: Level) -> LevelFilter {
        LevelFilter { level, ..Default::default() }
    }

    /// Whether the file keeps `e`.
    pub fn keeps(&mut self, e: &Event) -> bool {
        match self.level {
            Level::Off => false,
            Level::Full => true,
            Level::Summary => self.summary_keeps(e),
        }
    }

    fn summary_keeps(&mut self, e: &Event) -> bool {
        use EventKind::*;
        match &e.kind {
            RunStarted { .. } | RunEnded { .. } | PhaseChanged { .. } | LimitsSet { .. }
            | BlockRegistered { .. } | ItineraryLearned { .. } | ItineraryChanged { .. }
            | PoolConfigured { .. } | WeightStep(_) | ActivationStep(_) | ConductorStep(_)
            | TrainStep(_) | StepTime(_) | TransferStep(_) | Evaluation(_) | HintsChanged { .. }
            | SpillingToggled { .. } | Warning { .. } | OutOfMemory { .. } | NonFinite { .. }
            | TelemetryLost { .. } | EventsDropped { .. } | FlightRecorded { .. } | Quantized(_)
            | ModelRegistered { .. } => true,
            ModelMemory { .. } => due(&mut self.last_models_ns, e.t_ns),
            VramSample { .. } => due(&mut self.last_sample_ns, e.t_ns),
            // Every reading that is the step's largest so far is kept, so the step's record of
            // VRAM at its peak is the same as from a full file.
            VramOwners(o) => {
                let first = self.owners_peak.0 != e.step;
                let peak = first || o.allocated_bytes > self.owners_peak.1;
                if peak {
                    self.owners_peak = (e.step, o.allocated_bytes);
                }
                let due = due(&mut self.last_owners_ns, e.t_ns);
                peak || due
            }
            Residency { .. } | PrefetchHit { .. } | PrefetchMiss { .. } | Eviction { .. }
            | PrefetchWindow { .. } | Protection { .. } | TransferIssued { .. }
            | TransferCompleted { .. } | SlabAcquired { .. } | SlabReleased { .. }
            | PoolExhausted { .. } | PageableFallback { .. } | Pack { .. }
            | SpillFinalized { .. } | Restored { .. } | Reservation { .. }
            | ReservationReleased { .. } | SlotGranted { .. } | SlotDenied { .. }
            | SlotReleased { .. } => false,
        }
    }
}

/// True (and remembers `t_ns`) when `t_ns` is at least the interval after the last one kept.
fn due(last: &mut Option<u64>, t_ns: u64) -> bool {
    let ok = last.is_none_or(|l| t_ns.saturating_sub(l) >= SUMMARY_SAMPLE_INTERVAL_NS);
    if ok {
        *last = Some(t_ns);
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::model::{BlockId, Phase, VramByOwner};

    fn at(t_ns: u64, step: u64, kind: EventKind) -> Event {
        Event::new(1, t_ns, step, Phase::Forward, kind)
    }

    fn sample(t_ns: u64) -> Event {
        at(t_ns, 1, EventKind::VramSample { allocated_bytes: 1, reserved_bytes: 1, peak_allocated_bytes: 1 })
    }

    fn owners(t_ns: u64, step: u64, allocated_bytes: u64) -> Event {
        at(t_ns, step, EventKind::VramOwners(VramByOwner { allocated_bytes, ..Default::default() }))
    }

    #[test]
    fn summary_keeps_aggregates_and_bounds_readings() {
        let mut f = LevelFilter::new(Level::Summary);
        assert!(!f.keeps(&at(0, 1, EventKind::PrefetchHit { block: BlockId(0) })), "detail");
        assert!(f.keeps(&at(0, 1, EventKind::RunEnded { steps: 1 })));
        let ms = 1_000_000;
        let kept: Vec<u64> = (0..50).map(|i| i * 10 * ms).filter(|t| f.keeps(&sample(*t))).collect();
        assert_eq!(kept, [0, 100 * ms, 200 * ms, 300 * ms, 400 * ms], "one reading per 100 ms");
        // Owners: every new peak of the step, and otherwise the bounded rate.
        let step1: Vec<bool> = [(1, 5), (2, 9), (3, 9), (4, 3), (5, 12)]
            .iter()
            .map(|(t, a)| f.keeps(&owners(*t, 1, *a)))
            .collect();
        assert_eq!(step1, [true, true, false, false, true]);
        assert!(f.keeps(&owners(6, 2, 1)), "the first reading of a step");
        assert!(LevelFilter::new(Level::Full).keeps(&at(0, 1, EventKind::PrefetchHit { block: BlockId(0) })));
        assert!(!LevelFilter::new(Level::Off).keeps(&at(0, 1, EventKind::RunEnded { steps: 1 })));
    }
}
