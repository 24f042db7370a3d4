//! The scheduler: the state of every block and the decisions made for it, behind the weight
//! runtime's lock. Split by concern:
//!
//! - this file: registration, the step lifecycle and block use (forward entries, backward uses);
//! - [`room`]: the device room: loads into slots, prefetch along the itinerary, finalisation,
//!   eviction;
//! - [`train`]: trainable streamed blocks: gradients sent to the host as backward leaves each
//!   block, host optimizer steps gating loads of the blocks they change;
//! - [`values`]: parameters' values outside a step (checkpoints, snapshots, write-back).
//!
//! Cross-stream memory safety: a load copies into a slot the runtime owns, after the event
//! recorded on the compute stream when the slot's previous block was evicted; the compute stream
//! waits on the load's event before the block is used; the host memory a copy reads is owned by
//! its transfer until the copy completed.
//!
//! The file is long because the step lifecycle (registration, step begin and end, a block's entry
//! and exit) stays in one place, where its ordering rules read together; loading, eviction and
//! gradients live in the sibling files.

mod eval;
mod quantize;
mod parallel;
mod room;
mod train;
mod values;

use super::block::{Block, Source};
use super::file::FileSource;
use super::grads::GradSink;
use super::itinerary::Itinerary;
use super::loads::Loads;
use super::registry::BlockSpec;
use super::residency::Residency;
use super::route::{Learned, Route};
use super::slots::Slots;
use super::WeightConfig;
use crate::conductor::{Conductor, KnobValues, Knobs};
use crate::device::{Device, HostPool, IdleSpans};
use std::time::Instant;
use crate::error::{Error, Result};
use crate::events::{
    BlockId, BlockState, Bus, EventKind, ModelMemory, ModelWeightStep, Owner, Phase, WeightStepMetrics,
};
use crate::guards::GuardSlot;
use crate::precision::QuantFormat;
use crate::weights::stepper::Stepper;
use crate::pinned::SlabPool;
use crate::transfer::Copier;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// Where the bytes of a block on the device are, by device address (for the saved-tensor
/// resolver, which must not wait for the scheduler's lock).
#[derive(Debug, Clone)]
pub(crate) struct IndexEntry {
    pub block: BlockId,
    pub len: usize,
    /// (byte offset, bytes, dtype) of each parameter.
    pub params: Vec<(usize, usize, Kind)>,
}

/// Device start address of each block on the device -> its layout.
pub(crate) type PtrIndex = Arc<Mutex<BTreeMap<u64, IndexEntry>>>;

/// Where the scheduler is in the step lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepState {
    /// Between steps.
    Closed,
    /// A step is open; `backward` once a backward use happened in it, `stepped` once the
    /// optimizer queued its host steps. Either ends it at the next forward use in layer mode: a
    /// backward that reads no managed weight (one block whose input needs no gradient, an
    /// embedding) leaves only the optimizer's step to tell one step from the next.
    Open { backward: bool, stepped: bool },
    /// Between steps, forwards outside a step (evaluation, sampling): see `eval`.
    Eval,
    /// Shut down: every call fails; `dropped` when the handle that owned the runtime went.
    ShutDown { dropped: bool },
}

/// Why a block is being loaded: it decides the slot priority, whether the load may wait, and
/// which blocks it may displace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Load {
    /// Needed now: the step stalls until it lands.
    Demand,
    /// The next block on the itinerary: needed for certain, loaded early.
    Next,
    /// Further ahead: worth loading only if nothing more urgent wants the slot.
    Ahead,
}

pub(crate) struct Scheduler {
    device: Device,
    bus: Bus,
    cfg: WeightConfig,
    /// Shared with the Conductor's adapter; read on every use, never cached.
    knobs: Arc<Knobs>,
    /// Grants the transfer slots (disabled: every copy proceeds at no cost).
    conductor: Conductor,
    /// The run's numeric guards: the gradient sinks check with it, the handle arms it.
    guards: GuardSlot,
    blocks: Vec<Block>,
    names: HashMap<String, BlockId>,
    residency: Residency,
    route: Route,
    slots: Option<Slots>,
    /// Streamed blocks on the device, in the order they were loaded.
    loaded: Vec<BlockId>,
    loads: Loads,
    loader: Copier,
    grads: GradSink,
    /// Stages file-backed blocks (made with the first one).
    staging: Option<SlabPool>,
    /// The host optimizer, once one is attached: loads wait for the blocks it changes.
    stepper: Option<Arc<Stepper>>,
    /// An optimizer step is expected at the end of this step, so trained blocks are not loaded
    /// across the step's end (their host copy is about to change).
    update_expected: bool,
    /// Armed for this step: each trained block's host step is queued as soon as backward has
    /// left it (the optimizer step is known to follow this backward).
    eager: Option<crate::weights::stepper::JobMaker>,
    /// Blocks whose host step was queued in this step.
    submitted: std::collections::HashSet<BlockId>,
    index: PtrIndex,
    state: StepState,
    /// A step that failed while its optimizer steps ran: some blocks hold the next step's
    /// values and others not, so nothing trains on from here or reads the values out.
    torn: Option<String>,
    auto_step: bool,
    /// The first block entered in the open step (auto steps of inference loops end on it).
    first_entered: Option<BlockId>,
    step: u64,
    metrics: WeightStepMetrics,
    last_metrics: WeightStepMetrics,
    /// This step's waits for the host optimizer, read as the compute stream's idle time.
    update_waits: IdleSpans,
    /// The hooks' spans on the compute stream, when measured (`set_measure_hook_gpu`).
    hook_spans: Option<IdleSpans>,
    /// The Belady minimum of bytes a step, for the streamed order, room and trained blocks it
    /// was computed for, and each model's share of it.
    min_bytes: Option<(MinKey, u64, Vec<u64>)>,
    /// Inference mode: the blocks the plan pinned along the cyclic itinerary, and the streamed
    /// order and slot count they were chosen for ([`super::evictor::spread_pins`]).
    pins: Option<Pins>,
    /// The evaluation's route while training runs, the training's while evaluating (`eval`).
    other_route: Route,
    /// The evaluation under way: its forwards and when it began.
    evaluation: Option<eval::Evaluation>,
    /// This runtime's id in the process-wide claims on variables (`super::claims`).
    owner: u64,
    /// The room was made with every block resident (a plan where nothing streams): blocks
    /// registered since stay resident too.
    new_blocks_resident: bool,
    /// Handles of managed variables that other parts of the runtime hold (the device
    /// optimizer of resident blocks), beside the block's own.
    noted: HashMap<crate::torch::VariableId, usize>,
    /// Where block host copies and gradient buffers are cut from (shared by every model of a
    /// handle, and handed to the next one).
    pool: HostPool,
    /// The models whose blocks the runtime streams, by `Block::model`: the main model (index 0)
    /// and those a handle declared.
    models: Vec<ModelEntry>,
    /// Each model's share of the step's copies (when there are several).
    model_steps: Vec<ModelWeightStep>,
    /// The next block to load, whose host optimizer step was still running when the forward
    /// reached the block before it: loaded (after waiting for that step) once the block being
    /// entered has queued its kernels, at its `leave` (see `room::prefetch`).
    after_leave: Option<BlockId>,
    /// This runtime's rank of a data-parallel group, if it is one (`parallel`).
    rank: Option<parallel::Rank>,
}

