//! Events: a scrolling, filterable log of the raw events, following the tail unless a row is
//! selected.

use super::boxed;
use crate::app::{State, ViewState};
use crate::describe::describe;
use crate::format::{count, run_time};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Row, Table, TableState};
use ratatui::Frame;
use stagehand::events::{Event, EventKind};

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let events: Vec<&Event> = state.filtered_events(&vs.filter).collect();
    let n = events.len();
    let sel = vs.event_sel.map_or(n.saturating_sub(1), |s| s.min(n.saturating_sub(1)));
    // Only build the rows that can show: the window around the selection.
    let visible = (area.height.saturating_sub(3) as usize).max(1);
    let start = (sel + 1).saturating_sub(visible);
    let end = (start + visible).min(n);
    let rows: Vec<Row<'_>> = events[start..end]
        .iter()
        .map(|e| {
            let style = match e.kind {
                EventKind::Warning { .. }
                | EventKind::EventsDropped { .. }
                | EventKind::SlotDenied { .. }
                | EventKind::PrefetchMiss { .. }
                | EventKind::PoolExhausted { .. } => theme.alert(),
                EventKind::Residency { to, .. } => theme.state(to),
                _ => ratatui::style::Style::default(),
            };
            Row::new(vec![
                Line::raw(e.seq.to_string()),
                Line::raw(run_time(e.t_ns)),
                Line::raw(e.step.to_string()),
                Line::raw(e.phase.as_str()),
                Line::styled(e.kind.name(), style),
                Line::raw(describe(&e.kind)),
            ])
        })
        .collect();
    let mut title = format!(" Events ({n} of the last {} kept", state.recent.len());
    if !vs.filter.is_empty() {
        title.push_str(&format!(", filter: {}", vs.filter.text));
        if !vs.filter.invalid.is_empty() {
            title.push_str(&format!(" [ignored: {}]", vs.filter.invalid.join(" ")));
        }
    }
    title.push_str(if vs.event_sel.is_none() { ", following) " } else { ") " });
    let dropped = state.snapshot.dropped_events;
    let mut block = boxed(title, theme);
    if dropped > 0 {
        block = block.title(
            Line::styled(format!(" dropped by the bus: {} ", count(dropped)), theme.alert())
                .right_aligned(),
        );
    }
    let table = Table::new(
        rows,
        [
            Constraint::Length(7),
            Constraint::Length(9),
            Constraint::Length(4),
            Constraint::Length(10),
            Constraint::Length(20),
            Constraint::Min(20),
        ],
    )
    .header(Row::new(vec!["seq", "time", "step", "phase", "kind", "what"]).style(theme.strong()))
    .row_highlight_style(theme.selected())
    .block(block.title_bottom(Line::styled(
        " / filter (kind:NAME block:N step:A-B)  Enter details  G follow ",
        theme.dim(),
    )));
    let mut ts = TableState::default().with_selected((n > 0 && vs.event_sel.is_some()).then_some(sel - start));
    f.render_stateful_widget(table, area, &mut ts);
}
