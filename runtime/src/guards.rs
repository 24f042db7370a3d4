//! Numeric guards: NaN and infinity in block outputs, gradients and the loss, found on the device
//! without a host synchronisation per block.
//!
//! Each observation queues a one-pass sum of the tensor (accumulated in float32, or float64 for
//! float64 tensors) and a test of that one number on the compute stream, leaving a one-element
//! flag on the device; nothing waits for them. A NaN or an infinity anywhere makes the sum
//! non-finite (an infinity of each sign makes a NaN), so none is missed; finite values so large
//! that their sum overflows (near the float maximum) are reported as well, which is as alarming.
//! The sum reads the tensor once and allocates one number: `isfinite().all()` allocates a mask
//! as large as the tensor and costs a third of a step on the host device (see the `guards`
//! benchmark). At the end of the step
//! the step's flags are stacked and read once (one synchronisation per step, where the step
//! synchronises anyway), and the first observation that saw a non-finite value, in the order the
//! observations were made, is published as `non_finite` naming its block. Forward outputs come
//! before the loss and the gradients after it, so a NaN born in block 3's forward is named as
//! block 3's output, not as the loss it spread to.
//!
//! Off by default. The hooks ([`GuardSlot::observe_output`], [`GuardSlot::observe_gradient`])
//! read the weights runtime's slot (one atomic load) and return when no guards are armed there,
//! so a run without guards pays nothing. A handle arms them with `StagehandBuilder::guards(true)`.

use crate::error::Result;
use crate::events::{BlockId, Bus, EventKind, Owner};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tch::Tensor;

/// Flags kept one by one before they are stacked into one tensor (bounds the live tensors).
const FOLD_EVERY: usize = 256;
/// Observations one step keeps at most; later ones in the same step are counted, not checked.
pub const MAX_OBSERVATIONS_PER_STEP: usize = 1 << 20;

/// Where a checked tensor came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// A managed layer's output in the forward.
    Output,
    /// A parameter's gradient after backward.
    Gradient,
    /// The step's loss.
    Loss,
}

impl Site {
    /// The name `non_finite` events carry in `tensor`.
    pub fn as_str(self) -> &'static str {
        match self {
            Site::Output => "output",
            Site::Gradient => "gradient",
            Site::Loss => "loss",
        }
    }
}

/// The first non-finite value a step produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFinite {
    /// The block whose tensor held it (`None` for the loss and for unmanaged parameters).
    pub block: Option<BlockId>,
    pub site: Site,
    /// Observations of the step that saw a non-finite value (the first one included).
    pub count: usize,
}

#[derive(Debug, Default)]
struct Pending {
    /// Where each flag came from, in observation order.
    sites: Vec<(Option<BlockId>, Site)>,
    /// Flags not yet folded.
    flags: Vec<Tensor>,
    /// Earlier flags, stacked `FOLD_EVERY` at a time.
    folded: Vec<Tensor>,
    /// Observations that could not be checked (a failed kernel launch), and the last reason.
    failures: u64,
    last_failure: Option<String>,
    /// Observations past [`MAX_OBSERVATIONS_PER_STEP`].
    unchecked: u64,
}

/// The guards of one run: the step's device-side flags, and the bus findings go to.
#[derive(Debug)]
pub struct Guards {
    bus: Bus,
    pending: Mutex<Pending>,
    /// Tensors checked over the run: outputs, gradients, losses (read at each step's end).
    checked: Mutex<Checked>,
}

/// Tensors the guards checked over a run, by where they came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checked {
    pub outputs: u64,
    pub gradients: u64,
    pub losses: u64,
    /// Steps whose flags were read.
    pub steps: u64,
}

/// Where the code that checks tensors finds a run's armed guards: the weights runtime holds one
/// and hands clones to its gradient sinks, the handle arms it, and the managed layers read it.
/// Reading it is one atomic load, so the hooks cost nothing while guards are off. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct GuardSlot(Arc<OnceLock<Arc<Guards>>>);

impl GuardSlot {
    /// The armed guards, if any.
    pub fn get(&self) -> Option<&Arc<Guards>> {
        self.0.get()
    }

