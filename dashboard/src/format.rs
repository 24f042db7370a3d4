//! Numbers as a reader takes them in at a glance: counts abbreviated to three significant
//! digits (`14.6k`, `3.20M`), bytes in binary units (`48.0 MiB`), durations in the unit that
//! keeps them short (`840 us`, `3.40 ms`, `1.25 s`). Every function here returns at most
//! [`MAX_WIDTH`] characters, so a panel sized for them never cuts a number.

pub use stagehand_events::describe::bytes;
use stagehand_events::describe::three_digits;

/// The widest string any formatter here returns ("1023 KiB", "-999 ms" are 8).
pub const MAX_WIDTH: usize = 9;


/// A count, abbreviated with k, M, G, T, P, E once it passes 999 (decimal: these are events,
/// copies, blocks, not bytes).
pub fn count(n: u64) -> String {
    if n < 1000 {
        return n.to_string();
    }
    const UNITS: [&str; 6] = ["k", "M", "G", "T", "P", "E"];
    let mut v = n as f64;
    let mut u = 0;
    loop {
        v /= 1000.0;
        // 999_950 rounds to "1000k": move up a unit instead.
        if v < 999.5 || u == UNITS.len() - 1 {
            break;
        }
        u += 1;
    }
    format!("{}{}", three_digits(v), UNITS[u])
}


/// Milliseconds in the unit that keeps them short: "0 ms", "840 us", "3.40 ms", "88.0 ms",
/// "1.25 s", "12.5 min". Not-a-number reads "-".
pub fn ms(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let sign = if v < 0.0 { "-" } else { "" };
    let a = v.abs();
    if a == 0.0 {
        "0 ms".to_owned()
    } else if a < 0.9995 {
        format!("{sign}{:.0} us", a * 1e3)
    } else if a < 999.5 {
        format!("{sign}{} ms", three_digits(a))
    } else if a < 59_950.0 {
        format!("{sign}{} s", three_digits(a / 1e3))
    } else {
        format!("{sign}{} min", three_digits((a / 60e3).min(999.0)))
    }
}

/// Nanoseconds since the run started, as seconds with millisecond resolution: "12.345 s".
pub fn run_time(t_ns: u64) -> String {
    format!("{:.3} s", t_ns as f64 / 1e9)
}

/// A share as a percentage: "14%", "0.5%", or "-" of nothing.
pub fn percent(part: f64, whole: f64) -> String {
    if whole > 0.0 && part.is_finite() && whole.is_finite() {
        let p = 100.0 * part / whole;
        if p != 0.0 && p.abs() < 9.95 {
            format!("{p:.1}%")
        } else {
            format!("{p:.0}%")
        }
    } else {
        "-".to_owned()
    }
}

/// A throughput in GB/s (decimal, as PCIe is quoted): "19.4 GB/s".
pub fn gbps(v: f64) -> String {
    if v.is_finite() && v >= 0.0 {
        format!("{} GB/s", three_digits(v))
    } else {
        "-".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_keep_three_significant_digits() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1.00k");
        assert_eq!(count(1234), "1.23k");
        assert_eq!(count(14_600), "14.6k");
        assert_eq!(count(146_000), "146k");
        assert_eq!(count(999_499), "999k");
        assert_eq!(count(999_950), "1.00M");
        assert_eq!(count(3_200_000), "3.20M");
        assert_eq!(count(u64::MAX), "18.4E");
    }

    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(1020 << 10), "1020 KiB");
        assert_eq!(bytes(1_047_552), "1023 KiB");
        assert_eq!(bytes(1_048_575), "1.00 MiB");
        assert_eq!(bytes(48 << 20), "48.0 MiB");
        assert_eq!(bytes(920 << 20), "920 MiB");
        assert_eq!(bytes(1 << 30), "1.00 GiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn durations_pick_a_short_unit() {
        assert_eq!(ms(0.0), "0 ms");
        assert_eq!(ms(0.84), "840 us");
        assert_eq!(ms(3.4), "3.40 ms");
        assert_eq!(ms(88.0), "88.0 ms");
        assert_eq!(ms(999.4), "999 ms");
        assert_eq!(ms(1250.0), "1.25 s");
        assert_eq!(ms(750_000.0), "12.5 min");
        assert_eq!(ms(f64::NAN), "-");
        assert_eq!(ms(-2.0), "-2.00 ms");
    }

    #[test]
    fn shares_and_rates() {
        assert_eq!(percent(14.0, 100.0), "14%");
        assert_eq!(percent(0.5, 100.0), "0.5%");
        assert_eq!(percent(1.0, 0.0), "-");
        assert_eq!(gbps(19.35), "19.4 GB/s");
    }

    #[test]
    fn nothing_is_wider_than_the_promise() {
        let mut n = 1u64;
        while n < u64::MAX / 7 {
            for v in [n, n * 2, n * 3 - 1] {
                assert!(count(v).len() <= MAX_WIDTH, "{}", count(v));
                assert!(bytes(v).len() <= MAX_WIDTH, "{}", bytes(v));
                assert!(ms(v as f64 / 1e3).len() <= MAX_WIDTH, "{}", ms(v as f64 / 1e3));
            }
            n *= 7;
        }
    }
}