/// A model whose blocks the runtime streams.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelEntry {
    pub name: String,
    pub frozen: bool,
    pub quantize: Option<QuantFormat>,
}

/// The main model's name (blocks of no declared model).
pub(crate) const MAIN_MODEL: &str = "main";

/// Blocks pinned by the plan (protected from eviction) and what they were chosen for.
#[derive(Debug)]
struct Pins {
    order: Vec<BlockId>,
    slots: usize,
    /// Those the plan protected itself (a block the user already kept resident is not lifted
    /// when the plan changes).
    pinned: Vec<BlockId>,
}

/// What the Belady minimum depends on: the streamed blocks' order, the slots, the blocks whose
/// host copy changes every step.
type MinKey = (Vec<BlockId>, usize, Vec<BlockId>);

impl Drop for Scheduler {
    fn drop(&mut self) {
        // The host optimizer's worker writes the blocks' host memory: let a step it is running
        // finish before that memory is freed with the blocks.
        if let Some(s) = &self.stepper {
            let _ = s.wait_all();
        }
        super::claims::release(self.owner);
        // Resident blocks' own buffers go with the runtime (the room's with its slots).
        for b in &self.blocks {
            if matches!(b.placement, Some(super::block::Placement::Own(_))) {
                self.device.account(-(b.spec.bytes as i64));
            }
        }
    }
}

/// Threads the host's gradient adds use: half the cores, the rest left to the training thread
/// and the host optimizer, which overlap them.
fn host_sum_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

impl Scheduler {
    pub(crate) fn new(device: Device, cfg: WeightConfig, bus: Bus, index: PtrIndex) -> Result<Scheduler> {
        cfg.validate()?;
        bus.publish(EventKind::LimitsSet {
            owner: Owner::Weights,
            budget_bytes: cfg.weight_budget(),
            high_watermark_bytes: None,
            low_watermark_bytes: None,
        });
        let knobs = Knobs::new(KnobValues {
            max_inflight_h2d: cfg.max_inflight_h2d,
            max_inflight_d2h: cfg.max_inflight_h2d,
            prefetch_window: cfg.prefetch_window,
            suppress_speculative: false,
        });
        let device_for_pool = device.clone();
        let guards = GuardSlot::default();
        Ok(Scheduler {
            loader: Copier::new(&device, bus.clone(), Owner::Weights)?,
            grads: GradSink::new(Copier::new(&device, bus.clone(), Owner::Weights)?, guards.clone(), cfg.host_gradient_sums.then(host_sum_threads))?,
            guards,
            device,
            bus,
            cfg,
            knobs,
            conductor: Conductor::disabled(),
            blocks: Vec::new(),
            names: HashMap::new(),
            residency: Residency::new(),
            route: Route::default(),
            slots: None,
            loaded: Vec::new(),
            loads: Loads::default(),
            staging: None,
            stepper: None,
            update_expected: false,
            eager: None,
            submitted: std::collections::HashSet::new(),
            index,
            state: StepState::Closed,
            torn: None,
            auto_step: false,
            first_entered: None,
            step: 0,
            metrics: WeightStepMetrics::default(),
            last_metrics: WeightStepMetrics::default(),
            update_waits: IdleSpans::default(),
            hook_spans: None,
            min_bytes: None,
            pins: None,
            other_route: Route::default(),
            evaluation: None,
            owner: super::claims::owner(),
            new_blocks_resident: false,
            noted: HashMap::new(),
            pool: HostPool::new(&device_for_pool),
            models: vec![ModelEntry { name: MAIN_MODEL.into(), frozen: false, quantize: None }],
            model_steps: Vec::new(),
            after_leave: None,
            rank: None,
        })
    }

