//! How the ranks of a data-parallel group talk to each other (one process, a thread per device;
//! see [`crate::parallel`]):
//!
//! - [`faults`]: the group's failure state. The first rank that fails is recorded with its
//!   cause; every blocking call of every rank then returns [`Error::RankFailed`] naming it, and
//!   NCCL's communicators are aborted, so no rank waits for one that is gone.
//! - [`exchange`]: the in-process rendezvous: barriers and gathers of host values (losses,
//!   overflow flags, gradient norms, NCCL's unique id), with tags that must agree and a timeout
//!   that declares a missing rank failed.
//! - [`Transport`]: sums over the ranks of device memory, with two peers: `nccl` on CUDA
//!   (NCCL itself, loaded at run time, on a side stream of each device) and `host` on the host
//!   device (the exchange, summing in rank order, so that host runs are bit-exact).
//! - [`Collective`]: a rank's collectives as the runtimes use them: each one is a transfer of its
//!   own (`transfer_issued` and `transfer_completed`, direction `collective`, with its bytes and
//!   its time on the device), and keeps the tensors it reads and writes alive until it completed.

pub(crate) mod exchange;
pub(crate) mod faults;
mod host;
pub(crate) mod nccl;

use crate::device::{Device, StreamEvent};
use crate::error::{Error, Result};
use crate::events::{Bus, Direction, EventKind, Owner, TransferId};
use exchange::Exchange;
use faults::Faults;
use std::sync::Arc;
use tch::Tensor;

/// A collective queued on a device: timed events around it (`start` absent where it is not
/// timed) on the stream it runs on.
#[derive(Debug)]
pub(crate) struct Span {
    pub start: Option<StreamEvent>,
    pub done: StreamEvent,
}

/// Sums of device memory over a group's ranks: NCCL on CUDA, the exchange on the host device.
/// Both order the collective after the compute stream's work so far; the caller keeps the
/// tensors alive until `done` completed.
pub(crate) trait Transport: Send + Sync + std::fmt::Debug {
    /// Sums `input` (`world * n` elements) over the ranks and writes this rank's `n` into
    /// `output` (rank `r` gets elements `r * n .. (r + 1) * n`).
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, tag: &str) -> Result<Span>;
    /// Sums `tensor` over the ranks, in place.
    fn all_reduce(&self, tensor: &Tensor, tag: &str) -> Result<Span>;
    /// The end of the run on this rank (NCCL frees its communicator).
    fn close(&self) {}
}

/// A collective in flight: it keeps the tensors it reads and writes alive until it completed
/// (they come from libtorch's allocator, which would otherwise hand their memory to the
/// compute stream while the collective still uses it).
#[derive(Debug)]
#[must_use = "a collective must be finished so that its completion is reported"]
pub(crate) struct InFlight {
    id: TransferId,
    owner: Owner,
    bytes: u64,
    span: Span,
    /// Held, never read: the tensors stay allocated until the collective completed.
    _keep: Vec<Tensor>,
}

impl InFlight {
    /// The event after the collective (for a copy stream or the compute stream to wait on).
    pub(crate) fn done(&self) -> &StreamEvent {
        &self.span.done
    }

    /// Bytes the collective reduces on this rank (device memory it holds while in flight).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether it completed (never blocks).
    pub(crate) fn is_complete(&self) -> bool {
        self.span.done.is_complete()
    }
}

/// One rank's collectives over its transport, reported on its bus.
#[derive(Debug)]
pub(crate) struct Collective {
    transport: Box<dyn Transport>,
    device: Device,
    bus: Bus,
    /// NCCL cannot tell that two ranks paired different collectives of the same size (a
    /// reduce-scatter of another block): before each one the ranks check on the host that they
    /// queue the same thing (the host device's exchange checks it by itself).
    agree: Option<(usize, Arc<Exchange>)>,
}

