//! The full event stream (`/api/stream`, `/api/ws`), encoded once for every client.
//!
//! A sink on the hub encodes each event into a stream message as it is applied, and gathers the
//! messages into a [`Batch`], broadcast when it holds [`BATCH_BYTES`] or when the dispatcher
//! ends a batch of its own at least [`BATCH_AGE`] after the batch's first event (a waiting
//! client sends a quiet batch on after [`BATCH_LINGER`]). A hundred clients cost one encoding
//! and a few dozen wake-ups a second each, not a hundred encodings and a wake-up per event:
//! per-event wake-ups of every client were what watching cost a run. Each client reads the
//! broadcast ring at its own pace; one that falls more than [`FANOUT_CAPACITY`] batches behind is
//! told how many events it missed and starts over from a fresh snapshot (encoded once for every
//! client that asks at the same position). A replay seek makes every client start over the same
//! way.
//!
//! The sink also keeps the last [`RECENT_EVENTS`] events, which the page's log is filled from.

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use stagehand_events::{Event, EventSink, Hub, Snapshot};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::broadcast;

/// Batches a client of the full stream may fall behind before it is resynced (at most
/// [`BATCH_BYTES`] each: the ring holds a few MiB).
pub const FANOUT_CAPACITY: usize = 64;
/// Bytes of messages a batch holds before it is sent.
pub const BATCH_BYTES: usize = 64 << 10;
/// Age of a batch's first message after which the dispatcher's next batch end sends it.
pub const BATCH_AGE: std::time::Duration = std::time::Duration::from_millis(20);
/// How long a client waits for a batch before it sends on what is gathered (the run went quiet
/// with a batch not yet sent).
pub const BATCH_LINGER: std::time::Duration = std::time::Duration::from_millis(50);
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

/// Events as stream messages, one after the other: their SSE forms back to back, and where
/// each one's JSON is (for WebSocket text frames, zero-copy slices).
#[derive(Debug, Clone)]
pub(crate) struct Batch {
    sse: Bytes,
    json: Vec<(u32, u32)>,
    /// The stream index of the last event in it.
    last: u64,
}

impl Batch {
    /// The messages as SSE.
    pub(crate) fn sse(&self) -> Bytes {
        self.sse.clone()
    }

    /// Each message's JSON, in order.
    pub(crate) fn json(&self) -> impl Iterator<Item = Bytes> + '_ {
        self.json.iter().map(|&(a, b)| self.sse.slice(a as usize..b as usize))
    }

    /// Messages in it.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.json.len()
    }

    /// The stream index of its last event.
    pub(crate) fn last(&self) -> u64 {
        self.last
    }
}

/// What the fan-out broadcasts.
#[derive(Debug)]
pub(crate) enum Frame {
    /// The next events as stream messages.
    Events(Batch),
    /// The hub started over (a replay seek): what came before no longer holds.
    Resync,
}

/// Messages gathered for the next batch.
#[derive(Debug, Default)]
struct Gathering {
    sse: BytesMut,
    json: Vec<(u32, u32)>,
    since: Option<std::time::Instant>,
}

struct Inner {
    /// Counts every event and every restart: what the page's view keys its updates on.
    index: u64,
    recent: VecDeque<(u64, Event)>,
    encoded_events: u64,
    snapshot: Option<(u64, Encoded)>,
    /// The index of the last restart: lines from before it no longer belong.
    restarted_at: u64,
    gathering: Gathering,
}

impl Inner {
    /// Adds an event's message (`event: event`, `{"type":"event","event":...}`) to the batch
    /// being gathered, serialized straight into it.
    fn gather(&mut self, event: &Event) {
        let g = &mut self.gathering;
        let start = g.sse.len();
        g.sse.put_slice(b"event: event\ndata: ");
        let a = g.sse.len();
        g.sse.put_slice(b"{\"type\":\"event\",\"event\":");
        if serde_json::to_writer((&mut g.sse).writer(), event).is_err() {
            // Our own types always serialize; if one ever does not, say so in the stream.
            g.sse.truncate(a);
            g.sse.put_slice(b"{\"type\":\"error\",\"event\":null");
        }
        g.sse.put_slice(b"}");
        let b = g.sse.len();
        g.sse.put_slice(b"\n\n");
        match (u32::try_from(a), u32::try_from(b)) {
            (Ok(a), Ok(b)) => g.json.push((a, b)),
            // A batch is sent long before 4 GiB; were it not, the message is dropped whole.
            _ => g.sse.truncate(start),
        }
        g.since.get_or_insert_with(std::time::Instant::now);
    }

