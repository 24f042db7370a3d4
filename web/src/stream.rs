//! The live stream of one connection: snapshot first, then events; a connection that falls
//! behind is told how many events it missed and resynced from a fresh snapshot.
//!
//! Each connection reads its own `broadcast` receiver, so a slow client only ever lags itself:
//! the hub's send never waits, and the training thread never sees the server at all.

use stagehand::events::{Hub, StreamMessage, Subscription, Update};
use std::collections::VecDeque;
use std::sync::Arc;
use crate::api::Shutdown;
use tokio::sync::broadcast;

/// One connection's position in the stream.
pub(crate) struct Feed {
    hub: Arc<Hub>,
    rx: broadcast::Receiver<Update>,
    queue: VecDeque<StreamMessage>,
    stop: Shutdown,
}

impl Feed {
    pub(crate) fn new(hub: Arc<Hub>, stop: Shutdown) -> Feed {
        let Subscription { snapshot, rx } = hub.subscribe();
        Feed {
            hub,
            rx,
            queue: VecDeque::from([StreamMessage::Snapshot {
                snapshot: Box::new(snapshot),
            }]),
            stop,
        }
    }

    /// The next message, or `None` when the server shuts down.
    pub(crate) async fn next(&mut self) -> Option<StreamMessage> {
        if let Some(m) = self.queue.pop_front() {
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
            Ok(Update::Event(e)) => Some(StreamMessage::Event {
                event: Box::new((*e).clone()),
            }),
            Ok(Update::Resync(s)) => Some(StreamMessage::Snapshot {
                snapshot: Box::new((*s).clone()),
            }),
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                let Subscription { snapshot, rx } = self.hub.resubscribe();
                self.rx = rx;
                self.queue.push_back(StreamMessage::Snapshot {
                    snapshot: Box::new(snapshot),
                });
                Some(StreamMessage::Lagged { missed })
            }
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand::events::model::{BlockId, Event, EventKind, Phase};
    use tokio::sync::watch;

    fn hit(seq: u64) -> Event {
        Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
    }

    #[tokio::test]
    async fn a_lagging_feed_is_told_what_it_missed_then_resynced() {
        let hub = Arc::new(Hub::new());
        hub.ingest(hit(1));
        let (_tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub.clone(), Shutdown::new(stop));
        match feed.next().await {
            Some(StreamMessage::Snapshot { snapshot }) => assert_eq!(snapshot.last_seq, 1),
            other => panic!("expected the snapshot first, got {other:?}"),
        }
        let cap = stagehand::events::bus::DEFAULT_SUBSCRIBER_CAPACITY as u64;
        for s in 2..(2 + cap + 5) {
            hub.ingest(hit(s));
        }
        match feed.next().await {
            Some(StreamMessage::Lagged { missed }) => assert_eq!(missed, 5),
            other => panic!("expected lagged, got {other:?}"),
        }
        match feed.next().await {
            Some(StreamMessage::Snapshot { snapshot }) => assert_eq!(snapshot.last_seq, 1 + cap + 5),
            other => panic!("expected a fresh snapshot, got {other:?}"),
        }
        hub.ingest(hit(cap + 7));
        match feed.next().await {
            Some(StreamMessage::Event { event }) => assert_eq!(event.seq, cap + 7),
            other => panic!("expected the next event, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_feed_ends_at_shutdown() {
        let hub = Arc::new(Hub::new());
        let (tx, stop) = watch::channel(false);
        let mut feed = Feed::new(hub, Shutdown::new(stop));
        assert!(matches!(feed.next().await, Some(StreamMessage::Snapshot { .. })));
        tx.send(true).expect("feed listens");
        assert!(feed.next().await.is_none());
    }
}
