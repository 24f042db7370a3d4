//! The routes. Every one is documented in `assets/openapi.json`, served at `/api/openapi.json`.

use crate::access::{guard, Access};
use crate::assets;
use crate::fanout::Fanout;
use crate::view::feed::ViewFeed;
use crate::replay::{BadControl, ReplayDriver, SeekRequest, SpeedRequest, StepRequest};
use crate::stream::Feed;
use axum::extract::rejection::JsonRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, OriginalUri, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use futures_util::stream;
use serde::Serialize;
use serde_json::json;
use stagehand::events::snapshot::STEP_HISTORY;
use stagehand::events::{Hub, SCHEMA_VERSION};
use stagehand_exporter::{Metrics, TEXT_CONTENT_TYPE};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often an idle stream sends a keep-alive (an SSE comment, or a WebSocket ping).
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Steps returned by `/api/steps` when no `limit` is given.
pub const DEFAULT_STEPS_LIMIT: usize = 100;
/// A WebSocket client that answers nothing (not even a ping) for this long is gone.
const WS_SILENCE: Duration = Duration::from_secs(30);
/// Most a WebSocket client's write buffer may hold (one message: a large run's snapshot).
const MAX_WS_WRITE_BUFFER: usize = 64 << 20;
/// Largest request body accepted (the controls take a few numbers).
const MAX_BODY: usize = 16 * 1024;

/// Whether the server shows a live run or replays a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Live,
    Replay,
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    hub: Arc<Hub>,
    metrics: Metrics,
    replay: Option<Arc<ReplayDriver>>,
    stop: Shutdown,
    fanout: Arc<Fanout>,
    views: Arc<ViewFeed>,
    access: Arc<Access>,
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
        }
    }

    /// A replay: the driver feeds a hub of its own, with a metrics sink. Serving it with your
    /// own tokio, spawn [`ReplayDriver::run`] as well, or it never plays.
    pub fn replay(driver: Arc<ReplayDriver>) -> AppState {
        let hub = Arc::new(Hub::new());
        let metrics = Metrics::new();
        hub.add_sink(Box::new(metrics.clone()));
        let fanout = Fanout::attach(&hub);
        AppState {
            hub,
            metrics,
            replay: Some(driver),
            stop: Shutdown::default(),
            fanout,
            views: ViewFeed::new(),
            access: Arc::new(Access::loopback()),
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

/// A 4xx/5xx answer with a JSON body: `{"error": "...", "status": 400}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
    fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({ "error": self.message, "status": self.status.as_u16() })),
        )
            .into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        ApiError::new(r.status(), format!("bad request body: {}", r.body_text()))
    }
}

impl From<BadControl> for ApiError {
    fn from(b: BadControl) -> ApiError {
        ApiError::bad(b.0)
    }
}

/// The router of every route, for serving with your own tokio or testing in memory. Every
/// route, the fallback included, passes the state's [`Access`] checks.
pub fn router(state: AppState) -> Router {
    let access = state.access.clone();
    Router::new()
        .route("/", get(|| async { assets::page("index.html") }))
        .route("/assets/{*file}", get(asset))
        .route("/api/snapshot", get(snapshot))
        .route("/api/stream", get(sse))
        .route("/api/ws", get(ws))
        .route("/api/view", get(view))
        .route("/api/view/stream", get(view_stream))
        .route("/api/run", get(run))
        .route("/api/steps", get(steps))
        .route("/api/openapi.json", get(openapi))
        .route("/api/replay/status", get(replay_status))
        .route("/api/replay/play", post(replay_play))
        .route("/api/replay/pause", post(replay_pause))
        .route("/api/replay/seek", post(replay_seek))
        .route("/api/replay/speed", post(replay_speed))
        .route("/api/replay/step", post(replay_step))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(access, guard))
}

async fn not_found(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route '{}': see /api/openapi.json", uri.path()),
    )
}

async fn method_not_allowed(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method not allowed on '{}': see /api/openapi.json", uri.path()),
    )
}

async fn asset(axum::extract::Path(file): axum::extract::Path<String>) -> Response {
    assets::page(&file)
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        assets::OPENAPI,
    )
        .into_response()
}

async fn snapshot(State(s): State<AppState>) -> Response {
    // Serialized under the hub's lock, without a clone of the whole snapshot.
    match s.hub.with_snapshot(serde_json::to_vec) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn run(State(s): State<AppState>) -> Json<serde_json::Value> {
    let body = s.hub.with_snapshot(|snap| {
        json!({
            "mode": s.mode(),
            "run": snap.run,
            "ended": snap.ended,
            "step": snap.step,
            "phase": snap.phase,
            "events_applied": snap.events_applied,
            "dropped_events": snap.dropped_events,
            "schema_version": SCHEMA_VERSION,
            "server_version": env!("CARGO_PKG_VERSION"),
        })
    });
    Json(body)
}

fn parse_param<T: std::str::FromStr>(q: &HashMap<String, String>, key: &str, what: &str) -> Result<Option<T>, ApiError> {
    match q.get(key) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad(format!("'{key}={v}' is not valid: expected {what}"))),
    }
}

