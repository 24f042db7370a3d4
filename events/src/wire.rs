//! The live-stream protocol between a run's HTTP server and its clients (`stagehand-top`, the
//! web page). Defined here, beside the event model, so both ends share one definition.
//!
//! - `GET /api/snapshot`: the current [`Snapshot`] as JSON.
//! - `GET /api/stream` (Server-Sent Events): each SSE message's `event:` field is the
//!   [`StreamMessage`] variant name and its `data:` the JSON of that message. The first message is
//!   a `snapshot`; then one `event` per event; a client that fell behind gets `lagged` (how many it
//!   missed) followed by a fresh `snapshot`; a replay seek sends a fresh `snapshot`. Comments are
//!   sent as keep-alives.
//! - `GET /api/ws` (WebSocket): the same messages as JSON text frames, tagged by `type`.

use super::model::Event;
use super::snapshot::Snapshot;
use serde::{Deserialize, Serialize};

/// Where a run's server listens unless told otherwise (loopback only).
pub const DEFAULT_SERVER_ADDR: &str = "127.0.0.1:7878";

/// One message of the live stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamMessage {
    /// Start (or start over) from this state.
    Snapshot { snapshot: Box<Snapshot> },
    /// The next event.
    Event { event: Box<Event> },
    /// The client fell behind and missed this many events; a snapshot follows.
    Lagged { missed: u64 },
}

impl StreamMessage {
    /// The SSE `event:` name of this message.
    pub fn name(&self) -> &'static str {
        match self {
            StreamMessage::Snapshot { .. } => "snapshot",
            StreamMessage::Event { .. } => "event",
            StreamMessage::Lagged { .. } => "lagged",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EventKind, Phase};

    #[test]
    fn messages_are_tagged_by_type() {
        let m = StreamMessage::Event {
            event: Box::new(Event::new(1, 2, 3, Phase::Forward, EventKind::RunEnded { steps: 3 })),
        };
        let json = serde_json::to_value(&m).expect("serializes");
        assert_eq!(json["type"], "event");
        assert_eq!(json["event"]["kind"], "run_ended");
        assert_eq!(m.name(), "event");
        let back: StreamMessage = serde_json::from_value(json).expect("parses");
        assert_eq!(back, m);
    }
}
