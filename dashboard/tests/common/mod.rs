//! Shared by the integration tests: the recorded fixtures and drawing into a `TestBackend`.
#![allow(dead_code)]

use ratatui::backend::TestBackend;
use ratatui::Terminal;
use stagehand_dashboard::app::{Control, State, ViewState};
use stagehand_dashboard::source::{ReplaySource, Source};
use stagehand_dashboard::theme::Theme;
use stagehand_dashboard::views;

/// The recorded synthetic run (see `fixture_is_the_generators_output`).
pub const RUN: &str = "tests/fixtures/run.jsonl";
/// The same run cut short, with corrupt, unknown and truncated lines.
pub const DAMAGED: &str = "tests/fixtures/damaged.jsonl";

/// Screen sizes of the snapshot tests: the smallest terminal the views are laid out for, and a
/// roomy one.
pub const SMALL: (u16, u16) = (80, 24);
pub const LARGE: (u16, u16) = (120, 40);
/// The size the pseudo-terminal tests run at.
pub const W: u16 = 120;
pub const H: u16 = 40;

/// A state fed by replaying `path`, after `controls`.
pub fn replayed(path: &str, controls: &[Control]) -> (State, ReplaySource) {
    let mut src = ReplaySource::open(std::path::Path::new(path), false).expect("fixture opens");
    src.configure(1.0, true);
    let mut state = State::new();
    let mut out = Vec::new();
    for c in controls {
        src.control(*c, &mut out);
    }
    for u in out {
        state.ingest(u);
    }
    state.source = src.status();
    state.paused = src.paused();
    (state, src)
}

/// Draws one frame at `size`.
pub fn draw_at(state: &State, vs: &ViewState, theme: &Theme, size: (u16, u16)) -> Terminal<TestBackend> {
    let mut t = Terminal::new(TestBackend::new(size.0, size.1)).expect("test terminal");
    t.draw(|f| views::draw(f, state, vs, theme)).expect("draws");
    t
}

/// Draws one frame at the large size.
pub fn draw(state: &State, vs: &ViewState, theme: &Theme) -> Terminal<TestBackend> {
    draw_at(state, vs, theme, LARGE)
}

/// The screen as text, one line a row.
pub fn screen(t: &Terminal<TestBackend>) -> String {
    let buf = t.backend().buffer();
    let area = buf.area;
    (0..area.height)
        .map(|y| (0..area.width).map(|x| buf[(x, y)].symbol().to_owned()).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

use stagehand_events::{Event, Snapshot, StreamMessage};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};

/// What one connection to the test server is sent.
#[derive(Debug, Clone)]
pub enum Msg {
    Message(StreamMessage),
    /// A keep-alive comment.
    Comment,
}

/// A snapshot message of the state after `events`.
pub fn snapshot_of(events: &[Event]) -> Msg {
    Msg::Message(StreamMessage::Snapshot {
        snapshot: Box::new(Snapshot::from_events(events)),
    })
}

/// Event messages.
pub fn events_of(events: &[Event]) -> Vec<Msg> {
    events
        .iter()
        .map(|e| Msg::Message(StreamMessage::Event { event: Box::new(e.clone()) }))
        .collect()
}

/// A tiny SSE server speaking the `/api/stream` protocol: connection `i` is sent `script[i]`,
/// then closed if `close[i]`, else held open until the test ends. Returns its address.
pub fn sse_server(script: Vec<(Vec<Msg>, bool)>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds a port");
    let addr = listener.local_addr().expect("has an address").to_string();
    std::thread::spawn(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        for (msgs, close) in script {
            let Ok((mut conn, _)) = listener.accept() else { return };
            // Read the request head.
            let mut r = BufReader::new(conn.try_clone().expect("clones the stream"));
            let mut line = String::new();
            let mut path = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                if path.is_empty() {
                    path = line.split_whitespace().nth(1).unwrap_or_default().to_owned();
                }
                if line == "\r\n" {
                    break;
                }
                line.clear();
            }
            assert_eq!(path, "/api/stream");
            let mut body = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n",
            );
            for m in msgs {
                match m {
                    Msg::Comment => body.push_str(": keep-alive\n\n"),
                    Msg::Message(m) => {
                        let data = serde_json::to_string(&m).expect("serializes");
                        body.push_str(&format!("event: {}\ndata: {data}\n\n", m.name()));
                    }
                }
            }
            if conn.write_all(body.as_bytes()).is_err() {
                return;
            }
            let _ = conn.flush();
            if !close {
                held.push(conn);
            }
        }
        // Keep held connections open until the process ends.
        let _open = held;
        loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    });
    addr
}
