//! Per-step metrics and measurements events carry: the runtimes' step aggregates, where a step's
//! time went, copies by direction, VRAM by owner.

use serde::{Deserialize, Serialize};

/// Weight runtime metrics of one step. Field names match the original Python Stagehand's
/// `StepMetrics`, so that its users' tools read our files: in JSON its MiB values keep the
/// original's `_mb` names, which the Rust fields spell `_mib`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct WeightStepMetrics {
    /// Bytes the weight runtime copied to the device: its loads, and the gradient sums it brought
    /// back for accumulation (`grad_sum_h2d_bytes` of them). Every copy is a `transfer_completed`
    /// of the weights, so a step's detail events and this figure agree.
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub evictions: u64,
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// prefetch_hits / (hits + misses), 0 when there were none.
    pub hit_rate: f64,
    #[serde(rename = "vram_used_mb")]
    pub vram_used_mib: f64,
    #[serde(rename = "vram_reserved_mb")]
    pub vram_reserved_mib: f64,
    pub host_pool_free: u32,
    pub host_pool_in_use: u32,
    /// Milliseconds the compute stream waited for weight copies still landing (GPU-measured).
    #[serde(default)]
    pub h2d_wait_ms: f64,
    /// Milliseconds the compute stream sat idle while the training thread waited for the host
    /// optimizer to finish a block it needed (GPU-measured; on the host device, the waits).
    #[serde(default)]
    pub update_wait_ms: f64,
    /// Bytes a scheduler that knew the whole step in advance would have had to copy in (the
    /// Belady minimum for the step's itinerary and room), to compare with the loads
    /// ([`WeightStepMetrics::load_bytes`]).
    #[serde(default)]
    pub min_h2d_bytes: u64,
    /// Milliseconds the training thread spent in the weight runtime's hooks (block entry and
    /// exit, backward uses), less its waits for the host optimizer: what streaming costs the
    /// thread that queues the kernels.
    #[serde(default)]
    pub host_ms: f64,
    /// Measured on request (the handle's `measure_hook_gpu_time`): milliseconds of the compute
    /// stream between the hooks' entries and exits, that is the GPU idling while the training
    /// thread is in the hooks with nothing queued, plus what the hooks themselves queue there
    /// (waits for weight copies, dequantization, gradient sums on the device). A hook's span is
    /// counted in the first step whose end finds the stream past it. Absent when not measured.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub hook_gpu_ms: f64,
    /// Each model's share, when the runtime streams the blocks of several models (a handle with
    /// a teacher or a reference model beside the trained one); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<super::ModelWeightStep>,
    /// A data-parallel rank: milliseconds its gradient reductions (the collectives that
    /// completed in the step) ran on the device, and the bytes they reduced. Absent elsewhere.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub collective_ms: f64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub collective_bytes: u64,
    /// Gradient accumulation (micro-batches): bytes of gradient sums so far copied back to the
    /// device, to be added to a later micro-batch's gradients there; part of `h2d_bytes`. Absent
    /// when nothing accumulated.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub grad_sum_h2d_bytes: u64,
    /// Gradient accumulation on the host: bytes of later gradients added into their sums there
    /// (they crossed the link once, in `d2h_bytes`), and the milliseconds the adds took on their
    /// worker thread, beside the training thread. Absent when nothing accumulated on the host.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub grad_sum_host_bytes: u64,
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub grad_sum_host_ms: f64,
    /// Streamed blocks the host optimizer was given to step, and how many of them it was given
    /// while backward still ran (each as backward left its block, overlapping the rest of it);
    /// the others were given at the optimizer's call, after backward. Absent when none.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub host_steps: u64,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub host_steps_overlapped: u64,
}

impl WeightStepMetrics {
    /// Bytes of weight loads: `h2d_bytes` less the gradient sums.
    pub fn load_bytes(&self) -> u64 {
        self.h2d_bytes.saturating_sub(self.grad_sum_h2d_bytes)
    }

    /// Of `host_steps`, those given while backward ran: never more than were stepped, whatever
    /// a file from elsewhere claims.
    pub fn host_steps_during_backward(&self) -> u64 {
        self.host_steps_overlapped.min(self.host_steps)
    }

