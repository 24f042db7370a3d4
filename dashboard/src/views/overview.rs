//! Overview: VRAM against the watermarks and the budget and who holds it, the last step's time
//! part by part, the most severe finding, and each runtime's headline counters. Lines give way
//! by priority and boxes lose their least important rows as the terminal shrinks.

use super::parts::{owner_parts, time_parts};
use super::widgets::{bar, rows, spark, stacked, Fields};
use super::{bad_if, boxed, findings};
use crate::app::State;
use crate::format::{bytes, count, ms, percent};
use crate::theme::Theme;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;
use stagehand_events::BlockState;

/// Terminals at least this tall get the history lines.
const TALL: u16 = 30;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let tall = area.height >= TALL;
    let vram_h = if tall { 7 } else { 5 };
    let step_h = if tall { 6 } else { 5 };
    let findings_h = findings::summary_rows(&state.snapshot, area.width as usize);
    // A data-parallel run's GPUs first (nothing on one device).
    let gpus_h = super::gpus::height(state);
    let [gpus, vram, step, found, counters] = Layout::vertical([
        Constraint::Length(gpus_h),
        Constraint::Length(vram_h),
        Constraint::Length(step_h),
        Constraint::Length(findings_h),
        Constraint::Min(3),
    ])
    .areas(area);
    if gpus_h > 0 {
        super::gpus::draw(f, gpus, state, theme);
    }
    draw_vram(f, vram, state, tall, theme);
    draw_step(f, step, state, tall, theme);
    findings::draw_summary(f, found, &state.snapshot, theme);
    let [w, a, c] = Layout::horizontal([Constraint::Ratio(1, 3); 3]).areas(counters);
    draw_weights(f, w, state, theme);
    draw_activations(f, a, state, theme);
    draw_conductor(f, c, state, theme);
}

fn sep<'a>(theme: &Theme) -> Span<'a> {
    Span::styled(theme.sep(), theme.dim())
}

fn draw_vram(f: &mut Frame<'_>, area: Rect, state: &State, tall: bool, theme: &Theme) {
    let s = &state.snapshot;
    let w = area.width.saturating_sub(2) as usize;
    let lines = match &s.vram {
        None => vec![Line::styled("no VRAM sample yet", theme.dim())],
        Some(v) => {
            let budget_bytes = s.vram_budget_bytes().unwrap_or(0);
            let budget = budget_bytes.max(1) as f64;
            let frac = v.allocated_bytes as f64 / budget;
            let mut head = Fields::new();
            head.push(0, vec![
                Span::styled("allocated ", theme.dim()),
                Span::styled(bytes(v.allocated_bytes), theme.band(frac)),
                Span::styled(" of ", theme.dim()),
                Span::raw(bytes(budget_bytes)),
            ]);
            // The run's peak, as every surface shows it.
            head.kv(2, "peak", bytes(s.vram_peak_bytes), theme);
            let mut marks = Vec::new();
            if let Some((high, low)) = s.spill_watermarks() {
                head.kv(1, "L", bytes(low), theme);
                head.kv(1, "H", bytes(high), theme);
                marks = vec![(low as f64 / budget, "L"), (high as f64 / budget, "H")];
            }
            head.kv(3, "reserved", bytes(v.reserved_bytes), theme);
            head.kv(4, "spilling", if s.activations.spilling { "on" } else { "off" }.to_owned(), theme);
            let label = format!(" {}", percent(v.allocated_bytes as f64, budget));
            let mut gauge = bar(w.saturating_sub(label.len()), frac, &marks, theme);
            gauge.push(Span::styled(label, theme.band(frac)));
            let mut lines = vec![head.line(w, sep(theme)), Line::from(gauge)];
            match &s.vram_owners {
                Some(o) => {
                    // Who held it at the owners' own reading, with that reading's allocated
                    // bytes: the parts add up to it (the head's figure may be a later reading).
                    let parts = owner_parts(&o.owners, theme);
                    let mut by = Fields::new();
                    by.push(0, vec![Span::styled(
                        format!("{} at s{} {}:", bytes(o.owners.allocated_bytes), o.step, o.phase),
                        theme.dim(),
                    )]);
                    for (i, (sw, b)) in parts.iter().enumerate() {
                        let prio = if i == 0 || i == 1 { 0 } else { 1 + i as u8 };
                        by.push(prio, vec![
                            Span::styled(sw.glyph, sw.style),
                            Span::raw(format!(" {} {}", sw.name, bytes(*b as u64))),
                        ]);
                    }
                    lines.push(by.line(w, Span::raw("  ")));
                }
                None => lines.push(Line::styled("no reading of VRAM by owner yet", theme.dim())),
            }
            if tall {
                let hist: Vec<f64> = s.vram_history.iter().map(|r| r.allocated_bytes as f64).collect();
                lines.push(Line::from(vec![
                    Span::styled("history ", theme.dim()),
                    Span::styled(spark(&hist, budget, w.saturating_sub(8), theme), theme.band(frac)),
                ]));
                lines.push(Line::styled(format!("{} samples, newest right", s.vram_history.len()), theme.dim()));
            }
            lines
        }
    };
    f.render_widget(Paragraph::new(lines).block(boxed(" VRAM (3 for who holds it) ", theme)), area);
}

