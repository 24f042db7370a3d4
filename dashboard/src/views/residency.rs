//! Residency: every managed block in its state, the itinerary strip with the prefetch window and
//! the cursor, and a table of blocks (state, refcount, size, what happened last).

use super::boxed;
use super::widgets::{constraints, fit_columns, sort_title, Fields};
use crate::app::{State, ViewState};
use crate::format::{bytes, count};
use crate::sort::TableId;
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table, TableState};
use ratatui::Frame;
use stagehand_events::{BlockId, BlockState};

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let [strip, table] =
        Layout::vertical([Constraint::Length(6), Constraint::Min(3)]).areas(area);
    draw_strip(f, strip, state, theme);
    draw_table(f, table, state, vs, theme);
}

fn draw_strip(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let counts = s.residency_counts();
    let mut legend = Fields::new();
    for st in BlockState::ALL {
        let n = counts.get(&st).copied().unwrap_or(0);
        // Empty states give way first.
        legend.push(u8::from(n == 0), vec![
            Span::styled(format!("{} ", theme.state_glyph(st)), theme.state(st)),
            Span::styled(format!("{} {}", st.as_str(), count(n as u64)), theme.state(st)),
        ]);
    }
    let legend = legend.line(area.width.saturating_sub(2) as usize, Span::raw("  "));
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
    let lines = vec![legend, info, Line::from(cells), Line::from(marks)];
    f.render_widget(
        Paragraph::new(lines).block(boxed(" Residency ", theme)),
        area,
    );
}

/// Columns: (width, priority); "last" takes the rest. At 80 columns "last" keeps room for a
/// whole transition ("host_staged -> prefetching"); the reference count and flags give way.
const COLS: [(u16, u8); 9] = [(4, 0), (14, 0), (12, 0), (4, 3), (9, 1), (6, 1), (6, 1), (6, 3), (26, 1)];

fn draw_table(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let s = &state.snapshot;
    let it = &s.itinerary;
    let sort = vs.sorts.get(TableId::Blocks);
    let blocks = state.sorted_blocks(&vs.filter, &vs.sorts);
    // The name column as wide as the longest name (within reason).
    let mut cols = COLS;
    cols[1].0 = blocks.iter().map(|b| b.name.chars().count()).max().unwrap_or(0).clamp(8, 40) as u16;
    let kept = fit_columns(&cols, area.width.saturating_sub(2) as usize);
    let rows: Vec<Row<'_>> = blocks
        .iter()
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
            let cells = [
                Line::raw(b.id.to_string()),
                Line::raw(b.name.clone()),
                Line::styled(b.state.as_str(), theme.state(b.state)),
                Line::raw(count(b.refcount as u64)),
                Line::raw(bytes(b.bytes)),
                Line::raw(count(b.loads)),
                Line::raw(count(b.evictions)),
                Line::raw(flags),
                Line::raw(b.last.clone()),
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    let n = rows.len();
    let title = if vs.filter.is_empty() {
        format!(" Blocks ({n}) ")
    } else {
        format!(" Blocks ({n} of {}, filter: {}) ", s.blocks.len(), vs.filter.text)
    };
    // Table columns and the sort's columns: flags has no sort key.
    let sort_col = [0usize, 1, 2, 3, 4, 5, 6, 8];
    let titles = ["id", "name", "state", "ref", "size", "loads", "evict", "flags", "last"];
    let header: Vec<String> = kept
        .iter()
        .map(|i| {
            let here = sort_col.get(sort.column) == Some(i);
            sort_title(titles[*i], here.then_some(sort.descending), theme)
        })
        .collect();
    let table = Table::new(rows, constraints(&cols, &kept))
        .header(Row::new(header).style(theme.strong()))
        .row_highlight_style(theme.selected())
        .block(boxed(title, theme).title_bottom(Line::styled(
            " > cursor W window P protected T trainable F file  s sort  Enter details ",
            theme.dim(),
        )));
    let mut ts = TableState::default().with_selected((n > 0).then_some(vs.block_sel.min(n.saturating_sub(1))));
    f.render_stateful_widget(table, area, &mut ts);
}
