//! Process-wide saved-tensor hooks, gated per thread.
//!
//! While a [`SavedTensorHooks`] guard is alive on a thread, every tensor that autograd saves for
//! backward on that thread goes through the guard's [`SavedTensorStore`]: `pack` receives the
//! tensor and returns a handle, `unpack` (in backward, possibly on an autograd worker thread)
//! turns the handle back into a tensor, and `release` says the saved variable is gone.
//!
//! Things a store must know (docs/design.md, "What libtorch gives and does not give"):
//! - autograd may save one tensor several times (a ReLU output twice): compare
//!   [`TensorIdentity`] to dedupe;
//! - `nn::linear` saves `W.t()`, a non-leaf view of the weight: recognise parameters by
//!   storage pointer, not by `is_leaf`;
//! - never keep an un-detached output (it references its `grad_fn`: a cycle); keep
//!   `tensor.detach()` or a copy;
//! - with hooks autograd skips its version-counter check, so a store returning stale data goes
//!   unnoticed: return exactly what was saved.
//!
//! Callbacks run with the hooks switched off on the current thread and with grad mode off, so a
//! store may run tensor operations freely. A store error or panic becomes a torch error in the
//! operation (forward) or in backward, never an abort.

use super::grad_mode::GradMode;
use super::ffi;
use crate::error::{Error, Result};
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use tch::Tensor;
use torch_sys::C_tensor;

pub use crate::error::HookError;

/// Where saved tensors go between forward and backward.
pub trait SavedTensorStore: Send + Sync + 'static {
    /// Takes a tensor autograd saves; returns a handle to give back in `unpack`/`release`.
    fn pack(&self, tensor: Tensor) -> std::result::Result<u64, HookError>;
    /// Returns the tensor saved under `handle`.
    fn unpack(&self, handle: u64) -> std::result::Result<Tensor, HookError>;
    /// The saved variable holding `handle` is gone. Must not fail.
    fn release(&self, handle: u64);
    /// Opens a recompute scope ([`crate::activations::recompute`]): what autograd saves until
    /// [`SavedTensorStore::close_recompute`] is not kept but computed again in backward. False
    /// (the default) when this store keeps everything it is given; the scope is then not open.
    fn open_recompute(&self) -> std::result::Result<bool, HookError> {
        Ok(false)
    }
    /// Closes the open recompute scope: `f` on `sources` computed `output` and every tensor
    /// saved in the scope. `None` abandons the scope (the function panicked): a backward through
    /// it is then an error.
    fn close_recompute(&self, _closing: Option<Recompute<'_>>) -> std::result::Result<(), HookError> {
        Ok(())
    }
}

/// A function computing a tensor from its sources, run again in backward by a recompute scope
/// (possibly on an autograd thread). Behind a lock, so it may hold tensors (which are `Send`
/// but not `Sync`).
#[derive(Clone)]
pub struct RecomputeFn(Arc<std::sync::Mutex<BoxedRecompute>>);

type BoxedRecompute = Box<dyn FnMut(&[Tensor]) -> Tensor + Send>;

impl std::fmt::Debug for RecomputeFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecomputeFn")
    }
}

impl RecomputeFn {
    pub fn new(f: impl FnMut(&[Tensor]) -> Tensor + Send + 'static) -> RecomputeFn {
        RecomputeFn(Arc::new(std::sync::Mutex::new(Box::new(f))))
    }

    /// Runs the function (a panic inside leaves it usable: it holds no state of ours).
    pub fn call(&self, args: &[Tensor]) -> Tensor {
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(args)
    }
}

/// How a recompute scope computed its output, for the store to repeat it in backward.
#[derive(Clone, Copy)]
pub struct Recompute<'a> {
    pub sources: &'a [Tensor],
    pub output: &'a Tensor,
    pub f: &'a RecomputeFn,
}

impl std::fmt::Debug for Recompute<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recompute")
            .field("sources", &self.sources.len())
            .field("output", &self.output.size())
            .finish_non_exhaustive()
    }
}

/// Storage identity of a tensor: equal identities mean the same memory seen the same way.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorIdentity {
    /// Address of the storage's data (0 for a tensor without storage).
    pub storage_ptr: u64,
    /// Offset into the storage, in elements.
    pub storage_offset: i64,
    /// Bytes of the whole storage.
    pub storage_nbytes: u64,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    pub kind: tch::Kind,
}

/// Bytes of `t`'s whole storage (0 without one), read without its kind, which tch cannot name
/// for every tensor autograd saves.
pub fn storage_nbytes(t: &Tensor) -> u64 {
    storage_of(t).2
}

