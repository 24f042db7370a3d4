//! The web page, embedded in the binary: no files to ship, no build step.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

const FILES: &[(&str, &str, &[u8])] = &[
    ("index.html", "text/html; charset=utf-8", include_bytes!("../assets/index.html")),
    ("app.js", "text/javascript; charset=utf-8", include_bytes!("../assets/app.js")),
    ("charts.js", "text/javascript; charset=utf-8", include_bytes!("../assets/charts.js")),
    ("app.css", "text/css; charset=utf-8", include_bytes!("../assets/app.css")),
    ("favicon.svg", "image/svg+xml", include_bytes!("../assets/favicon.svg")),
    ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8", include_bytes!("../assets/vendor/uPlot.iife.min.js")),
    ("vendor/uPlot.min.css", "text/css; charset=utf-8", include_bytes!("../assets/vendor/uPlot.min.css")),
    ("vendor/uPlot.LICENSE", "text/plain; charset=utf-8", include_bytes!("../assets/vendor/uPlot.LICENSE")),
];

/// An embedded file, or a JSON 404.
pub(crate) fn page(name: &str) -> Response {
    match FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, ctype, body)) => (
            [(header::CONTENT_TYPE, *ctype), (header::CACHE_CONTROL, "no-cache")],
            *body,
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({ "error": format!("no asset '{name}'"), "status": 404 })),
        )
            .into_response(),
    }
}
