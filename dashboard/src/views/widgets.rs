//! Building blocks that keep a screen legible at any width: fields that give way by priority
//! (the least important go first, numbers are never cut), label/value rows that switch to
//! short labels, bars with marks, stacked bars whose parts add up to their width, legends laid
//! out as a grid, and tables that drop their least important columns.

use crate::theme::Theme;
use ratatui::layout::Constraint;
use ratatui::style::Style;
use ratatui::text::{Line, Span};

/// The width of some spans, in terminal cells.
pub(crate) fn width(spans: &[Span<'_>]) -> usize {
    spans.iter().map(Span::width).sum()
}

/// Fields on one line, separated, each with a priority (0 matters most) and one or more
/// renderings from widest to narrowest. [`Fields::line`] narrows, then drops, the least
/// important fields until the line fits: a field is shown whole or not at all.
#[derive(Debug, Default)]
pub(crate) struct Fields<'a> {
    items: Vec<(u8, Vec<Vec<Span<'a>>>)>,
}

impl<'a> Fields<'a> {
    pub fn new() -> Fields<'a> {
        Fields::default()
    }

    /// A field in its only rendering.
    pub fn push(&mut self, priority: u8, spans: Vec<Span<'a>>) -> &mut Self {
        self.items.push((priority, vec![spans]));
        self
    }

    /// A field with a narrower rendering to fall back on before it is dropped.
    pub fn push_alt(&mut self, priority: u8, wide: Vec<Span<'a>>, narrow: Vec<Span<'a>>) -> &mut Self {
        self.items.push((priority, vec![wide, narrow]));
        self
    }

    /// A dim label and a plain value.
    pub fn kv(&mut self, priority: u8, label: &str, value: String, theme: &Theme) -> &mut Self {
        self.push(priority, vec![Span::styled(format!("{label} "), theme.dim()), Span::raw(value)])
    }

    /// A dim label and a styled value.
    pub fn kv_styled(&mut self, priority: u8, label: &str, value: String, style: Style, theme: &Theme) -> &mut Self {
        self.push(priority, vec![Span::styled(format!("{label} "), theme.dim()), Span::styled(value, style)])
    }

    /// The fields that fit in `width`, joined by `sep`.
    pub fn line(self, max: usize, sep: Span<'a>) -> Line<'a> {
        let mut items = self.items;
        let total = |items: &[(u8, Vec<Vec<Span<'a>>>)]| -> usize {
            let fields: usize = items.iter().map(|(_, v)| width(&v[0])).sum();
            fields + sep.width() * items.len().saturating_sub(1)
        };
        while total(&items) > max && (items.len() > 1 || items.first().is_some_and(|(_, v)| v.len() > 1)) {
            // The least important field, the last one among equals.
            let worst = items
                .iter()
                .enumerate()
                .max_by_key(|(i, (p, _))| (*p, *i))
                .map_or(0, |(i, _)| i);
            if items[worst].1.len() > 1 {
                items[worst].1.remove(0);
            } else {
                items.remove(worst);
            }
        }
        let mut spans = Vec::new();
        for (i, (_, mut v)) in items.into_iter().enumerate() {
            if i > 0 {
                spans.push(sep.clone());
            }
            spans.append(&mut v[0]);
        }
        Line::from(spans)
    }
}

/// Label/value rows for a narrow panel: full labels when every row fits `width`, else the short
/// labels; a row that does not fit even so is left out, so values are never cut. Rows are given
/// most important first; the panel shows as many as its height allows.
pub(crate) fn rows<'a>(items: Vec<(&'a str, &'a str, String, Style)>, max: usize, theme: &Theme) -> Vec<Line<'a>> {
    let label_w = |pick: fn(&(&'a str, &'a str, String, Style)) -> &'a str| items.iter().map(|r| pick(r).len()).max().unwrap_or(0);
    let lw = label_w(|r| r.0);
    let full = items.iter().all(|r| lw + 1 + r.2.len() <= max);
    let w = if full { lw } else { label_w(|r| r.1) };
    items
        .into_iter()
        .filter(|r| w + 1 + r.2.len() <= max)
        .map(|(label, short, value, style)| {
            let l = if full { label } else { short };
            Line::from(vec![Span::styled(format!("{l:<w$} "), theme.dim()), Span::styled(value, style)])
        })
        .collect()
}

/// A horizontal bar `cells` wide, filled to `fraction` in its usage band, with marks
/// (fraction, label) drawn over it (the watermarks).
pub(crate) fn bar<'a>(cells: usize, fraction: f64, marks: &[(f64, &'a str)], theme: &Theme) -> Vec<Span<'a>> {
    let (full, empty) = theme.bar_cells();
    let fraction = if fraction.is_finite() { fraction } else { 0.0 };
    let filled = ((fraction.clamp(0.0, 1.0) * cells as f64).round() as usize).min(cells);
    let mut out: Vec<Span<'a>> = (0..cells)
        .map(|i| {
            if i < filled {
                Span::styled(full, theme.band(fraction))
            } else {
                Span::styled(empty, theme.dim())
            }
        })
        .collect();
    mark(&mut out, marks, theme);
    out
}

