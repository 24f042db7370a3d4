//! Several GPUs of one host: data parallel, with ONE host copy of the model.
//!
//! ```no_run
//! use stagehand::nn as snn;
//! use stagehand::parallel::Devices;
//! use stagehand::Stagehand;
//! use tch::nn::Module;
//!
//! # fn main() -> stagehand::Result<()> {
//! let group = Stagehand::builder().budget_mib(8 * 1024).devices(Devices::cuda(2)?).build_group()?;
//! let losses = group.run(
//!     // Built once per rank, rank 0 first: every rank builds the same model.
//!     |sh| {
//!         let root = sh.root();
//!         tch::nn::seq()
//!             .add(snn::linear(&root / "blocks" / 0 / "fc", 512, 512, Default::default()))
//!             .add(snn::linear(&root / "blocks" / 1 / "fc", 512, 512, Default::default()))
//!     },
//!     // The training loop, on every rank at once, each on its own GPU and its slice of the batch.
//!     |sh, model| -> stagehand::Result<f64> {
//!         let mut opt = sh.optimizer(tch::nn::AdamW::default(), 1e-3)?;
//!         let mut loss = 0.0;
//!         for step in 0..10 {
//!             let batch = tch::Tensor::randn([64, 512], (tch::Kind::Float, tch::Device::Cpu));
//!             let x = sh.shard(&batch)?; // rows rank * 32 .. (rank + 1) * 32, on this rank's GPU
//!             loss = sh.train_step(&mut opt, || model.forward(&x).square().mean(tch::Kind::Float))?.loss;
//!             if step % 5 == 4 {
//!                 sh.save("model.safetensors")?; // every rank calls it; rank 0 writes one model
//!             }
//!         }
//!         Ok(loss)
//!     },
//! )?;
//! # Ok(()) }
//! ```
//!
//! **One process, a thread per GPU.** The reason is the host side: the model's host copy (the
//! pinned weights every GPU streams from, the float32 masters) and the host optimizer's state
//! are the largest things a run holds, and one process holds them once: every rank's blocks
//! point at rank 0's host copy (`weights::shared`). A process per GPU (torchrun's
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`) would hold N copies, or share them through shared memory
//! and cross-process synchronisation of the optimizer's writes; the one process needs neither.
//! libtorch is thread-safe per device (each GPU has its own autograd thread, its own cuBLAS
//! handles, its own caching-allocator pools), and each rank's thread computes on its own
//! device's default stream.
//!
//! **A step.** Each rank runs the same loop on its slice of the global batch ([`Stagehand::shard`])
//! and streams its blocks from the shared host copy into its own device room, under its own
//! budget. As backward leaves each trained block, the rank packs the block's gradients into one
//! bucket and the group reduce-scatters it over NCCL on a side stream while backward goes on;
//! each rank copies its shard of the sum (1/N of the block) to the host once, and its host
//! optimizer steps that shard, writing the updated weights into the one host copy. A rank loads
//! a trained block only once every rank's step of it has run. Variables Stagehand does not
//! stream (norms, embeddings kept on the device) have their gradients all-reduced before each
//! rank's device optimizer steps them, so every rank holds the same values. The group's loss is
//! the ranks' average; fp16's overflow check, the guards' non-finite loss and gradient clipping
//! by norm are decided for the group (every rank skips the step, or none does).
//!
//! **Exactness.** Each rank's loss is its slice's mean divided by the world size, the operation
//! one device applies to each of N micro-batches, and the reduction sums in rank order: on the
//! host device a group of N trains bit-identically to one device running
//! `train_step_micro` over the same global batch in N micro-batches
//! (`runtime/tests/parallel.rs`). On CUDA, NCCL sums in its own order (equal within float
//! rounding).
//!
//! **Faults.** A rank that fails (an error or a panic in its closure, an out-of-memory, a
//! collective that did not complete within the timeout, a lost device) stops the group: every
//! rank's next collective, rendezvous or wait returns [`Error::RankFailed`] naming the rank and
//! the cause, NCCL's communicators are aborted (collectives on the devices end), and
//! [`Group::run`] returns that error. A rank stuck in its own code cannot be stopped from
//! outside; the others end with the timeout's error, and `run` returns once it does.
//!
//! **Across hosts** (not built): see docs/design.md, "Several GPUs".

use crate::collective::exchange::Exchange;
use crate::collective::faults::Faults;
use crate::collective::{nccl, Collective, Membership};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::events::Bus;
use crate::session::{Attachment, Stagehand, StagehandBuilder};
use crate::weights::shared::SharedModel;
use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tch::Tensor;

/// How long a rank waits for the others at one collective or rendezvous by default before it
/// declares the missing rank failed (a first NCCL collective on a cold machine takes seconds;
/// a step of a large model, less than this).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// The NCCL library the CUDA ranks use and its version ("2.28.9 (libnccl.so.2)"), or why it
/// cannot be loaded (it is loaded at run time: see `collective::nccl`).
pub fn nccl_version() -> Result<String> {
    nccl::version()
}

/// Lists of devices for [`StagehandBuilder::devices`].
#[derive(Debug)]
pub struct Devices;

impl Devices {
    /// CUDA devices `0..n`; an error naming what is missing when the machine has fewer.
    pub fn cuda(n: usize) -> Result<Vec<Device>> {
        if n == 0 {
            return Err(Error::Config { field: "gpus", value: "0".into(), expected: "at least 1".into() });
        }
        let have = if crate::torch::init() { usize::try_from(tch::Cuda::device_count()).unwrap_or(0) } else { 0 };
        if have < n {
            return Err(Error::NoCuda(format!("{n} GPUs asked for, {have} present")));
        }
        (0..n).map(Device::cuda).collect()
    }

    /// `n` host devices simulating GPUs (machines without CUDA, tests), each with
    /// `budget_bytes` of simulated VRAM.
    pub fn host(n: usize, budget_bytes: u64) -> Vec<Device> {
        (0..n).map(|i| Device::host_numbered(budget_bytes, i as u32)).collect()
    }

    /// `n` CUDA devices when the machine has that many, else `n` simulated host devices.
    pub fn auto(n: usize, budget_bytes: u64) -> Vec<Device> {
        Devices::cuda(n).unwrap_or_else(|_| Devices::host(n, budget_bytes))
    }
}

/// A data-parallel group: one handle per device, made when the group [runs](Group::run). Build
/// it with [`StagehandBuilder::devices`] and [`StagehandBuilder::build_group`].
pub struct Group {
    template: StagehandBuilder,
    devices: Vec<Device>,
    bus: Bus,
    timeout: Duration,
    /// Whether TF32 was on before the group turned it on (put back when it drops).
    tf32_before: Option<bool>,
    telemetry: Option<crate::events::Telemetry>,
    // Dropped last: the server keeps serving the run until the group goes.
    _attached: Vec<Attachment>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group").field("devices", &self.devices.iter().map(describe).collect::<Vec<_>>()).finish_non_exhaustive()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(was) = self.tf32_before {
            crate::torch::amp::set_tf32(was);
        }
    }
}

/// "cuda:1 (NVIDIA H100 80GB HBM3)" or "host:1 (simulated)".
fn describe(d: &Device) -> String {
    let i = d.info();
    if d.is_cuda() {
        format!("cuda:{} ({})", i.index, i.name)
    } else {
        format!("host:{} (simulated)", i.index)
    }
}

/// What a rank did: its closure's result or why it stopped.
type Outcome<T> = std::result::Result<T, String>;

impl Group {
    pub(crate) fn new(
        template: StagehandBuilder,
        devices: Vec<Device>,
        bus: Bus,
        telemetry: Option<crate::events::Telemetry>,
        attached: Vec<Attachment>,
        timeout: Duration,
        tf32: bool,
    ) -> Result<Group> {
        if devices.is_empty() {
            return Err(Error::Config { field: "devices", value: "none".into(), expected: "at least one device".into() });
        }
        let cuda = devices[0].is_cuda();
        if devices.iter().any(|d| d.is_cuda() != cuda) {
            return Err(Error::Config {
                field: "devices",
                value: devices.iter().map(describe).collect::<Vec<_>>().join(", "),
                expected: "devices of one kind: all CUDA, or all simulated on the host".into(),
            });
        }
        let mut indices: Vec<u32> = devices.iter().map(|d| d.info().index).collect();
        indices.sort_unstable();
        if indices.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::Config {
                field: "devices",
                value: devices.iter().map(describe).collect::<Vec<_>>().join(", "),
                expected: "each device once (a rank per device)".into(),
            });
        }
        if timeout.is_zero() {
            return Err(Error::Config { field: "collective_timeout", value: "0 s".into(), expected: "a positive duration".into() });
        }
        let tf32 = (tf32 && cuda).then(|| crate::torch::amp::set_tf32(true));
        Ok(Group { template, devices, bus, timeout, tf32_before: tf32, telemetry, _attached: attached })
    }

    /// The group's devices, rank by rank.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The bus every rank publishes on (each on its device's lane).
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The bus's hub, for consumers attached after the build.
    pub fn hub(&self) -> Option<&Arc<crate::events::Hub>> {
        self.bus.hub()
    }

    /// Writes what the telemetry holds (the handles' `finish` on one device).
    pub fn flush(&self) {
        self.bus.flush();
        if let Some(t) = &self.telemetry {
            t.flush();
        }
    }

    /// Runs the group: on each device a handle of its own (its rank), on a thread of its own.
    /// First `build` makes each rank's model on its handle, one rank after the other, rank 0
    /// first (rank 0's initial values are the model's: every other rank's blocks stream from
    /// rank 0's host copy, and its other variables are set to rank 0's; the random generator
    /// is put back after the other ranks' builds, so what the loops draw next is what a
    /// one-device program draws). Then `train` runs on every rank at once: the training loop,
    /// which sees its rank and slice through the handle. Returns each rank's result in rank
    /// order, or the error of the rank that failed first (see the module docs, "Faults").
    ///
    /// With one device, the handle is a plain one-device handle.
    pub fn run<M, T, E>(
        &self,
        build: impl Fn(&Stagehand) -> M + Sync,
        train: impl Fn(&Stagehand, &mut M) -> std::result::Result<T, E> + Sync,
    ) -> Result<Vec<T>>
    where
        T: Send,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let world = self.devices.len();
        if world == 1 {
            let sh = self.template.replica().device(self.devices[0].clone()).bus(self.bus.clone()).build()?;
            let mut model = build(&sh);
            let out = train(&sh, &mut model).map_err(|e| Error::RankFailed { rank: 0, device: describe(&self.devices[0]), cause: e.into().to_string() })?;
            return Ok(vec![out]);
        }
        let faults = Arc::new(Faults::new(self.devices.iter().map(describe).collect(), self.timeout));
        let exchange = Exchange::new(faults.clone());
        let model = SharedModel::new(faults.clone());
        let nccl = if self.devices[0].is_cuda() { Some(nccl::NcclGroup::new(faults.clone())?) } else { None };
        let shared = Shared { faults: faults.clone(), exchange, model, nccl, turn: Turn::default(), init: Mutex::new(None), rng: Mutex::new(None) };
        let replicas: Vec<StagehandBuilder> = (0..world).map(|_| self.template.replica()).collect();
        let outcomes: Vec<Outcome<T>> = std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(world);
            for (rank, replica) in replicas.into_iter().enumerate() {
                let device = self.devices[rank].clone();
                let bus = self.bus.lane(device.info().index);
                let (shared, build, train) = (&shared, &build, &train);
                let spawned = std::thread::Builder::new()
                    .name(format!("stagehand-rank-{rank}"))
                    .spawn_scoped(s, move || run_rank(rank, world, replica, device, bus, shared, build, train));
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        faults.raise(rank, format!("its thread could not start: {e}"));
                    }
                }
            }
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&*p)))))
                .collect()
        });
        if let Some(f) = faults.fault() {
            return Err(f.error());
        }
        outcomes.into_iter().map(|o| o.map_err(|cause| Error::internal(format!("a rank failed without stopping the group: {cause}")))).collect()
    }
}

/// What the ranks of one run share.
struct Shared {
    faults: Arc<Faults>,
    exchange: Arc<Exchange>,
    model: Arc<SharedModel>,
    nccl: Option<nccl::NcclGroup>,
    /// Whose turn it is to build.
    turn: Turn,
    /// Rank 0's values of the variables Stagehand does not stream, by name (CPU copies), for
    /// the other ranks to start from.
    init: Mutex<Option<Vec<(String, Tensor)>>>,
    /// The random generator after rank 0's build.
    rng: Mutex<Option<crate::torch::rng::RngState>>,
}

/// The rank whose turn it is to build its model.
#[derive(Default)]
struct Turn {
    next: Mutex<usize>,
    cv: Condvar,
}

impl Turn {
    /// Waits for `rank`'s turn (abortable: the group's fault ends the wait).
    fn wait(&self, rank: usize, faults: &Faults) -> Result<()> {
        let t0 = Instant::now();
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        while *next != rank {
            faults.check()?;
            if t0.elapsed() > faults.timeout() {
                let late = *next;
                drop(next);
                return Err(faults.raise(late, format!("did not build its model within {:.0} s", faults.timeout().as_secs_f64())).error());
            }
            next = self.cv.wait_timeout(next, Duration::from_millis(50)).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(())
    }

    fn pass(&self, to: usize) {
        *self.next.lock().unwrap_or_else(|p| p.into_inner()) = to;
        self.cv.notify_all();
    }
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    crate::error::panic_message(p).unwrap_or_else(|| "a panic without a message".into())
}

/// One rank's whole run; any failure stops the group (the first one is its cause).
#[allow(clippy::too_many_arguments)]
fn run_rank<M, T, E>(
    rank: usize,
    world: usize,
    replica: StagehandBuilder,
    device: Device,
    bus: Bus,
    shared: &Shared,
    build: &(impl Fn(&Stagehand) -> M + Sync),
    train: &(impl Fn(&Stagehand, &mut M) -> std::result::Result<T, E> + Sync),
) -> Outcome<T>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let body = || -> Outcome<T> {
        let text = |e: Error| e.to_string();
        device.bind_to_thread().map_err(text)?;
        let collective = match &shared.nccl {
            Some(g) => {
                let id = if rank == 0 { nccl::unique_id().map_err(text)? } else { Vec::new() };
                let ids = shared.exchange.all_gather(rank, "NCCL's unique id", id).map_err(text)?;
                let t = g.join(rank, world, &device, &ids[0]).map_err(text)?;
                Collective::nccl(t, rank, device.clone(), bus.clone(), shared.exchange.clone())
            }
            None => Collective::host(rank, device.clone(), bus.clone(), shared.exchange.clone()),
        };
        let member = Membership { rank, world, faults: shared.faults.clone(), exchange: shared.exchange.clone(), collective: Arc::new(collective) };
        let sh = replica.build_rank(device, bus, member.clone(), shared.model.clone()).map_err(text)?;
        // The models, one rank after the other.
        shared.turn.wait(rank, &shared.faults).map_err(text)?;
        if rank == 1 {
            *shared.rng.lock().unwrap_or_else(|p| p.into_inner()) = crate::torch::rng::cpu_rng_state();
        }
        let mut model = build(&sh);
        sh.store().seal().map_err(text)?;
        start_from_rank0(rank, &sh, shared).map_err(text)?;
        if rank + 1 == world {
            if let Some(state) = shared.rng.lock().unwrap_or_else(|p| p.into_inner()).take() {
                crate::torch::rng::set_cpu_rng_state(&state).map_err(text)?;
            }
        }
        shared.turn.pass(rank + 1);
        shared.exchange.barrier(rank, "every rank built its model").map_err(text)?;
        let result = train(&sh, &mut model).map_err(|e| e.into().to_string());
        if result.is_ok() {
            // No rank frees its communicator while another may still queue a collective with it.
            shared.exchange.barrier(rank, "every rank finished").map_err(text)?;
        }
        member.collective.close();
        drop(model);
        drop(sh);
        result
    };
    let out = match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(cause)) => Err(cause),
        Err(p) => Err(format!("panicked: {}", panic_text(&*p))),
    };
    if let Err(cause) = &out {
        shared.faults.raise(rank, cause.clone());
    }
    out
}

/// Rank 0 records its values of the variables Stagehand does not stream; every other rank sets
/// its own to them (its streamed blocks already point at rank 0's host copy). Names, shapes and
/// dtypes must match.
fn start_from_rank0(rank: usize, sh: &Stagehand, shared: &Shared) -> Result<()> {
    let managed = sh.store().managed_names();
    let vars = sh.store().vars();
    let mine: Vec<(String, Tensor)> = {
        let v = vars.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, Tensor)> =
            v.named_variables.iter().filter(|(n, _)| !managed.contains(*n)).map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    };
    let mut init = shared.init.lock().unwrap_or_else(|p| p.into_inner());
    if rank == 0 {
        let copies = mine
            .iter()
            .map(|(n, t)| Ok((n.clone(), tch::no_grad(|| t.f_to_device(tch::Device::Cpu)?.f_detach_copy())?)))
            .collect::<Result<Vec<_>>>()?;
        *init = Some(copies);
        return Ok(());
    }
    let Some(first) = init.as_ref() else {
        return Err(Error::internal("rank 0 built no model before the others"));
    };
    let mismatch = |what: String| shared.faults.raise(rank, format!("rank {rank} built a model unlike rank 0's: {what}: every rank must build the same model")).error();
    if let Some((n, _)) = mine.iter().find(|(n, _)| !first.iter().any(|(m, _)| m == n)) {
        return Err(mismatch(format!("it has variable '{n}', rank 0 does not")));
    }
    if let Some((n, _)) = first.iter().find(|(n, _)| !mine.iter().any(|(m, _)| m == n)) {
        return Err(mismatch(format!("rank 0 has variable '{n}', it does not")));
    }
    for (name, t) in &mine {
        let Some((_, v)) = first.iter().find(|(n, _)| n == name) else { continue };
        if t.size() != v.size() || t.kind() != v.kind() {
            return Err(mismatch(format!("'{name}' is {:?} {:?} there, {:?} {:?} on rank 0", t.kind(), t.size(), v.kind(), v.size())));
        }
        tch::no_grad(|| t.shallow_clone().f_copy_(v))?;
    }
    Ok(())
}
