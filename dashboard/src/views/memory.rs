//! VRAM: where device memory went. Who holds it now (resident weights, kept activations,
//! restored activations waiting for backward, copies in flight, the rest) against the budget and
//! the spill watermarks; the same over recent readings as a stacked chart, one column a reading
//! (`vram_owners_history`); the last finished step at its fullest reading (`vram_at_peak`) beside its true peak; and the limits
//! each owner set, with any out-of-memory report.

use super::parts::{owner_parts, owner_values, swatch, OWNER_PARTS};
use super::widgets::{legend, mark, stacked, Fields};
use super::boxed;
use crate::app::State;
use crate::format::{bytes, percent};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;
use stagehand_events::snapshot::OwnersReading;
use stagehand_events::{Owner, Snapshot, VramByOwner};

/// Width of the chart's axis labels ("1023 MiB ").
const AXIS: usize = 9;

/// A stacked bar of `o` against `scale` with the watermarks marked, and its legend.
fn owners_lines<'a>(o: &VramByOwner, scale: f64, marks: &[(f64, &'a str)], w: usize, theme: &Theme) -> Vec<Line<'a>> {
    let parts = owner_parts(o, theme);
    let mut cells = stacked(&parts, scale, w, theme);
    // One span per cell, so the marks land on the right cell.
    let mut flat: Vec<Span<'a>> = cells
        .drain(..)
        .flat_map(|s| {
            let style = s.style;
            s.content.chars().map(move |c| Span::styled(c.to_string(), style)).collect::<Vec<_>>()
        })
        .collect();
    mark(&mut flat, marks, theme);
    let mut lines = vec![Line::from(flat)];
    let free = scale - o.allocated_bytes as f64;
    let mut items: Vec<_> = parts
        .iter()
        .map(|(sw, v)| (*sw, format!("{} {} {}", sw.name, bytes(*v as u64), percent(*v, o.allocated_bytes as f64))))
        .collect();
    if free > 0.0 {
        let sw = super::widgets::Swatch { name: "free", style: theme.dim(), glyph: theme.bar_cells().1 };
        items.push((sw, format!("free {}", bytes(free as u64))));
    }
    lines.extend(legend(items, w));
    lines
}

