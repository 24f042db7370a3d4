//! The handle's weights plan, made once, the first time the model runs: in a training step, or
//! in a forward outside any step (an evaluation or sampling before the first step), which the
//! weight runtime asks for through a hook before it makes any block resident.

use super::plan::{self, BudgetGuide, Machine, ModelFacts, Plan};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::Table;
use crate::precision::{Precision, StateStorage};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Where a plan's model runs: its device, and its rank and group size in a data-parallel group
/// ((0, 1) on one device).
pub(super) struct Place {
    pub device: Device,
    pub rank: u32,
    pub world_size: u32,
}

/// What the plan needs and the plan, once made.
pub(super) struct Planner {
    device: Device,
    budget: u64,
    prefetch_window: u32,
    /// The run's precision and how the host optimizer stores its state.
    precision: (Precision, StateStorage),
    /// Settings given on the builder over the plan's choice.
    knobs: super::knobs::Knobs,
    table: Arc<Table>,
    vars: Arc<Mutex<tch::nn::Variables>>,
    /// Optimizer state per trainable byte, from the optimizer made (Adam's 2 until then).
    state_factor: AtomicU64,
    /// This rank's number and its group's size ((0, 1) on one device).
    group: (u32, u32),
    plan: Mutex<Option<Plan>>,
}

impl std::fmt::Debug for Planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner").field("budget", &self.budget).finish_non_exhaustive()
    }
}

impl Planner {
    /// A planner for the model on `table` (its VarStore's variables are `vars`); the weight
    /// runtime asks it for the plan before its first block use.
    pub(super) fn new(
        place: Place,
        budget: u64,
        prefetch_window: u32,
        precision: (Precision, StateStorage),
        knobs: super::knobs::Knobs,
        table: Arc<Table>,
        vars: Arc<Mutex<tch::nn::Variables>>,
    ) -> Arc<Planner> {
        let p = Arc::new(Planner {
            device: place.device,
            budget,
            prefetch_window,
            precision,
            knobs,
            table,
            vars,
            group: (place.rank, place.world_size),
            state_factor: AtomicU64::new(2),
            plan: Mutex::new(None),
        });
        // Weak: the runtime must not keep the planner (which holds the runtime) alive.
        let weak: Weak<Planner> = Arc::downgrade(&p);
        p.table.runtime().set_planner(Arc::new(move || match weak.upgrade() {
            Some(p) => p.ensure().map(|_| ()),
            None => Ok(()),
        }));
        p
    }

    pub(super) fn set_state_factor(&self, factor: u64) {
        self.state_factor.store(factor, Ordering::Relaxed);
    }

    /// What the plan needs to know of the model and the machine (registering the model's
    /// layers first).
    pub(super) fn facts(&self) -> Result<(ModelFacts, Machine)> {
        self.table.seal()?;
        // What the device holds before the run's own memory (other models, libtorch's
        // workspaces, allocated first so the reading counts them).
        self.device.warm_up()?;
        let baseline = self.device.memory().allocated;
        let managed = self.table.managed_names();
        let mut unmanaged = (0u64, 0u64);
        for (name, t) in self.variables() {
            if managed.contains(&name) {
                continue;
            }
            let bytes = crate::torch::tensor_bytes(&t);
            if t.requires_grad() {
                unmanaged.0 += bytes;
            } else {
                unmanaged.1 += bytes;
            }
        }
        let specs = self.table.runtime().blocks();
        let elements = |keep: fn(&crate::weights::ParamSpec) -> bool| -> u64 {
            specs.iter().flat_map(|b| b.params.iter().filter(|p| keep(p))).map(|p| p.numel().max(0) as u64).sum()
        };
        let facts = ModelFacts {
            blocks: specs.iter().map(|b| (b.bytes as u64, b.trainable())).collect(),
            unmanaged_trainable_bytes: unmanaged.0,
            unmanaged_frozen_bytes: unmanaged.1,
            optimizer_state_factor: self.state_factor.load(Ordering::Relaxed),
            baseline_bytes: baseline,
            precision: self.precision.0,
            state_storage: self.precision.1,
            trained_elements: elements(|p| p.trainable),
            master_elements: elements(|p| p.has_master()),
            transfer_bytes: specs.iter().map(|b| b.transfer_bytes() as u64).collect(),
            stash_bytes: specs.iter().filter_map(|b| b.quant.as_ref().map(|q| q.stash_bytes as u64)).max().unwrap_or(0),
            quantization: self.table.runtime().quantization_reports(),
            models: self.model_facts(specs.len()),
            rank: self.group.0,
            world_size: self.group.1,
        };
        let machine = Machine {
            // The host device's "memory" is the budget itself (checked against the host's
            // memory when the handle was built): no bound of its own.
            device_bytes: if self.device.is_cuda() { self.device.info().total_bytes } else { 0 },
            host_available_bytes: plan::host_available_bytes(),
            // Registration made the blocks' pinned copies and gradient buffers (from the
            // weights' host pool, which may hold more: a pool handed over) and their masters.
            host_held_bytes: self.table.runtime().host_pool().stats().pinned_bytes
                + 4 * if self.group.0 == 0 { facts.master_elements } else { 0 },
        };
        Ok((facts, machine))
    }

