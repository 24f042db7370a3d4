//! Start-up: make libtorch's CUDA backend visible to tch.
//!
//! rustc links with `--as-needed`, which drops `libtorch_cuda.so` because no Rust symbol uses
//! it, so tch would see no CUDA. Loading it with `RTLD_GLOBAL` at start-up registers the CUDA
//! backend; on a machine without CUDA the load fails cleanly and everything runs on the host.

use std::ffi::{CStr, CString};
use std::sync::OnceLock;

static CUDA_LOADED: OnceLock<Result<(), String>> = OnceLock::new();

/// Loads libtorch's CUDA backend if it is present and installs the saved-tensor hook engine.
/// Idempotent and cheap after the first call; every runtime constructor calls it. Returns
/// whether CUDA is usable.
///
/// The hook engine itself becomes libtorch's default engine while the binary loads (libtorch
/// starts the autograd engine's device threads once per process, so it must be the default
/// before the first backward); this registers the Rust callbacks it calls.
pub fn init() -> bool {
    let _ = CUDA_LOADED.get_or_init(load_torch_cuda);
    if let Err(e) = super::hooks::install() {
        eprintln!("stagehand: {e}");
    }
    cuda_available()
}

/// Whether tch sees a CUDA device (after [`init`]).
pub fn cuda_available() -> bool {
    CUDA_LOADED.get().is_some_and(|r| r.is_ok()) && tch::Cuda::is_available()
}

/// Why CUDA could not be loaded, if it could not.
pub fn cuda_load_error() -> Option<String> {
    CUDA_LOADED.get().and_then(|r| r.as_ref().err().cloned())
}

fn dlopen_global(path: &CStr) -> Result<(), String> {
    // SAFETY: dlopen with a valid NUL-terminated path; the handle is intentionally kept open
    // for the life of the process (the backend registers itself on load).
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local message or null.
        let msg = unsafe { libc::dlerror() };
        let msg = if msg.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            // SAFETY: non-null dlerror strings are NUL-terminated.
            unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
        };
        return Err(msg);
    }
    Ok(())
}

/// The folder of the loaded libtorch_cpu, found through a symbol it defines.
fn libtorch_dir() -> Option<std::path::PathBuf> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let sym = torch_sys::at_new_tensor as *const libc::c_void;
    // SAFETY: dladdr only reads the address; `info` is a valid out-parameter.
    let ok = unsafe { libc::dladdr(sym, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    std::path::Path::new(&path).parent().map(|p| p.to_path_buf())
}

fn load_torch_cuda() -> Result<(), String> {
    let by_name = CString::new("libtorch_cuda.so").expect("literal has no NUL");
    match dlopen_global(&by_name) {
        Ok(()) => Ok(()),
        Err(first) => {
            let Some(dir) = libtorch_dir() else {
                return Err(first);
            };
            let full = dir.join("libtorch_cuda.so");
            let c = CString::new(full.to_string_lossy().as_bytes())
                .map_err(|e| e.to_string())?;
            dlopen_global(&c).map_err(|second| format!("{first}; {second}"))
        }
    }
}
