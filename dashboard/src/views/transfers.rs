//! Transfers: H2D and D2H copies in flight, throughput against the measured bandwidth, and the
//! most recent copies.

use super::{bar, boxed, kv};
use crate::app::{fmt_bytes, fmt_t, State};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand::events::Direction;

/// The bandwidth a direction is measured against: `bandwidth.h2d_gbps` / `bandwidth.d2h_gbps`
/// in the run's configuration when the run measured it, else the fastest recent copy.
pub(crate) fn reference_gbps(state: &State, dir: Direction) -> (f64, &'static str) {
    let key = match dir {
        Direction::H2d => "/bandwidth/h2d_gbps",
        Direction::D2h => "/bandwidth/d2h_gbps",
    };
    if let Some(g) = state
        .snapshot
        .run
        .as_ref()
        .and_then(|r| r.config.pointer(key))
        .and_then(|v| v.as_f64())
    {
        return (g, "measured");
    }
    let peak = state
        .snapshot
        .transfers
        .recent
        .iter()
        .filter(|t| t.dir == dir && t.duration_ms > 0.0)
        .map(|t| t.bytes as f64 / (t.duration_ms * 1e6))
        .fold(0.0, f64::max);
    (peak, "peak seen")
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [dirs, recent] =
        Layout::vertical([Constraint::Length(7), Constraint::Min(3)]).areas(area);
    let [h, d] = Layout::horizontal([Constraint::Ratio(1, 2); 2]).areas(dirs);
    draw_dir(f, h, state, Direction::H2d, theme);
    draw_dir(f, d, state, Direction::D2h, theme);
    draw_recent(f, recent, state, theme);
}

fn draw_dir(f: &mut Frame<'_>, area: Rect, state: &State, dir: Direction, theme: &Theme) {
    let t = state.snapshot.transfers.dir(dir);
    let c = &state.snapshot.conductor;
    let (cap, slots) = match dir {
        Direction::H2d => (c.hints.max_inflight_h2d, c.h2d_inflight),
        Direction::D2h => (c.hints.max_inflight_d2h, c.d2h_inflight),
    };
    let (reference, what) = reference_gbps(state, dir);
    let bar_w = area.width.saturating_sub(22) as usize;
    let gauge = |label: &'static str, v: f64| {
        let frac = if reference > 0.0 { v / reference } else { 0.0 };
        let mut spans = vec![Span::styled(format!("{label:<6}"), theme.dim())];
        spans.extend(bar(bar_w, frac, &[], theme));
        spans.push(Span::raw(format!(" {v:>6.2} GB/s")));
        Line::from(spans)
    };
    let lines = vec![
        kv(
            &[
                ("in flight", t.inflight.to_string()),
                (
                    "slots",
                    format!("{slots} (cap {})", cap.map_or("-".into(), |c| c.to_string())),
                ),
                ("copies", t.count.to_string()),
                ("moved", fmt_bytes(t.bytes)),
            ],
            theme,
        ),
        gauge("mean", t.mean_gbps()),
        gauge("last", t.last_gbps),
        Line::styled(format!("against {reference:.2} GB/s ({what})"), theme.dim()),
    ];
    let title = match dir {
        Direction::H2d => " H2D (host to device) ",
        Direction::D2h => " D2H (device to host) ",
    };
    f.render_widget(Paragraph::new(lines).block(boxed(title, theme)), area);
}

fn draw_recent(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let recent = &state.snapshot.transfers.recent;
    let visible = area.height.saturating_sub(3) as usize;
    let rows: Vec<Row<'_>> = recent
        .iter()
        .rev()
        .take(visible)
        .map(|t| {
            let gbps = if t.duration_ms > 0.0 {
                t.bytes as f64 / (t.duration_ms * 1e6)
            } else {
                0.0
            };
            Row::new(vec![
                t.seq.to_string(),
                fmt_t(t.t_ns),
                t.dir.as_str().to_owned(),
                t.owner.as_str().to_owned(),
                t.id.to_string(),
                fmt_bytes(t.bytes),
                format!("{:.3}", t.duration_ms),
                format!("{gbps:.2}"),
            ])
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(7),
            Constraint::Length(10),
            Constraint::Length(4),
            Constraint::Length(12),
            Constraint::Length(6),
            Constraint::Length(11),
            Constraint::Length(8),
            Constraint::Length(8),
        ],
    )
    .header(
        Row::new(vec!["seq", "time", "dir", "owner", "id", "bytes", "ms", "GB/s"])
            .style(theme.strong()),
    )
    .block(boxed(format!(" Recent transfers (newest first, {} kept) ", recent.len()), theme));
    f.render_widget(table, area);
}