/// `t`'s storage: the address of its data, `t`'s offset into it in elements, and its bytes.
fn storage_of(t: &Tensor) -> (u64, i64, u64) {
    let (mut ptr, mut off, mut nbytes) = (0u64, 0i64, 0u64);
    // SAFETY: `t` is a live tensor; the shim only reads its storage metadata.
    unsafe { ffi::stagehand_tensor_identity(t.as_ptr(), &mut ptr, &mut off, &mut nbytes) };
    (ptr, off, nbytes)
}

/// A zero-dimensional unsigned 64-bit tensor on the CPU: a kind tch cannot name (`kind()`
/// panics on it), as flash attention's saved RNG state is on CUDA. For tests of the hooks.
#[doc(hidden)]
pub fn unsigned_scalar() -> Tensor {
    // SAFETY: the shim returns a new, owned, defined tensor handle.
    unsafe { Tensor::from_ptr(ffi::stagehand_unsigned_scalar()) }
}

impl TensorIdentity {
    /// Reads the identity of `t`.
    pub fn of(t: &Tensor) -> TensorIdentity {
        let (ptr, off, nbytes) = storage_of(t);
        TensorIdentity {
            storage_ptr: ptr,
            storage_offset: off,
            storage_nbytes: nbytes,
            sizes: t.size(),
            strides: t.stride(),
            kind: t.kind(),
        }
    }
}

/// A weak reference to a tensor's storage: whether that very storage is still alive, without
/// keeping it alive. Equal identities of a live storage mean the same memory; once the storage
/// is gone its address may be reused by an unrelated tensor.
#[derive(Debug)]
pub struct StorageWatch(*mut std::os::raw::c_void);

// SAFETY: the weak pointer is only read through the thread-safe `expired()` and freed once.
unsafe impl Send for StorageWatch {}
// SAFETY: as above; `alive` only reads.
unsafe impl Sync for StorageWatch {}

impl StorageWatch {
    /// Watches `t`'s storage (`None` for a tensor without storage).
    pub fn of(t: &Tensor) -> Option<StorageWatch> {
        // SAFETY: `t` is live; the shim copies a weak reference to its storage.
        let w = unsafe { ffi::stagehand_storage_watch(t.as_ptr()) };
        (!w.is_null()).then_some(StorageWatch(w))
    }

    /// Whether the storage is still alive.
    pub fn alive(&self) -> bool {
        // SAFETY: `self.0` came from `stagehand_storage_watch` and is not freed yet.
        unsafe { ffi::stagehand_storage_alive(self.0) != 0 }
    }
}

impl Drop for StorageWatch {
    fn drop(&mut self) {
        // SAFETY: freed exactly once, here.
        unsafe { ffi::stagehand_storage_watch_free(self.0) }
    }
}

type Ctx = Arc<dyn SavedTensorStore>;

thread_local! {
    /// Set on a thread whose recomputation is stopping early (`torch::capture`): its failing
    /// packs are that stop, which the shim throws without a stack trace.
    static STOPPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks (or stops marking) this thread's failing packs as a recomputation's early stop.
pub(crate) fn set_stopping(on: bool) {
    STOPPING.with(|s| s.set(on));
}

/// Whether a pack failing on this thread is a recomputation's early stop.
pub(crate) fn stopping() -> bool {
    STOPPING.with(std::cell::Cell::get)
}

/// Runs a callback with hooks off on this thread and grad mode off, catching panics.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, HookError>) -> std::result::Result<T, String> {
    // SAFETY: setting the thread-local context to null and restoring it is always valid.
    let prev = unsafe { ffi::stagehand_hooks_set_context(std::ptr::null_mut()) };
    let out = catch_unwind(AssertUnwindSafe(|| {
        let _grad = GradMode::set(false);
        f()
    }));
    // SAFETY: restores the value read above on the same thread.
    unsafe { ffi::stagehand_hooks_set_context(prev) };
    match out {
        Ok(r) => r.map_err(|e| message(e.as_ref())),
        Err(p) => {
            let msg = crate::error::panic_message(p.as_ref()).unwrap_or_else(|| "unknown panic".into());
            Err(format!("panic in {what}: {msg}"))
        }
    }
}

/// An error and its sources, as one line (libtorch gets text).
fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The store this thread's hooks send saved tensors to, if any.
pub(crate) fn current_store() -> Option<Ctx> {
    // SAFETY: reads this thread's context pointer; non-null, it is a live `Box<Ctx>` owned by a
    // guard on this thread (or by the shim for the callback running now), which we clone.
    unsafe {
        let ctx = ffi::stagehand_hooks_get_context();
        (!ctx.is_null()).then(|| (*(ctx as *const Ctx)).clone())
    }
}

/// Runs a store's own tensor work from outside a callback (a recompute scope opened by user
/// code) as a callback runs: hooks off on this thread, grad mode off, panics caught.
pub(crate) fn outside_hooks<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, HookError>) -> Result<T> {
    guarded(what, f).map_err(|msg| Error::Torch(tch::TchError::Torch(msg)))
}

