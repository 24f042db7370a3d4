//! Telemetry (JSONL events) to a Chrome trace / Perfetto JSON file (the Trace Event Format).
//!
//! One process for the run; one track (thread) for the compute stream, which carries a slice per
//! step with its phases nested inside, and one track per copy lane of each direction (`H2D`,
//! `D2H`; copies that overlap in time go to extra lanes `H2D 2`, ... so that the slices of a
//! track never overlap). Counter tracks follow VRAM (allocated, reserved, watermarks) and the
//! bytes taken in each pinned pool. Timestamps are microseconds since the run started.
//!
//! Open the output in <https://ui.perfetto.dev> or `chrome://tracing`.

use crate::{Error, Result};
use serde_json::{json, Map, Value};
use stagehand::events::model::{Direction, Event, EventKind, Phase, PoolKind, TransferId};
use stagehand::events::Snapshot;
use std::collections::HashMap;

/// The process id used for the run.
pub const PID: u64 = 1;
/// The compute stream's track.
pub const COMPUTE_TID: u64 = 1;
/// First track of the H2D lanes (lane `n` is `H2D_TID + n`).
pub const H2D_TID: u64 = 100;
/// First track of the D2H lanes.
pub const D2H_TID: u64 = 200;
/// Lanes per direction; copies beyond this many in flight share the last lane's neighbours.
const MAX_LANES: u64 = 99;

fn us(t_ns: u64) -> f64 {
    t_ns as f64 / 1e3
}

/// A slice on a track (an `X` complete event).
#[derive(Debug, Clone)]
struct Slice {
    tid: u64,
    name: String,
    cat: &'static str,
    start_ns: u64,
    end_ns: u64,
    args: Value,
}

/// Lanes of one copy direction: each lane holds the end time of its last copy.
#[derive(Debug, Default)]
struct Lanes {
    ends: Vec<u64>,
}

impl Lanes {
    fn place(&mut self, start: u64, end: u64) -> u64 {
        let free = self.ends.iter().position(|&e| e <= start);
        let lane = match free {
            Some(i) => i,
            None if (self.ends.len() as u64) < MAX_LANES => {
                self.ends.push(0);
                self.ends.len() - 1
            }
            // Pathological: more copies in flight than lanes; put it on the lane that frees first.
            None => self
                .ends
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| **e)
                .map_or(0, |(i, _)| i),
        };
        self.ends[lane] = end;
        lane as u64
    }
}

