//! The UI's state: a [`Snapshot`] advanced by the same reducer every consumer uses, a bounded
//! log of recent raw events, and what the source says about itself; plus the view state
//! (which view, selection, filter, overlays). No ratatui here: views render from these.

use crate::keys::Action;
use stagehand::events::*;
use std::collections::VecDeque;
use std::time::Duration;

/// Raw events kept for the Events view.
pub const RECENT_EVENTS: usize = 4096;

/// What a source hands the state. The state cannot tell which source it came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// Start over from this state. `history` replaces the log of recent events when given;
    /// otherwise events newer than the snapshot are dropped from it.
    Reset {
        snapshot: Box<Snapshot>,
        history: Option<Vec<Event>>,
    },
    /// The next event.
    Event(Box<Event>),
    /// The consumer fell behind and missed this many events (a reset follows).
    Lagged(u64),
}

/// How the source is doing, for the header.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum SourceStatus {
    /// Nothing yet.
    #[default]
    Starting,
    /// A live stream: connecting (attempt n, from 1).
    Connecting { url: String, attempt: u32 },
    /// A live stream that is delivering.
    Connected { url: String },
    /// A live stream that failed (attempts in a row so far); it tries again after `retry_in`.
    Disconnected {
        url: String,
        error: String,
        retry_in: Duration,
        attempt: u32,
    },
    /// A replay of a file.
    Replay {
        path: String,
        status: ReplayStatus,
        /// What reading the file skipped ("read ... ; skipped ...").
        report: String,
        skipped: u64,
    },
}

impl SourceStatus {
    /// Whether this is a replay.
    pub fn is_replay(&self) -> bool {
        matches!(self, SourceStatus::Replay { .. })
    }
}

/// The views, in tab order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum View {
    #[default]
    Overview,
    Residency,
    Pools,
    Transfers,
    Activations,
    Conductor,
    Events,
}

impl View {
    /// Every view, in tab order (number keys 1..=7).
    pub const ALL: [View; 7] = [
        View::Overview,
        View::Residency,
        View::Pools,
        View::Transfers,
        View::Activations,
        View::Conductor,
        View::Events,
    ];

    /// The tab title.
    pub fn title(self) -> &'static str {
        match self {
            View::Overview => "Overview",
            View::Residency => "Residency",
            View::Pools => "Pools",
            View::Transfers => "Transfers",
            View::Activations => "Activations",
            View::Conductor => "Conductor",
            View::Events => "Events",
        }
    }

    /// Position in tab order.
    pub fn index(self) -> usize {
        View::ALL.iter().position(|v| *v == self).unwrap_or(0)
    }

    fn offset(self, by: isize) -> View {
        let n = View::ALL.len() as isize;
        View::ALL[(self.index() as isize + by).rem_euclid(n) as usize]
    }
}

/// A filter over events (Events view) and blocks (Residency view), typed after `/`.
///
/// Words are ANDed: `kind:resid` (kind name contains), `block:3`, `step:2` or `step:2-4`; a bare
/// word matches the kind name, or for blocks the block name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filter {
    pub text: String,
    kinds: Vec<String>,
    words: Vec<String>,
    block: Option<u32>,
    steps: Option<(u64, u64)>,
    /// Words that did not parse, shown so a typo is visible.
    pub invalid: Vec<String>,
}

impl Filter {
    /// Parses a filter; an empty text matches everything.
    pub fn parse(text: &str) -> Filter {
        let mut f = Filter {
            text: text.trim().to_owned(),
            ..Default::default()
        };
        for word in text.split_whitespace() {
            let lower = word.to_ascii_lowercase();
            if let Some(k) = lower.strip_prefix("kind:") {
                f.kinds.push(k.to_owned());
            } else if let Some(b) = lower.strip_prefix("block:") {
                match b.parse() {
                    Ok(n) => f.block = Some(n),
                    Err(_) => f.invalid.push(word.to_owned()),
                }
            } else if let Some(s) = lower.strip_prefix("step:") {
                let range = match s.split_once('-') {
                    Some((a, b)) => a.parse().ok().zip(b.parse().ok()),
                    None => s.parse().ok().map(|n| (n, n)),
                };
                match range {
                    Some(r) => f.steps = Some(r),
                    None => f.invalid.push(word.to_owned()),
                }
            } else {
                f.words.push(lower);
            }
        }
        f
    }

