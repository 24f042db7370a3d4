//! What the web page shows, computed here from the snapshot: the page renders it and keeps no
//! reducer of its own, so it cannot disagree with the API, `stagehand-top` or the exporters.
//!
//! [`PageView`] holds only what the page shows, with bounded histories and rounded figures. It
//! goes out on `/api/view/stream` at most every `VIEW_INTERVAL`, built and
//! encoded once for every page, with the log lines of the events since the previous one.

pub(crate) mod feed;
pub mod figures;
pub mod insight;
pub mod log;
pub mod panels;

use crate::api::Mode;
use figures::round;
use insight::{FindingView, OwnersPanel, StepTimePanel};
use log::LogLine;
use panels::{ActivationsPanel, ConductorPanel, GpuPanel, Header, PoolPanel, ResidencyPanel, TransfersPanel, VramPanel};
use serde::Serialize;
use stagehand_events::{ReplayStatus, Snapshot};

/// Where a replay is, as its controls show it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ReplayPanel {
    /// Events applied.
    pub position: usize,
    pub total: usize,
    pub paused: bool,
    /// The playback speed in force (1 = as recorded).
    pub speed: f64,
    /// Replay time and the file's end, seconds since the run started.
    pub t_s: f64,
    pub end_t_s: f64,
    pub step: u64,
}

impl From<&ReplayStatus> for ReplayPanel {
    fn from(r: &ReplayStatus) -> ReplayPanel {
        ReplayPanel {
            position: r.position,
            total: r.total,
            paused: r.paused,
            speed: r.speed,
            t_s: round(r.t_ns as f64 / 1e9, 3),
            end_t_s: round(r.end_t_ns as f64 / 1e9, 3),
            step: r.step,
        }
    }
}

/// Everything the page shows.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct PageView {
    pub mode: Mode,
    pub header: Header,
    /// What is off and which knob fixes it, most severe first.
    pub findings: Vec<FindingView>,
    /// What to say when there are no findings (so far, or in the whole ended run).
    pub findings_note: String,
    pub vram: VramPanel,
    pub step_time: StepTimePanel,
    pub owners: OwnersPanel,
    pub residency: ResidencyPanel,
    pub pools: Vec<PoolPanel>,
    pub transfers: TransfersPanel,
    pub activations: ActivationsPanel,
    pub conductor: ConductorPanel,
    /// A data-parallel run's GPUs, each its lane (empty on one device; the other panels then
    /// follow the first GPU).
    pub gpus: Vec<GpuPanel>,
    pub replay: Option<ReplayPanel>,
}

impl PageView {
    /// The view of `s`.
    pub fn build(s: &Snapshot, mode: Mode, replay: Option<&ReplayStatus>) -> PageView {
        PageView {
            mode,
            header: panels::header(s),
            findings: insight::findings(s),
            findings_note: stagehand_events::insight::nothing_found(s).to_owned(),
            vram: panels::vram(s),
            step_time: insight::step_time(s),
            owners: insight::owners(s),
            residency: panels::residency(s),
            pools: panels::pools(s),
            transfers: panels::transfers(s),
            activations: panels::activations(s),
            conductor: panels::conductor(s),
            gpus: panels::gpus(s),
            replay: replay.map(ReplayPanel::from),
        }
    }
}

/// Log lines that come with a view.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LogBatch {
    /// Drop the lines you have: these start over (a new client, or a replay seek).
    pub reset: bool,
    /// Oldest first. Lines whose `i` does not follow the previous line's are events not shown.
    pub lines: Vec<LogLine>,
}

/// One message of `/api/view/stream` (and the body of `/api/view`): `{"type": "view", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ViewMessage {
    /// Always `"view"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub view: PageView,
    pub log: LogBatch,
}
