//! What the handlers share: the hub, its metrics, the replay driver, the stream fan-out, the
//! page's view feed, the access rules and the shutdown signal.

use crate::access::Access;
use crate::fanout::Fanout;
use crate::replay::ReplayDriver;
use crate::view::feed::ViewFeed;
use serde::Serialize;
use stagehand_events::Hub;
use stagehand_exporter::Metrics;
use std::sync::Arc;
use tokio::sync::watch;

/// Whether the server shows a live run or replays a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Live,
    Replay,
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(super) hub: Arc<Hub>,
    pub(super) metrics: Metrics,
    pub(super) replay: Option<Arc<ReplayDriver>>,
    pub(super) stop: Shutdown,
    pub(super) fanout: Arc<Fanout>,
    pub(super) views: Arc<ViewFeed>,
    pub(super) access: Arc<Access>,
    /// How long a request's body may take to arrive.
    pub(super) body_timeout: std::time::Duration,
    /// The snapshot's JSON, shared by the requests that come close together.
    pub(super) snapshots: Arc<super::routes::SnapshotCache>,
}

/// When the streams end. A router built by the user (served on their own tokio) has no
/// shutdown signal: its streams run until the client leaves.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shutdown(Option<watch::Receiver<bool>>);

impl Shutdown {
    /// Streams end when `stop` turns true.
    pub(crate) fn new(stop: watch::Receiver<bool>) -> Shutdown {
        Shutdown(Some(stop))
    }

    /// True once the server is shutting down.
    pub(crate) fn is_set(&self) -> bool {
        self.0.as_ref().is_some_and(|rx| *rx.borrow())
    }

    /// Resolves when the server shuts down (or its handle is gone); never without a signal.
    pub(crate) async fn wait(&mut self) {
        match &mut self.0 {
            Some(rx) => {
                let _ = rx.wait_for(|s| *s).await;
            }
            None => std::future::pending().await,
        }
    }
}

impl AppState {
    /// A live run's hub, with the metrics sink attached to it. Adds the sink that encodes the
    /// stream for every client (once per state: clones share it), so build one per hub.
    pub fn live(hub: Arc<Hub>, metrics: Metrics) -> AppState {
        let fanout = Fanout::attach(&hub);
        AppState {
            hub,
            metrics,
            replay: None,
            stop: Shutdown::default(),
            fanout,
            views: ViewFeed::new(),
            access: Arc::new(Access::loopback()),
            body_timeout: std::time::Duration::from_millis(crate::config::DEFAULT_BODY_TIMEOUT_MS),
            snapshots: Arc::default(),
        }
    }

    /// A replay: the driver feeds a hub of its own, with a metrics sink. Serving it with your
    /// own tokio, spawn [`ReplayDriver::run`] as well, or it never plays.
    pub fn replay(driver: Arc<ReplayDriver>) -> AppState {
        let hub = Arc::new(Hub::new());
        let metrics = Metrics::new();
        hub.add_snapshot_sink(Box::new(metrics.clone()));
        let fanout = Fanout::attach(&hub);
        AppState {
            hub,
            metrics,
            replay: Some(driver),
            stop: Shutdown::default(),
            fanout,
            views: ViewFeed::new(),
            access: Arc::new(Access::loopback()),
            body_timeout: std::time::Duration::from_millis(crate::config::DEFAULT_BODY_TIMEOUT_MS),
            snapshots: Arc::default(),
        }
    }

    /// Streams end when `stop` turns true (graceful shutdown).
    pub fn with_shutdown(mut self, stop: watch::Receiver<bool>) -> AppState {
        self.stop = Shutdown::new(stop);
        self
    }

    /// Who may use the routes (default: [`Access::loopback`], no token).
    pub fn with_access(mut self, access: Access) -> AppState {
        self.access = Arc::new(access);
        self
    }

    /// How long a request's body may take to arrive, all of it (default
    /// [`DEFAULT_BODY_TIMEOUT_MS`](crate::DEFAULT_BODY_TIMEOUT_MS)).
    pub fn with_body_timeout(mut self, limit: std::time::Duration) -> AppState {
        self.body_timeout = limit;
        self
    }

    /// Clients of the full stream (`/api/stream`, `/api/ws`) connected now; a client counts
    /// from the moment its snapshot is taken, before its answer's headers go out.
    pub fn stream_clients(&self) -> usize {
        self.fanout.clients()
    }

    pub(crate) fn fanout(&self) -> &Arc<Fanout> {
        &self.fanout
    }

    pub(crate) fn shutdown(&self) -> Shutdown {
        self.stop.clone()
    }

    /// The replay's driver, when replaying.
    pub fn replay_driver(&self) -> Option<&Arc<ReplayDriver>> {
        self.replay.as_ref()
    }

    /// The hub the routes read.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Live or replay.
    pub fn mode(&self) -> Mode {
        if self.replay.is_some() {
            Mode::Replay
        } else {
            Mode::Live
        }
    }
}

