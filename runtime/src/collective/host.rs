//! The host device's collectives: N simulated devices in one process reduce through the
//! group's [`Exchange`](super::exchange::Exchange). Sums are taken in rank order, element by
//! element, with the same kernel that adds a micro-batch's gradient to the ones before it, so
//! that N ranks training on N slices of a batch compute the same bits as one device training on
//! the whole batch in N micro-batches (`runtime/tests/parallel.rs` checks it).

use super::exchange::Exchange;
use super::{Span, Transport};
use crate::device::Device;
use crate::error::{Error, Result};
use std::sync::Arc;
use tch::Tensor;

/// One rank's end of the host device's collectives.
#[derive(Debug)]
pub(crate) struct HostTransport {
    rank: usize,
    device: Device,
    exchange: Arc<Exchange>,
}

impl HostTransport {
    pub(crate) fn new(rank: usize, device: Device, exchange: Arc<Exchange>) -> HostTransport {
        HostTransport { rank, device, exchange }
    }

    /// Every rank's tensor for this round (shallow clones), in rank order.
    fn gather(&self, tag: &str, t: &Tensor) -> Result<Vec<Tensor>> {
        let shape = format!("{tag} ({} elements of {:?})", t.numel(), t.kind());
        let all = self.exchange.round(self.rank, &shape, Box::new(t.shallow_clone()), |all| {
            all.iter()
                .map(|d| d.as_ref().and_then(|(_, v)| v.downcast_ref::<Tensor>()).map(Tensor::shallow_clone))
                .collect::<Option<Vec<Tensor>>>()
        })?;
        all.ok_or_else(|| Error::internal(format!("{tag}: a rank deposited something other than a tensor")))
    }
}

fn check(t: &Tensor, what: &str) -> Result<()> {
    if t.device() != tch::Device::Cpu || !t.is_contiguous() {
        return Err(Error::internal(format!("{what}: a contiguous tensor on the host device, not {:?} with strides {:?}", t.device(), t.stride())));
    }
    Ok(())
}

impl Transport for HostTransport {
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, tag: &str) -> Result<Span> {
        check(input, tag)?;
        check(output, tag)?;
        let world = self.exchange.world() as i64;
        let shard = output.numel() as i64;
        if input.numel() as i64 != shard * world || input.kind() != output.kind() {
            return Err(Error::internal(format!(
                "{tag}: reduce-scatter of {} {:?} elements into shards of {shard} {:?} over {world} ranks",
                input.numel(),
                input.kind(),
                output.kind()
            )));
        }
        let start = self.device.record_compute()?;
        let inputs = self.gather(&format!("reduce-scatter of {tag}"), input)?;
        let lo = self.rank as i64 * shard;
        tch::no_grad(|| -> Result<()> {
            let mut out = output.shallow_clone();
            out.f_copy_(&inputs[0].f_narrow(0, lo, shard)?)?;
            for t in &inputs[1..] {
                let _ = out.shallow_clone().f_add_(&t.f_narrow(0, lo, shard)?)?;
            }
            Ok(())
        })?;
        Ok(Span { start: Some(start), done: self.device.record_compute()? })
    }

    fn all_reduce(&self, tensor: &Tensor, tag: &str) -> Result<Span> {
        check(tensor, tag)?;
        let start = self.device.record_compute()?;
        let tag = format!("all-reduce of {tag}");
        let inputs = self.gather(&tag, tensor)?;
        let sum = tch::no_grad(|| -> Result<Tensor> {
            let sum = inputs[0].f_detach_copy()?;
            for t in &inputs[1..] {
                let _ = sum.shallow_clone().f_add_(t)?;
            }
            Ok(sum)
        })?;
        // Every rank has read every tensor before any is overwritten.
        self.exchange.barrier(self.rank, &format!("{tag}: summed"))?;
        tch::no_grad(|| tensor.shallow_clone().f_copy_(&sum))?;
        Ok(Span { start: Some(start), done: self.device.record_compute()? })
    }
}
