//! NCCL: the collectives of CUDA ranks.
//!
//! The library is loaded at run time, like the CUDA driver, so the build needs no CUDA toolkit
//! and a machine without NCCL runs everything else. The types are cudarc's NCCL bindings
//! (`cudarc::nccl::sys`, NCCL 2.28's layout); the loading is ours, because cudarc's loader looks
//! for `libnccl.so` and versioned names that NCCL 2 does not ship (pip's `nvidia-nccl` has
//! `libnccl.so.2` only), and panics when it finds none. Here: `$STAGEHAND_NCCL_LIBRARY`,
//! `libnccl.so.2` (already loaded by libtorch_cuda on the GPU machines), `libnccl.so`, and
//! pip's layout beside libtorch; a missing library is an error that lists what was tried.
//!
//! Communicators are non-blocking (`ncclConfig_t::blocking = 0`): a call that is still being
//! set up returns `ncclInProgress` and the rank polls `ncclCommGetAsyncError`, checking the
//! group's fault state and timeout between polls, so a rank never sits inside NCCL waiting for
//! one that failed. When any rank fails, every communicator is aborted (`ncclCommAbort`), which
//! ends collectives still running on the devices, so the events behind them complete and no
//! host thread waits on them forever. A watchdog thread declares a rank failed when one of its
//! collectives has not completed within the group's timeout, and reports errors NCCL found
//! asynchronously.

use super::faults::Faults;
use super::{Span, Transport};
use crate::device::{Device, SideStream, StreamEvent};
use crate::error::{Error, Result};
use cudarc::nccl::sys as nc;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// `ncclResult_t` as the library returns it (a raw number: a value Rust's enum does not list
/// must not be undefined behaviour).
type Status = u32;
const SUCCESS: Status = 0;
const IN_PROGRESS: Status = 7;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> Status;
type GetUniqueId = unsafe extern "C" fn(*mut nc::ncclUniqueId) -> Status;
type CommInitRankConfig = unsafe extern "C" fn(*mut nc::ncclComm_t, c_int, nc::ncclUniqueId, c_int, *mut nc::ncclConfig_t) -> Status;
type CommGetAsyncError = unsafe extern "C" fn(nc::ncclComm_t, *mut Status) -> Status;
type CommOp = unsafe extern "C" fn(nc::ncclComm_t) -> Status;
type Collective = unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, nc::ncclRedOp_t, nc::ncclComm_t, nc::cudaStream_t) -> Status;
type GetErrorString = unsafe extern "C" fn(Status) -> *const c_char;

/// The library's entry points.
struct Lib {
    path: String,
    get_version: GetVersion,
    get_unique_id: GetUniqueId,
    comm_init_rank_config: CommInitRankConfig,
    comm_get_async_error: CommGetAsyncError,
    comm_abort: CommOp,
    comm_finalize: CommOp,
    comm_destroy: CommOp,
    reduce_scatter: Collective,
    all_reduce: Collective,
    get_error_string: GetErrorString,
}

static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();

fn library() -> Result<&'static Lib> {
    LIB.get_or_init(load).as_ref().map_err(|m| Error::Nccl { what: "loading the library".into(), message: m.clone() })
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null dlerror strings are NUL-terminated.
        unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    }
}

/// Where to look for the library, in order.
fn candidates() -> Vec<String> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("STAGEHAND_NCCL_LIBRARY") {
        c.push(p.to_string_lossy().into_owned());
    }
    c.push("libnccl.so.2".into());
    c.push("libnccl.so".into());
    // pip's layout: site-packages/torch/lib beside site-packages/nvidia/nccl/lib.
    if let Some(torch) = std::env::var_os("LIBTORCH") {
        let site = std::path::Path::new(&torch).join("..").join("nvidia").join("nccl").join("lib").join("libnccl.so.2");
        c.push(site.to_string_lossy().into_owned());
    }
    c
}