impl Collective {
    /// Rank `rank`'s NCCL collectives, checked against the other ranks' through `exchange`.
    pub(crate) fn nccl(transport: nccl::NcclTransport, rank: usize, device: Device, bus: Bus, exchange: Arc<Exchange>) -> Collective {
        Collective { transport: Box::new(transport), device, bus, agree: Some((rank, exchange)) }
    }

    /// The host device's collectives for rank `rank`, through the group's exchange.
    pub(crate) fn host(rank: usize, device: Device, bus: Bus, exchange: Arc<Exchange>) -> Collective {
        Collective { transport: Box::new(host::HostTransport::new(rank, device.clone(), exchange)), device, bus, agree: None }
    }

    fn check_agreement(&self, what: &str, t: &Tensor) -> Result<()> {
        match &self.agree {
            Some((rank, ex)) => ex.barrier(*rank, &format!("{what} ({} elements of {:?})", t.numel(), t.kind())),
            None => Ok(()),
        }
    }

    /// The end of the run on this rank.
    pub(crate) fn close(&self) {
        self.transport.close()
    }

    fn issued(&self, owner: Owner, bytes: u64, subject: &str) -> TransferId {
        let id = self.device.next_transfer_id();
        self.bus.publish_with(|| EventKind::TransferIssued { id, dir: Direction::Collective, owner, bytes, subject: subject.to_owned() });
        id
    }

    /// Reduce-scatter of `input` into `output` (see [`Transport::reduce_scatter`]).
    pub(crate) fn reduce_scatter(&self, input: Tensor, output: Tensor, owner: Owner, subject: &str) -> Result<InFlight> {
        let bytes = crate::torch::tensor_bytes(&input);
        self.check_agreement(&format!("reduce-scatter of {subject}"), &input)?;
        let id = self.issued(owner, bytes, subject);
        let span = self.transport.reduce_scatter(&input, &output, subject)?;
        Ok(InFlight { id, owner, bytes, span, _keep: vec![input, output] })
    }

    /// All-reduce of `tensor` in place (see [`Transport::all_reduce`]).
    pub(crate) fn all_reduce(&self, tensor: Tensor, owner: Owner, subject: &str) -> Result<InFlight> {
        let bytes = crate::torch::tensor_bytes(&tensor);
        self.check_agreement(&format!("all-reduce of {subject}"), &tensor)?;
        let id = self.issued(owner, bytes, subject);
        let span = self.transport.all_reduce(&tensor, subject)?;
        Ok(InFlight { id, owner, bytes, span, _keep: vec![tensor] })
    }

    fn completed(&self, op: &InFlight) -> Option<f64> {
        let ms = op.span.start.as_ref().and_then(|s| s.elapsed_ms(&op.span.done));
        let (id, owner, bytes) = (op.id, op.owner, op.bytes);
        self.bus.publish_with(|| EventKind::TransferCompleted { id, dir: Direction::Collective, owner, bytes, duration_ms: ms });
        ms
    }

    /// Reports a completed collective and releases its tensors, returning its time on the
    /// device (ms); the collective itself while it runs.
    pub(crate) fn finish(&self, op: InFlight) -> std::result::Result<Option<f64>, InFlight> {
        if !op.is_complete() {
            return Err(op);
        }
        Ok(self.completed(&op))
    }

    /// Waits for a collective (the host waits), reports it and releases its tensors.
    pub(crate) fn wait(&self, op: InFlight) -> Result<Option<f64>> {
        op.span.done.synchronize()?;
        Ok(self.completed(&op))
    }
}

/// A rank's place in its group, shared by the runtimes of its handle: who it is, the group's
/// failure state and rendezvous, and its collectives.
#[derive(Debug, Clone)]
pub(crate) struct Membership {
    pub rank: usize,
    pub world: usize,
    pub faults: Arc<Faults>,
    pub exchange: Arc<Exchange>,
    pub collective: Arc<Collective>,
}

impl Membership {
    /// Records this rank's failure (the group stops) and returns the error every rank sees.
    pub(crate) fn fail(&self, cause: impl std::fmt::Display) -> Error {
        self.faults.raise(self.rank, cause.to_string()).error()
    }
}
