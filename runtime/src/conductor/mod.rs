//! Conductor: phases, budgets, PCIe slots and policy hints across the runtimes.
//!
//! The weight runtime streams weights host-to-device, the activation runtime spills saved
//! tensors device-to-host and restores them; both want the same VRAM headroom, pinned host
//! memory and PCIe lanes. The Conductor arbitrates without touching their internals: it
//! tracks phases, answers reservation and transfer-slot requests, and writes limits into
//! knobs each runtime shares with it. It never allocates device or pinned memory and never
//! decides what to prefetch. Every decision is an event on the [`Bus`].
//!
//! # Driving it from the trainer
//!
//! ```
//! use stagehand::conductor::{Conductor, ConductorConfig, Knobs, KnobValues, WeightAdapter};
//! use stagehand::events::Bus;
//!
//! # fn main() -> Result<(), stagehand::conductor::Error> {
//! let config = ConductorConfig::builder().vram_soft_cap_mib(22_000).vram_hard_cap_mib(23_500).build()?;
//! // The real runtime passes the allocator's allocated bytes.
//! let conductor = Conductor::new(config, Bus::disabled(), || 0)?;
//! let knobs = Knobs::new(KnobValues { max_inflight_h2d: 2, max_inflight_d2h: 0, prefetch_window: 3, suppress_speculative: false });
//! conductor.register(WeightAdapter::new(knobs.clone()))?;
//! for step in 0..2 {
//!     conductor.begin_step(step)?;
//!     conductor.enter_forward()?;
//!     // forward: the weight runtime reads knobs.prefetch_window() ...
//!     conductor.enter_backward()?;
//!     conductor.enter_optimizer()?;
//!     assert_eq!(knobs.max_inflight_h2d(), 1, "optimizer protection");
//!     conductor.end_step()?;
//! }
//! conductor.shutdown();
//! assert_eq!(knobs.max_inflight_h2d(), 2, "restored on detach");
//! # Ok(())
//! # }
//! ```
//!
//! The runtimes attach themselves: `WeightRuntime::attach_conductor` and
//! `ActivationRuntime::attach_conductor` register their adapter over the runtime's own knobs
//! and make every copy take a slot, so the trainer only announces phases;
//! `WeightRuntime::attach_conductor` shows the whole loop.
//!
//! With a disabled Conductor ([`Conductor::disabled`], or `enabled: false`) every method
//! returns at once with "proceed" and nothing is allocated; the trainer then tags phases on
//! the bus itself with [`Bus::enter_phase`].
//!
//! # Phases
//!
//! `STEP_BEGIN → FORWARD → BACKWARD → OPTIMIZER → STEP_END`, plus `BACKWARD → FORWARD` (next
//! micro-batch) and `BACKWARD → STEP_END` (an accumulation step without optimizer); any other
//! order is an [`Error::InvalidPhaseTransition`] (also published as a `warning`). At every
//! boundary the Conductor: publishes `phase_changed` (through [`Bus::enter_phase`]), releases
//! the reservations scoped to the phase left, resets the hints at STEP_BEGIN, recomputes the
//! hints, tells every adapter (`on_phase`, then `apply_hints`), and at STEP_END publishes
//! `conductor_step` every `telemetry_interval_steps` steps.
//!
//! # Budgets (`budget`)
//!
//! | mode | meaning |
//! |---|---|
//! | HARD | all or nothing under the soft cap |
//! | SOFT | a partial grant of what is available under the soft cap |
//! | BURST | all or nothing, may pass the soft cap up to the hard cap |
//! | FLOOR | a guaranteed minimum: all or nothing under the soft cap, ignoring the priority reserve |
//! | CEILING | records an upper bound on what the owner may hold of the resource; grants nothing |
//!
//! Available = cap − (measured VRAM use + outstanding grants); pinned memory has only its cap
//! and the grants. Priorities CRITICAL > REQUIRED > SPECULATIVE > BACKGROUND: below CRITICAL
//! each level must leave `priority_reserve_mib` × 1, 2, 3 of headroom for the levels above, so
//! the lowest are denied first (`priority_reserve`). Reservations scoped to a phase are
//! released when the step leaves that phase; others by [`Conductor::release`] or at shutdown.
//! Every request publishes `reservation` (mode, priority, requested and granted bytes,
//! outcome, reason, scope); every release `reservation_released`.
//!
//! # Transfer slots (`transfer`)
//!
//! Separate H2D and D2H pools of `h2d_slots` / `d2h_slots`, lowered by the `max_inflight_*`
//! hints. A runtime calls [`Conductor::acquire_slot`] before each copy and gets a
//! [`SlotToken`] (released on drop, publishing `slot_released`; [`SlotToken::complete`] also
//! records bytes and time) or a [`SlotDenied`] with a typed reason: speculative and
//! background requests are refused while a rule suppresses speculative work
//! (`phase_rule_suppressed_speculative`) or when the pool is full (`h2d_slots_exhausted`,
//! `d2h_slots_exhausted`). **Required and critical copies are never refused**: with the pool
//! full they are granted over the limit, counted in `slot_over_limit_count` and visible as a
//! `slot_granted` whose `inflight` exceeds the slots. The Conductor never blocks the training
//! thread: a wait would be a stall, and the slot awaited could be held by the same thread.
//!
//! # Policy (`policy`)
//!
//! 1. Backward pressure: in BACKWARD with VRAM use > 80% of the soft cap → suppress
//!    speculative work, `prefetch_window_cap = 1`.
//! 2. Optimizer protection: in OPTIMIZER → suppress speculative work, `max_inflight_h2d = 1`.
//! 3. Contention: a slot pool found full on more than 3 consecutive requests →
//!    `prefetch_window_cap` one lower (from the weight runtime's configured window), floor 1.
//!    Checked on each slot request, not only at boundaries.
//!
//! Within a step hints only tighten; STEP_BEGIN resets them. Each change publishes
//! `hints_changed` with the rule that caused it.
//!
//! # Knobs (`adapter`)
//!
//! Each runtime owns its [`Knobs`] (`WeightRuntime::knobs`, `ActivationRuntime::knobs`) and
//! reads them at every decision; the adapter writes them, so a hint takes effect at once.
//!
//! | hint | weight runtime ([`WeightAdapter`]) | activation runtime ([`ActivationAdapter`]) |
//! |---|---|---|
//! | `max_inflight_h2d` | `max_inflight_h2d` (copy engine) | `max_inflight_h2d` (restores) |
//! | `max_inflight_d2h` | — | `max_inflight_d2h` (spills) |
//! | `prefetch_window_cap` | `prefetch_window` | — |
//! | `suppress_speculative` | `prefetch_window = 1`, `suppress_speculative` | `max_inflight_d2h = 0` in OPTIMIZER, `suppress_speculative` |
//!
//! Adapters snapshot the knobs on attach and restore them on detach (and when the last
//! handle to the Conductor is dropped).
//!
//! # Configuration ([`ConductorConfig`])
//!
//! `enabled`, `vram_soft_cap_mib`, `vram_hard_cap_mib`, `pinned_cap_mib`, `h2d_slots`,
//! `d2h_slots`, `telemetry_interval_steps`, `debug_event_trace` (true: every slot grant and
//! release is an event; false: only slot grants over the limit, denials and everything
//! else), `priority_reserve_mib`, `backward_pressure_fraction`, `contention_checks`,
//! `default_prefetch_window`. In a JSON config the MiB fields keep the original's names:
//! `vram_soft_cap_mb`, `vram_hard_cap_mb`, `pinned_cap_mb`, `priority_reserve_mb`.
//!
//! The file is long because of this documentation (the whole policy, in one place a user reads)
//! and the facade whose methods share one lock; budgets, phases, policy rules, adapters and
//! transfers live in the sibling files.

