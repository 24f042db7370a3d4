//! Telemetry (JSONL events) to a Chrome trace / Perfetto JSON file (the Trace Event Format),
//! streamed: events are read a line at a time and trace events written as they are known, so
//! memory does not grow with the file (what is held is bounded: the open step's phases, the
//! copies in flight, the copy lanes, the pool classes).
//!
//! One process for the run (a data-parallel run: one process per GPU, `GPU 0`, `GPU 1`, ...,
//! from each event's device); in each, one track for the compute stream, which carries a slice
//! per step with its phases nested inside and an instant per prefetch miss; one track per copy
//! lane of each direction (`H2D`, `D2H`, and `collective` for a group's reductions; copies that
//! overlap in time go to extra lanes `H2D 2`, ... so the slices of a track never overlap); and a
//! track for the host optimizer, a slice per block it stepped (after a slice for its wait for
//! the block's copies, where it waited). Counter tracks follow VRAM (readings, and the limits), VRAM
//! by owner (stacked: weights, kept and restored activations, copies in flight, the rest), the
//! step time by part, and the bytes taken in each pinned pool. Incidents (out of memory,
//! non-finite values, flight records, lost telemetry, dropped events, itinerary changes,
//! warnings) are instant events. Timestamps are microseconds since the run started.
//!
//! Copies pair issue with completion by transfer id, direction and owner; a duplicate id pairs
//! with its most recent issue, and a completion without an issue starts at its completion less
//! its duration.
//!
//! Open the output in <https://ui.perfetto.dev> or `chrome://tracing`.

mod validate;

pub use validate::validate;

use crate::{Error, Result};
use serde_json::{json, Map, Value};
use stagehand_events::jsonl::{self, ReadReport};
use stagehand_events::model::{copy_gbps, Direction, Event, EventKind, Owner, Phase, PoolKind};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, Write};

/// The process id used for the run.
pub const PID: u64 = 1;
/// The process id of device `d` of a data-parallel run is `DEVICE_PID + d`.
pub const DEVICE_PID: u64 = 100;
/// Devices of a data-parallel run with tracks of their own, at most (events of others share
/// the last one).
const MAX_DEVICES: u64 = 1024;
/// The compute stream's track.
pub const COMPUTE_TID: u64 = 1;
/// First track of the H2D lanes (lane `n` is `H2D_TID + n`).
pub const H2D_TID: u64 = 100;
/// First track of the D2H lanes.
pub const D2H_TID: u64 = 200;
/// First track of the collectives' lanes (a data-parallel run's reductions).
pub const COLLECTIVE_TID: u64 = 300;
/// First track of the host optimizer's lanes.
pub const HOST_TID: u64 = 400;
/// Lanes per direction; copies beyond this many in flight share the lane that frees first.
const MAX_LANES: u64 = 99;
/// Copies waiting for their completion, at most; issues beyond wait unpaired.
const MAX_PENDING: usize = 1 << 16;
/// Characters of a copy's subject kept for its slice name.
const MAX_SUBJECT: usize = 256;
/// Size classes of a pool tracked, at most.
const MAX_POOL_CLASSES: usize = 4096;
/// Phase slices of one step held until the step's slice is written, at most.
const MAX_HELD_PHASES: usize = 64;

fn us(t_ns: u64) -> f64 {
    t_ns as f64 / 1e3
}

/// What a conversion read and wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// What reading the telemetry found (events, lines skipped and why).
    pub report: ReadReport,
    /// Trace events written.
    pub trace_events: u64,
    /// Copies whose issue could not be paired with a completion (or the reverse).
    pub unpaired: u64,
}

/// Lanes of one copy direction: each lane holds the end time of its last copy.
#[derive(Debug, Default)]
struct Lanes {
    ends: Vec<u64>,
}

impl Lanes {
    /// A lane free at `start` for a copy ending at `end`. Copies are placed as they complete;
    /// a lane's ends only grow, so a copy placed after a lane's last end never overlaps it.
    fn place(&mut self, start: u64, end: u64) -> u64 {
        let lane = match self.ends.iter().position(|&e| e <= start) {
            Some(i) => i,
            None if (self.ends.len() as u64) < MAX_LANES => {
                self.ends.push(0);
                self.ends.len() - 1
            }
            // Pathological: more copies in flight than lanes; the lane that frees first.
            None => self.ends.iter().enumerate().min_by_key(|(_, e)| **e).map_or(0, |(i, _)| i),
        };
        self.ends[lane] = self.ends[lane].max(end);
        lane as u64
    }
}

