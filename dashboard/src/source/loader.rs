//! Reads a telemetry file on a background thread and hands its events over in batches, so the
//! first screen of a large file shows as soon as its first events are read, with a progress
//! line while the rest loads. With `follow`, it keeps reading the file as it grows (a partial
//! last line waits for its newline) and starts over if the file shrinks (rewritten).

use super::sse::LineReader;
use stagehand::events::jsonl::{parse_line, ReadReport, SkipReason};
use stagehand::events::Event;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest telemetry line read; longer ones are skipped as corrupt.
pub const MAX_LINE: usize = 64 << 20;
/// The first batch is sent after this many events, so the first screen comes quickly.
const FIRST_BATCH: usize = 256;
/// Later batches: at most this many events, or whatever was read in [`BATCH_EVERY`].
const BATCH: usize = 8192;
const BATCH_EVERY: Duration = Duration::from_millis(50);
/// How often a followed file is checked for new lines.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// What the loader has read since the last batch.
#[derive(Debug)]
pub struct Batch {
    pub events: Vec<Event>,
    /// The report of everything read so far.
    pub report: ReadReport,
    pub bytes_read: u64,
    /// The initial read reached the end of the file (following goes on after it).
    pub done: bool,
    /// Reading failed; nothing more comes.
    pub error: Option<String>,
}

/// Where a loader reads.
pub enum Input {
    /// A file, read from its start; with `follow`, read on as it grows.
    File { file: File, follow: bool },
    /// Any reader (tests): read to its end.
    Reader(Box<dyn Read + Send>),
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Input::File { follow, .. } => write!(f, "File {{ follow: {follow} }}"),
            Input::Reader(_) => f.write_str("Reader"),
        }
    }
}

/// The UI's end of a loader.
#[derive(Debug)]
pub struct Loader {
    rx: Receiver<Batch>,
    stop: Arc<AtomicBool>,
    finished: bool,
}

impl Loader {
    /// Starts reading `input` on a thread.
    pub fn start(input: Input) -> std::io::Result<Loader> {
        // Two batches in flight at most: the reader waits for the UI rather than piling up.
        let (tx, rx) = sync_channel(2);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::Builder::new()
            .name("stagehand-top-load".into())
            .spawn(move || run(input, tx, s))?;
        Ok(Loader { rx, stop, finished: false })
    }