pub(crate) mod adapter;
pub(crate) mod budget;
pub mod config;
pub mod error;
pub(crate) mod phase;
pub(crate) mod policy;
pub(crate) mod copy_slots;

pub use adapter::{ActivationAdapter, KnobValues, Knobs, RuntimeAdapter, WeightAdapter};
pub use budget::{BudgetCounts, BudgetManager, ReservationDecision, ReservationRequest};
pub use config::{ConductorConfig, ConductorConfigBuilder};
pub use error::{Error, Result};
pub use phase::PhaseCoordinator;
pub use policy::{PolicyBridge, PolicyInputs};
pub use copy_slots::{SlotDecision, TransferManager};

use crate::events::model::{
    ConductorStepMetrics, DenyReason, Direction, EventKind, Hints, Owner, Phase, PolicyRule,
    Priority, ReservationId, ReservationOutcome, Resource,
};
use crate::events::Bus;
use std::sync::{Arc, Mutex, MutexGuard};

const MIB_F: f64 = (1u64 << 20) as f64;

/// A refused transfer slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotDenied {
    pub dir: Direction,
    pub reason: DenyReason,
}

impl std::fmt::Display for SlotDenied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} slot denied: {}", self.dir.as_str(), self.reason.as_str())
    }
}

/// Reads the bytes allocated on the device (the allocator statistics; scripted in tests).
type VramReader = Box<dyn Fn() -> u64 + Send + Sync>;

