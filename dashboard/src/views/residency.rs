//! Residency: every managed block in its state, the itinerary strip with the prefetch window and
//! the cursor, and a table of blocks (state, refcount, size, what happened last).

use super::boxed;
use crate::app::{fmt_bytes, State, ViewState};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table, TableState};
use ratatui::Frame;
use stagehand::events::{BlockId, BlockState};

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let [strip, table] =
        Layout::vertical([Constraint::Length(6), Constraint::Min(3)]).areas(area);
    draw_strip(f, strip, state, theme);
    draw_table(f, table, state, vs, theme);
}

fn draw_strip(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let counts = s.residency_counts();
    let mut legend = Vec::new();
    for st in BlockState::ALL {
        legend.push(Span::styled(
            format!("{} ", theme.state_glyph(st)),
            theme.state(st),
        ));
        legend.push(Span::styled(
            format!("{} {}   ", st.as_str(), counts.get(&st).copied().unwrap_or(0)),
            theme.state(st),
        ));
    }
    let it = &s.itinerary;
    let order: Vec<BlockId> = if it.order.is_empty() {
        s.blocks.iter().map(|b| b.id).collect()
    } else {
        it.order.clone()
    };
    let width = area.width.saturating_sub(14) as usize;
    let mut cells = vec![Span::styled("itinerary  ", theme.dim())];
    let mut marks = vec![Span::raw(" ".repeat(11))];
    for (i, id) in order.iter().enumerate().take(width / 2) {
        let st = s.block(*id).map_or(BlockState::Unloaded, |b| b.state);
        cells.push(Span::styled(theme.state_glyph(st), theme.state(st)));
        cells.push(Span::raw(" "));
        let mark = if i as u32 == it.cursor {
            "^"
        } else if it.window.contains(id) {
            "w"
        } else {
            " "
        };
        marks.push(Span::styled(format!("{mark} "), theme.accent()));
    }
    let info = Line::styled(
        format!(
            "cursor {} ({}), prefetch window [{}], {} blocks in order",
            it.cursor,
            if it.backward { "backward" } else { "forward" },
            it.window.iter().map(|b| b.0.to_string()).collect::<Vec<_>>().join(" "),
            order.len()
        ),
        theme.dim(),
    );
    let lines = vec![Line::from(legend), info, Line::from(cells), Line::from(marks)];
    f.render_widget(
        Paragraph::new(lines).block(boxed(" Residency ", theme)),
        area,
    );
}

fn draw_table(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let s = &state.snapshot;
    let it = &s.itinerary;
    let rows: Vec<Row<'_>> = state
        .filtered_blocks(&vs.filter)
        .map(|b| {
            let mut flags = String::new();
            if it.cursor == b.exec_order && !it.order.is_empty() {
                flags.push('>');
            }
            if it.window.contains(&b.id) {
                flags.push('W');
            }
            if b.protected {
                flags.push('P');
            }
            if b.trainable {
                flags.push('T');
            }
            if b.file_backed {
                flags.push('F');
            }
            Row::new(vec![
                Line::raw(b.id.to_string()),
                Line::raw(b.name.clone()),
                Line::styled(b.state.as_str(), theme.state(b.state)),
                Line::raw(b.refcount.to_string()),
                Line::raw(fmt_bytes(b.bytes)),
                Line::raw(b.loads.to_string()),
                Line::raw(b.evictions.to_string()),
                Line::raw(flags),
                Line::raw(format!("{} (#{})", b.last, b.last_seq)),
            ])
        })
        .collect();
    let n = rows.len();
    let title = if vs.filter.is_empty() {
        format!(" Blocks ({n}) ")
    } else {
        format!(" Blocks ({n} of {}, filter: {}) ", s.blocks.len(), vs.filter.text)
    };
    let table = Table::new(
        rows,
        [
            Constraint::Length(4),
            Constraint::Length(14),
            Constraint::Length(12),
            Constraint::Length(4),
            Constraint::Length(10),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Min(10),
        ],
    )
    .header(
        Row::new(vec!["id", "name", "state", "ref", "size", "loads", "evict", "flags", "last"])
            .style(theme.strong()),
    )
    .row_highlight_style(theme.selected())
    .block(boxed(title, theme).title_bottom(Line::styled(
        " flags: > cursor  W window  P protected  T trainable  F file-backed   Enter details ",
        theme.dim(),
    )));
    let mut ts = TableState::default().with_selected((n > 0).then_some(vs.block_sel.min(n.saturating_sub(1))));
    f.render_stateful_widget(table, area, &mut ts);
}