fn load() -> std::result::Result<Lib, String> {
    let mut tried = Vec::new();
    for name in candidates() {
        let Ok(c) = CString::new(name.clone()) else { continue };
        // SAFETY: dlopen with a NUL-terminated name; the handle stays open for the process.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            tried.push(format!("{name} ({})", dl_error()));
            continue;
        }
        let sym = |s: &str| -> std::result::Result<*mut c_void, String> {
            let cs = CString::new(s).map_err(|e| e.to_string())?;
            // SAFETY: `handle` is a live library handle and `cs` a NUL-terminated name.
            let p = unsafe { libc::dlsym(handle, cs.as_ptr()) };
            if p.is_null() {
                Err(format!("{name} has no symbol {s}"))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is NCCL's function of that name, whose C signature the type
        // spells (nccl.h of NCCL 2.28, as cudarc's bindings declare them).
        let lib = unsafe {
            Lib {
                path: name.clone(),
                get_version: std::mem::transmute::<*mut c_void, GetVersion>(sym("ncclGetVersion")?),
                get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(sym("ncclGetUniqueId")?),
                comm_init_rank_config: std::mem::transmute::<*mut c_void, CommInitRankConfig>(sym("ncclCommInitRankConfig")?),
                comm_get_async_error: std::mem::transmute::<*mut c_void, CommGetAsyncError>(sym("ncclCommGetAsyncError")?),
                comm_abort: std::mem::transmute::<*mut c_void, CommOp>(sym("ncclCommAbort")?),
                comm_finalize: std::mem::transmute::<*mut c_void, CommOp>(sym("ncclCommFinalize")?),
                comm_destroy: std::mem::transmute::<*mut c_void, CommOp>(sym("ncclCommDestroy")?),
                reduce_scatter: std::mem::transmute::<*mut c_void, Collective>(sym("ncclReduceScatter")?),
                all_reduce: std::mem::transmute::<*mut c_void, Collective>(sym("ncclAllReduce")?),
                get_error_string: std::mem::transmute::<*mut c_void, GetErrorString>(sym("ncclGetErrorString")?),
            }
        };
        return Ok(lib);
    }
    Err(format!("tried {}: set STAGEHAND_NCCL_LIBRARY to libnccl.so.2 (pip's nvidia-nccl puts it in site-packages/nvidia/nccl/lib)", tried.join(", ")))
}

impl Lib {
    fn message(&self, status: Status) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.get_error_string)(status) };
        if p.is_null() {
            format!("error {status}")
        } else {
            // SAFETY: as above.
            format!("{} (error {status})", unsafe { CStr::from_ptr(p) }.to_string_lossy())
        }
    }

    fn check(&self, what: impl Into<String>, status: Status) -> Result<()> {
        match status {
            SUCCESS | IN_PROGRESS => Ok(()),
            s => Err(Error::Nccl { what: what.into(), message: self.message(s) }),
        }
    }
}

/// The NCCL version found, as "2.28.9 (libnccl.so.2)".
pub(crate) fn version() -> Result<String> {
    let lib = library()?;
    let mut v: c_int = 0;
    // SAFETY: a valid out-parameter.
    lib.check("ncclGetVersion", unsafe { (lib.get_version)(&mut v) })?;
    Ok(format!("{}.{}.{} ({})", v / 10000, (v % 10000) / 100, v % 100, lib.path))
}