/// The coordinator. Cheap to clone: clones share one state, so the trainer and each runtime
/// can hold one. See the module docs.
#[derive(Clone)]
pub struct Conductor {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for Conductor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            None => f.write_str("Conductor(disabled)"),
            Some(i) => {
                let st = i.lock();
                f.debug_struct("Conductor")
                    .field("step", &st.phase.step())
                    .field("phase", &st.phase.phase())
                    .field("hints", &st.policy.hints())
                    .field("adapters", &st.adapters.len())
                    .finish()
            }
        }
    }
}

struct Inner {
    config: ConductorConfig,
    bus: Bus,
    vram: VramReader,
    state: Mutex<State>,
}

struct State {
    phase: PhaseCoordinator,
    budget: BudgetManager,
    transfer: TransferManager,
    policy: PolicyBridge,
    adapters: Vec<Box<dyn RuntimeAdapter>>,
    /// The VRAM reading of the last boundary or VRAM reservation (rule 1 on a contention
    /// check uses it, so the reader is never called with the lock held).
    last_vram: u64,
    shut_down: bool,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking adapter must not wedge every runtime's copy path.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes `changes`, then pushes the hints in force to every adapter.
    fn push_hints(&self, st: &mut State, changes: Vec<(PolicyRule, Hints)>) {
        for (rule, hints) in changes {
            self.bus.publish(EventKind::HintsChanged { hints, rule });
        }
        let hints = st.policy.hints();
        let phase = st.phase.phase();
        for a in st.adapters.iter_mut() {
            a.apply_hints(&hints, phase);
        }
    }

    /// Gives a transfer slot back; `completed`: the bytes of a copy that finished.
    fn release_slot(&self, dir: Direction, owner: Owner, completed: Option<u64>) {
        let mut st = self.lock();
        if let Some(bytes) = completed {
            st.transfer.record_completion(dir, bytes);
        }
        let inflight = st.transfer.release(dir);
        if self.config.debug_event_trace {
            self.bus.publish(EventKind::SlotReleased {
                dir,
                owner,
                inflight,
            });
        }
    }

    fn metrics(&self, st: &State, vram: u64) -> ConductorStepMetrics {
        let counts = st.budget.counts();
        let t = st.transfer.counts();
        ConductorStepMetrics {
            vram_allocated_mib: vram as f64 / MIB_F,
            vram_headroom_mib: st.budget.headroom(Resource::Vram, vram) as f64 / MIB_F,
            pinned_granted_mib: st.budget.outstanding(Resource::PinnedHost) as f64 / MIB_F,
            h2d_inflight: st.transfer.inflight(Direction::H2d),
            d2h_inflight: st.transfer.inflight(Direction::D2h),
            grant_count: counts.grants,
            deny_count: counts.denials,
            partial_count: counts.partials,
            phase_durations: st.phase.durations(),
            runtime_snapshots: st
                .adapters
                .iter()
                .map(|a| (a.name().to_string(), a.runtime_snapshot()))
                .collect(),
            slot_grant_count: t.grants,
            slot_deny_count: t.denials,
            slot_over_limit_count: t.over_limit_grants,
            h2d_bytes: t.h2d_bytes,
            d2h_bytes: t.d2h_bytes,
        }
    }

