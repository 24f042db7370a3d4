//! Tests of the sink, the reader and the follower.

use super::*;
use crate::events::bus::EventSink;
use crate::events::model::{BlockId, EventKind, Phase};
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
    // 64 MiB of zeros without a newline, then a good line: like reading /dev/zero.
    let good = format!("\n{}\n", line(&event(7)));
    let input = io::repeat(0).take(64 << 20).chain(io::Cursor::new(good.into_bytes()));
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
    use crate::events::synthetic::{self, SyntheticRun};
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
    let segs = sink::segments(&path);
    assert!(segs.len() > 3, "{segs:?}");
    assert_eq!(segs[1].file_name().and_then(|n| n.to_str()), Some("run.0001.jsonl.zst"));
    for seg in &segs[1..] {
        let (events, report) = read_file(seg).expect("reads");
        assert_eq!(report.skipped_total, 0, "{report:?}");
        assert!(matches!(events[0].kind, EventKind::RunStarted { .. }), "{seg:?} starts with the run");
        let snap = crate::events::Snapshot::from_events(&events);
        assert_eq!(snap.blocks.len(), 8, "{seg:?} knows the blocks");
    }
    let mut f = Follower::open(&path).expect("opens");
    let followed = f.poll().expect("poll").events;
    assert_eq!(followed, run, "the segments follow as the one run, preambles skipped");
}

#[test]
fn a_limited_poll_reads_a_rotated_compressed_run_in_parts() {
    use crate::events::synthetic::{self, SyntheticRun};
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
    let total: u64 = sink::segments(&path).iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
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
    use crate::events::synthetic::{self, SyntheticRun};
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
    let (events, _) = read_file(sink::segment_path(&path, after_events as u32 - 1)).expect("reads");
    assert_eq!(events.last(), Some(&run[20]), "the new event follows the preamble");
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
    assert_eq!(report.count(SkipReason::Truncated), 1, "{}", report.summary());
    let r = crate::events::replay::FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    assert_eq!(r.len(), 10);
    assert_eq!(r.report().0.count(SkipReason::Truncated), 1);
    // A damaged frame in the middle is skipped; the frames after it still read.
    let mut damaged = bytes.clone();
    let first_frame = zst::frame_len(&damaged).expect("a frame");
    damaged[first_frame - 3] ^= 0xff; // inside the first frame's data or checksum
    std::fs::write(&path, &damaged).expect("write");
    let mut f = Follower::open(&path).expect("opens");
    let p = f.poll().expect("polls");
    assert_eq!(p.events.first().map(|e| e.seq), Some(11), "{:?}", f.report());
    assert_eq!(f.report().count(SkipReason::Truncated), 1);
    // The streaming reader and the replay skip the same frame and read on.
    let (events, report) = read_file(&path).expect("reads");
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), (11..=20).collect::<Vec<_>>());
    assert_eq!(report.count(SkipReason::Truncated), 1, "{}", report.summary());
    let mut r = crate::events::replay::FileReplay::open(&path).expect("opens");
    r.wait_indexed();
    r.to_end().expect("plays to the end");
    assert_eq!((r.position(), r.snapshot().last_seq), (10, 20));
}
