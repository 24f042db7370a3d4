//! A minimal blocking HTTP/1.1 client for the end-to-end tests (requests, chunked bodies,
//! and SSE read incrementally), so the tests need no client crate.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Response {
    let host = addr.to_string();
    request_with(addr, method, path, &[("host", &host), ("content-type", "application/json")], body)
}

/// A request with exactly these headers (plus `connection: close` and the body's length).
pub fn request_with(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&str>) -> Response {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(90))).expect("timeout");
    let body = body.unwrap_or("");
    let mut head = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    // A server that turns the connection away may answer and close before it has read the
    // request: the answer still counts.
    let _ = write!(s, "{head}\r\n{body}");
    read_response(s)
}

/// Reads one response from a stream.
pub fn read_response(s: TcpStream) -> Response {
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        let mut c = Chunked { r, left: 0, done: false };
        c.read_to_end(&mut body).expect("body");
    } else if let Some(len) = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok())
    {
        body.resize(len, 0);
        r.read_exact(&mut body).expect("body");
    } else {
        r.read_to_end(&mut body).expect("body");
    }
    Response { status, headers, body }
}

/// A chunked-transfer decoder.
pub struct Chunked<R> {
    r: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.r.read_line(&mut line)?;
            if line.trim().is_empty() {
                line.clear();
                self.r.read_line(&mut line)?;
            }
            self.left = usize::from_str_radix(line.trim(), 16).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("chunk size {line:?}: {e}"))
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.left);
        let n = self.r.read(&mut buf[..want])?;
        self.left -= n;
        Ok(n)
    }
}

/// An open SSE stream.
pub struct Sse {
    lines: BufReader<Chunked<BufReader<TcpStream>>>,
}

impl Sse {
    pub fn open(addr: SocketAddr) -> Sse {
        Sse::open_path(addr, "/api/stream", "")
    }

    /// Opens `path` with `extra` header lines (each ending in `\r\n`).
    pub fn open_path(addr: SocketAddr, path: &str, extra: &str) -> Sse {
        let mut s = TcpStream::connect(addr).expect("connects");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        write!(s, "GET {path} HTTP/1.1\r\nhost: {addr}\r\naccept: text/event-stream\r\n{extra}\r\n").expect("sends");
        let mut r = BufReader::new(s);
        let (status, headers) = read_head(&mut r);
        assert_eq!(status, 200);
        assert!(headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("content-type") && v.starts_with("text/event-stream")));
        Sse { lines: BufReader::new(Chunked { r, left: 0, done: false }) }
    }

    /// The next message as (event name, data); comments (keep-alives) are returned as
    /// ("comment", text).
    pub fn next(&mut self) -> Option<(String, String)> {
        let mut event = String::new();
        let mut data = String::new();
        let mut line = String::new();
        loop {
            line.clear();
            if self.lines.read_line(&mut line).ok()? == 0 {
                return None;
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                if !event.is_empty() || !data.is_empty() {
                    return Some((event, data));
                }
                continue;
            }
            if let Some(c) = l.strip_prefix(':') {
                return Some(("comment".into(), c.trim().to_owned()));
            }
            if let Some(v) = l.strip_prefix("event:") {
                event = v.trim().to_owned();
            } else if let Some(v) = l.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
    }
}

/// The sum of a metric's samples in Prometheus text, `None` when it has none.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}
