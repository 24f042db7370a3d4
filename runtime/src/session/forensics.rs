//! Out-of-memory forensics: when a step runs out of device memory (libtorch's CUDA
//! out-of-memory, or an allocation of the runtime's own that the budget cannot hold), the handle
//! publishes `out_of_memory` with what held the device at that moment (VRAM by owner, the weight
//! blocks on the device and their states, kept, restored and spilling activations, copies in
//! flight, the Conductor's reservations), the step and phase, and what the runtime was about to
//! do. The flight recorder dumps the last steps around it, and the error returned to the caller
//! (an [`OomReport`]) says the same in words and names the dump.
//!
//! Layers cannot return errors from `forward` (tch panics on a failed op, and so do Stagehand's
//! layers), so an out-of-memory that unwinds out of the forward becomes this error too: a
//! Stagehand layer's arrives as its typed error (`nn::raise`), libtorch's as its message. Any
//! other panic goes on unwinding (a Stagehand layer's with its message).

use super::Stagehand;
use crate::error::Error;
use crate::events::{BlockHolding, BlockState, DeviceHoldings, EventKind, Phase};
use crate::nn::raise::{catching, LayerFailure};
use crate::oom::OomReport;
use regex::Regex;
use std::collections::HashSet;
use std::panic::resume_unwind;
use std::sync::LazyLock;

/// Blocks a report lists at most (largest first); the count of the rest is kept.
const MAX_BLOCKS_REPORTED: usize = 256;

/// What an error says about running out of device memory.
#[derive(Debug, Clone, PartialEq)]
struct Oom {
    requested_bytes: u64,
    /// What was being allocated, when the runtime named it.
    what: Option<String>,
    budget_bytes: Option<u64>,
}

/// The size in libtorch's out-of-memory message, which reaches Rust only as text.
static TRIED: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"(?i)tried to allocate ([0-9.]+) ?(B|bytes|KiB|MiB|GiB|TiB)\b").ok());

/// Reads an out-of-memory from libtorch's text (CUDA, cuBLAS, its CPU allocator), the only form
/// its errors and panics take; the runtime's own arrives typed ([`Error::DeviceFull`]). The CPU
/// allocator's is host memory: the device's own on the host device, and on CUDA a tensor the
/// step made on the host.
fn classify_text(text: &str) -> Option<Oom> {
    let lower = text.to_ascii_lowercase();
    let host = lower.contains("can't allocate memory");
    let oom = host
        || ["out of memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation"]
            .iter()
            .any(|p| lower.contains(p));
    if !oom {
        return None;
    }
    let requested_bytes = TRIED.as_ref().and_then(|r| r.captures(text)).map_or(0, |c| {
        let n: f64 = c[1].parse().unwrap_or(0.0);
        let unit = match &c[2] {
            "KiB" => 1u64 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            _ => 1,
        };
        (n * unit as f64) as u64
    });
    Some(Oom {
        requested_bytes,
        what: host.then(|| crate::oom::HOST_MEMORY.to_owned()),
        budget_bytes: None,
    })
}

fn classify(e: &Error) -> Option<Oom> {
    match e {
        Error::DeviceFull {
            what,
            requested_bytes,
            budget_bytes,
            ..
        } => Some(Oom {
            requested_bytes: *requested_bytes,
            what: Some(what.clone()),
            budget_bytes: Some(*budget_bytes),
        }),
        // A report already, or a refusal that may quote one.
        Error::OutOfMemory(_) | Error::Misuse { .. } => None,
        other => classify_text(&other.to_string()),
    }
}

/// Runs the user's forward; an out-of-memory that unwinds out of it becomes an error: a
/// Stagehand layer's typed one as it is, libtorch's as its text. Any other panic unwinds on.
pub(super) fn catch_oom<T>(forward: impl FnOnce() -> T) -> crate::Result<T> {
    let payload = match catching(forward) {
        Ok(t) => return Ok(t),
        Err(payload) => payload,
    };
    let payload = match payload.downcast::<LayerFailure>() {
        Ok(failure) if classify(&failure.error).is_some() => return Err(failure.error),
        // Not ours to turn into an error: the message the layer panics with outside a step.
        Ok(failure) => panic!("stagehand layer '{}': {}", failure.layer, failure.error),
        Err(payload) => payload,
    };
    match crate::error::panic_message(payload.as_ref()) {
        Some(t) if classify_text(&t).is_some() => Err(Error::Torch(tch::TchError::Torch(t))),
        _ => resume_unwind(payload),
    }
}

impl Stagehand {
    /// Turns an out-of-memory into [`Error::OutOfMemory`] (publishing the report and dumping
    /// the flight recorder); returns any other error as it is.
    pub(super) fn explain_failure(&self, e: Error) -> Error {
        let Some(oom) = classify(&e) else { return e };
        let report = self.report_oom(oom, e.to_string());
        Error::OutOfMemory(Box::new(report))
    }

