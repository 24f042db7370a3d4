//! The in-process event bus and the hub every consumer subscribes to.
//!
//! ```text
//! training thread ──publish──▶ bounded lock-free queue ──▶ dispatcher thread ──▶ Hub
//!  (never blocks; full queue                                      │  apply(&Event) to the Snapshot
//!   = drop and count)                                             │  sinks (files, the web's stream)
//!                                                                 └─ snapshot sinks (metrics), with
//!                                                                    the snapshot after the event
//! ```
//!
//! Publishing is a sequence-number increment, a clock read and a push into a bounded
//! `ArrayQueue`; when the queue is full the event is dropped and counted, and the dispatcher
//! turns the count into an `events_dropped` event so every consumer sees it. The hub reduces
//! each event once: the consumers that derive values from the run's state ([`SnapshotSink`]:
//! Prometheus, OpenTelemetry) read the hub's snapshot rather than keep a copy of it. A replay
//! feeds the same [`Hub`], so consumers cannot tell a replay from a live run.
//!
//! The dispatcher adds a few events of its own, with the next sequence numbers: `events_dropped`
//! when publishes were dropped, `transfer_step` when a step closes (see [`super::steps`]), and
//! whatever the sinks report through [`EventSink::notices`] (a file sink's `telemetry_lost`, the
//! flight recorder's `flight_recorded`), which a sink cannot publish itself while the hub is busy
//! delivering to it.
//!
//! The file is long because the publish path and the hub's delivery share the queue's bounds and
//! the drop accounting, which read best side by side.

use super::model::{Event, EventKind, Phase};
use super::snapshot::Snapshot;
use super::steps::{Closed, StepCloser};
use crossbeam_queue::ArrayQueue;
use std::borrow::Borrow;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Events the publish queue holds before it drops.
pub const DEFAULT_QUEUE_CAPACITY: usize = 1 << 16;
/// How long the dispatcher sleeps when the queue is empty.
const DISPATCH_IDLE: Duration = Duration::from_millis(2);

/// A consumer that runs inline on the dispatcher thread and sees every event that was not
/// dropped at publish, in order. Sinks must be quick; they are flushed after each batch.
pub trait EventSink: Send {
    /// Called once per event.
    fn on_event(&mut self, event: &Event);
    /// Called after each batch and at shutdown.
    fn flush(&mut self) {}
    /// The hub starts over at an earlier or later point of the run (a replay seek): every
    /// event up to the new position follows, one [`EventSink::rewind_event`] each, then
    /// [`EventSink::rewind_end`]. One event at a time, so that a replay of a file of any size
    /// can stream them. Sinks that derive state from the events (metrics) rebuild it; sinks
    /// that only append (files) ignore all three.
    fn rewind_begin(&mut self) {}
    /// One event of the history that [`EventSink::rewind_begin`] announced, in order.
    fn rewind_event(&mut self, event: &Event) {
        let _ = event;
    }
    /// The history is complete.
    fn rewind_end(&mut self) {}
    /// Called after each batch the dispatcher delivers. A sink may defer its writes to a later
    /// batch (to write fewer, larger blocks) as long as [`EventSink::flush`] writes everything.
    fn batch_end(&mut self) {
        self.flush();
    }
    /// Events the sink itself has to report (the events it failed to write, a flight record it
    /// wrote). The dispatcher publishes them after the batch, so every consumer sees them; a
    /// sink cannot publish from inside the hub, which is busy delivering to it.
    fn notices(&mut self) -> Vec<EventKind> {
        Vec::new()
    }
}

