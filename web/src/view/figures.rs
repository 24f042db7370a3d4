//! Figures as the page shows them: rounded once here, and chart axes whose ticks fall on round
//! values of the unit they are labelled in (binary steps for bytes, decimal for times and rates).

use serde::Serialize;

/// `x` rounded to `decimals` places (a non-finite value becomes 0: the page never shows NaN).
pub(crate) fn round(x: f64, decimals: i32) -> f64 {
    if !x.is_finite() {
        return 0.0;
    }
    let f = 10f64.powi(decimals);
    (x * f).round() / f
}

/// Milliseconds as the page shows them: to the microsecond.
pub(crate) fn ms(x: f64) -> f64 {
    round(x, 3)
}

/// A chart's value axis: the scale's top, where the ticks go, and what they say.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Axis {
    pub max: f64,
    pub ticks: Vec<f64>,
    pub labels: Vec<String>,
}

/// About this many intervals per axis.
const INTERVALS: f64 = 4.0;

const BINARY_UNITS: [(&str, f64); 5] = [
    ("B", 1.0),
    ("KiB", 1024.0),
    ("MiB", 1048576.0),
    ("GiB", 1073741824.0),
    ("TiB", 1099511627776.0),
];

/// An axis for bytes: ticks every power of two (16 MiB, 32 MiB, ...), labelled in the binary
/// unit of the top, so that every label is a round figure ("0 MiB", "8 MiB", "1.5 GiB").
pub(crate) fn bytes_axis(top: u64) -> Axis {
    let top = (top.max(1)) as f64;
    let step = 2f64.powi((top / INTERVALS).log2().ceil().max(0.0) as i32);
    let max = (top / step).ceil() * step;
    let (unit, size) = BINARY_UNITS
        .iter()
        .rev()
        .find(|(_, size)| max >= *size)
        .copied()
        .unwrap_or(BINARY_UNITS[0]);
    // A step of half (a quarter, ...) of the unit needs one (two, ...) decimal.
    let decimals = if step >= size { 0 } else { (size / step).log2().ceil() as usize };
    ticks(max, step, |v| {
        let s = format!("{:.decimals$}", v / size);
        let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s };
        format!("{s} {unit}")
    })
}

/// An axis for a decimal quantity: ticks at 1, 2 or 5 times a power of ten, labelled with
/// `unit` and no more decimals than the step has.
pub(crate) fn decimal_axis(top: f64, unit: &str) -> Axis {
    let top = if top.is_finite() && top > 0.0 { top } else { 1.0 };
    let raw = top / INTERVALS;
    let pow = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * pow)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * pow);
    let max = (top / step).ceil() * step;
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    ticks(max, step, |v| format!("{v:.decimals$} {unit}"))
}

fn ticks(max: f64, step: f64, label: impl Fn(f64) -> String) -> Axis {
    let n = (max / step).round() as usize;
    let ticks: Vec<f64> = (0..=n).map(|i| i as f64 * step).collect();
    let labels = ticks.iter().map(|v| label(*v)).collect();
    Axis { max, ticks, labels }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn byte_ticks_fall_on_binary_steps_with_binary_labels() {
        // The page once showed 0/10/19/29 MiB: decimal steps labelled in MiB.
        let a = bytes_axis(29 * MIB);
        assert_eq!(a.labels, ["0 MiB", "8 MiB", "16 MiB", "24 MiB", "32 MiB"]);
        assert_eq!(a.max, (32 * MIB) as f64);
        assert!(a.ticks.iter().all(|t| (*t as u64).is_multiple_of(8 * MIB)));
        assert_eq!(bytes_axis(1536 * MIB).labels, ["0 GiB", "0.5 GiB", "1 GiB", "1.5 GiB"]);
        assert_eq!(bytes_axis(1537 * MIB).labels, ["0 GiB", "0.5 GiB", "1 GiB", "1.5 GiB", "2 GiB"]);
        assert_eq!(bytes_axis(100 * MIB).labels, ["0 MiB", "32 MiB", "64 MiB", "96 MiB", "128 MiB"]);
        assert_eq!(bytes_axis(3000).labels, ["0 KiB", "1 KiB", "2 KiB", "3 KiB"]);
        assert_eq!(bytes_axis(0).labels, ["0 B", "1 B"]);
        assert_eq!(bytes_axis(80 << 30).labels.last().map(String::as_str), Some("96 GiB"));
    }

    #[test]
    fn decimal_ticks_are_round() {
        assert_eq!(decimal_axis(37.0, "ms").labels, ["0 ms", "10 ms", "20 ms", "30 ms", "40 ms"]);
        assert_eq!(decimal_axis(0.9, "GB/s").labels, ["0.0 GB/s", "0.5 GB/s", "1.0 GB/s"]);
        assert_eq!(decimal_axis(0.7, "GB/s").labels, ["0.0 GB/s", "0.2 GB/s", "0.4 GB/s", "0.6 GB/s", "0.8 GB/s"]);
        assert_eq!(decimal_axis(55.0, "GB/s").labels.last().map(String::as_str), Some("60 GB/s"));
        assert_eq!(decimal_axis(f64::NAN, "ms").max, 1.0);
    }

    #[test]
    fn figures_are_rounded() {
        assert_eq!(ms(0.1234567), 0.123);
        assert_eq!(round(f64::NAN, 2), 0.0);
    }
}
