//! Overview: VRAM against the watermarks and the budget, the step, and each runtime's headline
//! counters.

use super::{bad_if, bar, boxed, kv, pct, spark};
use crate::app::{fmt_bytes, State};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let [vram, step, counters] = Layout::vertical([
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Min(4),
    ])
    .areas(area);
    draw_vram(f, vram, state, theme);
    draw_step(f, step, state, theme);
    let [w, a, c] = Layout::horizontal([Constraint::Ratio(1, 3); 3]).areas(counters);
    draw_weights(f, w, state, theme);
    draw_activations(f, a, state, theme);
    draw_conductor(f, c, state, theme);
}

fn draw_vram(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let block = boxed(" VRAM ", theme);
    let inner_w = area.width.saturating_sub(2) as usize;
    let lines = match &s.vram {
        None => vec![Line::styled("no VRAM sample yet", theme.dim())],
        Some(v) => {
            let budget_bytes = s.vram_budget_bytes().unwrap_or(0);
            let (high, low) = s.spill_watermarks().unwrap_or((0, 0));
            let budget = budget_bytes.max(1) as f64;
            let frac = v.allocated_bytes as f64 / budget;
            let label = format!(" {}", pct(v.allocated_bytes as f64, budget));
            let bar_w = inner_w.saturating_sub(label.len() + 1);
            let mut gauge = bar(
                bar_w,
                frac,
                &[
                    (low as f64 / budget, "L"),
                    (high as f64 / budget, "H"),
                ],
                theme,
            );
            gauge.insert(0, Span::raw(" "));
            gauge.push(Span::styled(label, theme.band(frac)));
            let hist: Vec<f64> = s
                .vram_history
                .iter()
                .map(|r| r.allocated_bytes as f64)
                .collect();
            let spark_w = inner_w.saturating_sub(9);
            vec![
                kv(
                    &[
                        ("allocated", fmt_bytes(v.allocated_bytes)),
                        ("of budget", fmt_bytes(budget_bytes)),
                        ("reserved", fmt_bytes(v.reserved_bytes)),
                        ("peak", fmt_bytes(v.peak_allocated_bytes)),
                        ("low (L)", fmt_bytes(low)),
                        ("high (H)", fmt_bytes(high)),
                    ],
                    theme,
                ),
                Line::from(gauge),
                Line::from(vec![
                    Span::styled(" history ", theme.dim()),
                    Span::styled(spark(&hist, budget, spark_w, theme), theme.band(frac)),
                ]),
                Line::styled(
                    format!(
                        " {} samples; spilling {}",
                        s.vram_history.len(),
                        if s.activations.spilling { "on" } else { "off" }
                    ),
                    theme.dim(),
                ),
            ]
        }
    };
    f.render_widget(Paragraph::new(lines).block(block), area);
}

fn draw_step(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let s = &state.snapshot;
    let inner_w = area.width.saturating_sub(2) as usize;
    let mut lines = vec![kv(
        &[
            ("step", s.step.to_string()),
            ("phase", s.phase.to_string()),
            (
                "in phase for",
                format!("{:.1} ms", s.t_ns.saturating_sub(s.phase_started_ns) as f64 / 1e6),
            ),
            ("run time", crate::app::fmt_t(s.t_ns)),
            ("events", s.events_applied.to_string()),
        ],
        theme,
    )];
    match state.last_train() {
        Some((step, t)) => {
            let tput = if t.step_time_s > 0.0 {
                format!("{:.0} tokens/s", t.tokens as f64 / t.step_time_s)
            } else {
                "-".into()
            };
            lines.push(kv(
                &[
                    ("last step", step.to_string()),
                    ("step time", format!("{:.1} ms", t.step_time_s * 1e3)),
                    ("throughput", tput),
                    ("loss", format!("{:.4}", t.loss)),
                    ("stall", format!("{:.2} ms total", state.stall_ms())),
                ],
                theme,
            ));
        }
        None => lines.push(Line::styled("no step finished yet", theme.dim())),
    }
    let times: Vec<f64> = s
        .steps
        .iter()
        .filter_map(|r| r.train.as_ref().map(|t| t.step_time_s))
        .collect();
    lines.push(Line::from(vec![
        Span::styled("step time ", theme.dim()),
        Span::styled(spark(&times, 0.0, inner_w.saturating_sub(12), theme), theme.accent()),
    ]));
    let stalls: Vec<f64> = s
        .steps
        .iter()
        .map(|r| {
            r.weights.as_ref().map_or(0.0, |w| w.stall_time_ms)
                + r.activations.as_ref().map_or(0.0, |a| a.stall_time_ms)
        })
        .collect();
    lines.push(Line::from(vec![
        Span::styled("stall ms  ", theme.dim()),
        Span::styled(spark(&stalls, 0.0, inner_w.saturating_sub(12), theme), theme.band(0.7)),
    ]));
    f.render_widget(Paragraph::new(lines).block(boxed(" Step ", theme)), area);
}

