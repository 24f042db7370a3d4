//! Raw declarations of the C++ shim (`csrc/shim.cpp`). Only `torch::*` modules use them.

use std::os::raw::{c_char, c_int, c_void};
use torch_sys::C_tensor;

pub(crate) type PackFn =
    unsafe extern "C" fn(*mut c_void, *mut C_tensor, *mut u64, *mut c_char, usize) -> c_int;
pub(crate) type UnpackFn =
    unsafe extern "C" fn(*mut c_void, u64, *mut *mut C_tensor, *mut c_char, usize) -> c_int;
pub(crate) type ReleaseFn = unsafe extern "C" fn(*mut c_void, u64);
pub(crate) type RetainFn = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
pub(crate) type DropFn = unsafe extern "C" fn(*mut c_void);

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct AllocStats {
    pub allocated_current: i64,
    pub allocated_peak: i64,
    pub reserved_current: i64,
    pub reserved_peak: i64,
    pub active_current: i64,
    pub active_peak: i64,
    pub num_ooms: i64,
    pub num_alloc_retries: i64,
}

/// A libtorch optimizer made by the shim (`torch::optim::Optimizer*`).
pub(crate) type COptim = c_void;

/// The options of a new libtorch optimizer (mirrors `StagehandOptimConfig` in the shim).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct OptimConfig {
    /// 0 SGD, 1 Adam, 2 AdamW, 3 RMSprop.
    pub algorithm: c_int,
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub alpha: f64,
    pub nesterov: c_int,
    pub amsgrad: c_int,
    pub centered: c_int,
}

extern "C" {
    pub(crate) fn stagehand_hooks_install(
        pack: PackFn,
        unpack: UnpackFn,
        release: ReleaseFn,
        retain: RetainFn,
        drop: DropFn,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_hooks_installed() -> c_int;
    pub(crate) fn stagehand_hooks_set_context(ctx: *mut c_void) -> *mut c_void;
    pub(crate) fn stagehand_hooks_get_context() -> *mut c_void;
    pub(crate) fn stagehand_unsigned_scalar() -> *mut C_tensor;
    pub(crate) fn stagehand_fused_attention(
        kernel: c_int,
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        causal: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut C_tensor;
    pub(crate) fn stagehand_tensor_identity(
        t: *const C_tensor,
        storage_ptr: *mut u64,
        storage_offset: *mut i64,
        storage_nbytes: *mut u64,
    );
    pub(crate) fn stagehand_cuda_alloc_stats(
        device: c_int,
        out: *mut AllocStats,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_cuda_reset_peak(device: c_int, err: *mut c_char, err_len: usize)
        -> c_int;
    pub(crate) fn stagehand_storage_watch(t: *const C_tensor) -> *mut c_void;
    pub(crate) fn stagehand_storage_alive(w: *const c_void) -> c_int;
    pub(crate) fn stagehand_storage_watch_free(w: *mut c_void);
    pub(crate) fn stagehand_set_grad(
        t: *mut C_tensor,
        grad: *const C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stagehand_fused_adam(
        kind: c_int,
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        amsgrad: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_tensor_impl(t: *const C_tensor) -> *const c_void;
    pub(crate) fn stagehand_tensor_handles(t: *const C_tensor) -> i64;
    pub(crate) fn stagehand_optim_new(c: *const OptimConfig, err: *mut c_char, err_len: usize) -> *mut COptim;
    pub(crate) fn stagehand_optim_free(o: *mut COptim);
    pub(crate) fn stagehand_optim_add(
        o: *mut COptim,
        t: *const C_tensor,
        group: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_optim_groups(o: *mut COptim) -> usize;
    pub(crate) fn stagehand_optim_set_group(
        o: *mut COptim,
        group: usize,
        lr: f64,
        weight_decay: f64,
        momentum: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_optim_step(o: *mut COptim, err: *mut c_char, err_len: usize) -> c_int;
    pub(crate) fn stagehand_optim_zero_grad(o: *mut COptim, err: *mut c_char, err_len: usize) -> c_int;
    pub(crate) fn stagehand_optim_state_get(
        o: *mut COptim,
        p: *const C_tensor,
        present: *mut c_int,
        step: *mut i64,
        out: *mut *mut C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_optim_state_set(
        o: *mut COptim,
        p: *const C_tensor,
        step: i64,
        input: *const *mut C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_cuda_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
    pub(crate) fn stagehand_set_local_intra_op_threads(n: c_int);
    pub(crate) fn stagehand_autocast_get(cuda: c_int, enabled: *mut c_int, dtype: *mut c_int);
    pub(crate) fn stagehand_autocast_set(
        cuda: c_int,
        enabled: c_int,
        dtype: c_int,
        enter: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    pub(crate) fn stagehand_set_tf32(on: c_int);
    pub(crate) fn stagehand_cpu_rng_state(out: *mut u8, cap: usize) -> usize;
    pub(crate) fn stagehand_cpu_rng_set_state(state: *const u8, len: usize, err: *mut c_char, err_len: usize) -> c_int;
    pub(crate) fn stagehand_tf32() -> c_int;
    pub(crate) fn stagehand_cuda_mem_info(
        device: c_int,
        free_bytes: *mut u64,
        total_bytes: *mut u64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// Reads a NUL-terminated message written by the shim.
pub(crate) fn message(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Writes `msg` NUL-terminated into a shim-owned buffer.
///
/// # Safety
/// `buf` must be valid for `len` bytes.
pub(crate) unsafe fn write_message(buf: *mut c_char, len: usize, msg: &str) {
    if buf.is_null() || len == 0 {
        return;
    }
    let n = msg.len().min(len - 1);
    // SAFETY: the caller guarantees `buf` is valid for `len` bytes and n < len.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, buf, n);
        *buf.add(n) = 0;
    }
}
