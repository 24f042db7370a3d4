//! A data-parallel run's GPUs, one row per device (its lane): its step and phase, its last
//! step's time with the collectives' share, what it reduced, how many of the blocks its host
//! optimizer stepped it was given while backward ran ("in bwd", of those stepped), and its
//! memory against its budget. Shown on the overview when the run has more than one device; the other views
//! follow the first GPU.

use super::boxed;
use super::widgets::{constraints, fit_columns};
use crate::app::State;
use crate::format::{bytes, ms};
use crate::theme::Theme;
use ratatui::layout::Rect;
use ratatui::widgets::{Row, Table};
use ratatui::Frame;

/// Columns: (width, priority); the least important give way on narrow terminals.
const COLS: [(u16, u8); 10] = [(6, 0), (6, 0), (10, 1), (9, 0), (9, 1), (9, 2), (9, 0), (10, 2), (7, 2), (19, 1)];
const TITLES: [&str; 10] = ["GPU", "step", "phase", "step time", "compute", "H2D wait", "collect.", "reduced", "in bwd", "memory / budget"];

/// Rows the box takes (0 without lanes): the border, the header, a row per GPU.
pub(super) fn height(state: &State) -> u16 {
    let n = state.snapshot.lanes.len();
    if n == 0 {
        0
    } else {
        (n as u16).saturating_add(3)
    }
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let kept = fit_columns(&COLS, area.width.saturating_sub(2) as usize);
    let rows: Vec<Row<'_>> = s
        .lanes
        .values()
        .map(|l| {
            let t = l.last_time.as_ref();
            let w = l.last_weights.as_ref();
            let or_dash = |v: Option<f64>| v.map_or("-".to_owned(), ms);
            let mem = match (l.vram, l.budget_bytes) {
                (Some(v), Some(b)) => format!("{} / {}", bytes(v.peak_allocated_bytes), bytes(b)),
                (Some(v), None) => bytes(v.peak_allocated_bytes),
                _ => "-".to_owned(),
            };
            let cells = [
                format!("GPU {}", l.device),
                l.step.to_string(),
                l.phase.as_str().to_owned(),
                or_dash(t.map(|t| t.step_ms)),
                or_dash(t.map(|t| t.compute_ms)),
                or_dash(t.map(|t| t.h2d_wait_ms)),
                or_dash(w.map(|w| w.collective_ms)),
                bytes(w.map_or(0, |w| w.collective_bytes)),
                w.filter(|w| w.host_steps > 0).map_or("-".to_owned(), |w| format!("{}/{}", w.host_steps_during_backward(), w.host_steps)),
                mem,
            ];
            Row::new(kept.iter().map(|i| cells[*i].clone()).collect::<Vec<_>>())
        })
        .collect();
    let header: Vec<&str> = kept.iter().map(|i| TITLES[*i]).collect();
    let first = s.first_device.unwrap_or(0);
    let table = Table::new(rows, constraints(&COLS, &kept))
        .header(Row::new(header).style(theme.strong()))
        .block(boxed(format!(" GPUs: the last step of each (the other views follow GPU {first}) "), theme));
    f.render_widget(table, area);
}
