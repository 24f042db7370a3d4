//! The server probed as an attacker would: pages on other origins, rebound host names,
//! cross-site form posts, missing tokens, wide binds, idle and stalled connections, too many
//! connections; and HTTPS with a certificate made here.

mod http;

use http::{request_with, Response};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::Hub;
use stagehand_exporter::Metrics;
use stagehand_web::{AppState, Error, ReplayDriver, Server, ServerConfig, ServerHandle, TlsFiles, TokenSetting};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn live(config: ServerConfig) -> (Arc<Hub>, ServerHandle) {
    let hub = Arc::new(Hub::new());
    for e in synthetic::events(SyntheticRun::finished(2)) {
        hub.ingest(e);
    }
    let server = Server::start(&config, AppState::live(hub.clone(), Metrics::new())).expect("starts");
    (hub, server)
}

fn replay(config: ServerConfig) -> (Arc<ReplayDriver>, ServerHandle) {
    let driver = Arc::new(ReplayDriver::new(synthetic::events(SyntheticRun::finished(2))));
    let server = Server::start(&config, AppState::replay(driver.clone())).expect("starts");
    (driver, server)
}

fn loopback() -> ServerConfig {
    ServerConfig::new("127.0.0.1:0")
}

fn assert_refused(r: &Response, status: u16, mentions: &str) {
    let body = r.json();
    assert_eq!(r.status, status, "{body}");
    assert_eq!(body["status"], status);
    let msg = body["error"].as_str().unwrap_or_default();
    assert!(msg.contains(mentions), "{msg:?} should mention {mentions:?}");
}

/// The page's own files: served without the token (no run data in them).
const PAGE_FILES: [&str; 2] = ["/", "/assets/app.js"];

const GET_ROUTES: [&str; 9] = [
    "/", "/assets/app.js", "/api/snapshot", "/api/run", "/api/steps", "/api/openapi.json",
    "/metrics", "/api/replay/status", "/api/nothing-here",
];

#[test]
fn a_page_on_another_origin_cannot_open_the_websocket_or_the_stream() {
    let (_hub, server) = live(loopback());
    let addr = server.addr();
    let upgrade = |origin: &str| {
        let mut req = tungstenite::client::IntoClientRequest::into_client_request(format!("ws://{addr}/api/ws"))
            .expect("a request");
        req.headers_mut().insert("origin", origin.parse().expect("a header value"));
        tungstenite::connect(req)
    };
    match upgrade("http://evil.example") {
        Err(tungstenite::Error::Http(r)) => assert_eq!(r.status(), 403),
        Err(e) => panic!("expected a 403, got {e}"),
        Ok(_) => panic!("a page on another origin opened the WebSocket"),
    }
    // Another app on this machine is another origin too.
    assert!(upgrade("http://127.0.0.1:1").is_err());
    let (mut own, resp) = upgrade(&format!("http://{addr}")).expect("the server's own page connects");
    assert_eq!(resp.status(), 101);
    let _ = own.close(None);

    let host = addr.to_string();
    let r = request_with(addr, "GET", "/api/stream", &[("host", &host), ("origin", "https://evil.example")], None);
    assert_refused(&r, 403, "evil.example");
}

#[test]
fn rebound_host_names_are_refused_on_every_route() {
    let (_hub, server) = live(loopback());
    let addr = server.addr();
    let port = addr.port();
    for path in GET_ROUTES {
        let rebound = format!("attacker.example:{port}");
        let r = request_with(addr, "GET", path, &[("host", &rebound)], None);
        assert_refused(&r, 403, "attacker.example");
        let other_port = format!("localhost:{}", port.wrapping_add(1).max(1));
        assert_eq!(request_with(addr, "GET", path, &[("host", &other_port)], None).status, 403, "{path}");
        let r = request_with(addr, "GET", path, &[], None);
        assert_refused(&r, 400, "Host");
    }
    for name in ["localhost", "127.0.0.1", "[::1]"] {
        let host = format!("{name}:{port}");
        assert_eq!(request_with(addr, "GET", "/api/run", &[("host", &host)], None).status, 200, "{host}");
    }
}