    fn check_live(&self) -> Result<()> {
        self.check_whole()?;
        match self.state {
            StepState::ShutDown { dropped: false } => Err(Error::Shutdown("weight runtime")),
            StepState::ShutDown { dropped: true } => Err(Error::misuse(
                "using a model whose Stagehand handle was dropped",
                "the handle alive for as long as the model is used (take sh.var_store() before dropping it for a plain tch copy of the weights)",
            )),
            _ => Ok(()),
        }
    }

    /// The error for any use of the model once a failed step left it part stepped.
    fn check_whole(&self) -> Result<()> {
        match &self.torn {
            Some(why) => Err(Error::misuse(
                format!("using the model after {why}"),
                "a new handle loaded from the last checkpoint saved before that step: some of the model's values are the next step's and others are not",
            )),
            None => Ok(()),
        }
    }

    /// The open step failed with `cause`: if it had begun updating the model (a host step
    /// queued, or `or_updating`: the device's optimizer step), the model is part stepped from
    /// now on.
    pub(crate) fn tear_if_updating(&mut self, or_updating: bool, cause: impl FnOnce() -> String) {
        if self.torn.is_none() && (or_updating || self.updates_queued()) {
            let why = format!("step {} failed ({})", self.step + 1, cause());
            self.bus.publish(EventKind::Warning {
                source: Owner::Weights,
                message: format!("{why}: the model is part stepped; it trains no more and its values are not saved"),
            });
            self.torn = Some(why);
        }
    }

    pub(crate) fn is_torn(&self) -> bool {
        self.torn.is_some()
    }

    pub(crate) fn block(&self, id: BlockId) -> Result<&Block> {
        self.blocks.get(id.0 as usize).ok_or_else(|| Error::UnknownBlock(id.to_string()))
    }

    pub(crate) fn knobs(&self) -> Arc<Knobs> {
        self.knobs.clone()
    }

    pub(crate) fn guards(&self) -> GuardSlot {
        self.guards.clone()
    }

    pub(crate) fn set_conductor(&mut self, c: Conductor) -> Conductor {
        std::mem::replace(&mut self.conductor, c)
    }

    /// Sets the weights' room, where it came from, and the prefetch knobs, before the room is
    /// made (a plan decides them once the model's blocks are known).
    pub(crate) fn configure(&mut self, room: u64, origin: String, prefetch_window: u32, max_inflight_h2d: u32) -> Result<()> {
        if self.slots.is_some() {
            return Err(Error::misuse("configuring the weights' room", "configure it before the first step"));
        }
        self.cfg.weight_budget_bytes = Some(room.max(1));
        self.cfg.room_origin = origin;
        self.cfg.prefetch_window = prefetch_window;
        self.cfg.max_inflight_h2d = max_inflight_h2d.max(1);
        self.knobs.set_prefetch_window(prefetch_window);
        self.knobs.set_max_inflight_h2d(max_inflight_h2d.max(1));
        self.bus.publish(EventKind::LimitsSet {
            owner: Owner::Weights,
            budget_bytes: room,
            high_watermark_bytes: None,
            low_watermark_bytes: None,
        });
        Ok(())
    }

    pub(crate) fn set_max_inflight_grad_bytes(&mut self, bytes: Option<u64>) {
        self.cfg.max_inflight_grad_bytes = bytes;
    }

    /// Where later gradients of an accumulation window are added from now on
    /// ([`WeightConfig::host_gradient_sums`]); only while no gradient is on its way.
    pub(crate) fn set_host_gradient_sums(&mut self, on: bool) -> Result<()> {
        if on == self.cfg.host_gradient_sums {
            return Ok(());
        }
        if self.grads.in_flight() > 0 || self.blocks.iter().any(|b| b.grads.iter().any(|g| g.received)) {
            return Err(Error::misuse("choosing where gradients accumulate", "between accumulation windows, before a gradient is sent"));
        }
        let copier = Copier::new(&self.device, self.bus.clone(), Owner::Weights)?;
        self.grads = GradSink::new(copier, self.guards.clone(), on.then(host_sum_threads))?;
        self.cfg.host_gradient_sums = on;
        Ok(())
    }

    pub(crate) fn set_auto_step(&mut self, on: bool) {
        self.auto_step = on;
    }

    pub(crate) fn block_id(&self, name: &str) -> Result<BlockId> {
        self.names.get(name).copied().ok_or_else(|| Error::UnknownBlock(name.to_string()))
    }

    /// A block's name, shared.
    pub(crate) fn block_name(&self, id: BlockId) -> Result<Arc<str>> {
        Ok(self.block(id)?.name.clone())
    }

    pub(crate) fn specs(&self) -> Vec<BlockSpec> {
        self.blocks.iter().map(|b| b.spec.clone()).collect()
    }

    pub(crate) fn residency(&self) -> &Residency {
        &self.residency
    }

    /// Protects `id` from eviction (`on`) or lifts the protection (never for resident blocks).
    pub(crate) fn protect(&mut self, id: BlockId, on: bool) -> Result<()> {
        if !on && self.block(id)?.resident {
            return Ok(());
        }
        // The user's word now decides for this block: a later plan neither keeps nor lifts it.
        if let Some(p) = &mut self.pins {
            p.pinned.retain(|&b| b != id);
        }
        self.residency.set_protected(id, on, &self.bus)
    }

