//! Where events come from: a run's live SSE stream, or a replayed telemetry file. Both implement
//! [`Source`] and hand the state the same [`SourceUpdate`]s, so nothing downstream can tell them apart.

mod auth;
mod live;
mod replay;
pub mod sse;
mod vetting;

pub use auth::{Auth, AuthError, TOKEN_ENV};
pub use live::{decode, vet_event, vet_snapshot, Backoff, LiveSource, Refusal, MAX_BLOCK_ID, MAX_POOL_CLASS};
pub use replay::{replay_snapshot, ReplaySource};

use crate::app::{Control, SourceStatus, SourceUpdate};
use stagehand_events::{jsonl, DEFAULT_SERVER_ADDR};
use std::time::Instant;

/// Errors of the sources.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A telemetry file could not be read.
    #[error(transparent)]
    Jsonl(#[from] jsonl::JsonlError),
    /// A `--connect` address that is not an http(s) URL.
    #[error("unsupported address '{0}': expected http(s)://HOST:PORT[/api/stream] or HOST:PORT")]
    BadUrl(String),
    /// A `--connect` address with the token in it.
    #[error(
        "the address holds the token ('?token=...'): every user of this machine would see it in `ps`, and the header \
         would show it; put it in the {TOKEN_ENV} environment variable or a file named with --token-file"
    )]
    TokenInUrl,
    /// The token or TLS could not be set up.
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
}

/// A feed of updates for the state.
pub trait Source {
    /// Appends what arrived (or came due) since the last call.
    fn poll(&mut self, now: Instant, out: &mut Vec<SourceUpdate>);
    /// Pause, seek, speed. Controls a source cannot honour are ignored.
    fn control(&mut self, c: Control, out: &mut Vec<SourceUpdate>);
    /// How the source is doing, for the header.
    fn status(&self) -> SourceStatus;
    /// Whether the source is paused.
    fn paused(&self) -> bool;
}

/// The stream URL for a `--connect` argument: `HOST:PORT`, `http(s)://HOST:PORT` or a full URL.
/// An address with the token in it is refused (see [`Error::TokenInUrl`]).
pub fn stream_url(arg: Option<&str>) -> Result<String, Error> {
    let arg = arg.unwrap_or(DEFAULT_SERVER_ADDR).trim();
    let with_scheme = if arg.contains("://") {
        arg.to_owned()
    } else {
        format!("http://{arg}")
    };
    let (scheme, rest) = match with_scheme.split_once("://") {
        Some((s @ ("http" | "https"), rest)) => (s, rest),
        _ => return Err(Error::BadUrl(arg.to_owned())),
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(Error::BadUrl(arg.to_owned()));
    }
    let query = rest.split_once('?').map_or("", |(_, q)| q);
    if query.split('&').any(|kv| kv.split_once('=').map_or(kv, |(k, _)| k) == "token") {
        return Err(Error::TokenInUrl);
    }
    Ok(match rest.split_once('/') {
        Some((_, path)) if !path.is_empty() => with_scheme,
        Some((host, _)) => format!("{scheme}://{host}/api/stream"),
        None => format!("{with_scheme}/api/stream"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_arguments_become_stream_urls() {
        assert_eq!(stream_url(None).ok().as_deref(), Some("http://127.0.0.1:7878/api/stream"));
        assert_eq!(
            stream_url(Some("localhost:9000")).ok().as_deref(),
            Some("http://localhost:9000/api/stream")
        );
        assert_eq!(stream_url(Some("http://h:1/")).ok().as_deref(), Some("http://h:1/api/stream"));
        assert_eq!(
            stream_url(Some("http://h:1/custom/sse")).ok().as_deref(),
            Some("http://h:1/custom/sse")
        );
        assert_eq!(stream_url(Some("https://h:1")).ok().as_deref(), Some("https://h:1/api/stream"));
        assert!(stream_url(Some("ftp://h:1")).is_err());
        assert!(stream_url(Some("http://")).is_err());
        assert!(matches!(stream_url(Some("http://h:1/api/stream?token=abc")), Err(Error::TokenInUrl)));
        assert!(matches!(stream_url(Some("h:1/api/stream?x=1&token=abc")), Err(Error::TokenInUrl)));
    }
}