/// A finished slice waiting to be written.
#[derive(Debug, Clone)]
struct Slice {
    pid: u64,
    tid: u64,
    name: String,
    cat: &'static str,
    start_ns: u64,
    end_ns: u64,
    args: Value,
}

impl Slice {
    fn to_json(&self) -> Value {
        json!({
            "ph": "X", "name": self.name, "cat": self.cat, "pid": self.pid, "tid": self.tid,
            "ts": us(self.start_ns), "dur": us(self.end_ns.saturating_sub(self.start_ns)), "args": self.args,
        })
    }
}

/// One process's tracks: the run's, or one device's of a data-parallel run.
#[derive(Debug, Default)]
struct Tracks {
    open_step: Option<(u64, u64)>,
    open_phase: Option<(u64, Phase, u64)>,
    /// Phase slices of the open step, written after the step's own slice.
    held: Vec<Slice>,
    h2d: Lanes,
    d2h: Lanes,
    collective: Lanes,
    host: Lanes,
    /// Per pool: (slab bytes, slabs in use) by class.
    pools: [Vec<(u64, u64)>; 2],
    limits: BTreeMap<&'static str, u64>,
}

/// The process an event's tracks belong to.
fn pid_of(e: &Event) -> u64 {
    match e.device {
        None => PID,
        Some(d) => DEVICE_PID + u64::from(d).min(MAX_DEVICES - 1),
    }
}

/// A copy's transfer id, direction, owner and process.
type CopyKey = (u64, Direction, Owner, u64);

/// The converter's state: everything in it is bounded, whatever the input's size.
struct Converter<W: Write> {
    out: W,
    written: u64,
    named: bool,
    /// By process id.
    tracks: BTreeMap<u64, Tracks>,
    /// Issued copies by (id, direction, owner, process): their issue times and subjects.
    pending: HashMap<CopyKey, Vec<(u64, String)>>,
    pending_n: usize,
    unpaired: u64,
    last_t: u64,
    other: Map<String, Value>,
}

fn pool_index(p: PoolKind) -> usize {
    match p {
        PoolKind::Weights => 0,
        PoolKind::Activations => 1,
    }
}

impl<W: Write> Converter<W> {
    fn new(mut out: W) -> io::Result<Converter<W>> {
        out.write_all(b"{\"traceEvents\":[")?;
        Ok(Converter {
            out,
            written: 0,
            named: false,
            tracks: BTreeMap::new(),
            pending: HashMap::new(),
            pending_n: 0,
            unpaired: 0,
            last_t: 0,
            other: Map::new(),
        })
    }

    fn emit(&mut self, v: &Value) -> io::Result<()> {
        if self.written > 0 {
            self.out.write_all(b",\n")?;
        } else {
            self.out.write_all(b"\n")?;
        }
        serde_json::to_writer(&mut self.out, v)?;
        self.written += 1;
        Ok(())
    }

    fn counter(&mut self, pid: u64, name: &str, t_ns: u64, args: Value) -> io::Result<()> {
        self.emit(&json!({ "ph": "C", "name": name, "cat": "memory", "pid": pid, "tid": 0, "ts": us(t_ns), "args": args }))
    }

    fn instant(&mut self, name: &str, cat: &str, e: &Event, args: Value) -> io::Result<()> {
        self.emit(&json!({ "ph": "i", "s": "g", "name": name, "cat": cat, "pid": pid_of(e), "tid": 0, "ts": us(e.t_ns),
                           "args": args }))
    }

    fn tracks(&mut self, pid: u64) -> &mut Tracks {
        self.tracks.entry(pid).or_default()
    }

