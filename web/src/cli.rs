//! The server's command-line options, shared by binaries that serve a run (feature `cli`):
//! flatten [`ServeArgs`] into a clap parser and pass [`ServeArgs::config`] to
//! [`Server::start`](crate::Server::start).

use crate::config::{ServerConfig, TlsFiles, TokenSetting, DEFAULT_MAX_CONNECTIONS};
use std::path::PathBuf;

/// Where and how to serve the dashboard and the API.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to serve on, HOST:PORT. Loopback unless told otherwise; a wider bind (e.g.
    /// 0.0.0.0:7878) gets a random token, printed in the address to open.
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// Require this token (at least 16 characters) instead of a random one. The environment
    /// keeps it out of the process list better than the command line does.
    #[arg(long, env = "STAGEHAND_TOKEN", hide_env_values = true, conflicts_with_all = ["random_token", "no_token"])]
    pub token: Option<String>,
    /// Require a random token even on loopback (a shared machine).
    #[arg(long, conflicts_with = "no_token")]
    pub random_token: bool,
    /// Serve without a token. Refused beyond loopback.
    #[arg(long)]
    pub no_token: bool,
    /// Also answer to this host name, as a browser or a reverse proxy names the server (NAME or
    /// NAME:PORT; * for any, which leaves the token as the only protection). Repeatable.
    #[arg(long = "allow-host", value_name = "HOST")]
    pub allow_hosts: Vec<String>,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM); needs --tls-cert.
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Connections served at once; more are turned away with a 503.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub max_connections: usize,
}

impl ServeArgs {
    /// The server's configuration, bound to `--addr` or else `default_addr`.
    pub fn config(&self, default_addr: &str) -> ServerConfig {
        let token = match (&self.token, self.random_token, self.no_token) {
            (Some(t), _, _) => TokenSetting::Fixed(t.clone()),
            (None, true, _) => TokenSetting::Random,
            (None, false, true) => TokenSetting::Off,
            (None, false, false) => TokenSetting::Auto,
        };
        ServerConfig {
            addr: self.addr.clone().unwrap_or_else(|| default_addr.to_owned()),
            token,
            allowed_hosts: self.allow_hosts.clone(),
            tls: match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles { cert: cert.clone(), key: key.clone() }),
                _ => None,
            },
            max_connections: self.max_connections,
            ..ServerConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn options_become_a_config() {
        let c = Cli::try_parse_from(["x"]).expect("parses").serve.config("127.0.0.1:0");
        assert_eq!((c.addr.as_str(), &c.token, c.tls.is_none()), ("127.0.0.1:0", &TokenSetting::Auto, true));
        let c = Cli::try_parse_from(["x", "--addr", "0.0.0.0:9000", "--allow-host", "box.lan", "--allow-host", "x:1",
            "--tls-cert", "c.pem", "--tls-key", "k.pem", "--max-connections", "7"]).expect("parses").serve.config("-");
        assert_eq!(c.addr, "0.0.0.0:9000");
        assert_eq!(c.allowed_hosts, ["box.lan", "x:1"]);
        assert_eq!(c.tls, Some(TlsFiles { cert: "c.pem".into(), key: "k.pem".into() }));
        assert_eq!(c.max_connections, 7);
        assert_eq!(Cli::try_parse_from(["x", "--no-token"]).expect("parses").serve.config("-").token, TokenSetting::Off);
        assert_eq!(Cli::try_parse_from(["x", "--random-token"]).expect("parses").serve.config("-").token, TokenSetting::Random);
        assert!(Cli::try_parse_from(["x", "--tls-cert", "c.pem"]).is_err(), "a certificate needs its key");
        assert!(Cli::try_parse_from(["x", "--token", "abcdefghijklmnopq", "--no-token"]).is_err());
    }
}
