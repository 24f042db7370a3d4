//! The page, its assets, and the state of the run: snapshot, run description, steps, metrics.

use super::{ApiError, AppState, ErrorBody, Mode};
use crate::assets;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use stagehand_events::snapshot::{RunInfo, StepRecord, STEP_HISTORY};
use stagehand_events::{Phase, SCHEMA_VERSION};
use stagehand_exporter::TEXT_CONTENT_TYPE;
use std::collections::HashMap;

/// Steps returned by `/api/steps` when no `limit` is given.
pub const DEFAULT_STEPS_LIMIT: usize = 100;

/// The answers every route may give instead of its own: refusals of the access rules, and
/// malformed requests.
#[derive(Debug, utoipa::IntoResponses)]
#[allow(dead_code)] // documentation only: the answers are built by `ApiError`
pub(crate) enum Refusals {
    /// A malformed request: no `Host`, a bad parameter or body.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// The server has a token and the request did not carry it.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// A host name or origin this server does not answer to, or another site's request.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// A state-changing request without `Content-Type: application/json`.
    #[response(status = 415)]
    UnsupportedMediaType(ErrorBody),
}

/// The dashboard.
#[utoipa::path(get, path = "/", tag = "page",
    responses((status = 200, description = "The dashboard page", content_type = "text/html"), Refusals))]
pub(crate) async fn page() -> Response {
    assets::page("index.html")
}

/// The page's scripts, styles and the vendored chart library, embedded in the binary.
#[utoipa::path(get, path = "/assets/{file}", tag = "page",
    params(("file" = String, Path, description = "app.js, charts.js, app.css, vendor/uPlot.iife.min.js, ...")),
    responses((status = 200, description = "The file"), (status = 404, description = "No such asset", body = ErrorBody), Refusals))]
pub(crate) async fn asset(axum::extract::Path(file): axum::extract::Path<String>) -> Response {
    assets::page(&file)
}

/// This document.
#[utoipa::path(get, path = "/api/openapi.json", tag = "meta",
    responses((status = 200, description = "The OpenAPI document of every route", content_type = "application/json"), Refusals))]
pub(crate) async fn openapi() -> Response {
    match crate::openapi::document() {
        Ok(doc) => ([(header::CONTENT_TYPE, "application/json")], doc).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

/// How long one encoding of the snapshot answers every request for it.
pub const SNAPSHOT_REUSE: std::time::Duration = std::time::Duration::from_millis(250);

/// The snapshot's JSON, encoded at most once per [`SNAPSHOT_REUSE`] whatever the number of
/// clients: encoding holds the hub (and so the events' delivery), and clients polling it must
/// not add up to a load on the run.
#[derive(Debug, Default)]
pub(crate) struct SnapshotCache {
    last: tokio::sync::Mutex<Option<Encoding>>,
}

/// One encoding of the snapshot.
#[derive(Debug)]
struct Encoding {
    at: std::time::Instant,
    /// The snapshot's (events applied, last sequence number) then.
    key: (u64, u64),
    json: bytes::Bytes,
}

impl SnapshotCache {
    /// The snapshot's JSON: encoded now, or less than [`SNAPSHOT_REUSE`] ago, or when the
    /// snapshot was as it is now.
    async fn get(&self, hub: &stagehand_events::Hub) -> Result<bytes::Bytes, serde_json::Error> {
        // One encoding at a time: the requests that wait get its result.
        let mut last = self.last.lock().await;
        let now = hub.with_snapshot(|s| (s.events_applied, s.last_seq));
        if let Some(e) = &*last {
            if e.key == now || e.at.elapsed() < SNAPSHOT_REUSE {
                return Ok(e.json.clone());
            }
        }
        // Serialized under the hub's lock, without a clone of the whole snapshot.
        let (key, json) = hub.with_snapshot(|s| ((s.events_applied, s.last_seq), serde_json::to_vec(s)));
        let json = bytes::Bytes::from(json?);
        *last = Some(Encoding { at: std::time::Instant::now(), key, json: json.clone() });
        Ok(json)
    }

    /// Forgets the encoding (the state jumped: a replay seek).
    pub(crate) async fn clear(&self) {
        *self.last.lock().await = None;
    }
}

/// The current snapshot: everything known about the run, as every client's reducer has it
/// (encoded at most four times a second, however many ask).
#[utoipa::path(get, path = "/api/snapshot", tag = "state",
    responses((status = 200, description = "The snapshot", body = stagehand_events::Snapshot), Refusals))]
