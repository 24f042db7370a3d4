//! What frames every view: the header (run, source, the tabs, and a status line for news about
//! the source: why a connection failed and when it is tried again, how far a file has loaded,
//! what a server sent that was refused), the footer (replay position and keys), the help overlay
//! and the details overlay.

use super::widgets::{progress, Fields};
use super::boxed;
use crate::app::{Detail, Link, LiveStatus, ReplayInfo, SourceStatus, State, View, ViewState};
use stagehand_events::describe::describe;
use crate::format;
use crate::keys::HELP;
use crate::theme::Theme;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Clear, Paragraph, Wrap};
use ratatui::Frame;

/// Lines the status line may wrap to.
const STATUS_LINES: usize = 3;

/// The stream URL as the header shows it: without the scheme, and without the default path.
fn short_url(url: &str) -> &str {
    let u = url.strip_prefix("http://").unwrap_or(url);
    u.strip_suffix("/api/stream").unwrap_or(u)
}

fn sep<'a>(theme: &Theme) -> Span<'a> {
    Span::styled(theme.sep(), theme.dim())
}

/// The status line(s) under the tabs: empty when there is no news.
pub(super) fn status_lines<'a>(state: &State, width: usize, theme: &Theme) -> Vec<Line<'a>> {
    let text: Option<(String, ratatui::style::Style)> = match &state.source {
        SourceStatus::Live(LiveStatus { link: Link::Disconnected { error, retry_in, attempt }, .. }) => Some((
            format!(
                "retrying in {:.1} s (attempt {}) {} disconnected: {error}",
                retry_in.as_secs_f64(),
                attempt.saturating_add(1),
                if theme.ascii { "-" } else { "·" },
            ),
            theme.alert(),
        )),
        SourceStatus::Live(LiveStatus { skipped, .. }) if skipped.total() > 0 => Some((
            format!(
                "refused {} messages from the server: {} over {} MiB, {} unreadable, {} with implausible ids",
                skipped.total(),
                skipped.oversize,
                crate::source::sse::MAX_MESSAGE >> 20,
                skipped.unreadable,
                skipped.implausible
            ),
            theme.alert(),
        )),
        SourceStatus::Replay(ReplayInfo { loading: Some(l), path, .. }) => {
            let frac = if l.total_bytes > 0 { l.bytes_read as f64 / l.total_bytes as f64 } else { 0.0 };
            let mut spans = vec![Span::styled(
                format!("loading {path} {} ", format::percent(l.bytes_read as f64, l.total_bytes as f64)),
                theme.accent(),
            )];
            let tail = format!(
                " {} of {}, {} events",
                format::bytes(l.bytes_read),
                format::bytes(l.total_bytes),
                format::count(l.events)
            );
            let cells = width.saturating_sub(spans[0].width() + tail.len()).min(30);
            spans.extend(progress(cells, frac, theme));
            spans.push(Span::raw(tail));
            return vec![Line::from(spans)];
        }
        _ => None,
    };
    let Some((text, style)) = text else { return Vec::new() };
    // Wrap by hand, at spaces, so the header knows its height; the countdown leads, so it is
    // never the part cut when the reason needs more than the lines there are.
    wrap(&text, width.max(1))
        .into_iter()
        .take(STATUS_LINES)
        .map(|l| Line::styled(l, style))
        .collect()
}