    /// True when the filter lets everything through.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Whether an event passes.
    pub fn matches_event(&self, e: &Event) -> bool {
        let name = e.kind.name();
        self.kinds.iter().all(|k| name.contains(k.as_str()))
            && self.words.iter().all(|w| name.contains(w.as_str()))
            && self.block.is_none_or(|b| e.kind.block() == Some(BlockId(b)))
            && self.steps.is_none_or(|(a, b)| (a..=b).contains(&e.step))
    }

    /// Whether a block passes (the Residency view).
    pub fn matches_block(&self, b: &snapshot::BlockView) -> bool {
        self.block.is_none_or(|id| b.id == BlockId(id))
            && self
                .words
                .iter()
                .all(|w| b.name.to_ascii_lowercase().contains(w.as_str()) || b.state.as_str().contains(w.as_str()))
            && self.kinds.iter().all(|k| b.state.as_str().contains(k.as_str()))
    }
}

/// What an overlay on top of a view shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detail {
    /// A block, by id.
    Block(BlockId),
    /// An event, by sequence number.
    Event(u64),
}

/// Which view is shown and how.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ViewState {
    pub view: View,
    /// Selected row in the Residency view (index into the filtered blocks).
    pub block_sel: usize,
    /// Selected row in the Events view (index into the filtered events), when not following.
    pub event_sel: Option<usize>,
    pub filter: Filter,
    /// The filter being typed after `/`, if any.
    pub filter_input: Option<String>,
    pub detail: Option<Detail>,
    pub help: bool,
    pub quit: bool,
}

/// What a key asks of the source (pause, seek, speed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Control {
    TogglePause,
    StepEvents(i64),
    StepTraining(i64),
    SeekFraction(f64),
    Faster,
    Slower,
    ToStart,
    ToEnd,
}

/// Everything the UI draws from.
#[derive(Debug, Clone, Default)]
pub struct State {
    pub snapshot: Snapshot,
    /// The most recent raw events, oldest first, at most [`RECENT_EVENTS`].
    pub recent: VecDeque<Event>,
    pub source: SourceStatus,
    /// Whether the source is paused (live: display frozen; replay: playback stopped).
    pub paused: bool,
    /// Events missed by falling behind the live stream, in all.
    pub lagged: u64,
    /// Resets (snapshots) received: the first, then one per resync or seek.
    pub resets: u64,
}

impl State {
    /// An empty state.
    pub fn new() -> State {
        State::default()
    }

    /// Applies what the source sent.
    pub fn ingest(&mut self, u: Update) {
        match u {
            Update::Event(e) => {
                self.snapshot.apply(&e);
                if self.recent.len() == RECENT_EVENTS {
                    self.recent.pop_front();
                }
                self.recent.push_back(*e);
            }
            Update::Reset { snapshot, history } => {
                self.snapshot = *snapshot;
                self.resets += 1;
                match history {
                    Some(h) => {
                        let skip = h.len().saturating_sub(RECENT_EVENTS);
                        self.recent = h.into_iter().skip(skip).collect();
                    }
                    None => {
                        let last = self.snapshot.last_seq;
                        while self.recent.back().is_some_and(|e| e.seq > last) {
                            self.recent.pop_back();
                        }
                    }
                }
            }
            Update::Lagged(n) => self.lagged += n,
        }
    }

