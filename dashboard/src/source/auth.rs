//! How `stagehand-top` proves itself to a run's server and knows it is talking to the right
//! one: the token (from `STAGEHAND_TOKEN` or a file, never from the command line, where every
//! user of the machine sees it in `ps`), and TLS for `https://` servers (rustls, trusting the
//! certificate given, or the system's certificate authorities).
//!
//! Files are as untrusted as any input: a token or certificate file is read only when it is a
//! regular file, and only up to a bound (`/dev/zero` is refused, not read).

use std::io::{self, Read};
use std::path::Path;
use std::sync::Arc;

/// The environment variable a token is read from.
pub const TOKEN_ENV: &str = "STAGEHAND_TOKEN";
/// Largest token file read (a token is a few dozen characters).
const MAX_TOKEN_FILE: u64 = 4 << 10;
/// Largest certificate file read (the system's bundle is a few hundred KiB).
const MAX_CERT_FILE: u64 = 4 << 20;
/// Where systems keep their certificate authorities, bundled in one file.
const SYSTEM_BUNDLES: [&str; 3] = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"];

/// Why the token or TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("'{path}': {reason}")]
    File { path: String, reason: String },
    #[error("{0}")]
    Token(String),
    #[error("TLS: {0}")]
    Tls(String),
}

/// What a connection to the server needs: its token, and how to check its certificate.
#[derive(Clone, Default)]
pub struct Auth {
    token: Option<String>,
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Auth {
    // Never print the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// `path`'s bytes, when it is a regular file of at most `max` bytes.
fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, AuthError> {
    let bad = |reason: String| AuthError::File { path: path.display().to_string(), reason };
    let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open the {what}: {e}")))?;
    let meta = file.metadata().map_err(|e| bad(format!("cannot read the {what}: {e}")))?;
    if !meta.is_file() {
        return Err(bad(format!("not a regular file: expected the {what}")));
    }
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read the {what}: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(bad(format!("larger than {max} bytes: not a {what}")));
    }
    Ok(bytes)
}

/// A token as sent: printable ASCII without spaces (it goes into a header).
fn checked_token(token: &str, from: &str) -> Result<String, AuthError> {
    let t = token.trim();
    if t.is_empty() {
        return Err(AuthError::Token(format!("the token from {from} is empty")));
    }
    if let Some(c) = t.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(AuthError::Token(format!("the token from {from} holds {c:?}: expected printable characters without spaces")));
    }
    Ok(t.to_owned())
}

impl Auth {
    /// The token from `token_file` when given, else from `STAGEHAND_TOKEN` (`env` reads it),
    /// and TLS trusting `tls_cert` when given (else the system's authorities, when the server
    /// is `https://`).
    pub fn from_sources(
        token_file: Option<&Path>,
        env: impl Fn(&str) -> Option<String>,
        tls_cert: Option<&Path>,
        https: bool,
    ) -> Result<Auth, AuthError> {
        let token = match token_file {
            Some(p) => {
                let bytes = read_bounded(p, MAX_TOKEN_FILE, "token file")?;
                let text = String::from_utf8(bytes).map_err(|_| AuthError::Token(format!("'{}' is not text", p.display())))?;
                Some(checked_token(&text, &format!("'{}'", p.display()))?)
            }
            None => env(TOKEN_ENV).filter(|t| !t.is_empty()).map(|t| checked_token(&t, TOKEN_ENV)).transpose()?,
        };
        let tls = if https || tls_cert.is_some() { Some(client_config(tls_cert)?) } else { None };
        Ok(Auth { token, tls })
    }

    /// No token, no TLS.
    pub fn none() -> Auth {
        Auth::default()
    }

    /// A token to send.
    pub fn with_token(mut self, token: &str) -> Result<Auth, AuthError> {
        self.token = Some(checked_token(token, "the caller")?);
        Ok(self)
    }