/// A new unique id (rank 0 makes it; the others get it through the group's rendezvous).
pub(crate) fn unique_id() -> Result<Vec<u8>> {
    let lib = library()?;
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-parameter.
    lib.check("ncclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn data_type(kind: Kind) -> Result<nc::ncclDataType_t> {
    Ok(match kind {
        Kind::Float => nc::ncclDataType_t::ncclFloat32,
        Kind::BFloat16 => nc::ncclDataType_t::ncclBfloat16,
        Kind::Half => nc::ncclDataType_t::ncclFloat16,
        Kind::Double => nc::ncclDataType_t::ncclFloat64,
        k => {
            return Err(Error::Config {
                field: "gradient dtype",
                value: format!("{k:?}"),
                expected: "float32, bfloat16, float16 or float64 (what NCCL reduces)".into(),
            })
        }
    })
}

/// A communicator: its handle until it is aborted or destroyed. Calls take the read lock for
/// the length of one NCCL call; aborting takes the write lock.
struct Comm {
    handle: RwLock<Option<CommHandle>>,
}

#[derive(Clone, Copy)]
struct CommHandle(nc::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the lock), and
// aborted from another thread (NCCL's documented way to end a rank's collectives).
unsafe impl Send for CommHandle {}
// SAFETY: as above.
unsafe impl Sync for CommHandle {}

impl Comm {
    /// Runs `f` on the handle; an error once the communicator was aborted.
    fn with<T>(&self, faults: &Faults, f: impl FnOnce(nc::ncclComm_t) -> T) -> Result<T> {
        let g = self.handle.read().unwrap_or_else(|p| p.into_inner());
        match *g {
            Some(h) => Ok(f(h.0)),
            None => {
                drop(g);
                faults.check()?;
                Err(Error::Nccl { what: "a collective".into(), message: "the communicator was aborted".into() })
            }
        }
    }

    /// Aborts the communicator (its collectives on the device end); idempotent.
    fn abort(&self) {
        let mut g = self.handle.write().unwrap_or_else(|p| p.into_inner());
        if let (Some(h), Ok(lib)) = (g.take(), library()) {
            // SAFETY: a live communicator, no other call in progress (the write lock).
            unsafe { (lib.comm_abort)(h.0) };
        }
    }

    /// Starts flushing the communicator's work before it is destroyed (non-blocking: its state
    /// leaves "in progress" when done).
    fn finalize(&self, faults: &Faults) -> Result<Status> {
        let lib = library()?;
        // SAFETY: a live communicator (the read lock), no other call on it in progress.
        self.with(faults, |h| unsafe { (lib.comm_finalize)(h) })
    }

    /// Frees the communicator after a run whose collectives all completed.
    fn destroy(&self) {
        let mut g = self.handle.write().unwrap_or_else(|p| p.into_inner());
        if let (Some(h), Ok(lib)) = (g.take(), library()) {
            // SAFETY: a live communicator with nothing in flight.
            unsafe { (lib.comm_destroy)(h.0) };
        }
    }

    /// The communicator's asynchronous state: `IN_PROGRESS` while a call is being set up, an
    /// error NCCL found, or `SUCCESS`.
    fn state(&self, faults: &Faults) -> Result<Status> {
        let lib = library()?;
        self.with(faults, |h| {
            let mut s: Status = SUCCESS;
            // SAFETY: a live communicator and a valid out-parameter.
            let r = unsafe { (lib.comm_get_async_error)(h, &mut s) };
            if r != SUCCESS {
                r
            } else {
                s
            }
        })
    }
}

/// A collective queued and not seen complete yet, for the watchdog.
struct Watched {
    rank: usize,
    tag: String,
    issued: Instant,
    done: StreamEvent,
}

/// What the watchdog watches: every rank's communicator and collectives in flight.
struct Watch {
    comms: Mutex<Vec<(usize, Weak<Comm>)>>,
    inflight: Mutex<VecDeque<Watched>>,
}

/// The NCCL side of one group: the communicators' watchdog. Dropped at the end of the run
/// (the thread ends).
pub(crate) struct NcclGroup {
    faults: Arc<Faults>,
    watch: Arc<Watch>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup").finish_non_exhaustive()
    }
}

/// How often the watchdog looks.
const WATCH_EVERY: Duration = Duration::from_millis(200);

