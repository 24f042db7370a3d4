//! Pools: the weight pool's slabs (free, staging, in use) and the activation pool's size
//! classes (slabs used, hits, misses, pageable fallbacks).

use super::widgets::{bar, Fields};
use super::{bad_if, boxed};
use crate::app::State;
use crate::format::{bytes as fmt_bytes, count, ms};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use ratatui::Frame;
use stagehand_events::BlockState;

/// Bytes a pool holds, saturating (the figures come from the run, or a server: never overflow).
fn capacity(p: &stagehand_events::snapshot::PoolView) -> u64 {
    p.classes.iter().map(|c| c.slab_bytes.saturating_mul(u64::from(c.slabs))).fold(0, u64::saturating_add)
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [w, a] = Layout::vertical([Constraint::Length(8), Constraint::Min(4)]).areas(area);
    draw_weight_pool(f, w, state, theme);
    draw_activation_pool(f, a, state, theme);
}

fn draw_weight_pool(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let block = boxed(" Weight pool ", theme);
    let w = area.width.saturating_sub(2) as usize;
    let Some(p) = &s.weight_pool else {
        // Blocks in host memory load straight from their pinned copies: no pool to show.
        let text = stagehand_events::insight::weights_without_pool(s).unwrap_or_else(|| "no weight blocks (yet)".into());
        f.render_widget(
            Paragraph::new(Line::styled(text, theme.dim())).wrap(ratatui::widgets::Wrap { trim: false }).block(block),
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
    let held = in_use.saturating_sub(staging);
    let free = slabs.saturating_sub(in_use);
    let (full, empty) = theme.bar_cells();
    let stage_glyph = if theme.ascii { "s" } else { "▒" };
    let mut cells = vec![Span::styled("slabs ", theme.dim())];
    // Three cells a slab, as many as fit (the slab count comes from the run: never allocate
    // by it); the rest are summed up after.
    let room = (area.width.saturating_sub(16) / 3) as u32;
    let drawn = slabs.min(room);
    for i in 0..drawn {
        let (g, style) = if i < staging {
            (stage_glyph, theme.state(BlockState::Prefetching))
        } else if i < in_use {
            (full, theme.band(in_use as f64 / slabs.max(1) as f64))
        } else {
            (empty, theme.dim())
        };
        cells.push(Span::styled(format!("{g}{g} "), style));
    }
    if drawn < slabs {
        cells.push(Span::styled(format!("+{}", count(u64::from(slabs - drawn))), theme.dim()));
    }
    let lines = vec![
        {
            let mut l = Fields::new();
            l.kv(0, "slabs", format!("{} x {}", count(u64::from(slabs)), fmt_bytes(slab_bytes)), theme)
                .kv(0, "capacity", fmt_bytes(capacity(p)), theme)
                .kv(1, "pinned", p.pinned.to_string(), theme);
            l.line(w, Span::raw("  "))
        },
        Line::from(cells),
        {
            let mut l = Fields::new();
            l.kv(0, "free", count(u64::from(free)), theme)
                .kv(0, "staging", count(u64::from(staging)), theme)
                .kv(0, "in use", count(u64::from(held)), theme)
                .kv(1, "peak in use", count(u64::from(peak)), theme);
            l.line(w, Span::raw("  "))
        },
        {
            let mut l = Fields::new();
            l.kv(1, "acquired", count(acquires), theme)
                .kv_styled(0, "exhausted", count(exhausted), bad_if(exhausted, theme), theme)
                .kv(2, "waited", ms(p.total_wait_ms), theme)
                .kv_styled(0, "pageable fallbacks", count(p.pageable_fallbacks), bad_if(p.pageable_fallbacks, theme), theme);
            l.line(w, Span::raw("  "))
        },
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
    let bar_w = (area.width.saturating_sub(50) as usize).clamp(4, 24);
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
                Line::styled(format!("{}/{}", count(u64::from(c.in_use)), count(u64::from(c.slabs))), theme.band(frac)),
                Line::raw(count(u64::from(c.peak_in_use))),
                Line::raw(count(c.hits)),
                Line::styled(count(c.exhausted), bad_if(c.exhausted, theme)),
            ])
        })
        .collect();
    rows.push(Row::new(vec![
        Line::raw(""),
        Line::styled("pageable", theme.dim()),
        Line::styled(
            format!("{} fallbacks, {}", count(p.pageable_fallbacks), fmt_bytes(p.pageable_bytes)),
            bad_if(p.pageable_fallbacks, theme),
        ),
    ]));
    let a = &s.activations;
    let title = format!(
        " Activation pool ({}, {}; spill hits {} misses {}) ",
        fmt_bytes(capacity(p)),
        if p.pinned { "pinned" } else { "pageable" },
        count(a.counts.pool_hits),
        count(a.counts.pool_misses)
    );
    let table = Table::new(
        rows,
        [
            Constraint::Length(5),
            Constraint::Length(10),
            Constraint::Length(bar_w as u16 + 1),
            Constraint::Length(11),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(7),
        ],
    )
    .header(
        Row::new(vec!["class", "slab", "used", "used", "peak", "hits", "misses"])
            .style(theme.strong()),
    )
    .block(boxed(title, theme));
    f.render_widget(table, area);
}
