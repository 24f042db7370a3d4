//! The memory plan: everything a run's device budget decides, derived in one place from the
//! budget and the model, with the reasoning kept in words.
//!
//! The budget is cut, in order, into:
//! 1. a **reserve** for the allocator's rounding and kernels' workspaces (a sixteenth);
//! 2. the model's **unmanaged** variables, with their gradients and optimizer state (they live
//!    on the device);
//! 3. **resident blocks**: every block when all of them fit in half of what is left (nothing then
//!    streams), else only the small ones (under an eighth of the largest block, which would waste
//!    a slot), with their gradients and optimizer state;
//! 4. the **weights' room**: equal slots of the largest streamed block, enough for the prefetch
//!    window and about a quarter of the rest, plus room for the gradients of the block backward
//!    is leaving;
//! 5. **activations**: what is left. Spilling starts when allocated memory reaches the high
//!    watermark (two thirds of it kept) and stops a quarter of that lower; a fifth is for spills
//!    still landing and for restores ahead of backward, which begin when memory is at its
//!    highest, and the rest for the temporaries of the ops running then. A step that still
//!    peaks over the budget moves the watermarks down for the next (`session::adapt`).
//!
//! The Conductor gets the budget as its soft cap (a tenth more as its hard cap) and as many
//! transfer slots as the runtimes' copies in flight. Host memory is checked too: the host copies
//! of the weights, their gradients (pinned), the optimizer state and the activation pool must
//! fit in the memory the host has available.

use crate::error::{Error, Result};
use crate::precision::{Precision, StateStorage};
use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;
/// Share of the budget kept for the allocator and kernels' workspaces.
pub const RESERVE_FRACTION: f64 = 1.0 / 16.0;
/// Share of the usable budget the weights' room aims for when the model streams.
pub const WEIGHT_SHARE: f64 = 0.25;
/// Blocks smaller than this fraction of the largest stay resident.
pub const SMALL_BLOCK_FRACTION: u64 = 8;
/// Blocks prefetched ahead by default.
pub const DEFAULT_PREFETCH_WINDOW: u32 = 2;

/// What the plan needs to know about the model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// Bytes and trainability of each managed block.
    pub blocks: Vec<(u64, bool)>,
    /// Bytes of trainable and of frozen variables the runtime does not manage.
    pub unmanaged_trainable_bytes: u64,
    pub unmanaged_frozen_bytes: u64,
    /// Optimizer state per trainable byte (2 for Adam and AdamW, 1 for SGD with momentum).
    pub optimizer_state_factor: u64,
    /// Device memory already allocated before the run (other tensors, library workspaces): it
    /// counts against the budget.
    #[serde(default)]
    pub baseline_bytes: u64,
    /// The run's precision: under mixed precision trained blocks never stay resident (they
    /// train on the host, against their float32 masters).
    #[serde(default)]
    pub precision: Precision,
    /// How the host optimizer stores its state.
    #[serde(default)]
    pub state_storage: StateStorage,
    /// Elements of the managed blocks' trainable parameters (the host optimizer's state is
    /// sized from them).
    #[serde(default)]
    pub trained_elements: u64,
    /// Elements with a float32 master on the host (trained parameters streamed in 16 bits).
    #[serde(default)]
    pub master_elements: u64,
    /// Bytes each block's host copy holds and each of its loads copies, in `blocks` order (a
    /// quantized block's payload; empty: each block's bytes).
    #[serde(default)]
    pub transfer_bytes: Vec<u64>,
    /// The largest device buffer a quantized streamed block's dequantization stashes its
    /// payload's end in (0 without quantized blocks).
    #[serde(default)]
    pub stash_bytes: u64,
    /// What quantizing each quantized block cost.
    #[serde(default)]
    pub quantization: Vec<crate::events::QuantizationReport>,
    /// The models whose blocks these are, when the handle runs several (empty: one model).
    #[serde(default)]
    pub models: Vec<ModelFact>,
    /// Ranks of the data-parallel group this plan is for (0 or 1: one device). In a group the
    /// trained blocks stream (each rank's host optimizer steps its shard of them) and each
    /// rank holds its shard's pinned gradients and optimizer state; rank 0 holds the one host
    /// copy of the weights.
    #[serde(default)]
    pub world_size: u32,
    /// This rank's number in the group.
    #[serde(default)]
    pub rank: u32,
}

/// One model of a handle that runs several, as the plan sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelFact {
    pub name: String,
    /// Declared frozen: only its forward runs in a step (a teacher, a reference model).
    pub frozen: bool,
    /// Its blocks, as indices into `ModelFacts::blocks`.
    pub blocks: Vec<usize>,
}

/// One model's share of the budget in a plan (see [`Plan::models`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelShare {
    pub name: String,
    pub blocks: u32,
    /// Its blocks kept resident, and their device bytes (with gradients and optimizer state).
    pub resident_blocks: u32,
    pub resident_bytes: u64,
    /// Its blocks streaming through the shared room.
    pub streamed_blocks: u32,
    /// Host bytes of its blocks (pinned).
    pub host_bytes: u64,
    /// The bytes its blocks move a step, predicted from the combined itinerary: the frozen
    /// models' forwards, then the trained ones' forward and backward, through the room's
    /// slots by Belady's rule (the runtime's `weight_step` reports what the traced itinerary
    /// needs).
    pub predicted_h2d_bytes: u64,
}

/// The machine the plan must fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// Device memory in all.
    pub device_bytes: u64,
    /// Host memory available now.
    pub host_available_bytes: u64,
    /// Of the plan's host memory, what is already allocated, so not among the available bytes:
    /// the registered blocks' host copies, gradient buffers and float32 masters (a handle plans
    /// after its model's blocks are registered; 0 for a plan made beforehand).
    #[serde(default)]
    pub host_held_bytes: u64,
}