    /// Each model's blocks, when the runtime streams several models.
    fn model_facts(&self, blocks: usize) -> Vec<super::plan::ModelFact> {
        let rt = self.table.runtime();
        let entries = rt.model_entries();
        if entries.len() < 2 {
            return Vec::new();
        }
        let of = rt.block_models();
        entries
            .into_iter()
            .map(|(name, frozen)| super::plan::ModelFact {
                blocks: (0..blocks).filter(|&i| of.get(i) == Some(&name)).collect(),
                name,
                frozen,
            })
            .filter(|m| !m.blocks.is_empty())
            .collect()
    }

    /// The budgets where the plan for this model changes (see [`BudgetGuide`]).
    pub(super) fn guide(&self) -> Result<BudgetGuide> {
        let (facts, machine) = self.facts()?;
        Plan::guide(&facts, machine, self.prefetch_window)
    }

    fn variables(&self) -> Vec<(String, tch::Tensor)> {
        let v = self.vars.lock().unwrap_or_else(|p| p.into_inner());
        v.named_variables.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
    }

    /// Makes the plan (once) and gives the weight runtime its part: the resident blocks, the
    /// room, the gradients in flight; the variables Stagehand does not manage move to the
    /// compute device.
    pub(super) fn ensure(&self) -> Result<Plan> {
        let mut slot = self.plan.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = &*slot {
            return Ok(p.clone());
        }
        let (facts, machine) = self.facts()?;
        let mut plan = Plan::derive(self.budget, &facts, machine, self.prefetch_window)?;
        self.knobs.apply(&mut plan)?;
        self.table.close_registration();
        let dev = self.device.tch_device();
        let managed = self.table.managed_names();
        for (name, mut t) in self.variables() {
            if !managed.contains(&name) && t.device() != dev {
                let moved = t.f_to_device(dev)?;
                t.set_data(&moved);
            }
        }
        let weights = self.table.runtime();
        let specs = weights.blocks();
        let resident: Vec<_> = plan
            .resident_blocks
            .iter()
            .map(|&i| specs.get(i).map(|s| s.id).ok_or_else(|| Error::internal(format!("the plan keeps block {i} of {}", specs.len()))))
            .collect::<Result<_>>()?;
        weights.set_resident(&resident)?;
        let room = if plan.streams() { plan.weights_budget_bytes() } else { u64::MAX / 4 };
        weights.configure(
            room,
            format!("the plan for a {} MiB budget", self.budget >> 20),
            plan.prefetch_window,
            plan.max_inflight_h2d,
        )?;
        // The plan keeps room for the gradients of two blocks on their way to the host.
        weights.set_max_inflight_grad_bytes((plan.gradient_bytes > 0).then_some(plan.gradient_bytes));
        // The room is made now, against the baseline the plan measured.
        weights.make_room()?;
        *slot = Some(plan.clone());
        Ok(plan)
    }
}