    /// Ends `pid`'s open phase at `t`: held with its step, or written when outside one.
    fn close_phase(&mut self, pid: u64, t: u64, unfinished: bool) -> io::Result<()> {
        let tr = self.tracks(pid);
        if let Some((step, phase, start)) = tr.open_phase.take() {
            let mut args = json!({ "step": step });
            if unfinished {
                args["unfinished"] = json!(true);
            }
            let s = Slice { pid, tid: COMPUTE_TID, name: phase.as_str().to_owned(), cat: "phase", start_ns: start, end_ns: t.max(start), args };
            if tr.open_step.is_some() && tr.held.len() < MAX_HELD_PHASES {
                tr.held.push(s);
            } else {
                self.emit(&s.to_json())?;
            }
        }
        Ok(())
    }

    /// Ends `pid`'s open step at `t`: its slice, then its phases, so parents come before
    /// children.
    fn close_step(&mut self, pid: u64, t: u64, unfinished: bool) -> io::Result<()> {
        let tr = self.tracks(pid);
        let open = tr.open_step.take();
        let held = std::mem::take(&mut tr.held);
        if let Some((step, start)) = open {
            let mut args = json!({ "step": step });
            if unfinished {
                args["unfinished"] = json!(true);
            }
            let s = Slice { pid, tid: COMPUTE_TID, name: format!("step {step}"), cat: "step", start_ns: start, end_ns: t.max(start), args };
            self.emit(&s.to_json())?;
        }
        for s in held {
            self.emit(&s.to_json())?;
        }
        Ok(())
    }

