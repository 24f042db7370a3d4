//! Knobs and the adapters that write them.
//!
//! A runtime owns an `Arc<Knobs>`, reads it on its hot path with relaxed loads, and hands a
//! clone to its adapter. The adapter snapshots the values on attach (they are the runtime's
//! configured values), writes hint-limited values at every phase boundary, and restores the
//! snapshot on detach. Hints only ever lower a knob below its configured value.
//!
//! | hint | [`WeightAdapter`] | [`ActivationAdapter`] |
//! |---|---|---|
//! | `max_inflight_h2d` | `max_inflight_h2d` (engine `max_inflight`) | `max_inflight_h2d` (restores) |
//! | `max_inflight_d2h` | — | `max_inflight_d2h` (spills) |
//! | `prefetch_window_cap` | `prefetch_window` | — |
//! | `suppress_speculative` | `prefetch_window = 1`, `suppress_speculative` | `max_inflight_d2h = 0` in OPTIMIZER, `suppress_speculative` |

use crate::events::model::{Hints, Owner, Phase};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

/// The values of a [`Knobs`], as plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct KnobValues {
    /// Host-to-device copies a runtime may have in flight.
    pub max_inflight_h2d: u32,
    /// Device-to-host copies a runtime may have in flight (0: start none, keep on device).
    pub max_inflight_d2h: u32,
    /// Blocks (or groups) a runtime may fetch ahead of need.
    pub prefetch_window: u32,
    /// Do no speculative work (prefetch beyond the next need, predictive restore).
    pub suppress_speculative: bool,
}

/// Tunables a runtime shares with the Conductor. Every field is an atomic: the runtime reads
/// on the training thread and the autograd worker, the adapter writes at phase boundaries.
#[derive(Debug, Default)]
pub struct Knobs {
    max_inflight_h2d: AtomicU32,
    max_inflight_d2h: AtomicU32,
    prefetch_window: AtomicU32,
    suppress_speculative: AtomicBool,
}

impl Knobs {
    /// Knobs at the runtime's configured values, ready to share.
    pub fn new(values: KnobValues) -> Arc<Knobs> {
        let k = Knobs::default();
        k.store(values);
        Arc::new(k)
    }

    /// Current `max_inflight_h2d`.
    #[inline]
    pub fn max_inflight_h2d(&self) -> u32 {
        self.max_inflight_h2d.load(Ordering::Relaxed)
    }

    /// Current `max_inflight_d2h`.
    #[inline]
    pub fn max_inflight_d2h(&self) -> u32 {
        self.max_inflight_d2h.load(Ordering::Relaxed)
    }

    /// Current `prefetch_window`.
    #[inline]
    pub fn prefetch_window(&self) -> u32 {
        self.prefetch_window.load(Ordering::Relaxed)
    }

    /// Whether speculative work is suppressed.
    #[inline]
    pub fn suppress_speculative(&self) -> bool {
        self.suppress_speculative.load(Ordering::Relaxed)
    }

    /// Sets `max_inflight_h2d`.
    pub fn set_max_inflight_h2d(&self, v: u32) {
        self.max_inflight_h2d.store(v, Ordering::Relaxed);
    }

    /// Sets `max_inflight_d2h`.
    pub fn set_max_inflight_d2h(&self, v: u32) {
        self.max_inflight_d2h.store(v, Ordering::Relaxed);
    }

    /// Sets `prefetch_window`.
    pub fn set_prefetch_window(&self, v: u32) {
        self.prefetch_window.store(v, Ordering::Relaxed);
    }

    /// Sets `suppress_speculative`.
    pub fn set_suppress_speculative(&self, v: bool) {
        self.suppress_speculative.store(v, Ordering::Relaxed);
    }

    /// All values at once (each read separately; fine for snapshots).
    pub fn load(&self) -> KnobValues {
        KnobValues {
            max_inflight_h2d: self.max_inflight_h2d(),
            max_inflight_d2h: self.max_inflight_d2h(),
            prefetch_window: self.prefetch_window(),
            suppress_speculative: self.suppress_speculative(),
        }
    }

    /// Writes all values.
    pub fn store(&self, v: KnobValues) {
        self.set_max_inflight_h2d(v.max_inflight_h2d);
        self.set_max_inflight_d2h(v.max_inflight_d2h);
        self.set_prefetch_window(v.prefetch_window);
        self.set_suppress_speculative(v.suppress_speculative);
    }
}

