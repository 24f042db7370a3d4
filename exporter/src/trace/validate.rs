//! A checker of the Trace Event Format's rules, as the converter must meet them (used by the
//! tests of this crate and of the programs that write traces).

use serde_json::Value;
use std::collections::HashMap;

/// Checks a trace against the Trace Event Format's rules, as the converter must meet them:
/// a `traceEvents` array; each event an object with a known `ph`, a string `name`, integer
/// `pid`/`tid` and (except metadata) a non-negative numeric `ts`; `X` events with a non-negative
/// `dur`; `B`/`E` pairs matched per track; `C` events with numeric args; and, per track, slices
/// that are either nested in the enclosing one or start after it ends. Returns every problem.
pub fn validate(trace: &Value) -> std::result::Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let Some(events) = trace.get("traceEvents").and_then(Value::as_array) else {
        return Err(vec!["missing `traceEvents` array".into()]);
    };
    // Per track (pid, tid): the (start, end, event index) of its slices, and its open B events.
    type Track = (u64, u64);
    let mut tracks: HashMap<Track, Vec<(f64, f64, usize)>> = HashMap::new();
    let mut stacks: HashMap<Track, Vec<(String, f64)>> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        let Some(o) = e.as_object() else {
            problems.push(format!("event {i}: not an object"));
            continue;
        };
        let ph = o.get("ph").and_then(Value::as_str).unwrap_or("");
        if !["X", "B", "E", "C", "M", "i", "I"].contains(&ph) {
            problems.push(format!("event {i}: unknown ph {:?}", o.get("ph")));
            continue;
        }
        if ph != "E" && !o.get("name").is_some_and(Value::is_string) {
            problems.push(format!("event {i}: `name` must be a string"));
        }
        let pid = o.get("pid").and_then(Value::as_u64);
        let tid = o.get("tid").and_then(Value::as_u64);
        let (Some(pid), Some(tid)) = (pid, tid) else {
            problems.push(format!("event {i}: `pid` and `tid` must be non-negative integers"));
            continue;
        };
        if ph == "M" {
            if !o.get("args").is_some_and(Value::is_object) {
                problems.push(format!("event {i}: metadata without `args` object"));
            }
            continue;
        }
        let Some(ts) = o.get("ts").and_then(Value::as_f64).filter(|t| *t >= 0.0) else {
            problems.push(format!("event {i}: `ts` must be a non-negative number"));
            continue;
        };
        match ph {
            "X" => match o.get("dur").and_then(Value::as_f64) {
                Some(d) if d >= 0.0 => tracks.entry((pid, tid)).or_default().push((ts, ts + d, i)),
                _ => problems.push(format!("event {i}: `dur` must be a non-negative number")),
            },
            "B" => stacks
                .entry((pid, tid))
                .or_default()
                .push((o["name"].as_str().unwrap_or("").to_owned(), ts)),
            "E" => match stacks.entry((pid, tid)).or_default().pop() {
                Some((name, start)) => {
                    if ts < start {
                        problems.push(format!("event {i}: `E` before its `B` ({name})"));
                    }
                    tracks.entry((pid, tid)).or_default().push((start, ts, i));
                }
                None => problems.push(format!("event {i}: `E` without a `B`")),
            },
            "C" => {
                let ok = o
                    .get("args")
                    .and_then(Value::as_object)
                    .is_some_and(|a| !a.is_empty() && a.values().all(Value::is_number));
                if !ok {
                    problems.push(format!("event {i}: counter `args` must be numbers"));
                }
            }
            _ => {}
        }
    }
    for ((pid, tid), stack) in &stacks {
        for (name, _) in stack {
            problems.push(format!("track {pid}/{tid}: `B` {name:?} never ended"));
        }
    }
    // Relative tolerance for the microsecond floats.
    const EPS: f64 = 1e-6;
    for ((pid, tid), mut spans) in tracks {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<(f64, f64)> = Vec::new();
        for (s, e, i) in spans {
            while open.last().is_some_and(|&(_, oe)| oe <= s + EPS) {
                open.pop();
            }
            if let Some(&(_, oe)) = open.last() {
                if e > oe + EPS {
                    problems.push(format!(
                        "track {pid}/{tid}: slice of event {i} ({s}..{e}) overlaps its \
                         neighbour without nesting (ends at {oe})"
                    ));
                    continue;
                }
            }
            open.push((s, e));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn validator_rejects_what_the_format_forbids() {
        let bad = json!({ "traceEvents": [
            { "ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0 },
            { "ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5.0, "dur": 10.0 },
            { "ph": "X", "name": "c", "pid": 1, "tid": 1, "ts": 30.0, "dur": -1.0 },
            { "ph": "B", "name": "d", "pid": 1, "tid": 2, "ts": 1.0 },
            { "ph": "C", "name": "e", "pid": 1, "tid": 0, "ts": 1.0, "args": { "x": "no" } },
            { "ph": "Q", "name": "f", "pid": 1, "tid": 0, "ts": 1.0 },
            { "ph": "X", "pid": 1, "tid": 3, "ts": 1.0, "dur": 1.0 },
        ]});
        let problems = validate(&bad).expect_err("invalid");
        assert_eq!(problems.len(), 6, "{problems:#?}");
        assert!(validate(&json!({})).is_err());
    }
}
