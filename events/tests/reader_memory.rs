//! The readers' memory does not grow with what a file holds: a counting allocator measures the
//! peak heap while the streaming reader, the replay's index and the follower read a small file
//! that decodes to gigabytes, and while a replay indexes a run whose snapshot is large.

use stagehand_events::jsonl::{self, Follower, JsonlSink, OpenMode};
use stagehand_events::model::{BlockId, Event, EventKind, Phase};
use stagehand_events::replay::FileReplay;
use stagehand_events::EventSink;
use std::io::Write;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

/// The heap's peak above what it held when `f` started, in MiB.
fn peak_mib(f: impl FnOnce()) -> f64 {
    counting_alloc::peak_above(f).1 as f64 / (1 << 20) as f64
}

/// A line of telemetry, then `gib` GiB of one byte (newlines every `line` bytes, or none),
/// compressed as one zstd frame.
fn bomb(path: &std::path::Path, gib: usize, line: Option<usize>) {
    let e = Event::new(1, 1, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) });
    let mut enc = zstd::stream::write::Encoder::new(std::fs::File::create(path).expect("creates"), 3).expect("encoder");
    enc.write_all((serde_json::to_string(&e).expect("json") + "\n").as_bytes()).expect("compress");
    let mut chunk = vec![b'a'; 1 << 20];
    if let Some(l) = line {
        for i in (l..chunk.len()).step_by(l) {
            chunk[i] = b'\n';
        }
    }
    for _ in 0..gib << 10 {
        enc.write_all(&chunk).expect("compress");
    }
    enc.finish().expect("finish");
}

#[test]
fn a_small_file_that_decodes_to_gigabytes_costs_no_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, gib, line) in [("long.jsonl.zst", 1, None), ("lines.jsonl.zst", 4, Some(1000))] {
        let path = dir.path().join(name);
        bomb(&path, gib, line);
        let size = std::fs::metadata(&path).expect("meta").len();
        assert!(size < 1 << 20, "{name}: {size} bytes");
        let read = peak_mib(|| {
            let mut r = jsonl::open(&path).expect("opens");
            let n = (&mut r).filter_map(Result::ok).count();
            assert_eq!(n, 1, "{name}");
            assert!(r.report().damaged >= 1, "{name}: {}", r.report().summary());
        });
        let replay = peak_mib(|| {
            let mut r = FileReplay::open(&path).expect("opens");
            r.wait_indexed();
            r.to_end().expect("plays");
            assert_eq!(r.position(), 1, "{name}");
        });
        let follow = peak_mib(|| {
            let mut f = Follower::open(&path).expect("opens");
            assert_eq!(f.poll().expect("polls").events.len(), 1, "{name}");
        });
        println!("{name} ({size} bytes, {gib} GiB decoded): peak heap {read:.1} MiB reading, {replay:.1} MiB replaying, {follow:.1} MiB following");
        for (what, mib) in [("reading", read), ("replaying", replay), ("following", follow)] {
            assert!(mib < 64.0, "{name}: {what} took {mib:.0} MiB");
        }
    }
}

#[test]
fn a_large_snapshot_costs_the_index_its_budget_not_more() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("wide.jsonl.zst");
    // 30,000 blocks with long names (a snapshot of about 8 MiB of JSON), then 1.5 million small
    // events: about 180 MiB of input, a checkpoint's worth every 8 MiB.
    {
        let mut sink = JsonlSink::open_with(&path, OpenMode::CreateNew, true, None).expect("opens");
        let name = "n".repeat(240);
        let mut seq = 0;
        let mut put = |kind| {
            seq += 1;
            sink.on_event(&Event::new(seq, seq, 1, Phase::Forward, kind));
        };
        for b in 0..30_000u32 {
            put(EventKind::BlockRegistered { block: BlockId(b), name: format!("{name}{b}"), bytes: 1, exec_order: b, file_backed: false, trainable: false });
        }
        for i in 0..1_500_000u32 {
            put(EventKind::PrefetchHit { block: BlockId(i % 30_000) });
        }
    }
    let mut checkpoints = 0;
    let peak = peak_mib(|| {
        let r = FileReplay::open(&path).expect("opens");
        r.wait_indexed();
        assert_eq!(r.len(), 1_530_000, "every event read: {:?}", r.report());
        checkpoints = r.checkpoints();
        assert!(r.checkpoint_bytes() <= 64 << 20, "{} bytes of checkpoints", r.checkpoint_bytes());
    });
    println!("a large snapshot: {checkpoints} checkpoints, peak heap {peak:.0} MiB");
    assert!(checkpoints >= 2);
    assert!(peak < 400.0, "the index took {peak:.0} MiB");
}