    /// The batch gathered, to broadcast (none when empty).
    fn take_batch(&mut self) -> Option<Frame> {
        let g = std::mem::take(&mut self.gathering);
        g.since?;
        Some(Frame::Events(Batch { sse: g.sse.freeze(), json: g.json, last: self.index }))
    }
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
                gathering: Gathering::default(),
            }),
        });
        hub.add_sink(Box::new(FanoutSink(fanout.clone())));
        fanout
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The snapshot message for the hub's current state, its stream index, and a receiver of
    /// everything after it. Taken under the hub's lock, which the sink also runs under, so
    /// nothing falls between (the batch being gathered is sent first: it is in the snapshot).
    pub(crate) fn subscribe(&self, hub: &Hub) -> (Encoded, u64, broadcast::Receiver<Arc<Frame>>) {
        hub.with_snapshot(|snap: &Snapshot| {
            let mut inner = self.lock();
            if let Some(batch) = inner.take_batch() {
                let _ = self.tx.send(Arc::new(batch));
            }
            let rx = self.tx.subscribe();
            let index = inner.index;
            let encoded = match &inner.snapshot {
                Some((i, e)) if *i == index => e.clone(),
                _ => {
                    let e = Encoded::message("snapshot", "snapshot", snap);
                    inner.snapshot = Some((index, e.clone()));
                    e
                }
            };
            (encoded, index, rx)
        })
    }

    /// Sends the batch being gathered, if any (a client waited [`BATCH_LINGER`] for it).
    pub(crate) fn send_gathered(&self) {
        let mut inner = self.lock();
        if let Some(batch) = inner.take_batch() {
            let _ = self.tx.send(Arc::new(batch));
        }
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
            inner.gather(event);
            if inner.gathering.sse.len() >= BATCH_BYTES {
                if let Some(batch) = inner.take_batch() {
                    let _ = f.tx.send(Arc::new(batch));
                }
            }
        }
    }

    fn batch_end(&mut self) {
        let f = &self.0;
        let mut inner = f.lock();
        if inner.gathering.since.is_some_and(|t| t.elapsed() >= BATCH_AGE) {
            if let Some(batch) = inner.take_batch() {
                let _ = f.tx.send(Arc::new(batch));
            }
        }
    }

    fn flush(&mut self) {
        self.0.send_gathered();
    }

    fn rewind_begin(&mut self) {
        let mut inner = self.0.lock();
        // What was gathered belongs before the restart: it goes out first.
        if let Some(batch) = inner.take_batch() {
            let _ = self.0.tx.send(Arc::new(batch));
        }
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
    use stagehand_events::model::{BlockId, EventKind, Phase};
    use stagehand_events::StreamMessage;

    fn hit(seq: u64) -> Event {
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
    }

    #[test]
    fn every_event_is_encoded_once_for_all_clients_and_sent_in_batches() {
        let hub = Hub::new();
        let fanout = Fanout::attach(&hub);
        hub.ingest(hit(1)); // nobody listens yet: not encoded
        let mut clients: Vec<_> = (0..3).map(|_| fanout.subscribe(&hub)).collect();
        for s in 2..=11 {
            hub.ingest(hit(s));
        }
        assert_eq!(fanout.encoded_events(), 10, "once per event, not once per client");
        // The dispatcher ends its batch: young messages wait, old enough ones go as one batch.
        hub.batch_end();
        assert!(clients[0].2.try_recv().is_err(), "younger than the batch age: still gathered");
        std::thread::sleep(BATCH_AGE);
        hub.batch_end();
        let mut firsts = Vec::new();
        for (snap, index, rx) in &mut clients {
            let m: StreamMessage = serde_json::from_slice(&snap.json()).expect("a snapshot message");
            assert!(matches!(m, StreamMessage::Snapshot { snapshot } if snapshot.last_seq == 1));
            assert_eq!(*index, 1);
            let frame = rx.try_recv().expect("one batch");
            assert!(rx.try_recv().is_err(), "one frame for ten events");
            firsts.push(frame);
        }
        assert!(Arc::ptr_eq(&firsts[0], &firsts[1]) && Arc::ptr_eq(&firsts[1], &firsts[2]), "shared, not copied");
        let Frame::Events(b) = &*firsts[0] else { panic!("a batch") };
        assert_eq!((b.len(), b.last()), (10, 11));
        let seqs: Vec<u64> = b
            .json()
            .map(|j| match serde_json::from_slice::<StreamMessage>(&j).expect("an event message") {
                StreamMessage::Event { event } => event.seq,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(seqs, (2..=11).collect::<Vec<_>>());
        assert!(b.sse().starts_with(b"event: event\ndata: {\"type\":\"event\"") && b.sse().ends_with(b"}\n\n"));
        assert_eq!(b.sse().iter().filter(|c| **c == b'\n').count(), 30, "ten SSE messages");
        // A large batch goes as soon as it is full.
        for s in 12..2000 {
            hub.ingest(hit(s));
        }
        assert!(clients[0].2.try_recv().is_ok(), "sent at {BATCH_BYTES} bytes, not waiting for the batch end");
    }

    #[test]
    fn a_rewind_restarts_clients_and_the_recent_events() {
        let hub = Hub::new();
        let fanout = Fanout::attach(&hub);
        let (_, _, mut rx) = fanout.subscribe(&hub);
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
