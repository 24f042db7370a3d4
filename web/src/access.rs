//! Who may talk to the server. Every request, the WebSocket upgrade included, passes [`guard`]:
//!
//! - `Host` must name this server (loopback names and the bound address by default, plus an
//!   allow-list), so a page on another domain cannot rebind its name to 127.0.0.1 (DNS
//!   rebinding) and read the API as if it were same-origin.
//! - `Origin`, when a browser sends one, must be this server's own origin (or allow-listed), and
//!   a browser's cross-site request (`Sec-Fetch-Site`) is refused unless it is a navigation,
//!   whose answer the other page cannot read. So no page elsewhere can open the stream or the
//!   WebSocket, or read a route through a no-cors request.
//! - A state-changing request (anything but GET and HEAD) must say `Content-Type:
//!   application/json`, which a cross-site form or no-cors `fetch` cannot send.
//! - When a token is set, every route that shows the run or changes it needs it, as
//!   `Authorization: Bearer TOKEN` or `?token=TOKEN`. It is never a cookie: cookies are not
//!   kept apart by port (nor `__Host-` ones), so a cookie would reach every other server on the
//!   machine (a notebook, another user's dashboard) the browser talks to. The page's own files
//!   (`/`, `/assets/...`: the same bytes for everyone, no run data) load without it; the page
//!   takes the token from its address (`/#token=TOKEN`, a fragment the browser never sends),
//!   keeps it in its origin's session storage, which no other port can read, and sends it in the
//!   `Authorization` header itself. `/?token=TOKEN` is sent on to `/#token=TOKEN`.
//! - A request that passes these rules admits its connection (see [`crate::admission`]): until
//!   then a connection holds only a pending place.

use crate::admission::Ticket;
use crate::api::ApiError;
use crate::Error;
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Names a loopback server answers to.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];
/// Sent with every answer: no framing (clickjacking the replay controls), no MIME sniffing, no
/// token leaking through a `Referer`, and a page that loads and connects to itself only.
const SECURITY_HEADERS: [(&str, &str); 4] = [
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    (
        "content-security-policy",
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; \
         connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
];

/// One accepted `Host`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostRule {
    /// This name (lowercase, IPv6 in brackets) on this port, or on any port.
    Name { name: String, port: Option<u16> },
    /// Any IP address written as such, on this port. A wildcard bind answers on every address
    /// of the machine; a rebinding attack always arrives with a DNS name, never an address.
    AnyAddress { port: u16 },
    /// Anything (`*`): gives up the rebinding protection, for reverse proxies that rewrite.
    Any,
}

impl HostRule {
    fn parse(spec: &str, default_port: Option<u16>) -> Result<HostRule, Error> {
        let spec = spec.trim();
        if spec == "*" {
            return Ok(HostRule::Any);
        }
        let (name, port) = split_authority(spec).ok_or_else(|| {
            Error::Config(format!(
                "allowed host '{spec}' is not a host name: expected NAME, NAME:PORT, an address, or *"
            ))
        })?;
        Ok(HostRule::Name {
            name,
            port: port.or(default_port),
        })
    }

    fn matches(&self, name: &str, port: u16) -> bool {
        match self {
            HostRule::Name { name: n, port: p } => n == name && p.is_none_or(|p| p == port),
            HostRule::AnyAddress { port: p } => *p == port && parse_ip(name).is_some(),
            HostRule::Any => true,
        }
    }
}

/// Splits `host[:port]` into a lowercase host (IPv6 kept in brackets) and its port. `None` for
/// anything that is not a plain host name or address.
fn split_authority(s: &str) -> Option<(String, Option<u16>)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let end = rest.find(']')?;
        let (v6, after) = (&rest[..end], &rest[end + 1..]);
        v6.parse::<Ipv6Addr>().ok()?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (format!("[{v6}]"), port)
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (s.to_owned(), None),
        }
    };
    let port = match port {
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
        None => None,
    };
    let host = host.strip_suffix('.').unwrap_or(&host).to_ascii_lowercase();
    let plain = host.starts_with('[')
        || (!host.is_empty()
            && host.len() <= 253
            && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')));
    plain.then_some((host, port))
}

fn parse_ip(host: &str) -> Option<IpAddr> {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
        None => host.parse().ok(),
    }
}