/// A consumer that derives values from the run's state (metrics' gauges and counters): it runs
/// inline on the dispatcher thread like an [`EventSink`], and receives each event together with
/// the hub's snapshot after the event was applied, so the run is reduced once however many
/// consumers read it.
pub trait SnapshotSink: Send {
    /// Called once, when the sink is added to a hub whose snapshot is `state` (a run may have
    /// started before: a sink that counts from the events it sees starts counting here).
    fn attach(&mut self, state: &Snapshot) {
        let _ = state;
    }
    /// Called once per event, `state` being the run as of this event.
    fn on_event(&mut self, event: &Event, state: &Snapshot);
    /// Called after each batch, on a flush and at shutdown, with the run as of the last event
    /// (a sink records what it reads from the state as a whole here, once per batch).
    fn flush(&mut self, state: &Snapshot) {
        let _ = state;
    }
    /// The hub starts over at an earlier or later point of the run (a replay seek): every
    /// event up to the new position follows, one [`SnapshotSink::rewind_event`] each with the
    /// state after it, then [`SnapshotSink::rewind_end`] with the state at the new position.
    fn rewind_begin(&mut self) {}
    /// One event of the history that [`SnapshotSink::rewind_begin`] announced, in order.
    fn rewind_event(&mut self, event: &Event, state: &Snapshot) {
        let _ = (event, state);
    }
    /// The history is complete; `state` is the run at the new position.
    fn rewind_end(&mut self, state: &Snapshot) {
        self.flush(state);
    }
}

/// Hands `events` to `sink` as a hub does, for a caller that holds the sink itself (a tool, a
/// test): each event with the snapshot after it, then a flush with the last; the events are
/// reduced once, here. Returns the snapshot.
pub fn feed<E: Borrow<Event>>(sink: &mut dyn SnapshotSink, events: impl IntoIterator<Item = E>) -> Snapshot {
    let mut state = Snapshot::new();
    sink.attach(&state);
    for e in events {
        let e = e.borrow();
        state.apply(e);
        sink.on_event(e, &state);
    }
    sink.flush(&state);
    state
}

struct HubState {
    snapshot: Snapshot,
    sinks: Vec<Box<dyn EventSink>>,
    snapshot_sinks: Vec<Box<dyn SnapshotSink>>,
}

/// The aggregator: owns the current [`Snapshot`] and runs the sinks.
pub struct Hub {
    state: Mutex<HubState>,
    /// Writes a flight record on request, when the run's telemetry has a flight recorder.
    flight: Mutex<Option<FlightRequest>>,
}

/// Writes a flight record of the last steps now (the telemetry's recorder registers one with
/// the hub), so that a server holding only the hub can offer it: the file written, or why not.
pub type FlightRequest = Arc<dyn Fn(&str) -> std::result::Result<std::path::PathBuf, FlightError> + Send + Sync>;

/// Why a flight record asked for through [`Hub::request_flight`] was not written. Its own type
/// (the telemetry's errors convert into it) because the hub sits below the telemetry that
/// writes the record.
#[derive(Debug, thiserror::Error)]
pub enum FlightError {
    /// One was written less than the recorder's minimum interval ago.
    #[error("a flight record was requested less than the minimum interval ago; not writing '{0}'")]
    RateLimited(String),
    /// The record could not be written.
    #[error(transparent)]
    Write(Box<dyn std::error::Error + Send + Sync>),
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("Hub")
            .field("events_applied", &st.snapshot.events_applied)
            .field("sinks", &st.sinks.len())
            .field("snapshot_sinks", &st.snapshot_sinks.len())
            .finish_non_exhaustive()
    }
}

impl Default for Hub {
    fn default() -> Self {
        Hub::new()
    }
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Hub {
        Hub {
            state: Mutex::new(HubState {
                snapshot: Snapshot::new(),
                sinks: Vec::new(),
                snapshot_sinks: Vec::new(),
            }),
            flight: Mutex::new(None),
        }
    }

    /// Lets [`Hub::request_flight`] write flight records (done by the telemetry's `attach`).
    pub fn set_flight_request(&self, request: FlightRequest) {
        *self.flight.lock().unwrap_or_else(|p| p.into_inner()) = Some(request);
    }