    fn detach_all(&self, st: &mut State) {
        for mut a in st.adapters.drain(..) {
            a.detach();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for mut a in st.adapters.drain(..) {
            a.detach();
        }
    }
}

impl Conductor {
    /// A Conductor for `config`, publishing on `bus`, reading live VRAM use from `vram`.
    /// With `enabled: false` this is [`Conductor::disabled`] (and `vram` is dropped).
    pub fn new(
        config: ConductorConfig,
        bus: Bus,
        vram: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Result<Conductor> {
        if !config.enabled {
            return Ok(Conductor::disabled());
        }
        config.validate()?;
        let state = State {
            phase: PhaseCoordinator::new(),
            budget: BudgetManager::new(&config),
            transfer: TransferManager::new(config.h2d_slots, config.d2h_slots),
            policy: PolicyBridge::new(
                config.vram_soft_cap_bytes(),
                config.backward_pressure_fraction,
                config.contention_checks,
                config.default_prefetch_window,
            ),
            adapters: Vec::new(),
            last_vram: 0,
            shut_down: false,
        };
        Ok(Conductor {
            inner: Some(Arc::new(Inner {
                config,
                bus,
                vram: Box::new(vram),
                state: Mutex::new(state),
            })),
        })
    }

    /// A Conductor that allocates nothing and answers "proceed" to everything.
    pub const fn disabled() -> Conductor {
        Conductor { inner: None }
    }

    /// Whether it coordinates anything.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Attaches a runtime's adapter (snapshotting its knobs) and applies the hints in force.
    /// A disabled Conductor drops the adapter untouched.
    pub fn register(&self, adapter: impl RuntimeAdapter + 'static) -> Result<()> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let mut st = inner.lock();
        if st.adapters.iter().any(|a| a.name() == adapter.name()) {
            return Err(Error::DuplicateAdapter(adapter.name().to_string()));
        }
        let mut adapter = adapter;
        adapter.attach();
        if let Some(w) = adapter.configured_prefetch_window() {
            st.policy.set_baseline_window(w);
        }
        let (step, phase, hints) = (st.phase.step(), st.phase.phase(), st.policy.hints());
        adapter.on_phase(step, phase);
        adapter.apply_hints(&hints, phase);
        st.adapters.push(Box::new(adapter));
        Ok(())
    }

    /// Detaches the adapter called `name`, restoring its runtime's knobs. False when there is
    /// none.
    pub fn detach(&self, name: &str) -> bool {
        let Some(inner) = &self.inner else {
            return false;
        };
        let mut st = inner.lock();
        match st.adapters.iter().position(|a| a.name() == name) {
            Some(i) => {
                st.adapters.remove(i).detach();
                true
            }
            None => false,
        }
    }

    fn transition(&self, step: Option<u64>, to: Phase) -> Result<()> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let vram = (inner.vram)();
        let mut st = inner.lock();
        if st.shut_down {
            return Ok(());
        }
        let left = match st.phase.transition(step, to) {
            Ok(left) => left,
            Err(e) => {
                inner.bus.publish_with(|| EventKind::Warning {
                    source: Owner::Conductor,
                    message: e.to_string(),
                });
                return Err(e);
            }
        };
        st.last_vram = vram;
        let step = st.phase.step();
        inner.bus.enter_phase(step, to);
        for (id, bytes) in st.budget.end_phase(left.phase) {
            inner
                .bus
                .publish(EventKind::ReservationReleased { id, bytes });
        }
        let mut changes = Vec::new();
        if to == Phase::StepBegin {
            st.budget.reset_counts();
            st.transfer.reset_counts();
            st.transfer.reset_contention();
            changes.extend(st.policy.reset());
        }
        let inputs = PolicyInputs {
            phase: to,
            vram_used: vram,
            consecutive_full: st.transfer.consecutive_full(),
        };
        let fired = st.policy.evaluate(inputs);
        if fired
            .iter()
            .any(|(r, _)| *r == PolicyRule::Contention)
        {
            st.transfer.reset_contention();
        }
        changes.extend(fired);
        for a in st.adapters.iter_mut() {
            a.on_phase(step, to);
        }
        inner.push_hints(&mut st, changes);
        if to == Phase::StepEnd && step % inner.config.telemetry_interval_steps == 0 {
            let m = inner.metrics(&st, vram);
            inner.bus.publish(EventKind::ConductorStep(m));
        }
        Ok(())
    }

    /// STEP_BEGIN of `step`: hints back to the configured values, per-step counts zeroed.
    pub fn begin_step(&self, step: u64) -> Result<()> {
        self.transition(Some(step), Phase::StepBegin)
    }

    /// FORWARD.
    pub fn enter_forward(&self) -> Result<()> {
        self.transition(None, Phase::Forward)
    }

