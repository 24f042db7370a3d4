//! Tests of the sink, the reader and the follower.

use super::*;
use crate::bus::EventSink;
use crate::model::{BlockId, EventKind, Phase};
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex};

fn event(seq: u64) -> Event {
    Event::new(seq, seq * 10, 1, Phase::Forward, EventKind::PrefetchHit { block: BlockId(seq as u32) })
}

fn line(e: &Event) -> String {
    serde_json::to_string(e).expect("json")
}

#[test]
fn sink_then_reader_round_trips_plain_and_compressed() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, compress) in [("run/t.jsonl", false), ("run/t.jsonl.zst", true)] {
        let path = dir.path().join(name);
        {
            let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, compress, None).expect("opens");
            for i in 1..=100 {
                sink.on_event(&event(i));
                if i % 30 == 0 {
                    sink.flush(); // several frames when compressed
                }
            }
        }
        let raw = std::fs::read(&path).expect("read");
        assert_eq!(zst::is_zstd(&raw), compress, "{name}");
        let (events, report) = read_file(&path).expect("reads");
        assert_eq!(events.len(), 100, "{name}");
        assert_eq!(events[41], event(42));
        assert_eq!(report.skipped_total, 0);
    }
}

#[test]
fn existing_file_is_never_overwritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.jsonl");
    std::fs::write(&path, "keep me\n").expect("write");
    let err = JsonlSink::open(&path, OpenMode::CreateNew).expect_err("refuses");
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "keep me\n");
    let mut sink = JsonlSink::open(&path, OpenMode::Append).expect("appends");
    sink.on_event(&event(1));
    drop(sink);
    assert_eq!(read_file(&path).expect("reads").0.len(), 1);
}

#[test]
fn a_full_device_is_opened_and_its_losses_are_counted_with_the_real_reason() {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this system");
        return;
    }
    let mut sink = JsonlSink::open("/dev/full", OpenMode::CreateNew).expect("a device is not 'already existing' telemetry");
    for i in 1..=10 {
        sink.on_event(&event(i));
    }
    sink.flush();
    assert_eq!((sink.written(), sink.lost()), (0, 10));
    let notices = sink.notices();
    match notices.as_slice() {
        [EventKind::TelemetryLost { lost: 10, total: 10, reason, .. }] => {
            assert!(reason.contains("No space left"), "{reason}")
        }
        other => panic!("expected one telemetry_lost, got {other:?}"),
    }
    assert!(sink.notices().is_empty(), "reported once");
}

/// A file-like target that accepts `room` more bytes, then fails part way through a write,
/// and can be cut back like a file.
#[derive(Clone, Default)]
struct Flaky {
    data: Arc<Mutex<Vec<u8>>>,
    room: Arc<Mutex<usize>>,
    can_truncate: bool,
}

impl SinkTarget for Flaky {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut room = self.room.lock().expect("room");
        let n = buf.len().min(*room);
        self.data.lock().expect("data").extend_from_slice(&buf[..n]);
        *room -= n;
        if n < buf.len() {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
        }
        Ok(())
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        if !self.can_truncate {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "a pipe"));
        }
        self.data.lock().expect("data").truncate(len as usize);
        Ok(())
    }
}

fn flaky_run(can_truncate: bool) -> (Flaky, JsonlSink) {
    let target = Flaky { can_truncate, ..Default::default() };
    *target.room.lock().expect("room") = 1000;
    let mut sink = JsonlSink::to_target(Box::new(target.clone()), "flaky", false);
    let mut seq = 0;
    let mut batch = |sink: &mut JsonlSink, n: u64| {
        for _ in 0..n {
            seq += 1;
            sink.on_event(&event(seq));
        }
        sink.flush();
    };
    batch(&mut sink, 5); // fits
    batch(&mut sink, 20); // fails part way: the disk fills
    *target.room.lock().expect("room") = usize::MAX; // space is freed
    batch(&mut sink, 5);
    (target, sink)
}

#[test]
fn a_write_that_fails_part_way_is_rolled_back_to_the_last_complete_line() {
    let (target, sink) = flaky_run(true);
    assert_eq!((sink.written(), sink.lost()), (10, 20));
    let data = target.data.lock().expect("data").clone();
    let (events, report) = read_from(io::Cursor::new(data)).expect("reads");
    assert_eq!(report.skipped_total, 0, "no broken line: {}", report.summary());
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5, 26, 27, 28, 29, 30]);
}