    /// Writes a flight record of the last steps now, rate-limited as the recorder's own dumps
    /// are: `None` when the run has no flight recorder.
    pub fn request_flight(&self, reason: &str) -> Option<std::result::Result<std::path::PathBuf, FlightError>> {
        let request = self.flight.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        Some(request(reason))
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A panicking sink must not take the dashboards down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a sink; it sees every event ingested from now on.
    pub fn add_sink(&self, sink: Box<dyn EventSink>) {
        self.lock().sinks.push(sink);
    }

    /// Adds a sink that reads the hub's snapshot; it sees every event ingested from now on.
    pub fn add_snapshot_sink(&self, mut sink: Box<dyn SnapshotSink>) {
        let mut st = self.lock();
        sink.attach(&st.snapshot);
        st.snapshot_sinks.push(sink);
    }

    /// Applies one event: the snapshot, then the sinks.
    pub fn ingest(&self, event: Event) {
        let mut st = self.lock();
        let HubState { snapshot, sinks, snapshot_sinks } = &mut *st;
        snapshot.apply(&event);
        for s in sinks.iter_mut() {
            s.on_event(&event);
        }
        for s in snapshot_sinks.iter_mut() {
            s.on_event(&event, snapshot);
        }
    }

    /// Flushes every sink: everything ingested so far is written.
    pub fn flush(&self) {
        let mut st = self.lock();
        let HubState { snapshot, sinks, snapshot_sinks } = &mut *st;
        for s in sinks.iter_mut() {
            s.flush();
        }
        for s in snapshot_sinks.iter_mut() {
            s.flush(snapshot);
        }
    }

    /// Ends a delivered batch: every sink's [`EventSink::batch_end`], every snapshot sink's
    /// [`SnapshotSink::flush`].
    pub fn batch_end(&self) {
        let mut st = self.lock();
        let HubState { snapshot, sinks, snapshot_sinks } = &mut *st;
        for s in sinks.iter_mut() {
            s.batch_end();
        }
        for s in snapshot_sinks.iter_mut() {
            s.flush(snapshot);
        }
    }

    /// The events sinks have to report since the last call ([`EventSink::notices`]).
    pub fn take_notices(&self) -> Vec<EventKind> {
        let mut out = Vec::new();
        for s in self.lock().sinks.iter_mut() {
            out.extend(s.notices());
        }
        out
    }

    /// Replaces the snapshot (replay seek) and rewinds every sink to `history` (the events up
    /// to the snapshot's position, taken one at a time). Snapshot sinks get each event with the
    /// state after it: the hub reduces the history once for all of them (not at all without
    /// them), then hands them `snapshot`.
    pub fn reset<E: Borrow<Event>>(&self, snapshot: Snapshot, history: impl IntoIterator<Item = E>) {
        let mut st = self.lock();
        let HubState { snapshot: current, sinks, snapshot_sinks } = &mut *st;
        *current = snapshot;
        for s in sinks.iter_mut() {
            s.rewind_begin();
        }
        for s in snapshot_sinks.iter_mut() {
            s.rewind_begin();
        }
        let mut replayed = Snapshot::new();
        for e in history {
            let e = e.borrow();
            for s in sinks.iter_mut() {
                s.rewind_event(e);
            }
            if !snapshot_sinks.is_empty() {
                replayed.apply(e);
                for s in snapshot_sinks.iter_mut() {
                    s.rewind_event(e, &replayed);
                }
            }
        }
        for s in sinks.iter_mut() {
            s.rewind_end();
        }
        for s in snapshot_sinks.iter_mut() {
            s.rewind_end(current);
        }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot.clone()
    }

    /// Reads the current snapshot without cloning it.
    pub fn with_snapshot<R>(&self, f: impl FnOnce(&Snapshot) -> R) -> R {
        f(&self.lock().snapshot)
    }

}

struct Shared {
    queue: ArrayQueue<Event>,
    seq: AtomicU64,
    dropped: AtomicU64,
    start: Instant,
    step: AtomicU64,
    phase: AtomicU8,
    phase_since_ns: AtomicU64,
    stop: AtomicBool,
    /// Set while the dispatcher delivers a batch (from taking its first event to publishing the
    /// sinks' notices about it), so that a flush does not return in between.
    busy: AtomicBool,
    hub: Arc<Hub>,
    wall_clock_unix_ms: u64,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Ingests an event the dispatcher adds itself, with the next sequence number.
    fn ingest_own(&self, t_ns: u64, step: u64, phase: Phase, kind: EventKind) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        self.hub.ingest(Event::new(seq, t_ns, step, phase, kind));
    }