/// Every memory decision of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub budget_bytes: u64,
    /// Device memory already allocated when the plan was made.
    pub baseline_bytes: u64,
    pub reserve_bytes: u64,
    /// Device bytes of unmanaged variables with their gradients and optimizer state.
    pub unmanaged_bytes: u64,
    /// Indices of the blocks kept resident (in `ModelFacts::blocks` order).
    pub resident_blocks: Vec<usize>,
    /// Device bytes of resident blocks with their gradients and optimizer state.
    pub resident_bytes: u64,
    /// Device bytes of the resident blocks' weights alone (what the weight runtime holds for
    /// them beside its streaming room).
    #[serde(default)]
    pub resident_weight_bytes: u64,
    /// The streaming room: slots of `slot_bytes` each (0 when nothing streams).
    pub slots: u32,
    pub slot_bytes: u64,
    pub weight_room_bytes: u64,
    /// Device bytes kept for gradients of streamed blocks on their way to the host.
    pub gradient_bytes: u64,
    pub spill_high_bytes: u64,
    pub spill_low_bytes: u64,
    /// The lowest the high watermark may be moved to when steps go over the budget: what the
    /// device holds before any activation is kept.
    pub spill_floor_bytes: u64,
    pub restore_allowance_bytes: u64,
    /// Most bytes one batch of small spills gathers, and the size under which a spilled tensor
    /// joins a batch.
    #[serde(default)]
    pub spill_batch_bytes: u64,
    #[serde(default)]
    pub spill_batch_below_bytes: u64,
    pub prefetch_window: u32,
    pub max_inflight_h2d: u32,
    pub max_inflight_restores: u32,
    pub max_inflight_spills: u32,
    pub soft_cap_bytes: u64,
    pub hard_cap_bytes: u64,
    pub h2d_slots: u32,
    pub d2h_slots: u32,
    /// Host bytes the plan pins (weights, their gradients) and the most the activation pool may.
    pub pinned_bytes: u64,
    pub pool_limit_bytes: u64,
    /// Host memory available when the plan was made, less what the plan's own allocations
    /// still take (0: not known). A pool limit set on the builder must stay within it.
    #[serde(default)]
    pub host_left_bytes: u64,
    /// Host bytes of optimizer state (pageable).
    pub optimizer_state_bytes: u64,
    /// Host bytes of float32 masters (pageable; mixed precision).
    #[serde(default)]
    pub master_bytes: u64,
    /// Device bytes kept for the stash a quantized block's dequantization uses (transient).
    #[serde(default)]
    pub dequant_stash_bytes: u64,
    /// What quantizing each quantized block cost (format, bytes, error).
    #[serde(default)]
    pub quantization: Vec<crate::events::QuantizationReport>,
    /// Each model's share when the handle runs several: one budget, one room shared along the
    /// combined itinerary.
    #[serde(default)]
    pub models: Vec<ModelShare>,
    /// The derivation, one line per decision.
    pub reasons: Vec<String>,
}

/// Bytes in MiB, or in KiB under one MiB (small models' plans say something then).
pub(super) fn mib(b: u64) -> String {
    if b < MIB {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", b as f64 / MIB as f64)
    }
}

/// Why a budget does not fit a model, before the smallest one that does is known.
enum Misfit {
    /// The budget is too small: what does not fit.
    Budget(String),
    /// Something no budget changes (the device's or the host's memory).
    Other(Error),
}

impl From<Error> for Misfit {
    fn from(e: Error) -> Misfit {
        Misfit::Other(e)
    }
}

/// What budgets buy a model: the sizes where the plan changes what it does. Every size is a
/// budget the plan accepts (each was derived).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetGuide {
    /// The smallest budget the model trains in: the reserve, the unmanaged variables, the small
    /// resident blocks, the gradients of two streamed blocks, two slots of the largest streamed
    /// block (one in use, one loading, so each block's copy waits for the block before it) and
    /// the least room for activations.
    pub minimum_bytes: u64,
    /// From here the streaming room holds the prefetch window ahead of the block in use and
    /// one more (or every streamed block): copies run ahead of compute.
    pub full_window_bytes: u64,
    /// From here every block stays on the device with its gradients and optimizer state:
    /// nothing streams after the first step's loads.
    pub resident_bytes: u64,
}

impl Plan {
    /// Derives the plan for `budget` bytes of device memory. A budget too small for the model is
    /// [`Error::BudgetTooSmall`], which states the smallest budget that fits (the plan derived
    /// for it trains); other errors say which part does not fit.
    pub fn derive(budget: u64, model: &ModelFacts, machine: Machine, prefetch_window: u32) -> Result<Plan> {
        match Plan::fit(budget, model, machine, prefetch_window) {
            Ok(p) => Ok(p),
            Err(Misfit::Other(e)) => Err(e),
            Err(Misfit::Budget(why)) => {
                let guide = Plan::guide(model, machine, prefetch_window)?;
                Err(Error::BudgetTooSmall {
                    budget_bytes: budget,
                    minimum_bytes: guide.minimum_bytes,
                    why: format!(
                        "{why}; from {} the streaming room holds the prefetch window, from {} nothing streams{}",
                        mib(guide.full_window_bytes),
                        mib(guide.resident_bytes),
                        // Sizes that count what the device held: they move with it.
                        if model.baseline_bytes > 0 {
                            format!(" (each counting the {} the device held already)", mib(model.baseline_bytes))
                        } else {
                            String::new()
                        }
                    ),
                })
            }
        }
    }

