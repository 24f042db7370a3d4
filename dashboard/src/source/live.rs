//! A run's live SSE stream, read on a background thread that reconnects with back-off.
//!
//! The server is not trusted: lines and messages are bounded ([`super::sse`]), a message that
//! does not decode or whose numbers no run produces is skipped and counted, and the updates
//! waiting for the UI are bounded in bytes, so a server that floods cannot grow the process.

use super::auth::Auth;
use super::sse::{Item, Limits, LineReader, Skip, SseMessage, SseParser};
use super::Source;
use crate::app::{Control, Link, LiveStatus, Skipped, SourceStatus, SourceUpdate};
use stagehand_events::{Event, EventKind, Snapshot, StreamMessage};
use std::io::BufReader;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Updates buffered between the reader thread and the UI. When the UI pauses (stops draining),
/// the reader blocks, the server sees a slow client and later sends `lagged` and a snapshot.
const CHANNEL: usize = 65_536;
/// Bytes of messages waiting for the UI before the reader stops reading.
const MAX_QUEUED_BYTES: usize = 256 << 20;
/// Block ids at or above this are not a run's (a million blocks): they would make the reducer
/// allocate without bound.
pub const MAX_BLOCK_ID: u32 = 1 << 20;
/// Pool size classes at or above this are not a run's.
pub const MAX_POOL_CLASS: u32 = 1 << 10;

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

/// Why a decoded message is not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not a message of the protocol (not JSON, or not the shape of one).
    Unreadable(String),
    /// Well-formed, but with numbers no run produces.
    Implausible(String),
}

/// Decodes one message of the stream into an update, refusing what the state must not apply.
pub fn decode(msg: &SseMessage) -> Result<SourceUpdate, Refusal> {
    let m: StreamMessage = match serde_json::from_str(&msg.data) {
        Ok(m) => m,
        // Be lenient with a server that sends the payload without the `type` tag.
        Err(tagged) => {
            let bad = |e: serde_json::Error| Refusal::Unreadable(e.to_string());
            match msg.event.as_str() {
                "event" => StreamMessage::Event { event: serde_json::from_str(&msg.data).map_err(bad)? },
                "snapshot" => StreamMessage::Snapshot { snapshot: serde_json::from_str(&msg.data).map_err(bad)? },
                _ => return Err(Refusal::Unreadable(format!("'{}' message: {tagged}", msg.event))),
            }
        }
    };
    Ok(match m {
        StreamMessage::Snapshot { snapshot } => {
            vet_snapshot(&snapshot).map_err(Refusal::Implausible)?;
            SourceUpdate::Reset { snapshot, history: None }
        }
        StreamMessage::Event { event } => {
            vet_event(&event).map_err(Refusal::Implausible)?;
            SourceUpdate::Event(event)
        }
        StreamMessage::Lagged { missed } => SourceUpdate::Lagged(missed),
    })
}

/// Refuses an event whose ids would make the shared reducer allocate without bound (it sizes
/// the block table by block id and a pool's classes by class index).
pub fn vet_event(e: &Event) -> Result<(), String> {
    match &e.kind {
        EventKind::BlockRegistered { block, .. } if block.0 >= MAX_BLOCK_ID => {
            Err(format!("block id {block} (at most {MAX_BLOCK_ID})"))
        }
        EventKind::SlabAcquired { class, .. }
        | EventKind::SlabReleased { class, .. }
        | EventKind::PoolExhausted { class, .. }
            if *class >= MAX_POOL_CLASS =>
        {
            Err(format!("pool class {class} (at most {MAX_POOL_CLASS})"))
        }
        EventKind::PoolConfigured { classes, .. } if classes.len() >= MAX_POOL_CLASS as usize => {
            Err(format!("{} pool classes (at most {MAX_POOL_CLASS})", classes.len()))
        }
        _ => Ok(()),
    }
}

/// Refuses a snapshot that events could not have built.
pub fn vet_snapshot(s: &Snapshot) -> Result<(), String> {
    if s.blocks.len() > MAX_BLOCK_ID as usize {
        return Err(format!("{} blocks (at most {MAX_BLOCK_ID})", s.blocks.len()));
    }
    for p in [&s.weight_pool, &s.activation_pool].into_iter().flatten() {
        if p.classes.len() > MAX_POOL_CLASS as usize {
            return Err(format!("{} pool classes (at most {MAX_POOL_CLASS})", p.classes.len()));
        }
    }
    Ok(())
}