/// Builds the trace of a list of events (a run's telemetry, in order).
pub fn to_chrome_trace(events: &[Event]) -> Value {
    let mut slices: Vec<Slice> = Vec::new();
    let mut counters: Vec<Value> = Vec::new();
    let mut issued: HashMap<TransferId, (u64, String)> = HashMap::new();
    let mut copies: Vec<(Direction, u64, u64, String, Value)> = Vec::new();
    let mut snap = Snapshot::new();
    let mut process_name = "stagehand run".to_owned();
    // Open step: (step, start); open phase: (step, phase, start).
    let mut open_step: Option<(u64, u64)> = None;
    let mut open_phase: Option<(u64, Phase, u64)> = None;
    let mut last_t = 0;

    for e in events {
        snap.apply(e);
        last_t = last_t.max(e.t_ns);
        match &e.kind {
            EventKind::RunStarted { model, device, .. } => {
                process_name = format!("stagehand: {model} on {}", device.name);
            }
            EventKind::PhaseChanged { from, to, .. } => {
                if let Some((step, phase, start)) = open_phase.take() {
                    slices.push(Slice {
                        tid: COMPUTE_TID,
                        name: phase.as_str().to_owned(),
                        cat: "phase",
                        start_ns: start,
                        end_ns: e.t_ns.max(start),
                        args: json!({ "step": step, "from": from.as_str() }),
                    });
                }
                let step_ends = *to == Phase::StepBegin || *from == Phase::StepEnd;
                if step_ends {
                    if let Some((step, start)) = open_step.take() {
                        slices.push(Slice {
                            tid: COMPUTE_TID,
                            name: format!("step {step}"),
                            cat: "step",
                            start_ns: start,
                            end_ns: e.t_ns.max(start),
                            args: json!({ "step": step }),
                        });
                    }
                }
                if *to == Phase::StepBegin {
                    open_step = Some((e.step, e.t_ns));
                }
                if *to != Phase::Idle {
                    open_phase = Some((e.step, *to, e.t_ns));
                }
            }
            EventKind::TransferIssued { id, subject, .. } => {
                issued.insert(*id, (e.t_ns, subject.clone()));
            }
            EventKind::TransferCompleted {
                id,
                dir,
                owner,
                bytes,
                duration_ms,
            } => {
                let (start, subject) = issued.remove(id).unwrap_or_else(|| {
                    let d = (duration_ms.max(0.0) * 1e6) as u64;
                    (e.t_ns.saturating_sub(d), String::new())
                });
                let gbps = if *duration_ms > 0.0 {
                    *bytes as f64 / (duration_ms * 1e6)
                } else {
                    0.0
                };
                let name = if subject.is_empty() {
                    format!("{} {}", dir.as_str(), owner.as_str())
                } else {
                    subject
                };
                copies.push((
                    *dir,
                    start,
                    e.t_ns.max(start),
                    name,
                    json!({ "id": id.0, "owner": owner.as_str(), "bytes": bytes,
                            "duration_ms": duration_ms, "gbps": gbps }),
                ));
            }
            EventKind::VramSample {
                allocated_bytes,
                reserved_bytes,
                ..
            } => counters.push(json!({
                "ph": "C", "name": "VRAM", "cat": "memory", "pid": PID, "tid": 0,
                "ts": us(e.t_ns),
                "args": { "allocated": allocated_bytes, "reserved": reserved_bytes },
            })),
            EventKind::PoolConfigured { pool, .. }
            | EventKind::SlabAcquired { pool, .. }
            | EventKind::SlabReleased { pool, .. } => {
                let view = match pool {
                    PoolKind::Weights => &snap.weight_pool,
                    PoolKind::Activations => &snap.activation_pool,
                };
                if let Some(v) = view {
                    let name = match pool {
                        PoolKind::Weights => "weight pool",
                        PoolKind::Activations => "activation pool",
                    };
                    counters.push(json!({
                        "ph": "C", "name": name, "cat": "memory", "pid": PID, "tid": 0,
                        "ts": us(e.t_ns),
                        "args": { "in_use_bytes": v.in_use_bytes() },
                    }));
                }
            }
            _ => {}
        }
    }
    // Close what the file left open (a run cut short).
    if let Some((step, phase, start)) = open_phase {
        slices.push(Slice {
            tid: COMPUTE_TID,
            name: phase.as_str().to_owned(),
            cat: "phase",
            start_ns: start,
            end_ns: last_t.max(start),
            args: json!({ "step": step, "unfinished": true }),
        });
    }
    if let Some((step, start)) = open_step {
        slices.push(Slice {
            tid: COMPUTE_TID,
            name: format!("step {step}"),
            cat: "step",
            start_ns: start,
            end_ns: last_t.max(start),
            args: json!({ "step": step, "unfinished": true }),
        });
    }

    // Copies onto lanes, in start order, so overlapping copies get their own lanes.
    copies.sort_by_key(|c| (c.1, c.2));
    let mut h2d = Lanes::default();
    let mut d2h = Lanes::default();
    for (dir, start, end, name, args) in copies {
        let tid = match dir {
            Direction::H2d => H2D_TID + h2d.place(start, end),
            Direction::D2h => D2H_TID + d2h.place(start, end),
        };
        slices.push(Slice {
            tid,
            name,
            cat: "transfer",
            start_ns: start,
            end_ns: end,
            args,
        });
    }
    // Parents before children at equal start: longer first.
    slices.sort_by(|a, b| {
        (a.tid, a.start_ns, std::cmp::Reverse(a.end_ns)).cmp(&(
            b.tid,
            b.start_ns,
            std::cmp::Reverse(b.end_ns),
        ))
    });

    let mut out = Vec::new();
    out.push(json!({ "ph": "M", "name": "process_name", "pid": PID, "tid": 0,
                     "args": { "name": process_name } }));
    let mut tracks = vec![(COMPUTE_TID, "compute".to_owned())];
    for lane in 0..h2d.ends.len().max(1) as u64 {
        tracks.push((H2D_TID + lane, lane_name("H2D", lane)));
    }
    for lane in 0..d2h.ends.len().max(1) as u64 {
        tracks.push((D2H_TID + lane, lane_name("D2H", lane)));
    }
    for (tid, name) in tracks {
        out.push(json!({ "ph": "M", "name": "thread_name", "pid": PID, "tid": tid,
                         "args": { "name": name } }));
        out.push(json!({ "ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid,
                         "args": { "sort_index": tid } }));
    }
    for s in slices {
        out.push(json!({
            "ph": "X", "name": s.name, "cat": s.cat, "pid": PID, "tid": s.tid,
            "ts": us(s.start_ns), "dur": us(s.end_ns - s.start_ns), "args": s.args,
        }));
    }
    out.extend(counters);
    let mut other = Map::new();
    if let Some(run) = &snap.run {
        other.insert("run_id".into(), json!(run.run_id));
        other.insert("model".into(), json!(run.model));
        other.insert("device".into(), json!(run.device.name));
        other.insert("wall_clock_unix_ms".into(), json!(run.wall_clock_unix_ms));
    }
    other.insert("events".into(), json!(events.len()));
    json!({ "traceEvents": out, "displayTimeUnit": "ms", "otherData": other })
}

