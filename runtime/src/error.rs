//! The crate's error type: one enum, each variant a kind of failure a caller can act on, with
//! the offending value quoted and the underlying error kept as its source.

use crate::events::BlockState;

/// What a saved-tensor store or a weight resolver reports when it cannot do its part, with its
/// sources. The hook engine turns it into the message libtorch raises from the autograd call
/// (the only form that crosses into C++).
pub type HookError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A libtorch call failed. Shown without the C++ stack libtorch appends (addresses in its
    /// libraries, kept in `Debug`).
    #[error("libtorch: {}", without_cpp_stack(&.0.to_string()))]
    Torch(#[from] tch::TchError),
    /// A CUDA driver call failed.
    #[error("cuda: {what}: {source}")]
    Cuda {
        what: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A CUDA operation was asked for on a machine without a usable CUDA device.
    #[error("no CUDA device: {0}")]
    NoCuda(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {field} = {value}: {expected}")]
    Config {
        field: &'static str,
        value: String,
        expected: String,
    },
    /// A residency transition outside the eight valid edges.
    #[error("cannot transition block '{block}' from '{from}' to '{to}'")]
    InvalidTransition {
        block: String,
        from: BlockState,
        to: BlockState,
    },
    /// A block id or name that is not registered.
    #[error("unknown block '{0}'")]
    UnknownBlock(String),
    /// A device budget too small for the model: what does not fit, and the smallest budget the
    /// model trains in (its plan was derived, so following the advice works).
    #[error(
        "budget {budget_bytes} bytes ({:.1} MiB) is too small for this model: {why}; the smallest budget it trains in is {minimum_bytes} bytes ({:.1} MiB): budget_bytes({minimum_bytes})",
        *budget_bytes as f64 / 1048576.0,
        *minimum_bytes as f64 / 1048576.0
    )]
    BudgetTooSmall { budget_bytes: u64, minimum_bytes: u64, why: String },
    /// A request larger than what can ever satisfy it.
    #[error("{what} needs {needed} bytes, but {limit}")]
    TooLarge {
        what: String,
        needed: u64,
        limit: String,
    },
    /// A call made when the object is not in a state that allows it (a step begun twice, a
    /// handle used after its step ended); says what was expected.
    #[error("{what}: {expected}")]
    Misuse { what: String, expected: String },
    /// A pool or runtime was used after shutdown.
    #[error("{0} is shut down")]
    Shutdown(&'static str),
    /// An internal rule of the runtime was broken: a bug, reported rather than hidden.
    #[error("internal error: {0}")]
    Internal(String),
    /// Bytes changed between being written and read back (a spilled activation's checksum).
    #[error("corrupted data: {0}")]
    Corrupt(String),
    /// A safetensors file that frozen blocks stream from changed under the running job
    /// (shortened, rewritten, its bytes no longer those first read): its weights are no longer
    /// the ones the run started with, so the run stops rather than train on others.
    #[error("weights file '{path}' changed under the running job: {change}; file-backed blocks read it at every load, so it must stay as it was for the whole run: restore it and restart from the last checkpoint (to publish new weights, write a new file and rename it over this one: a running job keeps reading the file it opened)")]
    WeightsFileChanged { path: String, change: String },
    /// A spilled activation's bytes changed in host memory between its spill and its restore
    /// (checksums on): the restore is refused rather than hand backward other values.
    #[error("saved tensor {tensor}{} changed in host memory between its spill and its restore: checksum {spilled:08x} at the spill, {found:08x} now; the restore was refused rather than hand backward other values (faulty host memory, or something writing into the pinned pool)", in_region(.region))]
    SpillCorrupted {
        tensor: crate::events::TensorId,
        /// The region it was saved in, if any.
        region: Option<String>,
        spilled: u32,
        found: u32,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A saved-tensor hook or a weight resolver failed (the failing side's error).
    #[error("saved tensor: {0}")]
    Saved(#[source] HookError),
    /// Something attached to the run's hub (a server, an exporter) could not start.
    #[error("{what} could not start: {source}")]
    Attach {
        what: String,
        #[source]
        source: HookError,
    },
    /// The Conductor refused a call (a phase out of order, an adapter registered twice).
    #[error("conductor: {0}")]
    Conductor(#[from] crate::conductor::Error),
    /// A device allocation of the runtime's own did not fit: on the host device, the simulated
    /// VRAM budget is spent (a CUDA device reports its own out-of-memory through libtorch).
    #[error("device out of memory: {what} needs {requested_bytes} bytes but {allocated_bytes} of {budget_bytes} bytes are in use")]
    DeviceFull {
        what: String,
        requested_bytes: u64,
        allocated_bytes: u64,
        budget_bytes: u64,
    },
    /// A step ran out of device memory: what held the device at that moment, what the runtime
    /// was about to do, and the flight record written for it (see
    /// [`OomReport`](crate::oom::OomReport)).
    #[error("{0}")]
    OutOfMemory(Box<crate::oom::OomReport>),
    /// A rank of a data-parallel group failed, which stopped every rank: the rank, its device
    /// and the cause (its error, a panic in the training closure, a collective that did not
    /// complete in time). Every rank's calls return it, so no rank waits for one that is gone.
    #[error("rank {rank} ({device}) failed: {cause}; every rank of the group stopped")]
    RankFailed { rank: usize, device: String, cause: String },
    /// An NCCL call failed, or the library could not be loaded.
    #[error("nccl: {what}: {message}")]
    Nccl { what: String, message: String },
    /// Attaching the telemetry file or the flight recorder failed.
    #[error("telemetry: {0}")]
    Telemetry(#[from] crate::events::telemetry::TelemetryError),
}

/// " in region 'r'" for a message, or nothing.
fn in_region(region: &Option<String>) -> String {
    region.as_deref().map(|r| format!(" in region '{r}'")).unwrap_or_default()
}

impl Error {
    /// A [`Error::Misuse`].
    pub fn misuse(what: impl Into<String>, expected: impl Into<String>) -> Error {
        Error::Misuse {
            what: what.into(),
            expected: expected.into(),
        }
    }

    /// An [`Error::Internal`].
    pub fn internal(what: impl Into<String>) -> Error {
        Error::Internal(what.into())
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// libtorch's message without the C++ stack it appends ("Exception raised from ...", "frame #0:
/// ..."), also where the message arrived quoted in a panic's text (escaped newlines), and
/// without the `unwrap` wording of a panic around it.
pub(crate) fn without_cpp_stack(text: &str) -> String {
    let unwrapped = text.split_once("called `Result::unwrap()` on an `Err` value: Torch(\"").map(|(a, b)| format!("{a}{b}"));
    let text = unwrapped.as_deref().unwrap_or(text);
    let cut = ["\nException raised from", "\\nException raised from", "\nframe #0", "\\nframe #0"]
        .iter()
        .filter_map(|m| text.find(m))
        .min()
        .unwrap_or(text.len());
    text[..cut].trim_end().to_owned()
}

/// The message a panic carried: `panic!` with a literal (`&str`) or with a formatted message
/// (`String`); `None` for any other payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_messages_are_shown_without_their_cpp_stack() {
        let raised = "shape '[16, 64, 3, 4, 32]' is invalid for input of size 399360\nException raised from infer_size_impl at /pytorch/aten/src/ATen/InferSize.h:99 (most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7fad in libc10.so)";
        let e = Error::Torch(tch::TchError::Torch(raised.into()));
        assert_eq!(e.to_string(), "libtorch: Internal torch error: shape '[16, 64, 3, 4, 32]' is invalid for input of size 399360");
        assert!(format!("{e:?}").contains("frame #0"), "Debug keeps the stack");
        // As a panic's text: the error quoted, its newlines escaped.
        let panicked = "called `Result::unwrap()` on an `Err` value: Torch(\"[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes. Error code 12 (Cannot allocate memory)\\nframe #0: c10::ThrowEnforceNotMet(char const*) + 0x6a\")";
        assert_eq!(
            without_cpp_stack(panicked),
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes. Error code 12 (Cannot allocate memory)"
        );
        assert_eq!(without_cpp_stack("a plain message"), "a plain message");
    }
}
