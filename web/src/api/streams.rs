//! The streams: the page's view (`/api/view`, `/api/view/stream`) and the full event stream
//! for programs (`/api/stream` over SSE, `/api/ws` over WebSocket).

use super::routes::Refusals;
use super::{ApiError, AppState, KEEP_ALIVE};
use crate::stream::Feed;
use crate::view::ViewMessage;
use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{stream, SinkExt};
use std::convert::Infallible;
use std::time::{Duration, Instant};

/// A WebSocket client that answers nothing (not even a ping) for this long is gone.
const WS_SILENCE: Duration = Duration::from_secs(30);
/// Most a WebSocket client's write buffer may hold (one message: a large run's snapshot).
const MAX_WS_WRITE_BUFFER: usize = 64 << 20;

fn json_bytes(body: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The page's view now, with every recent log line: the first message of `/api/view/stream`.
#[utoipa::path(get, path = "/api/view", tag = "page",
    responses((status = 200, description = "The view the page shows", body = ViewMessage), Refusals))]
pub(crate) async fn view(State(s): State<AppState>) -> Response {
    match s.views.current(&s) {
        Some(m) => json_bytes(m.json()),
        None => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the view could not be built").into_response(),
    }
}

/// SSE of the page's view: the current one with the recent log, then a fresh one whenever it
/// changes (at most every [`VIEW_INTERVAL`](crate::view::feed::VIEW_INTERVAL)).
#[utoipa::path(get, path = "/api/view/stream", tag = "page",
    responses((status = 200, content_type = "text/event-stream",
        description = "Server-Sent Events named `view`, each a ViewMessage (the schema of /api/view); the log lines \
                       are those since the previous view. Comments are keep-alives.", body = ViewMessage), Refusals))]
pub(crate) async fn view_stream(State(s): State<AppState>) -> Response {
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

/// The full event stream, for programs (`stagehand-top`): each message as the fan-out framed
/// it, with a keep-alive comment when idle.
#[utoipa::path(get, path = "/api/stream", tag = "stream",
    responses((status = 200, content_type = "text/event-stream",
        description = "Server-Sent Events. Each `event:` names a stream message and its `data:` is the message as JSON, \
                       tagged by `type`: first `snapshot` {snapshot: Snapshot}, then one `event` {event} per event \
                       (the JSONL event format); a client that fell behind gets `lagged` {missed} and a fresh \
                       `snapshot`, and so does every client after a replay seek. Comments are keep-alives.",
        body = stagehand_events::Snapshot), Refusals))]
pub(crate) async fn sse(State(s): State<AppState>) -> Response {
    let body = stream::unfold(feed(&s), |mut feed| async move {
        let chunk = match tokio::time::timeout(KEEP_ALIVE, feed.next()).await {
            Ok(Some(c)) => c.sse(),
            Ok(None) => return None,
            Err(_) => Bytes::from_static(b": keep-alive\n\n"),
        };
        Some((Ok::<_, Infallible>(chunk), feed))
    });
    sse_response(Body::from_stream(body))
}

/// The full event stream over a WebSocket: the messages of `/api/stream` as JSON text frames.
#[utoipa::path(get, path = "/api/ws", tag = "stream",
    responses((status = 101, description = "Switching to a WebSocket carrying the messages of /api/stream as text frames; \
                                            the server pings every 5 s and closes a client silent for 30 s"), Refusals))]
pub(crate) async fn ws(State(s): State<AppState>, upgrade: WebSocketUpgrade) -> Response {
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
            chunk = feed.next() => {
                let Some(chunk) = chunk else { break };
                // A batch's messages go out as text frames, flushed once.
                for json in chunk.json() {
                    // The fan-out's JSON is UTF-8 by construction; the check is a scan, no copy.
                    let Ok(text) = axum::extract::ws::Utf8Bytes::try_from(json) else { return };
                    if socket.feed(Message::Text(text)).await.is_err() {
                        return;
                    }
                }
                if socket.flush().await.is_err() {
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