    /// Arms guards publishing to `bus` (once; later calls return the guards armed first).
    pub fn arm(&self, bus: &Bus) -> Arc<Guards> {
        self.0.get_or_init(|| Arc::new(Guards::new(bus.clone()))).clone()
    }

    /// Observes a managed layer's output when guards are armed.
    #[inline]
    pub fn observe_output(&self, block: BlockId, out: &Tensor) {
        if let Some(g) = self.get() {
            g.observe(Some(block), Site::Output, out);
        }
    }

    /// Observes a parameter's gradient when guards are armed.
    #[inline]
    pub fn observe_gradient(&self, block: Option<BlockId>, grad: &Tensor) {
        if let Some(g) = self.get() {
            g.observe(block, Site::Gradient, grad);
        }
    }
}

/// A device-side flag: true when `t` holds a NaN or an infinity. Queued, never waited for.
fn non_finite_flag(t: &Tensor) -> Result<Option<Tensor>> {
    if !t.defined() || !t.f_is_floating_point()? {
        return Ok(None);
    }
    let flag = tch::no_grad(|| {
        let acc = if t.kind() == tch::Kind::Double { tch::Kind::Double } else { tch::Kind::Float };
        t.f_sum(acc)?.f_isfinite()?.f_logical_not()
    })?;
    Ok(Some(flag))
}