/// Words into lines of at most `width` characters; a word longer than a line is split.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut cur = String::new();
    for word in text.split(' ') {
        let mut word: Vec<char> = word.chars().collect();
        loop {
            let cur_len = cur.chars().count();
            let need = word.len() + usize::from(cur_len > 0);
            if cur_len + need <= width {
                if cur_len > 0 {
                    cur.push(' ');
                }
                cur.extend(word.iter());
                break;
            }
            if cur_len > 0 {
                lines.push(std::mem::take(&mut cur));
                continue;
            }
            // A word wider than a line: split it.
            let rest = word.split_off(width.min(word.len()));
            lines.push(word.iter().collect());
            word = rest;
            if word.is_empty() {
                break;
            }
        }
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

fn source_span<'a>(src: &SourceStatus, paused: bool, theme: &Theme) -> Span<'a> {
    let (on, off) = if theme.ascii { ("*", "x") } else { ("●", "✕") };
    let pause = if paused { " (paused)" } else { "" };
    match src {
        SourceStatus::Starting => Span::styled("starting", theme.dim()),
        SourceStatus::Live(l) => {
            let url = short_url(&l.url);
            match &l.link {
                Link::Connecting { attempt } => Span::styled(
                    format!("{on} connecting to {url} (attempt {attempt})"),
                    theme.band(0.7),
                ),
                Link::Connected => Span::styled(format!("{on} live {url}{pause}"), theme.band(0.0)),
                Link::Disconnected { .. } => Span::styled(format!("{off} disconnected {url}"), theme.alert()),
            }
        }
        SourceStatus::Replay(r) => Span::raw(format!("replay {}{pause}", r.path)),
    }
}

/// The tab labels: full titles if they all fit, else short ones packed closer beside the
/// current view's full title, else numbers beside it.
fn tabs<'a>(current: View, width: usize, theme: &Theme) -> Line<'a> {
    let active = |i: usize, v: View| Span::styled(format!(" {} {} ", i + 1, v.title()), theme.selected().patch(theme.accent()));
    let full: Vec<Span<'a>> = View::ALL
        .iter()
        .enumerate()
        .map(|(i, v)| if *v == current { active(i, *v) } else { Span::styled(format!(" {} {} ", i + 1, v.title()), theme.dim()) })
        .collect();
    if super::widgets::width(&full) <= width {
        return Line::from(full);
    }
    let packed = |label: &dyn Fn(usize, View) -> String| -> Vec<Span<'a>> {
        let mut spans = Vec::new();
        for (i, v) in View::ALL.iter().enumerate() {
            if *v == current {
                spans.push(active(i, *v));
            } else {
                spans.push(Span::styled(label(i, *v), theme.dim()));
                spans.push(Span::raw(" "));
            }
        }
        spans
    };
    let short = packed(&|i, v| format!("{} {}", i + 1, v.short_title()));
    if super::widgets::width(&short) <= width {
        return Line::from(short);
    }
    Line::from(packed(&|i, _| (i + 1).to_string()))
}

pub(super) fn draw_header(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, status: Vec<Line<'_>>, theme: &Theme) {
    let s = &state.snapshot;
    let w = area.width as usize;
    let mut top = Fields::new();
    top.push(2, vec![Span::styled("stagehand-top", theme.accent())]);
    let step = format!("step {} {}{}", s.step, s.phase, if s.ended { " (ended)" } else { "" });
    top.push(0, vec![Span::styled(step, theme.strong())]);
    match &state.source {
        // The file's name when the whole path does not fit.
        SourceStatus::Replay(r) => {
            let name = std::path::Path::new(&r.path).file_name().map_or(r.path.clone(), |n| n.to_string_lossy().into_owned());
            let pause = if state.paused { " (paused)" } else { "" };
            top.push_alt(0, vec![source_span(&state.source, state.paused, theme)], vec![Span::raw(format!("replay {name}{pause}"))]);
        }
        _ => {
            top.push(0, vec![source_span(&state.source, state.paused, theme)]);
        }
    }
    if s.dropped_events > 0 {
        top.push(1, vec![Span::styled(format!("dropped {}", format::count(s.dropped_events)), theme.alert())]);
    }
    if s.telemetry_lost > 0 {
        top.push(1, vec![Span::styled(format!("lost {}", format::count(s.telemetry_lost)), theme.alert())]);
    }
    if state.lagged > 0 {
        top.push(1, vec![Span::styled(format!("lagged {}", format::count(state.lagged)), theme.alert())]);
    }
    if let Some(run) = &s.run {
        top.push_alt(
            3,
            vec![Span::raw(format!("{} {} on {}", run.run_id, run.model, run.device.name))],
            vec![Span::raw(run.model.clone())],
        );
    }
    let mut lines = vec![top.line(w, sep(theme)), tabs(vs.view, w, theme)];
    lines.extend(status);
    f.render_widget(Paragraph::new(lines), area);
}

fn fmt_speed(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.3}").trim_end_matches('0').to_owned()
    }
}

