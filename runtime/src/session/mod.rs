//! The one handle a training loop needs: [`Stagehand`].
//!
//! Build it with one device budget, build the model on its [`root`](Stagehand::root) with
//! Stagehand's drop-in layers (or `tch::nn` ones for what should stay on the device), make the
//! optimizer with [`optimizer`](Stagehand::optimizer), and run each step through
//! [`train_step`](Stagehand::train_step):
//!
//! ```no_run
//! use stagehand::nn as snn;
//! use stagehand::Stagehand;
//! use tch::nn::Module;
//!
//! # fn main() -> stagehand::Result<()> {
//! let sh = Stagehand::builder().budget_mib(4096).build()?;
//! let root = sh.root();
//! let model = tch::nn::seq()
//!     .add(snn::linear(&root / "blocks" / 0 / "fc", 512, 512, Default::default()))
//!     .add(snn::linear(&root / "blocks" / 1 / "fc", 512, 512, Default::default()));
//! let mut opt = sh.optimizer(tch::nn::AdamW::default(), 1e-3)?;
//! for _ in 0..10 {
//!     let x = tch::Tensor::randn([8, 512], (tch::Kind::Float, sh.device().tch_device()));
//!     let report = sh.train_step(&mut opt, || model.forward(&x).square().mean(tch::Kind::Float))?;
//!     println!("loss {:.4} in {:.1} ms", report.loss, report.step_ms);
//! }
//! # Ok(()) }
//! ```
//!
//! When the model first runs, its layers are grouped into blocks (every layer under `blocks.N`
//! is block `blocks.N`), and the memory plan is derived from the budget and the model
//! ([`plan`]): which blocks stream through how much device room, where activations spill, what
//! the Conductor allows. A budget too small is [`Error::BudgetTooSmall`], stating the smallest
//! one; [`Stagehand::budget_guide`] says what larger ones buy. A forward outside
//! [`train_step`](Stagehand::train_step) (evaluation, sampling) evaluates: the model runs with
//! its weights streamed along the evaluation's own order, in the `eval` phase, never counted as
//! a step. Each step's phases are tagged for the Conductor and the telemetry, the
//! saved-tensor hooks are on during the forward, the block being run is the activation region,
//! and at the end of the step its time breakdown and VRAM by owner are published.

mod checkpoint;
mod forensics;
mod knobs;
mod models;
mod numerics;
pub mod plan;
mod planner;
mod adapt;
mod step;
mod telemetry;

pub use crate::oom::OomReport;
pub use models::ModelOptions;
pub use plan::{BudgetGuide, Machine, ModelFact, ModelFacts, ModelShare, Plan};
pub use step::StepReport;

use crate::activations::{ActivationConfig, ActivationRuntime};
use crate::conductor::{Conductor, ConductorConfig};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::{Bus, EventKind, Hub, Owner};
use crate::nn::{Grouping, LayerOptions, ManagedVarStore, Path};
use crate::optim::{Algorithm, Kernel, Optimizer};
use crate::precision::{Precision, StateStorage};
use crate::weights::WeightRuntime;
use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

/// Something attached to the run's event hub for as long as the handle lives (the HTTP server,
/// an OTLP exporter), made by a closure given to [`StagehandBuilder::attach`].
pub type Attachment = Box<dyn Any + Send>;

type Attach = Box<dyn FnOnce(&Arc<Hub>) -> Result<Attachment> + Send>;

/// Builds a [`Stagehand`].
pub struct StagehandBuilder {
    budget: Option<u64>,
    device: Option<Device>,
    /// The devices of a data-parallel group ([`build_group`](Self::build_group)).
    devices: Vec<Device>,
    /// How long a rank of a group waits for the others before it declares one failed.
    collective_timeout: std::time::Duration,
    bus: Option<Bus>,
    prefetch_window: u32,
    grouping: Grouping,
    conductor: bool,
    spill: bool,
    kernel: Option<Kernel>,
    optimizer_threads: Option<usize>,
    recompute_fraction: f64,
    recompute_early_stop: bool,
    host_gradient_sums: bool,
    measure_hook_gpu_time: bool,
    spill_batches: Option<(u64, u64)>,
    attachments: Vec<Attach>,
    telemetry: Option<crate::events::TelemetryConfig>,
    guards: bool,
    checksums: bool,
    precision: Precision,
    optimizer_state: StateStorage,
    host_pool: Option<crate::device::HostPool>,
    knobs: knobs::Knobs,
}

