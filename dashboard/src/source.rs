//! Where events come from: a run's live SSE stream, or a replayed telemetry file. Both implement
//! [`Source`] and hand the state the same [`Update`]s, so nothing downstream can tell them apart.

use crate::app::{Control, SourceStatus, Update, RECENT_EVENTS};
use stagehand::events::jsonl::{self, Follower, ReadReport, Restart};
use stagehand::events::replay::{Change, FileReplay, Played};
use stagehand::events::{Event, Replay, Snapshot, StreamMessage, DEFAULT_SERVER_ADDR};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Errors of the sources.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A telemetry file could not be read.
    #[error(transparent)]
    Jsonl(#[from] jsonl::JsonlError),
    /// A `--connect` address that is not an http URL.
    #[error("unsupported address '{0}': expected http://HOST:PORT[/api/stream] or HOST:PORT")]
    BadUrl(String),
}

/// A feed of updates for the state.
pub trait Source {
    /// Appends what arrived (or came due) since the last call.
    fn poll(&mut self, now: Instant, out: &mut Vec<Update>);
    /// Pause, seek, speed. Controls a source cannot honour are ignored.
    fn control(&mut self, c: Control, out: &mut Vec<Update>);
    /// How the source is doing, for the header.
    fn status(&self) -> SourceStatus;
    /// Whether the source is paused.
    fn paused(&self) -> bool;
}

// ---- SSE ----------------------------------------------------------------------------------

/// One Server-Sent Events message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseMessage {
    pub event: String,
    pub data: String,
}

/// Turns SSE lines into messages (the subset the protocol uses: `event:`, `data:`, comments).
#[derive(Debug, Default)]
pub struct SseParser {
    event: String,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds one line (without its line ending); returns a message when a blank line ends one.
    pub fn line(&mut self, line: &str) -> Option<SseMessage> {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() {
            if self.data.is_empty() {
                self.event.clear();
                return None;
            }
            let msg = SseMessage {
                event: std::mem::take(&mut self.event),
                data: std::mem::take(&mut self.data).join("\n"),
            };
            return Some(msg);
        }
        if line.starts_with(':') {
            return None; // a comment: keep-alive
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => self.event = value.to_owned(),
            "data" => self.data.push(value.to_owned()),
            _ => {} // id, retry: not used by this protocol
        }
        None
    }
}

/// Decodes one message of the stream into an update.
pub fn decode(msg: &SseMessage) -> Result<Update, String> {
    let m: StreamMessage = match serde_json::from_str(&msg.data) {
        Ok(m) => m,
        // Be lenient with a server that sends the payload without the `type` tag.
        Err(tagged) => match msg.event.as_str() {
            "event" => StreamMessage::Event {
                event: serde_json::from_str(&msg.data).map_err(|e| e.to_string())?,
            },
            "snapshot" => StreamMessage::Snapshot {
                snapshot: serde_json::from_str(&msg.data).map_err(|e| e.to_string())?,
            },
            _ => return Err(format!("'{}' message: {tagged}", msg.event)),
        },
    };
    Ok(match m {
        StreamMessage::Snapshot { snapshot } => Update::Reset {
            snapshot,
            history: None,
        },
        StreamMessage::Event { event } => Update::Event(event),
        StreamMessage::Lagged { missed } => Update::Lagged(missed),
    })
}

/// The stream URL for a `--connect` argument: `HOST:PORT`, `http://HOST:PORT` or a full URL.
pub fn stream_url(arg: Option<&str>) -> Result<String, Error> {
    let arg = arg.unwrap_or(DEFAULT_SERVER_ADDR).trim();
    let with_scheme = if arg.contains("://") {
        arg.to_owned()
    } else {
        format!("http://{arg}")
    };
    let Some(rest) = with_scheme.strip_prefix("http://") else {
        return Err(Error::BadUrl(arg.to_owned()));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(Error::BadUrl(arg.to_owned()));
    }
    Ok(match rest.split_once('/') {
        Some((_, path)) if !path.is_empty() => with_scheme,
        Some((host, _)) => format!("http://{host}/api/stream"),
        None => format!("{with_scheme}/api/stream"),
    })
}

