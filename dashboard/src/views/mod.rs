//! Pure render functions: each view draws from `&State`, `&ViewState` and the theme, nothing
//! else, so a replay and a live run draw identically and tests can draw into a `TestBackend`.

mod activations;
mod conductor;
mod events;
mod overview;
mod pools;
mod residency;
mod transfers;

use crate::app::{fmt_bytes, fmt_t, Detail, SourceStatus, State, View, ViewState};
use crate::keys::HELP;
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

/// Draws the whole screen: header, the current view, footer, and any overlay.
pub fn draw(f: &mut Frame<'_>, state: &State, vs: &ViewState, theme: &Theme) {
    let [header, body, footer] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(3),
        Constraint::Length(2),
    ])
    .areas(f.area());
    draw_header(f, header, state, vs, theme);
    match vs.view {
        View::Overview => overview::draw(f, body, state, theme),
        View::Residency => residency::draw(f, body, state, vs, theme),
        View::Pools => pools::draw(f, body, state, theme),
        View::Transfers => transfers::draw(f, body, state, theme),
        View::Activations => activations::draw(f, body, state, theme),
        View::Conductor => conductor::draw(f, body, state, theme),
        View::Events => events::draw(f, body, state, vs, theme),
    }
    draw_footer(f, footer, state, vs, theme);
    if let Some(d) = &vs.detail {
        draw_detail(f, body, state, d, theme);
    }
    if vs.help {
        draw_help(f, body, state, theme);
    }
}

/// A bordered block in the theme's border set.
pub(crate) fn boxed<'a>(title: impl Into<Line<'a>>, theme: &Theme) -> Block<'a> {
    Block::bordered()
        .border_set(theme.border())
        .border_style(theme.dim())
        .title(title.into().style(theme.accent()))
}

/// A horizontal bar `width` cells wide, filled to `fraction` in its usage band, with marks
/// (fraction, label) drawn over it (the watermarks).
pub(crate) fn bar<'a>(
    width: usize,
    fraction: f64,
    marks: &[(f64, &'a str)],
    theme: &Theme,
) -> Vec<Span<'a>> {
    let (full, empty) = theme.bar_cells();
    let filled = ((fraction.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    let mut cells: Vec<Span<'a>> = (0..width)
        .map(|i| {
            if i < filled {
                Span::styled(full, theme.band(fraction))
            } else {
                Span::styled(empty, theme.dim())
            }
        })
        .collect();
    for (at, label) in marks {
        if width == 0 || !at.is_finite() {
            continue;
        }
        let i = ((at.clamp(0.0, 1.0) * width as f64) as usize).min(width - 1);
        cells[i] = Span::styled(*label, theme.strong());
    }
    cells
}

/// A sparkline of the last `width` values, scaled to `max` (or their own maximum when 0).
pub(crate) fn spark(values: &[f64], max: f64, width: usize, theme: &Theme) -> String {
    let levels = theme.spark_levels();
    let tail = &values[values.len().saturating_sub(width)..];
    let max = if max > 0.0 {
        max
    } else {
        tail.iter().copied().fold(0.0, f64::max)
    };
    tail.iter()
        .map(|v| {
            if max <= 0.0 {
                levels[0]
            } else {
                let l = ((v / max).clamp(0.0, 1.0) * 8.0).round() as usize;
                levels[l.max(usize::from(*v > 0.0))]
            }
        })
        .collect()
}

/// "label value" pairs, label dimmed.
pub(crate) fn kv<'a>(pairs: &[(&'a str, String)], theme: &Theme) -> Line<'a> {
    let mut spans = Vec::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            spans.push(Span::raw("  "));
        }
        spans.push(Span::styled(format!("{k} "), theme.dim()));
        spans.push(Span::raw(v.clone()));
    }
    Line::from(spans)
}

/// A percentage, or "-" of nothing.
pub(crate) fn pct(part: f64, whole: f64) -> String {
    if whole > 0.0 {
        format!("{:.1}%", 100.0 * part / whole)
    } else {
        "-".to_owned()
    }
}

