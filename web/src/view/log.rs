//! The page's event log: each event as the line the terminal UI shows for it
//! ([`describe`]), long values cut (a replayed file may hold anything).

use serde::Serialize;
use stagehand_events::describe::describe;
use stagehand_events::{Event, EventKind, Phase, ReservationOutcome};

/// Characters of a line's text kept.
const MAX_TEXT: usize = 400;

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LogLine {
    /// Position in the server's stream; a gap between two lines means events not shown.
    pub i: u64,
    pub seq: u64,
    pub step: u64,
    pub phase: Phase,
    pub kind: String,
    pub text: String,
    /// Something went wrong or was refused.
    pub warn: bool,
}

fn is_warning(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::Warning { .. }
            | EventKind::EventsDropped { .. }
            | EventKind::SlotDenied { .. }
            | EventKind::TelemetryLost { .. }
            | EventKind::OutOfMemory { .. }
            | EventKind::NonFinite { .. }
            | EventKind::Reservation { outcome: ReservationOutcome::Denied, .. }
    )
}

/// The line for the event at stream position `i`.
pub(crate) fn line(i: u64, e: &Event) -> LogLine {
    let mut text = describe(&e.kind);
    if text.chars().count() > MAX_TEXT {
        text = text.chars().take(MAX_TEXT).collect::<String>() + "...";
    }
    LogLine {
        i,
        seq: e.seq,
        step: e.step,
        phase: e.phase,
        kind: e.kind.name().to_owned(),
        text,
        warn: is_warning(&e.kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_events::{Direction, Owner, TransferId};

    #[test]
    fn each_event_reads_as_the_terminal_shows_it_and_long_text_is_cut() {
        let e = Event::new(7, 1, 2, Phase::Forward, EventKind::TransferCompleted {
            id: TransferId(3),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 1048576,
            duration_ms: Some(0.00016999999999999999),
        });
        let l = line(42, &e);
        assert_eq!((l.i, l.seq, l.kind.as_str(), l.warn), (42, 7, "transfer_completed", false));
        assert_eq!(l.text, describe(&e.kind));
        assert_eq!(l.text, "h2d #3 weights 1.00 MiB in 0.00 ms");
        // A copy that was not timed shows no duration rather than a made-up one.
        let untimed = Event::new(9, 1, 2, Phase::Forward, EventKind::TransferCompleted {
            id: TransferId(4),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 1048576,
            duration_ms: None,
        });
        assert_eq!(line(44, &untimed).text, "h2d #4 weights 1.00 MiB (not timed)");

        let w = Event::new(8, 1, 2, Phase::Forward, EventKind::Warning { source: Owner::Weights, message: "x".repeat(5000) });
        let l = line(43, &w);
        assert!(l.warn);
        assert!(l.text.chars().count() <= MAX_TEXT + 3);
    }
}