/// What the reader thread shares with the UI.
#[derive(Debug)]
struct Shared {
    url: String,
    link: Mutex<(Link, Option<Instant>)>,
    skipped: Mutex<Skipped>,
    queued: AtomicUsize,
    stop: AtomicBool,
}

impl Shared {
    fn set_link(&self, link: Link, retry_at: Option<Instant>) {
        // A poisoned lock only means a panic elsewhere; the status is still a plain value.
        *self.link.lock().unwrap_or_else(|p| p.into_inner()) = (link, retry_at);
    }

    fn count(&self, f: impl FnOnce(&mut Skipped)) {
        f(&mut self.skipped.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// A run's live SSE stream, read on a background thread that reconnects with back-off.
#[derive(Debug)]
pub struct LiveSource {
    rx: Receiver<(SourceUpdate, usize)>,
    shared: Arc<Shared>,
    paused: bool,
}

impl LiveSource {
    /// Starts reading `url` (see [`super::stream_url`]).
    pub fn connect(url: String, backoff: Backoff) -> LiveSource {
        LiveSource::connect_with(url, backoff, Limits::default(), Auth::none())
    }

    /// Starts reading `url` with these bounds on lines and messages, sending the token and
    /// checking the server's certificate as `auth` says.
    pub fn connect_with(url: String, backoff: Backoff, limits: Limits, auth: Auth) -> LiveSource {
        let (tx, rx) = sync_channel(CHANNEL);
        let shared = Arc::new(Shared {
            url: url.clone(),
            link: Mutex::new((Link::Connecting { attempt: 1 }, None)),
            skipped: Mutex::new(Skipped::default()),
            queued: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("stagehand-top-sse".into())
            .spawn(move || read_loop(url, backoff, limits, auth, tx, sh));
        if let Err(e) = spawned {
            shared.set_link(
                Link::Disconnected {
                    error: format!("cannot start the reader thread: {e}"),
                    retry_in: Duration::ZERO,
                    attempt: 0,
                },
                None,
            );
        }
        LiveSource { rx, shared, paused: false }
    }

    /// Bytes of messages the reader has queued and the view has not taken yet (what a pause
    /// holds back).
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }
}

impl Drop for LiveSource {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

/// Why a request failed, without the URL (the header shows it once).
fn reason(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Status(code, r) => format!("the server answered {code} {}", r.status_text()),
        ureq::Error::Transport(t) => {
            let mut s = t.kind().to_string();
            if let Some(m) = t.message() {
                s.push_str(": ");
                s.push_str(m);
            }
            if let Some(src) = std::error::Error::source(t) {
                s.push_str(": ");
                s.push_str(&src.to_string());
            }
            s
        }
    }
}

/// Reads one connection's stream until it ends; returns why it ended.
fn read_stream(resp: ureq::Response, limits: Limits, tx: &SyncSender<(SourceUpdate, usize)>, sh: &Shared) -> Option<String> {
    let mut reader = LineReader::new(BufReader::new(resp.into_reader()), limits.max_line);
    let mut parser = SseParser::new(limits);
    let mut buf = Vec::new();
    loop {
        if sh.stop.load(Ordering::Relaxed) {
            return None;
        }
        let info = match reader.next_line(&mut buf) {
            Ok(Some(info)) => info,
            Ok(None) => return Some("the server closed the stream".to_owned()),
            Err(e) => return Some(format!("reading the stream: {e}")),
        };
        let msg = match parser.line(&buf, info) {
            None => continue,
            Some(Item::Skipped(Skip::Oversize)) => {
                sh.count(|s| s.oversize += 1);
                continue;
            }
            Some(Item::Skipped(Skip::NotUtf8)) => {
                sh.count(|s| s.unreadable += 1);
                continue;
            }
            Some(Item::Message(m)) => m,
        };
        let update = match decode(&msg) {
            Ok(u) => u,
            Err(Refusal::Unreadable(_)) => {
                sh.count(|s| s.unreadable += 1);
                continue;
            }
            Err(Refusal::Implausible(_)) => {
                sh.count(|s| s.implausible += 1);
                continue;
            }
        };
        // Hold at most MAX_QUEUED_BYTES for the UI: wait while it catches up.
        let size = msg.data.len();
        while sh.queued.load(Ordering::Relaxed) > MAX_QUEUED_BYTES {
            if sh.stop.load(Ordering::Relaxed) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        sh.queued.fetch_add(size, Ordering::Relaxed);
        if tx.send((update, size)).is_err() {
            return None; // the UI is gone
        }
    }
}

fn read_loop(url: String, backoff: Backoff, limits: Limits, auth: Auth, tx: SyncSender<(SourceUpdate, usize)>, sh: Arc<Shared>) {
    let agent = auth.agent();
    let authorization = auth.header();
    let mut attempt = 0u32;
    while !sh.stop.load(Ordering::Relaxed) {
        attempt = attempt.saturating_add(1);
        sh.set_link(Link::Connecting { attempt }, None);
        let mut request = agent.get(&url).set("Accept", "text/event-stream");
        if let Some(a) = &authorization {
            request = request.set("Authorization", a);
        }
        let error = match request.call() {
            Ok(resp) => {
                sh.set_link(Link::Connected, None);
                attempt = 0;
                match read_stream(resp, limits, &tx, &sh) {
                    Some(why) => why,
                    None => return,
                }
            }
            Err(e) => reason(&e),
        };
        // A stream that was up counts as one failed attempt: retry quickly first.
        let attempt_now = attempt.max(1);
        let wait = backoff.delay(attempt_now);
        let until = Instant::now() + wait;
        sh.set_link(Link::Disconnected { error, retry_in: wait, attempt: attempt_now }, Some(until));
        while Instant::now() < until {
            if sh.stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Source for LiveSource {
    fn poll(&mut self, now: Instant, out: &mut Vec<SourceUpdate>) {
        if self.paused {
            return;
        }
        // Bounded by time so a flood never starves drawing and keys.
        let budget = now + Duration::from_millis(30);
        while let Ok((u, size)) = self.rx.try_recv() {
            self.shared.queued.fetch_sub(size, Ordering::Relaxed);
            out.push(u);
            if out.len() % 1024 == 0 && Instant::now() > budget {
                break;
            }
        }
    }

    fn control(&mut self, c: Control, _out: &mut Vec<SourceUpdate>) {
        if c == Control::TogglePause {
            self.paused = !self.paused;
        }
    }

    fn status(&self) -> SourceStatus {
        let (mut link, retry_at) = self.shared.link.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // The countdown: time left until the next attempt, as of now.
        if let (Link::Disconnected { retry_in, .. }, Some(at)) = (&mut link, retry_at) {
            *retry_in = at.saturating_duration_since(Instant::now());
        }
        SourceStatus::Live(LiveStatus {
            url: self.shared.url.clone(),
            link,
            skipped: *self.shared.skipped.lock().unwrap_or_else(|p| p.into_inner()),
        })
    }

    fn paused(&self) -> bool {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_events::synthetic::{events, SyntheticRun};
    use stagehand_events::{BlockId, Phase, PoolKind, SlabId};

    #[test]
    fn decodes_tagged_and_untagged_payloads() {
        let e = events(SyntheticRun::default()).remove(5);
        let tagged = serde_json::to_string(&StreamMessage::Event { event: Box::new(e.clone()) }).expect("serializes");
        let m = SseMessage { event: "event".into(), data: tagged };
        assert_eq!(decode(&m), Ok(SourceUpdate::Event(Box::new(e.clone()))));
        let bare = SseMessage { event: "event".into(), data: serde_json::to_string(&e).expect("serializes") };
        assert_eq!(decode(&bare), Ok(SourceUpdate::Event(Box::new(e))));
        assert!(matches!(
            decode(&SseMessage { event: "event".into(), data: "{nope".into() }),
            Err(Refusal::Unreadable(_))
        ));
    }

    #[test]
    fn refuses_ids_that_would_allocate_without_bound() {
        let at = |kind| Event::new(1, 0, 0, Phase::Idle, kind);
        let huge_block = at(EventKind::BlockRegistered {
            block: BlockId(u32::MAX),
            name: "x".into(),
            bytes: 1,
            exec_order: 0,
            file_backed: false,
            trainable: false,
        });
        let huge_class = at(EventKind::SlabAcquired {
            pool: PoolKind::Activations,
            class: u32::MAX - 1,
            slab: SlabId(0),
            bytes: 1,
            waited_ms: 0.0,
        });
        for e in [huge_block, huge_class] {
            let m = SseMessage {
                event: "event".into(),
                data: serde_json::to_string(&StreamMessage::Event { event: Box::new(e) }).expect("json"),
            };
            assert!(matches!(decode(&m), Err(Refusal::Implausible(_))), "{}", m.data);
        }
        let ok = at(EventKind::SlabReleased { pool: PoolKind::Weights, class: 3, slab: SlabId(9) });
        assert_eq!(vet_event(&ok), Ok(()));
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
}