    /// BACKWARD.
    pub fn enter_backward(&self) -> Result<()> {
        self.transition(None, Phase::Backward)
    }

    /// OPTIMIZER.
    pub fn enter_optimizer(&self) -> Result<()> {
        self.transition(None, Phase::Optimizer)
    }

    /// EVAL: forwards outside a step (evaluation, sampling), between two steps.
    pub fn enter_eval(&self) -> Result<()> {
        self.transition(None, Phase::Eval)
    }

    /// IDLE from inside a step that failed before it updated anything: abandoned, the next step
    /// begins from here.
    pub fn abandon_step(&self) -> Result<()> {
        self.transition(None, Phase::Idle)
    }

    /// STEP_END (publishes the step's metrics every `telemetry_interval_steps`).
    pub fn end_step(&self) -> Result<()> {
        self.transition(None, Phase::StepEnd)
    }

    /// Releases every reservation, detaches every adapter (restoring knobs) and goes idle.
    /// Later phase calls are no-ops, reservations and speculative slots are denied with
    /// `shutdown`, required slots still proceed.
    pub fn shutdown(&self) {
        let Some(inner) = &self.inner else { return };
        let mut st = inner.lock();
        if st.shut_down {
            return;
        }
        st.shut_down = true;
        if st.phase.phase() != Phase::Idle && st.phase.transition(None, Phase::Idle).is_ok() {
            inner.bus.enter_phase(st.phase.step(), Phase::Idle);
        }
        for (id, bytes) in st.budget.release_all() {
            inner
                .bus
                .publish(EventKind::ReservationReleased { id, bytes });
        }
        inner.detach_all(&mut st);
    }

    /// Asks for `req.bytes` of a resource. A disabled Conductor grants everything untracked.
    pub fn reserve(&self, req: ReservationRequest) -> ReservationDecision {
        let Some(inner) = &self.inner else {
            return ReservationDecision::proceed(req.bytes);
        };
        let vram = match req.resource {
            Resource::Vram => Some((inner.vram)()),
            Resource::PinnedHost => None,
        };
        let mut st = inner.lock();
        let decision = if st.shut_down {
            ReservationDecision {
                id: None,
                outcome: ReservationOutcome::Denied,
                granted_bytes: 0,
                reason: Some(DenyReason::Shutdown),
            }
        } else {
            if let Some(v) = vram {
                st.last_vram = v;
            }
            st.budget.request(&req, vram.unwrap_or(0))
        };
        inner.bus.publish(EventKind::Reservation {
            id: decision.id.unwrap_or_default(),
            owner: req.owner,
            resource: req.resource,
            mode: req.mode,
            priority: req.priority,
            requested_bytes: req.bytes,
            granted_bytes: decision.granted_bytes,
            outcome: decision.outcome,
            reason: decision.reason,
            scope: req.scope,
        });
        decision
    }

    /// Ends a reservation; returns the bytes released (0 when it was not held: already
    /// released, ended with its phase, or from a disabled Conductor).
    pub fn release(&self, id: ReservationId) -> u64 {
        let Some(inner) = &self.inner else { return 0 };
        let mut st = inner.lock();
        match st.budget.release(id) {
            Some(bytes) => {
                inner
                    .bus
                    .publish(EventKind::ReservationReleased { id, bytes });
                bytes
            }
            None => 0,
        }
    }