    fn report_oom(&self, oom: Oom, error: String) -> OomReport {
        let (step, phase) = if self.bus.is_enabled() { self.bus.context() } else { (self.run().step, Phase::Idle) };
        let owners = self.vram_owners();
        let (held, blocks_not_listed) = self.holdings(error, oom.budget_bytes.unwrap_or(self.budget));
        let failed = self.weights().failed_block().and_then(|id| {
            self.weights().blocks().into_iter().find(|b| b.id == id).map(|b| b.name)
        });
        let doing = match (failed, &oom.what) {
            (Some(b), Some(w)) => format!("making block '{b}' resident (allocating {w})"),
            (Some(b), None) => format!("making block '{b}' resident"),
            (None, Some(w)) => format!("allocating {w}"),
            (None, None) => format!("running the {phase}"),
        };
        let before = self.telemetry.as_ref().map_or(0, |t| t.dumps_written());
        self.bus.publish(EventKind::OutOfMemory {
            requested_bytes: oom.requested_bytes,
            owners,
            doing: doing.clone(),
            dump: None,
            held: Some(Box::new(held.clone())),
        });
        // The flight recorder dumps on the dispatcher when it sees the report.
        self.bus.flush();
        let (dump, no_dump) = match &self.telemetry {
            None => (None, Some("no telemetry is attached to this handle (StagehandBuilder::telemetry)".to_owned())),
            Some(t) if !t.recording() => (None, Some("the flight recorder is off (or the event bus is disabled)".to_owned())),
            Some(t) => match t.last_dump() {
                Some(d) if t.dumps_written() > before && d.reason == "out_of_memory" => (Some(d.path), None),
                Some(d) if d.reason == "out_of_memory" => (
                    None,
                    Some(format!(
                        "the recorder writes one out-of-memory record per interval, and wrote {} recently",
                        d.path.display()
                    )),
                ),
                _ => (None, Some("the recorder could not write one (see the warning it published)".to_owned())),
            },
        };
        OomReport {
            step,
            phase,
            requested_bytes: oom.requested_bytes,
            doing,
            owners,
            held,
            blocks_not_listed,
            dump,
            no_dump,
        }
    }

