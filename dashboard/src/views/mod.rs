//! Pure render functions: each view draws from `&State`, `&ViewState` and the theme, nothing
//! else, so a replay and a live run draw identically and tests can draw into a `TestBackend`.
//!
//! Every view is laid out for 80x24 and up: numbers are abbreviated ([`crate::format`]), fields
//! that do not fit give way by priority and tables drop their least important columns
//! (`widgets`), rather than cutting a number.

mod activations;
mod chrome;
mod conductor;
mod events;
mod findings;
mod gpus;
mod memory;
mod overview;
mod parts;
mod pools;
mod residency;
mod time;
mod transfers;
pub(crate) mod widgets;

use crate::app::{State, View, ViewState};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::Style;
use ratatui::text::Line;
use ratatui::widgets::Block;
use ratatui::Frame;

/// Draws the whole screen: header (with a status line when there is news about the source),
/// the current view, footer, and any overlay.
pub fn draw(f: &mut Frame<'_>, state: &State, vs: &ViewState, theme: &Theme) {
    let width = f.area().width as usize;
    let status = chrome::status_lines(state, width, theme);
    let [header, body, footer] = Layout::vertical([
        Constraint::Length(2 + status.len() as u16),
        Constraint::Min(3),
        Constraint::Length(2),
    ])
    .areas(f.area());
    chrome::draw_header(f, header, state, vs, status, theme);
    match vs.view {
        View::Overview => overview::draw(f, body, state, theme),
        View::Time => time::draw(f, body, state, vs, theme),
        View::Memory => memory::draw(f, body, state, theme),
        View::Residency => residency::draw(f, body, state, vs, theme),
        View::Pools => pools::draw(f, body, state, theme),
        View::Transfers => transfers::draw(f, body, state, vs, theme),
        View::Activations => activations::draw(f, body, state, vs, theme),
        View::Conductor => conductor::draw(f, body, state, vs, theme),
        View::Events => events::draw(f, body, state, vs, theme),
    }
    chrome::draw_footer(f, footer, state, vs, theme);
    if let Some(d) = &vs.detail {
        chrome::draw_detail(f, body, state, d, theme);
    }
    if vs.help {
        chrome::draw_help(f, body, state, theme);
    }
}

/// A bordered block in the theme's border set.
pub(crate) fn boxed<'a>(title: impl Into<Line<'a>>, theme: &Theme) -> Block<'a> {
    Block::bordered()
        .border_set(theme.border())
        .border_style(theme.dim())
        .title(title.into().style(theme.accent()))
}

/// A style for a count that should be zero.
pub(crate) fn bad_if(n: u64, theme: &Theme) -> Style {
    if n > 0 {
        theme.alert()
    } else {
        Style::default()
    }
}