fn scale_and_marks(s: &Snapshot, allocated: u64) -> (f64, Vec<(f64, &'static str)>) {
    let budget = s.vram_budget_bytes().unwrap_or(0);
    let scale = budget.max(allocated).max(1) as f64;
    let marks = s
        .spill_watermarks()
        .map(|(h, l)| vec![(l as f64 / scale, "L"), (h as f64 / scale, "H")])
        .unwrap_or_default();
    (scale, marks)
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let w = area.width.saturating_sub(2) as usize;
    let now = s.vram_owners.as_ref().map(|r| {
        let (scale, marks) = scale_and_marks(s, r.owners.allocated_bytes);
        let title = format!(
            " Now (step {} {}): {} of {} ",
            r.step,
            r.phase,
            bytes(r.owners.allocated_bytes),
            bytes(s.vram_budget_bytes().unwrap_or(0))
        );
        (title, owners_lines(&r.owners, scale, &marks, w, theme))
    });
    // The newest finished step, else the step under way: its fullest reading by owner, beside
    // its true peak (between readings).
    let finished = s.steps.iter().rev().find(|r| r.vram_at_peak.is_some() && s.is_finished(r));
    let any = s.steps.iter().rev().find(|r| r.vram_at_peak.is_some());
    let peak = finished.or(any).and_then(|r| r.vram_at_peak.map(|p| (r, p, finished.is_some()))).map(|(r, p, done)| {
        let (scale, marks) = scale_and_marks(s, p.allocated_bytes);
        let so_far = if done { "" } else { " so far" };
        let true_peak = r.train.as_ref().map_or(String::new(), |t| format!(", peak {}", bytes(t.vram_peak_bytes)));
        (
            format!(" Step {} fullest reading{so_far}: {}{true_peak} ", r.step, bytes(p.allocated_bytes)),
            owners_lines(&p, scale, &marks, w, theme),
        )
    });
    let limits = limit_lines(s, w, theme);
    let box_h = |x: &Option<(String, Vec<Line<'_>>)>| x.as_ref().map_or(3, |(_, l)| 2 + l.len() as u16);
    let [now_a, chart_a, peak_a, limits_a] = Layout::vertical([
        Constraint::Length(box_h(&now)),
        Constraint::Min(5),
        Constraint::Length(box_h(&peak)),
        Constraint::Length(2 + limits.len() as u16),
    ])
    .areas(area);
    let none = |what: &str| vec![Line::styled(format!("no reading of VRAM by owner {what}yet (vram_owners events)"), theme.dim())];
    let (t, l) = now.unwrap_or_else(|| (" Now ".into(), none("")));
    f.render_widget(Paragraph::new(l).block(boxed(t, theme)), now_a);
    draw_chart(f, chart_a, s, theme);
    let (t, l) = peak.unwrap_or_else(|| (" A step's fullest reading ".into(), none("in a step ")));
    f.render_widget(Paragraph::new(l).block(boxed(t, theme)), peak_a);
    f.render_widget(Paragraph::new(limits).wrap(Wrap { trim: false }).block(boxed(" Limits and incidents ", theme)), limits_a);
}

/// The limits each owner published, then any out-of-memory report, newest first.
fn limit_lines<'a>(s: &Snapshot, w: usize, theme: &Theme) -> Vec<Line<'a>> {
    let mut fl = Fields::new();
    for (owner, l) in &s.limits {
        let name = match owner {
            Owner::Device => "device budget",
            Owner::Weights => "weight room",
            Owner::Activations => "spill",
            Owner::Conductor => "conductor cap",
            Owner::Trainer => "trainer",
        };
        let mut text = bytes(l.budget_bytes);
        if let (Some(h), Some(lo)) = (l.high_watermark_bytes, l.low_watermark_bytes) {
            text = format!("H {} L {}", bytes(h), bytes(lo));
        } else if let Some(h) = l.high_watermark_bytes {
            text.push_str(&format!(" (hard {})", bytes(h)));
        }
        fl.kv(0, name, text, theme);
    }
    let mut lines = vec![];
    if s.limits.is_empty() {
        lines.push(Line::styled("no limits published yet (limits_set events)", theme.dim()));
    } else {
        lines.push(fl.line(w, Span::raw("  ")));
    }
    for o in s.out_of_memory.iter().rev().take(2) {
        lines.push(Line::styled(
            format!(
                "out of memory at step {} ({}) asking {} while {}: weights {}, activations {}, other {}",
                o.step,
                o.phase,
                bytes(o.requested_bytes),
                o.doing,
                bytes(o.owners.weights_bytes),
                bytes(o.owners.activations_kept_bytes.saturating_add(o.owners.activations_restored_bytes)),
                bytes(o.owners.other_bytes)
            ),
            theme.alert(),
        ));
    }
    lines
}

/// A stacked column chart of the recent readings by owner: one column a reading, newest right;
/// the row under it marks where each step's readings begin.
fn draw_chart(f: &mut Frame<'_>, area: Rect, s: &Snapshot, theme: &Theme) {
    let w = area.width.saturating_sub(2) as usize;
    let h = area.height.saturating_sub(3) as usize; // border, and the step row
    let cols = w.saturating_sub(AXIS);
    let hist: Vec<&OwnersReading> = s.vram_owners_history.iter().collect();
    let shown = &hist[hist.len().saturating_sub(cols)..];
    let top = shown.iter().map(|r| r.owners.allocated_bytes).max().unwrap_or(0);
    let scale = s.vram_budget_bytes().unwrap_or(0).max(top).max(1) as f64;
    let high_row = s.spill_watermarks().map(|(hi, _)| ((hi as f64 / scale) * h as f64) as usize);
    let swatches: Vec<_> = OWNER_PARTS.iter().map(|p| swatch(*p, theme)).collect();
    let empty = theme.bar_cells().1;
    let mut lines = Vec::new();
    for row in (0..h).rev() {
        let label = if row + 1 == h {
            bytes(scale as u64)
        } else if row == 0 {
            "0".to_owned()
        } else if Some(row) == high_row {
            "H".to_owned()
        } else {
            String::new()
        };
        let mut spans = vec![Span::styled(format!("{label:>8} "), theme.dim())];
        let mid = (row as f64 + 0.5) / h.max(1) as f64 * scale;
        for r in shown {
            let mut acc = 0.0;
            let mut cell = Span::styled(if Some(row) == high_row { "-" } else { " " }, theme.dim());
            if mid < r.owners.allocated_bytes as f64 {
                for (sw, v) in swatches.iter().zip(owner_values(&r.owners)) {
                    acc += v as f64;
                    if mid < acc {
                        cell = Span::styled(sw.glyph, sw.style);
                        break;
                    }
                }
                if mid >= acc {
                    cell = Span::styled(empty, theme.dim());
                }
            }
            spans.push(cell);
        }
        lines.push(Line::from(spans));
    }
    // Step marks: the step number where its readings begin, when there is room for it.
    let mut marks = vec![' '; shown.len()];
    let mut last_step = None;
    let mut free_from = 0;
    for (i, r) in shown.iter().enumerate() {
        if last_step != Some(r.step) {
            last_step = Some(r.step);
            let label: Vec<char> = format!("|{}", r.step).chars().collect();
            if i >= free_from && i + label.len() <= marks.len() {
                marks[i..i + label.len()].copy_from_slice(&label);
                free_from = i + label.len() + 1;
            }
        }
    }
    let axis = format!("{:>8} ", "step");
    lines.push(Line::from(vec![
        Span::styled(axis, theme.dim()),
        Span::styled(marks.into_iter().collect::<String>(), theme.dim()),
    ]));
    let title = format!(" By owner over the last {} readings (newest right) ", shown.len());
    f.render_widget(Paragraph::new(lines).block(boxed(title, theme)), area);
}