fn host_of(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

/// Who may use a server: the accepted hosts and origins, and the token.
#[derive(Clone)]
pub struct Access {
    /// Accepted in `Host`; their origins count as this server's own.
    hosts: Vec<HostRule>,
    /// Added by the user: accepted in `Host`, and in `Origin` even when it differs from `Host`.
    extra: Vec<HostRule>,
    token: Option<Arc<str>>,
    tls: bool,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("hosts", &self.hosts)
            .field("extra", &self.extra)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for Access {
    fn default() -> Self {
        Access::loopback()
    }
}

impl Access {
    /// Loopback names on any port, no token: what [`router`](crate::router) uses unless told
    /// otherwise (the port it will be served on is not known to it).
    pub fn loopback() -> Access {
        Access {
            hosts: LOOPBACK_NAMES
                .iter()
                .map(|n| HostRule::Name {
                    name: (*n).to_owned(),
                    port: None,
                })
                .collect(),
            extra: Vec::new(),
            token: None,
            tls: false,
        }
    }

    /// What a server bound to `local` accepts: the loopback names and the bound address on the
    /// bound port (any address on a wildcard bind), plus `allowed` hosts.
    pub(crate) fn for_bound(local: SocketAddr, allowed: &[String], tls: bool) -> Result<Access, Error> {
        let port = local.port();
        let mut hosts: Vec<HostRule> = LOOPBACK_NAMES
            .iter()
            .map(|n| HostRule::Name {
                name: (*n).to_owned(),
                port: Some(port),
            })
            .collect();
        if local.ip().is_unspecified() {
            hosts.push(HostRule::AnyAddress { port });
        } else if !local.ip().is_loopback() {
            hosts.push(HostRule::Name {
                name: host_of(local.ip()),
                port: Some(port),
            });
        }
        let extra = allowed
            .iter()
            .map(|a| HostRule::parse(a, Some(port)))
            .collect::<Result<_, _>>()?;
        Ok(Access {
            hosts,
            extra,
            token: None,
            tls,
        })
    }

    /// Requires `token` on every route.
    pub fn with_token(mut self, token: &str) -> Result<Access, Error> {
        if let Some(problem) = crate::config::token_problem(token) {
            return Err(Error::Config(problem));
        }
        self.token = Some(token.into());
        Ok(self)
    }

    /// Also accepts `host` (`NAME`, `NAME:PORT`, an address, or `*` for any) in `Host` and
    /// `Origin`.
    pub fn allow_host(mut self, host: &str) -> Result<Access, Error> {
        self.extra.push(HostRule::parse(host, None)?);
        Ok(self)
    }

    /// The token required, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether `*` is allowed (no rebinding protection).
    pub(crate) fn allows_any_host(&self) -> bool {
        self.extra.contains(&HostRule::Any)
    }

    fn default_port(&self) -> u16 {
        if self.tls {
            443
        } else {
            80
        }
    }

    /// `Host`'s name and effective port, when accepted.
    fn check_host(&self, host: &str) -> Option<(String, u16)> {
        let (name, port) = split_authority(host)?;
        let port = port.unwrap_or(self.default_port());
        self.hosts
            .iter()
            .chain(&self.extra)
            .any(|r| r.matches(&name, port))
            .then_some((name, port))
    }

    /// Whether a browser's `Origin` may use this server: its own origin, or an allowed one.
    fn origin_allowed(&self, origin: &str, host: &(String, u16)) -> bool {
        let Some((scheme, authority)) = origin.split_once("://") else {
            return false;
        };
        let default_port = match scheme {
            "http" => 80,
            "https" => 443,
            _ => return false,
        };
        let Some((name, port)) = split_authority(authority) else {
            return false;
        };
        let port = port.unwrap_or(default_port);
        (name == host.0 && port == host.1) || self.extra.iter().any(|r| r.matches(&name, port))
    }

    /// The token this request carries and how, when it is the right one.
    fn presented(&self, headers: &HeaderMap, query: Option<&str>) -> Option<Presented> {
        let want = self.token.as_deref()?;
        let matches = |t: &str| bool::from(t.as_bytes().ct_eq(want.as_bytes()));
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|t| matches(t.trim())) {
            return Some(Presented::Header);
        }
        let in_query = query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter_map(|kv| kv.split_once('='))
            .any(|(k, v)| k == "token" && matches(v));
        in_query.then_some(Presented::Query)
    }
}

/// How a request showed the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presented {
    Header,
    Query,
}

