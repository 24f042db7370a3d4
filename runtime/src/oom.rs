//! The report an out-of-memory error carries: what held the device when a step ran out of
//! memory, what the runtime was about to do, and the flight record written for it. It mirrors
//! the `out_of_memory` event (the same holdings, in the event's own types), so it sits on the
//! ground floor beside the error that carries it; the handle fills it in
//! (`session/forensics.rs`).

use crate::events::{DeviceHoldings, Phase, VramByOwner};
use std::fmt;
use std::path::PathBuf;

/// Blocks the message names (the report holds the rest).
const BLOCKS_NAMED: usize = 6;

/// Why a step ran out of device memory, and what held the device then.
#[derive(Debug, Clone, PartialEq)]
pub struct OomReport {
    pub step: u64,
    pub phase: Phase,
    /// Bytes the failed allocation asked for (0 when the allocator did not say).
    pub requested_bytes: u64,
    /// What the runtime was about to do ("making block 'blocks.3' resident: ...").
    pub doing: String,
    pub owners: VramByOwner,
    pub held: DeviceHoldings,
    /// Blocks on the device beyond those listed in `held.blocks`.
    pub blocks_not_listed: usize,
    /// The flight record written for it.
    pub dump: Option<PathBuf>,
    /// Why there is no flight record, when there is none.
    pub no_dump: Option<String>,
}

/// `1.5 MiB`, `512 B`: the same units as the dashboards' findings.
fn bytes(b: u64) -> String {
    crate::events::insight::human_bytes(b)
}

/// What an out-of-memory of libtorch's CPU allocator was allocating: the report's `doing` names
/// it, and its first words say host memory instead of device memory.
pub(crate) const HOST_MEMORY: &str = "host memory (libtorch's CPU allocator)";

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.owners;
        let h = &self.held;
        // libtorch's CPU allocator failing is host memory (on the host device, its "VRAM").
        let memory = if self.doing.contains(HOST_MEMORY) { "host" } else { "device" };
        write!(f, "out of {memory} memory in the {} of step {} while {}", self.phase, self.step, self.doing)?;
        if self.requested_bytes > 0 {
            write!(f, " ({} requested)", bytes(self.requested_bytes))?;
        }
        write!(f, ". The device held {}", bytes(o.allocated_bytes))?;
        if h.budget_bytes > 0 {
            write!(f, " of a {} budget", bytes(h.budget_bytes))?;
        }
        let on_device = h.blocks.len() + self.blocks_not_listed;
        let resident = h.blocks.iter().filter(|b| b.resident).count();
        write!(
            f,
            ": weights {} in {on_device} blocks ({resident} resident, {} streamed)",
            bytes(o.weights_bytes),
            on_device - resident
        )?;
        if !h.blocks.is_empty() {
            let named: Vec<String> = h
                .blocks
                .iter()
                .take(BLOCKS_NAMED)
                .map(|b| format!("{} {} {}", b.name, b.state, bytes(b.bytes)))
                .collect();
            let more = on_device.saturating_sub(named.len());
            write!(f, " [{}{}]", named.join(", "), if more > 0 { format!(" and {more} more") } else { String::new() })?;
        }
        write!(
            f,
            ", activations kept {}, restored {}, spilling {}, weight copies in flight {} ({}), other {}",
            bytes(h.activations_kept_bytes),
            bytes(h.activations_restored_bytes),
            bytes(h.activations_spilling_bytes),
            h.weight_copies_in_flight,
            bytes(h.weight_copies_in_flight_bytes),
            bytes(o.other_bytes)
        )?;
        let reserved: u64 = h.reservations.iter().map(|r| r.bytes).sum();
        write!(f, "; {} Conductor reservations hold {}", h.reservations.len(), bytes(reserved))?;
        match (&self.dump, &self.no_dump) {
            (Some(p), _) => write!(f, ". Flight record: {}", p.display())?,
            (None, Some(why)) => write!(f, ". No flight record: {why}")?,
            (None, None) => {}
        }
        write!(f, ". The allocator said: {}", h.error)
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(bytes(1536), "1.5 KiB");
    }
}