impl NcclGroup {
    /// The watchdog of a group whose failure state is `faults`.
    pub(crate) fn new(faults: Arc<Faults>) -> Result<NcclGroup> {
        library()?;
        let watch = Arc::new(Watch { comms: Mutex::new(Vec::new()), inflight: Mutex::new(VecDeque::new()) });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Abort every communicator as soon as any rank fails.
        let w = Arc::downgrade(&watch);
        faults.on_raise(move || {
            if let Some(w) = w.upgrade() {
                let comms: Vec<Arc<Comm>> = w.comms.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(|(_, c)| c.upgrade()).collect();
                for c in comms {
                    c.abort();
                }
            }
        });
        let (f, w, s) = (faults.clone(), watch.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("stagehand-nccl-watchdog".into())
            .spawn(move || watchdog(&f, &w, &s))
            .map_err(|e| Error::internal(format!("starting the NCCL watchdog: {e}")))?;
        Ok(NcclGroup { faults, watch, stop, thread: Some(thread) })
    }

    /// Rank `rank`'s transport on `device`, joining the communicator of `id` (every rank of the
    /// group calls it at once, each on its own thread, with the same id).
    pub(crate) fn join(&self, rank: usize, world: usize, device: &Device, id: &[u8]) -> Result<NcclTransport> {
        let lib = library()?;
        let stream = device
            .side_stream()?
            .ok_or_else(|| Error::internal("an NCCL rank on the host device"))?;
        stream.bind()?;
        let mut uid = nc::ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(Error::internal(format!("an NCCL unique id of {} bytes", id.len())));
        }
        for (d, &b) in uid.internal.iter_mut().zip(id) {
            *d = b as c_char;
        }
        // NCCL_CONFIG_INITIALIZER of nccl.h 2.28, non-blocking.
        const UNDEF: c_int = c_int::MIN;
        let mut config = nc::ncclConfig_t {
            size: std::mem::size_of::<nc::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: 22800,
            blocking: 0,
            cgaClusterSize: UNDEF,
            minCTAs: UNDEF,
            maxCTAs: UNDEF,
            netName: std::ptr::null(),
            splitShare: UNDEF,
            trafficClass: UNDEF,
            commName: std::ptr::null(),
            collnetEnable: UNDEF,
            CTAPolicy: UNDEF,
            shrinkShare: UNDEF,
            nvlsCTAs: UNDEF,
            nChannelsPerNetPeer: UNDEF,
            nvlinkCentricSched: UNDEF,
        };
        let mut handle: nc::ncclComm_t = std::ptr::null_mut();
        let (nranks, r) = (c_int::try_from(world).map_err(|e| Error::internal(e.to_string()))?, rank as c_int);
        // SAFETY: valid out-parameter, id and config; the device is current on this thread.
        let status = unsafe { (lib.comm_init_rank_config)(&mut handle, nranks, uid, r, &mut config) };
        lib.check(format!("rank {rank}: ncclCommInitRankConfig"), status)?;
        if handle.is_null() {
            return Err(Error::Nccl { what: format!("rank {rank}: ncclCommInitRankConfig"), message: "no communicator".into() });
        }
        let comm = Arc::new(Comm { handle: RwLock::new(Some(CommHandle(handle))) });
        self.watch.comms.lock().unwrap_or_else(|p| p.into_inner()).push((rank, Arc::downgrade(&comm)));
        let t = NcclTransport { rank, device: device.clone(), stream, comm, faults: self.faults.clone(), watch: self.watch.clone() };
        // Non-blocking: the communicator is ready once its state leaves "in progress".
        t.settle(&format!("rank {rank}: joining the communicator"))?;
        if self.faults.is_raised() {
            t.comm.abort();
        }
        Ok(t)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watchdog(faults: &Faults, watch: &Watch, stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(WATCH_EVERY);
        if faults.is_raised() {
            continue;
        }
        // Collectives that completed are forgotten; the oldest one still running decides.
        let late = {
            let mut q = watch.inflight.lock().unwrap_or_else(|p| p.into_inner());
            q.retain(|w| !w.done.is_complete());
            q.front().filter(|w| w.issued.elapsed() > faults.timeout()).map(|w| (w.rank, w.tag.clone(), w.issued.elapsed()))
        };
        if let Some((rank, tag, age)) = late {
            faults.raise(
                rank,
                format!(
                    "its {tag} did not complete within {:.0} s ({:.0} s so far): a rank stopped, hangs or runs other steps (NCCL's communicators were aborted)",
                    faults.timeout().as_secs_f64(),
                    age.as_secs_f64()
                ),
            );
            continue;
        }
        let comms: Vec<(usize, Arc<Comm>)> = watch.comms.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(|(r, c)| c.upgrade().map(|c| (*r, c))).collect();
        for (rank, c) in comms {
            if let Ok(s) = c.state(faults) {
                if s != SUCCESS && s != IN_PROGRESS {
                    let msg = library().map(|l| l.message(s)).unwrap_or_default();
                    faults.raise(rank, format!("NCCL reported an asynchronous error: {msg}"));
                    break;
                }
            }
        }
    }
}

/// One CUDA rank's collectives: its communicator and the side stream they run on.
pub(crate) struct NcclTransport {
    rank: usize,
    device: Device,
    stream: SideStream,
    comm: Arc<Comm>,
    faults: Arc<Faults>,
    watch: Arc<Watch>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport").field("rank", &self.rank).finish_non_exhaustive()
    }
}

/// How long a rank sleeps between polls of a call still being set up.
const POLL: Duration = Duration::from_micros(20);

