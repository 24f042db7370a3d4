//! Transfers: H2D and D2H copies in flight, throughput against the measured bandwidth, and the
//! most recent copies.

use super::boxed;
use super::widgets::{bar, constraints, fit_columns, sort_title, Fields};
use crate::app::{State, ViewState};
use crate::format::{bytes, count, gbps, ms, run_time};
use crate::sort::{self, TableId};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand_events::Direction;

/// The bandwidth a direction is measured against: `bandwidth.h2d_gbps` / `bandwidth.d2h_gbps`
/// in the run's configuration when the run measured it, else the fastest recent copy.
pub(crate) fn reference_gbps(state: &State, dir: Direction) -> (f64, &'static str) {
    let key = match dir {
        Direction::H2d => "/bandwidth/h2d_gbps",
        Direction::D2h => "/bandwidth/d2h_gbps",
        Direction::Collective => "/bandwidth/collective_gbps",
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
        .filter(|t| t.dir == dir)
        .filter_map(|t| t.gbps())
        .fold(0.0, f64::max);
    (peak, "peak seen")
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let [dirs, recent] =
        Layout::vertical([Constraint::Length(7), Constraint::Min(3)]).areas(area);
    let [h, d] = Layout::horizontal([Constraint::Ratio(1, 2); 2]).areas(dirs);
    draw_dir(f, h, state, Direction::H2d, theme);
    draw_dir(f, d, state, Direction::D2h, theme);
    draw_recent(f, recent, state, vs, theme);
}

fn draw_dir(f: &mut Frame<'_>, area: Rect, state: &State, dir: Direction, theme: &Theme) {
    let t = state.snapshot.transfers.dir(dir);
    let c = &state.snapshot.conductor;
    let (cap, slots) = match dir {
        Direction::H2d => (c.hints.max_inflight_h2d, c.h2d_inflight),
        Direction::D2h => (c.hints.max_inflight_d2h, c.d2h_inflight),
        // Collectives take no transfer slot.
        Direction::Collective => (None, 0),
    };
    let (reference, what) = reference_gbps(state, dir);
    let w = area.width.saturating_sub(2) as usize;
    let bar_w = w.saturating_sub(17);
    let gauge = |label: &'static str, v: f64| {
        let frac = if reference > 0.0 { v / reference } else { 0.0 };
        let mut spans = vec![Span::styled(format!("{label:<5}"), theme.dim())];
        spans.extend(bar(bar_w, frac, &[], theme));
        spans.push(Span::raw(format!(" {:>10}", gbps(v))));
        Line::from(spans)
    };
    let mut head = Fields::new();
    head.kv(0, "in flight", count(u64::from(t.inflight)), theme)
        .kv(1, "slots", format!("{} (cap {})", slots, cap.map_or("-".into(), |c| c.to_string())), theme)
        .kv(0, "copies", count(t.count), theme)
        .kv(0, "moved", bytes(t.bytes), theme);
    let lines = vec![
        head.line(w, Span::raw("  ")),
        gauge("mean", t.mean_gbps()),
        gauge("last", t.last_gbps),
        Line::styled(format!("against {} ({what})", gbps(reference)), theme.dim()),
    ];
    // On the host device a copy is a memcpy in host memory: its rates say nothing about PCIe.
    let simulated = state.snapshot.run.as_ref().is_some_and(|r| r.device.host_simulated());
    let title = match (dir, simulated) {
        (Direction::H2d, false) => " H2D (host to device) ",
        (Direction::D2h, false) => " D2H (device to host) ",
        (Direction::H2d, true) => " H2D (simulated: host memory copies) ",
        (Direction::D2h, true) => " D2H (simulated: host memory copies) ",
        (Direction::Collective, false) => " collectives (between the GPUs) ",
        (Direction::Collective, true) => " collectives (simulated: host memory sums) ",
    };
    f.render_widget(Paragraph::new(lines).block(boxed(title, theme)), area);
}

/// Columns: (width, priority).
const COLS: [(u16, u8); 8] = [(7, 1), (9, 2), (4, 0), (11, 1), (6, 3), (9, 0), (8, 0), (10, 1)];

fn draw_recent(f: &mut Frame<'_>, area: Rect, state: &State, vs: &ViewState, theme: &Theme) {
    let recent = &state.snapshot.transfers.recent;
    let sort = vs.sorts.get(TableId::Transfers);
    let visible = area.height.saturating_sub(3) as usize;
    let kept = fit_columns(&COLS, area.width.saturating_sub(2) as usize);
    let rows: Vec<Row<'_>> = sort::sorted(recent.iter().collect(), sort, sort::transfer_key)
        .into_iter()
        .take(visible)
        .map(|t| {
            // A copy that was not timed shows "-" for its time and rate.
            let rate = t.gbps().unwrap_or(f64::NAN);
            let cells = [
                t.seq.to_string(),
                run_time(t.t_ns),
                t.dir.as_str().to_owned(),
                t.owner.as_str().to_owned(),
                t.id.to_string(),
                bytes(t.bytes),
                ms(t.duration_ms.unwrap_or(f64::NAN)),
                gbps(rate),
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    // Table columns of the sort's columns (seq, dir, owner, bytes, time, GB/s).
    let sort_col = [0usize, 2, 3, 5, 6, 7];
    let titles = ["seq", "at", "dir", "owner", "id", "bytes", "time", "rate"];
    let header: Vec<String> = kept
        .iter()
        .map(|i| sort_title(titles[*i], (sort_col.get(sort.column) == Some(i)).then_some(sort.descending), theme))
        .collect();
    let table = Table::new(rows, constraints(&COLS, &kept))
        .header(Row::new(header).style(theme.strong()))
        .block(boxed(format!(" Recent transfers ({} kept; s sort, S reverse) ", recent.len()), theme));
    f.render_widget(table, area);
}