impl std::fmt::Debug for StagehandBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagehandBuilder")
            .field("budget", &self.budget)
            .field("prefetch_window", &self.prefetch_window)
            .field("conductor", &self.conductor)
            .field("spill", &self.spill)
            .field("telemetry", &self.telemetry)
            .field("guards", &self.guards)
            .field("checksums", &self.checksums)
            .field("precision", &self.precision)
            .field("optimizer_state", &self.optimizer_state)
            .field("knobs", &self.knobs)
            .finish_non_exhaustive()
    }
}

impl StagehandBuilder {
    /// What the run computes and updates in (default fp32; see [`crate::precision`]). Under
    /// bf16 and fp16, streamed weights and their gradients cross PCIe and live on the device in
    /// 16 bits, the host optimizer updates float32 masters, and the forward runs under autocast
    /// (losses, softmaxes and norms in float32); fp16 adds dynamic loss scaling. tf32 keeps
    /// float32 storage with TF32 matmuls on CUDA.
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }

    /// Cuts the model's host copies from `pool` (pinned memory handed over by a finished
    /// handle's [`Stagehand::shutdown_keep_pool`]) instead of pinning new memory: the pool's
    /// free ranges serve the blocks, and only what they lack is pinned. The pool must be on the
    /// handle's device.
    pub fn host_pool(mut self, pool: crate::device::HostPool) -> Self {
        self.host_pool = Some(pool);
        self
    }

    /// How the host optimizer stores its state (default fp32; bf16 halves it, int8 quarters it:
    /// see [`StateStorage`]). Compressed state needs Adam or AdamW.
    pub fn optimizer_state(mut self, s: StateStorage) -> Self {
        self.optimizer_state = s;
        self
    }

    /// The device memory the run may use, in bytes (required).
    pub fn budget_bytes(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// The device memory the run may use, in MiB.
    pub fn budget_mib(self, mib: u64) -> Self {
        self.budget_bytes(mib.saturating_mul(1 << 20))
    }

    /// The device (default: CUDA device 0 when present, else the host device with the budget as
    /// its simulated memory).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// The devices of a data-parallel group, one rank each (see [`crate::parallel`]); build it
    /// with [`build_group`](Self::build_group). The budget is each device's.
    /// [`Devices`](crate::parallel::Devices) makes the usual lists.
    pub fn devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = devices;
        self
    }

    /// How long a rank of a group waits for the others at one collective or rendezvous before
    /// it declares the missing rank failed and stops the group (default
    /// [`DEFAULT_COLLECTIVE_TIMEOUT`](crate::parallel::DEFAULT_COLLECTIVE_TIMEOUT)).
    pub fn collective_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.collective_timeout = timeout;
        self
    }

    /// The event bus (default: a new one, whose hub [`Stagehand::hub`] returns).
    pub fn bus(mut self, bus: Bus) -> Self {
        self.bus = Some(bus);
        self
    }

    /// Blocks prefetched ahead (default 2); with [`Grouping::Parts`], as many blocks' parts. 0
    /// prefetches nothing: each block loads when it is used, a counted miss.
    pub fn prefetch_window(mut self, k: u32) -> Self {
        self.prefetch_window = k;
        self
    }

    /// How layers become blocks (default: the model's repeated structure).
    pub fn grouping(mut self, g: Grouping) -> Self {
        self.grouping = g;
        self
    }

    /// Run the Conductor (default on).
    pub fn conductor(mut self, on: bool) -> Self {
        self.conductor = on;
        self
    }

    /// Spill activations above the plan's watermark (default on).
    pub fn spill_activations(mut self, on: bool) -> Self {
        self.spill = on;
        self
    }

    /// The host optimizer's kernel (default: fused Adam(W) on CUDA, exact otherwise).
    pub fn kernel(mut self, k: Kernel) -> Self {
        self.kernel = Some(k);
        self
    }

    /// Threads the host optimizer's steps use (default: every core). The steps run while the
    /// training thread launches the GPU's work; a core left to it keeps a busy host from
    /// delaying those launches.
    pub fn host_optimizer_threads(mut self, n: usize) -> Self {
        self.optimizer_threads = Some(n.max(1));
        self
    }

    /// The fraction of the model's recompute scopes (`activations::recompute`) that recompute
    /// in backward, spread evenly over the step (default 1: all). The others run as plain code
    /// and what they save is spilled or kept: less GPU work for more PCIe traffic and pinned
    /// memory, which pays where the copies have room to spare beside the step.
    pub fn recompute_fraction(mut self, fraction: f64) -> Self {
        self.recompute_fraction = fraction;
        self
    }

    /// Whether a recomputation in backward stops at the function's last saved tensor when
    /// nothing saved the scope's output (default: on). What a checkpointed block computes after
    /// its last save (its last matmul, the residual) is not needed in backward. Off runs every
    /// function to its end, for one whose later work must happen in backward too.
    pub fn recompute_early_stop(mut self, on: bool) -> Self {
        self.recompute_early_stop = on;
        self
    }

    /// Where the later micro-batches' gradients are added to the sum so far (default: on the
    /// device). On, each crosses the link once and a worker thread adds it on the host beside
    /// the training thread; off, the sum comes back to the device to take it in there, one more
    /// copy each way per gradient. On trades link bytes for host memory bandwidth and cores: for
    /// a host with both to spare behind a narrow link. On an H100's 16-core host it was slower
    /// (two models over four micro-batches 1261 against 820 ms a step, the 6.5 B row 7895
    /// against 6963 ms): the adds ran at 8-9 GB/s of gradients there and held the training
    /// thread back ([`WeightConfig::host_gradient_sums`](crate::weights::WeightConfig::host_gradient_sums)).
    /// A data-parallel rank adds its shards on the device either way.
    pub fn host_gradient_sums(mut self, on: bool) -> Self {
        self.host_gradient_sums = on;
        self
    }

    /// Measures the compute stream's time inside the weights' hooks (each step's
    /// `hook_gpu_ms`: the GPU idling while the training thread is in them, plus the waits and
    /// kernels they queue), to tell whether the hooks hold the GPU up. Two CUDA events a hook;
    /// off by default.
    pub fn measure_hook_gpu_time(mut self, on: bool) -> Self {
        self.measure_hook_gpu_time = on;
        self
    }

    /// Spilled tensors under `below_bytes` are copied in batches of up to `max_bytes`, one per
    /// block ([`ActivationConfig::batch_spills_below_bytes`](crate::activations::ActivationConfig::batch_spills_below_bytes));
    /// `(0, 0)` copies every tensor on its own. By default the plan sizes batches from the room
    /// for spills in flight (a quarter of it, at most 16 MiB, tensors under a quarter of that).
    pub fn spill_batches(mut self, below_bytes: u64, max_bytes: u64) -> Self {
        self.spill_batches = Some((below_bytes, max_bytes));
        self
    }

    /// Attaches something to the run's event hub when the handle is built (the HTTP server and
    /// dashboards, an OTLP exporter); it lives as long as the handle.
    pub fn attach(mut self, f: impl FnOnce(&Arc<Hub>) -> Result<Attachment> + Send + 'static) -> Self {
        self.attachments.push(Box::new(f));
        self
    }

    /// Makes the handle: the device, the bus and its attachments, the managed VarStore.
    pub fn build(mut self) -> Result<Stagehand> {
        if self.devices.len() > 1 {
            return Err(Error::misuse(
                format!("build() with {} devices", self.devices.len()),
                "build_group() for a data-parallel group (or one device)",
            ));
        }
        if let Some(d) = self.devices.pop() {
            self.device = Some(d);
        }
        self.build_inner(None)
    }

    /// A data-parallel group over [`devices`](Self::devices) (see [`crate::parallel`]): the bus,
    /// the telemetry and the attachments are the group's, each rank gets its own handle on its
    /// device's lane when the group runs.
    pub fn build_group(mut self) -> Result<crate::parallel::Group> {
        let budget = self.checked_budget()?;
        if self.host_pool.is_some() {
            // Each rank pins its own buffers: a pool handed over belongs to one device.
            return Err(Error::misuse("host_pool(..) on a data-parallel group", "a pool handed to a one-device handle (build())"));
        }
        let devices = match std::mem::take(&mut self.devices) {
            d if !d.is_empty() => d,
            _ => vec![self.device.take().unwrap_or_else(|| Device::auto(budget))],
        };
        let bus = self.bus.take().unwrap_or_default();
        let telemetry = self.telemetry.take().map(|c| crate::events::telemetry::attach(&bus, c)).transpose()?;
        let mut attached = Vec::new();
        if let Some(hub) = bus.hub().cloned() {
            for a in std::mem::take(&mut self.attachments) {
                attached.push(a(&hub)?);
            }
        }
        let (timeout, tf32) = (self.collective_timeout, self.precision == Precision::Tf32);
        crate::parallel::Group::new(self, devices, bus, telemetry, attached, timeout, tf32)
    }

    /// The settings of this builder for one rank of a group (no bus, telemetry, attachments or
    /// devices: the group's).
    pub(crate) fn replica(&self) -> StagehandBuilder {
        StagehandBuilder {
            budget: self.budget,
            device: None,
            devices: Vec::new(),
            collective_timeout: self.collective_timeout,
            bus: None,
            prefetch_window: self.prefetch_window,
            grouping: self.grouping.clone(),
            conductor: self.conductor,
            spill: self.spill,
            kernel: self.kernel,
            optimizer_threads: self.optimizer_threads,
            recompute_fraction: self.recompute_fraction,
            recompute_early_stop: self.recompute_early_stop,
            host_gradient_sums: self.host_gradient_sums,
            measure_hook_gpu_time: self.measure_hook_gpu_time,
            spill_batches: self.spill_batches,
            attachments: Vec::new(),
            telemetry: None,
            guards: self.guards,
            checksums: self.checksums,
            precision: self.precision,
            optimizer_state: self.optimizer_state,
            knobs: self.knobs,
            host_pool: None,
        }
    }

    /// The handle of one rank of a group, on `device`, publishing on `bus` (its lane), its
    /// weight runtime joined to the group before anything is registered.
    pub(crate) fn build_rank(
        mut self,
        device: Device,
        bus: Bus,
        member: crate::collective::Membership,
        model: Arc<crate::weights::shared::SharedModel>,
    ) -> Result<Stagehand> {
        self.device = Some(device);
        self.bus = Some(bus);
        // Each rank's host optimizer steps its shard on its own threads: a share of the cores,
        // not every core each (N workers of every core each would contend for them).
        if self.optimizer_threads.is_none() && member.world > 1 {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            self.optimizer_threads = Some((cores / member.world).max(1));
        }
        self.build_inner(Some((member, model)))
    }

    fn checked_budget(&self) -> Result<u64> {
        let budget = self.budget.ok_or_else(|| Error::Config {
            field: "budget",
            value: "unset".into(),
            expected: "a device budget (budget_bytes or budget_mib)".into(),
        })?;
        if budget == 0 {
            return Err(Error::Config {
                field: "budget",
                value: "0 bytes".into(),
                expected: "a device budget above 0".into(),
            });
        }
        Ok(budget)
    }

    fn build_inner(self, group: Option<(crate::collective::Membership, Arc<crate::weights::shared::SharedModel>)>) -> Result<Stagehand> {
        let budget = self.checked_budget()?;
        // Checked now, not when the plan makes the activation runtime's config.
        crate::activations::config::check_fraction("recompute_fraction", self.recompute_fraction)?;
        if let Some((below, max)) = self.spill_batches {
            crate::activations::config::check_batches(below, max)?;
        }
        self.knobs.check()?;
        let device = match self.device {
            Some(d) => d,
            None => Device::auto(budget),
        };
        // The host device keeps its "VRAM" in host memory: a budget the host cannot hold would
        // only fail later, deep in an allocation.
        let host = plan::host_available_bytes();
        if !device.is_cuda() && host > 0 && budget > host {
            return Err(Error::Config {
                field: "budget",
                value: format!("{budget} bytes ({} MiB)", budget >> 20),
                expected: format!(
                    "at most the host's available memory, {} MiB: the host device (no CUDA here) simulates VRAM in host memory",
                    host >> 20
                ),
            });
        }
        let bus = self.bus.unwrap_or_default();
        // A group's ranks share the process-wide switch: the group sets it once.
        let tf32 = (self.precision == Precision::Tf32 && device.is_cuda() && group.is_none()).then(|| crate::torch::amp::set_tf32(true));
        // First, so the file and the flight recorder see the run from its first event.
        let telemetry = self.telemetry.map(|c| crate::events::telemetry::attach(&bus, c)).transpose()?;
        let mut attached = Vec::new();
        if let Some(hub) = bus.hub().cloned() {
            for a in self.attachments {
                attached.push(a(&hub)?);
            }
        }
        bus.publish(EventKind::LimitsSet {
            owner: Owner::Device,
            budget_bytes: budget,
            high_watermark_bytes: None,
            low_watermark_bytes: None,
        });
        // The window counts streaming units: parts of a block look as far ahead in bytes.
        let prefetch_window = self.prefetch_window.saturating_mul(self.grouping.parts());
        let store = ManagedVarStore::new(
            tch::nn::VarStore::new(tch::Device::Cpu),
            LayerOptions {
                // The plan sizes the room once the model is known (and says what budget a
                // block too large for it needs); until then nothing is refused.
                weight_room: Some(u64::MAX / 4),
                prefetch_k: prefetch_window,
                telemetry: bus.clone(),
                device: Some(device.clone()),
                install_hooks: false,
                grouping: self.grouping,
                auto_step: false,
                // The plan measures the device before it places them.
                place_unmanaged: false,
                precision: self.precision,
                ..LayerOptions::default()
            },
        )?;
        // Armed before the first step: the weights runtime's layers and gradient sinks check.
        let guards = self.guards.then(|| store.runtime().guards().arm(&bus));
        if let Some(pool) = self.host_pool {
            store.runtime().set_host_pool(pool)?;
        }
        store.runtime().set_host_gradient_sums(self.host_gradient_sums)?;
        store.runtime().set_measure_hook_gpu_time(self.measure_hook_gpu_time);
        let member = match group {
            Some((member, model)) => {
                store.runtime().join_group(member.clone(), model)?;
                Some(member)
            }
            None => None,
        };
        let (rank, world_size) = member.as_ref().map_or((0, 1), |m| (m.rank as u32, m.world as u32));
        let planner = planner::Planner::new(
            planner::Place { device: device.clone(), rank, world_size },
            budget,
            prefetch_window,
            (self.precision, self.optimizer_state),
            self.knobs,
            store.table(),
            store.vars(),
        );
        Ok(Stagehand {
            planner,
            device,
            bus,
            store,
            budget,
            conductor_on: self.conductor,
            spill: self.spill,
            kernel: self.kernel,
            optimizer_threads: self.optimizer_threads,
            recompute_fraction: self.recompute_fraction,
            recompute_early_stop: self.recompute_early_stop,
            spill_batches: self.spill_batches,
            state: Mutex::new(step::Run::default()),
            telemetry,
            guards,
            checksums: self.checksums,
            precision: self.precision,
            optimizer_state: self.optimizer_state,
            tf32_before: tf32,
            member,
            knobs: self.knobs,
            _attached: attached,
        })
    }
}