fn draw_step(f: &mut Frame<'_>, area: Rect, state: &State, tall: bool, theme: &Theme) {
    let s = &state.snapshot;
    let w = area.width.saturating_sub(2) as usize;
    let mut head = Fields::new();
    head.push(0, vec![Span::styled(format!("step {} {}", s.step, s.phase), theme.strong())]);
    head.kv(3, "for", ms(s.t_ns.saturating_sub(s.phase_started_ns) as f64 / 1e6), theme);
    if let Some((step, t)) = state.last_train() {
        head.kv(0, &format!("step {step} took"), ms(t.step_time_s * 1e3), theme);
        if t.step_time_s > 0.0 {
            let rate = (t.tokens as f64 / t.step_time_s).min(u64::MAX as f64) as u64;
            head.push_alt(
                2,
                vec![Span::raw(format!("{} tokens/s", count(rate)))],
                vec![Span::raw(format!("{} tok/s", count(rate)))],
            );
        }
        head.kv(1, "loss", format!("{:.4}", t.loss), theme);
    }
    head.kv(4, "run time", crate::format::run_time(s.t_ns), theme);
    let mut lines = vec![head.line(w, sep(theme))];
    match s.steps.iter().rev().find_map(|r| r.time.map(|t| (r.step, t))) {
        Some((step, t)) => {
            let parts = time_parts(&t, theme);
            let label = format!("step {step} ");
            let mut b = vec![Span::styled(label.clone(), theme.dim())];
            b.extend(stacked(&parts, t.step_ms, w.saturating_sub(label.len()), theme));
            lines.push(Line::from(b));
            // One line of figures, the biggest parts first to stay.
            let mut order: Vec<usize> = (0..parts.len()).filter(|i| parts[*i].1 > 0.0).collect();
            order.sort_by(|a, b| parts[*b].1.total_cmp(&parts[*a].1));
            let mut figures = Fields::new();
            for i in (0..parts.len()).filter(|i| parts[*i].1 > 0.0) {
                let (sw, v) = parts[i];
                let rank = order.iter().position(|j| *j == i).unwrap_or(0) as u8;
                figures.push(rank, vec![
                    Span::styled(sw.glyph, sw.style),
                    Span::raw(format!(" {} {} {}", sw.name, ms(v), percent(v, t.step_ms))),
                ]);
            }
            lines.push(figures.line(w, Span::raw("  ")));
        }
        None => lines.push(Line::styled("no step time breakdown yet", theme.dim())),
    }
    if tall {
        let times: Vec<f64> = s.steps.iter().filter_map(|r| r.train.as_ref().map(|t| t.step_time_s)).collect();
        lines.push(Line::from(vec![
            Span::styled("step time ", theme.dim()),
            Span::styled(spark(&times, 0.0, w.saturating_sub(10), theme), theme.accent()),
        ]));
    }
    f.render_widget(Paragraph::new(lines).block(boxed(" Step time (2 for every step) ", theme)), area);
}

