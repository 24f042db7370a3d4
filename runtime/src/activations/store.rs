//! The saved-tensor store: pack (forward), unpack and release (backward).

use super::policy::{region_matches, PackFacts, Verdict};
use super::record::{Record, RecordState, TensorMeta};
use super::runtime::{Inner, Shared};
use super::transfer::transfer_id;
use crate::error::{Error, Result};
use crate::events::{Direction, EventKind, KeepReason, Owner, PackDecision, Priority, TensorId};
use crate::saved::WeightSave;
use crate::torch::{SavedTensorStore, TensorIdentity};
use std::sync::Arc;
use tch::Tensor;

/// Where autograd's saved tensors go while [`super::ActivationRuntime::managed_forward`] is on.
#[derive(Clone)]
pub struct ActivationStore {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ActivationStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationStore").finish_non_exhaustive()
    }
}

impl ActivationStore {
    pub(super) fn new(shared: Arc<Shared>) -> ActivationStore {
        ActivationStore { shared }
    }
}

impl SavedTensorStore for ActivationStore {
    fn pack(&self, tensor: Tensor) -> std::result::Result<u64, String> {
        // Ask the weight runtime first, outside our lock (it takes its own).
        if let Some(resolver) = &self.shared.resolver {
            if let Some(save) = resolver.resolve(&tensor) {
                return Ok(self.shared.pack_weight(save));
            }
        }
        self.shared.pack_tensor(tensor).map_err(|e| e.to_string())
    }

    fn unpack(&self, handle: u64) -> std::result::Result<Tensor, String> {
        self.shared.unpack(handle).map_err(|e| e.to_string())
    }

    fn release(&self, handle: u64) {
        self.shared.release(handle);
    }
}

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

