//! Conductor: the phase timeline of recent steps, reservations by mode and priority, denials
//! with their reasons, and the current hints with the rule that set them.

use super::widgets::{constraints, fit_columns, rows, sort_title};
use super::boxed;
use crate::app::{State, ViewState};
use stagehand_events::describe::{fmt_hints, rule_name};
use crate::format::{bytes, count, ms};
use crate::sort::{self, TableId};
use ratatui::style::Style;
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand_events::{Concern, DenyReason, Phase};

fn phase_glyph(p: Phase) -> (&'static str, Color) {
    match p {
        Phase::Idle => (" ", Color::Reset),
        Phase::StepBegin => ("s", Color::DarkGray),
        Phase::Forward => ("F", Color::Green),
        Phase::Backward => ("B", Color::Blue),
        Phase::Optimizer => ("O", Color::Magenta),
        Phase::StepEnd => ("e", Color::DarkGray),
        Phase::Eval => ("v", Color::Cyan),
    }
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let (timeline_h, middle_h) = if area.height < 30 { (6, 8) } else { (8, 10) };
    let [timeline, middle, denials] = Layout::vertical([
        Constraint::Length(timeline_h),
        Constraint::Length(middle_h),
        Constraint::Min(3),
    ])
    .areas(area);
    draw_timeline(f, timeline, state, theme);
    let [hints, modes, reasons] = Layout::horizontal([
        Constraint::Percentage(34),
        Constraint::Percentage(22),
        Constraint::Percentage(44),
    ])
    .areas(middle);
    draw_hints(f, hints, state, theme);
    draw_modes(f, modes, state, theme);
    draw_reasons(f, reasons, state, theme);
    draw_denials(f, denials, state, vs, theme);
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
        row.push(Span::raw(format!(" {}", ms(total(*step) as f64 / 1e6))));
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
    let n = Style::default();
    let items = vec![
        ("hints", "hints", fmt_hints(&c.hints), theme.strong()),
        ("set by rule", "rule", c.hints_rule.map_or("-".into(), |r| rule_name(r).to_owned()), n),
        // Refusals are the Conductor holding back work that can wait: not alarms by
        // themselves (each reason says whether it is bad, in the box beside).
        ("denied (slots)", "denied", format!("{} ({})", count(c.denials), count(c.slot_denials)), n),
        ("granted / partial", "granted", format!("{} / {}", count(c.grants), count(c.partials)), n),
        ("reservations held", "held", format!("{} ({})", count(c.active_reservations), bytes(c.active_bytes)), n),
        ("slots granted", "slots", count(c.slot_grants), n),
        ("in flight", "in flight", format!("h2d {} d2h {}", c.h2d_inflight, c.d2h_inflight), n),
        ("hint changes", "changes", count(c.hint_changes), n),
        ("ceilings", "ceilings", count(c.ceilings), n),
    ];
    let lines = rows(items, area.width.saturating_sub(2) as usize, theme);
    f.render_widget(Paragraph::new(lines).block(boxed(" Hints and grants ", theme)), area);
}

fn draw_modes(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let mut lines = vec![Line::styled("by mode", theme.strong())];
    for (k, v) in &c.by_mode {
        lines.push(Line::raw(format!("{:>6} {k}", count(*v))));
    }
    lines.push(Line::styled("by priority", theme.strong()));
    for (k, v) in &c.by_priority {
        lines.push(Line::raw(format!("{:>6} {k}", count(*v))));
    }
    f.render_widget(Paragraph::new(lines).block(boxed(" Reservations ", theme)), area);
}

/// How a refusal's reason is coloured: by whether it is bad.
fn concern_style(r: DenyReason, theme: &Theme) -> Style {
    match r.concern() {
        Concern::ByDesign => theme.dim(),
        Concern::IfStallsFollow => theme.band(0.7),
    }
}

/// Every reason of the run's refusals: its count, whether it is bad, and what it means.
fn draw_reasons(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let found: Vec<(DenyReason, u64)> = DenyReason::ALL
        .iter()
        .filter_map(|r| c.denials_by_reason.get(r.as_str()).filter(|n| **n > 0).map(|n| (*r, *n)))
        .collect();
    // One line per reason with whether it is bad; then, where rows are left, what each means.
    let mut lines: Vec<Line<'_>> = found
        .iter()
        .map(|(r, n)| {
            // The count first: a long reason wraps, the number stays.
            Line::from(vec![
                Span::styled(format!("{} ", count(*n)), theme.strong()),
                Span::styled(r.as_str(), concern_style(*r, theme)),
                Span::styled(format!(": {}", r.concern().verdict()), theme.dim()),
            ])
        })
        .collect();
    let inner = area.width.saturating_sub(2).max(1) as usize;
    let rows = |ls: &[Line<'_>]| ls.iter().map(|l| l.width().div_ceil(inner).max(1)).sum::<usize>();
    let room = area.height.saturating_sub(2) as usize;
    for (r, _) in &found {
        let meaning = Line::styled(format!("{}: {}", r.as_str(), r.meaning()), theme.dim());
        if rows(&lines) + rows(std::slice::from_ref(&meaning)) > room {
            break;
        }
        lines.push(meaning);
    }
    if lines.is_empty() {
        lines.push(Line::styled("no denials", theme.dim()));
    }
    f.render_widget(
        Paragraph::new(lines).wrap(ratatui::widgets::Wrap { trim: false }).block(boxed(" Denials by reason ", theme)),
        area,
    );
}

/// Columns: (width, priority). At 80 columns the sequence number and the phase give way, so a
/// reason is never cut ("phase_rule_suppressed_speculative" is 33).
const COLS: [(u16, u8); 6] = [(7, 2), (5, 1), (10, 3), (12, 1), (22, 0), (33, 0)];

fn draw_denials(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let sort = vs.sorts.get(TableId::Denials);
    let visible = area.height.saturating_sub(3) as usize;
    let kept = fit_columns(&COLS, area.width.saturating_sub(2) as usize);
    let recent = state.snapshot.conductor.recent_denials.iter().collect();
    let rows: Vec<Row<'_>> = sort::sorted(recent, sort, sort::denial_key)
        .into_iter()
        .take(visible)
        .map(|d| {
            let cells = [
                Line::raw(d.seq.to_string()),
                Line::raw(d.step.to_string()),
                Line::raw(d.phase.as_str()),
                Line::raw(d.owner.as_str()),
                Line::raw(d.what.clone()),
                Line::styled(d.reason.as_str(), concern_style(d.reason, theme)),
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    let titles = ["seq", "step", "phase", "owner", "what", "reason"];
    let header: Vec<String> = kept
        .iter()
        .map(|i| sort_title(titles[*i], (sort.column == *i).then_some(sort.descending), theme))
        .collect();
    let table = Table::new(rows, constraints(&COLS, &kept))
        .header(Row::new(header).style(theme.strong()))
        .block(boxed(" Recent denials (s sort, S reverse) ", theme));
    f.render_widget(table, area);
}
