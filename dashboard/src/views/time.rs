//! Step time: why is this step slow. The last finished step's time as a stacked bar with each
//! part's figure (compute; the compute stream waiting on H2D copies and on D2H copies; host
//! stalls loading weights and restoring activations; the optimizer; the rest), every recent
//! step as a row of the same bars (sortable), and the findings with the knob that fixes each.

use super::parts::{time_parts, time_values, TIME_PARTS};
use super::widgets::{constraints, fit_columns, legend, sort_title, stacked};
use super::{boxed, findings};
use crate::app::{State, ViewState};
use crate::format::{ms, percent};
use crate::sort::{self, TableId};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::Line;
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand_events::snapshot::StepRecord;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let w = area.width.saturating_sub(2) as usize;
    let last = state.snapshot.steps.iter().rev().find_map(|r| r.time.map(|t| (r, t)));
    let (title, lines) = match last {
        Some((r, t)) => {
            let step = r.step;
            let parts = time_parts(&t, theme);
            let mut lines = vec![Line::from(stacked(&parts, t.step_ms, w, theme))];
            let cells = parts
                .iter()
                .filter(|(_, v)| *v > 0.0)
                .map(|(sw, v)| (*sw, format!("{} {} {}", sw.name, ms(*v), percent(*v, t.step_ms))))
                .collect();
            lines.extend(legend(cells, w));
            // Whether the host optimizer overlapped backward: the blocks it was given while
            // backward ran, of all it stepped (the rest wait for the optimizer's call).
            if let Some(wm) = r.weights.as_ref().filter(|wm| wm.host_steps > 0) {
                lines.push(Line::styled(
                    format!(
                        "host optimizer: {} of {} blocks given to it while backward ran",
                        wm.host_steps_during_backward(),
                        wm.host_steps
                    ),
                    theme.dim(),
                ));
            }
            (format!(" Step {step} took {}: where the time went ", ms(t.step_ms)), lines)
        }
        None => (
            " Step time ".to_owned(),
            vec![Line::styled("no step has finished with a time breakdown yet (step_time events)", theme.dim())],
        ),
    };
    // The findings as tall as they need, up to a third of the screen (they scroll off the end).
    let findings_h = findings::all_rows(&state.snapshot, area.width as usize).min(area.height / 3).max(3);
    let [top, steps, found_area] = Layout::vertical([
        Constraint::Length(2 + lines.len() as u16),
        Constraint::Min(4),
        Constraint::Length(findings_h),
    ])
    .areas(area);
    f.render_widget(Paragraph::new(lines).block(boxed(title, theme)), top);
    draw_steps(f, steps, state, vs, theme);
    findings::draw_all(f, found_area, &state.snapshot, theme);
}

/// Columns: (width, priority). The bar takes what the numbers leave.
const COLS: [(u16, u8); 9] = [(5, 0), (8, 0), (8, 1), (8, 0), (8, 2), (8, 3), (8, 2), (8, 4), (8, 4)];

fn draw_steps(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let sort = vs.sorts.get(TableId::StepTimes);
    let inner = area.width.saturating_sub(2) as usize;
    // The bar column is the room left by the numbers, at least 20 cells (narrow terminals drop
    // the least important numbers to make it).
    let mut cols = COLS;
    let numbers: usize = COLS.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, c)| c.0 as usize + 1).sum();
    cols[2].0 = inner.saturating_sub(numbers).clamp(20, 200) as u16;
    let kept = fit_columns(&cols, inner);
    let recs: Vec<&StepRecord> = state.snapshot.steps.iter().filter(|r| r.time.is_some()).collect();
    let rows_fit = area.height.saturating_sub(3) as usize;
    let sorted = sort::sorted(recs, sort, sort::step_time_key);
    let longest = sorted.iter().filter_map(|r| r.time.map(|t| t.step_ms)).fold(0.0, f64::max);
    // Table columns: step, total, bar, then the parts; sort columns map onto them.
    let sort_col_of = [0usize, 1, 3, 4, 5, 6, 7, 8]; // sort column -> table column
    let titles: Vec<String> = (0..COLS.len())
        .map(|c| {
            let name = match c {
                0 => "step",
                1 => "total",
                2 => "",
                3 => "compute",
                4 => "h2d wait",
                5 => "d2h wait",
                6 => "stalls",
                7 => "optim",
                _ => "other",
            };
            let sorted_here = sort_col_of.get(sort.column).is_some_and(|tc| *tc == c);
            sort_title(name, sorted_here.then_some(sort.descending), theme)
        })
        .collect();
    let rows: Vec<Row<'_>> = sorted
        .iter()
        .take(rows_fit)
        .filter_map(|r| r.time.map(|t| (r.step, t)))
        .map(|(step, t)| {
            let v = time_values(&t);
            let cell = |c: usize| -> Line<'_> {
                match c {
                    0 => Line::raw(step.to_string()),
                    1 => Line::raw(ms(t.step_ms)),
                    2 => Line::from(stacked(&time_parts(&t, theme), longest, cols[2].0 as usize, theme)),
                    3 => Line::raw(ms(v[0])),
                    4 => Line::styled(ms(v[1]), share_style(v[1], t.step_ms, theme)),
                    5 => Line::styled(ms(v[2]), share_style(v[2], t.step_ms, theme)),
                    6 => Line::styled(ms(v[3] + v[4]), share_style(v[3] + v[4], t.step_ms, theme)),
                    7 => Line::raw(ms(v[5])),
                    _ => Line::raw(ms(v[6])),
                }
            };
            Row::new(kept.iter().map(|c| cell(*c)).collect::<Vec<_>>())
        })
        .collect();
    let sorted_by = TableId::StepTimes.columns().get(sort.column).map_or("step", |c| c.title);
    let title = format!(
        " Recent steps by {sorted_by}{} (s sort, S reverse; bars to scale) ",
        if sort.descending { ", largest first" } else { ", smallest first" }
    );
    let table = Table::new(rows, constraints(&cols, &kept))
        .header(Row::new(kept.iter().map(|c| titles[*c].clone()).collect::<Vec<_>>()).style(theme.strong()))
        .block(boxed(title, theme).title_bottom(legend_key(theme)));
    f.render_widget(table, area);
}

/// A wait over 5% of its step is worth a look (the findings' threshold).
fn share_style(part: f64, whole: f64, theme: &Theme) -> ratatui::style::Style {
    if whole > 0.0 && part / whole > 0.05 {
        theme.band(0.9)
    } else {
        ratatui::style::Style::default()
    }
}

/// The glyph key under the table for no-colour and ASCII modes, where bars use letters (with
/// colour, the legend above names the colours).
fn legend_key<'a>(theme: &Theme) -> Line<'a> {
    if theme.color && !theme.ascii {
        Line::raw("")
    } else {
        let text: Vec<String> = TIME_PARTS.iter().map(|p| format!("{} {}", p.2, p.0)).collect();
        Line::styled(format!(" {} ", text.join("  ")), theme.dim())
    }
}
