//! Activations: what the pack hook did with saved tensors (kept, spilled, restored, predicted
//! restores), stalls and bytes, over the run and step by step.

use super::widgets::{constraints, fit_columns, rows as kv_rows, sort_title, spark};
use super::{bad_if, boxed};
use crate::app::{State, ViewState};
use crate::format::{bytes, count, ms, percent};
use crate::sort::{self, TableId};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let [top, steps] = Layout::vertical([Constraint::Length(11), Constraint::Min(3)]).areas(area);
    let [totals, reasons] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(top);
    let a = &state.snapshot.activations;
    let spill_frac = if a.counts.saved > 0 { a.counts.spilled as f64 / a.counts.saved as f64 } else { 0.0 };
    let n = Style::default();
    let items = vec![
        ("saved", "saved", format!("{} ({} weights, {} dup)", count(a.counts.saved), count(a.counts.weight_handles), count(a.duplicates)), n),
        ("kept", "kept", count(a.counts.kept), n),
        (
            "spilled",
            "spilled",
            format!("{} ({} of saved, {} inline)", count(a.counts.spilled), percent(a.counts.spilled as f64, a.counts.saved as f64), count(a.finalized_inline)),
            theme.band(spill_frac),
        ),
        ("restored", "restored", format!("{} ({} ahead of need)", count(a.counts.restored), count(a.counts.predicted)), n),
        ("stalls", "stalls", format!("{} ({})", count(a.counts.stall_count), ms(a.counts.stall_time_ms)), bad_if(a.counts.stall_count, theme)),
        ("bytes spilled / back", "spill/back", format!("{} / {}", bytes(a.counts.spill_bytes), bytes(a.counts.restore_bytes)), n),
        ("recomputed, not stored", "recomputed", format!("{} ({})", count(a.counts.recomputed), bytes(a.counts.recompute_bytes)), n),
        ("pool hits / misses", "pool h/m", format!("{} / {}", count(a.counts.pool_hits), count(a.counts.pool_misses)), bad_if(a.counts.pool_misses, theme)),
        ("spilling now", "spilling", if a.spilling { "on (over the high watermark)" } else { "off" }.to_owned(), n),
    ];
    let lines = kv_rows(items, totals.width.saturating_sub(2) as usize, theme);
    f.render_widget(Paragraph::new(lines).block(boxed(" Activations (run) ", theme)), totals);

    let mut rl: Vec<Line<'_>> = a
        .kept_by_reason
        .iter()
        .map(|(r, n)| Line::from(vec![Span::styled(format!("{r:<18}"), theme.dim()), Span::raw(count(*n))]))
        .collect();
    if rl.is_empty() {
        rl.push(Line::styled("nothing kept yet", theme.dim()));
    }
    let spilled: Vec<f64> = state
        .snapshot
        .steps
        .iter()
        .filter_map(|r| r.activations.as_ref().map(|m| m.spill_bytes as f64))
        .collect();
    rl.push(Line::raw(""));
    rl.push(Line::from(vec![
        Span::styled("spilled/step ", theme.dim()),
        Span::styled(spark(&spilled, 0.0, reasons.width.saturating_sub(16) as usize, theme), theme.accent()),
    ]));
    f.render_widget(Paragraph::new(rl).block(boxed(" Kept, by reason ", theme)), reasons);

    draw_steps(f, steps, state, vs, theme);
}

/// Columns: (width, priority).
const COLS: [(u16, u8); 10] = [(6, 0), (7, 1), (6, 1), (8, 0), (9, 0), (10, 2), (16, 1), (12, 1), (9, 2), (9, 2)];

fn draw_steps(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let sort = vs.sorts.get(TableId::ActivationSteps);
    let visible = area.height.saturating_sub(3) as usize;
    let kept = fit_columns(&COLS, area.width.saturating_sub(2) as usize);
    let recs = state.snapshot.steps.iter().filter(|r| r.activations.is_some()).collect();
    let rows: Vec<Row<'_>> = sort::sorted(recs, sort, sort::activation_key)
        .into_iter()
        .filter_map(|r| r.activations.as_ref().map(|m| (r.step, m)))
        .take(visible)
        .map(|(step, m)| {
            let cells = [
                step.to_string(),
                count(m.activations_saved),
                count(m.activations_kept),
                count(m.activations_spilled),
                count(m.activations_restored),
                count(m.activations_predicted),
                format!("{} / {}", count(m.stall_count), ms(m.stall_time_ms)),
                bytes(m.spill_bytes),
                format!("{} / {}", count(m.pool_hits), count(m.pool_misses)),
                // The event carries this one figure in MiB (its wire name says so); shown in binary units like every size.
                bytes((m.vram_peak_mib.max(0.0) * 1048576.0) as u64),
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    // Table columns of the sort's columns.
    let sort_col = [0usize, 1, 2, 3, 4, 6, 7, 9];
    let titles = ["step", "saved", "kept", "spilled", "restored", "predicted", "stalls", "spill bytes", "pool h/m", "VRAM peak"];
    let header: Vec<String> = kept
        .iter()
        .map(|i| sort_title(titles[*i], (sort_col.get(sort.column) == Some(i)).then_some(sort.descending), theme))
        .collect();
    let table = Table::new(rows, constraints(&COLS, &kept))
        .header(Row::new(header).style(theme.strong()))
        .block(boxed(" Per step (s sort, S reverse) ", theme));
    f.render_widget(table, area);
}
