//! The routes. Each handler carries its OpenAPI description (`utoipa`); the document built from
//! them and from the response types is served at `/api/openapi.json` (see [`crate::openapi`]).

pub(crate) mod controls;
pub(crate) mod flight;
pub(crate) mod routes;
mod state;
pub(crate) mod streams;

pub use state::{AppState, Mode};
pub(crate) use state::Shutdown;

use crate::access::guard;
use crate::replay::ControlError;
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, OriginalUri, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use std::time::Duration;

/// How often an idle stream sends a keep-alive (an SSE comment, or a WebSocket ping).
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Largest request body accepted (the controls take a few numbers).
const MAX_BODY: usize = 16 * 1024;

/// The body of every 4xx and 5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What was wrong, quoting the offending value and saying what was expected.
    pub error: String,
    /// The HTTP status, repeated.
    pub status: u16,
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
    pub(crate) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.message,
            status: self.status.as_u16(),
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        ApiError::new(r.status(), format!("bad request body: {}", r.body_text()))
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> ApiError {
        match e {
            ControlError::Bad(message) => ApiError::bad(message),
            ControlError::Unreadable(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

/// The router of every route, for serving with your own tokio or testing in memory. Every
/// route, the fallback included, passes the state's [`Access`](crate::Access) checks.
pub fn router(state: AppState) -> Router {
    let access = state.access.clone();
    let body_timeout = state.body_timeout;
    Router::new()
        .route("/", get(routes::page))
        .route("/assets/{*file}", get(routes::asset))
        .route("/api/openapi.json", get(routes::openapi))
        .route("/api/snapshot", get(routes::snapshot))
        .route("/api/run", get(routes::run))
        .route("/api/steps", get(routes::steps))
        .route("/metrics", get(routes::metrics))
        .route("/api/view", get(streams::view))
        .route("/api/view/stream", get(streams::view_stream))
        .route("/api/stream", get(streams::sse))
        .route("/api/ws", get(streams::ws))
        .route("/api/flight", post(flight::record))
        .route("/api/replay/status", get(controls::status))
        .route("/api/replay/play", post(controls::play))
        .route("/api/replay/pause", post(controls::pause))
        .route("/api/replay/seek", post(controls::seek))
        .route("/api/replay/speed", post(controls::speed))
        .route("/api/replay/step", post(controls::step))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(body_timeout, body_deadline))
        .layer(axum::middleware::from_fn_with_state(access, guard))
}

/// A request's body arrives whole within the body timeout, or the request is answered `408`
/// and its connection closed: a client sending a byte every few seconds holds nothing for long.
/// Read here, before any handler (bodies are at most [`MAX_BODY`] bytes).
async fn body_deadline(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(limit, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(e)) => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body could not be read: {e} (at most {MAX_BODY} bytes)"),
        )
        .into_response(),
        Err(_) => {
            let mut r = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request body did not arrive within {} ms", limit.as_millis()),
            )
            .into_response();
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    }
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
