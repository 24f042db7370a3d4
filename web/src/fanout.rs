//! The full event stream (`/api/stream`, `/api/ws`), encoded once for every client.
//!
//! A sink on the hub encodes each event into a stream message as it is applied, and broadcasts
//! the shared bytes: a hundred clients cost one encoding, not a hundred. Each client reads the
//! broadcast ring at its own pace; one that falls more than [`FANOUT_CAPACITY`] messages behind is
//! told how many it missed and starts over from a fresh snapshot (encoded once for every client
//! that asks at the same position). A replay seek makes every client start over the same way.
//!
//! The sink also keeps the last [`RECENT_EVENTS`] events, which the page's log is filled from.

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use stagehand::events::{Event, EventSink, Hub, Snapshot};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::broadcast;

/// Messages a client of the full stream may fall behind before it is resynced.
pub const FANOUT_CAPACITY: usize = 4096;
/// Events kept for the page's log (so a page opened after the run still shows how it ended).
pub const RECENT_EVENTS: usize = 200;

/// One stream message, encoded once: its SSE form (`event: NAME\ndata: JSON\n\n`), from which
/// the JSON (for WebSocket text frames) is a zero-copy slice.
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    sse: Bytes,
    json_start: usize,
}

impl Encoded {
    /// Frames `json` (one line: serde_json's compact output has no newline) as SSE `name`.
    pub(crate) fn new(name: &str, json: &[u8]) -> Encoded {
        let mut b = BytesMut::with_capacity(name.len() + json.len() + 16);
        b.put_slice(b"event: ");
        b.put_slice(name.as_bytes());
        b.put_slice(b"\ndata: ");
        let json_start = b.len();
        b.put_slice(json);
        b.put_slice(b"\n\n");
        Encoded {
            sse: b.freeze(),
            json_start,
        }
    }

    /// `{"type":NAME,FIELD:<value>}`, serialized straight into the buffer.
    pub(crate) fn message<T: Serialize + ?Sized>(name: &str, field: &str, value: &T) -> Encoded {
        let mut json = Vec::with_capacity(256);
        json.extend_from_slice(format!("{{\"type\":\"{name}\",\"{field}\":").as_bytes());
        if serde_json::to_writer(&mut json, value).is_err() {
            // Our own types always serialize; if one ever does not, say so in the stream.
            json.truncate(0);
            json.extend_from_slice(format!("{{\"type\":\"error\",\"{field}\":null").as_bytes());
        }
        json.push(b'}');
        Encoded::new(name, &json)
    }

    /// The SSE message.
    pub(crate) fn sse(&self) -> Bytes {
        self.sse.clone()
    }

    /// The JSON alone.
    pub(crate) fn json(&self) -> Bytes {
        self.sse.slice(self.json_start..self.sse.len() - 2)
    }
}

/// What the fan-out broadcasts.
#[derive(Debug)]
pub(crate) enum Frame {
    /// The next event as a stream message.
    Event(Encoded),
    /// The hub started over (a replay seek): what came before no longer holds.
    Resync,
}

struct Inner {
    /// Counts every event and every restart: what the page's view keys its updates on.
    index: u64,
    recent: VecDeque<(u64, Event)>,
    encoded_events: u64,
    snapshot: Option<(u64, Encoded)>,
    /// The index of the last restart: lines from before it no longer belong.
    restarted_at: u64,
}

/// The shared side of the full stream.
pub(crate) struct Fanout {
    tx: broadcast::Sender<Arc<Frame>>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Fanout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fanout")
            .field("clients", &self.tx.receiver_count())
            .finish_non_exhaustive()
    }
}

impl Fanout {
    /// A fan-out fed by a new sink on `hub`.
    pub(crate) fn attach(hub: &Hub) -> Arc<Fanout> {
        let (tx, _) = broadcast::channel(FANOUT_CAPACITY);
        let fanout = Arc::new(Fanout {
            tx,
            inner: Mutex::new(Inner {
                index: 0,
                recent: VecDeque::with_capacity(RECENT_EVENTS),
                encoded_events: 0,
                snapshot: None,
                restarted_at: 0,
            }),
        });
        hub.add_sink(Box::new(FanoutSink(fanout.clone())));
        fanout
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The snapshot message for the hub's current state and a receiver of everything after it.
    /// Taken under the hub's lock, which the sink also runs under, so nothing falls between.
    pub(crate) fn subscribe(&self, hub: &Hub) -> (Encoded, broadcast::Receiver<Arc<Frame>>) {
        hub.with_snapshot(|snap: &Snapshot| {
            let rx = self.tx.subscribe();
            let mut inner = self.lock();
            let index = inner.index;
            let encoded = match &inner.snapshot {
                Some((i, e)) if *i == index => e.clone(),
                _ => {
                    let e = Encoded::message("snapshot", "snapshot", snap);
                    inner.snapshot = Some((index, e.clone()));
                    e
                }
            };
            (encoded, rx)
        })
    }

    /// Clients of the full stream connected now.
    pub(crate) fn clients(&self) -> usize {
        self.tx.receiver_count()
    }

    /// The position of the stream: moves with every event and every restart.
    pub(crate) fn index(&self) -> u64 {
        self.lock().index
    }

    /// The recent events with their positions, oldest first, and the position of the last
    /// restart.
    pub(crate) fn recent(&self) -> (Vec<(u64, Event)>, u64) {
        let inner = self.lock();
        (inner.recent.iter().cloned().collect(), inner.restarted_at)
    }

    /// Events encoded so far (each once, whatever the number of clients).
    #[cfg(test)]
    pub(crate) fn encoded_events(&self) -> u64 {
        self.lock().encoded_events
    }
}

struct FanoutSink(Arc<Fanout>);

impl EventSink for FanoutSink {
    fn on_event(&mut self, event: &Event) {
        let f = &self.0;
        let mut inner = f.lock();
        inner.index += 1;
        let index = inner.index;
        if inner.recent.len() == RECENT_EVENTS {
            inner.recent.pop_front();
        }
        inner.recent.push_back((index, event.clone()));
        // Nobody listening: nothing to encode.
        if f.tx.receiver_count() > 0 {
            inner.encoded_events += 1;
            let frame = Frame::Event(Encoded::message("event", "event", event));
            let _ = f.tx.send(Arc::new(frame));
        }
    }