    /// The `Authorization` header's value, when there is a token.
    pub(crate) fn header(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// The HTTP agent: TLS through rustls when the server is `https://`.
    pub(crate) fn agent(&self) -> ureq::Agent {
        let mut b = ureq::AgentBuilder::new().timeout_connect(std::time::Duration::from_secs(3));
        if let Some(cfg) = &self.tls {
            b = b.tls_connector(Arc::new(Rustls(cfg.clone())));
        }
        b.build()
    }
}

/// A rustls client configuration trusting the certificates in `cert` (the server's own, or
/// its authority), else the system's authorities.
fn client_config(cert: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, AuthError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let (path, pem) = match cert {
        Some(p) => (p.to_path_buf(), read_bounded(p, MAX_CERT_FILE, "PEM certificate")?),
        None => {
            let found = SYSTEM_BUNDLES.iter().map(Path::new).find(|p| p.is_file());
            let Some(p) = found else {
                return Err(AuthError::Tls(
                    "no certificate to trust: give the server's certificate (or its authority) with --tls-cert".into(),
                ));
            };
            (p.to_path_buf(), read_bounded(p, MAX_CERT_FILE, "PEM certificate bundle")?)
        }
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| AuthError::File { path: path.display().to_string(), reason: format!("not a PEM certificate: {e}") })?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(AuthError::File {
            path: path.display().to_string(),
            reason: "no certificate in it: expected PEM 'BEGIN CERTIFICATE'".into(),
        });
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| AuthError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// ureq's TLS through rustls.
struct Rustls(Arc<rustls::ClientConfig>);

/// A TLS stream for ureq.
struct TlsStream(rustls::StreamOwned<rustls::ClientConnection, Box<dyn ureq::ReadWrite>>);

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsStream")
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl io::Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl ureq::ReadWrite for TlsStream {
    fn socket(&self) -> Option<&std::net::TcpStream> {
        self.0.get_ref().socket()
    }
}

impl ureq::TlsConnector for Rustls {
    fn connect(&self, dns_name: &str, mut io: Box<dyn ureq::ReadWrite>) -> Result<Box<dyn ureq::ReadWrite>, ureq::Error> {
        let host = dns_name.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(dns_name);
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("'{host}' is not a server name: {e}")))?;
        let mut conn = rustls::ClientConnection::new(self.0.clone(), name)
            .map_err(|e| io::Error::other(format!("TLS: {e}")))?;
        conn.complete_io(&mut io).map_err(|e| io::Error::new(e.kind(), format!("TLS handshake: {e}")))?;
        Ok(Box::new(TlsStream(rustls::StreamOwned::new(conn, io))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_comes_from_a_file_or_the_environment_and_bad_files_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("token");
        std::fs::write(&file, "from-the-file-0123456789\n").expect("writes");
        let env = |k: &str| (k == TOKEN_ENV).then(|| "from-the-environment-01".to_owned());
        let a = Auth::from_sources(Some(&file), env, None, false).expect("auth");
        assert_eq!(a.header().as_deref(), Some("Bearer from-the-file-0123456789"));
        let a = Auth::from_sources(None, env, None, false).expect("auth");
        assert_eq!(a.header().as_deref(), Some("Bearer from-the-environment-01"));
        assert!(!format!("{a:?}").contains("from-the"), "never printed");
        for bad in ["/dev/zero", "/nonexistent/token"] {
            assert!(Auth::from_sources(Some(Path::new(bad)), |_| None, None, false).is_err(), "{bad}");
        }
        let big = dir.path().join("big");
        std::fs::File::create(&big).and_then(|f| f.set_len(1 << 30)).expect("a large file");
        let e = Auth::from_sources(Some(&big), |_| None, None, false).expect_err("too large");
        assert!(e.to_string().contains("larger than"), "{e}");
        std::fs::write(&file, "two words\n").expect("writes");
        assert!(Auth::from_sources(Some(&file), |_| None, None, false).is_err());
        // The same bounds for a certificate.
        let e = Auth::from_sources(None, |_| None, Some(Path::new("/dev/zero")), true).expect_err("refused");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = Auth::from_sources(None, |_| None, Some(&big), true).expect_err("refused");
        assert!(e.to_string().contains("larger than"), "{e}");
    }
}
