//! The page's event log: each event as one line of `field=value` text, figures rounded, long
//! values cut (a replayed file may hold anything).

use super::figures::short;
use serde::Serialize;
use serde_json::Value;
use stagehand::events::{Event, EventKind, Phase, ReservationOutcome};

/// Characters of a line's text kept.
const MAX_TEXT: usize = 400;

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LogLine {
    /// Position in the server's stream; a gap between two lines means events not shown.
    pub i: u64,
    pub seq: u64,
    pub step: u64,
    pub phase: Phase,
    pub kind: String,
    pub text: String,
    /// Something went wrong or was refused.
    pub warn: bool,
}

/// Rounds every float inside a JSON value (nested objects and arrays included).
fn rounded(v: Value) -> Value {
    match v {
        Value::Number(n) if n.is_f64() => n
            .as_f64()
            .and_then(|x| short(x).parse::<f64>().ok())
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        Value::Array(a) => Value::Array(a.into_iter().map(rounded).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, rounded(v))).collect()),
        other => other,
    }
}

fn field(v: Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.to_string(),
            (_, Some(i), _) => i.to_string(),
            (_, _, Some(f)) => short(f),
            _ => n.to_string(),
        },
        Value::String(s) => s,
        other => rounded(other).to_string(),
    }
}

fn is_warning(kind: &EventKind) -> bool {
    matches!(
        kind,
        EventKind::Warning { .. }
            | EventKind::EventsDropped { .. }
            | EventKind::SlotDenied { .. }
            | EventKind::TelemetryLost { .. }
            | EventKind::OutOfMemory { .. }
            | EventKind::NonFinite { .. }
            | EventKind::Reservation { outcome: ReservationOutcome::Denied, .. }
    )
}

/// The line for the event at stream position `i`.
pub(crate) fn line(i: u64, e: &Event) -> LogLine {
    let mut text = String::new();
    if let Ok(Value::Object(fields)) = serde_json::to_value(&e.kind) {
        for (k, v) in fields {
            if k == "kind" {
                continue;
            }
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&k);
            text.push('=');
            text.push_str(&field(v));
            if text.len() > MAX_TEXT {
                break;
            }
        }
    }
    if text.chars().count() > MAX_TEXT {
        text = text.chars().take(MAX_TEXT).collect::<String>() + "...";
    }
    LogLine {
        i,
        seq: e.seq,
        step: e.step,
        phase: e.phase,
        kind: e.kind.name().to_owned(),
        text,
        warn: is_warning(&e.kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand::events::{Direction, Owner, TransferId};

    #[test]
    fn figures_are_rounded_and_long_text_cut() {
        let e = Event::new(7, 1, 2, Phase::Forward, EventKind::TransferCompleted {
            id: TransferId(3),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 1048576,
            duration_ms: Some(0.00016999999999999999),
        });
        let l = line(42, &e);
        assert_eq!((l.i, l.seq, l.kind.as_str(), l.warn), (42, 7, "transfer_completed", false));
        assert!(l.text.contains("duration_ms=0.00017"), "{}", l.text);
        assert!(l.text.contains("bytes=1048576") && l.text.contains("dir=h2d"), "{}", l.text);
        // A copy that was not timed shows no duration rather than a made-up one.
        let untimed = Event::new(9, 1, 2, Phase::Forward, EventKind::TransferCompleted {
            id: TransferId(4),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 1048576,
            duration_ms: None,
        });
        assert!(!line(44, &untimed).text.contains("duration_ms"), "{}", line(44, &untimed).text);

        let w = Event::new(8, 1, 2, Phase::Forward, EventKind::Warning { source: Owner::Weights, message: "x".repeat(5000) });
        let l = line(43, &w);
        assert!(l.warn);
        assert!(l.text.chars().count() <= MAX_TEXT + 3);

        let nested = rounded(serde_json::json!({"a": {"b": [0.1234567, 2]}}));
        assert_eq!(nested.to_string(), r#"{"a":{"b":[0.1235,2]}}"#);
    }
}
