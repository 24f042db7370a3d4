#![doc = include_str!("../README.md")]

mod api;
mod assets;
mod replay;
mod stream;

pub use api::{router, AppState, Mode};
pub use replay::ReplayDriver;

use stagehand::events::Hub;
use stagehand_exporter::Metrics;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use tokio::sync::watch;

pub use stagehand::events::DEFAULT_SERVER_ADDR;

/// What can go wrong while starting or stopping a server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address could not be bound.
    #[error("cannot listen on '{addr}': {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The tokio runtime or its thread could not be started.
    #[error("cannot start the server thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// The replayed file could not be read.
    #[error("cannot replay '{path}': {source}")]
    Replay {
        path: PathBuf,
        #[source]
        source: stagehand::events::jsonl::JsonlError,
    },
    /// The server thread panicked.
    #[error("the server thread panicked")]
    Panicked,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Starts servers. Each runs tokio on its own named thread (`stagehand-web`), so the caller,
/// typically a synchronous training loop, never runs or waits on async code.
#[derive(Debug)]
pub struct Server;

impl Server {
    /// Serves a live run's hub on `addr` (e.g. [`DEFAULT_SERVER_ADDR`], or `127.0.0.1:0` for
    /// any free port). Attaches a fresh [`Metrics`] sink to the hub for `/metrics`; call this
    /// before the run publishes `run_started` so the metrics carry the device labels.
    pub fn live(hub: Arc<Hub>, addr: &str) -> Result<ServerHandle> {
        let metrics = Metrics::new();
        hub.add_sink(Box::new(metrics.clone()));
        Server::live_with(hub, metrics, addr)
    }

    /// Serves a live run's hub with a [`Metrics`] the caller already attached to it.
    pub fn live_with(hub: Arc<Hub>, metrics: Metrics, addr: &str) -> Result<ServerHandle> {
        let state = AppState::live(hub, metrics);
        Server::start(state, addr, None)
    }

    /// Serves a replay of the telemetry file at `path`, paused at its start; the API's
    /// `/api/replay/*` routes (and the web page's controls) play, pause, seek and set the speed.
    pub fn replay(path: impl AsRef<Path>, addr: &str) -> Result<ServerHandle> {
        let path = path.as_ref();
        let (events, _report) =
            stagehand::events::jsonl::read_file(path).map_err(|source| Error::Replay {
                path: path.to_owned(),
                source,
            })?;
        let driver = Arc::new(ReplayDriver::new(events));
        let state = AppState::replay(driver.clone());
        Server::start(state, addr, Some(driver))
    }

    fn start(state: AppState, addr: &str, driver: Option<Arc<ReplayDriver>>) -> Result<ServerHandle> {
        // Bind on the caller's thread so a busy port is an error here, not a log line.
        let std_listener = TcpListener::bind(addr).map_err(|source| Error::Bind {
            addr: addr.to_owned(),
            source,
        })?;
        let local = std_listener.local_addr().map_err(|source| Error::Bind {
            addr: addr.to_owned(),
            source,
        })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|source| Error::Bind {
                addr: addr.to_owned(),
                source,
            })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stagehand-web-worker")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let state = state.with_shutdown(stop_rx.clone());
        let thread = std::thread::Builder::new()
            .name("stagehand-web".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("stagehand-web: cannot use the listener: {e}");
                            return;
                        }
                    };
                    if let Some(d) = driver {
                        tokio::spawn(d.run(state.hub.clone(), stop_rx.clone()));
                    }
                    let mut stop = stop_rx;
                    let app = router(state);
                    let served = axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stop.wait_for(|s| *s).await;
                        })
                        .await;
                    if let Err(e) = served {
                        eprintln!("stagehand-web: server stopped: {e}");
                    }
                });
            })
            .map_err(Error::Runtime)?;
        Ok(ServerHandle {
            addr: local,
            stop: stop_tx,
            thread: Some(thread),
        })
    }
}

/// A running server. Dropping it shuts the server down (and waits for its thread).
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl ServerHandle {
    /// The address the server listens on (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for printing and for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, closes the live streams and waits for the server thread.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        let _ = self.stop.send(true);
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| Error::Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}
