//! One connection's place in the full stream: the snapshot first, then the events, all as
//! messages the [fan-out](crate::fanout) encoded once, in batches. A connection that falls
//! behind is told how many events it missed and starts over from a fresh snapshot; so does
//! every connection after a replay seek.

use crate::api::Shutdown;
use crate::fanout::{Batch, Encoded, Fanout, Frame, BATCH_LINGER};
use stagehand_events::Hub;
use std::sync::Arc;
use tokio::sync::broadcast;

/// What a connection sends next: one message, or a batch of events.
#[derive(Debug)]
pub(crate) enum Chunk {
    One(Encoded),
    Events(Arc<Frame>),
}

impl Chunk {
    /// The chunk as SSE.
    pub(crate) fn sse(&self) -> bytes::Bytes {
        match self {
            Chunk::One(e) => e.sse(),
            Chunk::Events(f) => batch(f).map(Batch::sse).unwrap_or_default(),
        }
    }

    /// Each message's JSON, in order (WebSocket text frames).
    pub(crate) fn json(&self) -> Vec<bytes::Bytes> {
        match self {
            Chunk::One(e) => vec![e.json()],
            Chunk::Events(f) => batch(f).map(|b| b.json().collect()).unwrap_or_default(),
        }
    }
}

fn batch(f: &Frame) -> Option<&Batch> {
    match f {
        Frame::Events(b) => Some(b),
        Frame::Resync => None,
    }
}

/// One connection's position in the stream.
pub(crate) struct Feed {
    hub: Arc<Hub>,
    fanout: Arc<Fanout>,
    rx: broadcast::Receiver<Arc<Frame>>,
    /// The snapshot to send before anything from `rx`.
    pending: Option<Encoded>,
    /// The stream index of the last event sent (in a batch, or in a snapshot).
    sent: u64,
    stop: Shutdown,
}

impl Feed {
    pub(crate) fn new(hub: Arc<Hub>, fanout: Arc<Fanout>, stop: Shutdown) -> Feed {
        let (snapshot, sent, rx) = fanout.subscribe(&hub);
        Feed {
            hub,
            fanout,
            rx,
            pending: Some(snapshot),
            sent,
            stop,
        }
    }

    /// A fresh snapshot and a receiver after it; returns the events it covers that were not
    /// sent.
    fn restart(&mut self) -> (Encoded, u64) {
        let (snapshot, index, rx) = self.fanout.subscribe(&self.hub);
        self.rx = rx;
        let missed = index.saturating_sub(self.sent);
        self.sent = index;
        (snapshot, missed)
    }

    /// The next chunk, or `None` when the server shuts down.
    pub(crate) async fn next(&mut self) -> Option<Chunk> {
        if let Some(m) = self.pending.take() {
            return Some(Chunk::One(m));
        }
        loop {
            if self.stop.is_set() {
                return None;
            }
            let received = tokio::select! {
                r = self.rx.recv() => r,
                _ = self.stop.wait() => return None,
                // The run went quiet with events gathered: they go now.
                _ = tokio::time::sleep(BATCH_LINGER) => {
                    self.fanout.send_gathered();
                    continue;
                }
            };
            return match received {
                Ok(frame) => match &*frame {
                    Frame::Events(b) if b.last() <= self.sent => continue,
                    Frame::Events(b) => {
                        self.sent = b.last();
                        Some(Chunk::Events(frame))
                    }
                    Frame::Resync => Some(Chunk::One(self.restart().0)),
                },
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let (snapshot, missed) = self.restart();
                    self.pending = Some(snapshot);
                    Some(Chunk::One(Encoded::message("lagged", "missed", &missed)))
                }
                Err(broadcast::error::RecvError::Closed) => None,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_events::model::{BlockId, Event, EventKind, Phase};
    use stagehand_events::StreamMessage;
    use tokio::sync::watch;

    fn hit(seq: u64) -> Event {
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
    }

    async fn next(feed: &mut Feed) -> Option<Vec<StreamMessage>> {
        let m = feed.next().await?;
        Some(m.json().iter().map(|j| serde_json::from_slice(j).expect("a stream message")).collect())
    }

    #[tokio::test]
    async fn a_lagging_feed_is_told_what_it_missed_then_resynced() {
        let hub = Arc::new(Hub::new());
        let fanout = Fanout::attach(&hub);
        hub.ingest(hit(1));
        let (_tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub.clone(), fanout, Shutdown::new(stop));
        match next(&mut feed).await.as_deref() {
            Some([StreamMessage::Snapshot { snapshot }]) => assert_eq!(snapshot.last_seq, 1),
            other => panic!("expected the snapshot first, got {other:?}"),
        }
        // Far more batches than the ring holds, the feed reading none of them.
        let n = 200_000u64;
        for s in 2..2 + n {
            hub.ingest(hit(s));
        }
        match next(&mut feed).await.as_deref() {
            Some([StreamMessage::Lagged { missed }]) => assert_eq!(*missed, n, "every event since the snapshot"),
            other => panic!("expected lagged, got {other:?}"),
        }
        match next(&mut feed).await.as_deref() {
            Some([StreamMessage::Snapshot { snapshot }]) => assert_eq!(snapshot.last_seq, 1 + n),
            other => panic!("expected a fresh snapshot, got {other:?}"),
        }
        hub.ingest(hit(n + 7));
        // A quiet run: the waiting feed sends the gathered event on.
        match next(&mut feed).await.as_deref() {
            Some([StreamMessage::Event { event }]) => assert_eq!(event.seq, n + 7),
            other => panic!("expected the next event, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_feed_ends_at_shutdown() {
        let hub = Arc::new(Hub::new());
        let fanout = Fanout::attach(&hub);
        let (tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub, fanout, Shutdown::new(stop));
        assert!(matches!(next(&mut feed).await.as_deref(), Some([StreamMessage::Snapshot { .. }])));
        tx.send(true).expect("feed listens");
        assert!(feed.next().await.is_none());
    }
}