    /// Takes a transfer slot before a copy. CRITICAL and REQUIRED always get one (over the
    /// limit if need be); SPECULATIVE and BACKGROUND may be refused. A disabled Conductor
    /// returns an inert token.
    pub fn acquire_slot(
        &self,
        dir: Direction,
        owner: Owner,
        priority: Priority,
    ) -> std::result::Result<SlotToken, SlotDenied> {
        let Some(inner) = &self.inner else {
            return Ok(SlotToken::inert(dir, owner));
        };
        let speculative = copy_slots::is_speculative(priority);
        let mut st = inner.lock();
        if st.shut_down {
            if speculative {
                return Err(SlotDenied {
                    dir,
                    reason: DenyReason::Shutdown,
                });
            }
            return Ok(SlotToken::inert(dir, owner));
        }
        let hints = st.policy.hints();
        let decision = st
            .transfer
            .acquire(dir, priority, hints.max_inflight(dir), hints.suppress_speculative);
        let consecutive_full = st.transfer.consecutive_full();
        if st.policy.contention_fires(consecutive_full) {
            st.transfer.reset_contention();
            let inputs = PolicyInputs {
                phase: st.phase.phase(),
                vram_used: st.last_vram,
                consecutive_full,
            };
            let changes = st.policy.evaluate(inputs);
            if !changes.is_empty() {
                inner.push_hints(&mut st, changes);
            }
        }
        match decision {
            SlotDecision::Granted {
                inflight,
                over_limit,
            } => {
                if inner.config.debug_event_trace || over_limit {
                    inner.bus.publish(EventKind::SlotGranted {
                        dir,
                        owner,
                        speculative,
                        inflight,
                    });
                }
                Ok(SlotToken {
                    inner: Some(inner.clone()),
                    dir,
                    owner,
                    over_limit,
                })
            }
            SlotDecision::Denied(reason) => {
                inner.bus.publish(EventKind::SlotDenied {
                    dir,
                    owner,
                    speculative,
                    reason,
                });
                Err(SlotDenied { dir, reason })
            }
        }
    }

    /// Whether every transfer slot in `dir` is held now (never when disabled or shut down). A
    /// question only: nothing is counted or published, unlike a refused
    /// [`Conductor::acquire_slot`]. A runtime that reports finished copies late asks it to know
    /// whether reporting them first would free a slot.
    pub fn slots_full(&self, dir: Direction) -> bool {
        let Some(inner) = &self.inner else { return false };
        let st = inner.lock();
        if st.shut_down {
            return false;
        }
        st.transfer.is_full(dir, st.policy.hints().max_inflight(dir))
    }

    /// The hints in force (default when disabled).
    pub fn hints(&self) -> Hints {
        self.inner
            .as_ref()
            .map_or_else(Hints::default, |i| i.lock().policy.hints())
    }

    /// The reservations held now (none when disabled).
    pub fn reservations(&self) -> Vec<crate::events::ReservationHolding> {
        self.inner.as_ref().map_or_else(Vec::new, |i| i.lock().budget.held())
    }

    /// The current step and phase (`(0, Idle)` when disabled).
    pub fn phase(&self) -> (u64, Phase) {
        self.inner.as_ref().map_or((0, Phase::Idle), |i| {
            let st = i.lock();
            (st.phase.step(), st.phase.phase())
        })
    }

    /// The metrics of the step so far, as `conductor_step` would publish them (None when
    /// disabled). Reads VRAM.
    pub fn metrics(&self) -> Option<ConductorStepMetrics> {
        let inner = self.inner.as_ref()?;
        let vram = (inner.vram)();
        let st = inner.lock();
        Some(inner.metrics(&st, vram))
    }
}

/// Permission for one copy. Dropping it gives the slot back (publishing `slot_released`);
/// [`SlotToken::complete`] also records the copy. Tokens from a disabled or shut-down
/// Conductor are inert.
#[must_use = "dropping the token releases the slot at once"]
pub struct SlotToken {
    inner: Option<Arc<Inner>>,
    dir: Direction,
    owner: Owner,
    over_limit: bool,
}

impl std::fmt::Debug for SlotToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotToken")
            .field("dir", &self.dir)
            .field("owner", &self.owner)
            .field("tracked", &self.inner.is_some())
            .field("over_limit", &self.over_limit)
            .finish()
    }
}

impl SlotToken {
    fn inert(dir: Direction, owner: Owner) -> SlotToken {
        SlotToken {
            inner: None,
            dir,
            owner,
            over_limit: false,
        }
    }

    /// The direction of the copy.
    pub fn direction(&self) -> Direction {
        self.dir
    }

    /// Whether the Conductor tracks this slot (false: disabled or shut down).
    pub fn is_tracked(&self) -> bool {
        self.inner.is_some()
    }

    /// Whether a required copy was let through a full pool.
    pub fn is_over_limit(&self) -> bool {
        self.over_limit
    }

    /// Records the finished copy and releases the slot.
    pub fn complete(mut self, bytes: u64) {
        if let Some(inner) = self.inner.take() {
            inner.release_slot(self.dir, self.owner, Some(bytes));
        }
    }
}

impl Drop for SlotToken {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner.release_slot(self.dir, self.owner, None);
        }
    }
}

#[cfg(test)]
mod tests;
