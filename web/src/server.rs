//! The server: its own tokio on a named thread, an accept loop that admits connections (see
//! [`crate::admission`]: pending places for clients not yet admitted, a cap for admitted ones),
//! times out slow headers, idle connections and stalled writes, optional TLS, and the exposure
//! rules (token, hosts) decided once at start.

use crate::access::Access;
use crate::admission::{Admission, Ticket};
use crate::api::{router, AppState};
use crate::config::{random_token, token_problem, ServerConfig, TlsFiles, TokenSetting};
use crate::{Error, Result};
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_io_timeout::TimeoutStream;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// How long connections get to finish when the server stops.
const DRAIN: Duration = Duration::from_secs(3);
/// Starts servers. Each runs tokio on its own named thread (`stagehand-web`), so the caller,
/// typically a synchronous training loop, never runs or waits on async code.
#[derive(Debug)]
pub struct Server;

impl Server {
    /// Serves a live run's hub on `addr` with the default exposure (loopback needs no token;
    /// a wider bind gets a random one). Attaches a fresh metrics sink to the hub for
    /// `/metrics`; call this before the run publishes `run_started` so the metrics carry the
    /// device labels.
    pub fn live(hub: Arc<stagehand_events::Hub>, addr: &str) -> Result<ServerHandle> {
        let metrics = stagehand_exporter::Metrics::new();
        hub.add_snapshot_sink(Box::new(metrics.clone()));
        Server::start(&ServerConfig::new(addr), AppState::live(hub, metrics))
    }

    /// Serves a live run's hub with a metrics sink the caller already attached to it.
    pub fn live_with(
        hub: Arc<stagehand_events::Hub>,
        metrics: stagehand_exporter::Metrics,
        addr: &str,
    ) -> Result<ServerHandle> {
        Server::start(&ServerConfig::new(addr), AppState::live(hub, metrics))
    }

    /// Serves a replay of the telemetry file at `path`, paused at its start.
    pub fn replay(path: impl AsRef<std::path::Path>, addr: &str) -> Result<ServerHandle> {
        let path = path.as_ref();
        let driver = crate::ReplayDriver::open(path).map_err(|source| Error::Replay {
            path: path.to_owned(),
            source,
        })?;
        let driver = Arc::new(driver);
        Server::start(&ServerConfig::new(addr), AppState::replay(driver))
    }

