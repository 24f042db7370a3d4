//! Gradient clipping as tch computes it, over every gradient of the model: device variables'
//! gradients and streamed parameters' host gradients, in the VarStore's order of trainable
//! variables (the order tch adds per-gradient norms in, which decides the float result).

use super::optimizer::{trainable, Optimizer};
use crate::error::Result;
use crate::events::BlockId;
use std::collections::HashSet;
use tch::Tensor;

impl Optimizer {
    /// Every gradient of this accumulation window, in the VarStore's order of trainable
    /// variables (the order tch's clipping adds norms in), streamed parameters' host gradients
    /// included. Waits for streamed gradients to reach the host.
    fn gradients(&mut self) -> Result<Vec<Tensor>> {
        self.ensure_built()?;
        self.rt.collect_grads()?;
        self.reduce_device_grads()?;
        let specs = self.rt.blocks();
        let mut host: Vec<(String, Tensor)> = Vec::new();
        let mut blocks: Vec<u32> = self.host.keys().copied().collect();
        blocks.sort_unstable();
        for b in blocks {
            for (i, g) in self.rt.received_grads(BlockId(b))? {
                let name = specs.get(b as usize).and_then(|s| s.params.get(i)).map(|p| p.name.clone()).unwrap_or_default();
                host.push((name, g));
            }
        }
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for t in self.origin.as_ref().map(trainable).unwrap_or_default() {
            seen.insert(t.id);
            if let Some(i) = host.iter().position(|(n, _)| *n == t.name) {
                out.push(host.swap_remove(i).1);
                continue;
            }
            let g = t.var.grad();
            if g.defined() {
                out.push(g);
            }
        }
        for p in &self.device_params {
            let g = p.var.grad();
            if !seen.contains(&p.id) && g.defined() {
                out.push(g);
            }
        }
        out.extend(host.into_iter().map(|(_, g)| g));
        Ok(out)
    }

    /// Clamps every gradient element to `[-max, max]` (tch's `clip_grad_value`).
    pub fn clip_grad_value(&mut self, max: f64) -> Result<()> {
        for g in self.gradients()? {
            let _ = tch::no_grad(|| g.shallow_clone().f_clamp_(-max, max))?;
        }
        Ok(())
    }

    /// Scales every gradient so that their total 2-norm is at most `max`, computed as tch does
    /// (the norm of the stacked per-gradient norms); returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max: f64) -> Result<f64> {
        let grads = self.gradients()?;
        if self.member.is_some() {
            return self.clip_grad_norm_group(max, &grads);
        }
        if grads.is_empty() {
            return Ok(0.0);
        }
        tch::no_grad(|| -> Result<f64> {
            let norms = grads
                .iter()
                .map(|g| Ok(g.f_norm()?.f_to_device(tch::Device::Cpu)?))
                .collect::<Result<Vec<_>>>()?;
            let total = Tensor::f_stack(&norms, 0)?.f_norm()?.f_double_value(&[])?;
            let coef = max / (total + 1e-6);
            if coef < 1.0 {
                for g in &grads {
                    let _ = g.shallow_clone().f_mul_scalar_(coef)?;
                }
            }
            Ok(total)
        })
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) in a data-parallel group, where each rank holds
    /// its shard of the streamed parameters' gradients and the whole (summed) gradients of the
    /// device variables: the squares of the shards' norms are summed over the ranks (in rank
    /// order, so every rank gets the same total), the device gradients' added once. Equal to one
    /// device's norm within float rounding (it adds in another order).
    fn clip_grad_norm_group(&mut self, max: f64, grads: &[Tensor]) -> Result<f64> {
        let Some(m) = self.member.clone() else { return Ok(0.0) };
        tch::no_grad(|| -> Result<f64> {
            let sq = |t: &Tensor| -> Result<f64> {
                let n = t.f_norm()?.f_double_value(&[])?;
                Ok(n * n)
            };
            let mut shards = 0.0;
            let mut blocks: Vec<u32> = self.host.keys().copied().collect();
            blocks.sort_unstable();
            for b in blocks {
                for (_, g) in self.rt.received_grads(BlockId(b))? {
                    shards += sq(&g)?;
                }
            }
            let mut device = 0.0;
            for p in &self.device_params {
                let g = p.var.grad();
                if g.defined() {
                    device += sq(&g)?;
                }
            }
            let total = (m.exchange.sum_f64(m.rank, "the gradient norm", shards)? + device).sqrt();
            let coef = max / (total + 1e-6);
            if coef < 1.0 {
                for g in grads {
                    let _ = g.shallow_clone().f_mul_scalar_(coef)?;
                }
            }
            Ok(total)
        })
    }
}