    pub(crate) fn itinerary(&self) -> Option<Itinerary> {
        self.route.itinerary().cloned()
    }

    pub(crate) fn step(&self) -> u64 {
        self.step
    }

    pub(crate) fn metrics(&self) -> WeightStepMetrics {
        self.metrics.clone()
    }

    pub(crate) fn last_metrics(&self) -> WeightStepMetrics {
        self.last_metrics.clone()
    }

    /// Adds a module-backed block of the main model (see [`register_in`](Self::register_in)).
    pub(crate) fn register(&mut self, name: &str, params: Vec<(String, Tensor)>) -> Result<BlockId> {
        self.register_in(name, params, 0)
    }

    /// The pool host copies are cut from.
    pub(crate) fn pool(&self) -> &HostPool {
        &self.pool
    }

    /// Cuts host copies from `pool` from now on (before any block is registered: a pool handed
    /// over from a finished model, or one shared with another runtime).
    pub(crate) fn set_pool(&mut self, pool: HostPool) -> Result<()> {
        if !self.blocks.is_empty() {
            return Err(Error::misuse("giving the weight runtime a host pool", "a pool given before the first block is registered"));
        }
        if !pool.is_on(&self.device) {
            return Err(Error::Config {
                field: "host_pool",
                value: "a pool of another device".into(),
                expected: "a pool made on the runtime's device (pinned memory belongs to its CUDA context)".into(),
            });
        }
        self.pool = pool;
        Ok(())
    }

    /// The index of model `name`, declaring it (frozen or not, quantized or not) if it is new.
    /// Declaring a known model again with other options is an error.
    pub(crate) fn model(&mut self, entry: ModelEntry) -> Result<u32> {
        if let Some(i) = self.models.iter().position(|m| m.name == entry.name) {
            if self.models[i] != entry {
                return Err(Error::misuse(
                    format!("declaring model '{}' again as {entry:?}", entry.name),
                    format!("one declaration a model (it is {:?})", self.models[i]),
                ));
            }
            return Ok(i as u32);
        }
        self.models.push(entry);
        Ok((self.models.len() - 1) as u32)
    }

    /// The models, by index.
    pub(crate) fn models(&self) -> &[ModelEntry] {
        &self.models
    }

    /// Each block's model name, in block order.
    pub(crate) fn block_models(&self) -> Vec<String> {
        self.blocks.iter().map(|b| self.models.get(b.model as usize).map(|m| m.name.clone()).unwrap_or_default()).collect()
    }

    /// Publishes each model and its blocks (a runtime streaming several models).
    pub(crate) fn announce_models(&self) {
        if self.models.len() < 2 {
            return;
        }
        for (i, m) in self.models.iter().enumerate() {
            let blocks: Vec<BlockId> = self.blocks.iter().filter(|b| b.model == i as u32).map(|b| b.spec.id).collect();
            if blocks.is_empty() {
                continue;
            }
            self.bus.publish(EventKind::ModelRegistered { model: m.name.clone(), blocks, frozen: m.frozen, quantized: m.quantize });
        }
    }

    /// Device memory and residency by model.
    pub(crate) fn model_memory(&self) -> Vec<ModelMemory> {
        let mut out: Vec<ModelMemory> =
            self.models.iter().map(|m| ModelMemory { model: m.name.clone(), ..ModelMemory::default() }).collect();
        for b in &self.blocks {
            let Some(m) = out.get_mut(b.model as usize) else { continue };
            m.blocks += 1;
            m.resident += u32::from(b.resident);
            if b.placement.is_some() {
                m.on_device += 1;
                m.device_bytes += b.spec.bytes as u64;
            }
        }
        out.retain(|m| m.blocks > 0);
        out
    }

    /// Adds a module-backed block of model `model` (an index from [`model`](Self::model)):
    /// copies its parameters into host memory (quantized when the model is, and the block is
    /// frozen) and leaves them pointing at placeholders until the block is first needed.
    pub(crate) fn register_in(&mut self, name: &str, params: Vec<(String, Tensor)>, model: u32) -> Result<BlockId> {
        self.check_live()?;
        let entry = self
            .models
            .get(model as usize)
            .cloned()
            .ok_or_else(|| Error::internal(format!("block '{name}' of undeclared model {model}")))?;
        if self.names.contains_key(name) {
            return Err(Error::Config {
                field: "block",
                value: format!("'{name}'"),
                expected: "a name not registered yet".into(),
            });
        }
        let id = BlockId(self.blocks.len() as u32);
        let mut spec = BlockSpec::layout_as(id, name, &params, self.cfg.precision.compute_kind())?;
        if let Some(format) = entry.quantize {
            if spec.trainable() {
                let trained: Vec<&str> = spec.params.iter().filter(|p| p.trainable).map(|p| p.name.as_str()).collect();
                return Err(Error::Config {
                    field: "quantize",
                    value: format!("block '{name}' of model '{}', whose {} train", entry.name, trained.join(", ")),
                    expected: "frozen weights: trained weights are never quantized".into(),
                });
            }
            // A block with nothing worth quantizing (norms, biases) stays at full width.
            spec.quant = super::quant::QuantLayout::new(&spec, format, crate::precision::QUANT_GROUP);
        }
        if let Some(room) = &self.slots {
            // The room exists: a block made now streams through its slots.
            if spec.bytes > room.slot_bytes() {
                return Err(Error::TooLarge {
                    what: format!("block '{name}', registered after the weights' room was made,"),
                    needed: spec.bytes as u64,
                    limit: format!(
                        "a slot of the room holds {} bytes (the largest block registered before it): register it before the first step, when the room is sized",
                        room.slot_bytes()
                    ),
                });
            }
        }
        let room = self.cfg.weight_budget();
        if spec.bytes as u64 > room {
            return Err(Error::TooLarge {
                what: format!("block '{name}'"),
                needed: spec.bytes as u64,
                limit: format!(
                    "the weights' device room is {room} bytes ({}): every block must fit in it, so give the weights at least {} bytes",
                    self.cfg.room_source(),
                    spec.bytes
                ),
            });
        }
        let trainable = spec.trainable();
        let bytes = spec.bytes as u64;
        super::claims::claim(self.owner, name, &params)?;
        let ids: Vec<crate::torch::VariableId> = params.iter().map(|(_, t)| crate::torch::VariableId::of(t)).collect();
        let mut block = match self.make_block(id, spec, params) {
            Ok(b) => b,
            Err(e) => {
                super::claims::unclaim(&ids);
                return Err(e);
            }
        };
        block.model = model;
        let report = block.report();
        self.residency.add(name);
        self.names.insert(name.to_string(), id);
        self.bus.publish(EventKind::BlockRegistered {
            block: id,
            name: name.to_string(),
            bytes,
            exec_order: id.0,
            file_backed: false,
            trainable,
        });
        if let Some(r) = report {
            self.bus.publish(EventKind::Quantized(r));
        }
        self.blocks.push(block);
        if self.new_blocks_resident {
            // The plan keeps every block resident (no room was made): one registered since
            // stays resident too (loaded before the next step's forward).
            self.set_resident(&[id])?;
        }
        Ok(id)
    }