fn draw_header(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let s = &state.snapshot;
    let sep = || Span::styled(theme.sep(), theme.dim());
    let mut top = vec![Span::styled("stagehand-top", theme.accent())];
    top.push(sep());
    top.push(Span::styled(format!("step {} {}", s.step, s.phase), theme.strong()));
    if s.ended {
        top.push(Span::raw(" (ended)"));
    }
    if s.dropped_events > 0 {
        top.push(sep());
        top.push(Span::styled(format!("dropped {}", s.dropped_events), theme.alert()));
    }
    if state.lagged > 0 {
        top.push(sep());
        top.push(Span::styled(format!("lagged {}", state.lagged), theme.alert()));
    }
    top.push(sep());
    top.push(source_span(&state.source, state.paused, theme));
    let mut tabs = Vec::new();
    for (i, v) in View::ALL.iter().enumerate() {
        let label = format!(" {} {} ", i + 1, v.title());
        if *v == vs.view {
            tabs.push(Span::styled(label, theme.selected().patch(theme.accent())));
        } else {
            tabs.push(Span::styled(label, theme.dim()));
        }
    }
    if let Some(run) = &s.run {
        tabs.push(Span::styled(theme.sep(), theme.dim()));
        tabs.push(Span::raw(format!("{} {} on {}", run.run_id, run.model, run.device.name)));
    }
    f.render_widget(Paragraph::new(vec![Line::from(top), Line::from(tabs)]), area);
}

fn source_span<'a>(src: &SourceStatus, paused: bool, theme: &Theme) -> Span<'a> {
    let dot = if theme.ascii { "*" } else { "●" };
    let pause = if paused { " (paused)" } else { "" };
    match src {
        SourceStatus::Starting => Span::styled("starting", theme.dim()),
        SourceStatus::Connecting { url, attempt } => Span::styled(
            format!("{dot} connecting to {url} (attempt {attempt})"),
            theme.band(0.7),
        ),
        SourceStatus::Connected { url } => {
            Span::styled(format!("{dot} live {url}{pause}"), theme.band(0.0))
        }
        SourceStatus::Disconnected { url, error, retry_in, attempt } => Span::styled(
            format!(
                "{dot} disconnected from {url}: {error}; retry in {:.1} s (attempt {attempt})",
                retry_in.as_secs_f64()
            ),
            theme.alert(),
        ),
        SourceStatus::Replay { path, .. } => Span::raw(format!("replay {path}{pause}")),
    }
}

fn draw_footer(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let keys = Span::styled("? help  q quit  Tab views  / filter  space pause", theme.dim());
    let first = if let SourceStatus::Replay { status, .. } = &state.source {
        let play = match (status.paused, theme.ascii) {
            (true, false) => "⏸",
            (true, true) => "||",
            (false, false) => "▶",
            (false, true) => ">",
        };
        let frac = if status.total > 0 {
            status.position as f64 / status.total as f64
        } else {
            0.0
        };
        let mut spans = vec![
            Span::styled(format!("{play} {}x ", fmt_speed(status.speed)), theme.strong()),
            Span::raw(format!("{}/{} ", status.position, status.total)),
        ];
        let (full, empty) = theme.bar_cells();
        let w = 20usize;
        let n = ((frac * w as f64).round() as usize).min(w);
        spans.push(Span::styled(full.repeat(n), theme.accent()));
        spans.push(Span::styled(empty.repeat(w - n), theme.dim()));
        spans.push(Span::raw(format!(
            " {} / {}",
            fmt_t(status.t_ns),
            fmt_t(status.end_t_ns)
        )));
        if status.following {
            spans.push(Span::styled(" following", theme.accent()));
        }
        spans.push(Span::styled(theme.sep(), theme.dim()));
        spans.push(Span::styled(
            "<- -> event  [ ] step  < > seek  - + speed  Home End",
            theme.dim(),
        ));
        Line::from(spans)
    } else {
        Line::from(vec![
            keys.clone(),
            Span::styled(theme.sep(), theme.dim()),
            Span::styled(
                format!("{} events, {} resyncs", state.snapshot.events_applied, state.resets),
                theme.dim(),
            ),
        ])
    };
    let second = if let Some(input) = &vs.filter_input {
        let cursor = if theme.ascii { "_" } else { "█" };
        Line::from(vec![
            Span::styled("filter /", theme.accent()),
            Span::raw(input.clone()),
            Span::raw(cursor),
            Span::styled("   Enter apply  Esc cancel  kind:NAME block:N step:A-B", theme.dim()),
        ])
    } else {
        let mut spans = Vec::new();
        if let SourceStatus::Replay { report, skipped, .. } = &state.source {
            let style = if *skipped > 0 { theme.alert() } else { theme.dim() };
            spans.push(Span::styled(report.clone(), style));
            spans.push(Span::styled(theme.sep(), theme.dim()));
            spans.push(keys);
        }
        if !vs.filter.is_empty() {
            if !spans.is_empty() {
                spans.push(Span::styled(theme.sep(), theme.dim()));
            }
            spans.push(Span::styled(format!("filter: {}", vs.filter.text), theme.accent()));
        }
        Line::from(spans)
    };
    f.render_widget(Paragraph::new(vec![first, second]), area);
}