fn row<'a>(k: &'a str, v: String) -> Line<'a> {
    Line::from(vec![Span::raw(format!("{k:<18}")), Span::raw(v)])
}

fn draw_weights(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let w = &state.snapshot.weights;
    let counts = state.snapshot.residency_counts();
    let on_gpu = counts.get(&stagehand::events::BlockState::GpuReady).copied().unwrap_or(0);
    let lines = vec![
        row("blocks on device", format!("{on_gpu} / {}", state.snapshot.blocks.len())),
        row("prefetch hits", w.prefetch_hits.to_string()),
        Line::from(vec![
            Span::raw(format!("{:<18}", "prefetch misses")),
            Span::styled(w.prefetch_misses.to_string(), bad_if(w.prefetch_misses, theme)),
        ]),
        row("hit rate", pct(w.hit_rate(), 1.0)),
        row("stall time", format!("{:.2} ms", w.stall_time_ms)),
        row("evictions", w.evictions.to_string()),
        row("H2D / D2H", format!("{} / {}", fmt_bytes(w.h2d_bytes), fmt_bytes(w.d2h_bytes))),
    ];
    f.render_widget(Paragraph::new(lines).block(boxed(" Weights ", theme)), area);
}

fn draw_activations(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let a = &state.snapshot.activations;
    let lines = vec![
        row("saved", a.saved.to_string()),
        row("kept / spilled", format!("{} / {}", a.kept, a.spilled)),
        row("restored", format!("{} ({} predicted)", a.restored, a.predicted)),
        Line::from(vec![
            Span::raw(format!("{:<18}", "stalls")),
            Span::styled(
                format!("{} ({:.2} ms)", a.stall_count, a.stall_time_ms),
                bad_if(a.stall_count, theme),
            ),
        ]),
        row("spilled bytes", fmt_bytes(a.spill_bytes)),
        row("pool hits / miss", format!("{} / {}", a.pool_hits, a.pool_misses)),
        row("spilling", if a.spilling { "on".into() } else { "off".into() }),
    ];
    f.render_widget(Paragraph::new(lines).block(boxed(" Activations ", theme)), area);
}

fn draw_conductor(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let lines = vec![
        row("grants / partial", format!("{} / {}", c.grants, c.partials)),
        Line::from(vec![
            Span::raw(format!("{:<18}", "denials")),
            Span::styled(
                format!("{} (+{} slots)", c.denials, c.slot_denials),
                bad_if(c.denials + c.slot_denials, theme),
            ),
        ]),
        row("active", format!("{} ({})", c.active_reservations, fmt_bytes(c.active_bytes))),
        row("slots in flight", format!("h2d {} d2h {}", c.h2d_inflight, c.d2h_inflight)),
        row(
            "hints set by",
            c.hints_rule.map_or("-".into(), |r| crate::app::rule_name(r).to_owned()),
        ),
        row("hint changes", c.hint_changes.to_string()),
        row("warnings", state.snapshot.warnings.len().to_string()),
    ];
    f.render_widget(Paragraph::new(lines).block(boxed(" Conductor ", theme)), area);
}
