//! Tests of the bus and the hub.

use super::*;
use crate::model::{BlockId, EventKind};

#[test]
fn subscriber_sees_snapshot_then_events() {
    let bus = Bus::new();
    let hub = bus.hub().expect("enabled").clone();
    bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    bus.flush();
    let mut sub = hub.subscribe();
    assert_eq!(sub.snapshot.weights.prefetch_hits, 1);
    bus.publish(EventKind::PrefetchHit { block: BlockId(1) });
    bus.flush();
    match sub.rx.try_recv() {
        Ok(Update::Event(e)) => assert_eq!(e.seq, 2),
        other => panic!("expected the second event, got {other:?}"),
    }
    assert!(sub.rx.try_recv().is_err(), "nothing else");
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
fn lagging_subscriber_is_told_how_many_it_missed() {
    let hub = Hub::new();
    let mut sub = hub.subscribe();
    for i in 0..(DEFAULT_SUBSCRIBER_CAPACITY as u64 + 10) {
        hub.ingest(Event::new(
            i + 1,
            i,
            0,
            Phase::Idle,
            EventKind::PrefetchHit { block: BlockId(0) },
        ));
    }
    match sub.rx.try_recv() {
        Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 10),
        other => panic!("expected Lagged, got {other:?}"),
    }
    let fresh = hub.resubscribe();
    assert_eq!(
        fresh.snapshot.weights.prefetch_hits,
        DEFAULT_SUBSCRIBER_CAPACITY as u64 + 10
    );
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
    struct Failing(u64, bool);
    impl EventSink for Failing {
        fn on_event(&mut self, _: &Event) {
            self.0 += 1;
        }
        fn notices(&mut self) -> Vec<EventKind> {
            // Reports once, as a real sink reports each new loss once.
            if std::mem::replace(&mut self.1, true) {
                return Vec::new();
            }
            vec![EventKind::TelemetryLost { sink: "f".into(), lost: self.0, total: self.0, reason: "disk full".into() }]
        }
    }
    let bus = Bus::new();
    let hub = bus.hub().expect("enabled").clone();
    hub.add_sink(Box::new(Failing(0, false)));
    for _ in 0..3 {
        bus.publish(EventKind::PrefetchHit { block: BlockId(0) });
    }
    bus.close();
    let snap = hub.snapshot();
    assert_eq!(snap.telemetry_lost, 3);
    assert_eq!(snap.event_counts["telemetry_lost"], 1);
}

#[test]
fn disabled_bus_is_inert() {
    let bus = Bus::disabled();
    bus.publish(EventKind::RunEnded { steps: 0 });
    bus.enter_phase(1, Phase::Forward);
    assert_eq!(bus.published(), 0);
    assert!(bus.hub().is_none());
}