    fn on_event(&mut self, e: &Event) -> io::Result<()> {
        self.last_t = self.last_t.max(e.t_ns);
        let pid = pid_of(e);
        match &e.kind {
            EventKind::RunStarted { run_id, model, device, wall_clock_unix_ms, .. } => {
                self.named = true;
                let name = format!("stagehand: {model} on {}", device.name);
                self.emit(&json!({ "ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": { "name": name } }))?;
                self.other.insert("run_id".into(), json!(run_id));
                self.other.insert("model".into(), json!(model));
                self.other.insert("device".into(), json!(device.name));
                self.other.insert("wall_clock_unix_ms".into(), json!(wall_clock_unix_ms));
            }
            EventKind::PhaseChanged { from, to, .. } => {
                self.close_phase(pid, e.t_ns, false)?;
                if *to == Phase::StepBegin || *from == Phase::StepEnd {
                    self.close_step(pid, e.t_ns, false)?;
                }
                if *to == Phase::StepBegin {
                    self.tracks(pid).open_step = Some((e.step, e.t_ns));
                }
                if *to != Phase::Idle {
                    self.tracks(pid).open_phase = Some((e.step, *to, e.t_ns));
                }
            }
            EventKind::RunEnded { .. } => {
                self.close_phase(pid, e.t_ns, false)?;
                self.close_step(pid, e.t_ns, false)?;
            }
            EventKind::TransferIssued { id, dir, owner, subject, .. } => {
                if self.pending_n < MAX_PENDING {
                    let subject: String = subject.chars().take(MAX_SUBJECT).collect();
                    self.pending.entry((id.0, *dir, *owner, pid)).or_default().push((e.t_ns, subject));
                    self.pending_n += 1;
                } else {
                    self.unpaired += 1;
                }
            }
            EventKind::TransferCompleted { id, dir, owner, bytes, duration_ms } => {
                let timed_ms = duration_ms.filter(|ms| ms.is_finite() && *ms >= 0.0);
                let key = (id.0, *dir, *owner, pid);
                // The most recent issue of this id: ids are unique per run, but a file may hold
                // two runs or a writer that restarted its count.
                let issued = self.pending.get_mut(&key).and_then(Vec::pop);
                if self.pending.get(&key).is_some_and(Vec::is_empty) {
                    self.pending.remove(&key);
                }
                let (start, subject) = match issued {
                    Some(i) => {
                        self.pending_n -= 1;
                        i
                    }
                    None => {
                        self.unpaired += 1;
                        let d = timed_ms.map_or(0, |ms| (ms * 1e6) as u64);
                        (e.t_ns.saturating_sub(d), String::new())
                    }
                };
                let end = e.t_ns.max(start);
                // A rate only for a timed copy (null in the slice's arguments otherwise).
                let gbps = copy_gbps(*bytes, *duration_ms);
                let name = if subject.is_empty() { format!("{} {}", dir.as_str(), owner.as_str()) } else { subject };
                let tr = self.tracks(pid);
                let tid = match dir {
                    Direction::H2d => H2D_TID + tr.h2d.place(start, end),
                    Direction::D2h => D2H_TID + tr.d2h.place(start, end),
                    Direction::Collective => COLLECTIVE_TID + tr.collective.place(start, end),
                };
                let args = json!({ "id": id.0, "owner": owner.as_str(), "bytes": bytes, "duration_ms": duration_ms, "gbps": gbps });
                let s = Slice { pid, tid, name, cat: "transfer", start_ns: start, end_ns: end, args };
                self.emit(&s.to_json())?;
            }
            EventKind::HostStep { block, queued_ms, waited_ms, ran_ms } => {
                // Published as the step ended: it ran just before, and waited before that. A
                // hostile or damaged duration (negative, NaN, huge) clamps to the run's start.
                let ns = |ms: f64| if ms.is_finite() && ms > 0.0 { (ms * 1e6) as u64 } else { 0 };
                let ran_from = e.t_ns.saturating_sub(ns(*ran_ms));
                let waited_from = ran_from.saturating_sub(ns(*waited_ms));
                let tid = HOST_TID + self.tracks(pid).host.place(waited_from, e.t_ns);
                let args = json!({ "block": block.0, "queued_ms": queued_ms, "waited_ms": waited_ms, "ran_ms": ran_ms });
                if waited_from < ran_from {
                    let s = Slice { pid, tid, name: format!("#{block} waits for its copies"), cat: "host_optimizer", start_ns: waited_from, end_ns: ran_from, args: args.clone() };
                    self.emit(&s.to_json())?;
                }
                let s = Slice { pid, tid, name: format!("#{block} step"), cat: "host_optimizer", start_ns: ran_from, end_ns: e.t_ns, args };
                self.emit(&s.to_json())?;
            }
            EventKind::VramSample { allocated_bytes, reserved_bytes, peak_allocated_bytes } => self.counter(
                pid,
                "VRAM",
                e.t_ns,
                json!({ "allocated": allocated_bytes, "reserved": reserved_bytes, "peak": peak_allocated_bytes }),
            )?,
            EventKind::LimitsSet { owner, budget_bytes, high_watermark_bytes, low_watermark_bytes } => {
                let (b, h, l) = match owner {
                    Owner::Device => ("device budget", "device high", "device low"),
                    Owner::Weights => ("weights budget", "weights high", "weights low"),
                    Owner::Activations => ("spill budget", "spill high", "spill low"),
                    Owner::Conductor => ("conductor soft cap", "conductor hard cap", "conductor low"),
                    Owner::Trainer => ("trainer budget", "trainer high", "trainer low"),
                };
                let limits = &mut self.tracks(pid).limits;
                limits.insert(b, *budget_bytes);
                if let Some(v) = high_watermark_bytes {
                    limits.insert(h, *v);
                }
                if let Some(v) = low_watermark_bytes {
                    limits.insert(l, *v);
                }
                let args = Value::Object(limits.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect());
                self.counter(pid, "VRAM limits", e.t_ns, args)?;
            }
            EventKind::VramOwners(o) => self.counter(
                pid,
                "VRAM by owner",
                e.t_ns,
                json!({ "weights": o.weights_bytes, "activations_kept": o.activations_kept_bytes,
                        "activations_restored": o.activations_restored_bytes,
                        "copies_in_flight": o.copies_in_flight_bytes, "other": o.other_bytes }),
            )?,
            EventKind::StepTime(t) => {
                let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
                self.counter(
                    pid,
                    "step time (ms)",
                    e.t_ns,
                    json!({ "compute": finite(t.compute_ms), "h2d_wait": finite(t.h2d_wait_ms), "d2h_wait": finite(t.d2h_wait_ms),
                            "weight_stall": finite(t.weight_stall_ms), "restore_stall": finite(t.restore_stall_ms),
                            "optimizer": finite(t.optimizer_ms), "other": finite(t.other_ms) }),
                )?
            }
            EventKind::PoolConfigured { pool, classes, .. } => {
                let p = &mut self.tracks(pid).pools[pool_index(*pool)];
                *p = classes.iter().take(MAX_POOL_CLASSES).map(|c| (c.slab_bytes, 0)).collect();
                self.pool_counter(pid, *pool, e.t_ns)?;
            }
            EventKind::SlabAcquired { pool, class, .. } | EventKind::SlabReleased { pool, class, .. } => {
                let up = matches!(e.kind, EventKind::SlabAcquired { .. });
                if let Some(c) = self.tracks(pid).pools[pool_index(*pool)].get_mut(*class as usize) {
                    c.1 = if up { c.1.saturating_add(1) } else { c.1.saturating_sub(1) };
                    self.pool_counter(pid, *pool, e.t_ns)?;
                }
            }
            EventKind::PrefetchMiss { block, stall_ms } => self.emit(&json!({
                "ph": "i", "s": "t", "name": "prefetch miss", "cat": "stall", "pid": pid, "tid": COMPUTE_TID,
                "ts": us(e.t_ns), "args": { "block": block.0, "stall_ms": stall_ms },
            }))?,
            EventKind::OutOfMemory { requested_bytes, doing, .. } => {
                self.instant("out of memory", "incident", e, json!({ "requested_bytes": requested_bytes, "doing": doing }))?
            }
            EventKind::NonFinite { block, tensor } => {
                self.instant("non-finite", "incident", e, json!({ "block": block.map(|b| b.0), "in": tensor }))?
            }
            EventKind::FlightRecorded { reason, path, events } => {
                self.instant("flight recorded", "incident", e, json!({ "reason": reason, "path": path, "events": events }))?
            }
            EventKind::TelemetryLost { sink, lost, reason, .. } => {
                self.instant("telemetry lost", "incident", e, json!({ "sink": sink, "lost": lost, "reason": reason }))?
            }
            EventKind::EventsDropped { total } => self.instant("events dropped", "incident", e, json!({ "total": total }))?,
            EventKind::ItineraryChanged { first_difference, .. } => {
                self.instant("itinerary changed", "incident", e, json!({ "first_difference": first_difference }))?
            }
            EventKind::Warning { source, message } => {
                self.instant("warning", "incident", e, json!({ "source": source.as_str(), "message": message }))?
            }
            _ => {}
        }
        Ok(())
    }