/// Exponential back-off between reconnection attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(8),
        }
    }
}

impl Backoff {
    /// Wait after failed attempt `attempt` (from 1): initial, doubled each time, capped.
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(16);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

/// Updates buffered between the reader thread and the UI. When the UI pauses (stops draining),
/// the reader blocks, the server sees a slow client and later sends `lagged` and a snapshot.
const CHANNEL: usize = 65_536;

/// A run's live SSE stream, read on a background thread that reconnects with back-off.
#[derive(Debug)]
pub struct LiveSource {
    rx: Receiver<Update>,
    status: Arc<Mutex<SourceStatus>>,
    stop: Arc<AtomicBool>,
    paused: bool,
}

impl LiveSource {
    /// Starts reading `url` (see [`stream_url`]).
    pub fn connect(url: String, backoff: Backoff) -> LiveSource {
        let (tx, rx) = sync_channel(CHANNEL);
        let status = Arc::new(Mutex::new(SourceStatus::Connecting {
            url: url.clone(),
            attempt: 1,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (status.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("stagehand-top-sse".into())
            .spawn(move || read_loop(url, backoff, tx, st, sp));
        if let Err(e) = spawned {
            set(&status, SourceStatus::Disconnected {
                url: String::new(),
                error: format!("cannot start the reader thread: {e}"),
                retry_in: Duration::ZERO,
                attempt: 0,
            });
        }
        LiveSource {
            rx,
            status,
            stop,
            paused: false,
        }
    }
}

impl Drop for LiveSource {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn set(status: &Mutex<SourceStatus>, s: SourceStatus) {
    // A poisoned lock only means a panic elsewhere; the status is still a plain value.
    let mut g = status.lock().unwrap_or_else(|p| p.into_inner());
    *g = s;
}

fn read_loop(
    url: String,
    backoff: Backoff,
    tx: SyncSender<Update>,
    status: Arc<Mutex<SourceStatus>>,
    stop: Arc<AtomicBool>,
) {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(3))
        .build();
    let mut attempt = 0u32;
    while !stop.load(Ordering::Relaxed) {
        attempt += 1;
        set(&status, SourceStatus::Connecting {
            url: url.clone(),
            attempt,
        });
        let error = match agent
            .get(&url)
            .set("Accept", "text/event-stream")
            .call()
        {
            Ok(resp) => {
                set(&status, SourceStatus::Connected { url: url.clone() });
                attempt = 0;
                let mut parser = SseParser::default();
                let mut reader = BufReader::new(resp.into_reader());
                let mut line = String::new();
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) => break "the server closed the stream".to_owned(),
                        Ok(_) => {}
                        Err(e) => break format!("reading the stream: {e}"),
                    }
                    let Some(msg) = parser.line(line.trim_end_matches('\n')) else {
                        continue;
                    };
                    // A message this version cannot read is skipped, like an unknown JSONL line.
                    if let Ok(u) = decode(&msg) {
                        if tx.send(u).is_err() {
                            return; // the UI is gone
                        }
                    }
                }
            }
            Err(e) => e.to_string(),
        };
        // A stream that was up counts as one failed attempt: retry quickly first.
        let attempt_now = attempt.max(1);
        let wait = backoff.delay(attempt_now);
        set(&status, SourceStatus::Disconnected {
            url: url.clone(),
            error,
            retry_in: wait,
            attempt: attempt_now,
        });
        let until = Instant::now() + wait;
        while Instant::now() < until {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Source for LiveSource {
    fn poll(&mut self, now: Instant, out: &mut Vec<Update>) {
        if self.paused {
            return;
        }
        // Bounded by time so a flood never starves drawing and keys.
        let budget = now + Duration::from_millis(30);
        while let Ok(u) = self.rx.try_recv() {
            out.push(u);
            if out.len() % 1024 == 0 && Instant::now() > budget {
                break;
            }
        }
    }

    fn control(&mut self, c: Control, _out: &mut Vec<Update>) {
        if c == Control::TogglePause {
            self.paused = !self.paused;
        }
    }

    fn status(&self) -> SourceStatus {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn paused(&self) -> bool {
        self.paused
    }
}

// ---- replay -------------------------------------------------------------------------------

/// Files up to this size are indexed before the first frame (a fraction of a second); larger
/// ones show their start at once and index in the background.
const INDEX_BEFORE_SHOWING: u64 = 16 << 20;

/// How often a followed file is read for new lines.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// A telemetry file played through [`Replay`], optionally followed as it grows.
#[derive(Debug)]
pub struct ReplaySource {
    replay: Replay,
    /// A file that is not followed plays from disk through its index instead of `replay`, so a
    /// large file shows its first screen at once.
    file: Option<FileReplay>,
    path: PathBuf,
    report: ReadReport,
    follower: Option<Follower>,
    last_follow: Option<Instant>,
    error: Option<String>,
    /// Why a followed file was replayed from a new start, shown until the source ends.
    restarted: Option<String>,
}

impl ReplaySource {
    /// Reads `path` (following it when `follow`), ready to play from the start.
    pub fn open(path: &Path, follow: bool) -> Result<ReplaySource, Error> {
        let (events, report, follower, file) = if follow {
            let mut f = Follower::open(path)?;
            let events = f.poll()?.events;
            (events, f.report().clone(), Some(f), None)
        } else {
            let file = FileReplay::open(path)?;
            // A small file is indexed before the first frame, so its header shows the total.
            if std::fs::metadata(path).map_or(0, |m| m.len()) <= INDEX_BEFORE_SHOWING {
                file.wait_indexed();
            }
            (Vec::new(), file.report().0, None, Some(file))
        };
        let mut replay = Replay::new(events);
        replay.set_following(follow);
        Ok(ReplaySource {
            replay,
            file,
            path: path.to_path_buf(),
            report,
            follower,
            last_follow: None,
            error: None,
            restarted: None,
        })
    }

    /// A replay of events already in memory (tests, benchmarks, `--demo`).
    pub fn from_events(events: Vec<Event>, label: &str) -> ReplaySource {
        let report = ReadReport {
            lines: events.len() as u64,
            events: events.len() as u64,
            ..Default::default()
        };
        ReplaySource {
            replay: Replay::new(events),
            file: None,
            path: PathBuf::from(label),
            report,
            follower: None,
            last_follow: None,
            error: None,
            restarted: None,
        }
    }

    /// Sets the playback speed and whether to start paused.
    pub fn configure(&mut self, speed: f64, paused: bool) {
        self.replay.set_speed(speed);
        self.replay.set_paused(paused);
        if let Some(f) = &mut self.file {
            f.set_speed(speed);
            f.set_paused(paused);
        }
    }

    /// The replay controller.
    pub fn replay(&self) -> &Replay {
        &self.replay
    }

    /// What reading the file found so far.
    pub fn report(&self) -> &ReadReport {
        &self.report
    }

    fn push_played(&mut self, played: Result<Played, jsonl::JsonlError>, out: &mut Vec<Update>) {
        let Some(f) = &self.file else { return };
        match played {
            Ok(Played::None) => {}
            Ok(Played::Advanced(v)) if v.len() <= RECENT_EVENTS => {
                out.extend(v.into_iter().map(|e| Update::Event(Box::new(e))));
            }
            Ok(Played::Advanced(_) | Played::Reset) => out.push(Update::Reset {
                snapshot: Box::new(f.snapshot().clone()),
                history: Some(f.recent().iter().cloned().collect()),
            }),
            Err(e) => self.error = Some(e.to_string()),
        }
    }

    fn control_file(&mut self, c: Control, out: &mut Vec<Update>) {
        let Some(f) = &mut self.file else { return };
        let played = match c {
            Control::TogglePause => {
                f.toggle_pause();
                Ok(Played::None)
            }
            Control::StepEvents(n) => f.step_events(n),
            Control::StepTraining(n) => f.step_training(n),
            Control::SeekFraction(d) => {
                let at = if f.is_empty() { 0.0 } else { f.position() as f64 / f.len() as f64 };
                f.seek_fraction(at + d)
            }
            Control::Faster => {
                f.faster();
                Ok(Played::None)
            }
            Control::Slower => {
                f.slower();
                Ok(Played::None)
            }
            Control::ToStart => f.to_start(),
            Control::ToEnd => f.to_end(),
        };
        self.push_played(played, out);
    }

    fn push_change(&self, change: Change, out: &mut Vec<Update>) {
        let events = self.replay.events();
        match change {
            Change::None => {}
            // A long jump forward resyncs from the replay's snapshot rather than re-applying.
            Change::Advanced(r) if r.len() <= RECENT_EVENTS => {
                out.extend(events[r].iter().map(|e| Update::Event(Box::new(e.clone()))));
            }
            Change::Advanced(_) | Change::Reset => {
                let pos = self.replay.position();
                out.push(Update::Reset {
                    snapshot: Box::new(self.replay.snapshot().clone()),
                    history: Some(events[pos.saturating_sub(RECENT_EVENTS)..pos].to_vec()),
                });
            }
        }
    }
}

impl Source for ReplaySource {
    fn poll(&mut self, now: Instant, out: &mut Vec<Update>) {
        if let Some(f) = &mut self.file {
            let (report, error) = f.report();
            self.report = report;
            if error.is_some() {
                self.error = error;
            }
            let played = f.tick(now);
            return self.push_played(played, out);
        }
        let mut reset = false;
        if let Some(f) = &mut self.follower {
            if self.last_follow.is_none_or(|t| now.duration_since(t) >= FOLLOW_EVERY) {
                self.last_follow = Some(now);
                match f.poll() {
                    Ok(polled) => {
                        if let Some(why) = polled.restarted {
                            // Another run now: start over rather than merge it into the last.
                            let (speed, paused) = (self.replay.speed(), self.replay.paused());
                            self.replay = Replay::new(polled.events);
                            self.replay.set_following(true);
                            self.replay.set_speed(speed);
                            self.replay.set_paused(paused);
                            self.restarted = Some(format!(
                                "the file was {} and is replayed from its new start",
                                match why {
                                    Restart::Truncated => "truncated and rewritten",
                                    Restart::Replaced => "replaced",
                                }
                            ));
                            reset = true;
                        } else if !polled.events.is_empty() {
                            self.replay.append(polled.events);
                        }
                        self.report = f.report().clone();
                        self.error = None;
                    }
                    Err(e) => self.error = Some(e.to_string()),
                }
            }
        }
        if reset {
            self.push_change(Change::Reset, out);
        }
        let change = self.replay.tick(now);
        self.push_change(change, out);
    }

    fn control(&mut self, c: Control, out: &mut Vec<Update>) {
        if self.file.is_some() {
            return self.control_file(c, out);
        }
        let r = &mut self.replay;
        let change = match c {
            Control::TogglePause => {
                r.toggle_pause();
                Change::None
            }
            Control::StepEvents(n) => r.step_events(n),
            Control::StepTraining(n) => r.step_training(n),
            Control::SeekFraction(d) => {
                let at = if r.is_empty() { 0.0 } else { r.position() as f64 / r.len() as f64 };
                r.seek_fraction(at + d)
            }
            Control::Faster => {
                r.faster();
                Change::None
            }
            Control::Slower => {
                r.slower();
                Change::None
            }
            Control::ToStart => r.to_start(),
            Control::ToEnd => r.to_end(),
        };
        self.push_change(change, out);
    }

    fn status(&self) -> SourceStatus {
        let mut report = self.report.summary();
        if let Some(e) = &self.error {
            report.push_str(&format!("; {e}"));
        }
        if let Some(r) = &self.restarted {
            report.push_str(&format!("; {r}"));
        }
        SourceStatus::Replay {
            path: self.path.display().to_string(),
            status: self.file.as_ref().map_or_else(|| self.replay.status(), FileReplay::status),
            report,
            skipped: self.report.skipped_total,
        }
    }

    fn paused(&self) -> bool {
        self.file.as_ref().map_or_else(|| self.replay.paused(), FileReplay::paused)
    }
}

/// The state a replay source shows after `n` events, for tests: the replay's own snapshot.
pub fn replay_snapshot(src: &ReplaySource) -> &Snapshot {
    src.file.as_ref().map_or_else(|| src.replay.snapshot(), FileReplay::snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::State;
    use stagehand::events::synthetic::{events, SyntheticRun};

    #[test]
    fn sse_lines_make_messages() {
        let mut p = SseParser::default();
        assert_eq!(p.line(": keep-alive"), None);
        assert_eq!(p.line("event: lagged"), None);
        assert_eq!(p.line("data: {\"type\":\"lagged\",\"missed\":4}\r"), None);
        let m = p.line("").expect("a blank line ends a message");
        assert_eq!(m.event, "lagged");
        assert_eq!(decode(&m), Ok(Update::Lagged(4)));
        assert_eq!(p.line(""), None, "a lone blank line is nothing");
        p.line("data:a");
        p.line("data: b");
        assert_eq!(p.line("").map(|m| m.data), Some("a\nb".to_owned()));
    }

    #[test]
    fn decodes_tagged_and_untagged_payloads() {
        let e = events(SyntheticRun::default()).remove(5);
        let tagged = serde_json::to_string(&StreamMessage::Event { event: Box::new(e.clone()) })
            .expect("serializes");
        let m = SseMessage { event: "event".into(), data: tagged };
        assert_eq!(decode(&m), Ok(Update::Event(Box::new(e.clone()))));
        let bare = SseMessage {
            event: "event".into(),
            data: serde_json::to_string(&e).expect("serializes"),
        };
        assert_eq!(decode(&bare), Ok(Update::Event(Box::new(e))));
        assert!(decode(&SseMessage { event: "event".into(), data: "{nope".into() }).is_err());
    }

    #[test]
    fn connect_arguments_become_stream_urls() {
        assert_eq!(stream_url(None).ok().as_deref(), Some("http://127.0.0.1:7878/api/stream"));
        assert_eq!(
            stream_url(Some("localhost:9000")).ok().as_deref(),
            Some("http://localhost:9000/api/stream")
        );
        assert_eq!(
            stream_url(Some("http://h:1/")).ok().as_deref(),
            Some("http://h:1/api/stream")
        );
        assert_eq!(
            stream_url(Some("http://h:1/custom/sse")).ok().as_deref(),
            Some("http://h:1/custom/sse")
        );
        assert!(stream_url(Some("https://h:1")).is_err());
        assert!(stream_url(Some("http://")).is_err());
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let b = Backoff::default();
        assert_eq!(b.delay(1), Duration::from_millis(250));
        assert_eq!(b.delay(2), Duration::from_millis(500));
        assert_eq!(b.delay(4), Duration::from_secs(2));
        assert_eq!(b.delay(10), Duration::from_secs(8));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(8));
    }

    fn drive(src: &mut ReplaySource, c: Control, state: &mut State) {
        let mut out = Vec::new();
        src.control(c, &mut out);
        for u in out {
            state.ingest(u);
        }
        assert_eq!(&state.snapshot, replay_snapshot(src), "after {c:?}");
    }

    #[test]
    fn replay_controls_keep_the_state_equal_to_the_replay() {
        let ev = events(SyntheticRun::default());
        let mut src = ReplaySource::from_events(ev.clone(), "mem");
        let mut state = State::new();
        drive(&mut src, Control::StepTraining(1), &mut state);
        assert_eq!(state.snapshot.step, 1);
        drive(&mut src, Control::StepEvents(5), &mut state);
        drive(&mut src, Control::StepEvents(-3), &mut state);
        assert_eq!(state.recent.back().map(|e| e.seq), Some(src.replay().position() as u64));
        drive(&mut src, Control::StepTraining(1), &mut state);
        assert_eq!(state.snapshot.step, 2);
        drive(&mut src, Control::StepTraining(-1), &mut state);
        assert_eq!(state.snapshot.step, 1);
        drive(&mut src, Control::SeekFraction(0.5), &mut state);
        drive(&mut src, Control::ToEnd, &mut state);
        assert_eq!(state.snapshot, Snapshot::from_events(&ev));
        drive(&mut src, Control::ToStart, &mut state);
        assert_eq!(state.snapshot.events_applied, 0);
        assert!(state.recent.is_empty());
        assert!(src.paused());
        drive(&mut src, Control::Faster, &mut state);
        assert_eq!(src.replay().speed(), 2.0);
        drive(&mut src, Control::Slower, &mut state);
        drive(&mut src, Control::Slower, &mut state);
        assert_eq!(src.replay().speed(), 0.5);
        drive(&mut src, Control::TogglePause, &mut state);
        assert!(!src.paused());
    }

    #[test]
    fn replay_plays_over_time() {
        let ev = events(SyntheticRun::default());
        let mut src = ReplaySource::from_events(ev.clone(), "mem");
        let mut state = State::new();
        let t0 = Instant::now();
        let mut out = Vec::new();
        src.poll(t0, &mut out);
        // The whole synthetic run lasts well under a minute of recorded time.
        src.poll(t0 + Duration::from_secs(60), &mut out);
        for u in out {
            state.ingest(u);
        }
        assert_eq!(state.snapshot, Snapshot::from_events(&ev));
        match src.status() {
            SourceStatus::Replay { status, skipped, .. } => {
                assert_eq!(status.position, ev.len());
                assert_eq!(skipped, 0);
            }
            other => panic!("not a replay status: {other:?}"),
        }
    }

    #[test]
    fn a_followed_file_rewritten_with_another_run_starts_over_and_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("live.jsonl");
        let first = events(SyntheticRun { blocks: 6, steps: 2, end_mid_step: false });
        let text = |ev: &[Event]| ev.iter().map(|e| serde_json::to_string(e).expect("json") + "\n").collect::<String>();
        std::fs::write(&path, text(&first)).expect("writes");
        let mut src = ReplaySource::open(&path, true).expect("opens");
        src.configure(1024.0, false);
        let mut state = State::new();
        let t0 = Instant::now();
        let mut out = Vec::new();
        src.poll(t0, &mut out);
        src.poll(t0 + Duration::from_secs(60), &mut out);
        for u in out.drain(..) {
            state.ingest(u);
        }
        assert_eq!(state.snapshot.blocks.len(), 6);
        // The writer starts another run in the same file, longer than the first.
        let second = events(SyntheticRun { blocks: 3, steps: 4, end_mid_step: false });
        std::fs::write(&path, text(&second)).expect("rewrites");
        let t1 = t0 + Duration::from_secs(61);
        src.poll(t1, &mut out);
        src.poll(t1 + Duration::from_secs(60), &mut out);
        for u in out.drain(..) {
            state.ingest(u);
        }
        assert_eq!(state.snapshot, Snapshot::from_events(&second), "the second run alone, not merged");
        match src.status() {
            SourceStatus::Replay { report, .. } => {
                assert!(report.contains("truncated and rewritten"), "{report}")
            }
            other => panic!("not a replay status: {other:?}"),
        }
    }
}