    fn rewind_begin(&mut self) {
        let mut inner = self.0.lock();
        // One step for the restart itself; the events kept are numbered at the end.
        inner.index += 1;
        inner.restarted_at = inner.index;
        inner.recent.clear();
    }

    fn rewind_event(&mut self, event: &Event) {
        let mut inner = self.0.lock();
        if inner.recent.len() == RECENT_EVENTS {
            inner.recent.pop_front();
        }
        // Numbered in `rewind_end`, once it is known which events are kept; until then the
        // placeholder is at the restart, so readers (who keep what is after it) skip them.
        let placeholder = inner.restarted_at;
        inner.recent.push_back((placeholder, event.clone()));
    }

    fn rewind_end(&mut self) {
        let f = &self.0;
        let mut inner = f.lock();
        // One step per event kept, as `on_event` counts.
        let base = inner.restarted_at;
        for (k, (i, _)) in inner.recent.iter_mut().enumerate() {
            *i = base + 1 + k as u64;
        }
        inner.index = base + inner.recent.len() as u64;
        let _ = f.tx.send(Arc::new(Frame::Resync));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand::events::model::{BlockId, EventKind, Phase};
    use stagehand::events::StreamMessage;

    fn hit(seq: u64) -> Event {
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
    }

    #[test]
    fn every_event_is_encoded_once_for_all_clients() {
        let hub = Hub::new();
        let fanout = Fanout::attach(&hub);
        hub.ingest(hit(1)); // nobody listens yet: not encoded
        let mut clients: Vec<_> = (0..3).map(|_| fanout.subscribe(&hub)).collect();
        for s in 2..=11 {
            hub.ingest(hit(s));
        }
        assert_eq!(fanout.encoded_events(), 10, "once per event, not once per client");
        let mut firsts = Vec::new();
        for (snap, rx) in &mut clients {
            let m: StreamMessage = serde_json::from_slice(&snap.json()).expect("a snapshot message");
            assert!(matches!(m, StreamMessage::Snapshot { snapshot } if snapshot.last_seq == 1));
            let mut n = 0;
            while let Ok(frame) = rx.try_recv() {
                if n == 0 {
                    firsts.push(frame.clone());
                }
                n += 1;
            }
            assert_eq!(n, 10);
        }
        assert!(Arc::ptr_eq(&firsts[0], &firsts[1]) && Arc::ptr_eq(&firsts[1], &firsts[2]), "shared, not copied");
        let Frame::Event(e) = &*firsts[0] else { panic!("an event frame") };
        let m: StreamMessage = serde_json::from_slice(&e.json()).expect("an event message");
        assert!(matches!(m, StreamMessage::Event { event } if event.seq == 2));
        assert!(e.sse().starts_with(b"event: event\ndata: {\"type\":\"event\"") && e.sse().ends_with(b"}\n\n"));
    }

    #[test]
    fn a_rewind_restarts_clients_and_the_recent_events() {
        let hub = Hub::new();
        let fanout = Fanout::attach(&hub);
        let (_, mut rx) = fanout.subscribe(&hub);
        let history: Vec<Event> = (1..=300).map(hit).collect();
        for e in &history {
            hub.ingest(e.clone());
        }
        let before = fanout.index();
        hub.reset(Snapshot::from_events(&history[..250]), &history[..250]);
        assert!(fanout.index() > before);
        let (recent, restarted_at) = fanout.recent();
        assert!(recent.iter().all(|(i, _)| *i > restarted_at));
        assert_eq!(recent.len(), RECENT_EVENTS);
        assert_eq!(recent.last().map(|(_, e)| e.seq), Some(250));
        assert!(recent.windows(2).all(|w| w[1].0 == w[0].0 + 1), "positions run on");
        assert_eq!(recent.last().map(|(i, _)| *i), Some(fanout.index()));
        let mut last = None;
        while let Ok(f) = rx.try_recv() {
            last = Some(f);
        }
        assert!(matches!(last.as_deref(), Some(Frame::Resync)));
    }
}
