//! `stagehand-top`: the terminal UI of Stagehand. Live from a run's HTTP stream, or a replay of
//! a JSONL telemetry file. See the crate README for the keys.

use anyhow::{Context, Result};
use clap::Parser;
use crossterm::event::{self, Event as TermEvent};
use ratatui::DefaultTerminal;
use stagehand_dashboard::app::{State, SourceUpdate, ViewState};
use stagehand_dashboard::keys::{map_key, KeyContext};
use stagehand_dashboard::source::sse::Limits;
use stagehand_dashboard::source::{stream_url, Auth, Backoff, LiveSource, ReplaySource, Source};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_dashboard::theme::Theme;
use stagehand_dashboard::views;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The terminal UI of Stagehand: watch a training run live, or replay its telemetry.
#[derive(Debug, Parser)]
#[command(name = "stagehand-top", version, about)]
struct Args {
    /// The run's HTTP server (HOST:PORT, http(s)://HOST:PORT[/api/stream]); default 127.0.0.1:7878.
    /// A token goes in the STAGEHAND_TOKEN environment variable or --token-file, never in the
    /// address (where every user sees it in `ps`).
    #[arg(long, value_name = "URL", conflicts_with_all = ["replay", "demo"])]
    connect: Option<String>,
    /// Read the server's token from this file (else from STAGEHAND_TOKEN).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["replay", "demo"])]
    token_file: Option<PathBuf>,
    /// Trust this certificate (PEM) for an https:// server: the one it was started with
    /// (--tls-cert), or its authority. Default: the system's authorities.
    #[arg(long, value_name = "PEM", conflicts_with_all = ["replay", "demo"])]
    tls_cert: Option<PathBuf>,
    /// Replay a JSONL telemetry file instead of connecting.
    #[arg(long, value_name = "FILE", conflicts_with = "demo")]
    replay: Option<PathBuf>,
    /// With --replay: keep reading the file as it grows (like tail -f).
    #[arg(long, requires = "replay")]
    follow: bool,
    /// Replay a built-in synthetic run (no training run needed).
    #[arg(long)]
    demo: bool,
    /// Replay speed (1 = as recorded).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Start a replay paused.
    #[arg(long)]
    paused: bool,
    /// No colours (also when NO_COLOR is set).
    #[arg(long)]
    no_color: bool,
    /// Only ASCII characters.
    #[arg(long)]
    ascii: bool,
    /// Frames per second to draw at most.
    #[arg(long, default_value_t = 30)]
    fps: u32,
}

/// Restores the terminal when dropped (ratatui's init also restores it on panic).
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let theme = Theme::from_flags(
        args.no_color,
        args.ascii,
        std::env::var("NO_COLOR").ok().as_deref(),
    );
    let mut source: Box<dyn Source> = if let Some(path) = &args.replay {
        let mut r = ReplaySource::open_in_background(path, args.follow)
            .with_context(|| format!("cannot replay '{}'", path.display()))?;
        r.configure(args.speed, args.paused);
        Box::new(r)
    } else if args.demo {
        let mut r = ReplaySource::from_events(
            synthetic::events(SyntheticRun {
                blocks: 12,
                steps: 20,
                end_mid_step: true,
            }),
            "demo",
        );
        r.configure(args.speed, args.paused);
        Box::new(r)
    } else {
        let url = stream_url(args.connect.as_deref())?;
        let auth = Auth::from_sources(
            args.token_file.as_deref(),
            |k| std::env::var(k).ok(),
            args.tls_cert.as_deref(),
            url.starts_with("https://"),
        )?;
        Box::new(LiveSource::connect_with(url, Backoff::default(), Limits::default(), auth))
    };

    let terminal = ratatui::init();
    let _guard = TerminalGuard;
    run(terminal, source.as_mut(), theme, args.fps.clamp(1, 240))
}

fn run(mut terminal: DefaultTerminal, source: &mut dyn Source, theme: Theme, fps: u32) -> Result<()> {
    let frame = Duration::from_secs(1) / fps;
    let mut state = State::new();
    let mut vs = ViewState::default();
    let mut out: Vec<SourceUpdate> = Vec::new();
    loop {
        let turn = Instant::now();
        source.poll(turn, &mut out);
        for u in out.drain(..) {
            state.ingest(u);
        }
        state.source = source.status();
        state.paused = source.paused();
        terminal.draw(|f| views::draw(f, &state, &vs, &theme))?;

        // Wait for keys until the next frame is due; a key redraws at once.
        let deadline = turn + frame;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !event::poll(left)? {
                break;
            }
            match event::read()? {
                TermEvent::Key(key) => {
                    let ctx = KeyContext {
                        typing_filter: vs.filter_input.is_some(),
                        replay: state.source.is_replay(),
                    };
                    if let Some(action) = map_key(key, ctx) {
                        if let Some(c) = vs.apply(action, &state) {
                            source.control(c, &mut out);
                            for u in out.drain(..) {
                                state.ingest(u);
                            }
                        }
                    }
                    break;
                }
                TermEvent::Resize(..) => break,
                _ => {}
            }
        }
        if vs.quit {
            return Ok(());
        }
    }
}
