//! Activations: what the pack hook did with saved tensors (kept, spilled, restored, predicted
//! restores), stalls and bytes, over the run and step by step.

use super::{bad_if, boxed, spark};
use crate::app::{fmt_bytes, State};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [top, steps] = Layout::vertical([Constraint::Length(10), Constraint::Min(3)]).areas(area);
    let [totals, reasons] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(top);
    let a = &state.snapshot.activations;
    let row = |k: &'static str, v: String| {
        Line::from(vec![Span::styled(format!("{k:<22}"), theme.dim()), Span::raw(v)])
    };
    let spill_frac = if a.saved > 0 { a.spilled as f64 / a.saved as f64 } else { 0.0 };
    let lines = vec![
        row(
            "saved",
            format!("{} ({} weight handles, {} duplicates)", a.saved, a.weight_handles, a.duplicates),
        ),
        row("kept", a.kept.to_string()),
        Line::from(vec![
            Span::styled(format!("{:<22}", "spilled"), theme.dim()),
            Span::styled(
                format!("{} ({:.0}% of saved, {} inline)", a.spilled, 100.0 * spill_frac, a.finalized_inline),
                theme.band(spill_frac),
            ),
        ]),
        row("restored", format!("{} ({} predicted ahead of need)", a.restored, a.predicted)),
        Line::from(vec![
            Span::styled(format!("{:<22}", "stalls"), theme.dim()),
            Span::styled(
                format!("{} ({:.2} ms)", a.stall_count, a.stall_time_ms),
                bad_if(a.stall_count, theme),
            ),
        ]),
        row("bytes spilled / back", format!("{} / {}", fmt_bytes(a.spill_bytes), fmt_bytes(a.restore_bytes))),
        row("pool hits / misses", format!("{} / {}", a.pool_hits, a.pool_misses)),
        row("spilling now", if a.spilling { "on (VRAM over the high watermark)".into() } else { "off".into() }),
    ];
    f.render_widget(Paragraph::new(lines).block(boxed(" Activations (run) ", theme)), totals);

    let mut rl: Vec<Line<'_>> = a
        .kept_by_reason
        .iter()
        .map(|(r, n)| Line::from(vec![Span::styled(format!("{r:<18}"), theme.dim()), Span::raw(n.to_string())]))
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

    let visible = steps.height.saturating_sub(3) as usize;
    let rows: Vec<Row<'_>> = state
        .snapshot
        .steps
        .iter()
        .rev()
        .filter_map(|r| r.activations.as_ref().map(|m| (r.step, m)))
        .take(visible)
        .map(|(step, m)| {
            Row::new(vec![
                step.to_string(),
                m.activations_saved.to_string(),
                m.activations_kept.to_string(),
                m.activations_spilled.to_string(),
                m.activations_restored.to_string(),
                m.activations_predicted.to_string(),
                format!("{} / {:.2} ms", m.stall_count, m.stall_time_ms),
                fmt_bytes(m.spill_bytes),
                format!("{} / {}", m.pool_hits, m.pool_misses),
                format!("{:.0} MiB", m.vram_peak_mb),
            ])
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(6),
            Constraint::Length(7),
            Constraint::Length(6),
            Constraint::Length(8),
            Constraint::Length(9),
            Constraint::Length(10),
            Constraint::Length(14),
            Constraint::Length(11),
            Constraint::Length(10),
            Constraint::Length(10),
        ],
    )
    .header(
        Row::new(vec![
            "step", "saved", "kept", "spilled", "restored", "predicted", "stalls", "spill bytes",
            "pool h/m", "VRAM peak",
        ])
        .style(theme.strong()),
    )
    .block(boxed(" Per step (newest first) ", theme));
    f.render_widget(table, steps);
}
