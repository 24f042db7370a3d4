//! Pools: the weight pool's slabs (free, staging, in use) and the activation pool's size
//! classes (slabs used, hits, misses, pageable fallbacks).

use super::{bad_if, bar, boxed, kv};
use crate::app::{fmt_bytes, State};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand::events::BlockState;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [w, a] = Layout::vertical([Constraint::Length(8), Constraint::Min(4)]).areas(area);
    draw_weight_pool(f, w, state, theme);
    draw_activation_pool(f, a, state, theme);
}

fn draw_weight_pool(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let block = boxed(" Weight pool ", theme);
    let Some(p) = &s.weight_pool else {
        f.render_widget(
            Paragraph::new(Line::styled("not configured (yet)", theme.dim())).block(block),
            area,
        );
        return;
    };
    let (slabs, slab_bytes, in_use, peak, acquires, exhausted) = p
        .classes
        .first()
        .map_or((0, 0, 0, 0, 0, 0), |c| (c.slabs, c.slab_bytes, c.in_use, c.peak_in_use, c.hits, c.exhausted));
    // Slabs being staged: those of blocks staged on the host or being copied up.
    let staging = s
        .blocks
        .iter()
        .filter(|b| matches!(b.state, BlockState::HostStaged | BlockState::Prefetching))
        .count()
        .min(in_use as usize) as u32;
    let held = in_use - staging;
    let free = slabs.saturating_sub(in_use);
    let (full, empty) = theme.bar_cells();
    let stage_glyph = if theme.ascii { "s" } else { "▒" };
    let mut cells = vec![Span::styled("slabs ", theme.dim())];
    for i in 0..slabs {
        let (g, style) = if i < staging {
            (stage_glyph, theme.state(BlockState::Prefetching))
        } else if i < in_use {
            (full, theme.band(in_use as f64 / slabs.max(1) as f64))
        } else {
            (empty, theme.dim())
        };
        cells.push(Span::styled(format!("{g}{g} "), style));
    }
    let lines = vec![
        kv(
            &[
                ("slabs", format!("{slabs} x {}", fmt_bytes(slab_bytes))),
                ("capacity", fmt_bytes(p.capacity_bytes())),
                ("pinned", p.pinned.to_string()),
            ],
            theme,
        ),
        Line::from(cells),
        kv(
            &[
                ("free", free.to_string()),
                ("staging", staging.to_string()),
                ("in use", held.to_string()),
                ("peak in use", peak.to_string()),
            ],
            theme,
        ),
        Line::from(vec![
            Span::styled("acquired ", theme.dim()),
            Span::raw(acquires.to_string()),
            Span::styled("  exhausted ", theme.dim()),
            Span::styled(exhausted.to_string(), bad_if(exhausted, theme)),
            Span::styled("  waited ", theme.dim()),
            Span::raw(format!("{:.2} ms", p.total_wait_ms)),
            Span::styled("  pageable fallbacks ", theme.dim()),
            Span::styled(p.pageable_fallbacks.to_string(), bad_if(p.pageable_fallbacks, theme)),
        ]),
        Line::styled(
            format!("legend: {stage_glyph} staging  {full} in use  {empty} free"),
            theme.dim(),
        ),
    ];
    f.render_widget(Paragraph::new(lines).block(block), area);
}

fn draw_activation_pool(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let Some(p) = &s.activation_pool else {
        f.render_widget(
            Paragraph::new(Line::styled("not configured (yet)", theme.dim()))
                .block(boxed(" Activation pool ", theme)),
            area,
        );
        return;
    };
    let bar_w = 24;
    let mut rows: Vec<Row<'_>> = p
        .classes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let frac = c.in_use as f64 / c.slabs.max(1) as f64;
            Row::new(vec![
                Line::raw(i.to_string()),
                Line::raw(fmt_bytes(c.slab_bytes)),
                Line::from(bar(bar_w, frac, &[], theme)),
                Line::styled(format!("{}/{}", c.in_use, c.slabs), theme.band(frac)),
                Line::raw(c.peak_in_use.to_string()),
                Line::raw(c.hits.to_string()),
                Line::styled(c.exhausted.to_string(), bad_if(c.exhausted, theme)),
            ])
        })
        .collect();
    rows.push(Row::new(vec![
        Line::raw(""),
        Line::styled("pageable", theme.dim()),
        Line::styled(
            format!("{} fallbacks, {}", p.pageable_fallbacks, fmt_bytes(p.pageable_bytes)),
            bad_if(p.pageable_fallbacks, theme),
        ),
    ]));
    let a = &s.activations;
    let title = format!(
        " Activation pool ({}, {}; spill hits {} misses {}) ",
        fmt_bytes(p.capacity_bytes()),
        if p.pinned { "pinned" } else { "pageable" },
        a.pool_hits,
        a.pool_misses
    );
    let table = Table::new(
        rows,
        [
            Constraint::Length(5),
            Constraint::Length(10),
            Constraint::Length(bar_w as u16 + 1),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(8),
            Constraint::Length(8),
        ],
    )
    .header(
        Row::new(vec!["class", "slab", "used", "used", "peak", "hits", "misses"])
            .style(theme.strong()),
    )
    .block(boxed(title, theme));
    f.render_widget(table, area);
}
