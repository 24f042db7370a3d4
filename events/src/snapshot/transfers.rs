//! Copies across PCIe: in flight, completed, recent, and their totals by direction.

use super::super::model::*;
use super::*;

pub(super) fn apply(s: &mut Snapshot, e: &Event) {
    match &e.kind {
        EventKind::TransferIssued { dir, .. } => {
            let d = s.transfers.dir_mut(*dir);
            d.inflight = d.inflight.saturating_add(1);
        }
        EventKind::TransferCompleted {
            id,
            dir,
            owner,
            bytes,
            duration_ms,
        } => {
            let d = s.transfers.dir_mut(*dir);
            d.inflight = d.inflight.saturating_sub(1);
            s.tallies
                .transfers
                .detail(e.step)
                .dir_mut(*dir)
                .record(*bytes, *duration_ms);
            if *owner == Owner::Weights {
                let t = weights::tally(s, e.step);
                match dir {
                    Direction::H2d => t.h2d_bytes = t.h2d_bytes.saturating_add(*bytes),
                    Direction::D2h => t.d2h_bytes = t.d2h_bytes.saturating_add(*bytes),
                    Direction::Collective => {}
                }
                weights::refresh(s);
            }
            push_bounded(
                &mut s.transfers.recent,
                TransferRecord {
                    seq: e.seq,
                    t_ns: e.t_ns,
                    id: *id,
                    dir: *dir,
                    owner: *owner,
                    bytes: *bytes,
                    duration_ms: *duration_ms,
                },
                RECENT_TRANSFERS,
            );
            refresh(s);
        }
        EventKind::TransferStep(m) => {
            s.tallies.transfers.aggregate(e.step, m);
            s.step_record_mut(e.step).transfers = Some(*m);
            refresh(s);
        }
        _ => {}
    }
}

fn refresh(s: &mut Snapshot) {
    let t = s.tallies.transfers.total();
    for (dir, c) in [(Direction::H2d, t.h2d), (Direction::D2h, t.d2h), (Direction::Collective, t.collective)] {
        let d = s.transfers.dir_mut(dir);
        d.count = c.count;
        d.bytes = c.bytes;
        d.untimed_bytes = c.untimed_bytes;
        d.busy_ms = c.busy_ms;
        d.last_gbps = c.last_gbps;
    }
}