    fn ingest_aggregate(&self, at: (u64, Phase), device: Option<u32>, mut closed: Closed) {
        // The state the step left behind, as the hub's snapshot has it now (in a data-parallel
        // run, the first device's: the snapshot's other domains follow it).
        if let Some(c) = &mut closed.counts {
            c.end = Some(self.hub.with_snapshot(|s| s.end_state()));
        }
        let step = closed.step;
        for kind in closed.kinds() {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
            self.hub.ingest(Event::new(seq, at.0, step, at.1, kind).on_device(device));
        }
    }

    fn dispatch_pending(&self, st: &mut DispatchState) -> usize {
        self.busy.store(true, Ordering::SeqCst);
        let n = self.dispatch_batch(st);
        self.busy.store(false, Ordering::SeqCst);
        n
    }

    fn dispatch_batch(&self, st: &mut DispatchState) -> usize {
        let mut n = 0;
        while let Some(e) = self.queue.pop() {
            let at = (e.t_ns, e.phase);
            // Each device's lane has steps of its own.
            let closer = st.closers.entry(e.device).or_default();
            if let Some(agg) = closer.before(&e) {
                self.ingest_aggregate(at, e.device, agg);
            }
            let after = closer.after(&e);
            let device = e.device;
            self.hub.ingest(e);
            if let Some(agg) = after {
                self.ingest_aggregate(at, device, agg);
            }
            n += 1;
        }
        let dropped = self.dropped.load(Ordering::Relaxed);
        if dropped != st.last_dropped {
            st.last_dropped = dropped;
            self.ingest_own(self.now_ns(), self.step(), self.phase(), EventKind::EventsDropped { total: dropped });
            n += 1;
        }
        if n > 0 {
            self.hub.batch_end();
        }
        n + self.publish_notices()
    }

    /// Publishes what the sinks have to report; they are written with the next batch.
    fn publish_notices(&self) -> usize {
        let notices = self.hub.take_notices();
        for kind in &notices {
            self.ingest_own(self.now_ns(), self.step(), self.phase(), kind.clone());
        }
        notices.len()
    }

    /// The last delivery: what is queued, the open step's copies, and the sinks' last notices.
    fn finish(&self, st: &mut DispatchState) {
        self.dispatch_pending(st);
        for (device, closer) in st.closers.iter_mut() {
            if let Some(agg) = closer.finish() {
                self.ingest_aggregate((self.now_ns(), self.phase()), *device, agg);
            }
        }
        // A flush can fail and have a loss to report, whose write can fail again: twice is
        // enough to get the first report out without looping on a dead disk.
        for _ in 0..2 {
            self.hub.flush();
            if self.publish_notices() == 0 {
                break;
            }
        }
        self.hub.flush();
    }

    fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    fn phase(&self) -> Phase {
        Phase::from_u8(self.phase.load(Ordering::Relaxed))
    }
}

/// What the dispatcher thread remembers between batches.
#[derive(Default)]
struct DispatchState {
    last_dropped: u64,
    /// One per device lane (`None`: a run on one device).
    closers: std::collections::BTreeMap<Option<u32>, StepCloser>,
}