    /// The events the filter lets through, oldest first.
    pub fn filtered_events<'a>(&'a self, f: &'a Filter) -> impl Iterator<Item = &'a Event> + 'a {
        self.recent.iter().filter(move |e| f.matches_event(e))
    }

    /// The blocks the filter lets through.
    pub fn filtered_blocks<'a>(
        &'a self,
        f: &'a Filter,
    ) -> impl Iterator<Item = &'a snapshot::BlockView> + 'a {
        self.snapshot.blocks.iter().filter(move |b| f.matches_block(b))
    }

    /// The last step with train metrics, for step time and throughput.
    pub fn last_train(&self) -> Option<(u64, &TrainStepMetrics)> {
        self.snapshot
            .steps
            .iter()
            .rev()
            .find_map(|r| r.train.as_ref().map(|t| (r.step, t)))
    }

    /// Stall time over the run, weights and activations, in ms.
    pub fn stall_ms(&self) -> f64 {
        self.snapshot.weights.stall_time_ms + self.snapshot.activations.stall_time_ms
    }
}

impl ViewState {
    /// Applies a key's action to the view state. Returns what it asks of the source, if anything.
    pub fn apply(&mut self, a: Action, state: &State) -> Option<Control> {
        match a {
            Action::Quit => self.quit = true,
            Action::Help => self.help = !self.help,
            Action::NextView => self.switch(self.view.offset(1)),
            Action::PrevView => self.switch(self.view.offset(-1)),
            Action::GoView(v) => self.switch(v),
            Action::Up(n) => self.move_sel(state, -(n as i64)),
            Action::Down(n) => self.move_sel(state, n as i64),
            Action::Top => self.move_sel(state, i64::MIN / 2),
            Action::Bottom => match self.view {
                View::Events => self.event_sel = None,
                _ => self.move_sel(state, i64::MAX / 2),
            },
            Action::Enter => self.detail = self.selected_detail(state),
            Action::Back => {
                if self.help {
                    self.help = false;
                } else if self.detail.is_some() {
                    self.detail = None;
                } else if !self.filter.is_empty() {
                    self.filter = Filter::default();
                    self.block_sel = 0;
                    self.event_sel = None;
                }
            }
            Action::StartFilter => self.filter_input = Some(self.filter.text.clone()),
            Action::FilterChar(c) => {
                if let Some(s) = &mut self.filter_input {
                    s.push(c);
                }
            }
            Action::FilterBackspace => {
                if let Some(s) = &mut self.filter_input {
                    s.pop();
                }
            }
            Action::FilterCommit => {
                if let Some(s) = self.filter_input.take() {
                    self.filter = Filter::parse(&s);
                    self.block_sel = 0;
                    self.event_sel = None;
                }
            }
            Action::FilterCancel => self.filter_input = None,
            Action::Control(c) => return Some(c),
        }
        None
    }

    fn switch(&mut self, v: View) {
        self.view = v;
        self.detail = None;
        self.help = false;
    }

    fn move_sel(&mut self, state: &State, by: i64) {
        match self.view {
            View::Residency => {
                let n = state.filtered_blocks(&self.filter).count();
                self.block_sel = clamp_move(self.block_sel, by, n);
            }
            View::Events => {
                let n = state.filtered_events(&self.filter).count();
                if n == 0 {
                    self.event_sel = None;
                    return;
                }
                let cur = self.event_sel.unwrap_or(n - 1).min(n - 1);
                let next = clamp_move(cur, by, n);
                // Moving to the last row goes back to following the tail.
                self.event_sel = if next + 1 == n && by > 0 { None } else { Some(next) };
            }
            _ => {}
        }
    }

    /// The detail that `Enter` opens in the current view.
    fn selected_detail(&self, state: &State) -> Option<Detail> {
        match self.view {
            View::Residency => state
                .filtered_blocks(&self.filter)
                .nth(self.block_sel)
                .map(|b| Detail::Block(b.id)),
            View::Events => {
                let events: Vec<&Event> = state.filtered_events(&self.filter).collect();
                let i = self.event_sel.unwrap_or(events.len().saturating_sub(1));
                events.get(i).map(|e| Detail::Event(e.seq))
            }
            _ => None,
        }
    }
}

fn clamp_move(cur: usize, by: i64, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    (cur as i64).saturating_add(by).clamp(0, n as i64 - 1) as usize
}