    /// Serves `state` as `config` says. Refuses a bind beyond loopback without a token, and
    /// warns (on stderr, and in [`ServerHandle::warnings`]) about a bind beyond loopback
    /// without TLS. When the token was generated, prints the address to open, with the token.
    pub fn start(config: &ServerConfig, state: AppState) -> Result<ServerHandle> {
        let limits = [
            ("max_connections", config.max_connections as u64),
            ("max_pending", config.max_pending as u64),
            ("header_timeout_ms", config.header_timeout_ms),
            ("write_timeout_ms", config.write_timeout_ms),
            ("pending_timeout_ms", config.pending_timeout_ms),
            ("body_timeout_ms", config.body_timeout_ms),
        ];
        if let Some((name, _)) = limits.iter().find(|(_, v)| *v == 0) {
            return Err(Error::Config(format!("{name} is 0: every connection limit must be above 0")));
        }
        // Bind on the caller's thread so a busy port is an error here, not a log line.
        let bind_err = |source| Error::Bind {
            addr: config.addr.clone(),
            source,
        };
        let std_listener = TcpListener::bind(&config.addr).map_err(bind_err)?;
        let local = std_listener.local_addr().map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let loopback = local.ip().is_loopback();

        let (token, generated) = match &config.token {
            TokenSetting::Auto if loopback => (None, false),
            TokenSetting::Auto | TokenSetting::Random => (Some(random_token().map_err(|e| {
                Error::Config(format!("cannot draw a random token from the operating system: {e}"))
            })?), true),
            TokenSetting::Fixed(t) => {
                if let Some(problem) = token_problem(t) {
                    return Err(Error::Config(problem));
                }
                (Some(t.clone()), false)
            }
            TokenSetting::Off => (None, false),
        };
        let mut access = Access::for_bound(local, &config.allowed_hosts, config.tls.is_some())?;
        if token.is_none() && (!loopback || access.allows_any_host()) {
            return Err(Error::Insecure {
                addr: local.to_string(),
                reason: if loopback {
                    "any host name is allowed ('*'), so any web page could read the run through DNS rebinding".into()
                } else {
                    "anyone who can reach this address could read the run and drive a replay".into()
                },
            });
        }
        if let Some(t) = &token {
            access = access.with_token(t)?;
        }
        let tls = config.tls.as_ref().map(load_tls).transpose()?;

        let mut warnings = Vec::new();
        if !loopback && tls.is_none() {
            warnings.push(format!(
                "serving on {local} without TLS: the token and the run's data cross the network in clear text; \
                 give a certificate (--tls-cert/--tls-key), or bind 127.0.0.1 and tunnel (ssh -L {p}:127.0.0.1:{p} HOST)",
                p = local.port()
            ));
        }
        if access.allows_any_host() {
            warnings.push("any host name is accepted ('*'): the server relies on its token alone".into());
        }

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stagehand-web-worker")
            // Watchers must never slow the run: the server's threads yield the CPU to it.
            .on_thread_start(crate::priority::lower_this_thread)
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let state = state
            .with_shutdown(stop_rx.clone())
            .with_access(access)
            .with_body_timeout(Duration::from_millis(config.body_timeout_ms));
        let clients = state.clone();
        let limits = Limits {
            max_connections: config.max_connections,
            max_pending: config.max_pending,
            header_timeout: Duration::from_millis(config.header_timeout_ms),
            write_timeout: Duration::from_millis(config.write_timeout_ms),
            pending_timeout: Duration::from_millis(config.pending_timeout_ms),
        };
        let handle_scheme = if tls.is_some() { "https" } else { "http" };
        let admission = Arc::new(Admission::new(limits.max_connections, limits.max_pending));
        let admitted = admission.clone();
        let thread = std::thread::Builder::new()
            .name("stagehand-web".into())
            .spawn(move || {
                crate::priority::lower_this_thread();
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("stagehand-web: cannot use the listener: {e}");
                            return;
                        }
                    };
                    if let Some(d) = state.replay_driver() {
                        tokio::spawn(d.clone().run(state.hub().clone(), stop_rx.clone()));
                    }
                    let app = router(state);
                    accept_loop(listener, app, tls, limits, admission, stop_rx).await;
                });
            })
            .map_err(Error::Runtime)?;
        let handle = ServerHandle {
            clients,
            admission: admitted,
            addr: local,
            scheme: handle_scheme,
            token,
            warnings,
            stop: stop_tx,
            thread: Some(thread),
        };
        for w in &handle.warnings {
            eprintln!("stagehand-web: warning: {w}");
        }
        if generated {
            eprintln!("stagehand-web: this server needs its token; open {}", handle.login_url());
        }
        Ok(handle)
    }
}

/// Largest certificate chain or key file read (a PEM file is a few KiB; `/dev/zero` is not).
const MAX_TLS_FILE: u64 = 1 << 20;

/// A TLS file's bytes: a regular file of at most [`MAX_TLS_FILE`] bytes.
fn read_tls_file(path: &std::path::Path) -> Result<Vec<u8>> {
    let bad = |reason: String| Error::Tls { path: path.to_owned(), reason };
    let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open it: {e}")))?;
    let meta = file.metadata().map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file: expected a PEM file".into()));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_TLS_FILE + 1), &mut bytes)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    if bytes.len() as u64 > MAX_TLS_FILE {
        return Err(bad(format!("larger than {MAX_TLS_FILE} bytes: not a PEM certificate or key")));
    }
    Ok(bytes)
}

