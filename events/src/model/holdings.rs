//! What held the device when an allocation failed: the detail an `out_of_memory` event carries
//! beyond the totals by owner, so that the report (and the flight record around it) says which
//! blocks, which activations and which reservations had the memory.

use super::{BlockId, BlockState, Owner, ReservationId, Resource};
use serde::{Deserialize, Serialize};

/// The device's holders at the moment an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct DeviceHoldings {
    /// The failure in the allocator's own words.
    pub error: String,
    /// The device's memory budget (the simulated VRAM on the host device), bytes.
    pub budget_bytes: u64,
    /// Weight blocks holding device memory, largest first.
    pub blocks: Vec<BlockHolding>,
    /// Saved activations kept on the device, bytes.
    pub activations_kept_bytes: u64,
    /// Spilled activations brought back (or landing) and waiting for backward, bytes.
    pub activations_restored_bytes: u64,
    /// Spills whose copies are still leaving the device, bytes.
    pub activations_spilling_bytes: u64,
    /// Weight copies in flight (loads landing, gradients leaving), and their device bytes.
    pub weight_copies_in_flight: u64,
    pub weight_copies_in_flight_bytes: u64,
    /// Conductor reservations still held.
    pub reservations: Vec<ReservationHolding>,
}

/// A weight block with device memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockHolding {
    pub block: BlockId,
    pub name: String,
    pub state: BlockState,
    pub bytes: u64,
    /// Kept on the device for good by the plan (otherwise streamed through the room).
    pub resident: bool,
}

/// A Conductor reservation still held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationHolding {
    pub id: ReservationId,
    pub owner: Owner,
    pub resource: Resource,
    pub bytes: u64,
}
