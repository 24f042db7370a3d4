//! Serving and exporting a [`Stagehand`](stagehand::Stagehand) handle's run in one call on its
//! builder: the HTTP server with the dashboards, the API and `/metrics`, and OTLP when the
//! standard `OTEL_*` variables ask for it. Both live as long as the handle.
//!
//! ```no_run
//! use stagehand_web::{Observe, ServerConfig};
//! let sh = stagehand::Stagehand::builder()
//!     .budget_mib(4096)
//!     .telemetry_file("runs/today.jsonl")
//!     .serve(ServerConfig::new("127.0.0.1:7878"), |s| println!("dashboard {}", s.login_url()))
//!     .otlp_from_env()
//!     .build()?;
//! # Ok::<(), stagehand::Error>(())
//! ```

use crate::{AppState, Server, ServerConfig, ServerHandle};
use stagehand::{Error, StagehandBuilder};

/// The builder's observability attachments.
pub trait Observe {
    /// Serves the run live on `config` (the dashboards, the API, `/metrics`) from when the handle
    /// is built until it is dropped; `started` gets the server (its address, its login URL).
    fn serve(self, config: ServerConfig, started: impl FnOnce(&ServerHandle) + Send + 'static) -> Self;

    /// Exports metrics and step spans over OTLP when the `OTEL_*` variables ask for it
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT` and friends; `OTEL_SDK_DISABLED=true` turns it off);
    /// nothing otherwise.
    fn otlp_from_env(self) -> Self;
}

impl Observe for StagehandBuilder {
    fn serve(self, config: ServerConfig, started: impl FnOnce(&ServerHandle) + Send + 'static) -> Self {
        self.attach(move |hub| {
            let metrics = stagehand_exporter::Metrics::new();
            hub.add_snapshot_sink(Box::new(metrics.clone()));
            let server = Server::start(&config, AppState::live(hub.clone(), metrics)).map_err(|e| Error::Attach {
                what: format!("the server on {}", config.addr),
                source: Box::new(e),
            })?;
            started(&server);
            Ok(Box::new(server))
        })
    }

    fn otlp_from_env(self) -> Self {
        self.attach(|hub| {
            let on = stagehand_exporter::otlp::attach_from_env(hub).map_err(|e| Error::Attach {
                what: "the OTLP exporter (OTEL_* variables)".into(),
                source: Box::new(e),
            })?;
            Ok(Box::new(on))
        })
    }
}