struct Dispatcher {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Dispatcher {
    fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let handle = self
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = handle {
            h.thread().unpark();
            // The dispatcher only panics if a sink does; the events are gone either way.
            let _ = h.join();
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One device's lane of a data-parallel run: its events carry the device, and its step and
/// phase are its own (the devices of a group step together but not in lockstep).
#[derive(Debug)]
struct Lane {
    device: u32,
    step: AtomicU64,
    phase: AtomicU8,
    phase_since_ns: AtomicU64,
}

/// The publishing side. Cheap to clone; every clone publishes into the same run.
///
/// A disabled bus (see [`Bus::disabled`]) allocates nothing and every publish is a no-op.
#[derive(Clone)]
pub struct Bus {
    inner: Option<Arc<Dispatcher>>,
    /// Set on a device's lane ([`Bus::lane`]).
    lane: Option<Arc<Lane>>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            None => f.write_str("Bus(disabled)"),
            Some(d) => f
                .debug_struct("Bus")
                .field("published", &d.shared.seq.load(Ordering::Relaxed))
                .field("dropped", &d.shared.dropped.load(Ordering::Relaxed))
                .finish(),
        }
    }
}

impl Bus {
    /// A bus with a fresh hub and the default queue capacity.
    pub fn new() -> Bus {
        Bus::with_hub(Arc::new(Hub::new()), DEFAULT_QUEUE_CAPACITY)
    }

