//! Cost of publishing on the training thread with the snapshot and JSONL consumers attached, and
//! with every telemetry sink attached (full and summary files, the flight recorder), and JSONL
//! write/read throughput.
//!
//! Run: `cargo bench -p stagehand-events --bench events`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use stagehand_events::jsonl::{read_from, JsonlSink, OpenMode};
use stagehand_events::telemetry::{self, Level, TelemetryConfig};
use stagehand_events::{
    BlockId, BlockState, Bus, Event, EventKind, EventSink, Hub, PackDecision, Phase, TensorId,
};
use std::sync::Arc;

fn residency(i: u64) -> EventKind {
    EventKind::Residency {
        block: BlockId((i % 16) as u32),
        from: BlockState::Prefetching,
        to: BlockState::GpuReady,
        refcount: 1,
    }
}

fn pack(i: u64) -> EventKind {
    EventKind::Pack {
        tensor: TensorId(i),
        decision: PackDecision::Spilled,
        reason: None,
        bytes: 1 << 20,
        class: Some(1),
        pool_hit: Some(true),
        region: None,
    }
}

fn publish(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let hub = Arc::new(Hub::new());
    let sink = JsonlSink::open(dir.path().join("bench.jsonl"), OpenMode::CreateNew).expect("sink");
    hub.add_sink(Box::new(sink));
    let bus = Bus::with_hub(hub, 1 << 16);
    bus.enter_phase(1, Phase::Forward);
    let mut g = c.benchmark_group("publish");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u64;
    g.bench_function("residency_with_snapshot_jsonl", |b| {
        b.iter(|| {
            i += 1;
            bus.publish(residency(i));
        })
    });
    g.bench_function("pack_with_snapshot_jsonl", |b| {
        b.iter(|| {
            i += 1;
            bus.publish(pack(i));
        })
    });
    g.finish();
    bus.flush();
    eprintln!("published {}, dropped {}", bus.published(), bus.dropped());

    // Every sink the product attaches: a full-level file, a compressed summary-level file with
    // the flight recorder and the snapshot.
    let hub = Arc::new(Hub::new());
    let bus = Bus::with_hub(hub, 1 << 16);
    let _full = telemetry::attach(
        &bus,
        TelemetryConfig { level: Level::Full, path: Some(dir.path().join("full.jsonl")), ..Default::default() },
    )
    .expect("full telemetry");
    let _summary = telemetry::attach(
        &bus,
        TelemetryConfig {
            level: Level::Summary,
            path: Some(dir.path().join("summary.jsonl.zst")),
            compress: true,
            ..Default::default()
        },
    )
    .expect("summary telemetry");
    bus.enter_phase(1, Phase::Forward);
    let mut g = c.benchmark_group("publish_all_sinks");
    g.throughput(Throughput::Elements(1));
    g.bench_function("residency_full_and_summary_files_flight_recorder", |b| {
        b.iter(|| {
            i += 1;
            bus.publish(residency(i));
        })
    });
    g.bench_function("pack_full_and_summary_files_flight_recorder", |b| {
        b.iter(|| {
            i += 1;
            bus.publish(pack(i));
        })
    });
    g.finish();
    bus.flush();
    eprintln!("published {}, dropped {}", bus.published(), bus.dropped());

    let mut g = c.benchmark_group("publish");
    let disabled = Bus::disabled();
    g.bench_function("disabled_bus", |b| b.iter(|| disabled.publish(residency(1))));
    g.finish();
}

fn jsonl(c: &mut Criterion) {
    let events: Vec<Event> = (1..=10_000u64)
        .map(|i| {
            let kind = if i % 2 == 0 { residency(i) } else { pack(i) };
            Event::new(i, i * 1000, i / 100, Phase::Forward, kind)
        })
        .collect();
    let mut g = c.benchmark_group("jsonl");
    g.throughput(Throughput::Elements(events.len() as u64));
    g.bench_function("write_10k", |b| {
        b.iter_batched(
            || {
                let dir = tempfile::tempdir().expect("tempdir");
                let sink = JsonlSink::open(dir.path().join("w.jsonl"), OpenMode::CreateNew)
                    .expect("sink");
                (dir, sink)
            },
            |(dir, mut sink)| {
                for e in &events {
                    sink.on_event(e);
                }
                sink.flush();
                drop(dir);
            },
            BatchSize::PerIteration,
        )
    });
    let mut text = Vec::new();
    for e in &events {
        serde_json::to_writer(&mut text, e).expect("json");
        text.push(b'\n');
    }
    g.bench_function("read_10k", |b| {
        b.iter(|| {
            let (evs, _) = read_from(std::io::Cursor::new(&text)).expect("read");
            assert_eq!(evs.len(), 10_000);
        })
    });
    g.finish();
}

criterion_group!(benches, publish, jsonl);
criterion_main!(benches);