fn draw_weights(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let w = &state.snapshot.weights;
    let counts = state.snapshot.residency_counts();
    let on_gpu = counts.get(&BlockState::GpuReady).copied().unwrap_or(0);
    let n = Style::default();
    let items = vec![
        ("hit rate", "hit rate", percent(w.hit_rate(), 1.0), n),
        // Step 1 misses by design (it traces the itinerary): alarming only in a later step.
        ("prefetch misses", "misses", count(w.prefetch_misses), bad_if(steady_misses(&state.snapshot), theme)),
        ("stall time", "stalls", ms(w.stall_time_ms), n),
        ("blocks on device", "on device", format!("{} / {}", count(on_gpu as u64), count(state.snapshot.blocks.len() as u64)), n),
        ("evictions", "evictions", count(w.evictions), n),
        ("prefetch hits", "hits", count(w.prefetch_hits), n),
        ("H2D / D2H", "H2D/D2H", format!("{} / {}", bytes(w.h2d_bytes), bytes(w.d2h_bytes)), n),
    ];
    let lines = rows(items, area.width.saturating_sub(2) as usize, theme);
    f.render_widget(Paragraph::new(lines).block(boxed(" Weights ", theme)), area);
}

/// Misses of the newest finished step after the first.
fn steady_misses(s: &stagehand_events::Snapshot) -> u64 {
    s.last_finished_step().filter(|r| r.step > 1).and_then(|r| r.weights.as_ref()).map_or(0, |w| w.prefetch_misses)
}

fn draw_activations(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let a = &state.snapshot.activations;
    let n = Style::default();
    let items = vec![
        ("kept / spilled", "kept/spill", format!("{} / {}", count(a.counts.kept), count(a.counts.spilled)), n),
        ("stalls", "stalls", format!("{} ({})", count(a.counts.stall_count), ms(a.counts.stall_time_ms)), bad_if(a.counts.stall_count, theme)),
        ("restored", "restored", format!("{} ({} ahead)", count(a.counts.restored), count(a.counts.predicted)), n),
        ("pool hits / misses", "pool h/m", format!("{} / {}", count(a.counts.pool_hits), count(a.counts.pool_misses)), bad_if(a.counts.pool_misses, theme)),
        ("spilled bytes", "spilled", bytes(a.counts.spill_bytes), n),
        ("saved", "saved", count(a.counts.saved), n),
        ("spilling", "spilling", if a.spilling { "on" } else { "off" }.to_owned(), n),
    ];
    let lines = rows(items, area.width.saturating_sub(2) as usize, theme);
    f.render_widget(Paragraph::new(lines).block(boxed(" Activations ", theme)), area);
}

fn draw_conductor(f: &mut Frame<'_>, area: Rect, state: &State, theme: &Theme) {
    let c = &state.snapshot.conductor;
    let n = Style::default();
    let items = vec![
        // Not an alarm: the Conductor holds back work that can wait (8 says why).
        ("denials (+slots)", "denied", format!("{} (+{})", count(c.denials), count(c.slot_denials)), n),
        ("grants / partial", "granted", format!("{} / {}", count(c.grants), count(c.partials)), n),
        ("hints set by", "hints by", c.hints_rule.map_or("-".into(), |r| stagehand_events::describe::rule_name(r).to_owned()), n),
        ("active", "active", format!("{} ({})", count(c.active_reservations), bytes(c.active_bytes)), n),
        ("slots in flight", "in flight", format!("h2d {} d2h {}", c.h2d_inflight, c.d2h_inflight), n),
        ("hint changes", "hint chg", count(c.hint_changes), n),
        ("warnings", "warnings", count(state.snapshot.warnings.len() as u64), n),
    ];
    let lines = rows(items, area.width.saturating_sub(2) as usize, theme);
    f.render_widget(Paragraph::new(lines).block(boxed(" Conductor ", theme)), area);
}