#[test]
fn a_cross_site_form_cannot_drive_a_replay() {
    let (driver, server) = replay(loopback());
    let addr = server.addr();
    let host = addr.to_string();
    // What a no-cors fetch or a form on another site sends.
    let r = request_with(addr, "POST", "/api/replay/play",
        &[("host", &host), ("origin", "https://evil.example"), ("content-type", "text/plain")], Some("{}"));
    assert_refused(&r, 403, "evil.example");
    // The same for the one state-changing route of a live run (a flight record on request).
    let r = request_with(addr, "POST", "/api/flight",
        &[("host", &host), ("origin", "https://evil.example"), ("content-type", "text/plain")], Some("{}"));
    assert_refused(&r, 403, "evil.example");
    // Even without an Origin (an old browser), a non-JSON body is refused.
    let r = request_with(addr, "POST", "/api/replay/play", &[("host", &host), ("content-type", "application/x-www-form-urlencoded")], Some("a=1"));
    assert_refused(&r, 415, "application/json");
    let r = request_with(addr, "POST", "/api/replay/seek",
        &[("host", &host), ("content-type", "text/plain"), ("sec-fetch-site", "cross-site"), ("sec-fetch-mode", "no-cors")],
        Some(r#"{"position":3}"#));
    assert_eq!(r.status, 403);
    let st = driver.status();
    assert!(st.paused && st.position == 0, "nothing moved: {st:?}");

    let own = format!("http://{host}");
    let r = request_with(addr, "POST", "/api/replay/play",
        &[("host", &host), ("origin", &own), ("content-type", "application/json"), ("sec-fetch-site", "same-origin")], None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(!driver.status().paused);
}

#[test]
fn another_sites_subresource_cannot_read_a_route_but_a_link_opens_it() {
    let (_hub, server) = live(loopback());
    let addr = server.addr();
    let host = addr.to_string();
    for site in ["cross-site", "same-site"] {
        let r = request_with(addr, "GET", "/api/snapshot", &[("host", &host), ("sec-fetch-site", site), ("sec-fetch-mode", "no-cors")], None);
        assert_refused(&r, 403, "another site");
    }
    let r = request_with(addr, "GET", "/", &[("host", &host), ("sec-fetch-site", "cross-site"), ("sec-fetch-mode", "navigate")], None);
    assert_eq!(r.status, 200);
    for (k, v) in [("x-frame-options", "DENY"), ("x-content-type-options", "nosniff"), ("referrer-policy", "no-referrer")] {
        assert_eq!(r.header(k), Some(v), "{k}");
    }
    assert!(r.header("content-security-policy").is_some_and(|c| c.contains("frame-ancestors 'none'")));
}

const TOKEN: &str = "correct-horse-battery-staple";

#[test]
fn a_token_is_required_on_every_route_of_the_run_and_is_never_a_cookie() {
    let mut config = loopback();
    config.token = TokenSetting::Fixed(TOKEN.into());
    let (_hub, server) = live(config);
    let addr = server.addr();
    let host = addr.to_string();
    assert_eq!(server.login_url(), format!("http://{addr}/#token={TOKEN}"));
    for path in GET_ROUTES.iter().filter(|p| !PAGE_FILES.contains(p)) {
        let r = request_with(addr, "GET", path, &[("host", &host)], None);
        assert_refused(&r, 401, "token");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        let wrong = request_with(addr, "GET", &format!("{path}?token=wrong-horse-battery-staple"), &[("host", &host)], None);
        assert_eq!(wrong.status, 401, "{path}");
        // A cookie could come from any port of the host: never taken.
        for cookie in [format!("stagehand_token_{}={TOKEN}", addr.port()), format!("__Host-stagehand_token={TOKEN}")] {
            let r = request_with(addr, "GET", path, &[("host", &host), ("cookie", &cookie)], None);
            assert_eq!(r.status, 401, "{path} with a cookie");
        }
    }
    let r = request_with(addr, "POST", "/api/replay/play", &[("host", &host), ("content-type", "application/json")], None);
    assert_refused(&r, 401, "token");
    // The page's own files are the same bytes for everyone: they load, holding no run data.
    for path in PAGE_FILES {
        let r = request_with(addr, "GET", path, &[("host", &host)], None);
        assert_eq!(r.status, 200, "{path}");
        assert!(!r.text().contains("\"run_id\""), "{path} holds no run data");
    }

    // The printed address of older versions: on to the page, the token in its fragment, no
    // cookie set.
    let r = request_with(addr, "GET", &format!("/?token={TOKEN}&x=1"), &[("host", &host)], None);
    assert_eq!(r.status, 303);
    assert_eq!(r.header("location"), Some(format!("/?x=1#token={TOKEN}").as_str()));
    assert!(r.header("set-cookie").is_none());
    let bearer = format!("Bearer {TOKEN}");
    for path in ["/api/snapshot", "/metrics", "/api/run"] {
        let r = request_with(addr, "GET", path, &[("host", &host), ("authorization", &bearer)], None);
        assert_eq!(r.status, 200, "{path} with the bearer token");
        assert!(r.header("set-cookie").is_none());
    }
    let r = request_with(addr, "GET", &format!("/api/run?token={TOKEN}"), &[("host", &host)], None);
    assert_eq!(r.status, 200);
    assert!(r.header("set-cookie").is_none(), "no cookie, ever");

    let mut sse = http::Sse::open_path(addr, &format!("/api/stream?token={TOKEN}"), "");
    assert!(matches!(sse.next(), Some((name, _)) if name == "snapshot"));
}

#[test]
fn binding_beyond_loopback_needs_a_token_and_warns_without_tls() {
    let mut config = ServerConfig::new("0.0.0.0:0");
    config.token = TokenSetting::Off;
    let err = Server::start(&config, AppState::live(Arc::new(Hub::new()), Metrics::new()))
        .expect_err("an open wide bind is refused");
    assert!(matches!(err, Error::Insecure { .. }));
    let msg = err.to_string();
    assert!(msg.contains("without a token") && msg.contains("ssh -L"), "{msg}");

    let mut config = loopback();
    config.token = TokenSetting::Off;
    config.allowed_hosts = vec!["*".into()];
    assert!(matches!(Server::start(&config, AppState::live(Arc::new(Hub::new()), Metrics::new())), Err(Error::Insecure { .. })),
        "any host without a token is DNS rebinding by another name");

    let (_hub, server) = live(ServerConfig::new("0.0.0.0:0"));
    let token = server.token().expect("a random token by default").to_owned();
    assert_eq!(token.len(), 48);
    assert!(server.login_url().ends_with(&format!("/#token={token}")));
    assert!(server.warnings().iter().any(|w| w.contains("without TLS")), "{:?}", server.warnings());
    let addr = SocketAddr::from(([127, 0, 0, 1], server.addr().port()));
    let host = addr.to_string();
    assert_eq!(request_with(addr, "GET", "/api/run", &[("host", &host)], None).status, 401);
    let bearer = format!("Bearer {token}");
    assert_eq!(request_with(addr, "GET", "/api/run", &[("host", &host), ("authorization", &bearer)], None).status, 200);

    let (_hub, lo) = live(loopback());
    assert!(lo.token().is_none() && lo.warnings().is_empty(), "loopback needs neither");

    let mut config = loopback();
    config.token = TokenSetting::Fixed("short".into());
    assert!(matches!(Server::start(&config, AppState::live(Arc::new(Hub::new()), Metrics::new())), Err(Error::Config(m)) if m.contains("at least 16")));
}

/// Reads until the server closes the connection; fails if it stays open past a generous limit.
fn wait_closed(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the server kept the connection open: {e}"),
        }
    }
}

#[test]
fn silent_and_idle_connections_are_closed() {
    let mut config = loopback();
    config.header_timeout_ms = 300;
    let (_hub, server) = live(config);
    let addr = server.addr();
    // Connected, never a byte.
    wait_closed(TcpStream::connect(addr).expect("connects"));
    // Half a request.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.write_all(b"GET /api/run HTTP/1.1\r\nhost: ").expect("sends");
    wait_closed(s);
    // One request, then idle on a kept-alive connection.
    let mut s = TcpStream::connect(addr).expect("connects");
    write!(s, "GET /api/run HTTP/1.1\r\nhost: {addr}\r\n\r\n").expect("sends");
    let got = wait_closed(s);
    assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
}

#[test]
fn connections_beyond_the_cap_are_turned_away_until_one_leaves() {
    let mut config = loopback();
    config.max_connections = 3;
    let (_hub, server) = live(config);
    let addr = server.addr();
    let host = addr.to_string();
    let held: Vec<_> = (0..3).map(|_| http::Sse::open(addr)).collect();
    let r = request_with(addr, "GET", "/api/run", &[("host", &host)], None);
    assert_refused(&r, 503, "too many connections");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = request_with(addr, "GET", "/api/run", &[("host", &host)], None);
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the cap never freed: {}", r.status);
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_stops_reading_is_dropped_and_frees_its_slot() {
    let mut config = loopback();
    config.max_connections = 1;
    config.write_timeout_ms = 300;
    let hub = Arc::new(Hub::new());
    let server = Server::start(&config, AppState::live(hub.clone(), Metrics::new())).expect("starts");
    let addr = server.addr();
    let host = addr.to_string();
    // Opens the stream and never reads again.
    let stalled = TcpStream::connect(addr).expect("connects");
    (&stalled).write_all(format!("GET /api/stream HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes()).expect("sends");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut round = 0;
    loop {
        // Far more than the socket buffers hold, so the server's writes block.
        for e in synthetic::events(SyntheticRun::finished(20)) {
            hub.ingest(e);
        }
        round += 1;
        let r = request_with(addr, "GET", "/api/run", &[("host", &host)], None);
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503, "the stalled client holds the only slot");
        assert!(Instant::now() < deadline, "the stalled client was never dropped ({round} rounds)");
    }
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_https_with_a_certificate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    let dir = tempfile::tempdir().expect("tempdir");
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("a certificate");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, made.cert.pem()).expect("writes");
    std::fs::write(&key, made.signing_key.serialize_pem()).expect("writes");

    let mut config = ServerConfig::new("0.0.0.0:0");
    config.tls = Some(TlsFiles { cert: cert.clone(), key: key.clone() });
    config.max_connections = 8;
    let (_hub, server) = tokio::task::spawn_blocking(move || live(config)).await.expect("started");
    assert!(server.warnings().is_empty(), "TLS: no clear-text warning: {:?}", server.warnings());
    assert!(server.url().starts_with("https://"));
    let token = server.token().expect("a token beyond loopback").to_owned();
    let port = server.addr().port();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(made.cert.der().clone()).expect("the root");
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let get_run = || async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("a name");
        let mut tls = connector.connect(name, tcp).await.expect("the handshake succeeds");
        let req = format!("GET /api/run HTTP/1.1\r\nhost: localhost:{port}\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n");
        tls.write_all(req.as_bytes()).await.expect("sends");
        let mut got = Vec::new();
        tls.read_to_end(&mut got).await.expect("reads");
        String::from_utf8_lossy(&got).into_owned()
    };
    let text = get_run().await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"mode\":\"live\""), "{text}");
    // Sockets that never begin a handshake, far more than the cap of 8: they hold pending
    // places only, and a client that handshakes gets in.
    let silent: Vec<_> = (0..40).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("connects")).collect();
    for _ in 0..5 {
        let text = get_run().await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }
    drop(silent);

    // Plain HTTP to the TLS port gets no answer.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connects");
    plain.write_all(b"GET /api/run HTTP/1.1\r\nhost: localhost\r\n\r\n").await.expect("sends");
    let mut buf = Vec::new();
    let _ = plain.read_to_end(&mut buf).await;
    assert!(!String::from_utf8_lossy(&buf).contains("\"mode\""));

    // A key that does not belong: a clear error naming the file.
    std::fs::write(&key, rcgen::KeyPair::generate().expect("a key").serialize_pem()).expect("writes");
    let mut config = loopback();
    config.tls = Some(TlsFiles { cert, key });
    let err = Server::start(&config, AppState::live(Arc::new(Hub::new()), Metrics::new())).expect_err("mismatched key");
    assert!(matches!(&err, Error::Tls { path, .. } if path.ends_with("key.pem")), "{err}");
    tokio::task::spawn_blocking(move || drop(server)).await.expect("stops");
}