/// The handle: a device budget, a model built on its managed VarStore, and the runtimes that
/// stream its weights and spill its activations under one memory plan.
pub struct Stagehand {
    planner: Arc<planner::Planner>,
    device: Device,
    bus: Bus,
    store: ManagedVarStore,
    budget: u64,
    conductor_on: bool,
    spill: bool,
    kernel: Option<Kernel>,
    optimizer_threads: Option<usize>,
    recompute_fraction: f64,
    recompute_early_stop: bool,
    spill_batches: Option<(u64, u64)>,
    state: Mutex<step::Run>,
    telemetry: Option<crate::events::Telemetry>,
    guards: Option<Arc<crate::guards::Guards>>,
    checksums: bool,
    precision: Precision,
    optimizer_state: StateStorage,
    /// Whether TF32 was on before this handle turned it on (put back when it drops).
    tf32_before: Option<bool>,
    /// This handle's place in its data-parallel group (`None`: the run's only device).
    member: Option<crate::collective::Membership>,
    knobs: knobs::Knobs,
    // Dropped last: the server keeps serving the run until the handle goes.
    _attached: Vec<Attachment>,
}

impl Drop for Stagehand {
    fn drop(&mut self) {
        if let Some(was) = self.tf32_before {
            crate::torch::amp::set_tf32(was);
        }
        // The model's layers may outlive the handle: a layer used later says the handle is gone
        // instead of running without its plan.
        if let Err(e) = self.weights().close() {
            self.bus.publish(EventKind::Warning { source: Owner::Weights, message: format!("closing the weight runtime: {e}") });
        }
    }
}