fn load_tls(files: &TlsFiles) -> Result<TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |path: &std::path::Path, reason: String| Error::Tls {
        path: path.to_owned(),
        reason,
    };
    let cert_pem = read_tls_file(&files.cert)?;
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(&files.cert, format!("cannot read a PEM certificate chain: {e}")))?;
    if certs.is_empty() {
        return Err(bad(&files.cert, "no certificate in the file: expected PEM 'BEGIN CERTIFICATE'".into()));
    }
    let key_pem = read_tls_file(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| bad(&files.key, format!("cannot read a PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
        .map_err(|e| bad(&files.key, format!("the certificate and key do not make a TLS setup: {e}")))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    max_pending: usize,
    header_timeout: Duration,
    write_timeout: Duration,
    pending_timeout: Duration,
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    admission: Arc<Admission>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stop) => break,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: back off rather than spin.
                eprintln!("stagehand-web: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let ticket = admission.arrive();
        let _ = tcp.set_nodelay(true);
        tokio::spawn(serve_connection(tcp, ticket, app.clone(), tls.clone(), limits, stop.clone()));
    }
    // Streams end on the stop signal; give their connections a moment to close cleanly.
    admission.drain(DRAIN).await;
}

/// Resolves once the server is told to stop (or its handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns must not live across an await: drop it here.
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// Serves one connection: while it is pending, until its deadline or until it is pushed out of
/// the pending places; once admitted, for as long as it lasts.
async fn serve_connection(
    tcp: TcpStream,
    ticket: Arc<Ticket>,
    app: Router,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    stop: watch::Receiver<bool>,
) {
    let mut io = TimeoutStream::new(tcp);
    io.set_write_timeout(Some(limits.write_timeout));
    let conn = Conn {
        io: Box::pin(io),
        _ticket: ticket.clone(),
    };
    // Each request carries the ticket, so the access rules can admit the connection.
    let app = app.layer(axum::Extension(ticket.clone()));
    let serving = async move {
        match tls {
            None => serve_http(TokioIo::new(conn), app, limits, stop).await,
            Some(acceptor) => {
                if let Ok(stream) = acceptor.accept(conn).await {
                    serve_http(TokioIo::new(stream), app, limits, stop).await;
                }
            }
        }
    };
    tokio::pin!(serving);
    let deadline = tokio::time::Instant::now() + limits.pending_timeout;
    loop {
        if ticket.admitted() {
            serving.await;
            return;
        }
        if ticket.evicted() {
            return;
        }
        tokio::select! {
            _ = &mut serving => return,
            _ = ticket.changed() => {}
            // Not admitted in time: a handshake never finished, or no request passed.
            _ = tokio::time::sleep_until(deadline) => if !ticket.admitted() { return },
        }
    }
}

async fn serve_http<I>(io: TokioIo<I>, app: Router, limits: Limits, mut stop: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(app);
    // The header timeout also runs while a kept-alive connection waits for its next request,
    // so it is the idle timeout as well.
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(64 * 1024)
        .serve_connection(io, service)
        .with_upgrades();
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = stopped(&mut stop) => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(DRAIN, conn).await;
        }
    }
}

/// A client connection: the socket with its write timeout, holding its ticket (and, once
/// admitted, its slot under the cap) for as long as it exists (an upgraded WebSocket keeps it
/// after hyper lets go).
struct Conn {
    io: Pin<Box<TimeoutStream<TcpStream>>>,
    _ticket: Arc<Ticket>,
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.get_mut().io.as_mut().poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().io.as_mut().poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().io.as_mut().poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().io.as_mut().poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().io.as_mut().poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// How many connections a server holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connections {
    /// Admitted: a request passed the access rules; each holds a slot under the cap.
    pub admitted: usize,
    /// Not admitted yet: each holds a pending place, for a short time.
    pub pending: usize,
}

/// A running server. Dropping it shuts the server down (and waits for its thread).
#[derive(Debug)]
pub struct ServerHandle {
    /// The served state, for counting its clients.
    clients: AppState,
    admission: Arc<Admission>,
    addr: SocketAddr,
    scheme: &'static str,
    token: Option<String>,
    warnings: Vec<String>,
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl ServerHandle {
    /// The address the server listens on (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT` (or `https://`), for clients; a wildcard bind is shown as loopback.
    pub fn url(&self) -> String {
        let ip = match self.addr.ip() {
            std::net::IpAddr::V4(v4) if v4.is_unspecified() => "127.0.0.1".to_owned(),
            std::net::IpAddr::V6(v6) if v6.is_unspecified() => "[::1]".to_owned(),
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        format!("{}://{ip}:{}", self.scheme, self.addr.port())
    }

    /// The page's address to open in a browser: with `#token=...` when the server has one (a
    /// fragment: the browser keeps it to the page and never sends it, not even to this server).
    pub fn login_url(&self) -> String {
        match &self.token {
            Some(t) => format!("{}/#token={t}", self.url()),
            None => format!("{}/", self.url()),
        }
    }

    /// The token every request must carry, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Clients of the full stream (`/api/stream`, `/api/ws`) connected now.
    pub fn stream_clients(&self) -> usize {
        self.clients.stream_clients()
    }

    /// Connections now: admitted (holding a slot under the cap) and pending (a handshake or a
    /// first request under way).
    pub fn connections(&self) -> Connections {
        Connections { admitted: self.admission.admitted(), pending: self.admission.pending() }
    }

    /// What was printed as warnings at start (exposure without TLS, any host allowed).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
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