    /// The budgets where the plan for `model` changes what it does (see [`BudgetGuide`]).
    /// Fails when no budget up to the device's memory fits the model, or the host cannot hold it.
    pub fn guide(model: &ModelFacts, machine: Machine, prefetch_window: u32) -> Result<BudgetGuide> {
        // The search's upper end: the device's memory, or where a budget stops being a number
        // anyone could mean.
        let top = if machine.device_bytes > 0 { machine.device_bytes } else { 1 << 60 };
        let fits = |b: u64| match Plan::fit(b, model, machine, prefetch_window) {
            Ok(p) => Ok(Some(p)),
            Err(Misfit::Budget(_)) => Ok(None),
            Err(Misfit::Other(e)) => Err(e),
        };
        let Some(at_top) = fits(top)? else {
            return Err(Error::Config {
                field: "model",
                value: format!("{} of managed blocks", mib(model.blocks.iter().map(|b| b.0).sum())),
                expected: format!("a model whose plan fits the device's memory, {}", mib(top)),
            });
        };
        // The smallest budget in `[lo, top]` whose plan satisfies `want` (plans grow with the
        // budget, so the first success is the boundary).
        let smallest = |want: &dyn Fn(&Plan) -> bool| -> Result<u64> {
            let (mut lo, mut hi) = (1u64, top);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                match fits(mid)? {
                    Some(p) if want(&p) => hi = mid,
                    _ => lo = mid + 1,
                }
            }
            Ok(hi)
        };
        let minimum_bytes = smallest(&|_| true)?;
        let resident_bytes = if at_top.streams() { top } else { smallest(&|p| !p.streams())? };
        let window = |p: &Plan| {
            let streamed = (model.blocks.len() - p.resident_blocks.len()) as u64;
            !p.streams() || u64::from(p.slots) >= (u64::from(p.prefetch_window) + 2).min(streamed)
        };
        let full_window_bytes = smallest(&window)?.max(minimum_bytes);
        Ok(BudgetGuide {
            minimum_bytes,
            full_window_bytes,
            resident_bytes: resident_bytes.max(full_window_bytes),
        })
    }

    fn fit(budget: u64, model: &ModelFacts, machine: Machine, prefetch_window: u32) -> std::result::Result<Plan, Misfit> {
        let short = |why: String| Misfit::Budget(why);
        if machine.device_bytes > 0 && budget > machine.device_bytes {
            return Err(Misfit::Other(Error::Config {
                field: "budget",
                value: format!("{budget} bytes ({})", mib(budget)),
                expected: format!("at most the device's memory, {}", mib(machine.device_bytes)),
            }));
        }
        let state = model.optimizer_state_factor;
        let cost = |bytes: u64, trainable: bool| if trainable { bytes.saturating_mul(2 + state) } else { bytes };
        let largest = model.blocks.iter().map(|b| b.0).max().unwrap_or(0);
        let mut p = Plan {
            budget_bytes: budget,
            // 0 is honoured (every block loads at its use, a baseline for what prefetching
            // buys); the room keeps two slots whatever the window.
            prefetch_window,
            ..Plan::default()
        };
        let available = budget
            .checked_sub(model.baseline_bytes)
            .filter(|&a| a > 0)
            .ok_or_else(|| short(format!("the device already holds {}", mib(model.baseline_bytes))))?;
        p.baseline_bytes = model.baseline_bytes;
        p.reserve_bytes = ((available as f64 * RESERVE_FRACTION) as u64).max(MIB.min(available / 4));
        p.unmanaged_bytes = cost(model.unmanaged_trainable_bytes, true).saturating_add(model.unmanaged_frozen_bytes);
        let usable = available
            .checked_sub(p.reserve_bytes)
            .and_then(|b| b.checked_sub(p.unmanaged_bytes))
            .filter(|&u| u > 0)
            .ok_or_else(|| {
                short(format!(
                    "the reserve {} and the unmanaged variables with gradients and optimizer state {} leave nothing",
                    mib(p.reserve_bytes),
                    mib(p.unmanaged_bytes)
                ))
            })?;
        p.reasons.push(format!(
            "budget {} ({} already on the device): reserve {} for the allocator, {} for unmanaged variables, {} usable",
            mib(budget),
            mib(model.baseline_bytes),
            mib(p.reserve_bytes),
            mib(p.unmanaged_bytes),
            mib(usable)
        ));
        let all: u64 = model.blocks.iter().map(|&(b, t)| cost(b, t)).sum();
        // Under mixed precision a trained block trains on the host against its float32 master:
        // it streams, whatever its size.
        // So it does in a data-parallel group, where the host optimizer steps each rank's shard.
        let world = u64::from(model.world_size.max(1));
        let may_stay = |trainable: bool| !(trainable && (model.precision.is_mixed() || world > 1));
        if all <= usable / 2 && model.blocks.iter().all(|b| may_stay(b.1)) {
            p.resident_blocks = (0..model.blocks.len()).collect();
            p.resident_bytes = all;
            p.resident_weight_bytes = model.blocks.iter().map(|b| b.0).sum();
            p.reasons.push(format!(
                "every block stays on the device: {} with gradients and optimizer state is within half of the usable budget",
                mib(all)
            ));
        } else {
            let small = largest / SMALL_BLOCK_FRACTION;
            for (i, &(b, t)) in model.blocks.iter().enumerate() {
                if b <= small && may_stay(t) {
                    p.resident_blocks.push(i);
                    p.resident_bytes += cost(b, t);
                    p.resident_weight_bytes += b;
                }
            }
            let trained: Vec<u64> = model
                .blocks
                .iter()
                .enumerate()
                .filter(|(i, b)| b.1 && !p.resident_blocks.contains(i))
                .map(|(_, b)| b.0)
                .collect();
            // The block backward is leaving and the one it works on hold device gradients: two of
            // the largest trained block (a frozen model's larger blocks have none); in a group,
            // two of their reductions in flight too, each a bucket of the block's gradients and
            // this rank's shard of the sum.
            let largest_trained = trained.iter().copied().max().unwrap_or(0);
            let streamed_trainable = trained.len() as u64;
            p.gradient_bytes = streamed_trainable.min(2) * largest_trained;
            if world > 1 {
                p.gradient_bytes += streamed_trainable.min(2) * (largest_trained + largest_trained.div_ceil(world));
            }
            let left = usable.saturating_sub(p.resident_bytes + p.gradient_bytes);
            let streamed = model.blocks.len() - p.resident_blocks.len();
            let want = (left as f64 * WEIGHT_SHARE) as u64 / largest.max(1);
            let slots = want.max(u64::from(p.prefetch_window) + 2).min(streamed as u64);
            // At least two slots (one in use, one landing), and the room may take at most
            // half of what is left: activations need the rest.
            let max_slots = (left / 2) / largest.max(1);
            let least = 2.min(streamed as u64);
            if max_slots < least {
                return Err(short(format!(
                    "{least} slot(s) of the largest streamed block ({} each) need {} left after the resident blocks ({}) and the gradients in flight ({}), twice the room, and {} is left",
                    mib(largest),
                    mib(2 * least * largest),
                    mib(p.resident_bytes),
                    mib(p.gradient_bytes),
                    mib(left)
                )));
            }
            // The weight runtime is handed the resident blocks' bytes and the room, and cuts
            // the room into slots with the same rule.
            let room = slots.min(max_slots).saturating_mul(largest);
            p.slots = crate::weights::slots::room_slots(p.resident_weight_bytes + room, p.resident_weight_bytes, largest, streamed) as u32;
            p.slot_bytes = largest;
            p.weight_room_bytes = u64::from(p.slots) * largest;
            p.reasons.push(format!(
                "{} of {} blocks stream through {} slots of {} ({}); {} small blocks stay resident ({})",
                streamed,
                model.blocks.len(),
                p.slots,
                mib(largest),
                mib(p.weight_room_bytes),
                p.resident_blocks.len(),
                mib(p.resident_bytes)
            ));
            if p.prefetch_window == 0 {
                p.reasons.push("prefetch window 0: each streamed block loads when it is used (a counted miss)".into());
            }
        }
        // A quantized streamed block's dequantization stashes the end of its payload in a small
        // device buffer while it runs (transient: freed before the block's layers run).
        p.dequant_stash_bytes = if p.streams() { model.stash_bytes } else { 0 };
        let weights = p.resident_bytes + p.weight_room_bytes + p.gradient_bytes + p.dequant_stash_bytes;
        let activations = usable.saturating_sub(weights);
        if activations < MIB.min(usable / 8) {
            return Err(short(format!(
                "activations need at least {} beside {} of weights, and {} is left",
                mib(MIB.min(usable / 8)),
                mib(weights),
                mib(activations)
            )));
        }
        // Activations kept through the forward fill two thirds; a fifth is for spills still
        // landing at the high point of the forward and, in backward, for restores ahead of
        // need; the rest (2/15) is for the temporaries of the ops running at that point beyond
        // the reserve (measured on an H100: GPT layers of d=1024 and d=2048 peak about 0.7 of
        // the activations' room above the kept level). Watermarks compare with all allocated
        // memory, which includes the reserve's users and the unmanaged variables. The handle
        // lowers them after a step that still goes over the budget.
        let kept = activations / 3 * 2;
        p.spill_high_bytes = model.baseline_bytes + p.reserve_bytes / 2 + p.unmanaged_bytes + weights + kept;
        p.spill_low_bytes = p.spill_high_bytes - kept / 4;
        p.spill_floor_bytes = p.spill_high_bytes - kept;
        // What rides above the watermark follows the widest layer's temporaries, not the
        // budget: a small budget next to wide layers (the demo's defaults on CUDA: 12 MiB above
        // the watermark with a 30 MiB room) needs more than the shares above. The first step
        // keeps an eighth and measures it; later steps keep the plan's watermark or less
        // (`Plan::first_spill_watermarks`).
        p.restore_allowance_bytes = activations / 5;
        p.reasons.push(format!(
            "activations spill above {} until under {} (the first step above {}, measuring the temporaries); restores ahead of backward may hold {}",
            mib(p.spill_high_bytes),
            mib(p.spill_low_bytes),
            mib(p.first_spill_watermarks().0),
            mib(p.restore_allowance_bytes)
        ));
        // A batch waits on the device and is held twice while it is gathered: a quarter of the
        // room for spills in flight, and no more than the default (past it, a copy's fixed cost
        // is under 2% of its time).
        // Tensors under a quarter of a batch join one, so that a batch gathers four at least.
        p.spill_batch_bytes = (p.restore_allowance_bytes / 4).min(crate::activations::config::DEFAULT_SPILL_BATCH_BYTES);
        p.spill_batch_below_bytes = p.spill_batch_bytes / 4;
        p.reasons.push(format!(
            "spilled tensors under {} are copied in batches of up to {}",
            mib(p.spill_batch_below_bytes),
            mib(p.spill_batch_bytes)
        ));
        p.max_inflight_h2d = p.prefetch_window.max(2);
        p.max_inflight_restores = 4;
        p.max_inflight_spills = 64;
        p.soft_cap_bytes = budget;
        p.hard_cap_bytes = budget + budget / 10;
        p.h2d_slots = p.max_inflight_h2d + p.max_inflight_restores;
        p.d2h_slots = p.max_inflight_spills + 8;
        // In a group rank 0 holds the one host copy (weights and masters), and each rank its
        // shard of the pinned gradients and of the optimizer state. A quantized block's host copy
        // is its payload.
        let holds_copy = u64::from(model.rank == 0);
        let transfer = |i: usize| model.transfer_bytes.get(i).copied().unwrap_or(model.blocks[i].0);
        let weights_host: u64 = (0..model.blocks.len()).map(transfer).sum::<u64>() * holds_copy;
        let grads_host: u64 = model.blocks.iter().filter(|b| b.1).map(|b| b.0).sum::<u64>().div_ceil(world);
        p.pinned_bytes = weights_host + grads_host;
        // Facts from before the element counts (serde default): each trained byte a float32.
        let trained = if model.trained_elements > 0 { model.trained_elements.div_ceil(world) } else { grads_host / 4 };
        p.optimizer_state_bytes = (trained as f64 * model.state_storage.bytes_per_param(state)).ceil() as u64;
        p.master_bytes = model.master_elements * 4 * holds_copy;
        if world > 1 {
            p.reasons.push(format!(
                "rank {} of a data-parallel group of {world}: trained blocks stream from the one host copy{}; this rank's host optimizer steps its shard of each",
                model.rank,
                if model.rank == 0 { " (this rank's)" } else { " (rank 0's)" }
            ));
        }
        let host_need = p.pinned_bytes + p.optimizer_state_bytes + p.master_bytes;
        // What the host must still find: the registered blocks' memory is taken already. Held
        // bytes count only against the parts registration makes (a pool handed over may hold
        // more than this model's copies and gradients): the state is always still to come.
        let held = machine.host_held_bytes.min(p.pinned_bytes + p.master_bytes);
        let host_to_come = host_need - held;
        let host_left = machine.host_available_bytes.saturating_sub(host_to_come);
        // The activation pool is sized from what a traced step spills at once, which depends on
        // the model's activations, not on the device's room: a model whose activations are many
        // times the room needs that much pinned memory. The limit only keeps the pool within
        // half the host memory left (or, where that cannot be read, 8x the device's room),
        // rounded down to a power of two: the memory a host has free moves a little from run to
        // run, and the plan should not.
        p.host_left_bytes = host_left;
        p.pool_limit_bytes = if machine.host_available_bytes > 0 {
            let half = (host_left / 2).max(1);
            1u64 << (63 - half.leading_zeros())
        } else {
            8 * activations.max(MIB)
        };
        let per_param = host_bytes_per_param(model, state);
        if machine.host_available_bytes > 0 && host_to_come > machine.host_available_bytes {
            return Err(Misfit::Other(Error::Config {
                field: "model",
                value: format!(
                    "{} of host weights and gradients plus {} of optimizer state ({}) plus {} of float32 masters: {} in all, {per_param}; {} of it still to allocate ({} held already)",
                    mib(p.pinned_bytes),
                    mib(p.optimizer_state_bytes),
                    model.state_storage,
                    mib(p.master_bytes),
                    mib(host_need),
                    mib(host_to_come),
                    mib(host_need - host_to_come)
                ),
                expected: format!(
                    "at most the host's available memory, {}{}",
                    mib(machine.host_available_bytes),
                    if model.state_storage == StateStorage::Int8 { "" } else { " (optimizer_state(StateStorage::Int8) stores the state in about a quarter of the bytes)" }
                ),
            }));
        }
        if !model.quantization.is_empty() {
            let q = &model.quantization;
            let full: u64 = q.iter().map(|r| r.full_bytes).sum();
            let small: u64 = q.iter().map(|r| r.quantized_bytes).sum();
            let worst = q.iter().map(|r| r.max_rel_error).fold(0.0, f64::max);
            let mean = q.iter().map(|r| r.mean_rel_error * r.full_bytes as f64).sum::<f64>() / full.max(1) as f64;
            let mut formats: Vec<&str> = q.iter().map(|r| r.format.name()).collect();
            formats.dedup();
            p.reasons.push(format!(
                "{} frozen block(s) quantized to {}: {} on the host and over PCIe instead of {}, dequantized in place in their slots (a stash of {} at most); error at most {:.3}% of a group's largest weight, {:.3}% of the weights' magnitude on average",
                q.len(),
                formats.join(" and "),
                mib(small),
                mib(full),
                mib(model.stash_bytes),
                worst * 100.0,
                mean * 100.0
            ));
            p.quantization = q.clone();
        }
        p.models = model_shares(model, &p);
        for m in &p.models {
            p.reasons.push(format!(
                "model '{}': {} block(s), {} resident ({}), {} streaming through the shared room; {} pinned on the host; about {} moved a step along the combined itinerary",
                m.name,
                m.blocks,
                m.resident_blocks,
                mib(m.resident_bytes),
                m.streamed_blocks,
                mib(m.host_bytes),
                mib(m.predicted_h2d_bytes)
            ));
        }
        p.reasons.push(format!(
            "host: {} pinned for weights and gradients, {} of optimizer state ({}), {} of float32 masters, activation pool at most {}; {per_param}",
            mib(p.pinned_bytes),
            mib(p.optimizer_state_bytes),
            model.state_storage,
            mib(p.master_bytes),
            mib(p.pool_limit_bytes)
        ));
        Ok(p)
    }

    /// Whether anything streams.
    pub fn streams(&self) -> bool {
        self.slots > 0
    }

    /// The device bytes the weight runtime may hold: the resident blocks' weights and the
    /// streaming room (it cuts the room into slots with the rule the plan used).
    pub fn weights_budget_bytes(&self) -> u64 {
        self.resident_weight_bytes + self.weight_room_bytes
    }

    /// The first step's spill watermarks, high then low: an eighth of the activations the plan
    /// keeps above the floor, spilling down to the floor. The first step measures what rides
    /// above the watermark (temporaries, restores, spills landing) before later steps keep more
    /// (`session::adapt`); until then it keeps little, since what rides above follows the widest
    /// layer, not the budget (measured on an H200: 783 MiB above a 2 GiB budget's watermark for
    /// a d=2048 GPT in fp32, which half the plan's share put 137 MiB over the budget).
    pub fn first_spill_watermarks(&self) -> (u64, u64) {
        let kept = self.spill_high_bytes - self.spill_floor_bytes;
        (self.spill_floor_bytes + kept / 8, self.spill_floor_bytes)
    }
}