/// Bytes as "48.0 MiB".
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Nanoseconds since the run started as "12.345 s".
pub fn fmt_t(t_ns: u64) -> String {
    format!("{:.3} s", t_ns as f64 / 1e9)
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Hints as "h2d<=1 d2h<=2 window<=1 no-spec".
pub fn fmt_hints(h: &Hints) -> String {
    let mut s = format!(
        "h2d<={} d2h<={} window<={}",
        opt(h.max_inflight_h2d),
        opt(h.max_inflight_d2h),
        opt(h.prefetch_window_cap)
    );
    if h.suppress_speculative {
        s.push_str(" no-speculative");
    }
    s
}


/// One line saying what an event says, for the Events log.
pub fn describe(k: &EventKind) -> String {
    use EventKind::*;
    match k {
        RunStarted { run_id, model, device, .. } => format!("{run_id}: {model} on {}", device.name),
        RunEnded { steps } => format!("after {steps} steps"),
        PhaseChanged { from, to, duration_s } => {
            format!("{from} -> {to} ({:.1} ms)", duration_s * 1e3)
        }
        BlockRegistered { block, name, bytes, trainable, .. } => format!(
            "#{block} {name} {}{}",
            fmt_bytes(*bytes),
            if *trainable { " trainable" } else { "" }
        ),
        ItineraryLearned { order } => format!("{} blocks", order.len()),
        Residency { block, from, to, refcount } => {
            format!("#{block} {from} -> {to} ref={refcount}")
        }
        PrefetchHit { block } => format!("#{block}"),
        PrefetchMiss { block, stall_ms } => format!("#{block} stalled {stall_ms:.2} ms"),
        Eviction { block, reason, score, bytes } => format!(
            "#{block} {} {} score {score:.2e}",
            stagehand::events::wire_name(reason),
            fmt_bytes(*bytes)
        ),
        PrefetchWindow { cursor, backward, window } => format!(
            "cursor {cursor}{} window {:?}",
            if *backward { " (backward)" } else { "" },
            window.iter().map(|b| b.0).collect::<Vec<_>>()
        ),
        Protection { block, protected } => format!(
            "#{block} {}",
            if *protected { "protected" } else { "unprotected" }
        ),
        TransferIssued { id, dir, owner, bytes, subject } => format!(
            "{} #{id} {} {} {subject}",
            dir.as_str(),
            owner.as_str(),
            fmt_bytes(*bytes)
        ),
        TransferCompleted { id, dir, owner, bytes, duration_ms } => format!(
            "{} #{id} {} {} in {duration_ms:.2} ms",
            dir.as_str(),
            owner.as_str(),
            fmt_bytes(*bytes)
        ),
        PoolConfigured { pool, classes, pinned } => format!(
            "{} {} classes{}",
            stagehand::events::wire_name(pool),
            classes.len(),
            if *pinned { " pinned" } else { "" }
        ),
        SlabAcquired { pool, class, slab, waited_ms, .. } => {
            format!("{} class {class} slab {slab} waited {waited_ms:.2} ms", stagehand::events::wire_name(pool))
        }
        SlabReleased { pool, class, slab } => format!("{} class {class} slab {slab}", stagehand::events::wire_name(pool)),
        PoolExhausted { pool, class, requested_bytes } => format!(
            "{} class {class} wanted {}",
            stagehand::events::wire_name(pool),
            fmt_bytes(*requested_bytes)
        ),
        PageableFallback { pool, bytes } => format!("{} {}", stagehand::events::wire_name(pool), fmt_bytes(*bytes)),
        Pack { tensor, decision, reason, bytes, .. } => format!(
            "t{tensor} {}{} {}",
            stagehand::events::wire_name(decision),
            reason.map(|r| format!(" ({})", stagehand::events::wire_name(&r))).unwrap_or_default(),
            fmt_bytes(*bytes)
        ),
        SpillFinalized { tensor, bytes, inline } => format!(
            "t{tensor} {}{}",
            fmt_bytes(*bytes),
            if *inline { " inline" } else { "" }
        ),
        Restored { tensor, bytes, predicted, stall_ms } => format!(
            "t{tensor} {}{} stall {stall_ms:.2} ms",
            fmt_bytes(*bytes),
            if *predicted { " predicted" } else { "" }
        ),
        SpillingToggled { on, vram_allocated_bytes } => format!(
            "{} at {}",
            if *on { "on" } else { "off" },
            fmt_bytes(*vram_allocated_bytes)
        ),
        Reservation { id, owner, mode, priority, requested_bytes, granted_bytes, outcome, reason, .. } => {
            format!(
                "r{id} {} {} {} {}/{} {}{}",
                owner.as_str(),
                stagehand::events::wire_name(mode),
                stagehand::events::wire_name(priority),
                fmt_bytes(*granted_bytes),
                fmt_bytes(*requested_bytes),
                stagehand::events::wire_name(outcome),
                reason.map(|r| format!(" ({})", r.as_str())).unwrap_or_default()
            )
        }
        ReservationReleased { id, bytes } => format!("r{id} {}", fmt_bytes(*bytes)),
        SlotGranted { dir, owner, speculative, inflight } => format!(
            "{} {}{} inflight {inflight}",
            dir.as_str(),
            owner.as_str(),
            if *speculative { " speculative" } else { "" }
        ),
        SlotDenied { dir, owner, speculative, reason } => format!(
            "{} {}{} {}",
            dir.as_str(),
            owner.as_str(),
            if *speculative { " speculative" } else { "" },
            reason.as_str()
        ),
        SlotReleased { dir, owner, inflight } => {
            format!("{} {} inflight {inflight}", dir.as_str(), owner.as_str())
        }
        HintsChanged { hints, rule } => format!("{}: {}", stagehand::events::wire_name(rule), fmt_hints(hints)),
        VramSample { allocated_bytes, reserved_bytes, .. } => format!(
            "{} allocated, {} reserved",
            fmt_bytes(*allocated_bytes),
            fmt_bytes(*reserved_bytes)
        ),
        WeightStep(m) => format!(
            "hits {} misses {} stall {:.1} ms",
            m.prefetch_hits, m.prefetch_misses, m.stall_time_ms
        ),
        ActivationStep(m) => format!(
            "saved {} spilled {} restored {}",
            m.activations_saved, m.activations_spilled, m.activations_restored
        ),
        ConductorStep(m) => format!(
            "grants {} partial {} denied {}",
            m.grant_count, m.partial_count, m.deny_count
        ),
        TrainStep(m) => format!("loss {:.4} in {:.1} ms", m.loss, m.step_time_s * 1e3),
        Warning { source, message } => format!("{}: {message}", source.as_str()),
        EventsDropped { total } => format!("{total} dropped so far"),
        LimitsSet { owner, budget_bytes, high_watermark_bytes, low_watermark_bytes } => {
            let mut s = format!("{} budget {}", owner.as_str(), fmt_bytes(*budget_bytes));
            if let Some(h) = high_watermark_bytes {
                s.push_str(&format!(", high {}", fmt_bytes(*h)));
            }
            if let Some(l) = low_watermark_bytes {
                s.push_str(&format!(", low {}", fmt_bytes(*l)));
            }
            s
        }
        VramOwners(o) => format!(
            "weights {} kept {} restored {} in flight {} other {}",
            fmt_bytes(o.weights_bytes),
            fmt_bytes(o.activations_kept_bytes),
            fmt_bytes(o.activations_restored_bytes),
            fmt_bytes(o.copies_in_flight_bytes),
            fmt_bytes(o.other_bytes)
        ),
        OutOfMemory { requested_bytes, doing, .. } => {
            format!("out of memory asking {} while {doing}", fmt_bytes(*requested_bytes))
        }
        ItineraryChanged { order, first_difference, .. } => {
            format!("retraced: {} blocks, differs from position {first_difference}", order.len())
        }
        TransferStep(m) => format!(
            "h2d {} copies {}, d2h {} copies {}",
            m.h2d.count,
            fmt_bytes(m.h2d.bytes),
            m.d2h.count,
            fmt_bytes(m.d2h.bytes)
        ),
        StepTime(t) => format!(
            "{:.1} ms: compute {:.1}, h2d wait {:.1}, d2h wait {:.1}, stalls {:.1}, optimizer {:.1}",
            t.step_ms,
            t.compute_ms,
            t.h2d_wait_ms,
            t.d2h_wait_ms,
            t.weight_stall_ms + t.restore_stall_ms,
            t.optimizer_ms
        ),
        TelemetryLost { sink, lost, reason, .. } => format!("{sink} lost {lost} events: {reason}"),
        NonFinite { block, tensor } => match block {
            Some(b) => format!("non-finite {tensor} in block {b}"),
            None => format!("non-finite {tensor}"),
        },
        FlightRecorded { reason, path, events } => format!("{events} events to {path} ({reason})"),
    }
}

/// The wire name of a policy rule.
pub fn rule_name(r: PolicyRule) -> &'static str {
    match r {
        PolicyRule::Reset => "reset",
        PolicyRule::BackwardPressure => "backward_pressure",
        PolicyRule::OptimizerProtection => "optimizer_protection",
        PolicyRule::Contention => "contention",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand::events::synthetic::{events, SyntheticRun};

    fn fed() -> (State, Vec<Event>) {
        let ev = events(SyntheticRun::default());
        let mut s = State::new();
        for e in &ev {
            s.ingest(Update::Event(Box::new(e.clone())));
        }
        (s, ev)
    }

    #[test]
    fn ingesting_events_matches_the_shared_reducer() {
        let (s, ev) = fed();
        assert_eq!(s.snapshot, Snapshot::from_events(&ev));
        assert_eq!(s.recent.len(), ev.len().min(RECENT_EVENTS));
        assert_eq!(s.recent.back().map(|e| e.seq), ev.last().map(|e| e.seq));
    }

    #[test]
    fn recent_events_stay_bounded() {
        let ev = events(SyntheticRun { blocks: 16, steps: 40, end_mid_step: false });
        assert!(ev.len() > RECENT_EVENTS);
        let mut s = State::new();
        for e in &ev {
            s.ingest(Update::Event(Box::new(e.clone())));
        }
        assert_eq!(s.recent.len(), RECENT_EVENTS);
        assert_eq!(s.recent.front().map(|e| e.seq), Some(ev[ev.len() - RECENT_EVENTS].seq));
    }

    #[test]
    fn a_reset_without_history_drops_events_newer_than_the_snapshot() {
        let (mut s, ev) = fed();
        let back = Snapshot::from_events(&ev[..50]);
        s.ingest(Update::Reset { snapshot: Box::new(back.clone()), history: None });
        assert_eq!(s.snapshot, back);
        assert_eq!(s.recent.back().map(|e| e.seq), Some(50));
        assert_eq!(s.resets, 1);
        s.ingest(Update::Reset { snapshot: Box::new(back), history: Some(ev[40..50].to_vec()) });
        assert_eq!(s.recent.len(), 10);
        s.ingest(Update::Lagged(7));
        s.ingest(Update::Lagged(3));
        assert_eq!(s.lagged, 10);
    }

    #[test]
    fn filters_by_kind_block_and_step() {
        let (s, _) = fed();
        let f = Filter::parse("kind:residency block:2 step:1-2");
        let hits: Vec<&Event> = s.filtered_events(&f).collect();
        assert!(!hits.is_empty());
        for e in &hits {
            assert_eq!(e.kind.name(), "residency");
            assert_eq!(e.kind.block(), Some(BlockId(2)));
            assert!((1..=2).contains(&e.step));
        }
        let bare = Filter::parse("dropped");
        assert_eq!(s.filtered_events(&bare).count(), 1);
        let bad = Filter::parse("block:x step:");
        assert_eq!(bad.invalid, vec!["block:x".to_owned(), "step:".to_owned()]);
        assert!(Filter::parse("  ").is_empty());
        let blocks = Filter::parse("blocks.1");
        assert!(s.filtered_blocks(&blocks).all(|b| b.name.contains("blocks.1")));
        assert!(s.filtered_blocks(&Filter::parse("gpu_ready")).all(|b| b.state == BlockState::GpuReady));
    }

    #[test]
    fn view_actions_move_selection_and_open_details() {
        let (s, _) = fed();
        let mut v = ViewState::default();
        v.apply(Action::GoView(View::Residency), &s);
        v.apply(Action::Down(3), &s);
        assert_eq!(v.block_sel, 3);
        v.apply(Action::Down(100), &s);
        assert_eq!(v.block_sel, s.snapshot.blocks.len() - 1);
        v.apply(Action::Top, &s);
        assert_eq!(v.block_sel, 0);
        v.apply(Action::Enter, &s);
        assert_eq!(v.detail, Some(Detail::Block(BlockId(0))));
        v.apply(Action::Back, &s);
        assert_eq!(v.detail, None);

        v.apply(Action::NextView, &s);
        assert_eq!(v.view, View::Pools);
        v.apply(Action::GoView(View::Events), &s);
        assert_eq!(v.event_sel, None, "follows the tail");
        v.apply(Action::Up(1), &s);
        let n = s.recent.len();
        assert_eq!(v.event_sel, Some(n - 2));
        v.apply(Action::Enter, &s);
        assert_eq!(v.detail, Some(Detail::Event(s.recent[n - 2].seq)));
        v.apply(Action::Down(1), &s);
        assert_eq!(v.event_sel, None, "back at the tail follows again");
        v.apply(Action::NextView, &s);
        assert_eq!(v.view, View::Overview, "tab wraps around");
        v.apply(Action::PrevView, &s);
        assert_eq!(v.view, View::Events);
    }

    #[test]
    fn filter_typing_commits_and_escape_clears() {
        let (s, _) = fed();
        let mut v = ViewState::default();
        v.apply(Action::StartFilter, &s);
        for c in "kind:pack".chars() {
            v.apply(Action::FilterChar(c), &s);
        }
        v.apply(Action::FilterChar('x'), &s);
        v.apply(Action::FilterBackspace, &s);
        assert_eq!(v.filter_input.as_deref(), Some("kind:pack"));
        v.apply(Action::FilterCommit, &s);
        assert_eq!(v.filter_input, None);
        assert_eq!(v.filter.text, "kind:pack");
        assert!(s.filtered_events(&v.filter).all(|e| e.kind.name() == "pack"));
        v.apply(Action::Back, &s);
        assert!(v.filter.is_empty());
        v.apply(Action::StartFilter, &s);
        v.apply(Action::FilterChar('z'), &s);
        v.apply(Action::FilterCancel, &s);
        assert!(v.filter.is_empty() && v.filter_input.is_none());
    }

    #[test]
    fn source_controls_pass_through_and_quit_sets_the_flag() {
        let s = State::new();
        let mut v = ViewState::default();
        assert_eq!(v.apply(Action::Control(Control::Faster), &s), Some(Control::Faster));
        assert_eq!(v.apply(Action::Help, &s), None);
        assert!(v.help);
        v.apply(Action::Back, &s);
        assert!(!v.help);
        v.apply(Action::Quit, &s);
        assert!(v.quit);
    }

    #[test]
    fn formats_sizes_and_describes_events() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(48 << 20), "48.0 MiB");
        let d = describe(&EventKind::Residency {
            block: BlockId(3),
            from: BlockState::Prefetching,
            to: BlockState::GpuReady,
            refcount: 1,
        });
        assert_eq!(d, "#3 prefetching -> gpu_ready ref=1");
        let h = fmt_hints(&Hints { max_inflight_h2d: Some(1), suppress_speculative: true, ..Default::default() });
        assert_eq!(h, "h2d<=1 d2h<=- window<=- no-speculative");
    }
}