async fn steps(
    State(s): State<AppState>,
    q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad(format!("bad query: {}", e.body_text())))?;
    if let Some(k) = q.keys().find(|k| *k != "from" && *k != "limit") {
        return Err(ApiError::bad(format!(
            "unknown parameter '{k}': expected 'from' and 'limit'"
        )));
    }
    let from: u64 = parse_param(&q, "from", "a step number (a non-negative integer)")?.unwrap_or(0);
    let limit: usize = parse_param(&q, "limit", &format!("an integer from 1 to {STEP_HISTORY}"))?
        .unwrap_or(DEFAULT_STEPS_LIMIT);
    if limit == 0 || limit > STEP_HISTORY {
        return Err(ApiError::bad(format!(
            "'limit={limit}' is out of range: expected 1 to {STEP_HISTORY}"
        )));
    }
    let body = s.hub.with_snapshot(|snap| {
        let selected: Vec<_> = snap.steps.iter().filter(|r| r.step >= from).take(limit).collect();
        let more = snap.steps.iter().filter(|r| r.step >= from).count() > selected.len();
        json!({
            "first_available": snap.steps.front().map(|r| r.step),
            "last_available": snap.steps.back().map(|r| r.step),
            "from": from,
            "limit": limit,
            "more": more,
            "steps": selected,
        })
    });
    Ok(Json(body))
}

async fn metrics(State(s): State<AppState>) -> Response {
    match s.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, TEXT_CONTENT_TYPE)], text).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn json_bytes(body: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn view(State(s): State<AppState>) -> Response {
    match s.views.current(&s) {
        Some(m) => json_bytes(m.json()),
        None => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the view could not be built").into_response(),
    }
}

/// SSE of the page's view: the current one with the recent log, then a fresh one whenever it
/// changes (at most every [`VIEW_INTERVAL`](crate::view::feed::VIEW_INTERVAL)).
async fn view_stream(State(s): State<AppState>) -> Response {
    let (first, rx) = s.views.subscribe(&s);
    let start = (first, rx, s.stop.clone());
    let body = stream::unfold(start, |(pending, mut rx, mut stop)| async move {
        if let Some(first) = pending {
            return Some((Ok::<_, Infallible>(first.sse()), (None, rx, stop)));
        }
        let chunk = tokio::select! {
            changed = tokio::time::timeout(KEEP_ALIVE, rx.changed()) => match changed {
                Ok(Ok(())) => rx.borrow_and_update().as_ref().map(|f| f.tick.sse()),
                Ok(Err(_)) => return None,
                Err(_) => Some(Bytes::from_static(b": keep-alive\n\n")),
            },
            _ = stop.wait() => return None,
        };
        let chunk = chunk.unwrap_or_else(|| Bytes::from_static(b": keep-alive\n\n"));
        Some((Ok(chunk), (None, rx, stop)))
    });
    sse_response(Body::from_stream(body))
}

fn sse_response(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn feed(s: &AppState) -> Feed {
    Feed::new(s.hub.clone(), s.fanout.clone(), s.stop.clone())
}

/// SSE: the messages as the fan-out framed them, with a keep-alive comment when idle.
async fn sse(State(s): State<AppState>) -> Response {
    let body = stream::unfold(feed(&s), |mut feed| async move {
        let chunk = match tokio::time::timeout(KEEP_ALIVE, feed.next()).await {
            Ok(Some(m)) => m.sse(),
            Ok(None) => return None,
            Err(_) => Bytes::from_static(b": keep-alive\n\n"),
        };
        Some((Ok::<_, Infallible>(chunk), feed))
    });
    sse_response(Body::from_stream(body))
}

async fn ws(State(s): State<AppState>, upgrade: WebSocketUpgrade) -> Response {
    // Clients have nothing to say beyond pongs and a close: small frames in, a small read
    // buffer (the default is 128 KiB per client). Out, each send waits for the previous flush,
    // so the write buffer holds one message beyond its small threshold.
    upgrade
        .max_message_size(4096)
        .max_frame_size(4096)
        .read_buffer_size(4096)
        .write_buffer_size(8192)
        .max_write_buffer_size(MAX_WS_WRITE_BUFFER)
        .on_upgrade(move |socket| ws_session(socket, s))
}

async fn ws_session(mut socket: WebSocket, s: AppState) {
    let mut feed = feed(&s);
    let mut ping = tokio::time::interval(KEEP_ALIVE);
    ping.tick().await;
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            msg = feed.next() => {
                let Some(msg) = msg else { break };
                // The fan-out's JSON is UTF-8 by construction; the check is a scan, no copy.
                let Ok(text) = axum::extract::ws::Utf8Bytes::try_from(msg.json()) else { break };
                if socket.send(Message::Text(text)).await.is_err() {
                    return;
                }
            }
            incoming = socket.recv() => match incoming {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(_)) => heard = Instant::now(),
            },
            _ = ping.tick() => {
                if heard.elapsed() > WS_SILENCE {
                    break;
                }
                if socket.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = socket.send(Message::Close(None)).await;
}

fn driver(s: &AppState) -> Result<&Arc<ReplayDriver>, ApiError> {
    s.replay.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "this server shows a live run: replay controls exist only when replaying a file",
        )
    })
}

async fn replay_status(State(s): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(json!(driver(&s)?.status())))
}

async fn replay_play(State(s): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(json!(driver(&s)?.set_paused(false))))
}

async fn replay_pause(State(s): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(json!(driver(&s)?.set_paused(true))))
}

async fn replay_seek(
    State(s): State<AppState>,
    body: Result<Json<SeekRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let d = driver(&s)?;
    let Json(req) = body?;
    Ok(Json(json!(d.seek(&req, &s.hub)?)))
}

async fn replay_speed(
    State(s): State<AppState>,
    body: Result<Json<SpeedRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let d = driver(&s)?;
    let Json(req) = body?;
    Ok(Json(json!(d.set_speed(&req)?)))
}

async fn replay_step(
    State(s): State<AppState>,
    body: Result<Json<StepRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let d = driver(&s)?;
    let Json(req) = body?;
    Ok(Json(json!(d.step(&req, &s.hub)?)))
}
