//! Requests answered by the router in process (no socket), for the route tests: the status,
//! the content type and the body.

#![allow(dead_code)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use stagehand_web::{router, AppState};
use tower::ServiceExt;

pub async fn call(state: &AppState, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, String, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "localhost:7878")
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .expect("request");
    let resp = router(state.clone()).oneshot(req).await.expect("answers");
    let status = resp.status();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes().to_vec();
    (status, ctype, bytes)
}
