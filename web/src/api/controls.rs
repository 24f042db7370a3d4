//! Replay controls: play, pause, seek, speed, step. Each answers where the replay is now; on a
//! live server they answer 404.

use super::routes::Refusals;
use super::{ApiError, AppState, ErrorBody};
use crate::replay::{ReplayDriver, SeekRequest, SpeedRequest, StepRequest};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use stagehand_events::ReplayStatus;
use std::sync::Arc;

/// Where a replay is: the replay's own status, answered as it is.
pub type ReplayState = ReplayStatus;

fn driver(s: &AppState) -> Result<&Arc<ReplayDriver>, ApiError> {
    s.replay.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "this server shows a live run: replay controls exist only when replaying a file",
        )
    })
}

type Answer = Result<Json<ReplayState>, ApiError>;

/// Where the replay is.
#[utoipa::path(get, path = "/api/replay/status", tag = "replay",
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody), Refusals))]
pub(crate) async fn status(State(s): State<AppState>) -> Answer {
    Ok(Json(driver(&s)?.status()))
}

/// Plays from the position at the speed in force.
#[utoipa::path(post, path = "/api/replay/play", tag = "replay",
    request_body(content = Option<serde_json::Value>, content_type = "application/json", description = "Empty or {}"),
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody), Refusals))]
pub(crate) async fn play(State(s): State<AppState>) -> Answer {
    Ok(Json(driver(&s)?.set_paused(false)))
}

/// Pauses.
#[utoipa::path(post, path = "/api/replay/pause", tag = "replay",
    request_body(content = Option<serde_json::Value>, content_type = "application/json", description = "Empty or {}"),
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody), Refusals))]
pub(crate) async fn pause(State(s): State<AppState>) -> Answer {
    Ok(Json(driver(&s)?.set_paused(true)))
}

/// Jumps to an event index, a fraction of the file, a time, or the start of a step.
#[utoipa::path(post, path = "/api/replay/seek", tag = "replay", request_body = SeekRequest,
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody),
              (status = 422, description = "A body that is not a SeekRequest", body = ErrorBody), Refusals))]
pub(crate) async fn seek(State(s): State<AppState>, body: Result<Json<SeekRequest>, JsonRejection>) -> Answer {
    let d = driver(&s)?;
    let Json(req) = body?;
    let state = d.seek(&req, &s.hub)?;
    // The state jumped: the next snapshot is encoded afresh.
    s.snapshots.clear().await;
    Ok(Json(state))
}

/// Sets the playback speed.
#[utoipa::path(post, path = "/api/replay/speed", tag = "replay", request_body = SpeedRequest,
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody),
              (status = 422, description = "A body that is not a SpeedRequest", body = ErrorBody), Refusals))]
pub(crate) async fn speed(State(s): State<AppState>, body: Result<Json<SpeedRequest>, JsonRejection>) -> Answer {
    let d = driver(&s)?;
    let Json(req) = body?;
    Ok(Json(d.set_speed(&req)?))
}

/// Moves by events or training steps, and pauses.
#[utoipa::path(post, path = "/api/replay/step", tag = "replay", request_body = StepRequest,
    responses((status = 200, body = ReplayState), (status = 404, description = "A live server", body = ErrorBody),
              (status = 422, description = "A body that is not a StepRequest", body = ErrorBody), Refusals))]
pub(crate) async fn step(State(s): State<AppState>, body: Result<Json<StepRequest>, JsonRejection>) -> Answer {
    let d = driver(&s)?;
    let Json(req) = body?;
    let state = d.step(&req, &s.hub)?;
    s.snapshots.clear().await;
    Ok(Json(state))
}
