//! What a [`ReplayDriver`](super::ReplayDriver) replays: a file read on demand or events in
//! memory, behind one set of operations.

use stagehand_events::jsonl::JsonlError;
use stagehand_events::replay::{Change, FileReplay, Played};
use stagehand_events::{Event, EventKind, Hub, Phase, Replay, ReplayStatus};

fn is_step_begin(e: &Event) -> bool {
    matches!(e.kind, EventKind::PhaseChanged { to: Phase::StepBegin, .. })
}

/// What the driver replays: a file read on demand, so that memory does not grow with the file
/// (servers), or events a program already holds in memory (programs and tests that built them).
// One per server, behind a mutex: the few hundred bytes between the variants cost nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Source {
    File(FileReplay),
    Events(Replay),
}

impl Source {
    pub(super) fn status(&self) -> ReplayStatus {
        match self {
            Source::File(r) => r.status(),
            Source::Events(r) => r.status(),
        }
    }

    pub(super) fn set_paused(&mut self, paused: bool) {
        match self {
            Source::File(r) => r.set_paused(paused),
            Source::Events(r) => r.set_paused(paused),
        }
    }

    pub(super) fn set_speed(&mut self, speed: f64) {
        match self {
            Source::File(r) => r.set_speed(speed),
            Source::Events(r) => r.set_speed(speed),
        }
    }

    pub(super) fn events_held(&self) -> usize {
        match self {
            Source::File(r) => r.events_held(),
            Source::Events(r) => r.len(),
        }
    }

    /// Events in the replay, counting at least to `wanted`: a file still being indexed is
    /// waited for only when `wanted` lies beyond what is indexed so far, so that a request for
    /// a late position is judged against the whole file, not against how far indexing got.
    pub(super) fn len_for(&self, wanted: usize) -> usize {
        match self {
            Source::File(r) => {
                if wanted > r.len() && !r.indexed() {
                    r.wait_indexed();
                }
                r.len()
            }
            Source::Events(r) => r.len(),
        }
    }

    /// The position just after `step` began, or the steps the file holds.
    pub(super) fn step_start(&self, step: u64) -> Result<usize, Option<(u64, u64)>> {
        match self {
            Source::File(r) => {
                if r.step_start(step).is_none() && !r.indexed() {
                    // A step indexing has not reached yet may still be in the file.
                    r.wait_indexed();
                }
                r.step_start(step).ok_or_else(|| r.step_range())
            }
            Source::Events(r) => {
                let events = r.events();
                events
                    .iter()
                    .position(|e| e.step == step && is_step_begin(e))
                    .map(|i| i + 1)
                    .ok_or_else(|| {
                        let mut steps = events.iter().filter(|e| is_step_begin(e)).map(|e| e.step);
                        let first = steps.next()?;
                        Some((first, steps.next_back().unwrap_or(first)))
                    })
            }
        }
    }

    /// Runs one operation on whichever replay this is, as what it did to the stream.
    pub(super) fn apply(
        &mut self,
        on_file: impl FnOnce(&mut FileReplay) -> Result<Played, JsonlError>,
        on_events: impl FnOnce(&mut Replay) -> Change,
    ) -> Result<Played, JsonlError> {
        match self {
            Source::File(r) => on_file(r),
            Source::Events(r) => Ok(match on_events(r) {
                Change::None => Played::None,
                Change::Advanced(range) => Played::Advanced(r.events()[range].to_vec()),
                Change::Reset => Played::Reset,
            }),
        }
    }

    /// Pushes what an operation did into the hub. After a jump the hub's sinks rebuild from
    /// every event up to the position: a file reads them again one at a time rather than keep
    /// them.
    pub(super) fn publish(&self, played: Played, hub: &Hub) -> Result<(), JsonlError> {
        match played {
            Played::None => {}
            Played::Advanced(events) => {
                for e in events {
                    hub.ingest(e);
                }
                hub.flush();
            }
            Played::Reset => match self {
                Source::File(r) => hub.reset(r.snapshot().clone(), r.applied()?),
                Source::Events(r) => hub.reset(r.snapshot().clone(), &r.events()[..r.position()]),
            },
        }
        Ok(())
    }
}