/// Each model's share of a plan for several models: its resident blocks, its streamed ones, its
/// pinned bytes, and the bytes it is predicted to move a step. The prediction runs Belady's rule
/// over the combined itinerary the handle's step most often has (the frozen models' forwards
/// first, then the trained models' forward and backward) with the plan's slots; the runtime
/// measures the traced itinerary's own minimum (`weight_step.models`).
fn model_shares(model: &ModelFacts, p: &Plan) -> Vec<ModelShare> {
    use crate::events::BlockId;
    use crate::weights::{evictor, Itinerary};
    if model.models.len() < 2 {
        return Vec::new();
    }
    let state = model.optimizer_state_factor;
    let transfer = |i: usize| model.transfer_bytes.get(i).copied().unwrap_or(model.blocks[i].0);
    let streams = |i: &usize| !p.resident_blocks.contains(i);
    let mut forward = Vec::new();
    let mut trained_forward = Vec::new();
    for m in &model.models {
        let ids = m.blocks.iter().copied().filter(streams).map(|i| BlockId(i as u32));
        if m.frozen {
            forward.extend(ids);
        } else {
            trained_forward.extend(ids);
        }
    }
    let backward: Vec<BlockId> = trained_forward.iter().rev().copied().collect();
    forward.extend(trained_forward);
    let updated: Vec<BlockId> = forward.iter().copied().filter(|b| model.blocks[b.0 as usize].1).collect();
    const STEPS: usize = 60;
    let mut moved = vec![0u64; model.blocks.len()];
    if p.slots > 0 {
        for b in evictor::min_loads(&Itinerary::new(forward, backward), p.slots as usize, &updated, STEPS) {
            moved[b.0 as usize] += transfer(b.0 as usize);
        }
    }
    model
        .models
        .iter()
        .map(|m| {
            let resident: Vec<usize> = m.blocks.iter().copied().filter(|i| p.resident_blocks.contains(i)).collect();
            ModelShare {
                name: m.name.clone(),
                blocks: m.blocks.len() as u32,
                resident_blocks: resident.len() as u32,
                resident_bytes: resident
                    .iter()
                    .map(|&i| if model.blocks[i].1 { model.blocks[i].0.saturating_mul(2 + state) } else { model.blocks[i].0 })
                    .sum(),
                streamed_blocks: (m.blocks.len() - resident.len()) as u32,
                host_bytes: m.blocks.iter().map(|&i| transfer(i) + if model.blocks[i].1 { model.blocks[i].0 } else { 0 }).sum(),
                predicted_h2d_bytes: m.blocks.iter().map(|&i| moved[i]).sum::<u64>() / STEPS as u64,
            }
        })
        .collect()
}

