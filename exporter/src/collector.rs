//! Talking to an OTLP collector without letting it stall or bloat the training process: the
//! exporters' HTTP client reads at most [`MAX_RESPONSE_BYTES`] of an answer (an OTLP answer is
//! a few bytes of protobuf; a collector that streams without end is cut off), and a request,
//! its answer included, takes at most the export timeout (`OTEL_EXPORTER_OTLP_TIMEOUT`, capped
//! at [`MAX_TIMEOUT`]). Exports run on the SDK's own threads; at shutdown the last export is
//! waited for at most [`SHUTDOWN_WAIT`] (see [`crate::otlp::OtelSink::shutdown`]).

use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use std::io::Read;
use std::time::{Duration, Instant};

/// Most bytes of a collector's answer read; the rest is never read.
pub const MAX_RESPONSE_BYTES: usize = 64 << 10;
/// The export timeout when `OTEL_EXPORTER_OTLP_TIMEOUT` says none (the OTel default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest export timeout taken from the environment.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a shutdown waits for the last export before it gives up on it.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// The export timeout the `OTEL_*` variables ask for (`get` reads one), bounded.
pub fn export_timeout(get: impl Fn(&str) -> Option<String>) -> Duration {
    let ms = ["OTEL_EXPORTER_OTLP_TIMEOUT"].iter().find_map(|k| get(k).and_then(|v| v.trim().parse::<u64>().ok()));
    ms.map_or(DEFAULT_TIMEOUT, Duration::from_millis).min(MAX_TIMEOUT)
}

/// An HTTP client for the OTLP exporters whose requests are bounded in time and answer size.
#[derive(Debug, Clone)]
pub struct BoundedClient {
    inner: reqwest::blocking::Client,
    timeout: Duration,
}

impl BoundedClient {
    /// A client whose requests take at most `timeout`, answer included.
    pub fn new(timeout: Duration) -> Result<BoundedClient, String> {
        // reqwest's blocking client runs a runtime of its own: build it off any async context.
        let inner = std::thread::spawn(move || reqwest::blocking::Client::builder().timeout(timeout).build())
            .join()
            .map_err(|_| "the HTTP client's thread panicked".to_owned())?
            .map_err(|e| format!("the HTTP client: {e}"))?;
        Ok(BoundedClient { inner, timeout })
    }

    fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let start = Instant::now();
        let request: reqwest::blocking::Request = request.try_into()?;
        let mut response = self.inner.execute(request)?;
        let status = response.status();
        let headers = std::mem::take(response.headers_mut());
        // Read at most the bound, and not past the deadline: each read waits at most the
        // timeout, so a collector that sends a byte now and then is cut off too.
        let mut body = Vec::new();
        let mut buf = [0u8; 8192];
        while body.len() < MAX_RESPONSE_BYTES {
            if start.elapsed() > self.timeout {
                return Err(format!("the collector's answer did not end within {} ms", self.timeout.as_millis()).into());
            }
            let n = response.read(&mut buf)?;
            if n == 0 {
                break;
            }
            let room = MAX_RESPONSE_BYTES - body.len();
            body.extend_from_slice(&buf[..n.min(room)]);
        }
        // Whatever is left is not read: the connection is dropped with the response.
        if !status.is_success() {
            return Err(format!("the collector answered {status}").into());
        }
        let mut out = Response::builder().status(status).body(Bytes::from(body))?;
        *out.headers_mut() = headers;
        Ok(out)
    }
}

impl HttpClient for BoundedClient {
    fn send_bytes<'a, 'b>(
        &'a self,
        request: Request<Bytes>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        // The exporters call this from their own threads and wait for it: blocking here blocks
        // them, never the training.
        let result = self.send(request);
        Box::pin(std::future::ready(result))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_comes_from_the_environment_within_bounds() {
        assert_eq!(export_timeout(|_| None), DEFAULT_TIMEOUT);
        assert_eq!(export_timeout(|_| Some("1500".into())), Duration::from_millis(1500));
        assert_eq!(export_timeout(|_| Some("3600000".into())), MAX_TIMEOUT);
        assert_eq!(export_timeout(|_| Some("soon".into())), DEFAULT_TIMEOUT);
    }
}