    /// Switches a frozen, unloaded block to stream from a safetensors file (its host copy goes).
    /// How file-backed blocks are checked (the configuration's choice).
    pub(crate) fn file_check(&self) -> super::file::FileCheck {
        self.cfg.file_check
    }

    pub(crate) fn back_with_file(&mut self, id: BlockId, file: FileSource) -> Result<()> {
        self.check_live()?;
        let b = self.block(id)?;
        if b.trainable() {
            return Err(Error::Config {
                field: "file_backed",
                value: format!("'{}'", b.spec.name),
                expected: "a frozen block (trainable weights must live in host memory)".into(),
            });
        }
        if self.residency.state(id)? != BlockState::Unloaded {
            return Err(Error::misuse(
                format!("backing block '{}' with a file", b.spec.name),
                "the block must be unloaded",
            ));
        }
        if b.spec.quant.is_some() {
            return Err(Error::misuse(
                format!("backing quantized block '{}' with a file", b.spec.name),
                "a block at full width (a quantized block streams its payload from host memory)",
            ));
        }
        if self.staging.is_none() {
            self.staging = Some(SlabPool::new(
                &self.device,
                crate::events::PoolKind::Weights,
                &[self.cfg.slab_bytes()],
                &[self.cfg.num_slabs() as u32],
                false,
                self.bus.clone(),
            )?);
        }
        let b = &mut self.blocks[id.0 as usize];
        b.source = Source::File(file);
        self.bus.publish(EventKind::BlockRegistered {
            block: id,
            name: b.spec.name.clone(),
            bytes: b.spec.bytes as u64,
            exec_order: id.0,
            file_backed: true,
            trainable: false,
        });
        Ok(())
    }

    // ---- step lifecycle -------------------------------------------------------------------

    pub(crate) fn begin_step(&mut self) -> Result<()> {
        self.check_live()?;
        self.end_evaluation()?;
        if self.state != StepState::Closed {
            return Err(Error::misuse(
                format!("begin_step (step {})", self.step + 1),
                "end the open step first",
            ));
        }
        self.state = StepState::Open { backward: false, stepped: false };
        self.metrics = WeightStepMetrics::default();
        self.model_steps = if self.models.len() > 1 {
            self.models.iter().map(|m| ModelWeightStep { model: m.name.clone(), ..ModelWeightStep::default() }).collect()
        } else {
            Vec::new()
        };
        self.route.begin();
        self.first_entered = None;
        self.update_expected = self.expects_updates();
        self.submitted.clear();
        self.after_leave = None;
        if self.auto_step {
            self.bus.enter_phase(self.step + 1, Phase::Forward);
        }
        Ok(())
    }

    /// Makes the device room now (else the first load makes it), while the device holds what the
    /// plan counted: allocations that come later (a library's workspace on the first forward)
    /// then cannot take the room's place.
    pub(crate) fn make_room(&mut self) -> Result<()> {
        self.check_live()?;
        if self.blocks.iter().any(|b| !b.resident) {
            self.room()?;
        }
        self.new_blocks_resident = self.slots.is_none();
        Ok(())
    }

    /// Loads every resident block not on the device yet (before a step's forward: loaded at
    /// their first use, they would find their memory held by the activations the forward keeps
    /// before them). On failure, the block that did not fit.
    pub(crate) fn load_residents(&mut self) -> std::result::Result<(), (Option<BlockId>, Error)> {
        for i in 0..self.blocks.len() {
            let id = BlockId(i as u32);
            let unloaded = self.residency.state(id).map_err(|e| (None, e))? == BlockState::Unloaded;
            if self.blocks[i].resident && unloaded {
                self.load(id, Load::Demand, None).and_then(|_| self.finalize(id, true)).map_err(|e| (Some(id), e))?;
            }
        }
        Ok(())
    }

