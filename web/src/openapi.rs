//! The OpenAPI document of every route, generated from the handlers' descriptions and from the
//! types they answer with (the snapshot's own types included), and served at
//! `/api/openapi.json`.

use crate::api::{controls, flight, routes, streams};
use std::sync::OnceLock;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Stagehand",
        description = "The HTTP API of a Stagehand run (or of a replayed telemetry file): its state, its live \
                       streams, the web page's view, and replay controls. Requests must name this server in \
                       `Host`; a browser's requests must come from the server's own page. When the server has a \
                       token, every request but the page's own files (`/`, `/assets/...`) carries it: \
                       `Authorization: Bearer TOKEN` or `?token=TOKEN` (never a cookie). Errors are JSON: {\"error\": \"...\", \"status\": N}."
    ),
    paths(
        routes::page, routes::asset, routes::openapi, routes::snapshot, routes::run, routes::steps, routes::metrics,
        streams::view, streams::view_stream, streams::sse, streams::ws,
        flight::record,
        controls::status, controls::play, controls::pause, controls::seek, controls::speed, controls::step,
    ),
    modifiers(&Security),
    security((), ("bearer" = []), ("cookie" = []), ("query" = [])),
    tags(
        (name = "page", description = "The web dashboard and the view it renders"),
        (name = "state", description = "The run's state"),
        (name = "stream", description = "The full event stream, for programs"),
        (name = "replay", description = "Replay controls (a server replaying a file)"),
        (name = "meta", description = "This document"),
    )
)]
struct ApiDoc;

/// The ways a token may come, for servers that have one.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "cookie",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::new("stagehand_token_PORT"))),
        );
        components.add_security_scheme("query", SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::new("token"))));
    }
}

/// The OpenAPI document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as served, built once.
pub(crate) fn document() -> Result<&'static str, String> {
    static DOC: OnceLock<Result<String, String>> = OnceLock::new();
    DOC.get_or_init(|| openapi().to_json().map_err(|e| format!("cannot encode the OpenAPI document: {e}")))
        .as_deref()
        .map_err(Clone::clone)
}