/// A progress bar `cells` wide, filled to `fraction` in the accent colour (progress is not a
/// usage: full is not bad).
pub(crate) fn progress<'a>(cells: usize, fraction: f64, theme: &Theme) -> Vec<Span<'a>> {
    let (full, empty) = theme.bar_cells();
    let fraction = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
    let n = ((fraction * cells as f64).round() as usize).min(cells);
    vec![Span::styled(full.repeat(n), theme.accent()), Span::styled(empty.repeat(cells - n), theme.dim())]
}

/// Draws marks (fraction of the bar, label) over bar cells.
pub(crate) fn mark<'a>(cells: &mut [Span<'a>], marks: &[(f64, &'a str)], theme: &Theme) {
    let n = cells.len();
    for (at, label) in marks {
        if n == 0 || !at.is_finite() || *at <= 0.0 {
            continue;
        }
        let i = ((at.clamp(0.0, 1.0) * n as f64) as usize).min(n - 1);
        cells[i] = Span::styled(*label, theme.strong());
    }
}

/// How many cells each part gets of `cells`, in proportion to `values` against `scale`, by
/// largest remainder so the parts add up exactly; a part that is not zero gets at least one
/// cell while the largest part can spare it, so a small wait stays visible.
pub(crate) fn apportion(values: &[f64], scale: f64, cells: usize) -> Vec<usize> {
    let clean = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let sum: f64 = values.iter().map(|v| clean(*v)).sum();
    let scale = if scale.is_finite() && scale > 0.0 { scale.max(sum) } else { sum };
    if scale <= 0.0 || cells == 0 {
        return vec![0; values.len()];
    }
    let filled = ((sum / scale) * cells as f64).round() as usize;
    let exact: Vec<f64> = values.iter().map(|v| clean(*v) / sum.max(f64::MIN_POSITIVE) * filled as f64).collect();
    let mut out: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut left = filled.saturating_sub(out.iter().sum());
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|a, b| (exact[*b] - exact[*b].floor()).total_cmp(&(exact[*a] - exact[*a].floor())));
    for i in order {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    for i in 0..values.len() {
        if out[i] == 0 && clean(values[i]) > 0.0 {
            if let Some(big) = (0..out.len()).max_by_key(|j| out[*j]).filter(|j| out[*j] > 1) {
                out[big] -= 1;
                out[i] = 1;
            }
        }
    }
    out
}

/// A part of a stacked bar or legend: its name, its style and its glyph.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Swatch {
    pub name: &'static str,
    pub style: Style,
    pub glyph: &'static str,
}

/// A stacked bar: each part's share of `scale` in its swatch, the rest empty, `cells` wide.
pub(crate) fn stacked<'a>(parts: &[(Swatch, f64)], scale: f64, cells: usize, theme: &Theme) -> Vec<Span<'a>> {
    let values: Vec<f64> = parts.iter().map(|(_, v)| *v).collect();
    let counts = apportion(&values, scale, cells);
    let mut out = Vec::new();
    for ((sw, _), n) in parts.iter().zip(&counts) {
        if *n > 0 {
            out.push(Span::styled(sw.glyph.repeat(*n), sw.style));
        }
    }
    let used: usize = counts.iter().sum();
    if used < cells {
        out.push(Span::styled(theme.bar_cells().1.repeat(cells - used), theme.dim()));
    }
    out
}

/// Legend cells (swatch, then text) laid out in equal columns, as many a line as fit.
pub(crate) fn legend<'a>(cells: Vec<(Swatch, String)>, max: usize) -> Vec<Line<'a>> {
    let cell_w = cells.iter().map(|(s, t)| s.glyph.chars().count() + 1 + t.chars().count()).max().unwrap_or(0) + 2;
    let per_line = (max / cell_w.max(1)).max(1);
    cells
        .chunks(per_line)
        .map(|chunk| {
            let mut spans = Vec::new();
            for (sw, text) in chunk {
                spans.push(Span::styled(sw.glyph.to_owned(), sw.style));
                let pad = cell_w - sw.glyph.chars().count() - 1;
                spans.push(Span::raw(format!(" {text:<pad$}")));
            }
            Line::from(spans)
        })
        .collect()
}

/// A sparkline of the last `cells` values, scaled to `max` (or their own maximum when 0).
pub(crate) fn spark(values: &[f64], max: f64, cells: usize, theme: &Theme) -> String {
    let levels = theme.spark_levels();
    let tail = &values[values.len().saturating_sub(cells)..];
    let max = if max > 0.0 { max } else { tail.iter().copied().fold(0.0, f64::max) };
    tail.iter()
        .map(|v| {
            if max <= 0.0 || !v.is_finite() {
                levels[0]
            } else {
                let l = ((v / max).clamp(0.0, 1.0) * 8.0).round() as usize;
                levels[l.max(usize::from(*v > 0.0))]
            }
        })
        .collect()
}