    /// Whether a host optimizer steps trained streamed blocks at the end of this step.
    fn expects_updates(&self) -> bool {
        self.stepper.is_some() && self.blocks.iter().any(|b| !b.grads.is_empty())
    }

    /// Starts a pass of the open step (see [`crate::weights::WeightRuntime::begin_pass`]): the
    /// host copies change at its end only when it is the step's last.
    pub(crate) fn begin_pass(&mut self, last: bool) -> Result<()> {
        self.check_live()?;
        if !matches!(self.state, StepState::Open { .. }) {
            return Err(Error::misuse("begin_pass", "begin a step first"));
        }
        self.update_expected = last && self.expects_updates();
        Ok(())
    }

    /// Closes an open step that failed before it updated anything: nothing to learn from its
    /// partial itinerary (the next step traces its own), no host step to wait for (a step that
    /// queued one cannot be abandoned), its blocks' holds already released as the failure
    /// unwound. Gradients its backward sent home are waited for and dropped: the next gradient
    /// of each parameter starts a new sum. Its number is used, as the handle's is.
    pub(crate) fn abandon_step(&mut self) -> Result<()> {
        self.check_live()?;
        let backward = match self.state {
            StepState::Open { backward, .. } if !self.updates_queued() => backward,
            // It failed before the step opened.
            StepState::Closed => return Ok(()),
            _ => return Err(Error::internal(format!("abandoning step {} once it began updating", self.step + 1))),
        };
        if backward {
            self.zero_grads()?;
        }
        self.reap();
        self.update_expected = false;
        self.eager = None;
        self.step += 1;
        self.state = StepState::Closed;
        Ok(())
    }

    pub(crate) fn end_step(&mut self) -> Result<()> {
        self.check_live()?;
        if matches!(self.state, StepState::Closed | StepState::Eval) {
            return Err(Error::misuse("end_step", "begin a step first"));
        }
        self.reap();
        match self.route.end() {
            Learned::Same => {}
            Learned::First(order) => self.bus.publish(EventKind::ItineraryLearned { order }),
            Learned::Changed(order, d) => self.bus.publish(EventKind::ItineraryChanged {
                order,
                first_difference: d.first_difference as u32,
                added: d.added,
                removed: d.removed,
            }),
        }
        self.plan_pins()?;
        self.preload_next_step()?;
        let mem = self.device.memory();
        let (min, model_min) = self.min_h2d_bytes();
        let mut models = std::mem::take(&mut self.model_steps);
        for (m, &b) in models.iter_mut().zip(&model_min) {
            m.min_h2d_bytes = b;
        }
        // Models without blocks say nothing.
        self.metrics.models = models
            .into_iter()
            .enumerate()
            .filter(|(i, _)| self.blocks.iter().any(|b| b.model as usize == *i))
            .map(|(_, m)| m)
            .collect();
        let wait = self.loads.take_wait_ms(false);
        let hook_gpu_ms = self.hook_spans.as_mut().map_or(0.0, IdleSpans::take_passed_ms);
        let update_host_ms = self.update_waits.host_ms();
        let update_idle = self.update_waits.take_ms()?;
        let (collective_ms, collective_bytes) = self.take_collective_totals();
        let (sum_time, sum_bytes) = self.grads.take_host_work();
        let m = &mut self.metrics;
        m.grad_sum_host_ms = sum_time.as_secs_f64() * 1e3;
        m.hook_gpu_ms = hook_gpu_ms;
        m.grad_sum_host_bytes = sum_bytes;
        let seen = m.prefetch_hits + m.prefetch_misses;
        m.hit_rate = if seen == 0 { 0.0 } else { m.prefetch_hits as f64 / seen as f64 };
        m.vram_used_mib = mem.allocated as f64 / (1u64 << 20) as f64;
        m.vram_reserved_mib = mem.reserved as f64 / (1u64 << 20) as f64;
        m.h2d_wait_ms += wait;
        m.update_wait_ms += update_idle;
        m.host_ms = (m.host_ms - update_host_ms).max(0.0);
        m.min_h2d_bytes = min;
        m.collective_ms = collective_ms;
        m.collective_bytes = collective_bytes;
        if let Some(p) = &self.staging {
            let s = p.stats();
            m.host_pool_free = s.free.iter().sum();
            m.host_pool_in_use = s.in_use();
        }
        self.bus.publish(EventKind::WeightStep(self.metrics.clone()));
        self.last_metrics = self.metrics.clone();
        self.step += 1;
        self.state = StepState::Closed;
        Ok(())
    }

    /// The itinerary's order without the blocks kept resident in their own buffers: what streams
    /// through the room's slots (`None` before an itinerary is learned).
    fn streamed_order(&self) -> Option<Vec<BlockId>> {
        let it = self.route.itinerary()?;
        Some(it.order().iter().copied().filter(|b| !self.blocks[b.0 as usize].resident).collect())
    }