/// Opens `n` connections that send nothing.
fn idle(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).expect("connects")).collect()
}

#[test]
fn clients_without_the_token_never_lock_out_one_with_it() {
    let mut config = loopback();
    config.token = TokenSetting::Fixed(TOKEN.into());
    config.max_connections = 8;
    let (_hub, server) = live(config);
    let addr = server.addr();
    let host = addr.to_string();
    let bearer = format!("Bearer {TOKEN}");
    // 130 idle sockets and 130 connections whose requests lack the token, kept open.
    let mut held = idle(addr, 130);
    for _ in 0..130 {
        let mut s = TcpStream::connect(addr).expect("connects");
        write!(s, "GET /api/run HTTP/1.1\r\nhost: {host}\r\n\r\n").expect("sends");
        held.push(s);
    }
    // Loading the page's files needs no token, and admits no one either.
    for _ in 0..20 {
        let mut s = TcpStream::connect(addr).expect("connects");
        write!(s, "GET / HTTP/1.1\r\nhost: {host}\r\n\r\n").expect("sends");
        held.push(s);
    }
    for i in 0..20 {
        let r = request_with(addr, "GET", "/api/run", &[("host", &host), ("authorization", &bearer)], None);
        assert_eq!(r.status, 200, "request {i} with the token, among 280 other connections");
    }
    // Once the requests with the token are done, nobody holds a slot.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = server.connections();
        // (A burst within the grace of the pending places may take four times them.)
        assert!(c.pending <= 4 * stagehand_web::DEFAULT_MAX_PENDING, "{c:?}");
        if c.admitted == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "a connection without the token holds a slot: {c:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Streams with the token take the slots; the cap holds for them.
    let streams: Vec<_> = (0..8).map(|_| http::Sse::open_path(addr, &format!("/api/stream?token={TOKEN}"), "")).collect();
    let r = request_with(addr, "GET", "/api/run", &[("host", &host), ("authorization", &bearer)], None);
    assert_refused(&r, 503, "too many connections");
    drop(streams);
    drop(held);
}