    /// The batches that are ready, without waiting.
    pub fn try_batches(&mut self) -> Vec<Batch> {
        let mut out = Vec::new();
        loop {
            match self.rx.try_recv() {
                Ok(b) => out.push(b),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.finished = true;
                    break;
                }
            }
        }
        out
    }

    /// The next batch, waiting for it; `None` once the loader has ended.
    pub fn wait_batch(&mut self) -> Option<Batch> {
        match self.rx.recv() {
            Ok(b) => Some(b),
            Err(_) => {
                self.finished = true;
                None
            }
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn skip(report: &mut ReadReport, reason: SkipReason, detail: String) {
    let line = report.lines;
    report.skip(line, reason, detail);
}

/// Reads one line's worth: parses it into `events` or counts why not.
fn take_line(raw: &[u8], cut: bool, complete: bool, report: &mut ReadReport, events: &mut Vec<Event>) {
    report.lines += 1;
    if cut {
        skip(report, SkipReason::LineTooLong, format!("line longer than {} MiB", MAX_LINE >> 20));
        return;
    }
    match parse_line(&String::from_utf8_lossy(raw)) {
        // A file is as untrusted as a server: ids that would make the state allocate without
        // bound are refused the same way.
        Ok(Some(e)) => match super::live::vet_event(&e) {
            Ok(()) => {
                report.events += 1;
                events.push(e);
            }
            Err(why) => skip(report, SkipReason::InvalidValue, format!("implausible: {why}")),
        },
        Ok(None) => report.blank += 1,
        Err((reason, detail)) => {
            let reason = if complete { reason } else { SkipReason::Truncated };
            skip(report, reason, detail);
        }
    }
}

/// Counts bytes read through it.
struct Counted<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

fn run(input: Input, tx: SyncSender<Batch>, stop: Arc<AtomicBool>) {
    let (reader, follow): (Box<dyn Feed>, bool) = match input {
        Input::File { file, follow } => (Box::new(file), follow),
        Input::Reader(r) => (Box::new(r), false),
    };
    let mut lines: Lines = LineReader::new(BufReader::new(Counted { inner: reader, read: 0 }), MAX_LINE);
    let mut report = ReadReport::default();
    let mut events = Vec::new();
    let mut raw = Vec::new();
    // A followed file's partial last line, waiting for its newline.
    let mut pending: Vec<u8> = Vec::new();
    let mut sent_any = false;
    let mut last_send = Instant::now();
    let mut done = false;
    let send = |events: &mut Vec<Event>, report: &ReadReport, read: u64, done: bool, error: Option<String>| {
        tx.send(Batch { events: std::mem::take(events), report: report.clone(), bytes_read: read, done, error }).is_ok()
    };
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let next = lines.next_line(&mut raw);
        let read = lines_read(&lines);
        match next {
            Err(e) => {
                send(&mut events, &report, read, true, Some(format!("reading: {e}")));
                return;
            }
            Ok(Some(info)) if info.complete => {
                if pending.is_empty() {
                    take_line(&raw, info.cut, true, &mut report, &mut events);
                } else {
                    pending.extend_from_slice(&raw);
                    let cut = info.cut || pending.len() > MAX_LINE;
                    take_line(&pending, cut, true, &mut report, &mut events);
                    pending.clear();
                }
            }
            Ok(Some(info)) => {
                // The last bytes, without a newline.
                if follow {
                    // Still being written: keep it (bounded) until its newline comes.
                    if pending.len() < MAX_LINE {
                        pending.extend_from_slice(&raw[..raw.len().min(MAX_LINE - pending.len())]);
                    }
                } else {
                    take_line(&raw, info.cut, false, &mut report, &mut events);
                }
            }
            Ok(None) => {
                if !done || !events.is_empty() {
                    done = true;
                    if !send(&mut events, &report, read, true, None) {
                        return;
                    }
                    sent_any = true;
                    last_send = Instant::now();
                }
                if !follow {
                    return;
                }
                std::thread::sleep(FOLLOW_EVERY);
                if restart_if_rewritten(&mut lines) {
                    pending.clear();
                }
                continue;
            }
        }
        let due = if sent_any { events.len() >= BATCH || last_send.elapsed() >= BATCH_EVERY } else { events.len() >= FIRST_BATCH };
        if due && !events.is_empty() {
            if !send(&mut events, &report, read, done, None) {
                return;
            }
            sent_any = true;
            last_send = Instant::now();
        }
    }
}

type Lines = LineReader<BufReader<Counted<Box<dyn Feed>>>>;

fn lines_read(lines: &Lines) -> u64 {
    let r = lines.get_ref();
    // Bytes handed out: read from the source, less what the buffer still holds.
    r.get_ref().read - r.buffer().len() as u64
}

/// What the loader reads from: any reader, and for a followed file, a way to notice that the
/// file was rewritten.
trait Feed: Read + Send {
    /// Whether the source became shorter than `read` bytes and was rewound to its start.
    fn rewound(&mut self, _read: u64) -> bool {
        false
    }
}

impl Feed for File {
    fn rewound(&mut self, read: u64) -> bool {
        match self.metadata() {
            Ok(m) if m.len() < read => self.seek(SeekFrom::Start(0)).is_ok(),
            _ => false,
        }
    }
}

impl Feed for Box<dyn Read + Send> {}

/// A followed file that became shorter than what was read was rewritten: start over at its
/// beginning (the buffer is empty here: this runs at the end of what was there).
fn restart_if_rewritten(lines: &mut Lines) -> bool {
    let counted = lines.get_mut().get_mut();
    if counted.inner.rewound(counted.read) {
        counted.read = 0;
        true
    } else {
        false
    }
}