    /// The Belady minimum of bytes a steady-state step of the itinerary just traced needs to
    /// copy in: the long-run average (see [`super::evictor::min_loads`]), computed again only
    /// when the itinerary, the room, the trained blocks or the step's passes change. A step of
    /// micro-batches goes over the itinerary once for each; its trained blocks change (and must
    /// be loaded again) only at its end.
    fn min_h2d_bytes(&mut self) -> (u64, Vec<u64>) {
        let (Some(pass), Some(slots)) = (self.streamed_order(), &self.slots) else {
            return (0, vec![0; self.models.len()]);
        };
        let streamed = pass.repeat(self.route.passes());
        let updated: Vec<BlockId> = if self.stepper.is_some() {
            self.blocks.iter().filter(|b| !b.grads.is_empty() && !b.resident).map(|b| b.spec.id).collect()
        } else {
            Vec::new()
        };
        let key = (streamed, slots.count(), updated);
        if let Some((k, bytes, models)) = &self.min_bytes {
            if *k == key {
                return (*bytes, models.clone());
            }
        }
        // About 60 passes simulated, 4 steps at the least: a step of many micro-batches is a long
        // cycle of its own.
        let steps = (60 / self.route.passes()).max(4);
        let it = Itinerary::new(key.0.clone(), Vec::new());
        // A quantized block moves its payload: the minimum counts the bytes each load copies.
        let mut models = vec![0u64; self.models.len()];
        for b in super::evictor::min_loads(&it, key.1, &key.2, steps) {
            let b = &self.blocks[b.0 as usize];
            if let Some(m) = models.get_mut(b.model as usize) {
                *m += b.spec.transfer_bytes() as u64;
            }
        }
        let bytes = models.iter().sum::<u64>() / steps as u64;
        let models: Vec<u64> = models.iter().map(|m| m / steps as u64).collect();
        self.min_bytes = Some((key, bytes, models.clone()));
        (bytes, models)
    }

    /// Ends an open step (layer mode's last step, which no later forward closes).
    pub(crate) fn finish(&mut self) -> Result<()> {
        if matches!(self.state, StepState::Open { .. }) {
            self.end_step()?;
        }
        self.end_evaluation()
    }

    // ---- block use ------------------------------------------------------------------------

    /// A forward use of `id`: resident (a hit or a counted miss), held until `leave`, with the
    /// blocks ahead prefetched.
    pub(crate) fn enter(&mut self, id: BlockId) -> Result<()> {
        self.timed(|s| s.enter_inner(id))
    }

