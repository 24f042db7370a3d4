//! The findings ([`insight::findings`]): what is off in the run, in a sentence each, and the
//! knob that fixes it. Drawn in full on the Step time view and as a summary on the Overview.

use super::boxed;
use crate::theme::Theme;
use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Wrap};
use ratatui::Frame;
use stagehand_events::insight::{self, Finding, Severity};
use stagehand_events::Snapshot;

fn mark(s: Severity, theme: &Theme) -> (&'static str, Style) {
    match s {
        Severity::Error => ("!!", theme.alert()),
        Severity::Warn => ("! ", theme.band(0.7)),
        Severity::Info => ("i ", theme.dim()),
    }
}

/// Lines of one finding: the mark and the sentence, then the knob.
fn lines<'a>(f: &Finding, with_knob: bool, theme: &Theme) -> Vec<Line<'a>> {
    let (m, style) = mark(f.severity, theme);
    let mut out = vec![Line::from(vec![Span::styled(format!("{m} "), style), Span::raw(f.message.clone())])];
    if with_knob && !f.knob.is_empty() {
        let arrow = if theme.ascii { "->" } else { "→" };
        out.push(Line::from(vec![
            Span::styled(format!("   {arrow} change "), theme.dim()),
            Span::styled(f.knob.clone(), theme.accent()),
        ]));
    }
    out
}

/// Rows a wrapped line takes at `width`.
fn rows(l: &Line<'_>, width: usize) -> usize {
    l.width().div_ceil(width.max(1)).max(1)
}

/// Every finding with its knob, most severe first.
pub(super) fn draw_all(f: &mut Frame<'_>, area: Rect, s: &Snapshot, theme: &Theme) {
    let found = insight::findings(s);
    let title = format!(" Findings ({}) ", found.len());
    let mut ls: Vec<Line<'_>> = found.iter().flat_map(|x| lines(x, true, theme)).collect();
    if ls.is_empty() {
        ls.push(Line::styled(insight::nothing_found(s), theme.dim()));
    }
    f.render_widget(Paragraph::new(ls).wrap(Wrap { trim: false }).block(boxed(title, theme)), area);
}

/// The rows [`draw_all`] wants at `width`: every finding and its knob, wrapped.
pub(super) fn all_rows(s: &Snapshot, width: usize) -> u16 {
    let inner = width.saturating_sub(2);
    let body: usize = insight::findings(s)
        .iter()
        .flat_map(|f| lines(f, true, &Theme::default()))
        .map(|l| rows(&l, inner))
        .sum();
    (body.max(1) + 2) as u16
}

/// The rows [`draw_summary`] wants at `width`: the most severe finding and the count.
pub(super) fn summary_rows(s: &Snapshot, width: usize) -> u16 {
    let found = insight::findings(s);
    let inner = width.saturating_sub(2);
    let body = found
        .first()
        .map_or(1, |f| lines(f, true, &Theme::default()).iter().map(|l| rows(l, inner)).sum());
    (body.min(4) + 2) as u16
}

/// The most severe finding with its knob, and how many more there are.
pub(super) fn draw_summary(f: &mut Frame<'_>, area: Rect, s: &Snapshot, theme: &Theme) {
    let found = insight::findings(s);
    let title = match found.len() {
        0 => " Findings ".to_owned(),
        1 => " Findings: 1 (2 Step time) ".to_owned(),
        n => format!(" Findings: {n}, most severe first (all in 2 Step time) "),
    };
    let ls = match found.first() {
        Some(x) => lines(x, true, theme),
        None => vec![Line::styled(insight::nothing_found(s), theme.dim())],
    };
    f.render_widget(Paragraph::new(ls).wrap(Wrap { trim: false }).block(boxed(title, theme)), area);
}