pub(crate) async fn snapshot(State(s): State<AppState>) -> Response {
    match s.snapshots.get(&s.hub).await {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// What `/api/run` answers.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct RunResponse {
    pub mode: Mode,
    /// What `run_started` said (its `config` exactly as the run published it), once it came.
    pub run: Option<RunInfo>,
    pub ended: bool,
    pub step: u64,
    pub phase: Phase,
    pub events_applied: u64,
    pub dropped_events: u64,
    pub schema_version: u32,
    pub server_version: String,
}

/// What is running: mode, model, device, versions, and the run's configuration.
#[utoipa::path(get, path = "/api/run", tag = "state",
    responses((status = 200, description = "The run", body = RunResponse), Refusals))]
pub(crate) async fn run(State(s): State<AppState>) -> Json<RunResponse> {
    let mode = s.mode();
    Json(s.hub.with_snapshot(|snap| RunResponse {
        mode,
        run: snap.run.clone(),
        ended: snap.ended,
        step: snap.step,
        phase: snap.phase,
        events_applied: snap.events_applied,
        dropped_events: snap.dropped_events,
        schema_version: SCHEMA_VERSION,
        server_version: env!("CARGO_PKG_VERSION").to_owned(),
    }))
}

/// A page of the per-step history.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepsPage {
    /// The oldest and newest steps still kept.
    pub first_available: Option<u64>,
    pub last_available: Option<u64>,
    pub from: u64,
    pub limit: usize,
    /// More steps follow the ones returned.
    pub more: bool,
    pub steps: Vec<StepRecord>,
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

/// The per-step history: weights, activations, Conductor, trainer, time breakdown and VRAM at
/// the peak of each step.
#[utoipa::path(get, path = "/api/steps", tag = "state",
    params(("from" = Option<u64>, Query, description = "First step wanted (default 0)"),
           ("limit" = Option<usize>, Query, description = "Steps wanted, 1 to 512 (default 100)")),
    responses((status = 200, description = "Steps from `from` on", body = StepsPage), Refusals))]
pub(crate) async fn steps(
    State(s): State<AppState>,
    q: Result<Query<HashMap<String, String>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<StepsPage>, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad(format!("bad query: {}", e.body_text())))?;
    // `token` is the access token, already checked.
    if let Some(k) = q.keys().find(|k| !matches!(k.as_str(), "from" | "limit" | "token")) {
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
    Ok(Json(s.hub.with_snapshot(|snap| {
        let mut wanted = snap.steps.iter().filter(|r| r.step >= from);
        let steps: Vec<StepRecord> = wanted.by_ref().take(limit).cloned().collect();
        StepsPage {
            first_available: snap.steps.front().map(|r| r.step),
            last_available: snap.steps.back().map(|r| r.step),
            from,
            limit,
            more: wanted.next().is_some(),
            steps,
        }
    })))
}

/// Prometheus metrics of the run (or of the replay's position).
#[utoipa::path(get, path = "/metrics", tag = "state",
    responses((status = 200, description = "Prometheus text format 0.0.4", content_type = "text/plain"), Refusals))]
pub(crate) async fn metrics(State(s): State<AppState>) -> Response {
    match s.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, TEXT_CONTENT_TYPE)], text).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_events::synthetic::{self, SyntheticRun};
    use stagehand_events::Hub;

    #[tokio::test]
    async fn the_snapshot_is_encoded_once_for_requests_close_together() {
        let hub = Hub::new();
        for e in synthetic::events(SyntheticRun::finished(2)) {
            hub.ingest(e);
        }
        let cache = SnapshotCache::default();
        let first = cache.get(&hub).await.expect("encodes");
        for _ in 0..100 {
            let again = cache.get(&hub).await.expect("encodes");
            assert_eq!(again.as_ptr(), first.as_ptr(), "the same encoding, shared");
        }
        // A changed state is encoded again once the reuse window has passed...
        for e in synthetic::events(SyntheticRun::finished(1)).into_iter().take(5) {
            hub.ingest(e);
        }
        tokio::time::sleep(SNAPSHOT_REUSE).await;
        let later = cache.get(&hub).await.expect("encodes");
        assert_ne!(later.as_ptr(), first.as_ptr());
        // ... or at once when told the state jumped.
        cache.clear().await;
        assert_ne!(cache.get(&hub).await.expect("encodes").as_ptr(), later.as_ptr());
    }
}