    /// Runs one of the training thread's calls into the scheduler, adding its host time to the
    /// step's `host_ms` (what the runtime itself costs the thread that queues the kernels).
    fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let t0 = Instant::now();
        let probe = match self.hook_spans {
            Some(_) => Some(self.device.idle_probe()?),
            None => None,
        };
        let r = f(self);
        if let Some(p) = probe {
            let span = p.end(&self.device)?;
            if let Some(s) = &mut self.hook_spans {
                s.push(span);
            }
        }
        self.metrics.host_ms += t0.elapsed().as_secs_f64() * 1e3;
        r
    }

    /// Measures the compute stream's time inside the hooks from now on (`hook_gpu_ms` of each
    /// step's metrics): two events a hook.
    pub(crate) fn set_measure_hook_gpu(&mut self, on: bool) {
        if on != self.hook_spans.is_some() {
            self.hook_spans = on.then(IdleSpans::default);
        }
    }

    fn enter_inner(&mut self, id: BlockId) -> Result<()> {
        self.check_live()?;
        self.block(id)?;
        if self.auto_step {
            match self.state {
                StepState::Closed => self.begin_step()?,
                StepState::Open { backward, stepped } => {
                    let again = self.first_entered == Some(id) && self.route.current() != Some(id);
                    if backward || stepped || (again && self.cfg.inference_mode) {
                        self.end_step()?;
                        self.begin_step()?;
                    }
                }
                StepState::Eval | StepState::ShutDown { .. } => {}
            }
        }
        match self.state {
            // A forward outside a step: an evaluation, along its own itinerary.
            StepState::Closed => self.begin_evaluation()?,
            StepState::Eval => self.next_forward(id),
            _ => {}
        }
        self.first_entered.get_or_insert(id);
        self.route.enter(id, false);
        self.ensure_ready(id)?;
        self.residency.acquire(id, self.step)?;
        self.prefetch()
    }

    /// The end of a forward use of `id`.
    pub(crate) fn leave(&mut self, id: BlockId) -> Result<()> {
        self.timed(|s| {
            s.block(id)?;
            s.residency.release(id)?;
            s.mark_used(id)?;
            s.load_after_leave()
        })
    }

    /// Records the end of a use of `id` on the compute stream (see `Block::last_use`).
    fn mark_used(&mut self, id: BlockId) -> Result<()> {
        if !self.blocks[id.0 as usize].resident {
            self.blocks[id.0 as usize].last_use = Some(self.device.record_compute()?);
        }
        Ok(())
    }

    /// A backward use (a saved weight of `id` being unpacked): resident, the blocks backward
    /// needs next prefetched, and the block backward just left sends its gradients home.
    pub(crate) fn backward_use(&mut self, id: BlockId) -> Result<()> {
        self.timed(|s| s.backward_use_inner(id))
    }

    fn backward_use_inner(&mut self, id: BlockId) -> Result<()> {
        self.check_live()?;
        self.block(id)?;
        if !matches!(self.state, StepState::Open { .. }) {
            return Err(Error::misuse(
                format!("backward reading block '{}' outside a training step", self.blocks[id.0 as usize].spec.name),
                "the forward and its backward inside one step (Stagehand::train_step with the handle)",
            ));
        }
        if let StepState::Open { backward, .. } = &mut self.state {
            if !*backward && self.auto_step {
                self.bus.enter_phase(self.step + 1, Phase::Backward);
            }
            *backward = true;
        }
        if let Some(left) = self.route.enter(id, true) {
            // Backward has queued every kernel that reads `left`.
            self.mark_used(left)?;
            self.flush_grads(left)?;
            self.eager_update(left)?;
        }
        if self.eager.is_some() && self.submitted.contains(&id) {
            // Its host step was queued when backward left it, because the itinerary said
            // backward would not read it again; this step ran another order. Reading it now
            // would read the stepped values.
            return Err(Error::misuse(
                format!("backward reading block '{}' after its optimizer step started", self.blocks[id.0 as usize].spec.name),
                "the order of the traced steps (a step whose backward reads blocks in another order than the step before it cannot overlap the host optimizer with backward: turn it off with Optimizer::set_overlap_backward(false))",
            ));
        }
        self.ensure_ready(id)?;
        self.prefetch()
    }

    /// A view of a resident parameter with the geometry of a saved tensor (backward).
    pub(crate) fn param_view(&self, id: BlockId, param: u32, rel_offset: i64, sizes: &[i64], strides: &[i64]) -> Result<Tensor> {
        let b = self.block(id)?;
        let var = b
            .vars
            .get(param as usize)
            .ok_or_else(|| Error::UnknownBlock(format!("{} parameter {param}", b.spec.name)))?;
        let base = crate::torch::TensorIdentity::of(var).storage_offset;
        Ok(var.f_as_strided(sizes, strides, Some(base + rel_offset))?)
    }

    /// Copies not yet seen complete: (loads landing, landed loads not yet reported plus
    /// gradient copies).
    pub(crate) fn copies_in_flight(&self) -> (usize, usize) {
        let (landing, retired) = self.loads.in_flight();
        let reducing = self.rank.as_ref().map_or(0, |r| r.reduce.in_flight());
        (landing, retired + self.grads.in_flight() + reducing)
    }

    /// Device bytes held by streamed blocks (the room, once made) and resident blocks.
    pub(crate) fn resident_bytes(&self) -> usize {
        let own: usize = self
            .blocks
            .iter()
            .filter(|b| b.resident && b.placement.is_some())
            .map(|b| b.spec.bytes)
            .sum();
        own + self.loaded.iter().map(|b| self.blocks[b.0 as usize].spec.bytes).sum::<usize>()
    }

    /// Device bytes the weights hold: the room (allocated once, whole) and resident blocks.
    pub(crate) fn device_bytes(&self) -> u64 {
        let own: usize = self
            .blocks
            .iter()
            .filter(|b| b.resident && b.placement.is_some())
            .map(|b| b.spec.bytes)
            .sum();
        own as u64 + self.slots.as_ref().map_or(0, |s| (s.slot_bytes() * s.count()) as u64)
    }

    /// Bytes of copies in flight that hold device memory: loads landing and gradient copies.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.loads.landing_bytes() + self.grads.in_flight_bytes() + self.rank.as_ref().map_or(0, |r| r.reduce.in_flight_bytes())
    }

    /// The canonical value of a parameter (a fresh CPU tensor), after any pending optimizer
    /// step of its block.
    pub(crate) fn host_param(&self, id: BlockId, i: usize) -> Result<Tensor> {
        self.wait_host_copy(id)?;
        self.block(id)?.host_param(i)
    }

    /// The owner is gone: an evaluation under way ends, host steps finish, later calls fail.
    /// Nothing else is published (the run is over); the device memory goes with the runtime,
    /// when the last layer holding it does.
    pub(crate) fn close(&mut self) -> Result<()> {
        if matches!(self.state, StepState::ShutDown { .. }) {
            return Ok(());
        }
        let result = self.end_evaluation().and_then(|_| self.wait_all_updates());
        self.state = StepState::ShutDown { dropped: true };
        result
    }

    /// Waits for the host optimizer, ends an evaluation or open step, evicts every block.
    fn evict_all(&mut self) -> Result<()> {
        self.end_evaluation()?;
        self.wait_all_updates()?;
        for i in 0..self.blocks.len() {
            let id = BlockId(i as u32);
            if self.residency.state(id)? == BlockState::Prefetching {
                self.finalize(id, false)?;
            }
            self.residency.set_protected(id, false, &self.bus)?;
            self.blocks[i].resident = false;
            if self.residency.state(id)? == BlockState::GpuReady {
                self.evict(id, crate::events::EvictionReason::Shutdown, 0.0)?;
            }
        }
        self.wait_all_grads()?;
        self.loads.drain(&self.loader)
    }

    /// Evicts everything, leaves the parameters as CPU copies of their values, shuts the pool.
    /// With `keep_pool`, the blocks' host copies and gradient buffers go back to the host pool
    /// (which outlives the runtime, for the next model) instead of staying readable.
    pub(crate) fn shutdown(&mut self, keep_pool: bool) -> Result<()> {
        if matches!(self.state, StepState::ShutDown { .. }) {
            return Ok(());
        }
        self.evict_all()?;
        for i in 0..self.blocks.len() {
            for j in 0..self.blocks[i].vars.len() {
                let t = self.blocks[i].host_param(j)?;
                self.blocks[i].vars[j].set_data(&t);
            }
        }
        if keep_pool {
            // Copies and host adds still in flight end before their buffers go (a failed one
            // was its step's error).
            let _ = self.wait_all_grads();
            self.grads.release_spares();
            for b in &mut self.blocks {
                b.source = Source::Released;
                b.grads.clear();
            }
        }
        if let Some(p) = &self.staging {
            p.shutdown();
        }
        self.state = StepState::ShutDown { dropped: false };
        Ok(())
    }
}