fn lane_name(dir: &str, lane: u64) -> String {
    if lane == 0 {
        dir.to_owned()
    } else {
        format!("{dir} {}", lane + 1)
    }
}

/// Reads a telemetry file and writes its trace to `out`. Returns the reader's report (lines
/// skipped and why).
pub fn convert_file(
    input: impl AsRef<std::path::Path>,
    out: impl std::io::Write,
) -> Result<stagehand::events::ReadReport> {
    let (events, report) = stagehand::events::jsonl::read_file(input)?;
    let trace = to_chrome_trace(&events);
    serde_json::to_writer(out, &trace).map_err(|e| Error::Encode(e.to_string()))?;
    Ok(report)
}

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
    use stagehand::events::model::Owner;

    fn ev(seq: u64, t_ns: u64, step: u64, kind: EventKind) -> Event {
        Event::new(seq, t_ns, step, Phase::Forward, kind)
    }

    fn phase(seq: u64, t: u64, step: u64, from: Phase, to: Phase) -> Event {
        ev(seq, t, step, EventKind::PhaseChanged { from, to, duration_s: 0.0 })
    }

    #[test]
    fn overlapping_copies_get_their_own_lanes_and_phases_nest_in_steps() {
        let mut es = vec![
            phase(1, 1_000, 1, Phase::Idle, Phase::StepBegin),
            phase(2, 2_000, 1, Phase::StepBegin, Phase::Forward),
        ];
        for (i, (start, end)) in [(2_000u64, 9_000u64), (3_000, 5_000), (9_500, 12_000)]
            .into_iter()
            .enumerate()
        {
            let id = TransferId(i as u64);
            es.push(ev(10 + i as u64, start, 1, EventKind::TransferIssued {
                id, dir: Direction::H2d, owner: Owner::Weights, bytes: 1 << 20,
                subject: format!("blocks.{i}"),
            }));
            es.push(ev(20 + i as u64, end, 1, EventKind::TransferCompleted {
                id, dir: Direction::H2d, owner: Owner::Weights, bytes: 1 << 20,
                duration_ms: (end - start) as f64 / 1e6,
            }));
        }
        es.sort_by_key(|e| e.t_ns);
        es.push(phase(30, 13_000, 1, Phase::Forward, Phase::StepEnd));
        es.push(phase(31, 14_000, 1, Phase::StepEnd, Phase::Idle));
        let t = to_chrome_trace(&es);
        validate(&t).expect("valid trace");
        let evs = t["traceEvents"].as_array().expect("array");
        let xs: Vec<&Value> = evs.iter().filter(|e| e["ph"] == "X").collect();
        let tid_of = |name: &str| {
            xs.iter().find(|e| e["name"] == name).map(|e| e["tid"].as_u64())
        };
        assert_eq!(tid_of("blocks.0"), Some(Some(H2D_TID)));
        assert_eq!(tid_of("blocks.1"), Some(Some(H2D_TID + 1)));
        assert_eq!(tid_of("blocks.2"), Some(Some(H2D_TID)));
        assert_eq!(tid_of("step 1"), Some(Some(COMPUTE_TID)));
        let step = xs.iter().find(|e| e["name"] == "step 1").expect("step slice");
        assert_eq!(step["ts"], 1.0);
        assert_eq!(step["dur"], 13.0);
        for p in ["step_begin", "forward", "step_end"] {
            assert!(xs.iter().any(|e| e["name"] == p), "missing phase {p}");
        }
        assert!(evs
            .iter()
            .any(|e| e["ph"] == "M" && e["args"]["name"] == "H2D 2"));
    }

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