/// The page's own files: the same bytes for everyone, served without the token.
fn is_page_file(method: &Method, path: &str) -> bool {
    matches!(*method, Method::GET | Method::HEAD) && (path == "/" || path.starts_with("/assets/"))
}

fn refuse(status: StatusCode, message: String) -> Response {
    ApiError::new(status, message).into_response()
}

/// The query without its `token` parameter.
fn query_without_token(query: &str) -> String {
    query
        .split('&')
        .filter(|kv| !kv.is_empty() && kv.split_once('=').map_or(*kv, |(k, _)| k) != "token")
        .collect::<Vec<_>>()
        .join("&")
}

/// The checks above, in that order, then the security headers on whatever is answered.
pub(crate) async fn guard(State(access): State<Arc<Access>>, req: Request, next: Next) -> Response {
    let mut resp = check(&access, req, next).await;
    let h = resp.headers_mut();
    for (k, v) in SECURITY_HEADERS {
        h.insert(k, HeaderValue::from_static(v));
    }
    resp
}

async fn check(access: &Access, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host_text = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    let Some(host_text) = host_text else {
        return refuse(StatusCode::BAD_REQUEST, "the request has no Host header".into());
    };
    let Some(host) = access.check_host(&host_text) else {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "host '{}' is not allowed: this server answers to its loopback names and its own \
                 address; add the name you use with --allow-host (ServerConfig::allowed_hosts)",
                host_text.chars().take(200).collect::<String>()
            ),
        );
    };
    let origin = headers.get(header::ORIGIN).map(|v| v.to_str().unwrap_or("?"));
    let origin_ok = match origin {
        Some(o) => access.origin_allowed(o, &host),
        None => false,
    };
    if let Some(o) = origin {
        if !origin_ok {
            return refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "origin '{}' may not use this server: only its own pages may (allow another with --allow-host)",
                    o.chars().take(200).collect::<String>()
                ),
            );
        }
    }
    let fetch = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
    let cross_site = matches!(fetch("sec-fetch-site"), "cross-site" | "same-site");
    if cross_site && fetch("sec-fetch-mode") != "navigate" && !origin_ok {
        return refuse(
            StatusCode::FORBIDDEN,
            "a request from another site's page is refused: open the dashboard itself".into(),
        );
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "{} {} needs 'Content-Type: application/json' (the controls change state; a form cannot send it)",
                    req.method(),
                    req.uri().path()
                ),
            );
        }
    }
    let page_file = is_page_file(req.method(), req.uri().path());
    let presented = if access.token.is_some() {
        match access.presented(headers, req.uri().query()) {
            Some(p) => Some(p),
            None if page_file => None,
            None => {
                let mut r = refuse(
                    StatusCode::UNAUTHORIZED,
                    "this server requires a token: open the address it printed (ending in #token=...), \
                     send 'Authorization: Bearer TOKEN', or add '?token=TOKEN'"
                        .into(),
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
        }
    } else {
        None
    };
    // The page's files do not admit a connection when there is a token: anyone may load them,
    // and only a client with the token may hold a slot.
    if !(page_file && presented.is_none() && access.token.is_some()) {
        if let Some(ticket) = req.extensions().get::<Arc<Ticket>>() {
            if ticket.admit().is_err() {
                return refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many connections: the server's connection cap is reached; retry later".into(),
                );
            }
        }
    }
    if presented == Some(Presented::Query) && req.method() == Method::GET && req.uri().path() == "/" {
        // The printed address of older versions: on to the page, the token in the fragment
        // (which the browser never sends anywhere) rather than the query.
        let rest = query_without_token(req.uri().query().unwrap_or(""));
        let token = access.token.as_deref().unwrap_or("");
        let location = if rest.is_empty() { format!("/#token={token}") } else { format!("/?{rest}#token={token}") };
        let mut r = StatusCode::SEE_OTHER.into_response();
        if let Ok(l) = HeaderValue::from_str(&location) {
            r.headers_mut().insert(header::LOCATION, l);
        }
        r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        return r;
    }
    next.run(req).await
}

#[cfg(test)]
mod tests;