unsafe extern "C" fn pack_cb(
    ctx: *mut c_void,
    t: *mut C_tensor,
    handle: *mut u64,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: `ctx` is a live `Box<Ctx>` made by `retain_cb`; `t` is a heap tensor whose
    // ownership the shim hands to us.
    let (store, tensor) = unsafe { (&*(ctx as *const Ctx), Tensor::from_ptr(t)) };
    match guarded("pack", || store.pack(tensor)) {
        Ok(h) => {
            // SAFETY: `handle` is a valid out-parameter.
            unsafe { *handle = h };
            0
        }
        Err(msg) => {
            // SAFETY: the shim's buffer is valid for `err_len` bytes.
            unsafe { ffi::write_message(err, err_len, &msg) };
            // 2: a recomputation stopping early, which the shim throws without a stack trace.
            if stopping() {
                2
            } else {
                1
            }
        }
    }
}

unsafe extern "C" fn unpack_cb(
    ctx: *mut c_void,
    handle: u64,
    out: *mut *mut C_tensor,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: `ctx` is a live `Box<Ctx>`.
    let store = unsafe { &*(ctx as *const Ctx) };
    match guarded("unpack", || store.unpack(handle)) {
        Ok(mut tensor) => {
            let ptr = tensor.as_mut_ptr();
            // Ownership of the heap tensor passes to the shim, which deletes it.
            std::mem::forget(tensor);
            // SAFETY: `out` is a valid out-parameter.
            unsafe { *out = ptr };
            0
        }
        Err(msg) => {
            // SAFETY: the shim's buffer is valid for `err_len` bytes.
            unsafe { ffi::write_message(err, err_len, &msg) };
            1
        }
    }
}

unsafe extern "C" fn release_cb(ctx: *mut c_void, handle: u64) {
    // SAFETY: `ctx` is a live `Box<Ctx>`.
    let store = unsafe { &*(ctx as *const Ctx) };
    let _ = guarded("release", || {
        store.release(handle);
        Ok(())
    });
}

unsafe extern "C" fn retain_cb(ctx: *mut c_void) -> *mut c_void {
    // SAFETY: `ctx` is a live `Box<Ctx>`; we return a new box holding another reference.
    let store = unsafe { &*(ctx as *const Ctx) };
    Box::into_raw(Box::new(store.clone())) as *mut c_void
}

unsafe extern "C" fn drop_cb(ctx: *mut c_void) {
    // SAFETY: `ctx` came from `Box::into_raw` in `retain_cb` and is dropped exactly once.
    drop(unsafe { Box::from_raw(ctx as *mut Ctx) });
}

/// Makes the hook engine libtorch's default engine. Idempotent. Must happen before the first
/// backward of the process (every [`SavedTensorHooks::enable`] calls it).
pub fn install() -> Result<()> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: the callbacks match the shim's signatures and live for the whole program.
    let rc = unsafe {
        ffi::stagehand_hooks_install(
            pack_cb,
            unpack_cb,
            release_cb,
            retain_cb,
            drop_cb,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 {
        return Err(Error::Torch(tch::TchError::Torch(format!(
            "installing the saved-tensor hook engine: {}",
            ffi::message(&err)
        ))));
    }
    Ok(())
}

/// Whether the hook engine is installed.
pub fn installed() -> bool {
    // SAFETY: reads an atomic flag.
    unsafe { ffi::stagehand_hooks_installed() != 0 }
}

/// While alive, sends every tensor autograd saves on this thread to a store. Restores the
/// previous store (or none) when dropped. Not `Send`: it belongs to the thread that made it.
pub struct SavedTensorHooks {
    ctx: *mut c_void,
    prev: *mut c_void,
    _thread_bound: PhantomData<*const ()>,
}

impl std::fmt::Debug for SavedTensorHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedTensorHooks").finish_non_exhaustive()
    }
}

impl SavedTensorHooks {
    /// Turns the hooks on for this thread, sending saved tensors to `store`.
    pub fn enable(store: Arc<dyn SavedTensorStore>) -> Result<SavedTensorHooks> {
        install()?;
        let ctx = Box::into_raw(Box::new(store)) as *mut c_void;
        // SAFETY: `ctx` is a live `Box<Ctx>` until this guard drops it.
        let prev = unsafe { ffi::stagehand_hooks_set_context(ctx) };
        Ok(SavedTensorHooks {
            ctx,
            prev,
            _thread_bound: PhantomData,
        })
    }
}

impl Drop for SavedTensorHooks {
    fn drop(&mut self) {
        // SAFETY: restores the previous context on the thread that set ours, then frees our
        // reference; hooks objects created meanwhile hold their own references.
        unsafe {
            ffi::stagehand_hooks_set_context(self.prev);
            drop(Box::from_raw(self.ctx as *mut Ctx));
        }
    }
}
