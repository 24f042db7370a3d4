//! The live source against an HTTPS server: the certificate given is trusted, the token comes
//! from a file or the environment and goes in a header, and the address never holds it.

use stagehand_events::{Snapshot, StreamMessage};
use stagehand_dashboard::app::{Link, LiveStatus, SourceStatus, State};
use stagehand_dashboard::source::sse::Limits;
use stagehand_dashboard::source::{stream_url, Auth, Backoff, LiveSource, Source, TOKEN_ENV};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "tls-token-0123456789";

/// An HTTPS server answering the stream with a snapshot, when the request has the token;
/// keeps every request's head.
fn https_server(cert: &rcgen::CertifiedKey<rcgen::KeyPair>) -> (u16, Arc<Mutex<Vec<String>>>) {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let certs = vec![CertificateDer::from(cert.cert.der().to_vec())];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der()));
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("a server config");
    let cfg = Arc::new(cfg);
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let port = listener.local_addr().expect("addr").port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let cfg = cfg.clone();
            let keep = keep.clone();
            std::thread::spawn(move || {
                let Ok(conn) = rustls::ServerConnection::new(cfg) else { return };
                let mut tls = rustls::StreamOwned::new(conn, tcp);
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                keep.lock().expect("lock").push(head.clone());
                if !head.to_ascii_lowercase().contains(&format!("authorization: bearer {}", TOKEN.to_ascii_lowercase())) {
                    let _ = tls.write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    return;
                }
                let msg = serde_json::to_string(&StreamMessage::Snapshot { snapshot: Box::new(Snapshot::new()) }).expect("json");
                let _ = write!(tls, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\nevent: snapshot\ndata: {msg}\n\n");
                let _ = tls.flush();
                std::thread::sleep(Duration::from_secs(30));
            });
        }
    });
    (port, seen)
}

#[test]
fn an_https_server_is_read_with_the_token_from_a_file_and_the_certificate_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("a certificate");
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, made.cert.pem()).expect("writes");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("writes");
    let (port, seen) = https_server(&made);
    let url = stream_url(Some(&format!("https://localhost:{port}"))).expect("an https address");
    let auth = Auth::from_sources(Some(&token_file), |_| None, Some(&cert), true).expect("auth");
    let quick = Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(100) };
    let mut src = LiveSource::connect_with(url, quick, Limits::default(), auth);
    let mut state = State::new();
    let limit = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while state.resets == 0 {
        src.poll(Instant::now(), &mut out);
        for u in out.drain(..) {
            state.ingest(u);
        }
        assert!(Instant::now() < limit, "never connected: {:?}", src.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    let SourceStatus::Live(LiveStatus { url, link, .. }) = src.status() else { panic!("live") };
    assert_eq!(link, Link::Connected);
    assert!(!url.contains(TOKEN), "the header shows no token: {url}");
    let heads = seen.lock().expect("lock").clone();
    assert!(heads.iter().all(|h| !h.split_whitespace().nth(1).unwrap_or("").contains(TOKEN)), "never in the address: {heads:?}");
    drop(src);

    // Without the certificate, the server is not trusted (the system's authorities do not know it).
    let auth = Auth::from_sources(Some(&token_file), |_| None, None, true);
    if let Ok(auth) = auth {
        let mut src = LiveSource::connect_with(stream_url(Some(&format!("https://localhost:{port}"))).expect("url"), quick, Limits::default(), auth);
        let limit = Instant::now() + Duration::from_secs(30);
        loop {
            src.poll(Instant::now(), &mut out);
            if let SourceStatus::Live(LiveStatus { link: Link::Disconnected { error, .. }, .. }) = src.status() {
                assert!(error.to_lowercase().contains("certificate") || error.contains("TLS"), "{error}");
                break;
            }
            assert!(Instant::now() < limit, "an unknown certificate was accepted: {:?}", src.status());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn the_binary_takes_no_token_on_its_command_line() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stagehand-top"))
        .args(["--connect", "http://127.0.0.1:9/api/stream?token=secret-in-ps-0123"])
        .env_remove(TOKEN_ENV)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(TOKEN_ENV) && err.contains("--token-file"), "{err}");
    // A token file that is no file is refused before anything else.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stagehand-top"))
        .args(["--connect", "127.0.0.1:9", "--token-file", "/dev/zero"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a regular file"), "{}", String::from_utf8_lossy(&out.stderr));
}
