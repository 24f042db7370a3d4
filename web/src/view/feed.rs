//! The page's stream: one view built and encoded per interval for every page, shared through a
//! `watch` channel. A page that reads slowly simply gets the newest view when it is ready (it
//! never queues old ones); the log lines it skipped show as a gap in their positions, which the
//! page reports. The ticker runs only while a page is connected.

use super::log::{line, LogLine};
use super::{LogBatch, PageView};
use crate::api::AppState;
use crate::fanout::Encoded;
use stagehand_events::ReplayStatus;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// How often a fresh view goes out (when anything changed).
pub const VIEW_INTERVAL: Duration = Duration::from_millis(200);

/// One view, encoded once, as the ticker sends it and as a new page first gets it.
#[derive(Debug)]
pub(crate) struct ViewFrame {
    index: u64,
    replay: Option<ReplayStatus>,
    /// Position of the newest log line included.
    last_index: u64,
    /// The view with the lines since the previous view.
    pub(crate) tick: Encoded,
    /// The view with every recent line, for a page that just connected.
    pub(crate) first: Encoded,
}

/// The shared side of the page's stream.
#[derive(Debug)]
pub(crate) struct ViewFeed {
    tx: watch::Sender<Option<Arc<ViewFrame>>>,
    /// Whether the ticker runs. Held while a view is built, so builds never interleave.
    running: Mutex<bool>,
}

/// `{"type":"view","view":VIEW,"log":LOG}` around an already encoded view.
fn compose(view: &[u8], log: &LogBatch) -> Encoded {
    let mut json = Vec::with_capacity(view.len() + 256 * log.lines.len() + 64);
    json.extend_from_slice(b"{\"type\":\"view\",\"view\":");
    json.extend_from_slice(view);
    json.extend_from_slice(b",\"log\":");
    if serde_json::to_writer(&mut json, log).is_err() {
        json.extend_from_slice(b"null");
    }
    json.push(b'}');
    Encoded::new("view", &json)
}

impl ViewFeed {
    pub(crate) fn new() -> Arc<ViewFeed> {
        Arc::new(ViewFeed {
            tx: watch::channel(None).0,
            running: Mutex::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Builds a new frame when the stream moved or the replay changed since the last one.
    fn refresh(&self, state: &AppState, _running: &MutexGuard<'_, bool>) {
        let fanout = state.fanout();
        let index = fanout.index();
        let replay = state.replay_driver().map(|d| d.status());
        let prev = self.tx.borrow().clone();
        if prev.as_ref().is_some_and(|p| p.index == index && p.replay == replay) {
            return;
        }
        let view = state
            .hub()
            .with_snapshot(|s| PageView::build(s, state.mode(), replay.as_ref()));
        let Ok(view_json) = serde_json::to_vec(&view) else { return };
        let (recent, restarted_at) = fanout.recent();
        let ring: Vec<LogLine> = recent.iter().map(|(i, e)| line(*i, e)).collect();
        let last_index = ring.last().map_or(index, |l| l.i);
        let tick = match &prev {
            Some(p) if p.last_index >= restarted_at => LogBatch {
                reset: false,
                lines: ring.iter().filter(|l| l.i > p.last_index).cloned().collect(),
            },
            _ => LogBatch { reset: true, lines: ring.clone() },
        };
        let frame = ViewFrame {
            index,
            replay,
            last_index,
            tick: compose(&view_json, &tick),
            first: compose(&view_json, &LogBatch { reset: true, lines: ring }),
        };
        self.tx.send_replace(Some(Arc::new(frame)));
    }

    /// The current view with every recent log line (what `/api/view` answers).
    pub(crate) fn current(&self, state: &AppState) -> Option<Encoded> {
        let running = self.lock();
        self.refresh(state, &running);
        let first = self.tx.borrow().as_ref().map(|f| f.first.clone());
        first
    }

    /// The first message for a new page, and the channel of the views after it. Starts the
    /// ticker if no page was connected.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        state: &AppState,
    ) -> (Option<Encoded>, watch::Receiver<Option<Arc<ViewFrame>>>) {
        let mut running = self.lock();
        self.refresh(state, &running);
        if !*running {
            *running = true;
            tokio::spawn(self.clone().tick(state.clone()));
        }
        let mut rx = self.tx.subscribe();
        let first = rx.borrow_and_update().as_ref().map(|f| f.first.clone());
        (first, rx)
    }

    async fn tick(self: Arc<Self>, state: AppState) {
        let mut interval = tokio::time::interval(VIEW_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut stop = state.shutdown();
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                _ = stop.wait() => break,
            }
            let running = self.lock();
            if self.tx.receiver_count() == 0 {
                break;
            }
            self.refresh(&state, &running);
        }
        *self.lock() = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::AppState;
    use serde_json::Value;
    use stagehand_events::synthetic::{self, SyntheticRun};
    use stagehand_events::Hub;
    use stagehand_exporter::Metrics;

    fn parse(e: &Encoded) -> Value {
        serde_json::from_slice(&e.json()).expect("a view message")
    }

    #[tokio::test]
    async fn views_follow_the_run_with_the_log_lines_since_the_last() {
        let hub = Arc::new(Hub::new());
        let state = AppState::live(hub.clone(), Metrics::new());
        let events = synthetic::events(SyntheticRun::finished(3));
        for e in &events[..100] {
            hub.ingest(e.clone());
        }
        let feed = ViewFeed::new();
        let (first, mut rx) = feed.subscribe(&state);
        let first = parse(&first.expect("a first view"));
        assert_eq!(first["type"], "view");
        assert_eq!(first["view"]["header"]["events_applied"], 100);
        assert_eq!(first["log"]["reset"], true);
        let lines = first["log"]["lines"].as_array().expect("lines");
        assert_eq!(lines.len(), 100);
        let last_i = lines[99]["i"].as_u64().expect("i");

        for e in &events[100..150] {
            hub.ingest(e.clone());
        }
        rx.changed().await.expect("a new view comes");
        let tick = parse(&rx.borrow_and_update().as_ref().expect("a frame").tick);
        assert_eq!(tick["view"]["header"]["events_applied"], 150);
        assert_eq!(tick["log"]["reset"], false);
        let lines = tick["log"]["lines"].as_array().expect("lines");
        assert_eq!(lines.len(), 50, "only the lines since the previous view");
        assert_eq!(lines[0]["i"].as_u64(), Some(last_i + 1));
    }
}
