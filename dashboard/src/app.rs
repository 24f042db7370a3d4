//! The UI's state: a [`Snapshot`] advanced by the same reducer every consumer uses, a bounded
//! log of recent raw events, and what the source says about itself; plus the view state
//! (which view, selection, filter, overlays). No ratatui here: views render from these.

use crate::filter::Filter;
use crate::keys::Action;
use crate::sort::{self, Sorts, TableId};
use stagehand_events::*;
use std::collections::VecDeque;
use std::time::Duration;

/// Raw events kept for the Events view and its filter (a few hundred steps of a full-detail
/// demo run; about 10 MiB at most). The view says which sequence numbers it searches.
pub const RECENT_EVENTS: usize = 1 << 16;

/// What a source hands the state. The state cannot tell which source it came from.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceUpdate {
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
    /// A run's live stream.
    Live(LiveStatus),
    /// A replay of a file.
    Replay(ReplayInfo),
}

impl SourceStatus {
    /// Whether this is a replay.
    pub fn is_replay(&self) -> bool {
        matches!(self, SourceStatus::Replay(_))
    }
}

/// A live stream: where from, the state of the connection, and what it skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveStatus {
    pub url: String,
    pub link: Link,
    /// Messages the source refused (over the size bound, unreadable, implausible).
    pub skipped: Skipped,
}

/// The state of a live connection.
#[derive(Debug, Clone, PartialEq)]
pub enum Link {
    /// Connecting (attempt n, from 1).
    Connecting { attempt: u32 },
    /// Delivering.
    Connected,
    /// Failed `attempt` times in a row; tries again in `retry_in` (counting down).
    Disconnected {
        /// Why, without the URL (the header shows it once).
        error: String,
        retry_in: Duration,
        attempt: u32,
    },
}

/// Messages of a live stream that were skipped rather than applied, by why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Skipped {
    /// Over the line or message size bound.
    pub oversize: u64,
    /// Not UTF-8, not JSON, or not a message of the protocol.
    pub unreadable: u64,
    /// Well-formed but with numbers no run produces (ids that would allocate without bound).
    pub implausible: u64,
}

impl Skipped {
    /// All skipped messages.
    pub fn total(&self) -> u64 {
        self.oversize.saturating_add(self.unreadable).saturating_add(self.implausible)
    }
}

/// A replay of a file.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayInfo {
    pub path: String,
    pub status: ReplayStatus,
    /// What reading the file skipped ("read ... ; skipped ...").
    pub report: String,
    pub skipped: u64,
    /// While the file is still being read: how far.
    pub loading: Option<Loading>,
}

/// How far reading a file has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loading {
    pub bytes_read: u64,
    /// The file's size when reading started.
    pub total_bytes: u64,
    pub events: u64,
}

/// The views, in tab order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum View {
    #[default]
    Overview,
    /// Why a step is slow: each step's time, part by part, and the findings.
    Time,
    /// Where VRAM went: by owner now, over the step, at the step's peak.
    Memory,
    Residency,
    Pools,
    Transfers,
    Activations,
    Conductor,
    Events,
}

impl View {
    /// Every view, in tab order (number keys 1..=9).
    pub const ALL: [View; 9] = [
        View::Overview,
        View::Time,
        View::Memory,
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
            View::Time => "Step time",
            View::Memory => "VRAM",
            View::Residency => "Residency",
            View::Pools => "Pools",
            View::Transfers => "Transfers",
            View::Activations => "Activations",
            View::Conductor => "Conductor",
            View::Events => "Events",
        }
    }

    /// The tab title where the full ones do not fit.
    pub fn short_title(self) -> &'static str {
        match self {
            View::Overview => "Over",
            View::Time => "Time",
            View::Memory => "VRAM",
            View::Residency => "Resid",
            View::Pools => "Pools",
            View::Transfers => "Xfer",
            View::Activations => "Act",
            View::Conductor => "Cond",
            View::Events => "Events",
        }
    }

    /// The sortable table of this view, if it has one.
    pub fn table(self) -> Option<TableId> {
        match self {
            View::Residency => Some(TableId::Blocks),
            View::Time => Some(TableId::StepTimes),
            View::Transfers => Some(TableId::Transfers),
            View::Activations => Some(TableId::ActivationSteps),
            View::Conductor => Some(TableId::Denials),
            _ => None,
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
    /// The order of each sortable table.
    pub sorts: Sorts,
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
    pub fn ingest(&mut self, u: SourceUpdate) {
        match u {
            SourceUpdate::Event(e) => {
                self.snapshot.apply(&e);
                if self.recent.len() == RECENT_EVENTS {
                    self.recent.pop_front();
                }
                self.recent.push_back(*e);
            }
            SourceUpdate::Reset { snapshot, history } => {
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
            // A number the server sent: saturate rather than overflow.
            SourceUpdate::Lagged(n) => self.lagged = self.lagged.saturating_add(n),
        }
    }

    /// The events the filter lets through, oldest first.
    pub fn filtered_events<'a>(&'a self, f: &'a Filter) -> impl Iterator<Item = &'a Event> + 'a {
        self.recent.iter().filter(move |e| f.matches_event(e))
    }

    /// The blocks the filter lets through, in the table's order.
    pub fn sorted_blocks(&self, f: &Filter, sorts: &Sorts) -> Vec<&snapshot::BlockView> {
        let rows = self.snapshot.blocks.iter().filter(|b| f.matches_block(b)).collect();
        sort::sorted(rows, sorts.get(TableId::Blocks), sort::block_key)
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
        self.snapshot.weights.stall_time_ms + self.snapshot.activations.counts.stall_time_ms
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
            Action::SortNext => {
                if let Some(t) = self.view.table() {
                    self.sorts.next_column(t);
                    self.block_sel = 0;
                }
            }
            Action::SortReverse => {
                if let Some(t) = self.view.table() {
                    self.sorts.reverse(t);
                    self.block_sel = 0;
                }
            }
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
                let n = state.sorted_blocks(&self.filter, &self.sorts).len();
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
                .sorted_blocks(&self.filter, &self.sorts)
                .get(self.block_sel)
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

#[cfg(test)]
mod tests;
