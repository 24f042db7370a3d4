//! What an example needs to be watched: a telemetry file (`--out`), the HTTP API with the web
//! dashboard and the stream `stagehand-top --connect` reads (`--serve`), and the `run_started`
//! event that names the run. The handle gets the bus with [`Watch::builder`].

use anyhow::{Context, Result};
use stagehand::device::Device;
use stagehand::events::telemetry::{Level, TelemetryConfig};
use stagehand::events::{Bus, EventKind};
use stagehand::StagehandBuilder;
use stagehand_web::cli::ServeArgs;
use std::path::PathBuf;

/// The watching flags an example takes.
#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    /// Telemetry file of the watched run (every event; never overwritten). Replay it with
    /// `stagehand-top --replay FILE`.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Serve the API and the web dashboard while the watched run trains (loopback unless
    /// --addr says otherwise); `stagehand-top --connect URL` watches it in a terminal.
    #[arg(long)]
    pub serve: bool,
    #[command(flatten)]
    pub server: ServeArgs,
    /// After training, keep serving until Enter is pressed.
    #[arg(long, requires = "serve")]
    pub keep_serving: bool,
}

/// A run being watched: its bus, and the server while it lives.
#[derive(Debug)]
pub struct Watch {
    bus: Bus,
    server: Option<stagehand_web::ServerHandle>,
    telemetry: Option<TelemetryConfig>,
    keep_serving: bool,
}

impl WatchArgs {
    /// Starts watching: the bus, the server when asked for (it binds before anything is
    /// written), and says where to look.
    pub fn start(&self) -> Result<Watch> {
        let bus = Bus::new();
        let hub = bus.hub().context("the bus is enabled")?.clone();
        let server = if self.serve {
            let config = self.server.config(stagehand_web::DEFAULT_SERVER_ADDR);
            let metrics = stagehand_exporter::Metrics::new();
            hub.add_snapshot_sink(Box::new(metrics.clone()));
            let state = stagehand_web::AppState::live(hub.clone(), metrics);
            let server = stagehand_web::Server::start(&config, state).with_context(|| format!("serving on {}", config.addr))?;
            println!("  dashboard  {}", server.login_url());
            let connect = match server.token() {
                None => server.url(),
                Some(t) => format!("{}/api/stream?token={t}", server.url()),
            };
            println!("  live TUI   stagehand-top --connect {connect}");
            Some(server)
        } else {
            None
        };
        let telemetry = self.out.as_ref().map(|path| {
            println!("  telemetry  {} (replay: stagehand-top --replay {})", path.display(), path.display());
            TelemetryConfig { level: Level::Full, path: Some(path.clone()), ..TelemetryConfig::default() }
        });
        Ok(Watch { bus, server, telemetry, keep_serving: self.keep_serving })
    }
}

impl Watch {
    /// The run's bus.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// `builder` on the watched bus, with the telemetry file, announcing the run (`run_id`, a
    /// description of the model and its configuration) before the handle publishes anything.
    pub fn builder(&mut self, builder: StagehandBuilder, device: &Device, run_id: &str, model: String, config: serde_json::Value) -> StagehandBuilder {
        let builder = builder.bus(self.bus.clone());
        let builder = match self.telemetry.take() {
            Some(t) => builder.telemetry(t),
            None => builder,
        };
        let (bus, device, run_id) = (self.bus.clone(), device.clone(), run_id.to_owned());
        builder.attach(move |_| {
            bus.publish(EventKind::RunStarted {
                run_id,
                wall_clock_unix_ms: bus.wall_clock_unix_ms(),
                device: device.info(),
                model,
                versions: [("stagehand".to_owned(), env!("CARGO_PKG_VERSION").to_owned())].into_iter().collect(),
                config,
            });
            Ok(Box::new(()))
        })
    }

    /// Ends the watch: delivers every event, keeps serving until Enter when asked, stops the
    /// server.
    pub fn finish(self) -> Result<()> {
        self.bus.close();
        if let Some(server) = self.server {
            if self.keep_serving {
                println!("serving {} until Enter is pressed", server.login_url());
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            }
            server.shutdown()?;
        }
        Ok(())
    }
}