    /// Who holds the device now, in detail.
    fn holdings(&self, error: String, budget_bytes: u64) -> (DeviceHoldings, usize) {
        let w = self.weights();
        let resident: HashSet<usize> = self.plan().map(|p| p.resident_blocks.into_iter().collect()).unwrap_or_default();
        let mut blocks: Vec<BlockHolding> = w
            .blocks()
            .into_iter()
            .enumerate()
            .filter_map(|(i, spec)| {
                let state = w.state(spec.id).ok()?;
                let on_device = matches!(
                    state,
                    BlockState::Prefetching | BlockState::GpuReady | BlockState::Evicting | BlockState::GpuFreeing
                );
                on_device.then(|| BlockHolding {
                    block: spec.id,
                    name: spec.name,
                    state,
                    bytes: spec.bytes as u64,
                    resident: resident.contains(&i),
                })
            })
            .collect();
        blocks.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.block.cmp(&b.block)));
        let not_listed = blocks.len().saturating_sub(MAX_BLOCKS_REPORTED);
        blocks.truncate(MAX_BLOCKS_REPORTED);
        let acts = self.activations().map(|a| a.held_bytes()).unwrap_or_default();
        let (landing, other) = w.copies_in_flight();
        let held = DeviceHoldings {
            error,
            budget_bytes,
            blocks,
            activations_kept_bytes: acts.kept,
            activations_restored_bytes: acts.restored,
            activations_spilling_bytes: acts.spilling,
            weight_copies_in_flight: (landing + other) as u64,
            weight_copies_in_flight_bytes: w.in_flight_bytes(),
            reservations: self.conductor().map(|c| c.reservations()).unwrap_or_default(),
        };
        (held, not_listed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use tch::Tensor;

    #[test]
    fn out_of_memory_texts_are_recognised() {
        let cuda = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total capacity; \
                    78.90 GiB already allocated)";
        assert_eq!(
            classify_text(cuda),
            Some(Oom { requested_bytes: 20 << 20, what: None, budget_bytes: None })
        );
        assert!(classify_text("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)").is_some());
        let ours = Error::DeviceFull {
            what: "a device slab".into(),
            requested_bytes: 4096,
            allocated_bytes: 10,
            budget_bytes: 4097,
        };
        let want = Some(Oom { requested_bytes: 4096, what: Some("a device slab".into()), budget_bytes: Some(4097) });
        assert_eq!(classify(&ours), want);
        assert_eq!(classify_text("shape mismatch: [2, 3] and [4]"), None);
        assert_eq!(classify(&Error::internal("a bug")), None);
    }

    #[test]
    fn a_layers_device_full_arrives_typed() {
        let full = Error::DeviceFull {
            what: "block 'blocks.2' weights".into(),
            requested_bytes: 4352,
            allocated_bytes: 260000,
            budget_bytes: 262144,
        };
        let e = catch_oom(|| crate::nn::raise::raise("blocks.2.fc", full)).expect_err("an error");
        assert!(
            matches!(&e, Error::DeviceFull { what, requested_bytes: 4352, allocated_bytes: 260000, budget_bytes: 262144 } if what == "block 'blocks.2' weights"),
            "{e:?}"
        );
        // A layer's other failures are not the step's to return: they panic with the message.
        let other = catch_unwind(AssertUnwindSafe(|| catch_oom(|| crate::nn::raise::raise("fc", Error::internal("a bug")))));
        let payload = other.expect_err("it panics");
        assert_eq!(payload.downcast_ref::<String>().map(String::as_str), Some("stagehand layer 'fc': internal error: a bug"));
    }

    const BUDGET: u64 = 1 << 20;

    /// A handle on the host device with one 4 x 4 linear block and SGD over it.
    fn one_layer() -> (Stagehand, crate::nn::Linear, crate::optim::Optimizer) {
        let sh = Stagehand::builder()
            .budget_bytes(BUDGET)
            .device(crate::device::Device::host(BUDGET))
            .build()
            .expect("handle");
        let fc = crate::nn::linear(&sh.root() / "blocks" / 0 / "fc", 4, 4, Default::default());
        let opt = sh.optimizer(tch::nn::Sgd::default(), 1e-2).expect("optimizer");
        (sh, fc, opt)
    }

    #[test]
    fn a_layers_device_full_in_a_step_reaches_the_caller_with_its_figures() {
        let (sh, fc, mut opt) = one_layer();
        let err = sh
            .train_step(&mut opt, || {
                use tch::nn::Module;
                let _ = fc.forward(&Tensor::ones([1, 4], tch::kind::FLOAT_CPU));
                crate::nn::raise::raise(
                    "blocks.0.fc",
                    Error::DeviceFull { what: "a scratch buffer".into(), requested_bytes: 4000, allocated_bytes: BUDGET - 10, budget_bytes: BUDGET },
                )
            })
            .expect_err("the step runs out of memory");
        let Error::OutOfMemory(report) = &err else { panic!("not an out-of-memory report: {err:?}") };
        assert_eq!((report.phase, report.requested_bytes), (Phase::Forward, 4000), "{err}");
        assert_eq!(report.doing, "allocating a scratch buffer", "{err}");
        // The typed error's own words, not a panic message wrapped as libtorch's.
        assert!(report.held.error.starts_with("device out of memory: a scratch buffer needs 4000 bytes"), "{}", report.held.error);
    }

    #[test]
    fn host_memory_the_step_cannot_allocate_is_an_out_of_memory_report() {
        let text = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: \
                    you tried to allocate 9830400000 bytes. Error code 12 (Cannot allocate memory)";
        let want = Some(Oom { requested_bytes: 9830400000, what: Some("host memory (libtorch's CPU allocator)".into()), budget_bytes: None });
        assert_eq!(classify_text(text), want);

        // A forward that asks libtorch for more host memory than any machine has (a batch too
        // large, say): the step returns the report instead of the panic unwinding out of it.
        let (sh, fc, mut opt) = one_layer();
        let err = sh
            .train_step(&mut opt, || {
                use tch::nn::Module;
                let y = fc.forward(&Tensor::ones([1, 4], tch::kind::FLOAT_CPU));
                y.sum(tch::Kind::Float) + Tensor::zeros([1i64 << 52], tch::kind::FLOAT_CPU).sum(tch::Kind::Float)
            })
            .expect_err("the step runs out of host memory");
        let Error::OutOfMemory(report) = &err else { panic!("not an out-of-memory report: {err:?}") };
        assert_eq!((report.phase, report.requested_bytes), (Phase::Forward, 4 << 52), "{err}");
        assert_eq!(report.doing, "allocating host memory (libtorch's CPU allocator)", "{err}");
    }

    #[test]
    fn only_out_of_memory_panics_become_errors() {
        let e = catch_oom(|| panic!("CUDA out of memory. Tried to allocate 2.00 GiB")).expect_err("an error");
        assert!(e.to_string().contains("Tried to allocate 2.00 GiB"), "{e}");
        let other = catch_unwind(|| catch_oom(|| panic!("index out of range")));
        assert!(other.is_err(), "other panics unwind on");
        assert!(catch_oom(|| Tensor::from(1.0f32)).is_ok());
    }

}