impl std::fmt::Debug for Stagehand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stagehand")
            .field("device", &self.device.info().name)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Stagehand {
    /// A builder.
    pub fn builder() -> StagehandBuilder {
        StagehandBuilder {
            budget: None,
            device: None,
            devices: Vec::new(),
            collective_timeout: crate::parallel::DEFAULT_COLLECTIVE_TIMEOUT,
            bus: None,
            prefetch_window: plan::DEFAULT_PREFETCH_WINDOW,
            grouping: Grouping::Repeated,
            conductor: true,
            spill: true,
            kernel: None,
            optimizer_threads: None,
            recompute_fraction: 1.0,
            recompute_early_stop: true,
            host_gradient_sums: false,
            measure_hook_gpu_time: false,
            spill_batches: None,
            attachments: Vec::new(),
            telemetry: None,
            guards: false,
            checksums: crate::activations::config::DEFAULT_DEBUG_CHECKSUMS,
            precision: Precision::Fp32,
            optimizer_state: StateStorage::Fp32,
            host_pool: None,
            knobs: knobs::Knobs::default(),
        }
    }

    /// The run's precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// This handle's rank in its data-parallel group (0 for a handle on one device).
    pub fn rank(&self) -> usize {
        self.member.as_ref().map_or(0, |m| m.rank)
    }

    /// The ranks of its group (1 for a handle on one device).
    pub fn world_size(&self) -> usize {
        self.member.as_ref().map_or(1, |m| m.world)
    }

    /// This rank's slice of a global batch: the rows `rank * n .. (rank + 1) * n` of `batch`
    /// (`n` its first dimension over the world size), on this rank's device. The first dimension
    /// must divide evenly: every rank trains on as many rows, so the group's update equals one
    /// device's over the whole batch. On one device, the batch itself on the device.
    pub fn shard(&self, batch: &tch::Tensor) -> Result<tch::Tensor> {
        let (rank, world) = (self.rank() as i64, self.world_size() as i64);
        let rows = batch.size().first().copied().ok_or_else(|| Error::Config {
            field: "batch",
            value: "a scalar".into(),
            expected: "a tensor whose first dimension is the batch".into(),
        })?;
        if rows % world != 0 {
            return Err(Error::Config {
                field: "batch",
                value: format!("{rows} rows"),
                expected: format!("a multiple of the group's {world} ranks (each trains on as many rows)"),
            });
        }
        let n = rows / world;
        Ok(batch.f_narrow(0, rank * n, n)?.f_to_device(self.device.tch_device())?)
    }

    /// Whether `flag` is set on any rank of the group (on one device, `flag`): every rank calls
    /// it at the same point of its loop and gets the same answer, so the ranks can decide
    /// together (stop after this step, evaluate now) and keep making the same calls. A rank
    /// that does not come within the group's timeout stops the group.
    pub fn any_rank(&self, flag: bool) -> Result<bool> {
        match &self.member {
            Some(m) => m.exchange.any(m.rank, "any_rank", flag),
            None => Ok(flag),
        }
    }

    /// This handle's place in its group.
    pub(crate) fn member(&self) -> Option<&crate::collective::Membership> {
        self.member.as_ref()
    }

    /// The root path to build the model on (Stagehand's layers stream; `tch::nn` layers made on
    /// `&*root` stay on the device).
    pub fn root(&self) -> Path<'_> {
        self.store.root()
    }

    /// The managed VarStore.
    pub fn store(&self) -> &ManagedVarStore {
        &self.store
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The bus every event goes to.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The bus's hub (for consumers attached after the build), if the bus is enabled.
    pub fn hub(&self) -> Option<&Arc<Hub>> {
        self.bus.hub()
    }

    /// The weight runtime.
    pub fn weights(&self) -> &WeightRuntime {
        self.store.runtime()
    }

    fn run(&self) -> MutexGuard<'_, step::Run> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The memory plan, once the model has run (or [`prepare`](Self::prepare) was called).
    pub fn plan(&self) -> Option<Plan> {
        self.run().ready.as_ref().map(|r| r.plan.clone())
    }

    /// The activation runtime, once prepared.
    pub fn activations(&self) -> Option<ActivationRuntime> {
        self.run().ready.as_ref().and_then(|r| r.acts.clone())
    }

    /// The Conductor, once prepared.
    pub fn conductor(&self) -> Option<Conductor> {
        self.run().ready.as_ref().map(|r| r.conductor.clone())
    }

    /// An optimizer over every trainable variable of the model, managed or not, including
    /// variables made later (`tch::nn::AdamW::default()` and the other tch configs convert into
    /// an [`Algorithm`]).
    pub fn optimizer(&self, algorithm: impl Into<Algorithm>, lr: f64) -> Result<Optimizer> {
        let algorithm = algorithm.into();
        // Compressed state lives only in the fused kernel.
        let compressed = self.optimizer_state != StateStorage::Fp32;
        let kernel = self
            .kernel
            .unwrap_or_else(|| if compressed { Kernel::Fused } else { Kernel::auto(&algorithm, self.device.is_cuda()) });
        let mut opt = Optimizer::for_var_store(self.weights(), algorithm, lr, kernel)?;
        opt.set_state_storage(self.optimizer_state)?;
        opt.set_host_threads(self.optimizer_threads);
        self.planner.set_state_factor(match algorithm {
            Algorithm::Adam { .. } | Algorithm::AdamW { .. } => 2,
            Algorithm::Sgd { momentum, .. } if momentum > 0.0 => 1,
            Algorithm::Sgd { .. } => 0,
            Algorithm::RmsProp { momentum, centered, .. } => 1 + u64::from(momentum > 0.0) + u64::from(centered),
        });
        Ok(opt)
    }

    /// Registers the model's blocks, derives the memory plan and sets up the runtimes and the
    /// Conductor (otherwise the first step does it). Returns the plan.
    pub fn prepare(&self) -> Result<Plan> {
        let mut run = self.run();
        self.ensure_ready(&mut run)?;
        run.ready
            .as_ref()
            .map(|r| r.plan.clone())
            .ok_or_else(|| Error::internal("prepared without a plan"))
    }

    /// What budgets buy this model (the model's layers registered first): the smallest budget
    /// it trains in, where the prefetch window is covered, where nothing streams. The budget a
    /// [`Error::BudgetTooSmall`] states is this guide's minimum.
    pub fn budget_guide(&self) -> Result<BudgetGuide> {
        self.planner.guide()
    }

    fn ensure_ready(&self, run: &mut step::Run) -> Result<()> {
        if run.ready.is_some() {
            return Ok(());
        }
        let weights = self.weights();
        // Made already if the model ran outside a step first (an evaluation before training).
        let plan = self.planner.ensure()?;
        let acts = if self.spill {
            let (high, low) = plan.first_spill_watermarks();
            let cfg = ActivationConfig::builder()
                .watermarks_bytes(high, low)
                .max_inflight(plan.max_inflight_spills, plan.max_inflight_restores)
                // Spills still landing hold their device memory: at most the room above the
                // high watermark.
                .max_inflight_spill_bytes(Some(plan.restore_allowance_bytes.max(1)))
                .restore_ahead(self.knobs.restore_lookahead(), plan.restore_allowance_bytes.max(1))
                .min_slabs_per_class(self.knobs.slabs_per_class.unwrap_or(0))
                // The last block's activations stay on the device only while they fit in the
                // room kept for restores (backward needs them first).
                .tail_max_bytes(Some(plan.restore_allowance_bytes))
                .spill_batches(
                    self.spill_batches.map_or(plan.spill_batch_below_bytes, |b| b.0),
                    self.spill_batches.map_or(plan.spill_batch_bytes, |b| b.1),
                )
                .size_pool_from_trace(true, Some(plan.pool_limit_bytes))
                // A small provisional pool: the first step that spills sizes the real one.
                .classes_bytes(&[1 << 20])
                .slabs_per_class(&[4])
                .debug_checksums(self.checksums)
                .recompute_fraction(self.recompute_fraction)
                .recompute_early_stop(self.recompute_early_stop)
                .build()?;
            Some(ActivationRuntime::new(self.device.clone(), cfg, self.bus.clone(), Some(weights.resolver()))?)
        } else {
            None
        };
        let conductor = if self.conductor_on {
            // The Conductor counts in MiB: caps round up, so a cap never falls below what the
            // plan allows (a budget of 65.2 MiB is not a cap of 65).
            let mib = |b: u64| b.div_ceil(1 << 20).max(1);
            let dev = self.device.clone();
            let c = Conductor::new(
                ConductorConfig::builder()
                    .vram_soft_cap_mib(mib(plan.soft_cap_bytes))
                    .vram_hard_cap_mib(mib(plan.hard_cap_bytes).max(mib(plan.soft_cap_bytes) + 1))
                    .h2d_slots(plan.h2d_slots)
                    .d2h_slots(plan.d2h_slots)
                    .priority_reserve_mib((mib(plan.budget_bytes) / 64).max(1))
                    // The plan fills the budget by design (activations are kept up to the
                    // watermarks, restores reserve their memory first), so backward runs near
                    // it every step: pressure means over the budget, not near it. At 95% the
                    // rule fired every step and cut the prefetch window to 1 and restores to
                    // one ahead, serializing backward's copies.
                    .backward_pressure_fraction(1.0)
                    .build()?,
                self.bus.clone(),
                move || dev.memory().allocated,
            )?;
            weights.attach_conductor(&c)?;
            if let Some(a) = &acts {
                a.attach_conductor(&c)?;
            }
            c
        } else {
            Conductor::disabled()
        };
        if self.conductor_on {
            self.bus.publish(EventKind::LimitsSet {
                owner: Owner::Conductor,
                budget_bytes: plan.soft_cap_bytes,
                high_watermark_bytes: Some(plan.hard_cap_bytes),
                low_watermark_bytes: None,
            });
        }
        run.ready = Some(step::Ready { plan, acts, conductor });
        Ok(())
    }

    /// Waits for the host optimizer, ends the runtimes and gives the device memory back; each
    /// parameter then holds its values on the CPU.
    pub fn shutdown(&self) -> Result<()> {
        let run = self.run();
        if let Some(r) = &run.ready {
            r.conductor.shutdown();
        }
        self.weights().shutdown()
    }
}