    fn pool_counter(&mut self, pid: u64, pool: PoolKind, t_ns: u64) -> io::Result<()> {
        let used: u64 = self.tracks(pid).pools[pool_index(pool)].iter().map(|(b, n)| b.saturating_mul(*n)).fold(0, u64::saturating_add);
        let name = match pool {
            PoolKind::Weights => "weight pool",
            PoolKind::Activations => "activation pool",
        };
        self.counter(pid, name, t_ns, json!({ "in_use_bytes": used }))
    }

    /// Closes what the file left open, names the tracks, and ends the JSON document.
    fn finish(mut self, report: &ReadReport) -> io::Result<(W, u64, u64)> {
        let t = self.last_t;
        // A run on one device has the run's process and its tracks, whatever it held.
        if self.tracks.is_empty() {
            self.tracks(PID);
        }
        let pids: Vec<u64> = self.tracks.keys().copied().collect();
        for &pid in &pids {
            self.close_phase(pid, t, true)?;
            self.close_step(pid, t, true)?;
        }
        if !self.named {
            self.emit(&json!({ "ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": { "name": "stagehand run" } }))?;
        }
        for pid in pids {
            if pid != PID {
                let name = format!("GPU {}", pid - DEVICE_PID);
                self.emit(&json!({ "ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": { "name": name } }))?;
                self.emit(&json!({ "ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": { "sort_index": pid } }))?;
            }
            let tr = &self.tracks[&pid];
            // Only the lanes copies used: a summary-level file has no copies, and an empty track
            // would say there were none.
            let mut tracks = vec![(COMPUTE_TID, "compute".to_owned())];
            for lane in 0..tr.h2d.ends.len() as u64 {
                tracks.push((H2D_TID + lane, lane_name("H2D", lane)));
            }
            for lane in 0..tr.d2h.ends.len() as u64 {
                tracks.push((D2H_TID + lane, lane_name("D2H", lane)));
            }
            for lane in 0..tr.collective.ends.len() as u64 {
                tracks.push((COLLECTIVE_TID + lane, lane_name("collective", lane)));
            }
            for lane in 0..tr.host.ends.len() as u64 {
                tracks.push((HOST_TID + lane, lane_name("host optimizer", lane)));
            }
            for (tid, name) in tracks {
                self.emit(&json!({ "ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": { "name": name } }))?;
                self.emit(&json!({ "ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": { "sort_index": tid } }))?;
            }
        }
        // Issues still waiting for their completion never completed in this file.
        self.unpaired += self.pending_n as u64;
        let mut other = std::mem::take(&mut self.other);
        other.insert("events".into(), json!(report.events));
        other.insert("lines_skipped".into(), json!(report.skipped_total));
        other.insert("blank_lines".into(), json!(report.blank));
        other.insert("events_lost_in_damaged_frames".into(), json!(report.damaged_events));
        other.insert("copies_unpaired".into(), json!(self.unpaired));
        self.out.write_all(b"\n],\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        serde_json::to_writer(&mut self.out, &Value::Object(other))?;
        self.out.write_all(b"}\n")?;
        self.out.flush()?;
        Ok((self.out, self.written, self.unpaired))
    }
}

fn lane_name(dir: &str, lane: u64) -> String {
    if lane == 0 {
        dir.to_owned()
    } else {
        format!("{dir} {}", lane + 1)
    }
}

/// Converts telemetry read from `input` (plain JSONL) into a trace written to `out`, an event
/// at a time. Fails when reading or writing fails, or when no line holds an event.
pub fn convert(input: impl BufRead + Send, out: impl Write) -> Result<Summary> {
    convert_events(jsonl::Reader::new(input), out)
}

/// Converts the events a streaming [`jsonl::Reader`] yields (see [`convert`]): memory stays
/// bounded by the reader's line bound, whatever the file's size.
pub fn convert_events<S: jsonl::ByteSource>(mut events: jsonl::Reader<S>, out: impl Write) -> Result<Summary> {
    let mut w = TraceWriter::new(out)?;
    for e in &mut events {
        w.write(&e?)?;
    }
    w.finish(events.into_report())
}

/// A trace written an event at a time, for programs that already read the events for
/// something else (a replay's index pass), so that the file is read once for both. Memory
/// stays bounded whatever the number of events.
pub struct TraceWriter<W: Write> {
    converter: Converter<W>,
}

impl<W: Write> std::fmt::Debug for TraceWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceWriter").field("written", &self.converter.written).finish_non_exhaustive()
    }
}