#[test]
fn without_rollback_only_the_broken_line_is_damaged() {
    let (target, sink) = flaky_run(false);
    assert_eq!(sink.lost(), 20);
    let data = target.data.lock().expect("data").clone();
    let (events, report) = read_from(io::Cursor::new(data)).expect("reads");
    assert_eq!(report.skipped_total, 1, "{}", report.summary());
    // The partly written batch's complete lines read back; the cut one is skipped.
    assert!(events.iter().any(|e| e.seq == 30) && events.iter().any(|e| e.seq == 26));
}

#[test]
fn every_skip_reason_is_told_apart_and_counted_in_full() {
    let good = line(&event(1));
    let mut text = String::new();
    text.push_str(&format!("{good}\n"));
    text.push_str("{\"not an event\n");
    text.push_str("{\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"run_ended\",\"steps\":1}\n");
    text.push_str("{\"v\":\"two\",\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"run_ended\",\"steps\":1}\n");
    text.push_str("{\"v\":0,\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"run_ended\",\"steps\":1}\n");
    text.push_str("{\"v\":99,\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"run_ended\",\"steps\":1}\n");
    text.push_str("{\"v\":2,\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"from_the_future\"}\n");
    text.push_str("{\"v\":2,\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"warp\",\"kind\":\"run_ended\",\"steps\":1}\n");
    text.push_str("{\"v\":2,\"seq\":1,\"t_ns\":0,\"step\":0,\"phase\":\"idle\",\"kind\":\"prefetch_hit\",\"block\":4294967296}\n");
    text.push('\n');
    for _ in 0..150 {
        text.push_str("garbage\n");
    }
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(b"{\"v\":2,\xff}\n");
    bytes.extend_from_slice(&good.as_bytes()[..good.len() / 2]);
    let (events, report) = read_from(io::Cursor::new(bytes)).expect("reads");
    assert_eq!(events.len(), 1);
    use SkipReason::*;
    let expect = [
        (Malformed, 151),
        (MissingVersion, 1),
        (InvalidVersion, 1),
        (UnsupportedVersion, 2),
        (UnknownKind, 1),
        (InvalidValue, 2),
        (NotUtf8, 1),
        (Truncated, 1),
    ];
    for (r, n) in expect {
        assert_eq!(report.count(r), n, "{r:?}: {}", report.summary());
    }
    assert_eq!(report.skipped_total, 160);
    assert_eq!(report.skipped.len(), MAX_SKIPPED_KEPT, "examples stay bounded");
    assert_eq!(report.blank, 1);
    assert!(report.summary().contains("151 malformed"), "{}", report.summary());
}

#[test]
fn an_endless_line_is_skipped_in_bounded_memory() {
    // 32 MiB of zeros without a newline, then a good line: like reading /dev/zero.
    let good = format!("\n{}\n", line(&event(7)));
    let input = io::repeat(0).take(32 << 20).chain(io::Cursor::new(good.into_bytes()));
    let mut reader = Reader::new(io::BufReader::new(input));
    let mut max_cap = 0;
    let mut events = Vec::new();
    while let Some(e) = reader.next() {
        max_cap = max_cap.max(reader.line.capacity());
        events.push(e.expect("reads"));
    }
    assert_eq!(events, vec![event(7)]);
    assert_eq!(reader.report().count(SkipReason::LineTooLong), 1);
    assert!(max_cap <= MAX_LINE_BYTES + 1, "held {max_cap} bytes");
    // The real device, for a while: memory stays bounded however long it is read.
    if let Ok(zero) = std::fs::File::open("/dev/zero") {
        let mut r = Reader::new(io::BufReader::new(zero.take(32 << 20)));
        assert!(r.next().is_none());
        assert_eq!(r.report().count(SkipReason::LineTooLong), 1);
    }
}

#[test]
fn follower_holds_partial_lines_until_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("live.jsonl");
    let l = line(&event(1));
    std::fs::write(&path, format!("{l}\n{}", &l[..10])).expect("write");
    let mut f = Follower::open(&path).expect("opens");
    assert_eq!(f.poll().expect("poll").events.len(), 1);
    let mut file = OpenOptions::new().append(true).open(&path).expect("open");
    writeln!(file, "{}", &l[10..]).expect("append");
    let more = f.poll().expect("poll");
    assert_eq!(more, Polled { restarted: None, events: vec![event(1)] });
    assert_eq!(f.report().skipped_total, 0);
}