impl NcclTransport {
    /// Waits until the communicator's last call left "in progress": fails on an NCCL error,
    /// when the group stopped, or past the group's timeout.
    fn settle(&self, what: &str) -> Result<()> {
        let t0 = Instant::now();
        loop {
            self.faults.check()?;
            let s = self.comm.state(&self.faults)?;
            match s {
                SUCCESS => return Ok(()),
                IN_PROGRESS => {
                    if t0.elapsed() > self.faults.timeout() {
                        let f = self.faults.raise(self.rank, format!("{what} did not finish within {:.0} s", self.faults.timeout().as_secs_f64()));
                        return Err(f.error());
                    }
                    std::thread::sleep(POLL);
                }
                s => {
                    let msg = library().map(|l| l.message(s)).unwrap_or_default();
                    return Err(Error::Nccl { what: what.into(), message: msg });
                }
            }
        }
    }

    /// Queues `op` on the side stream after the compute stream's work so far, timed.
    fn queue(&self, tag: &str, op: impl FnOnce(&Lib, nc::ncclComm_t, nc::cudaStream_t) -> Status) -> Result<Span> {
        let lib = library()?;
        self.faults.check()?;
        self.stream.bind()?;
        let produced = self.device.record_compute()?;
        self.stream.wait(&produced)?;
        let start = self.stream.record(true)?;
        let raw = self.stream.raw() as nc::cudaStream_t;
        let status = self.comm.with(&self.faults, |h| op(lib, h, raw))?;
        lib.check(format!("rank {}: {tag}", self.rank), status)?;
        if status == IN_PROGRESS {
            self.settle(tag)?;
        }
        let done = self.stream.record(true)?;
        self.watch.inflight.lock().unwrap_or_else(|p| p.into_inner()).push_back(Watched {
            rank: self.rank,
            tag: tag.to_owned(),
            issued: Instant::now(),
            done: done.clone(),
        });
        Ok(Span { start: Some(start), done })
    }
}

impl Transport for NcclTransport {
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, tag: &str) -> Result<Span> {
        let dt = data_type(output.kind())?;
        if input.kind() != output.kind() || !input.is_contiguous() || !output.is_contiguous() {
            return Err(Error::internal(format!("{tag}: reduce-scatter of a {:?} tensor into a {:?} one", input.kind(), output.kind())));
        }
        let (src, dst, count) = (input.data_ptr() as *const c_void, output.data_ptr(), output.numel());
        // SAFETY: both tensors are contiguous device memory of this rank, `input` holding
        // `world * count` elements and `output` `count`, kept alive by the caller until the
        // returned span's `done` completes; the stream belongs to this device.
        self.queue(&format!("reduce-scatter of {tag}"), |lib, h, s| unsafe {
            (lib.reduce_scatter)(src, dst, count, dt, nc::ncclRedOp_t::ncclSum, h, s)
        })
    }

    fn all_reduce(&self, tensor: &Tensor, tag: &str) -> Result<Span> {
        let dt = data_type(tensor.kind())?;
        if !tensor.is_contiguous() {
            return Err(Error::internal(format!("{tag}: all-reduce of a non-contiguous tensor")));
        }
        let (ptr, count) = (tensor.data_ptr(), tensor.numel());
        // SAFETY: as in `reduce_scatter`, in place.
        self.queue(&format!("all-reduce of {tag}"), |lib, h, s| unsafe {
            (lib.all_reduce)(ptr as *const c_void, ptr, count, dt, nc::ncclRedOp_t::ncclSum, h, s)
        })
    }

    /// Frees the communicator at the end of a run that completed (everything on the device
    /// done); after a failure it was aborted already.
    fn close(&self) {
        if self.faults.is_raised() {
            self.comm.abort();
            return;
        }
        let _ = self.device.synchronize();
        // A non-blocking communicator is finalized (and that awaited) before it is destroyed.
        let finalized = match self.comm.finalize(&self.faults) {
            Ok(SUCCESS) => Ok(()),
            Ok(IN_PROGRESS) => self.settle(&format!("rank {}: finalizing the communicator", self.rank)),
            Ok(s) => Err(Error::Nccl { what: "ncclCommFinalize".into(), message: library().map(|l| l.message(s)).unwrap_or_default() }),
            Err(e) => Err(e),
        };
        match finalized {
            Ok(()) => self.comm.destroy(),
            Err(_) => self.comm.abort(),
        }
    }
}