impl<W: Write> TraceWriter<W> {
    /// Starts a trace on `out`.
    pub fn new(out: W) -> Result<TraceWriter<W>> {
        Ok(TraceWriter { converter: Converter::new(out)? })
    }

    /// Adds the next event, in file order.
    pub fn write(&mut self, event: &Event) -> Result<()> {
        Ok(self.converter.on_event(event)?)
    }

    /// Closes the trace; `report` is what reading the events found (its counts go into the
    /// trace). Fails when no event was read.
    pub fn finish(self, report: ReadReport) -> Result<Summary> {
        if report.events == 0 {
            return Err(Error::Encode(format!("no events to convert ({})", report.summary())));
        }
        let (_, trace_events, unpaired) = self.converter.finish(&report)?;
        Ok(Summary { report, trace_events, unpaired })
    }
}

/// Reads a telemetry file, plain or zstd-compressed, and writes its trace to `out` (see
/// [`convert`]).
pub fn convert_file(input: impl AsRef<std::path::Path>, out: impl Write) -> Result<Summary> {
    let path = input.as_ref();
    convert_events(jsonl::open(path)?, out)
}

/// The trace of events already in memory, as a JSON value (for programs that hold their events;
/// files go through [`convert_file`], which streams).
pub fn to_chrome_trace(events: &[Event]) -> Value {
    let mut text = Vec::new();
    for e in events {
        // An Event always serializes: every field is plain data.
        if serde_json::to_writer(&mut text, e).is_ok() {
            text.push(b'\n');
        }
    }
    let mut out = Vec::new();
    match convert(text.as_slice(), &mut out) {
        Ok(_) => serde_json::from_slice(&out).unwrap_or_else(|e| json!({ "traceEvents": [], "error": e.to_string() })),
        Err(e) => json!({ "traceEvents": [], "error": e.to_string() }),
    }
}

#[cfg(test)]
mod tests;