#[test]
fn follower_reports_a_truncated_and_rewritten_file_instead_of_merging_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("live.jsonl");
    let text: String = (1..=5).map(|i| line(&event(i)) + "\n").collect();
    std::fs::write(&path, &text).expect("write");
    let mut f = Follower::open(&path).expect("opens");
    assert_eq!(f.poll().expect("poll").events.len(), 5);
    // Rewritten in place with another run, longer than the first.
    let other: String = (100..=110).map(|i| line(&event(i)) + "\n").collect();
    let mut file = OpenOptions::new().write(true).truncate(true).open(&path).expect("open");
    Write::write_all(&mut file, other.as_bytes()).expect("write");
    let p = f.poll().expect("poll");
    assert_eq!(p.restarted, Some(Restart::Truncated));
    assert_eq!(p.events.first().map(|e| e.seq), Some(100));
    assert_eq!(p.events.len(), 11);
    // Replaced by a new file at the same path.
    std::fs::remove_file(&path).expect("rm");
    std::fs::write(&path, line(&event(200)) + "\n").expect("write");
    let p = f.poll().expect("poll");
    assert_eq!(p.restarted, Some(Restart::Replaced));
    assert_eq!(p.events, vec![event(200)]);
}

#[test]
fn follower_reads_a_large_existing_file_in_one_linear_pass() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("big.jsonl");
    let mut sink = JsonlSink::open(&path, OpenMode::CreateNew).expect("opens");
    for i in 1..=200_000 {
        sink.on_event(&event(i));
    }
    drop(sink);
    let mut f = Follower::open(&path).expect("opens");
    let p = f.poll().expect("poll");
    assert_eq!(p.events.len(), 200_000);
    assert_eq!(p.events.last().map(|e| e.seq), Some(200_000));
}

#[test]
fn follower_decodes_a_growing_compressed_file_frame_by_frame() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("live.jsonl.zst");
    let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, None).expect("opens");
    sink.on_event(&event(1));
    sink.flush();
    let mut f = Follower::open(&path).expect("opens");
    assert_eq!(f.poll().expect("poll").events, vec![event(1)]);
    sink.on_event(&event(2));
    sink.on_event(&event(3));
    sink.flush();
    assert_eq!(f.poll().expect("poll").events, vec![event(2), event(3)]);
}

#[test]
fn rotated_segments_each_read_alone_and_follow_as_one_run() {
    use crate::synthetic::{self, SyntheticRun};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run.jsonl.zst");
    let run = synthetic::events(SyntheticRun { blocks: 8, steps: 6, end_mid_step: false });
    {
        let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, Some(4096)).expect("opens");
        for (i, e) in run.iter().enumerate() {
            sink.on_event(e);
            if i % 50 == 0 {
                sink.flush();
            }
        }
    }
    let segs = segments(&path);
    assert!(segs.len() > 3, "{segs:?}");
    assert_eq!(segs[1].file_name().and_then(|n| n.to_str()), Some("run.0001.jsonl.zst"));
    for seg in &segs[1..] {
        let (events, report) = read_file(seg).expect("reads");
        assert_eq!(report.skipped_total, 0, "{report:?}");
        assert!(matches!(events[0].kind, EventKind::RunStarted { .. }), "{seg:?} starts with the run");
        let snap = crate::Snapshot::from_events(&events);
        assert_eq!(snap.blocks.len(), 8, "{seg:?} knows the blocks");
    }
    let mut f = Follower::open(&path).expect("opens");
    let followed = f.poll().expect("poll").events;
    assert_eq!(followed, run, "the segments follow as the one run, preambles skipped");
}

#[test]
fn a_limited_poll_reads_a_rotated_compressed_run_in_parts() {
    use crate::synthetic::{self, SyntheticRun};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run.jsonl.zst");
    let run = synthetic::events(SyntheticRun { blocks: 8, steps: 12, end_mid_step: false });
    {
        let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, Some(4096)).expect("opens");
        for (i, e) in run.iter().enumerate() {
            sink.on_event(e);
            if i % 50 == 0 {
                sink.flush();
            }
        }
    }
    let total: u64 = segments(&path).iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let mut f = Follower::open(&path).expect("opens");
    let (mut got, mut polls) = (Vec::new(), 0);
    while !f.caught_up() {
        let p = f.poll_limited(1).expect("poll");
        assert_eq!(p.restarted, None);
        got.extend(p.events);
        polls += 1;
        assert!(polls < 10_000, "never caught up");
    }
    assert!(polls > 3, "read in parts: {polls} polls");
    assert_eq!(got, run, "the same events as one unlimited poll");
    assert_eq!(f.bytes_read(), total, "every segment's bytes counted");
    assert!(f.poll().expect("poll").events.is_empty());
}

