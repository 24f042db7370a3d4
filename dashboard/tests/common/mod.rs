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

/// Screen size of the snapshot tests.
pub const W: u16 = 120;
pub const H: u16 = 36;

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

/// Draws one frame.
pub fn draw(state: &State, vs: &ViewState, theme: &Theme) -> Terminal<TestBackend> {
    let mut t = Terminal::new(TestBackend::new(W, H)).expect("test terminal");
    t.draw(|f| views::draw(f, state, vs, theme)).expect("draws");
    t
}
