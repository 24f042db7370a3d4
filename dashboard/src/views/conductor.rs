//! Conductor: the phase timeline of recent steps, reservations by mode and priority, denials
//! with their reasons, and the current hints with the rule that set them.

use super::{bad_if, boxed, kv};
use crate::app::{fmt_bytes, fmt_hints, rule_name, State};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand::events::Phase;

fn phase_glyph(p: Phase) -> (&'static str, Color) {
    match p {
        Phase::Idle => (" ", Color::Reset),
        Phase::StepBegin => ("s", Color::DarkGray),
        Phase::Forward => ("F", Color::Green),
        Phase::Backward => ("B", Color::Blue),
        Phase::Optimizer => ("O", Color::Magenta),
        Phase::StepEnd => ("e", Color::DarkGray),
    }
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [timeline, middle, denials] = Layout::vertical([
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Min(3),
    ])
    .areas(area);
    draw_timeline(f, timeline, state, theme);
    let [hints, modes, reasons] = Layout::horizontal([
        Constraint::Percentage(40),
        Constraint::Percentage(30),
        Constraint::Percentage(30),
    ])
    .areas(middle);
    draw_hints(f, hints, state, theme);
    draw_modes(f, modes, state, theme);
    draw_reasons(f, reasons, state, theme);
    draw_denials(f, denials, state, theme);
}

fn draw_timeline(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let spans = &state.snapshot.phase_spans;
    let rows = area.height.saturating_sub(3) as usize;
    let mut steps: Vec<u64> = spans.iter().map(|s| s.step).collect();
    steps.dedup();
    let shown = &steps[steps.len().saturating_sub(rows)..];
    let total = |step: u64| -> u64 {
        spans
            .iter()
            .filter(|s| s.step == step)
            .map(|s| s.end_ns.saturating_sub(s.start_ns))
            .sum()
    };
    let longest = shown.iter().map(|s| total(*s)).max().unwrap_or(0).max(1);
    let width = area.width.saturating_sub(24) as usize;
    let mut lines = Vec::new();
    for step in shown {
        let mut row = vec![Span::styled(format!("step {step:<5}"), theme.dim())];
        for s in spans.iter().filter(|s| s.step == *step) {
            let d = s.end_ns.saturating_sub(s.start_ns);
            let n = ((d as f64 / longest as f64) * width as f64).round() as usize;
            let (g, c) = phase_glyph(s.phase);
            let style = if theme.color { theme.strong().fg(c) } else { theme.strong() };
            row.push(Span::styled(g.repeat(n), style));
        }
        row.push(Span::raw(format!(" {:.1} ms", total(*step) as f64 / 1e6)));
        lines.push(Line::from(row));
    }
    if lines.is_empty() {
        lines.push(Line::styled("no phase finished yet", theme.dim()));
    }
    lines.push(Line::styled(
        format!(
            "now: step {} {} | F forward  B backward  O optimizer  s/e step begin/end",
            state.snapshot.step, state.snapshot.phase
        ),
        theme.dim(),
    ));
    f.render_widget(
        Paragraph::new(lines).block(boxed(" Phase timeline (recent steps) ", theme)),
        area,
    );
}

fn draw_hints(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let lines = vec![
        Line::from(vec![
            Span::styled("hints ", theme.dim()),
            Span::styled(fmt_hints(&c.hints), theme.strong()),
        ]),
        kv(
            &[
                ("set by rule", c.hints_rule.map_or("-".into(), |r| rule_name(r).to_owned())),
                ("changes", c.hint_changes.to_string()),
            ],
            theme,
        ),
        Line::raw(""),
        kv(
            &[
                ("active reservations", c.active_reservations.to_string()),
                ("holding", fmt_bytes(c.active_bytes)),
            ],
            theme,
        ),
        kv(
            &[
                ("granted", c.grants.to_string()),
                ("partial", c.partials.to_string()),
                ("ceilings", c.ceilings.to_string()),
            ],
            theme,
        ),
        Line::from(vec![
            Span::styled("denied ", theme.dim()),
            Span::styled(c.denials.to_string(), bad_if(c.denials, theme)),
            Span::styled("  slots granted ", theme.dim()),
            Span::raw(c.slot_grants.to_string()),
            Span::styled("  refused ", theme.dim()),
            Span::styled(c.slot_denials.to_string(), bad_if(c.slot_denials, theme)),
        ]),
        kv(
            &[
                ("in flight", format!("h2d {} d2h {}", c.h2d_inflight, c.d2h_inflight)),
            ],
            theme,
        ),
    ];
    f.render_widget(Paragraph::new(lines).block(boxed(" Hints and grants ", theme)), area);
}

fn draw_modes(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let mut lines = vec![Line::styled("by mode", theme.strong())];
    for (k, v) in &c.by_mode {
        lines.push(Line::raw(format!("  {k:<12}{v:>6}")));
    }
    lines.push(Line::styled("by priority", theme.strong()));
    for (k, v) in &c.by_priority {
        lines.push(Line::raw(format!("  {k:<12}{v:>6}")));
    }
    f.render_widget(Paragraph::new(lines).block(boxed(" Reservations ", theme)), area);
}

fn draw_reasons(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let mut lines: Vec<Line<'_>> = c
        .denials_by_reason
        .iter()
        .map(|(k, v)| {
            Line::from(vec![
                Span::raw(format!("{k:<34}")),
                Span::styled(v.to_string(), theme.alert()),
            ])
        })
        .collect();
    if lines.is_empty() {
        lines.push(Line::styled("no denials", theme.dim()));
    }
    f.render_widget(Paragraph::new(lines).block(boxed(" Denials by reason ", theme)), area);
}

fn draw_denials(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let visible = area.height.saturating_sub(3) as usize;
    let rows: Vec<Row<'_>> = state
        .snapshot
        .conductor
        .recent_denials
        .iter()
        .rev()
        .take(visible)
        .map(|d| {
            Row::new(vec![
                Line::raw(d.seq.to_string()),
                Line::raw(d.step.to_string()),
                Line::raw(d.phase.as_str()),
                Line::raw(d.owner.as_str()),
                Line::raw(d.what.clone()),
                Line::styled(d.reason.as_str(), theme.alert()),
            ])
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(7),
            Constraint::Length(5),
            Constraint::Length(10),
            Constraint::Length(12),
            Constraint::Length(24),
            Constraint::Min(20),
        ],
    )
    .header(Row::new(vec!["seq", "step", "phase", "owner", "what", "reason"]).style(theme.strong()))
    .block(boxed(" Recent denials (newest first) ", theme));
    f.render_widget(table, area);
}