#[test]
fn a_bound_below_the_preamble_never_opens_segments_without_events() {
    use crate::synthetic::{self, SyntheticRun};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.jsonl");
    let run = synthetic::events(SyntheticRun { blocks: 4, steps: 1, end_mid_step: false });
    let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, false, Some(1)).expect("opens");
    for e in &run[..20] {
        sink.on_event(e);
    }
    sink.flush();
    let after_events = sink.paths().len();
    for _ in 0..5 {
        sink.flush(); // idle flushes
    }
    assert_eq!(sink.paths().len(), after_events, "no segment holds only a preamble");
    sink.on_event(&run[20]);
    sink.flush();
    assert_eq!(sink.paths().len(), after_events + 1);
    drop(sink);
    let (events, _) = read_file(segment_path(&path, after_events as u32 - 1)).expect("reads");
    assert_eq!(events.last(), Some(&run[20]), "the new event follows the preamble");
}

/// The length of the first frame group (record and frame) of a compressed telemetry file.
fn first_group(raw: &[u8]) -> usize {
    assert_eq!(raw[..4], zst::RECORD_MAGIC, "starts with a frame record");
    let compressed = u32::from_le_bytes([raw[20], raw[21], raw[22], raw[23]]) as usize;
    zst::RECORD_BYTES + compressed
}

#[test]
fn a_compressed_file_cut_off_mid_frame_keeps_the_events_before() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cut.jsonl.zst");
    {
        let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, None).expect("opens");
        for i in 1..=10 {
            sink.on_event(&event(i));
        }
        sink.flush();
        for i in 11..=20 {
            sink.on_event(&event(i));
        }
    }
    // The writer was killed while writing the second frame.
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 7]).expect("cut");
    let (events, report) = read_file(&path).expect("reads what is there");
    assert_eq!(events.len(), 10);
    assert_eq!((report.damaged, report.damaged_events), (1, 10), "{}", report.summary());
    assert!(report.summary().contains("lost 10 events in 1 damaged compressed frame"), "{}", report.summary());
    let r = crate::replay::FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    assert_eq!(r.len(), 10);
    assert_eq!(r.report().0.damaged_events, 10);
    // A damaged frame in the middle is skipped; the frames after it still read.
    let mut damaged = bytes.clone();
    let first = first_group(&damaged);
    damaged[first - 3] ^= 0xff; // inside the first frame
    std::fs::write(&path, &damaged).expect("write");
    let mut f = Follower::open(&path).expect("opens");
    let p = f.poll().expect("polls");
    assert_eq!(p.events.first().map(|e| e.seq), Some(11), "{:?}", f.report());
    assert_eq!((f.report().damaged, f.report().damaged_events), (1, 10));
    // The streaming reader and the replay skip the same frame and read on.
    let (events, report) = read_file(&path).expect("reads");
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), (11..=20).collect::<Vec<_>>());
    assert_eq!(report.damaged_events, 10, "{}", report.summary());
    let mut r = crate::replay::FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    r.to_end().expect("plays to the end");
    assert_eq!((r.position(), r.snapshot().last_seq), (10, 20));
}

/// A long compressed run of many frames.
fn compressed_run(path: &Path) -> Vec<Event> {
    use crate::synthetic::{self, SyntheticRun};
    let run = synthetic::events(SyntheticRun { blocks: 24, steps: 60, end_mid_step: false });
    let mut sink = JsonlSink::open_with(path, OpenMode::CreateNew, true, None).expect("opens");
    for (i, e) in run.iter().enumerate() {
        sink.on_event(e);
        if i % 400 == 399 {
            sink.flush();
        }
    }
    drop(sink);
    run
}

