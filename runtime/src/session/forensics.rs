//! Out-of-memory forensics: when a step runs out of device memory (libtorch's CUDA
//! out-of-memory, or an allocation of the runtime's own that the budget cannot hold), the handle
//! publishes `out_of_memory` with what held the device at that moment (VRAM by owner, the weight
//! blocks on the device and their states, kept, restored and spilling activations, copies in
//! flight, the Conductor's reservations), the step and phase, and what the runtime was about to
//! do. The flight recorder dumps the last steps around it, and the error returned to the caller
//! says the same in words and names the dump.
//!
//! Layers cannot return errors from `forward` (tch panics on a failed op, and so do Stagehand's
//! layers), so a panic in the forward whose message is an out-of-memory becomes this error too;
//! any other panic goes on unwinding unchanged.

use super::Stagehand;
use crate::error::Error;
use crate::events::{BlockHolding, BlockState, DeviceHoldings, EventKind, Phase, VramByOwner};
use regex::Regex;
use std::collections::HashSet;
use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::LazyLock;

/// Blocks a report lists at most (largest first); the count of the rest is kept.
const MAX_BLOCKS_REPORTED: usize = 256;
/// Blocks the message names (the report holds the rest).
const BLOCKS_NAMED: usize = 6;

/// Why a step ran out of device memory, and what held the device then.
#[derive(Debug, Clone, PartialEq)]
pub struct OomReport {
    pub step: u64,
    pub phase: Phase,
    /// Bytes the failed allocation asked for (0 when the allocator did not say).
    pub requested_bytes: u64,
    /// What the runtime was about to do ("making block 'blocks.3' resident: ...").
    pub doing: String,
    pub owners: VramByOwner,
    pub held: DeviceHoldings,
    /// Blocks on the device beyond those listed in `held.blocks`.
    pub blocks_not_listed: usize,
    /// The flight record written for it.
    pub dump: Option<PathBuf>,
    /// Why there is no flight record, when there is none.
    pub no_dump: Option<String>,
}

/// What an error says about running out of device memory.
#[derive(Debug, Clone, PartialEq)]
struct Oom {
    requested_bytes: u64,
    /// What was being allocated, when the runtime named it.
    what: Option<String>,
    budget_bytes: Option<u64>,
}

static OURS: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r"device out of memory: (.+?) needs (\d+) bytes but (\d+) of (\d+) bytes are in use").ok()
});
static TRIED: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"(?i)tried to allocate ([0-9.]+) ?(B|bytes|KiB|MiB|GiB|TiB)\b").ok());

/// Reads an out-of-memory from an error's or a panic's text: the runtime's own
/// ([`Error::DeviceFull`]'s message) or libtorch's (CUDA, cuBLAS).
fn classify_text(text: &str) -> Option<Oom> {
    if let Some(c) = OURS.as_ref().and_then(|r| r.captures(text)) {
        return Some(Oom {
            requested_bytes: c[2].parse().unwrap_or(0),
            what: Some(c[1].to_owned()),
            budget_bytes: c[4].parse().ok(),
        });
    }
    let lower = text.to_ascii_lowercase();
    let oom = ["out of memory", "cublas_status_alloc_failed", "cudaerrormemoryallocation"]
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
        what: None,
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
        Error::OutOfMemory(_) => None,
        other => classify_text(&other.to_string()),
    }
}

/// Runs the user's forward; a panic that reports an out-of-memory becomes an error (any other
/// panic unwinds on).
pub(super) fn catch_oom<T>(forward: impl FnOnce() -> T) -> crate::Result<T> {
    match catch_unwind(AssertUnwindSafe(forward)) {
        Ok(t) => Ok(t),
        Err(payload) => {
            let text = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()));
            match text {
                Some(t) if classify_text(&t).is_some() => Err(Error::Torch(tch::TchError::Torch(t))),
                _ => resume_unwind(payload),
            }
        }
    }
}

/// `1.5 MiB`, `512 B`: the same units as the dashboards' findings.
fn bytes(b: u64) -> String {
    crate::events::insight::human_bytes(b)
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.owners;
        let h = &self.held;
        write!(f, "out of device memory in the {} of step {} while {}", self.phase, self.step, self.doing)?;
        if self.requested_bytes > 0 {
            write!(f, " ({} requested)", bytes(self.requested_bytes))?;
        }
        write!(f, ". The device held {}", bytes(o.allocated_bytes))?;
        if h.budget_bytes > 0 {
            write!(f, " of a {} budget", bytes(h.budget_bytes))?;
        }
        let on_device = h.blocks.len() + self.blocks_not_listed;
        let resident = h.blocks.iter().filter(|b| b.resident).count();
        write!(
            f,
            ": weights {} in {on_device} blocks ({resident} resident, {} streamed)",
            bytes(o.weights_bytes),
            on_device - resident
        )?;
        if !h.blocks.is_empty() {
            let named: Vec<String> = h
                .blocks
                .iter()
                .take(BLOCKS_NAMED)
                .map(|b| format!("{} {} {}", b.name, b.state, bytes(b.bytes)))
                .collect();
            let more = on_device.saturating_sub(named.len());
            write!(f, " [{}{}]", named.join(", "), if more > 0 { format!(" and {more} more") } else { String::new() })?;
        }
        write!(
            f,
            ", activations kept {}, restored {}, spilling {}, weight copies in flight {} ({}), other {}",
            bytes(h.activations_kept_bytes),
            bytes(h.activations_restored_bytes),
            bytes(h.activations_spilling_bytes),
            h.weight_copies_in_flight,
            bytes(h.weight_copies_in_flight_bytes),
            bytes(o.other_bytes)
        )?;
        let reserved: u64 = h.reservations.iter().map(|r| r.bytes).sum();
        write!(f, "; {} Conductor reservations hold {}", h.reservations.len(), bytes(reserved))?;
        match (&self.dump, &self.no_dump) {
            (Some(p), _) => write!(f, ". Flight record: {}", p.display())?,
            (None, Some(why)) => write!(f, ". No flight record: {why}")?,
            (None, None) => {}
        }
        write!(f, ". The allocator said: {}", h.error)
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
        // Through a layer's panic message, the same figures.
        assert_eq!(classify_text(&format!("stagehand layer 3: {ours}")), want);
        assert_eq!(classify_text("shape mismatch: [2, 3] and [4]"), None);
        assert_eq!(classify(&Error::internal("a bug")), None);
    }

    #[test]
    fn only_out_of_memory_panics_become_errors() {
        let e = catch_oom(|| panic!("CUDA out of memory. Tried to allocate 2.00 GiB")).expect_err("an error");
        assert!(e.to_string().contains("Tried to allocate 2.00 GiB"), "{e}");
        let other = catch_unwind(|| catch_oom(|| panic!("index out of range")));
        assert!(other.is_err(), "other panics unwind on");
        assert!(catch_oom(|| Tensor::from(1.0f32)).is_ok());
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(bytes(1536), "1.5 KiB");
    }
}
