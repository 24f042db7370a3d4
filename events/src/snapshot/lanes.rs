//! A data-parallel run's lanes: one per device (the events' `device`), each with its own step
//! and phase and what its last step did (time by part, copies and collectives, memory, loss).
//! The other domains of the snapshot (blocks, transfers, pools, the Conductor) follow the
//! run's first device: block ids and copies are per device, and mixing two devices' would show
//! neither. A run on one device has no lanes.

use super::super::model::*;
use super::Snapshot;
use serde::{Deserialize, Serialize};

/// Devices a snapshot keeps lanes for; events of others only count.
pub const MAX_LANES: usize = 64;

/// One device of a data-parallel run.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Lane {
    pub device: u32,
    /// Its step and phase now.
    pub step: u64,
    pub phase: Phase,
    /// Events it published.
    pub events: u64,
    /// Its device budget (its `device` limit).
    pub budget_bytes: Option<u64>,
    /// Its latest memory reading.
    pub vram: Option<LaneMemory>,
    /// Its last step: the trainer's metrics, where the time went, the weights' copies and
    /// collectives, its copies by direction.
    pub last_train: Option<TrainStepMetrics>,
    pub last_time: Option<StepTimeBreakdown>,
    pub last_weights: Option<WeightStepMetrics>,
    pub last_transfers: Option<TransferStepMetrics>,
    /// Its copies and collectives over the run.
    pub transfers: TransferStepMetrics,
    /// Steps it finished.
    pub steps: u64,
}

/// A lane's device memory.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct LaneMemory {
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
}

/// Applies `e` (from `device`) to its lane. Returns whether the rest of the snapshot follows it
/// too: events of the run's first device do, those of the others only update their lanes.
pub(super) fn apply(s: &mut Snapshot, device: u32, e: &Event) -> bool {
    let first = *s.first_device.get_or_insert(device);
    if !s.lanes.contains_key(&device) && s.lanes.len() >= MAX_LANES {
        s.refuse(super::Refusal::TooManyDevices);
        return device == first;
    }
    let lane = s.lanes.entry(device).or_insert_with(|| Lane { device, ..Lane::default() });
    lane.events = lane.events.saturating_add(1);
    lane.step = lane.step.max(e.step);
    match &e.kind {
        EventKind::PhaseChanged { to, .. } => {
            lane.phase = *to;
            lane.step = e.step;
        }
        EventKind::LimitsSet { owner: Owner::Device, budget_bytes, .. } => lane.budget_bytes = Some(*budget_bytes),
        EventKind::VramSample { allocated_bytes, reserved_bytes, peak_allocated_bytes } => {
            lane.vram = Some(LaneMemory {
                allocated_bytes: *allocated_bytes,
                reserved_bytes: *reserved_bytes,
                peak_allocated_bytes: *peak_allocated_bytes,
            });
        }
        EventKind::TrainStep(m) => {
            lane.last_train = Some(m.clone());
            lane.steps = lane.steps.saturating_add(1);
        }
        EventKind::StepTime(t) => lane.last_time = Some(*t),
        EventKind::WeightStep(m) => lane.last_weights = Some(m.clone()),
        EventKind::TransferStep(m) => {
            lane.last_transfers = Some(*m);
            use super::tally::StepSum;
            lane.transfers.add(m);
        }
        _ => {}
    }
    device == first
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(device: Option<u32>, seq: u64, step: u64, kind: EventKind) -> Event {
        Event::new(seq, seq * 10, step, Phase::Forward, kind).on_device(device)
    }

    fn registered(seq: u64, device: u32) -> Event {
        on(Some(device), seq, 0, EventKind::BlockRegistered { block: BlockId(0), name: "blocks.0".into(), bytes: 64, exec_order: 0, file_backed: false, trainable: true })
    }

    #[test]
    fn each_device_has_its_lane_and_the_rest_follows_the_first() {
        let collective = |bytes| {
            let mut m = TransferStepMetrics::default();
            m.collective.record(bytes, Some(1.0));
            EventKind::TransferStep(m)
        };
        let events = vec![
            registered(1, 0),
            registered(2, 1),
            on(Some(1), 3, 1, EventKind::PhaseChanged { from: Phase::Idle, to: Phase::Backward, duration_s: 0.0 }),
            on(Some(0), 4, 1, EventKind::TrainStep(TrainStepMetrics { loss: 2.0, ..Default::default() })),
            on(Some(1), 5, 1, EventKind::TrainStep(TrainStepMetrics { loss: 2.0, ..Default::default() })),
            on(Some(1), 6, 2, EventKind::TrainStep(TrainStepMetrics { loss: 1.5, ..Default::default() })),
            on(Some(0), 7, 1, collective(100)),
            on(Some(1), 8, 1, collective(100)),
            on(Some(1), 9, 2, collective(50)),
            on(Some(1), 10, 2, EventKind::VramSample { allocated_bytes: 7, reserved_bytes: 8, peak_allocated_bytes: 9 }),
        ];
        let s = Snapshot::from_events(&events);
        assert_eq!(s.lanes.len(), 2);
        assert_eq!(s.first_device, Some(0));
        let (l0, l1) = (&s.lanes[&0], &s.lanes[&1]);
        assert_eq!((l0.steps, l1.steps), (1, 2));
        assert_eq!(l1.step, 2);
        assert_eq!((l0.transfers.collective.bytes, l1.transfers.collective.bytes), (100, 150));
        assert_eq!(l1.last_train.as_ref().map(|t| t.loss), Some(1.5));
        assert_eq!(l1.vram.map(|v| v.peak_allocated_bytes), Some(9));
        // The blocks and steps are the first device's: its one block, its one step.
        assert_eq!(s.blocks.len(), 1, "the same block id of another device is not another block");
        assert_eq!(s.steps.iter().filter(|r| r.train.is_some()).count(), 1);
        assert_eq!(s.phase, Phase::Idle, "another device's phase is its lane's");
        assert_eq!(s.events_applied, 10, "every event counts");
        assert!(Snapshot::from_events(&[on(None, 1, 0, EventKind::RunEnded { steps: 0 })]).lanes.is_empty(), "one device: no lanes");
    }
}