/// What the Conductor needs from a runtime. Adapters are called with the Conductor's lock
/// held, so they must only write knobs and never call back into the Conductor.
pub trait RuntimeAdapter: Send {
    /// The key in `runtime_snapshots` ("stagehand", "activation_stagehand").
    fn name(&self) -> &'static str;
    /// The runtime this adapter speaks for.
    fn owner(&self) -> Owner;
    /// Snapshots the runtime's configured values.
    fn attach(&mut self);
    /// A phase boundary (called before [`RuntimeAdapter::apply_hints`]).
    fn on_phase(&mut self, step: u64, phase: Phase);
    /// Translates the hints in force into knob writes.
    fn apply_hints(&mut self, hints: &Hints, phase: Phase);
    /// Restores the values snapshotted on attach.
    fn detach(&mut self);
    /// The runtime's knobs now, for the per-step metrics.
    fn runtime_snapshot(&self) -> serde_json::Value;
    /// The prefetch window the runtime was configured with, if it has one (rule 3 shrinks
    /// from it).
    fn configured_prefetch_window(&self) -> Option<u32> {
        None
    }
}

/// `configured` lowered to `hint` when there is one.
fn capped(configured: u32, hint: Option<u32>) -> u32 {
    hint.map_or(configured, |h| configured.min(h))
}

/// A runtime's knobs with the values they had when an adapter attached, so the adapter can
/// compute hints against the configured values and restore them on detach.
#[derive(Debug)]
struct SavedKnobs {
    knobs: Arc<Knobs>,
    original: Option<KnobValues>,
}

impl SavedKnobs {
    fn new(knobs: Arc<Knobs>) -> SavedKnobs {
        SavedKnobs {
            knobs,
            original: None,
        }
    }

    /// Remembers the current values as the configured ones.
    fn attach(&mut self) {
        self.original = Some(self.knobs.load());
    }

    /// The configured values (remembered now if not yet).
    fn original(&mut self) -> KnobValues {
        *self.original.get_or_insert_with(|| self.knobs.load())
    }

    /// The configured values, if remembered.
    fn saved(&self) -> Option<KnobValues> {
        self.original
    }

    /// Puts the configured values back.
    fn detach(&mut self) {
        if let Some(o) = self.original.take() {
            self.knobs.store(o);
        }
    }
}

impl std::ops::Deref for SavedKnobs {
    type Target = Knobs;
    fn deref(&self) -> &Knobs {
        &self.knobs
    }
}

/// Tunes the weight runtime: copy engine inflight and prefetch window.
#[derive(Debug)]
pub struct WeightAdapter {
    knobs: SavedKnobs,
}

impl WeightAdapter {
    /// The adapter's name, its key in `runtime_snapshots`.
    pub const NAME: &'static str = "stagehand";

    /// An adapter over the weight runtime's knobs.
    pub fn new(knobs: Arc<Knobs>) -> WeightAdapter {
        WeightAdapter {
            knobs: SavedKnobs::new(knobs),
        }
    }
}

impl RuntimeAdapter for WeightAdapter {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn owner(&self) -> Owner {
        Owner::Weights
    }

    fn attach(&mut self) {
        self.knobs.attach();
    }

    fn on_phase(&mut self, _step: u64, _phase: Phase) {}

    fn apply_hints(&mut self, hints: &Hints, _phase: Phase) {
        let o = self.knobs.original();
        let mut window = capped(o.prefetch_window, hints.prefetch_window_cap);
        if hints.suppress_speculative {
            window = window.min(1);
        }
        self.knobs.store(KnobValues {
            max_inflight_h2d: capped(o.max_inflight_h2d, hints.max_inflight_h2d),
            max_inflight_d2h: o.max_inflight_d2h,
            prefetch_window: window,
            suppress_speculative: o.suppress_speculative || hints.suppress_speculative,
        });
    }

    fn detach(&mut self) {
        self.knobs.detach();
    }

    fn runtime_snapshot(&self) -> serde_json::Value {
        serde_json::json!({
            "max_inflight": self.knobs.max_inflight_h2d(),
            "prefetch_window": self.knobs.prefetch_window(),
            "suppress_speculative": self.knobs.suppress_speculative(),
        })
    }

    fn configured_prefetch_window(&self) -> Option<u32> {
        Some(
            self.knobs
                .saved()
                .map_or_else(|| self.knobs.prefetch_window(), |o| o.prefetch_window),
        )
    }
}

/// Tunes the activation runtime: spill (D2H) and restore (H2D) inflight.
#[derive(Debug)]
pub struct ActivationAdapter {
    knobs: SavedKnobs,
}

impl ActivationAdapter {
    /// The adapter's name, its key in `runtime_snapshots`.
    pub const NAME: &'static str = "activation_stagehand";

    /// An adapter over the activation runtime's knobs.
    pub fn new(knobs: Arc<Knobs>) -> ActivationAdapter {
        ActivationAdapter {
            knobs: SavedKnobs::new(knobs),
        }
    }
}