    /// Counts `bytes` of gradient sums brought back to the device.
    pub fn count_grad_sums(&mut self, bytes: u64) {
        self.h2d_bytes = self.h2d_bytes.saturating_add(bytes);
        self.grad_sum_h2d_bytes = self.grad_sum_h2d_bytes.saturating_add(bytes);
    }
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// What one evaluation did: the forwards a weight runtime ran outside training steps, between
/// two steps (an evaluation pass, sampling, inference through the handle), published when it
/// ends (the next step begins, the run finishes). It is never a training step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct EvaluationMetrics {
    /// Blocks entered (each use a prefetch hit or a miss).
    pub block_uses: u64,
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    pub stall_time_ms: f64,
    pub h2d_bytes: u64,
    pub evictions: u64,
    /// Milliseconds the compute stream waited for weight copies still landing.
    pub h2d_wait_ms: f64,
    /// Wall time from the first forward to the evaluation's end.
    pub duration_ms: f64,
}

/// Activation runtime metrics of one step (field names kept from the original, as above).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ActivationStepMetrics {
    pub activations_saved: u64,
    pub activations_kept: u64,
    pub activations_spilled: u64,
    pub activations_restored: u64,
    /// Restores issued ahead of need by the predictive restorer.
    pub activations_predicted: u64,
    pub weight_handles: u64,
    pub spill_bytes: u64,
    pub restore_bytes: u64,
    pub stall_time_ms: f64,
    pub stall_count: u64,
    pub pool_hits: u64,
    pub pool_misses: u64,
    #[serde(rename = "vram_peak_mb")]
    pub vram_peak_mib: f64,
    /// Milliseconds the compute stream waited for restores still landing (GPU-measured).
    #[serde(default)]
    pub h2d_wait_ms: f64,
    /// Milliseconds the compute stream sat idle while the training thread waited for spills to
    /// land (over the in-flight caps, a tensor backward needed, the step's end); GPU-measured,
    /// on the host device the waits themselves.
    #[serde(default)]
    pub d2h_wait_ms: f64,
    /// Bytes spilled through pageable memory because no pinned slab was free.
    #[serde(default)]
    pub pageable_bytes: u64,
    /// Milliseconds the training thread spent in the saved-tensor hooks (pack, unpack,
    /// release), less their waits for spills to land and the work done in them for others: the
    /// recomputation of checkpointed scopes (`recompute_ms`) and the weight runtime's backward
    /// uses (in the weights' `host_ms`). What the activation runtime itself costs the thread.
    #[serde(default)]
    pub host_ms: f64,
    /// Saved tensors not stored because a recompute scope computes them again in backward.
    #[serde(default)]
    pub activations_recomputed: u64,
    /// Their bytes: what neither stays on the device nor crosses PCIe.
    #[serde(default)]
    pub recompute_bytes: u64,
    /// Milliseconds of host time spent recomputing in backward: the scopes' forward run again
    /// inside an unpack, queueing kernels that run on the compute stream (not in `host_ms`).
    #[serde(default)]
    pub recompute_ms: f64,
    /// Recompute scopes computed again in backward (each once, at its first unpack).
    #[serde(default)]
    pub scopes_recomputed: u64,
    /// Of them, those stopped at their last saved tensor: what their function computes after
    /// it (a block's last matmul, its residual) is not run again.
    #[serde(default)]
    pub scopes_stopped_early: u64,
    /// Milliseconds spent pinning host memory for spills: buffers pinned on the spot for spills
    /// no slab took, and a pool sized from the trace (the first step's cost of sizing it).
    #[serde(default)]
    pub pin_ms: f64,
}

/// Conductor metrics of one step (field names kept from the original, as above).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ConductorStepMetrics {
    #[serde(rename = "vram_allocated_mb")]
    pub vram_allocated_mib: f64,
    #[serde(rename = "vram_headroom_mb")]
    pub vram_headroom_mib: f64,
    #[serde(rename = "pinned_granted_mb")]
    pub pinned_granted_mib: f64,
    pub h2d_inflight: u32,
    pub d2h_inflight: u32,
    pub grant_count: u64,
    pub deny_count: u64,
    pub partial_count: u64,
    /// Seconds spent in each phase of the step.
    pub phase_durations: PhaseDurations,
    /// Each attached runtime's knobs at the end of the step, by adapter name
    /// (`stagehand: {max_inflight, prefetch_window}`, `activation_stagehand: {max_d2h, max_h2d}`).
    #[serde(default)]
    pub runtime_snapshots: std::collections::BTreeMap<String, serde_json::Value>,
    /// Transfer slots granted in the step (over-limit grants included).
    #[serde(default)]
    pub slot_grant_count: u64,
    /// Transfer slots refused in the step.
    #[serde(default)]
    pub slot_deny_count: u64,
    /// Required copies let through a full slot pool in the step.
    #[serde(default)]
    pub slot_over_limit_count: u64,
    /// Bytes reported by completed H2D slot tokens in the step.
    #[serde(default)]
    pub h2d_bytes: u64,
    /// Bytes reported by completed D2H slot tokens in the step.
    #[serde(default)]
    pub d2h_bytes: u64,
}

