//! One connection's place in the full stream: the snapshot first, then the events, all as
//! messages the [fan-out](crate::fanout) encoded once. A connection that falls behind is told
//! how many events it missed and starts over from a fresh snapshot; so does every connection
//! after a replay seek.

use crate::api::Shutdown;
use crate::fanout::{Encoded, Fanout, Frame};
use stagehand::events::Hub;
use std::sync::Arc;
use tokio::sync::broadcast;

/// One connection's position in the stream.
pub(crate) struct Feed {
    hub: Arc<Hub>,
    fanout: Arc<Fanout>,
    rx: broadcast::Receiver<Arc<Frame>>,
    /// The snapshot to send before anything from `rx`.
    pending: Option<Encoded>,
    stop: Shutdown,
}

impl Feed {
    pub(crate) fn new(hub: Arc<Hub>, fanout: Arc<Fanout>, stop: Shutdown) -> Feed {
        let (snapshot, rx) = fanout.subscribe(&hub);
        Feed {
            hub,
            fanout,
            rx,
            pending: Some(snapshot),
            stop,
        }
    }

    fn restart(&mut self) -> Encoded {
        let (snapshot, rx) = self.fanout.subscribe(&self.hub);
        self.rx = rx;
        snapshot
    }

    /// The next message, or `None` when the server shuts down.
    pub(crate) async fn next(&mut self) -> Option<Encoded> {
        if let Some(m) = self.pending.take() {
            return Some(m);
        }
        if self.stop.is_set() {
            return None;
        }
        let received = tokio::select! {
            r = self.rx.recv() => r,
            _ = self.stop.wait() => return None,
        };
        match received {
            Ok(frame) => match &*frame {
                Frame::Event(e) => Some(e.clone()),
                Frame::Resync => Some(self.restart()),
            },
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                self.pending = Some(self.restart());
                Some(Encoded::message("lagged", "missed", &missed))
            }
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fanout::FANOUT_CAPACITY;
    use stagehand::events::model::{BlockId, Event, EventKind, Phase};
    use stagehand::events::StreamMessage;
    use tokio::sync::watch;

    fn hit(seq: u64) -> Event {
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
    }

    async fn next(feed: &mut Feed) -> Option<StreamMessage> {
        let m = feed.next().await?;
        Some(serde_json::from_slice(&m.json()).expect("a stream message"))
    }

    #[tokio::test]
    async fn a_lagging_feed_is_told_what_it_missed_then_resynced() {
        let hub = Arc::new(Hub::new());
        let fanout = Fanout::attach(&hub);
        hub.ingest(hit(1));
        let (_tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub.clone(), fanout, Shutdown::new(stop));
        match next(&mut feed).await {
            Some(StreamMessage::Snapshot { snapshot }) => assert_eq!(snapshot.last_seq, 1),
            other => panic!("expected the snapshot first, got {other:?}"),
        }
        let cap = FANOUT_CAPACITY as u64;
        for s in 2..(2 + cap + 5) {
            hub.ingest(hit(s));
        }
        match next(&mut feed).await {
            Some(StreamMessage::Lagged { missed }) => assert_eq!(missed, 5),
            other => panic!("expected lagged, got {other:?}"),
        }
        match next(&mut feed).await {
            Some(StreamMessage::Snapshot { snapshot }) => assert_eq!(snapshot.last_seq, 1 + cap + 5),
            other => panic!("expected a fresh snapshot, got {other:?}"),
        }
        hub.ingest(hit(cap + 7));
        match next(&mut feed).await {
            Some(StreamMessage::Event { event }) => assert_eq!(event.seq, cap + 7),
            other => panic!("expected the next event, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_feed_ends_at_shutdown() {
        let hub = Arc::new(Hub::new());
        let fanout = Fanout::attach(&hub);
        let (tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub, fanout, Shutdown::new(stop));
        assert!(matches!(next(&mut feed).await, Some(StreamMessage::Snapshot { .. })));
        tx.send(true).expect("feed listens");
        assert!(feed.next().await.is_none());
    }
}