impl Shared {
    fn pack_weight(&self, save: WeightSave) -> u64 {
        let mut g = self.lock();
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        let bytes = save.bytes;
        let mut rec = Record::new(id, RecordState::WeightHandle, bytes);
        rec.weight = Some(save);
        let (_, handle) = g.records.insert(rec);
        g.metrics.activations_saved += 1;
        g.metrics.weight_handles += 1;
        let region = current_region(&g);
        self.telemetry.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::WeightHandle,
            reason: None,
            bytes,
            class: None,
            pool_hit: None,
            region,
        });
        handle
    }

    fn pack_tensor(&self, t: Tensor) -> Result<u64> {
        let identity = TensorIdentity::of(&t);
        let bytes = tensor_bytes(&t);
        let mut g = self.lock();
        if let Some(idx) = g.records.find_identity(&identity) {
            if let Some(rec) = g.records.get_mut(idx) {
                rec.refs += 1;
                let id = rec.id;
                let handle = g.records.new_handle(idx);
                let region = current_region(&g);
                self.telemetry.publish_with(|| EventKind::Pack {
                    tensor: id,
                    decision: PackDecision::Duplicate,
                    reason: None,
                    bytes,
                    class: None,
                    pool_hit: None,
                    region,
                });
                return Ok(handle);
            }
        }
        g.next_tensor += 1;
        let id = TensorId(g.next_tensor);
        // On the host device every tensor is "on the device" (there is no other one).
        let on_device = !self.device.is_cuda() || t.device() == self.device.tch_device();
        let parameter = g.parameters.contains(&identity.storage_ptr) || (t.is_leaf() && t.requires_grad());
        let region = current_region(&g);
        let region_allowed = self.config.regions.is_empty()
            || region
                .as_deref()
                .is_some_and(|path| self.config.regions.iter().any(|p| region_matches(p, path)));
        let keep_tail = self.config.keep_tail_groups as usize;
        let tail = keep_tail > 0
            && !g.in_backward
            && !g.profile.is_empty()
            && g.group.is_some_and(|gi| gi as usize + keep_tail >= g.profile.len());
        let spillable = on_device && !parameter && bytes >= self.config.min_spill_bytes && region_allowed;
        if spillable && !g.in_backward {
            if let Some(gi) = g.group {
                if let Some(p) = g.learning.get_mut(gi as usize) {
                    p.bytes += bytes;
                    p.tensors += 1;
                }
            }
        }
        let facts = PackFacts {
            bytes,
            on_device,
            parameter,
            region_allowed,
            tail,
            allocated: self.device.memory().allocated,
        };
        let (verdict, toggled) = g.policy.decide(&facts);
        if let Some(on) = toggled {
            self.telemetry.publish_with(|| EventKind::SpillingToggled {
                on,
                vram_allocated_bytes: facts.allocated,
            });
            self.vram_sample();
        }
        g.metrics.activations_saved += 1;
        let reason = match verdict {
            Verdict::Spill if self.spills_paused() => {
                g.policy.spill_refused(bytes);
                KeepReason::SpillsPaused
            }
            Verdict::Spill => match self.spill(&mut g, &t, identity.clone(), bytes, id, region.clone()) {
                Ok(handle) => return Ok(handle),
                Err(Error::TooLarge { .. }) => {
                    g.policy.spill_refused(bytes);
                    KeepReason::TooLarge
                }
                Err(e) => return Err(e),
            },
            Verdict::Keep(reason) => reason,
        };
        let mut rec = Record::new(id, RecordState::Kept, bytes);
        // Detached: a kept output must not reference its own grad_fn (a cycle).
        rec.tensor = Some(t.detach());
        rec.identity = Some(identity);
        if on_device && !parameter {
            self.set_device_bytes(&mut rec, bytes);
        }
        let (_, handle) = g.records.insert(rec);
        g.metrics.activations_kept += 1;
        self.telemetry.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Kept,
            reason: Some(reason),
            bytes,
            class: None,
            pool_hit: None,
            region,
        });
        Ok(handle)
    }

    /// Starts the D2H copy of `t` into a pool buffer and records it as spilling.
    fn spill(
        &self,
        g: &mut Inner,
        t: &Tensor,
        identity: TensorIdentity,
        bytes: u64,
        id: TensorId,
        region: Option<String>,
    ) -> Result<u64> {
        self.make_room_d2h(g)?;
        let (mut lease, hit) = g.pool.acquire(bytes)?;
        // Required: a spill the policy asked for relieves memory now, so it is never refused.
        let slot = g
            .conductor
            .acquire_slot(Direction::D2h, Owner::Activations, Priority::Required)
            .ok();
        let src = t.detach();
        let contiguous = src.is_contiguous();
        let src = if contiguous { src } else { src.f_contiguous()? };
        let meta = TensorMeta {
            kind: t.kind(),
            sizes: t.size(),
            strides: t.stride(),
            contiguous,
        };
        let issued = {
            let Inner { pool, transfers, .. } = &mut *g;
            pool.buffer_mut(&mut lease)
                .and_then(|(buf, off)| transfers.d2h.d2h(buf, off, &src, None))
        };
        let pending = match issued {
            Ok(p) => p,
            Err(e) => {
                g.pool.release(lease);
                return Err(e);
            }
        };
        let class = lease.class();
        let mut rec = Record::new(id, RecordState::Spilling, bytes);
        rec.tensor = Some(src);
        rec.lease = Some(lease);
        rec.copy = Some(pending);
        rec.slot = slot;
        rec.meta = Some(meta);
        // A contiguous copy made here is not the saved storage: dedupe only when we hold that.
        rec.identity = contiguous.then_some(identity);
        self.set_device_bytes(&mut rec, bytes);
        let (idx, handle) = g.records.insert(rec);
        g.transfers.inflight_d2h.push_back(idx);
        g.metrics.activations_spilled += 1;
        g.metrics.spill_bytes += bytes;
        if hit {
            g.metrics.pool_hits += 1;
        } else {
            g.metrics.pool_misses += 1;
        }
        self.telemetry.publish_with(|| EventKind::Pack {
            tensor: id,
            decision: PackDecision::Spilled,
            reason: None,
            bytes,
            class,
            pool_hit: Some(hit),
            region,
        });
        self.telemetry.publish_with(|| EventKind::TransferIssued {
            id: transfer_id(id.0, Direction::D2h),
            dir: Direction::D2h,
            owner: Owner::Activations,
            bytes,
            subject: format!("tensor {id}"),
        });
        Ok(handle)
    }

    fn unpack(&self, handle: u64) -> Result<Tensor> {
        let mut g = self.lock();
        let idx = g.records.index_of(handle).ok_or_else(|| {
            Error::State(format!(
                "saved tensor handle {handle} is unknown (released, or from a step that already ended)"
            ))
        })?;
        if !g.in_backward {
            // Backward has begun: no spill is worth leaving in flight any longer.
            g.in_backward = true;
            self.finalize_all_spills(&mut g)?;
        }
        let state = g
            .records
            .get(idx)
            .map(|r| r.state)
            .ok_or_else(|| Error::State(format!("saved tensor handle {handle} has no record")))?;
        let out = match state {
            RecordState::WeightHandle => None,
            RecordState::Kept => g.records.get(idx).and_then(|r| r.tensor.as_ref()).map(|t| t.shallow_clone()),
            RecordState::Spilling | RecordState::Spilled | RecordState::Restoring | RecordState::Restored => {
                if state == RecordState::Spilling {
                    self.finalize_spill(&mut g, idx, false)?;
                }
                if matches!(state, RecordState::Spilling | RecordState::Spilled) {
                    let slot = g
                        .conductor
                        .acquire_slot(Direction::H2d, Owner::Activations, Priority::Required)
                        .ok();
                    self.issue_restore(&mut g, idx, false, slot)?;
                }
                let t = self.serve_restored(&mut g, idx)?;
                self.reap_restores(&mut g, false)?;
                Some(t)
            }
        };
        self.predict_from(&mut g, idx)?;
        match out {
            Some(t) => Ok(t),
            None if state == RecordState::WeightHandle => {
                let save = g
                    .records
                    .get(idx)
                    .and_then(|r| r.weight.clone())
                    .ok_or_else(|| Error::State(format!("weight handle {handle} has no save")))?;
                drop(g);
                let resolver = self
                    .resolver
                    .as_ref()
                    .ok_or_else(|| Error::State("a weight handle without a weight resolver".into()))?;
                resolver.materialize(&save).map_err(Error::State)
            }
            None => Err(Error::State(format!("kept tensor of handle {handle} is missing"))),
        }
    }

    fn release(&self, handle: u64) {
        let save = {
            let mut g = self.lock();
            // An unknown handle belongs to a step that already ended: nothing left to free.
            let Some(idx) = g.records.remove_handle(handle) else {
                return;
            };
            let last = match g.records.get_mut(idx) {
                Some(rec) => {
                    rec.refs = rec.refs.saturating_sub(1);
                    rec.refs == 0
                }
                None => false,
            };
            if !last {
                return;
            }
            self.retire(&mut g, idx)
        };
        if let (Some(save), Some(r)) = (save, &self.resolver) {
            r.release(&save);
        }
    }
}

fn current_region(g: &Inner) -> Option<String> {
    (!g.regions.is_empty()).then(|| g.regions.join("."))
}