fn fmt_speed(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.3}").trim_end_matches('0').to_owned()
    }
}

/// A centred rectangle of at most `w` x `h` inside `area`.
fn centred(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    }
}

fn draw_help(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let replay = state.source.is_replay();
    let mut lines = Vec::new();
    for (keys, what, replay_only) in HELP {
        let mut spans = vec![
            Span::styled(format!("{keys:<18}"), theme.strong()),
            Span::raw(*what),
        ];
        if *replay_only {
            spans.push(Span::styled(
                if replay { "  (replay)" } else { "  (replay only)" },
                theme.dim(),
            ));
        }
        lines.push(Line::from(spans));
    }
    lines.push(Line::raw(""));
    lines.push(Line::styled(
        "Residency colours: unloaded host_staged prefetching gpu_ready evicting gpu_freeing",
        theme.dim(),
    ));
    let r = centred(area, 96, lines.len() as u16 + 2);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(boxed(" Keys (Esc or ? to close) ", theme)),
        r,
    );
}

fn draw_detail(f: &mut Frame<'_>, area: Rect, state: &State, d: &Detail, theme: &Theme) {
    let (title, lines): (String, Vec<Line<'_>>) = match d {
        Detail::Block(id) => match state.snapshot.block(*id) {
            Some(b) => {
                let mut lines = vec![
                    kv(&[("name", b.name.clone()), ("id", b.id.to_string())], theme),
                    Line::from(vec![
                        Span::styled("state ", theme.dim()),
                        Span::styled(b.state.as_str(), theme.state(b.state)),
                        Span::styled("  refcount ", theme.dim()),
                        Span::raw(b.refcount.to_string()),
                    ]),
                    kv(
                        &[
                            ("size", fmt_bytes(b.bytes)),
                            ("exec order", b.exec_order.to_string()),
                            ("loads", b.loads.to_string()),
                            ("evictions", b.evictions.to_string()),
                        ],
                        theme,
                    ),
                    kv(
                        &[
                            ("trainable", b.trainable.to_string()),
                            ("file-backed", b.file_backed.to_string()),
                            ("protected", b.protected.to_string()),
                        ],
                        theme,
                    ),
                    kv(&[("last", format!("{} (seq {})", b.last, b.last_seq))], theme),
                    Line::raw(""),
                    Line::styled("recent events about this block:", theme.dim()),
                ];
                let about: Vec<_> = state
                    .recent
                    .iter()
                    .filter(|e| e.kind.block() == Some(*id))
                    .collect();
                for e in about.iter().rev().take(12).rev() {
                    lines.push(Line::raw(format!(
                        "  #{:<6} step {:<3} {:<14} {}",
                        e.seq,
                        e.step,
                        e.kind.name(),
                        crate::app::describe(&e.kind)
                    )));
                }
                (format!(" Block {} ", b.name), lines)
            }
            None => (" Block ".into(), vec![Line::raw("no such block")]),
        },
        Detail::Event(seq) => match state.recent.iter().find(|e| e.seq == *seq) {
            Some(e) => {
                let json = serde_json::to_string_pretty(e).unwrap_or_else(|e| e.to_string());
                (
                    format!(" Event #{seq} {} ", e.kind.name()),
                    json.lines().map(|l| Line::raw(l.to_owned())).collect(),
                )
            }
            None => (
                format!(" Event #{seq} "),
                vec![Line::raw("no longer in the recent-events log")],
            ),
        },
    };
    let r = centred(area, 100, (lines.len() as u16 + 2).max(5));
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(boxed(title, theme).title_bottom(Line::styled(" Esc back ", theme.dim()))),
        r,
    );
}

/// A style for a count that should be zero.
pub(crate) fn bad_if(n: u64, theme: &Theme) -> Style {
    if n > 0 {
        theme.alert()
    } else {
        Style::default()
    }
}
