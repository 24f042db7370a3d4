//! Follows a telemetry file that is still being written (`--replay FILE --follow`) on a
//! background thread, through the runtime's [`Follower`]: plain or zstd, across rotated
//! segments, and started over (with a notice) when the file is truncated or replaced. Events
//! come over in batches: the first ones at once, then the rest of what is already on disk in
//! parts with the progress, then whatever the run appends.
//!
//! A file is as untrusted as a server: events whose ids would make the state allocate without
//! bound are refused as they are read and counted in the report.

use stagehand::events::jsonl::{Follower, JsonlError, ReadReport, Restart, SkipReason};
use stagehand::events::Event;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::Duration;

/// Bytes read for the first batch (small, so the first screen comes at once).
const FIRST_READ: u64 = 256 << 10;
/// Bytes read per batch after it, while catching up with the file.
const READ: u64 = 4 << 20;
/// How often a caught-up file is checked for new lines.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// What the loader has read since the last batch.
#[derive(Debug)]
pub struct Batch {
    pub events: Vec<Event>,
    /// The report of everything read since the last restart.
    pub report: ReadReport,
    pub bytes_read: u64,
    /// Everything on disk has been read (following goes on after it).
    pub caught_up: bool,
    /// The file started over: `events` begin a new run, and what came before is gone.
    pub restarted: Option<Restart>,
    /// Reading failed; nothing more comes.
    pub error: Option<String>,
}

/// The UI's end of a loader.
#[derive(Debug)]
pub struct Loader {
    rx: Receiver<Batch>,
    stop: Arc<AtomicBool>,
}

impl Loader {
    /// Starts following `path` on a thread; fails at once when the file cannot be opened.
    pub fn follow(path: &Path) -> Result<Loader, JsonlError> {
        let follower = Follower::open(path)?;
        // Two batches in flight at most: the reader waits for the UI rather than piling up.
        let (tx, rx) = sync_channel(2);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::Builder::new()
            .name("stagehand-top-follow".into())
            .spawn(move || run(follower, tx, s))
            .map_err(|e| JsonlError::Io { path: path.to_path_buf(), source: e })?;
        Ok(Loader { rx, stop })
    }

    /// The batches that are ready, without waiting.
    pub fn try_batches(&mut self) -> Vec<Batch> {
        let mut out = Vec::new();
        while let Ok(b) = self.rx.try_recv() {
            out.push(b);
        }
        out
    }

    /// The next batch, waiting for it; `None` once the loader has ended.
    pub fn wait_batch(&mut self) -> Option<Batch> {
        self.rx.recv().ok()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The events the state may apply; the others are counted in `refused`.
pub(super) fn vet(events: Vec<Event>, refused: &mut ReadReport) -> Vec<Event> {
    events
        .into_iter()
        .filter(|e| match super::live::vet_event(e) {
            Ok(()) => true,
            Err(why) => {
                refused.skip(0, SkipReason::InvalidValue, format!("implausible: {why}"));
                false
            }
        })
        .collect()
}

/// `read` with the refused events counted as skipped rather than read.
pub(super) fn with_refusals(read: &ReadReport, refused: &ReadReport) -> ReadReport {
    let mut r = read.clone();
    r.events = r.events.saturating_sub(refused.skipped_total);
    r.merge(refused);
    r
}

fn run(mut follower: Follower, tx: SyncSender<Batch>, stop: Arc<AtomicBool>) {
    let mut refused = ReadReport::default();
    let mut first = true;
    let mut was_caught_up = false;
    while !stop.load(Ordering::Relaxed) {
        let polled = follower.poll_limited(if first { FIRST_READ } else { READ });
        first = false;
        let polled = match polled {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.send(Batch {
                    events: Vec::new(),
                    report: with_refusals(follower.report(), &refused),
                    bytes_read: follower.bytes_read(),
                    caught_up: true,
                    restarted: None,
                    error: Some(e.to_string()),
                });
                return;
            }
        };
        if polled.restarted.is_some() {
            refused = ReadReport::default();
        }
        let events = vet(polled.events, &mut refused);
        let caught_up = follower.caught_up();
        let news = !events.is_empty() || polled.restarted.is_some() || caught_up != was_caught_up;
        if news {
            let batch = Batch {
                events,
                report: with_refusals(follower.report(), &refused),
                bytes_read: follower.bytes_read(),
                caught_up,
                restarted: polled.restarted,
                error: None,
            };
            if tx.send(batch).is_err() {
                return;
            }
        }
        was_caught_up = caught_up;
        if caught_up {
            std::thread::sleep(FOLLOW_EVERY);
        }
    }
}