#[test]
fn a_zeroed_page_costs_the_frames_it_touches_counted_in_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run.jsonl.zst");
    let run = compressed_run(&path);
    let pristine = std::fs::read(&path).expect("read");
    assert!(pristine.len() / 4096 > 8, "a file of {} bytes", pristine.len());
    // Where the last frame group starts: damage there has no later record to count it by.
    let mut last_group = 0;
    while last_group + first_group(&pristine[last_group..]) < pristine.len() {
        last_group += first_group(&pristine[last_group..]);
    }
    // 4 KiB pages from the start to the end: zeroed, as a disk or a copy loses one.
    let pages = pristine.len().div_ceil(4096);
    for page in (0..12).map(|k| k * (pages - 1) / 11) {
        let mut bytes = pristine.clone();
        let end = (page * 4096 + 4096).min(bytes.len());
        bytes[page * 4096..end].fill(0);
        std::fs::write(&path, &bytes).expect("write");
        let (events, report) = read_file(&path).expect("reads the rest");
        // Each frame holds 400 events: a page touches at most two of them.
        assert!(events.len() + 800 >= run.len(), "page {page}: {} of {} read; {}", events.len(), run.len(), report.summary());
        // Every event is either read or counted as lost: nothing goes unreported (but in the
        // last frame, which no later record counts).
        if end <= last_group {
            assert_eq!(events.len() as u64 + report.damaged_events, run.len() as u64, "page {page}: {}", report.summary());
            assert!(report.damaged >= 1 && report.damaged_uncounted == 0, "page {page}: {}", report.summary());
        } else {
            assert!(report.damaged >= 1, "page {page}: {}", report.summary());
        }
        // What was read is the run less whole frames.
        let read: std::collections::BTreeSet<u64> = events.iter().map(|e| e.seq).collect();
        assert!(events.iter().all(|e| run.contains(e)), "page {page}: an event that was not written");
        assert_eq!(read.len(), events.len());
    }
}

#[test]
fn a_small_file_that_decodes_to_gigabytes_is_refused_in_bounded_memory_and_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bomb.jsonl.zst");
    // 1 GiB of one byte compresses to about 32 KiB; a valid line first, so the file starts
    // as telemetry.
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 19).expect("encoder");
    Write::write_all(&mut enc, (line(&event(1)) + "\n").as_bytes()).expect("compress");
    let chunk = vec![b'a'; 1 << 20];
    for _ in 0..1024 {
        Write::write_all(&mut enc, &chunk).expect("compress");
    }
    let bomb = enc.finish().expect("finish");
    assert!(bomb.len() < 1 << 20, "{} bytes", bomb.len());
    std::fs::write(&path, &bomb).expect("write");
    let t = std::time::Instant::now();
    let mut reader = open(&path).expect("opens");
    let mut events = 0;
    let mut max_line = 0;
    let mut outcome = None;
    while let Some(e) = reader.next() {
        max_line = max_line.max(reader_line_capacity(&reader));
        match e {
            Ok(_) => events += 1,
            Err(err) => outcome = Some(err.to_string()),
        }
    }
    assert_eq!(events, 1);
    // The frame is refused as it passes the ratio: decoding stops there.
    let report = reader.report();
    assert_eq!(report.damaged, 1, "{}", report.summary());
    assert!(report.damage[0].contains("more than 256 times"), "{:?} {outcome:?}", report.damage);
    assert!(max_line <= MAX_LINE_BYTES + 1);
    assert!(t.elapsed() < std::time::Duration::from_secs(30), "took {:?}", t.elapsed());
    // The replay's index and the follower refuse it the same way.
    let r = crate::replay::FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    assert_eq!(r.len(), 1);
    assert_eq!(r.report().0.damaged, 1);
    let mut f = Follower::open(&path).expect("opens");
    assert_eq!(f.poll().expect("polls").events.len(), 1);
    assert_eq!(f.report().damaged, 1);
}

fn reader_line_capacity<S>(r: &Reader<S>) -> usize {
    r.line.capacity()
}

#[test]
fn blank_line_floods_are_quick_counted_and_bounded() {
    // 8 MiB of blank lines around an event: read at memory speed and said in the summary.
    let mut text = vec![b'\n'; 4 << 20];
    text.extend_from_slice((line(&event(1)) + "\n").as_bytes());
    text.extend(std::iter::repeat_n(b'\n', 4 << 20));
    let (events, report) = read_from(io::Cursor::new(text)).expect("reads");
    assert_eq!(events.len(), 1);
    assert_eq!(report.blank, 8 << 20);
    assert!(report.summary().contains(&format!("{} blank lines", 8 << 20)), "{}", report.summary());
    // A flood without end (or /dev/zero) is not read to its end: an error says why.
    let endless = io::repeat(b'\n').take(1 << 40);
    let mut r = Reader::new(io::BufReader::new(endless));
    let err = r.next().expect("an item").expect_err("refused");
    assert!(err.to_string().contains("no telemetry in"), "{err}");
    assert!(r.next().is_none(), "and the reader ends");
    assert!(r.report().blank <= MAX_BARREN_BYTES + (1 << 20));
    if let Ok(zero) = std::fs::File::open("/dev/zero") {
        let mut r = Reader::new(io::BufReader::new(zero));
        assert!(r.next().expect("an item").is_err(), "/dev/zero is refused, not read for ever");
    }
}