#[test]
fn a_body_that_comes_slowly_is_cut_off() {
    let mut config = loopback();
    config.body_timeout_ms = 500;
    let (_driver, server) = replay(config);
    let addr = server.addr();
    let mut s = TcpStream::connect(addr).expect("connects");
    let body = r#"{"position": 3}"#;
    write!(s, "POST /api/replay/seek HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len())
        .expect("sends the head");
    // One byte a second: the body never arrives in time.
    let writer = {
        let mut w = s.try_clone().expect("clone");
        let body = body.to_owned();
        std::thread::spawn(move || {
            for b in body.bytes() {
                if w.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let got = wait_closed(s);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("did not arrive within 500 ms"), "{text}");
    let _ = writer.join();
    // A body sent at once is fine.
    let r = http::request(addr, "POST", "/api/replay/seek", Some(body));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn tls_files_that_are_not_pem_files_are_refused_without_being_read_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let big = dir.path().join("big.pem");
    std::fs::File::create(&big).and_then(|f| f.set_len(64 << 20)).expect("a large file");
    let key = dir.path().join("key.pem");
    std::fs::write(&key, "not a key").expect("writes");
    for (cert, says) in [(std::path::PathBuf::from("/dev/zero"), "not a regular file"), (big.clone(), "larger than")] {
        let mut config = loopback();
        config.tls = Some(TlsFiles { cert: cert.clone(), key: key.clone() });
        let err = Server::start(&config, AppState::live(Arc::new(Hub::new()), Metrics::new())).expect_err("refused");
        assert!(matches!(&err, Error::Tls { path, .. } if *path == cert), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
}