/// Seconds spent in each phase of one step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct PhaseDurations {
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
}

/// What the trainer reports at the end of each step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TrainStepMetrics {
    pub loss: f64,
    /// Wall time of the whole step in seconds.
    pub step_time_s: f64,
    /// Tokens (or samples) processed in the step.
    pub tokens: u64,
    /// Peak bytes allocated on the device during the step.
    pub vram_peak_bytes: u64,
    /// The loss scale the step's backward used (fp16's dynamic loss scaling; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The step's update was skipped: an infinite or NaN gradient under fp16 loss scaling.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

/// Where one step's wall time went. The parts `compute_ms` .. `other_ms` add up to `step_ms`.
///
/// The compute stream's waits are measured on the GPU: before the compute stream is made to wait
/// on a copy, a timed event is recorded on it, and the time from that event to the copy's own
/// completion event is how long the compute stream sat idle for the copy (0 when the copy had
/// landed first). On the host device copies are synchronous and those waits are host stalls.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct StepTimeBreakdown {
    /// Wall time of the whole step.
    pub step_ms: f64,
    /// Forward and backward time not spent in any of the waits below.
    pub compute_ms: f64,
    /// The compute stream waiting on host-to-device copies (weights, restores) still landing.
    pub h2d_wait_ms: f64,
    /// The compute stream (or the host) waiting on device-to-host copies (spills, gradients).
    pub d2h_wait_ms: f64,
    /// The host blocked loading weight blocks that were not prefetched (misses).
    pub weight_stall_ms: f64,
    /// The host blocked restoring spilled activations on demand.
    pub restore_stall_ms: f64,
    /// The optimizer phase (host and device optimizer steps).
    pub optimizer_ms: f64,
    /// Everything else (step set-up, loss read-back, telemetry).
    pub other_ms: f64,
}

/// Copies of one direction in one step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct CopyStats {
    /// Copies completed.
    pub count: u64,
    pub bytes: u64,
    /// Bytes of the copies that were not timed (see `TransferCompleted`): `bytes` less these
    /// over `busy_ms` is the measured rate.
    #[serde(default)]
    pub untimed_bytes: u64,
    /// Sum of the timed copies' durations.
    pub busy_ms: f64,
    /// Throughput of the step's last timed copy, GB/s (0 when none was timed).
    pub last_gbps: f64,
}

impl CopyStats {
    /// Whether nothing was counted (a direction a run never used).
    pub fn is_none(&self) -> bool {
        self.count == 0 && self.bytes == 0
    }
}

/// GB/s of `bytes` copied in `duration_ms`, when that is a measured time (finite, above 0): the
/// one rate formula for a timed copy and for the timed copies of a step or a run.
pub fn copy_gbps(bytes: u64, duration_ms: Option<f64>) -> Option<f64> {
    duration_ms.filter(|ms| ms.is_finite() && *ms > 0.0).map(|ms| bytes as f64 / (ms * 1e6))
}

/// Copies of one step, both directions ([`EventKind::TransferStep`](super::EventKind::TransferStep)).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct TransferStepMetrics {
    pub h2d: CopyStats,
    pub d2h: CopyStats,
    /// Collectives between the devices of a data-parallel group (absent from older files and
    /// single-device runs).
    #[serde(default, skip_serializing_if = "CopyStats::is_none")]
    pub collective: CopyStats,
}

/// Device memory by owner at one moment. `other_bytes` is what the allocator holds beyond the
/// runtimes' own figures (the model's unmanaged tensors, workspaces, gradients, fragmentation).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct VramByOwner {
    pub allocated_bytes: u64,
    /// Resident weight blocks (ready or being evicted).
    pub weights_bytes: u64,
    /// Saved activations kept on the device.
    pub activations_kept_bytes: u64,
    /// Spilled activations brought back and waiting for backward.
    pub activations_restored_bytes: u64,
    /// Destinations of copies still in flight (weights landing, restores landing, spills leaving).
    pub copies_in_flight_bytes: u64,
    pub other_bytes: u64,
}

impl VramByOwner {
    /// Fills `other_bytes` from `allocated_bytes` and the owned parts.
    pub fn with_other(mut self) -> VramByOwner {
        // Saturating: the parts come from readers of hostile files too.
        let owned = self
            .weights_bytes
            .saturating_add(self.activations_kept_bytes)
            .saturating_add(self.activations_restored_bytes)
            .saturating_add(self.copies_in_flight_bytes);
        self.other_bytes = self.allocated_bytes.saturating_sub(owned);
        self
    }
}