/// The columns of a table that fit `max` cells (with one cell between columns): columns are
/// taken by priority (0 first) while they fit, then shown in their own order. Returns the
/// indices kept and their constraints.
pub(crate) fn fit_columns(cols: &[(u16, u8)], max: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..cols.len()).collect();
    order.sort_by_key(|i| (cols[*i].1, *i));
    let mut kept = Vec::new();
    let mut used = 0usize;
    for i in order {
        let w = cols[i].0 as usize + usize::from(!kept.is_empty());
        if used + w <= max {
            used += w;
            kept.push(i);
        }
    }
    kept.sort_unstable();
    kept
}

/// Constraints for the kept columns: each its width, the last one taking the rest.
pub(crate) fn constraints(cols: &[(u16, u8)], kept: &[usize]) -> Vec<Constraint> {
    kept.iter()
        .enumerate()
        .map(|(n, i)| if n + 1 == kept.len() { Constraint::Min(cols[*i].0) } else { Constraint::Length(cols[*i].0) })
        .collect()
}

/// A column title with the sort marker when the table is sorted by it.
pub(crate) fn sort_title(title: &str, sorted: Option<bool>, theme: &Theme) -> String {
    match sorted {
        None => title.to_owned(),
        Some(desc) => {
            let m = match (desc, theme.ascii) {
                (true, false) => "▼",
                (false, false) => "▲",
                (true, true) => "v",
                (false, true) => "^",
            };
            format!("{title}{m}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(l: &Line<'_>) -> String {
        l.spans.iter().map(|s| s.content.as_ref()).collect()
    }

    #[test]
    fn fields_give_way_least_important_first_and_whole() {
        let theme = Theme::default();
        let build = || {
            let mut f = Fields::new();
            f.kv(0, "step", "4".into(), &theme)
                .kv(2, "run time", "0.151 s".into(), &theme)
                .push_alt(1, vec![Span::raw("throughput 186k tokens/s")], vec![Span::raw("186k tok/s")])
                .kv(0, "loss", "1.0000".into(), &theme);
            f
        };
        let sep = || Span::raw(" | ");
        assert_eq!(text(&build().line(200, sep())), "step 4 | run time 0.151 s | throughput 186k tokens/s | loss 1.0000");
        assert_eq!(text(&build().line(50, sep())), "step 4 | throughput 186k tokens/s | loss 1.0000");
        assert_eq!(text(&build().line(35, sep())), "step 4 | 186k tok/s | loss 1.0000");
        assert_eq!(text(&build().line(10, sep())), "step 4");
        for w in 0..120 {
            let l = build().line(w, sep());
            assert!(l.width() <= w.max(6), "{w}: {}", text(&l));
        }
    }

    #[test]
    fn rows_switch_to_short_labels_rather_than_cut_values() {
        let theme = Theme::default();
        let items = || vec![
            ("kept / spilled", "kept/spill", "8.43k / 12.3k".to_owned(), Style::default()),
            ("restored", "restored", "24".to_owned(), Style::default()),
        ];
        let wide = rows(items(), 40, &theme);
        assert_eq!(text(&wide[0]), "kept / spilled 8.43k / 12.3k");
        let narrow = rows(items(), 24, &theme);
        assert_eq!(text(&narrow[0]), "kept/spill 8.43k / 12.3k");
        assert!(narrow.iter().all(|l| l.width() <= 24));
        let tiny = rows(items(), 14, &theme);
        assert_eq!(tiny.len(), 1, "the row that cannot fit is left out");
        assert_eq!(text(&tiny[0]), "restored   24");
    }

    #[test]
    fn stacked_parts_add_up_and_small_ones_stay_visible() {
        assert_eq!(apportion(&[60.0, 4.0, 1.5, 0.0, 12.0], 88.0, 40), vec![27, 2, 1, 0, 5]);
        assert_eq!(apportion(&[1.0, 1.0], 4.0, 10).iter().sum::<usize>(), 5);
        assert_eq!(apportion(&[100.0, 0.01], 100.0, 10), vec![9, 1]);
        assert_eq!(apportion(&[f64::NAN, -1.0], 0.0, 10), vec![0, 0]);
        assert_eq!(apportion(&[5.0, 5.0], 1.0, 10).iter().sum::<usize>(), 10, "over the scale fills the bar");
        for cells in 0..60 {
            let a = apportion(&[3.0, 0.2, 7.0, 0.0, 1.0], 20.0, cells);
            assert!(a.iter().sum::<usize>() <= cells);
        }
    }

    #[test]
    fn tables_keep_their_most_important_columns() {
        let cols = [(6, 0), (8, 0), (20, 1), (8, 2), (8, 3)];
        assert_eq!(fit_columns(&cols, 100), vec![0, 1, 2, 3, 4]);
        assert_eq!(fit_columns(&cols, 45), vec![0, 1, 2, 3]);
        assert_eq!(fit_columns(&cols, 30), vec![0, 1, 3], "the bar does not fit: narrower columns fill the room");
    }
}
