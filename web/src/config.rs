//! How a server is exposed: address, token, accepted host names, TLS, and the limits that keep
//! a hostile or careless client from taking the server (or the training run) down.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

pub use stagehand_events::DEFAULT_SERVER_ADDR;

/// Admitted connections served at once (a request passed the access rules, the token when
/// there is one); a request beyond is answered `503`. SSE and WebSocket clients count for as
/// long as they stay connected.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;
/// Connections not yet admitted held at once (a TLS handshake or a first request under way);
/// a new one beyond pushes out the oldest. Clients that never authenticate only ever take
/// these places, never an admitted client's slot.
pub const DEFAULT_MAX_PENDING: usize = 32;
/// Milliseconds a connection may stay pending (finish its TLS handshake and send a request
/// that passes the access rules) before it is closed.
pub const DEFAULT_PENDING_TIMEOUT_MS: u64 = 5_000;
/// Milliseconds a request's body may take to arrive, all of it, before the request is answered
/// `408` and its connection closed.
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 5_000;
/// Milliseconds a connection may take to send a request's headers (and a TLS handshake), and
/// may sit idle between requests, before it is closed.
pub const DEFAULT_HEADER_TIMEOUT_MS: u64 = 10_000;
/// Milliseconds a write to a client may stay blocked (a client that stopped reading) before the
/// connection is closed.
pub const DEFAULT_WRITE_TIMEOUT_MS: u64 = 30_000;
/// Shortest token accepted; random tokens are 48 hex characters.
pub const MIN_TOKEN_LEN: usize = 16;

/// Whether the server requires a token.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenSetting {
    /// A random token when bound beyond loopback, none on loopback.
    #[default]
    Auto,
    /// A random token, wherever bound.
    Random,
    /// This token (at least [`MIN_TOKEN_LEN`] characters, no spaces, quotes, `;` or `,`).
    Fixed(String),
    /// No token. Refused beyond loopback.
    Off,
}

impl std::fmt::Debug for TokenSetting {
    // Never print a token into a log by way of a config dump.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSetting::Auto => f.write_str("Auto"),
            TokenSetting::Random => f.write_str("Random"),
            TokenSetting::Fixed(_) => f.write_str("Fixed(<redacted>)"),
            TokenSetting::Off => f.write_str("Off"),
        }
    }
}

/// A certificate chain and its private key, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Everything [`Server::start`](crate::Server::start) needs to know about exposure and limits.
///
/// The defaults serve loopback only, without a token, with the limits above.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerConfig {
    /// `HOST:PORT` to bind (`127.0.0.1:0` for any free port).
    pub addr: String,
    pub token: TokenSetting,
    /// Host names (or `NAME:PORT`) accepted in `Host` and `Origin` besides the loopback names
    /// and the bound address, e.g. the name a reverse proxy or a remote browser uses. `*`
    /// accepts any host, which gives up the protection against DNS rebinding.
    pub allowed_hosts: Vec<String>,
    /// Serve HTTPS with this certificate.
    pub tls: Option<TlsFiles>,
    pub max_connections: usize,
    pub max_pending: usize,
    pub header_timeout_ms: u64,
    pub write_timeout_ms: u64,
    pub pending_timeout_ms: u64,
    pub body_timeout_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            addr: DEFAULT_SERVER_ADDR.to_owned(),
            token: TokenSetting::Auto,
            allowed_hosts: Vec::new(),
            tls: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_pending: DEFAULT_MAX_PENDING,
            header_timeout_ms: DEFAULT_HEADER_TIMEOUT_MS,
            write_timeout_ms: DEFAULT_WRITE_TIMEOUT_MS,
            pending_timeout_ms: DEFAULT_PENDING_TIMEOUT_MS,
            body_timeout_ms: DEFAULT_BODY_TIMEOUT_MS,
        }
    }
}

impl ServerConfig {
    /// The defaults, bound to `addr`.
    pub fn new(addr: impl Into<String>) -> ServerConfig {
        ServerConfig {
            addr: addr.into(),
            ..ServerConfig::default()
        }
    }
}

/// Why a token is not acceptable, or `None` when it is.
pub(crate) fn token_problem(token: &str) -> Option<String> {
    if token.chars().count() < MIN_TOKEN_LEN {
        return Some(format!(
            "the token is {} characters long: expected at least {MIN_TOKEN_LEN}",
            token.chars().count()
        ));
    }
    // It travels in a query string, a cookie and a header: keep it to characters all three
    // carry without quoting.
    if let Some(c) = token
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '"' | ';' | ',' | '\\' | '&' | '=' | '+' | '%' | '#'))
    {
        return Some(format!(
            "the token contains {c:?}: expected letters, digits and punctuation other than \" ; , \\ & = + % #"
        ));
    }
    None
}

/// A fresh random token: 24 bytes from the operating system, as 48 hex characters.
pub(crate) fn random_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_random_ones_pass() {
        assert!(token_problem("short").is_some_and(|m| m.contains("5 characters")));
        assert!(token_problem("sixteen chars ok").is_some_and(|m| m.contains("' '")));
        assert!(token_problem("abcdefghijklmnop;").is_some_and(|m| m.contains("';'")));
        assert_eq!(token_problem("abcdefghijklmnop"), None);
        let a = random_token().expect("the OS has randomness");
        let b = random_token().expect("the OS has randomness");
        assert_eq!(a.len(), 48);
        assert_ne!(a, b);
        assert_eq!(token_problem(&a), None);
    }

    #[test]
    fn debug_never_shows_a_token() {
        let c = ServerConfig {
            token: TokenSetting::Fixed("abcdefghijklmnopqrst".into()),
            ..ServerConfig::default()
        };
        assert!(!format!("{c:?}").contains("abcdefghijklmnopqrst"));
    }
}