/// "16.0 host bytes per trained parameter (float32 master 4, pinned bf16 copy 2, ...)".
fn host_bytes_per_param(model: &ModelFacts, state_tensors: u64) -> String {
    let mixed = model.master_elements > 0;
    let (copy, grad) = if model.precision.is_mixed() { (2.0, 2.0) } else { (4.0, 4.0) };
    let master = if mixed { 4.0 } else { 0.0 };
    let st = model.state_storage.bytes_per_param(state_tensors);
    let dtype = if model.precision.is_mixed() { model.precision.name() } else { "float32" };
    format!(
        "{:.1} host bytes per trained parameter ({}pinned {dtype} copy {copy}, pinned {dtype} gradient {grad}, optimizer state {st:.2} in {})",
        master + copy + grad + st,
        if mixed { "float32 master 4, " } else { "" },
        model.state_storage
    )
}

/// Host memory available now (`MemAvailable`), or 0 when it cannot be read.
pub fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt(layers: usize, block: u64) -> ModelFacts {
        let mut blocks = vec![(block / 50, true), (block / 100, true)];
        blocks.extend((0..layers).map(|_| (block, true)));
        blocks.push((block / 50, true));
        ModelFacts {
            blocks,
            optimizer_state_factor: 2,
            ..ModelFacts::default()
        }
    }

    const GB: u64 = 1 << 30;
    const HOST: Machine = Machine {
        device_bytes: 80 * GB,
        host_available_bytes: 100 * GB,
        host_held_bytes: 0,
    };

    #[test]
    fn a_model_that_fits_stays_resident() {
        let p = Plan::derive(16 * GB, &gpt(4, 50 * MIB), HOST, 2).expect("plan");
        assert!(!p.streams());
        assert_eq!(p.resident_blocks.len(), 7);
        assert!(p.spill_high_bytes > p.spill_low_bytes);
        let (high, low) = p.first_spill_watermarks();
        assert!(p.spill_floor_bytes == low && low < high && high < p.spill_low_bytes, "{p:?}");
    }

    #[test]
    fn a_large_model_streams_through_slots_of_its_largest_block() {
        // 24 blocks of 201 MB (d=2048, f32) under 4 GiB: the demo's 1.2 B parameter model.
        let block = 12 * 2048 * 2048 * 4;
        let p = Plan::derive(4 * GB, &gpt(24, block), HOST, 2).expect("plan");
        assert!(p.streams());
        assert_eq!(p.slot_bytes, block);
        assert!(p.slots >= 4, "{p:?}");
        assert_eq!(p.resident_blocks, [0, 1, 26], "the embeddings and head are small");
        let used = p.reserve_bytes + p.resident_bytes + p.weight_room_bytes + p.gradient_bytes;
        assert!(used < p.spill_high_bytes && p.spill_high_bytes <= p.budget_bytes, "{p:?}");
        assert_eq!(p.hard_cap_bytes, 4 * GB + 4 * GB / 10);
        assert!(!p.reasons.is_empty());
    }

    #[test]
    fn a_rank_of_a_group_streams_its_trained_blocks_and_holds_its_share_of_the_host_state() {
        let model = gpt(4, 50 * MIB);
        let one = Plan::derive(16 * GB, &model, HOST, 2).expect("plan");
        assert!(!one.streams(), "on one device the model stays resident");
        for (rank, world) in [(0u32, 2u32), (1, 2), (3, 4)] {
            let ranked = ModelFacts { rank, world_size: world, ..model.clone() };
            let p = Plan::derive(16 * GB, &ranked, HOST, 2).expect("plan");
            assert!(p.streams() && p.resident_blocks.is_empty(), "rank {rank} of {world}: trained blocks stream: {p:?}");
            // Two blocks' gradients, and two reductions in flight (a bucket and its shard each).
            let largest = 50 * MIB;
            assert_eq!(p.gradient_bytes, 2 * largest + 2 * (largest + largest.div_ceil(u64::from(world))));
            let weights: u64 = model.blocks.iter().map(|b| b.0).sum();
            let grads = weights.div_ceil(u64::from(world));
            let copy = if rank == 0 { weights } else { 0 };
            assert_eq!(p.pinned_bytes, copy + grads, "rank {rank}: the one host copy on rank 0, a shard of the gradients each");
            assert!(p.reasons.iter().any(|r| r.contains(&format!("rank {rank} of a data-parallel group of {world}"))), "{:?}", p.reasons);
        }
    }

    #[test]
    fn impossible_budgets_are_clear_errors() {
        let block = 100 * MIB;
        for budget in [0, 1, 2 * MIB, 300 * MIB] {
            let e = Plan::derive(budget, &gpt(8, block), HOST, 2).expect_err("too small");
            assert!(e.to_string().contains("budget"), "{e}");
        }
        let e = Plan::derive(u64::MAX, &gpt(8, block), HOST, 2).expect_err("more than the device");
        assert!(e.to_string().contains("device's memory"), "{e}");
        let small_host = Machine { device_bytes: 80 * GB, host_available_bytes: 2 * GB, host_held_bytes: 0 };
        let e = Plan::derive(8 * GB, &gpt(24, block), small_host, 2).expect_err("host too small");
        assert!(e.to_string().contains("host's available memory"), "{e}");
    }

    /// A handle plans after its blocks are registered, whose host copies, gradient buffers and
    /// masters are then taken from the available memory already: the fit counts only what is
    /// still to come (a 6.7 B model with fp32 state was refused on a 128 GiB host that held it).
    #[test]
    fn host_memory_already_held_by_the_registered_blocks_is_not_counted_twice() {
        let model = gpt(24, 100 * MIB);
        let p = Plan::derive(8 * GB, &model, HOST, 2).expect("plan");
        let need = p.pinned_bytes + p.optimizer_state_bytes + p.master_bytes;
        let held = p.pinned_bytes + p.master_bytes;
        // Exactly the state still to allocate is available: it fits with the held bytes known...
        let tight = Machine { device_bytes: 80 * GB, host_available_bytes: need - held, host_held_bytes: held };
        Plan::derive(8 * GB, &model, tight, 2).expect("the state fits what is left");
        // ...and is refused without them, or with one byte less available.
        let e = Plan::derive(8 * GB, &model, Machine { host_held_bytes: 0, ..tight }, 2).expect_err("counted twice");
        assert!(e.to_string().contains("host's available memory"), "{e}");
        let short = Machine { host_available_bytes: need - held - 1, ..tight };
        let e = Plan::derive(8 * GB, &model, short, 2).expect_err("one byte short").to_string();
        assert!(e.contains("still to allocate") && e.contains("held already"), "{e}");
        // A pool holding more than this model's copies (handed over from a larger one) does not
        // count against the state, which is still to allocate.
        let big_pool = Machine { host_held_bytes: need * 4, ..short };
        Plan::derive(8 * GB, &model, big_pool, 2).expect_err("the state still does not fit");
    }

    #[test]
    fn a_budget_error_says_what_the_device_held_since_its_sizes_count_it() {
        let held = ModelFacts { baseline_bytes: 3 * MIB, ..mnist() };
        let g = Plan::guide(&held, HOST, 2).expect("guide");
        assert_eq!(g.minimum_bytes - Plan::guide(&mnist(), HOST, 2).expect("guide").minimum_bytes, 3 * MIB, "{g:?}");
        let e = Plan::derive(g.minimum_bytes - 1, &held, HOST, 2).expect_err("one byte short").to_string();
        assert!(e.contains("each counting the 3.0 MiB the device held already"), "{e}");
        let e = Plan::derive(1, &mnist(), HOST, 2).expect_err("too small").to_string();
        assert!(!e.contains("held already"), "nothing held, nothing said: {e}");
    }

    /// The shape of tch's mnist_conv: two small convolutions, a 4 MiB linear, a small head.
    fn mnist() -> ModelFacts {
        ModelFacts {
            blocks: vec![(3_328, true), (204_928, true), (4_198_400, true), (41_000, true)],
            optimizer_state_factor: 2,
            ..ModelFacts::default()
        }
    }

    #[test]
    fn the_guide_states_budgets_the_plan_accepts_and_the_one_below_it_does_not() {
        for (model, window) in [(mnist(), 2), (gpt(8, 800 << 10), 2), (gpt(24, 50 * MIB), 3)] {
            let g = Plan::guide(&model, HOST, window).expect("guide");
            assert!(g.minimum_bytes <= g.full_window_bytes && g.full_window_bytes <= g.resident_bytes, "{g:?}");
            let p = Plan::derive(g.minimum_bytes, &model, HOST, window).expect("the minimum is a plan");
            assert!(p.streams() && p.slots >= 1, "{p:?}");
            match Plan::derive(g.minimum_bytes - 1, &model, HOST, window) {
                Err(Error::BudgetTooSmall { budget_bytes, minimum_bytes, why }) => {
                    assert_eq!((budget_bytes, minimum_bytes), (g.minimum_bytes - 1, g.minimum_bytes));
                    assert!(!why.is_empty());
                }
                other => panic!("one byte less: {other:?}"),
            }
            let p = Plan::derive(g.full_window_bytes, &model, HOST, window).expect("full window");
            let streamed = (model.blocks.len() - p.resident_blocks.len()) as u32;
            assert!(!p.streams() || p.slots >= (window + 2).min(streamed), "{p:?}");
            assert!(!Plan::derive(g.resident_bytes, &model, HOST, window).expect("resident").streams());
            assert!(Plan::derive(g.resident_bytes - 1, &model, HOST, window).expect("streams").streams());
        }
    }

    #[test]
    fn every_budget_from_the_minimum_up_is_a_plan_whose_room_the_runtime_cuts_the_same() {
        let model = mnist();
        let g = Plan::guide(&model, HOST, 2).expect("guide");
        let mut b = g.minimum_bytes;
        while b <= g.resident_bytes + MIB {
            let p = Plan::derive(b, &model, HOST, 2).expect("a plan at every budget from the minimum");
            if p.streams() {
                // The resident blocks are not counted twice: the runtime, handed the plan's
                // weights budget, cuts the plan's slots.
                let resident: u64 = p.resident_blocks.iter().map(|&i| model.blocks[i].0).sum();
                assert_eq!(p.resident_weight_bytes, resident);
                let streamed = model.blocks.len() - p.resident_blocks.len();
                let cut = crate::weights::slots::room_slots(p.weights_budget_bytes(), resident, p.slot_bytes, streamed);
                assert_eq!(cut, u64::from(p.slots), "{p:?}");
            }
            b += 256 << 10;
        }
    }

    #[test]
    fn two_models_share_one_plan_and_a_frozen_model_keeps_no_gradient_room() {
        // A trained model of 8 blocks of 8 MiB and a frozen teacher of 8 blocks of 16 MiB.
        let mut blocks = vec![(8 * MIB, true); 8];
        blocks.extend(vec![(16 * MIB, false); 8]);
        let facts = ModelFacts {
            blocks,
            optimizer_state_factor: 2,
            models: vec![
                ModelFact { name: "main".into(), frozen: false, blocks: (0..8).collect() },
                ModelFact { name: "teacher".into(), frozen: true, blocks: (8..16).collect() },
            ],
            ..ModelFacts::default()
        };
        let p = Plan::derive(512 * MIB, &facts, HOST, 2).expect("plan");
        assert!(p.streams() && p.slots >= 4, "{p:?}");
        assert_eq!(p.slot_bytes, 16 * MIB, "one room, slots of the largest block of either model");
        assert_eq!(p.gradient_bytes, 2 * 8 * MIB, "gradients of the trained model's blocks only");
        let names: Vec<&str> = p.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["main", "teacher"]);
        let (main, teacher) = (&p.models[0], &p.models[1]);
        assert_eq!((main.blocks, teacher.blocks, main.streamed_blocks), (8, 8, 8));
        assert_eq!(teacher.host_bytes, 8 * 16 * MIB, "a frozen block pins its copy alone");
        assert_eq!(main.host_bytes, 8 * 2 * 8 * MIB, "a trained one its copy and its gradient");
        // A trained block comes back every step (its host copy changes); the teacher moves at
        // most its whole self, and less for what the room keeps across the step's end.
        assert!(main.predicted_h2d_bytes >= 8 * 8 * MIB, "{main:?}");
        assert!(teacher.predicted_h2d_bytes <= 8 * 16 * MIB, "{teacher:?}");
        assert!(p.reasons.iter().any(|r| r.contains("model 'teacher'")), "{:?}", p.reasons);
        // The teacher's quantized payloads are what it pins and moves.
        let mut q = facts.clone();
        q.transfer_bytes = (0..16).map(|i| if i < 8 { 8 * MIB } else { 8 * MIB + MIB / 4 }).collect();
        let pq = Plan::derive(512 * MIB, &q, HOST, 2).expect("plan");
        assert_eq!(pq.models[1].host_bytes, 8 * (8 * MIB + MIB / 4));
        assert!(pq.models[1].predicted_h2d_bytes < teacher.predicted_h2d_bytes);
        assert!(pq.pinned_bytes < p.pinned_bytes);
    }

    #[test]
    fn the_activation_pool_may_hold_many_times_the_device_room() {
        // Activations that spill ten times the device's room at once still fit in pinned memory:
        // the pool's limit follows the host, not the budget.
        let p = Plan::derive(16 * MIB, &gpt(8, 800 << 10), HOST, 2).expect("plan");
        let room = p.budget_bytes - p.reserve_bytes - p.resident_bytes - p.weight_room_bytes;
        assert!(p.pool_limit_bytes > 10 * room, "{p:?}");
        assert!(p.pool_limit_bytes <= HOST.host_available_bytes / 2, "{p:?}");
        let unknown = Machine { device_bytes: 80 * GB, host_available_bytes: 0, host_held_bytes: 0 };
        let p = Plan::derive(16 * MIB, &gpt(8, 800 << 10), unknown, 2).expect("plan");
        assert!(p.pool_limit_bytes > 0 && p.pool_limit_bytes <= 8 * 16 * MIB, "{p:?}");
        // The host's free memory moves a little from run to run; the plan does not.
        let limit = |free: u64| {
            let m = Machine { device_bytes: 80 * GB, host_available_bytes: free, host_held_bytes: 0 };
            Plan::derive(16 * MIB, &gpt(8, 800 << 10), m, 2).expect("plan").pool_limit_bytes
        };
        assert_eq!(limit(22 * GB), limit(22 * GB + 300 * MIB));
        assert_eq!(limit(22 * GB), 8 * GB, "half of what is left, down to a power of two");
    }
}
