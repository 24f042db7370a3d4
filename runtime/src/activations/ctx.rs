//! What a hook call works with besides the locked state: the device it copies on, the bus it
//! reports on, the Conductor that grants copy slots and reservations, and the knobs it reads.
//! Made once per call ([`Shared::ctx`](super::state::Shared)) and lent to the spill queue, the
//! restorer and the state's steps, instead of each taking them one by one.

use crate::conductor::{Conductor, Knobs};
use crate::device::Device;
use crate::events::Bus;

/// A hook call's surroundings, borrowed for the call.
pub(super) struct Ctx<'a> {
    pub(super) device: &'a Device,
    pub(super) bus: &'a Bus,
    /// The runtime's Conductor at the call (disabled when none is attached): attaching one
    /// swaps it under the state's lock, so a call holds its own handle to it.
    pub(super) conductor: Conductor,
    pub(super) knobs: &'a Knobs,
}
