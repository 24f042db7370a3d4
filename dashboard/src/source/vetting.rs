//! Vetting what a telemetry file hands the state: events whose ids would make the state
//! allocate without bound are refused as they are played and counted in the report (a file is
//! as untrusted as a server).

use stagehand_events::jsonl::{ReadReport, SkipReason};
use stagehand_events::Event;

/// The events the state may apply; the others are counted in `refused`.
pub(super) fn vet(events: Vec<Event>, refused: &mut ReadReport) -> Vec<Event> {
    events
        .into_iter()
        .filter(|e| match super::live::vet_event(e) {
            Ok(()) => true,
            Err(why) => {
                refused.skip(0, SkipReason::InvalidValue, format!("implausible: {why}"));
                false
            }
        })
        .collect()
}

/// `read` with the refused events counted as skipped rather than read.
pub(super) fn with_refusals(read: &ReadReport, refused: &ReadReport) -> ReadReport {
    let mut r = read.clone();
    r.events = r.events.saturating_sub(refused.skipped_total);
    r.merge(refused);
    r
}