/// A rotated run written in segments of about `bound` bytes.
fn rotated_run(path: &Path, compress: bool, bound: u64) -> Vec<Event> {
    use crate::synthetic::{self, SyntheticRun};
    let run = synthetic::events(SyntheticRun { blocks: 8, steps: 6, end_mid_step: false });
    let mut sink = JsonlSink::open_with(path, OpenMode::CreateNew, compress, Some(bound)).expect("opens");
    for (i, e) in run.iter().enumerate() {
        sink.on_event(e);
        if i % 50 == 0 {
            sink.flush();
        }
    }
    run
}

#[test]
fn every_reader_reads_a_rotated_run_as_one_file_and_names_a_gap_or_a_foreign_segment() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, compress) in [("run.jsonl", false), ("run.jsonl.zst", true)] {
        let path = dir.path().join(name);
        let run = rotated_run(&path, compress, 4096);
        let segs = segments(&path);
        assert!(segs.len() > 3, "{segs:?}");
        let (events, report) = read_file(&path).expect("reads");
        assert_eq!(events, run, "{name}: the segments as one run, preambles passed over");
        assert!(report.repeated > 0, "{name}");
        let mut r = crate::replay::FileReplay::open(&path).expect("opens");
        r.wait_indexed();
        assert_eq!(r.len(), run.len(), "{name}");
        for target in [run.len() - 1, run.len() / 3, 5, run.len()] {
            r.seek(target).expect("seeks");
            assert_eq!(r.snapshot(), &crate::Snapshot::from_events(&run[..target]), "{name} at {target}");
        }
        // A segment of another run, put in the place of one of this run's.
        let other = dir.path().join(format!("other-{name}"));
        let mut sink = JsonlSink::open_with(&other, OpenMode::CreateNew, compress, Some(4096)).expect("opens");
        let mut foreign = run.clone();
        if let EventKind::RunStarted { run_id, .. } = &mut foreign[0].kind {
            *run_id = "another".into();
        }
        for e in &foreign {
            sink.on_event(e);
            sink.flush();
        }
        drop(sink);
        let victim = segs[2].clone();
        let saved = std::fs::read(&victim).expect("read");
        std::fs::copy(segment_path(&other, 2), &victim).expect("copy");
        let err = read_file(&path).expect_err("a foreign segment is refused");
        assert!(err.to_string().contains(&victim.display().to_string()) && err.to_string().contains("another run"), "{err}");
        let mut f = Follower::open(&path).expect("opens");
        let err = f.poll().expect_err("the follower refuses it too");
        assert!(err.to_string().contains("another run"), "{err}");
        // A missing middle segment: a follower already past it, or one that starts now, says so.
        let mut before_gap = Follower::open(&path).expect("opens");
        before_gap.poll_limited(1).expect("polls");
        std::fs::remove_file(&victim).expect("rm");
        let mut polled = Ok(());
        while polled.is_ok() && !before_gap.caught_up() {
            polled = before_gap.poll_limited(1).map(|_| ());
        }
        let err = polled.expect_err("the follower stops on the gap, with a word");
        assert!(err.to_string().contains("missing"), "{err}");
        let err = Follower::open(&path).expect_err("and does not start on it");
        assert!(err.to_string().contains(&victim.display().to_string()), "{err}");
        let err = read_file(&path).expect_err("a gap is refused");
        assert!(err.to_string().contains(&victim.display().to_string()) && err.to_string().contains("missing"), "{err}");
        let err = crate::replay::FileReplay::open(&path).expect_err("the replay refuses it too");
        assert!(err.to_string().contains("missing"), "{err}");
        std::fs::write(&victim, saved).expect("restore");
        assert_eq!(read_file(&path).expect("whole again").0, run);
    }
}