impl RuntimeAdapter for ActivationAdapter {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn owner(&self) -> Owner {
        Owner::Activations
    }

    fn attach(&mut self) {
        self.knobs.attach();
    }

    fn on_phase(&mut self, _step: u64, _phase: Phase) {}

    fn apply_hints(&mut self, hints: &Hints, phase: Phase) {
        let o = self.knobs.original();
        let mut d2h = capped(o.max_inflight_d2h, hints.max_inflight_d2h);
        if hints.suppress_speculative && phase == Phase::Optimizer {
            d2h = 0;
        }
        self.knobs.store(KnobValues {
            max_inflight_h2d: capped(o.max_inflight_h2d, hints.max_inflight_h2d),
            max_inflight_d2h: d2h,
            prefetch_window: o.prefetch_window,
            suppress_speculative: o.suppress_speculative || hints.suppress_speculative,
        });
    }

    fn detach(&mut self) {
        self.knobs.detach();
    }

    fn runtime_snapshot(&self) -> serde_json::Value {
        serde_json::json!({
            "max_d2h": self.knobs.max_inflight_d2h(),
            "max_h2d": self.knobs.max_inflight_h2d(),
            "suppress_speculative": self.knobs.suppress_speculative(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configured() -> KnobValues {
        KnobValues {
            max_inflight_h2d: 2,
            max_inflight_d2h: 2,
            prefetch_window: 3,
            suppress_speculative: false,
        }
    }

    #[test]
    fn weight_adapter_maps_hints_and_restores_on_detach() {
        let knobs = Knobs::new(configured());
        let mut a = WeightAdapter::new(knobs.clone());
        a.attach();
        a.apply_hints(
            &Hints {
                prefetch_window_cap: Some(2),
                ..Hints::default()
            },
            Phase::Forward,
        );
        assert_eq!(knobs.prefetch_window(), 2);
        a.apply_hints(
            &Hints {
                max_inflight_h2d: Some(1),
                prefetch_window_cap: Some(2),
                suppress_speculative: true,
                ..Hints::default()
            },
            Phase::Optimizer,
        );
        assert_eq!(
            knobs.load(),
            KnobValues {
                max_inflight_h2d: 1,
                max_inflight_d2h: 2,
                prefetch_window: 1,
                suppress_speculative: true,
            }
        );
        assert_eq!(a.runtime_snapshot()["max_inflight"], 1);
        assert_eq!(a.runtime_snapshot()["prefetch_window"], 1);
        a.detach();
        assert_eq!(knobs.load(), configured());
    }

    #[test]
    fn hints_never_raise_a_knob_above_its_configured_value() {
        let knobs = Knobs::new(configured());
        let mut a = WeightAdapter::new(knobs.clone());
        a.attach();
        a.apply_hints(
            &Hints {
                max_inflight_h2d: Some(8),
                prefetch_window_cap: Some(9),
                ..Hints::default()
            },
            Phase::Forward,
        );
        assert_eq!(knobs.load(), configured());
        assert_eq!(a.configured_prefetch_window(), Some(3));
    }

    #[test]
    fn activation_adapter_stops_spills_only_in_the_optimizer() {
        let knobs = Knobs::new(configured());
        let mut a = ActivationAdapter::new(knobs.clone());
        a.attach();
        let suppress = Hints {
            suppress_speculative: true,
            max_inflight_h2d: Some(1),
            ..Hints::default()
        };
        a.apply_hints(&suppress, Phase::Backward);
        assert_eq!(knobs.max_inflight_d2h(), 2);
        assert_eq!(knobs.max_inflight_h2d(), 1);
        a.apply_hints(&suppress, Phase::Optimizer);
        assert_eq!(knobs.max_inflight_d2h(), 0);
        assert_eq!(a.runtime_snapshot()["max_d2h"], 0);
        assert_eq!(knobs.prefetch_window(), 3, "not an activation knob");
        a.apply_hints(
            &Hints {
                max_inflight_d2h: Some(1),
                ..Hints::default()
            },
            Phase::Forward,
        );
        assert_eq!((knobs.max_inflight_d2h(), knobs.max_inflight_h2d()), (1, 2));
        a.detach();
        assert_eq!(knobs.load(), configured());
    }

    #[test]
    fn detach_without_attach_leaves_knobs_alone() {
        let knobs = Knobs::new(configured());
        let mut a = ActivationAdapter::new(knobs.clone());
        knobs.set_max_inflight_d2h(7);
        a.detach();
        assert_eq!(knobs.max_inflight_d2h(), 7);
    }
}
