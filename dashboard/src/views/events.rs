//! Events: a scrolling, filterable log of the raw events, following the tail unless a row is
//! selected.

use super::boxed;
use super::widgets::{constraints, fit_columns};
use crate::app::{State, ViewState};
use stagehand_events::describe::describe;
use crate::format::{count, run_time};
use crate::theme::Theme;
use ratatui::layout::Rect;
use ratatui::text::Line;
use ratatui::widgets::{Row, Table, TableState};
use ratatui::Frame;
use stagehand_events::{Event, EventKind};

/// Columns: (width, priority); "what" takes the rest. At 80 columns the time gives way, so
/// what an event says keeps its units.
const COLS: [(u16, u8); 6] = [(7, 1), (9, 3), (4, 1), (10, 2), (20, 0), (30, 0)];

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let kept = fit_columns(&COLS, area.width.saturating_sub(2) as usize);
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
            let cells = [
                Line::raw(e.seq.to_string()),
                Line::raw(run_time(e.t_ns)),
                Line::raw(e.step.to_string()),
                Line::raw(e.phase.as_str()),
                Line::styled(e.kind.name(), style),
                Line::raw(describe(&e.kind)),
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    // What the filter searches: the events kept, by sequence number.
    let range = match (state.recent.front(), state.recent.back()) {
        (Some(a), Some(b)) => format!("/{}, seq {}-{}", count(state.recent.len() as u64), a.seq, b.seq),
        _ => String::new(),
    };
    let mut title = format!(" Events ({n}{range}");
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
    let titles = ["seq", "time", "step", "phase", "kind", "what"];
    let table = Table::new(rows, constraints(&COLS, &kept))
    .header(Row::new(kept.iter().map(|i| titles[*i]).collect::<Vec<_>>()).style(theme.strong()))
    .row_highlight_style(theme.selected())
    .block(block.title_bottom(Line::styled(
        " / filter (kind:NAME block:N step:A-B)  Enter details  G follow ",
        theme.dim(),
    )));
    let mut ts = TableState::default().with_selected((n > 0 && vs.event_sel.is_some()).then_some(sel - start));
    f.render_stateful_widget(table, area, &mut ts);
}