impl Guards {
    /// Guards publishing their findings on `bus`.
    pub fn new(bus: Bus) -> Guards {
        Guards {
            bus,
            pending: Mutex::new(Pending::default()),
            checked: Mutex::new(Checked::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Plain data: a panic while holding it leaves it usable.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a step: flags left by a step that failed before its end are dropped.
    pub fn begin_step(&self) {
        *self.lock() = Pending::default();
    }

    /// Checks `t` on its device (no host synchronisation); the result is read at the step's end.
    pub fn observe(&self, block: Option<BlockId>, site: Site, t: &Tensor) {
        let mut p = self.lock();
        if p.sites.len() >= MAX_OBSERVATIONS_PER_STEP {
            p.unchecked += 1;
            return;
        }
        let flag = non_finite_flag(t).and_then(|f| {
            let Some(f) = f else { return Ok(None) };
            p.flags.push(f);
            if p.flags.len() >= FOLD_EVERY {
                let stacked = Tensor::f_stack(&p.flags, 0)?;
                p.flags.clear();
                p.folded.push(stacked);
            }
            Ok(Some(()))
        });
        match flag {
            Ok(Some(())) => p.sites.push((block, site)),
            Ok(None) => {}
            Err(e) => {
                p.failures += 1;
                p.last_failure = Some(e.to_string());
            }
        }
    }

    /// What the guards checked over the run so far (the steps that ended).
    pub fn checked(&self) -> Checked {
        *self.checked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Observations made in the step so far (tests, diagnostics).
    pub fn observed(&self) -> usize {
        self.lock().sites.len()
    }

    /// Ends the step: reads the step's flags once and publishes the first non-finite value as
    /// `non_finite` (and a warning when some tensors could not be checked).
    pub fn finish_step(&self) -> Result<Option<NonFinite>> {
        let p = std::mem::take(&mut *self.lock());
        if p.failures > 0 || p.unchecked > 0 {
            self.bus.publish(EventKind::Warning {
                source: Owner::Trainer,
                message: format!(
                    "numeric guards left {} tensors of this step unchecked ({} over the limit of {MAX_OBSERVATIONS_PER_STEP}){}",
                    p.failures + p.unchecked,
                    p.unchecked,
                    p.last_failure.map(|e| format!("; last failure: {e}")).unwrap_or_default()
                ),
            });
        }
        if p.sites.is_empty() {
            return Ok(None);
        }
        {
            let mut c = self.checked.lock().unwrap_or_else(|p| p.into_inner());
            for (_, site) in &p.sites {
                let n = match site {
                    Site::Output => &mut c.outputs,
                    Site::Gradient => &mut c.gradients,
                    Site::Loss => &mut c.losses,
                };
                *n += 1;
            }
            c.steps += 1;
        }
        let mut parts = p.folded;
        if !p.flags.is_empty() {
            parts.push(Tensor::f_stack(&p.flags, 0)?);
        }
        // The one read of the step.
        let all = Tensor::f_cat(&parts, 0)?.f_to_kind(tch::Kind::Uint8)?.f_to_device(tch::Device::Cpu)?;
        let flags = Vec::<u8>::try_from(&all)?;
        let mut bad = flags.iter().zip(&p.sites).filter(|(f, _)| **f != 0).map(|(_, s)| *s);
        let Some((block, site)) = bad.next() else { return Ok(None) };
        let finding = NonFinite {
            block,
            site,
            count: 1 + bad.count(),
        };
        self.bus.publish(EventKind::NonFinite {
            block,
            tensor: site.as_str().into(),
        });
        Ok(Some(finding))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn the_first_non_finite_observation_is_found_with_one_read() {
        let g = Guards::new(Bus::disabled());
        g.begin_step();
        g.observe(Some(BlockId(0)), Site::Output, &t(&[1.0, 2.0]));
        g.observe(Some(BlockId(1)), Site::Output, &t(&[1.0, f32::NAN]));
        g.observe(None, Site::Loss, &t(&[f32::INFINITY]));
        // Integer tensors cannot hold NaN: not observed.
        g.observe(Some(BlockId(2)), Site::Output, &Tensor::from_slice(&[1i64]));
        assert_eq!(g.observed(), 3);
        let f = g.finish_step().expect("reads the flags");
        assert_eq!(f, Some(NonFinite { block: Some(BlockId(1)), site: Site::Output, count: 2 }));
        assert_eq!(g.observed(), 0, "the step's flags are gone");
        assert_eq!(g.finish_step().expect("nothing to read"), None);
    }

    #[test]
    fn half_precision_and_huge_values_are_judged_by_a_wide_sum() {
        let g = Guards::new(Bus::disabled());
        // 1000 x 60000 overflows float16 but not the float32 sum: finite.
        let big = Tensor::full([1000], 60000.0, (tch::Kind::Half, tch::Device::Cpu));
        g.observe(Some(BlockId(0)), Site::Output, &big);
        let nan = Tensor::from_slice(&[1.0f32, f32::NAN]).to_kind(tch::Kind::BFloat16);
        g.observe(Some(BlockId(1)), Site::Output, &nan);
        // Infinities of both signs sum to NaN: still found.
        g.observe(Some(BlockId(2)), Site::Output, &t(&[f32::INFINITY, f32::NEG_INFINITY]));
        let f = g.finish_step().expect("reads").expect("a finding");
        assert_eq!((f.block, f.count), (Some(BlockId(1)), 2));
        // Finite float32 values whose sum overflows are reported (documented).
        g.observe(Some(BlockId(3)), Site::Output, &t(&[3e38, 3e38]));
        assert_eq!(g.finish_step().expect("reads").map(|f| f.block), Some(Some(BlockId(3))));
    }

    #[test]
    fn folded_flags_keep_their_order() {
        let g = Guards::new(Bus::disabled());
        for i in 0..(FOLD_EVERY * 2 + 7) {
            let v = if i == FOLD_EVERY + 3 { f32::NEG_INFINITY } else { 0.5 };
            g.observe(Some(BlockId(i as u32)), Site::Gradient, &t(&[v]));
        }
        let f = g.finish_step().expect("reads").expect("a finding");
        assert_eq!((f.block, f.site, f.count), (Some(BlockId(FOLD_EVERY as u32 + 3)), Site::Gradient, 1));
    }

    #[test]
    fn a_clean_step_finds_nothing_and_begin_drops_stale_flags() {
        let g = Guards::new(Bus::disabled());
        g.observe(Some(BlockId(0)), Site::Output, &t(&[f32::NAN]));
        g.begin_step();
        g.observe(Some(BlockId(0)), Site::Output, &t(&[0.0]));
        assert_eq!(g.finish_step().expect("reads"), None);
    }
}
