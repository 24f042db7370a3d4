#![doc = include_str!("../README.md")]

mod access;
mod admission;
mod api;
mod assets;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod fanout;
#[cfg(feature = "handle")]
mod handle;
mod openapi;
mod priority;
mod replay;
mod server;
mod stream;
pub mod view;

pub use access::Access;
pub use api::controls::ReplayState;
pub use api::routes::{RunResponse, StepsPage, DEFAULT_STEPS_LIMIT};
pub use api::{router, AppState, ErrorBody, Mode, KEEP_ALIVE};
pub use openapi::openapi;
pub use config::{
    ServerConfig, TlsFiles, TokenSetting, DEFAULT_BODY_TIMEOUT_MS, DEFAULT_HEADER_TIMEOUT_MS, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PENDING, DEFAULT_PENDING_TIMEOUT_MS, DEFAULT_SERVER_ADDR, DEFAULT_WRITE_TIMEOUT_MS, MIN_TOKEN_LEN,
};
pub use fanout::{FANOUT_CAPACITY, RECENT_EVENTS};
#[cfg(feature = "handle")]
pub use handle::Observe;
pub use replay::{ControlError, ReplayDriver};
pub use server::{Connections, Server, ServerHandle};

use std::path::PathBuf;

/// What can go wrong while starting or stopping a server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address could not be bound.
    #[error("cannot listen on '{addr}': {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// Serving as asked would expose the run to anyone who can reach it.
    #[error(
        "refusing to serve on '{addr}' without a token: {reason}. Keep the token (the default beyond \
         loopback: it is printed in the address to open), or bind 127.0.0.1 and reach it through an \
         SSH tunnel (ssh -L PORT:127.0.0.1:PORT HOST)"
    )]
    Insecure { addr: String, reason: String },
    /// A setting that cannot work (a short token, a malformed host name, a zero limit).
    #[error("bad server setting: {0}")]
    Config(String),
    /// The TLS certificate or key could not be used.
    #[error("TLS file '{path}': {reason}")]
    Tls { path: PathBuf, reason: String },
    /// The tokio runtime or its thread could not be started.
    #[error("cannot start the server thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// The replayed file could not be read.
    #[error("cannot replay '{path}': {source}")]
    Replay {
        path: PathBuf,
        #[source]
        source: stagehand_events::jsonl::JsonlError,
    },
    /// The server thread panicked.
    #[error("the server thread panicked")]
    Panicked,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
