//! Tests of the bus and the hub.

use super::*;
use crate::model::{BlockId, EventKind};

/// What a snapshot sink saw: each event's sequence number with the prefetch hits of the state
/// it came with, and the hits of the state each flush and rewind end came with.
#[derive(Default)]
struct Seen {
    events: Vec<(u64, u64)>,
    rewound: Vec<(u64, u64)>,
    flushes: Vec<u64>,
    rewind_ends: Vec<u64>,
}

struct Watch(Arc<Mutex<Seen>>);

impl SnapshotSink for Watch {
    fn on_event(&mut self, event: &Event, state: &Snapshot) {
        self.0.lock().expect("seen").events.push((event.seq, state.weights.prefetch_hits));
    }
    fn flush(&mut self, state: &Snapshot) {
        self.0.lock().expect("seen").flushes.push(state.weights.prefetch_hits);
    }
    fn rewind_event(&mut self, event: &Event, state: &Snapshot) {
        self.0.lock().expect("seen").rewound.push((event.seq, state.weights.prefetch_hits));
    }
    fn rewind_end(&mut self, state: &Snapshot) {
        self.0.lock().expect("seen").rewind_ends.push(state.weights.prefetch_hits);
    }
}

fn hit(seq: u64) -> Event {
    Event::new(seq, seq, 0, Phase::Idle, EventKind::PrefetchHit { block: BlockId(0) })
}

#[test]
fn a_snapshot_sink_reads_the_hubs_state_after_each_event() {
    let bus = Bus::new();
    let hub = bus.hub().expect("enabled").clone();
    let seen = Arc::new(Mutex::new(Seen::default()));
    hub.add_snapshot_sink(Box::new(Watch(seen.clone())));
    bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    bus.publish(EventKind::PrefetchHit { block: BlockId(1) });
    bus.flush();
    let seen = seen.lock().expect("seen");
    assert_eq!(seen.events, [(1, 1), (2, 2)], "each event with the state it left");
    assert_eq!(seen.flushes.last(), Some(&2), "a batch ends with the state as of its last event");
}

#[test]
fn a_seek_hands_snapshot_sinks_the_history_reduced_once_then_the_new_state() {
    let hub = Hub::new();
    let seen = Arc::new(Mutex::new(Seen::default()));
    hub.add_snapshot_sink(Box::new(Watch(seen.clone())));
    let run: Vec<Event> = (1..=5).map(hit).collect();
    for e in &run {
        hub.ingest(e.clone());
    }
    hub.reset(Snapshot::from_events(&run[..3]), &run[..3]);
    let seen = seen.lock().expect("seen");
    assert_eq!(seen.rewound, [(1, 1), (2, 2), (3, 3)]);
    assert_eq!(seen.rewind_ends, [3]);
    assert_eq!(hub.snapshot().weights.prefetch_hits, 3);
}

#[test]
fn full_queue_drops_and_counts_without_blocking() {
    let hub = Arc::new(Hub::new());
    let bus = Bus::with_hub(hub.clone(), 4);
    // Stop the dispatcher so the queue fills.
    if let Some(d) = &bus.inner {
        d.shared.stop.store(true, Ordering::Release);
    }
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..10 {
        bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    }
    assert_eq!(bus.dropped(), 6);
    assert_eq!(bus.published(), 10);
}

#[test]
fn dropped_count_becomes_an_event() {
    let hub = Arc::new(Hub::new());
    let bus = Bus::with_hub(hub.clone(), 2);
    if let Some(d) = &bus.inner {
        d.shared.dropped.store(5, Ordering::Relaxed);
    }
    bus.publish(EventKind::RunEnded { steps: 0 });
    bus.close();
    assert_eq!(hub.snapshot().dropped_events, 5);
    assert_eq!(hub.snapshot().event_counts["events_dropped"], 1);
}

#[test]
fn phases_tag_events_and_carry_durations() {
    let bus = Bus::new();
    bus.enter_phase(3, Phase::StepBegin);
    bus.enter_phase(3, Phase::Forward);
    bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    bus.flush();
    let snap = bus.hub().expect("enabled").snapshot();
    assert_eq!((snap.step, snap.phase), (3, Phase::Forward));
    assert_eq!(bus.context(), (3, Phase::Forward));
}

#[test]
fn a_sinks_losses_reach_every_consumer_as_telemetry_lost() {
    /// Fails to write every event but the reports of its own losses, and reports each new loss
    /// once, as a real sink does. The dispatcher asks after every batch, an empty one too, so a
    /// report may cover any share of the events.
    #[derive(Default)]
    struct Failing {
        lost: u64,
        reported: u64,
    }
    impl EventSink for Failing {
        fn on_event(&mut self, e: &Event) {
            if !matches!(e.kind, EventKind::TelemetryLost { .. }) {
                self.lost += 1;
            }
        }
        fn notices(&mut self) -> Vec<EventKind> {
            let new = self.lost - self.reported;
            if new == 0 {
                return Vec::new();
            }
            self.reported = self.lost;
            vec![EventKind::TelemetryLost { sink: "f".into(), lost: new, total: self.lost, reason: "disk full".into() }]
        }
    }
    let bus = Bus::new();
    let hub = bus.hub().expect("enabled").clone();
    hub.add_sink(Box::<Failing>::default());
    for _ in 0..3 {
        bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    }
    bus.close();
    let snap = hub.snapshot();
    assert_eq!(snap.telemetry_lost, 3, "every loss counted once");
    let reports = snap.event_counts["telemetry_lost"];
    assert!((1..=3).contains(&reports), "{reports} reports");
}

#[test]
fn disabled_bus_is_inert() {
    let bus = Bus::disabled();
    bus.publish(EventKind::RunEnded { steps: 0 });
    bus.enter_phase(1, Phase::Forward);
    assert_eq!(bus.published(), 0);
    assert!(bus.hub().is_none());
}