pub(super) fn draw_footer(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let w = area.width as usize;
    let keys = || Span::styled("? help  q quit  Tab views  / filter  s sort  space pause", theme.dim());
    let mut first = Fields::new();
    if let SourceStatus::Replay(ReplayInfo { status, .. }) = &state.source {
        let play = match (status.paused, theme.ascii) {
            (true, false) => "⏸",
            (true, true) => "||",
            (false, false) => "▶",
            (false, true) => ">",
        };
        let frac = if status.total > 0 { status.position as f64 / status.total as f64 } else { 0.0 };
        first.push(0, vec![Span::styled(format!("{play} {}x", fmt_speed(status.speed)), theme.strong())]);
        first.push(0, vec![Span::raw(format!("{}/{}", status.position, status.total))]);
        first.push(2, progress(20, frac, theme));
        first.push(1, vec![Span::raw(format!("{} / {}", format::run_time(status.t_ns), format::run_time(status.end_t_ns)))]);
        if status.following {
            first.push(1, vec![Span::styled("following", theme.accent())]);
        }
        first.push(3, vec![Span::styled("<- -> event  [ ] step  < > seek  - + speed  Home End", theme.dim())]);
    } else {
        first.push_alt(2, vec![keys()], vec![Span::styled("? help  q quit", theme.dim())]);
        first.push(
            1,
            vec![Span::styled(
                format!("{} events, {} resyncs", format::count(state.snapshot.events_applied), state.resets),
                theme.dim(),
            )],
        );
    }
    let second = if let Some(input) = &vs.filter_input {
        let cursor = if theme.ascii { "_" } else { "█" };
        let mut l = Fields::new();
        l.push(0, vec![Span::styled("filter /", theme.accent()), Span::raw(input.clone()), Span::raw(cursor)]);
        l.push(1, vec![Span::styled("Enter apply  Esc cancel  kind:NAME block:N step:A-B", theme.dim())]);
        l.line(w, Span::raw("   "))
    } else {
        let mut l = Fields::new();
        if let SourceStatus::Replay(ReplayInfo { report, skipped, .. }) = &state.source {
            let style = if *skipped > 0 { theme.alert() } else { theme.dim() };
            // Narrow terminals keep what was skipped, which matters more than what was read.
            let narrow = report.split_once("; ").map_or(report.as_str(), |(_, rest)| rest);
            l.push_alt(0, vec![Span::styled(report.clone(), style)], vec![Span::styled(narrow.to_owned(), style)]);
            l.push_alt(2, vec![keys()], vec![Span::styled("? help  q quit", theme.dim())]);
        }
        if !vs.filter.is_empty() {
            l.push(0, vec![Span::styled(format!("filter: {}", vs.filter.text), theme.accent())]);
        }
        l.line(w, sep(theme))
    };
    f.render_widget(Paragraph::new(vec![first.line(w, sep(theme)), second]), area);
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

pub(super) fn draw_help(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let replay = state.source.is_replay();
    let mut lines = Vec::new();
    for (keys, what, replay_only) in HELP {
        let mut spans = vec![Span::styled(format!("{keys:<16}"), theme.strong()), Span::raw(*what)];
        if *replay_only && !replay {
            spans.push(Span::styled("  (replay only)", theme.dim()));
        }
        lines.push(Line::from(spans));
    }
    lines.push(Line::raw(""));
    lines.push(Line::styled(
        "2 Step time: where each step's time went, and what to change. 3 VRAM: who holds device memory.",
        theme.dim(),
    ));
    let r = centred(area, 100, lines.len() as u16 + 2);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(boxed(" Keys (Esc or ? to close) ", theme)),
        r,
    );
}

pub(super) fn draw_detail(f: &mut Frame<'_>, area: Rect, state: &State, d: &Detail, theme: &Theme) {
    let kv = |pairs: &[(&str, String)]| {
        let mut fl = Fields::new();
        for (k, v) in pairs {
            fl.kv(0, k, v.clone(), theme);
        }
        fl.line(usize::MAX, Span::raw("  "))
    };
    let (title, lines): (String, Vec<Line<'_>>) = match d {
        Detail::Block(id) => match state.snapshot.block(*id) {
            Some(b) => {
                let mut lines = vec![
                    kv(&[("name", b.name.clone()), ("id", b.id.to_string())]),
                    Line::from(vec![
                        Span::styled("state ", theme.dim()),
                        Span::styled(b.state.as_str(), theme.state(b.state)),
                        Span::styled("  refcount ", theme.dim()),
                        Span::raw(b.refcount.to_string()),
                    ]),
                    kv(&[
                        ("size", format::bytes(b.bytes)),
                        ("exec order", b.exec_order.to_string()),
                        ("loads", format::count(b.loads)),
                        ("evictions", format::count(b.evictions)),
                    ]),
                    kv(&[
                        ("trainable", b.trainable.to_string()),
                        ("file-backed", b.file_backed.to_string()),
                        ("protected", b.protected.to_string()),
                    ]),
                    kv(&[("last", format!("{} (seq {})", b.last, b.last_seq))]),
                    Line::raw(""),
                    Line::styled("recent events about this block:", theme.dim()),
                ];
                let about: Vec<_> = state.recent.iter().filter(|e| e.kind.block() == Some(*id)).collect();
                for e in about.iter().rev().take(12).rev() {
                    lines.push(Line::raw(format!(
                        "  #{:<6} step {:<3} {:<14} {}",
                        e.seq,
                        e.step,
                        e.kind.name(),
                        describe(&e.kind)
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
            None => (format!(" Event #{seq} "), vec![Line::raw("no longer in the recent-events log")]),
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

#[cfg(test)]
mod tests {
    use super::wrap;

    #[test]
    fn wraps_at_spaces_and_splits_only_words_wider_than_a_line() {
        assert_eq!(wrap("retry in 2.3 s: connection refused", 16), ["retry in 2.3 s:", "connection", "refused"]);
        assert_eq!(wrap("abcdefghij k", 4), ["abcd", "efgh", "ij k"]);
        assert_eq!(wrap("", 10), Vec::<String>::new());
    }
}
