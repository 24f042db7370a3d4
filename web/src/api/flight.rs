//! A flight record on request: the last steps of a live run in full detail, written beside its
//! telemetry file by the run's flight recorder, whose rate limit applies.

use super::routes::Refusals;
use super::{ApiError, AppState, ErrorBody};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;
use stagehand_events::bus::FlightError;

/// A flight record written.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct FlightRecord {
    /// The file, as the run's process names it (it opens in every telemetry reader).
    pub path: String,
}

/// Writes a flight record of the last steps now.
#[utoipa::path(post, path = "/api/flight", tag = "state",
    request_body(content = Option<serde_json::Value>, content_type = "application/json", description = "Empty or {}"),
    responses((status = 200, body = FlightRecord),
              (status = 404, description = "The run has no flight recorder (a replay, or telemetry without one)", body = ErrorBody),
              (status = 429, description = "A record was requested too recently (the recorder's interval)", body = ErrorBody),
              (status = 500, description = "The record could not be written", body = ErrorBody), Refusals))]
pub(crate) async fn record(State(s): State<AppState>) -> Result<Json<FlightRecord>, ApiError> {
    let hub = s.hub.clone();
    // Writing the record is file I/O under the recorder's lock: off the async workers.
    let written = tokio::task::spawn_blocking(move || hub.request_flight("api"))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the request failed: {e}")))?;
    match written {
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "this run has no flight recorder: a replay, or telemetry attached without one",
        )),
        Some(Ok(path)) => Ok(Json(FlightRecord { path: path.display().to_string() })),
        Some(Err(e @ FlightError::RateLimited(_))) => Err(ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())),
        Some(Err(e)) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}