    /// A bus that feeds `hub`, dropping events beyond `capacity` queued ones.
    pub fn with_hub(hub: Arc<Hub>, capacity: usize) -> Bus {
        let wall_clock_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let shared = Arc::new(Shared {
            queue: ArrayQueue::new(capacity.max(1)),
            seq: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            start: Instant::now(),
            step: AtomicU64::new(0),
            phase: AtomicU8::new(Phase::Idle.to_u8()),
            phase_since_ns: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            hub,
            wall_clock_unix_ms,
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("stagehand-events".into())
            .spawn(move || {
                let mut st = DispatchState::default();
                loop {
                    let n = worker.dispatch_pending(&mut st);
                    if worker.stop.load(Ordering::Acquire) {
                        worker.finish(&mut st);
                        break;
                    }
                    if n == 0 {
                        std::thread::park_timeout(DISPATCH_IDLE);
                    }
                }
            })
            .ok();
        Bus {
            inner: Some(Arc::new(Dispatcher {
                shared,
                thread: Mutex::new(thread),
            })),
            lane: None,
        }
    }

    /// A bus that publishes nothing and costs nothing.
    pub fn disabled() -> Bus {
        Bus { inner: None, lane: None }
    }

    /// Device `device`'s lane of this run: a bus into the same hub whose events carry the
    /// device, with a step and phase of its own (each GPU of a data-parallel group publishes
    /// on its lane).
    pub fn lane(&self, device: u32) -> Bus {
        Bus {
            inner: self.inner.clone(),
            lane: Some(Arc::new(Lane {
                device,
                step: AtomicU64::new(0),
                phase: AtomicU8::new(Phase::Idle.to_u8()),
                phase_since_ns: AtomicU64::new(self.now_ns()),
            })),
        }
    }

    /// The device this bus's events carry (its lane's), if any.
    pub fn device(&self) -> Option<u32> {
        self.lane.as_ref().map(|l| l.device)
    }

    /// The step and phase atomics events are tagged from: the lane's, else the run's.
    fn context_of<'a>(&'a self, s: &'a Shared) -> (&'a AtomicU64, &'a AtomicU8, &'a AtomicU64) {
        match &self.lane {
            Some(l) => (&l.step, &l.phase, &l.phase_since_ns),
            None => (&s.step, &s.phase, &s.phase_since_ns),
        }
    }

    /// Whether events go anywhere.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The hub this bus feeds (None when disabled).
    pub fn hub(&self) -> Option<&Arc<Hub>> {
        self.inner.as_ref().map(|d| &d.shared.hub)
    }

    /// Publishes an event tagged with the current step and phase. Never blocks: if the queue
    /// is full the event is dropped and counted.
    #[inline]
    pub fn publish(&self, kind: EventKind) {
        let Some(d) = &self.inner else { return };
        let s = &d.shared;
        let (step, phase, _) = self.context_of(s);
        let seq = s.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let mut e = Event::new(
            seq,
            s.now_ns(),
            step.load(Ordering::Relaxed),
            Phase::from_u8(phase.load(Ordering::Relaxed)),
            kind,
        );
        if let Some(l) = &self.lane {
            e.device = Some(l.device);
        }
        if s.queue.push(e).is_err() {
            s.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Publishes an event built by `f`, only when the bus is enabled (saves building it).
    #[inline]
    pub fn publish_with(&self, f: impl FnOnce() -> EventKind) {
        if self.inner.is_some() {
            self.publish(f());
        }
    }

    /// Moves the run to `phase` of `step` and publishes the boundary with the duration of the
    /// phase being left.
    pub fn enter_phase(&self, step: u64, phase: Phase) {
        let Some(d) = &self.inner else { return };
        let s = &d.shared;
        let now = s.now_ns();
        let (step_at, phase_at, since_at) = self.context_of(s);
        let from = Phase::from_u8(phase_at.load(Ordering::Relaxed));
        let since = since_at.swap(now, Ordering::Relaxed);
        step_at.store(step, Ordering::Relaxed);
        phase_at.store(phase.to_u8(), Ordering::Relaxed);
        if self.lane.is_some() {
            // The run's own context follows its lanes, so events the dispatcher adds (drops,
            // sinks' notices) carry a recent step.
            s.step.fetch_max(step, Ordering::Relaxed);
        }
        self.publish(EventKind::PhaseChanged {
            from,
            to: phase,
            duration_s: (now.saturating_sub(since)) as f64 / 1e9,
        });
    }

    /// The step and phase events are currently tagged with.
    pub fn context(&self) -> (u64, Phase) {
        match &self.inner {
            None => (0, Phase::Idle),
            Some(d) => {
                let (step, phase, _) = self.context_of(&d.shared);
                (step.load(Ordering::Relaxed), Phase::from_u8(phase.load(Ordering::Relaxed)))
            }
        }
    }

    /// Nanoseconds since the bus was created (the run's clock).
    pub fn now_ns(&self) -> u64 {
        self.inner.as_ref().map_or(0, |d| d.shared.now_ns())
    }

    /// Wall clock at `t_ns == 0`, for the `run_started` event.
    pub fn wall_clock_unix_ms(&self) -> u64 {
        self.inner.as_ref().map_or(0, |d| d.shared.wall_clock_unix_ms)
    }

    /// Events published so far (including dropped ones).
    pub fn published(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |d| d.shared.seq.load(Ordering::Relaxed))
    }

    /// Events dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.inner
            .as_ref()
            .map_or(0, |d| d.shared.dropped.load(Ordering::Relaxed))
    }

    /// Waits until every event published before this call has reached the hub and its sinks.
    pub fn flush(&self) {
        let Some(d) = &self.inner else { return };
        let target = d.shared.seq.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            // Queue empty and no batch under way: the last batch's notices (a flight record
            // written, telemetry lost) are in too.
            if d.shared.queue.is_empty() && !d.shared.busy.load(Ordering::SeqCst) {
                let applied = d.shared.hub.with_snapshot(|s| s.last_seq);
                let dropped = d.shared.dropped.load(Ordering::Relaxed);
                if applied >= target || dropped > 0 {
                    break;
                }
            }
            if let Some(h) = d.thread.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                h.thread().unpark();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        d.shared.hub.flush();
    }

    /// Stops the dispatcher after delivering everything queued. Later publishes are queued but
    /// never delivered. Called automatically when the last clone is dropped.
    pub fn close(&self) {
        if let Some(d) = &self.inner {
            d.stop();
        }
    }
}

impl Default for Bus {
    fn default() -> Self {
        Bus::new()
    }
}

#[cfg(test)]
mod tests;
