//! Recompute scopes: tensors that cost less to compute again in backward than to keep or to
//! move over PCIe twice (an activation function's output, attention probabilities).
//!
//! [`recompute`] runs `f` on its sources with a scope open in the activation runtime. Every
//! tensor autograd saves inside the scope becomes a record that holds nothing, and so does the
//! scope's output when a later operation saves it (or a view of it). Only the sources are saved,
//! the usual way (kept or spilled). The first time backward needs one of the scope's tensors,
//! the runtime brings the sources back, runs `f` again with grad mode on, collects what autograd
//! saves in the same order, and serves every tensor of the scope from that one recomputation;
//! it frees them when the last of them is released. A recomputation that saves tensors of other
//! shapes than the forward did is an error, never a silent mismatch. Unless a later operation
//! saved the scope's output, the recomputation stops at `f`'s last save (the configuration's
//! `recompute_early_stop`, see `torch::capture`): what `f` computes after it is not needed.
//!
//! `f` must compute the same values from the same sources: no dropout or other randomness, and
//! nothing after its last saving operation that backward relies on (it may not run again: the
//! stop unwinds `f` from inside that operation, so a lock `f` holds there is poisoned). A
//! streamed weight `f` uses must be one of its sources: saved as a handle to its block, it comes
//! back resident for the recomputation (a weight's block need not be on the device otherwise;
//! a scope whose function uses one it was not given is refused when it closes). That is how a
//! whole block is checkpointed in block mode. Without an activation runtime on the thread (plain
//! tch, hooks off, a store that keeps everything) `f` simply runs.

use super::record::{Member, Record, Records, Slot};
use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::saved::WeightSave;
use crate::torch::amp::AutocastState;
use crate::torch::{HookError, Recompute, RecomputeFn, StorageWatch, TensorIdentity};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use tch::Tensor;

/// Computes `f(sources)`; under an activation runtime, the tensors `f` saves for backward and
/// its output are recomputed in backward instead of being kept or spilled.
///
/// # Panics
/// Like tch's operations, on an error of the runtime (see [`f_recompute`]).
///
/// ```
/// use stagehand::activations::recompute;
/// let u = tch::Tensor::randn([4, 8], tch::kind::FLOAT_CPU).set_requires_grad(true);
/// let h = recompute(&[&u], |s| s[0].gelu("tanh"));
/// assert_eq!(h.size(), vec![4, 8]);
/// ```
pub fn recompute<F>(sources: &[&Tensor], f: F) -> Tensor
where
    F: FnMut(&[Tensor]) -> Tensor + Send + 'static,
{
    match f_recompute(sources, f) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

/// [`recompute`], returning the runtime's errors.
pub fn f_recompute<F>(sources: &[&Tensor], mut f: F) -> Result<Tensor>
where
    F: FnMut(&[Tensor]) -> Tensor + Send + 'static,
{
    // Backward recomputes on another thread: under the autocast the forward ran with, or the
    // recomputation would compute other values (and save tensors of other dtypes).
    let autocast = [AutocastState::current(false), AutocastState::current(true)];
    let f = if autocast.iter().any(|a| a.enabled) {
        RecomputeFn::new(move |s: &[Tensor]| {
            let _guards: Vec<_> = autocast.iter().filter_map(|a| a.apply().ok()).collect();
            f(s)
        })
    } else {
        RecomputeFn::new(f)
    };
    let args: Vec<Tensor> = sources.iter().map(|t| t.shallow_clone()).collect();
    let Some(store) = crate::torch::hooks::current_store() else { return Ok(f.call(&args)) };
    if !crate::torch::hooks::outside_hooks("opening a recompute scope", || store.open_recompute())? {
        return Ok(f.call(&args));
    }
    let output = match catch_unwind(AssertUnwindSafe(|| f.call(&args))) {
        Ok(t) => t,
        Err(panic) => {
            let _ = crate::torch::hooks::outside_hooks("abandoning a recompute scope", || store.close_recompute(None));
            resume_unwind(panic);
        }
    };
    let closing = Recompute {
        sources: &args,
        output: &output,
        f: &f,
    };
    crate::torch::hooks::outside_hooks("closing a recompute scope", || store.close_recompute(Some(closing)))?;
    Ok(output)
}

/// One recompute scope of the current step.
struct Frame {
    /// Set when the scope closes; `None` while open or after it was abandoned.
    f: Option<RecomputeFn>,
    /// Handles of the saved sources, and whether each required grad.
    sources: Vec<(u64, bool)>,
    /// Shapes of the tensors saved inside the scope, one per member (to check the
    /// recomputation).
    saved: Vec<Vec<i64>>,
    /// For each save inside the scope, in order, the member it is: a tensor saved twice is one
    /// member, and the recomputation saves it twice too.
    order: Vec<usize>,
    output_sizes: Vec<i64>,
    /// The recomputation, from the first unpack until the last member is released.
    cache: Option<Recomputed>,
    /// Live records pointing here.
    members: usize,
    /// Live records standing for views of the scope's output: while there are none, the
    /// recomputation stops at its last save.
    output_members: usize,
}

struct Recomputed {
    saved: Vec<Tensor>,
    /// `None` when the recomputation stopped at its last save.
    output: Option<Tensor>,
}

/// The output of a closed scope, matched by storage when a later operation saves it.
struct Output {
    storage_ptr: u64,
    watch: StorageWatch,
    frame: usize,
}

/// The step's recompute scopes (inside the activation runtime's locked state): which are open,
/// closed or recomputed, and which records stand for their tensors. The state asks it what a
/// save or an unpack is, and does the packing and unpacking itself.
#[derive(Default)]
pub(super) struct Scopes {
    frames: Vec<Option<Frame>>,
    open: Option<usize>,
    /// The scope whose sources are being saved: sources are stored tensors, never recomputed
    /// ones (see [`Scopes::excludes`]).
    closing: Option<usize>,
    outputs: Vec<Output>,
    /// Source handles of scopes whose last member went, to release outside the lock.
    releases: Vec<u64>,
    /// Streamed weights (block, parameter) saved inside the open scope: each must be one of
    /// its sources, so that backward's recomputation gets it resident.
    weights: Vec<(BlockId, u32)>,
    /// Scopes this step has opened, those that run as plain code included.
    seen: u64,
}

/// Whether the `index`-th scope of a step recomputes when a `fraction` of them do: the scopes
/// that do are spread evenly (every other one at 0.5), the first one last to be chosen.
fn recomputes(fraction: f64, index: u64) -> bool {
    fraction >= 1.0 || ((index + 1) as f64 * fraction).floor() > (index as f64 * fraction).floor()
}

impl Scopes {
    /// Forgets the step's scopes (the records that pointed into them are gone).
    pub(super) fn clear(&mut self) -> bool {
        let was_open = self.open.is_some();
        *self = Scopes::default();
        was_open
    }

    /// Source handles to release now that their scopes are gone.
    pub(super) fn take_releases(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.releases)
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// A streamed weight is being saved: noted when a scope is open (true), else nothing.
    pub(super) fn note_weight(&mut self, save: &WeightSave) -> bool {
        if self.open.is_none() {
            return false;
        }
        if !self.weights.contains(&(save.block, save.param)) {
            self.weights.push((save.block, save.param));
        }
        true
    }

    /// Whether a save may not dedupe against `rec`: a scope's sources are stored tensors, never
    /// recomputed ones (a source the scope itself saved would be recomputed from itself, and
    /// one another scope recomputes would chain every scope's recomputation to the first).
    pub(super) fn excludes(&self, rec: &Record) -> bool {
        self.closing.is_some() && rec.recompute.is_some()
    }

    /// A record of scope `frame` went: at the last one, frees the recomputation and hands its
    /// sources back. Its output stops standing for the scope: a later save of it (none comes in
    /// backward) is stored the usual way. Keeping the scope for its output instead would chain
    /// the scopes of a checkpointed stack (each block's output is the next one's source, and the
    /// last output lives until backward ends), holding every recomputation to the step's end.
    pub(super) fn member_gone(&mut self, member: &Member) {
        let Some(slot) = self.frames.get_mut(member.frame) else { return };
        let Some(frame) = slot.as_mut() else { return };
        frame.members = frame.members.saturating_sub(1);
        if matches!(member.slot, Slot::Output { .. }) {
            frame.output_members = frame.output_members.saturating_sub(1);
        }
        if frame.members == 0 && frame.f.is_some() && self.open != Some(member.frame) {
            if let Some(frame) = slot.take() {
                self.releases.extend(frame.sources.iter().map(|(h, _)| *h));
            }
            self.outputs.retain(|o| o.frame != member.frame);
        }
    }
}

/// What a tensor being saved is to the scopes.
pub(super) enum Membership {
    /// Saved before in the open scope: record `idx` again.
    Duplicate(usize),
    /// One of a scope's tensors: a record holding nothing stands for it.
    Member(Member),
    /// Nothing of theirs: saved the usual way.
    Outside,
}

/// What unpacking a scope's tensor takes.
pub(super) enum Recomputation {
    /// The scope was recomputed already: the tensor.
    Served(Tensor),
    /// The scope's first unpack: run `f` again on the sources (handles, and whether each
    /// required grad), stopped at its `stop_after`-th save where given, then [`Scopes::store`]
    /// what it saved.
    Needed {
        f: RecomputeFn,
        sources: Vec<(u64, bool)>,
        stop_after: Option<usize>,
    },
}

impl Scopes {
    /// Opens a scope unless one is open (a nested one runs as part of it) or this one runs as
    /// plain code (the fraction that recomputes); whether it opened.
    pub(super) fn open(&mut self, fraction: f64) -> bool {
        if self.open.is_some() {
            return false;
        }
        let index = self.seen;
        self.seen += 1;
        if !recomputes(fraction, index) {
            return false;
        }
        let frame = self.frames.len();
        self.frames.push(Some(Frame {
            f: None,
            sources: Vec::new(),
            saved: Vec::new(),
            order: Vec::new(),
            output_sizes: Vec::new(),
            cache: None,
            members: 0,
            output_members: 0,
        }));
        self.open = Some(frame);
        true
    }

    /// Closes the open scope: its frame, and the streamed weights saved inside it.
    pub(super) fn close(&mut self) -> Result<(usize, Vec<(BlockId, u32)>)> {
        let frame = self.open.take().ok_or_else(|| Error::internal("closing a recompute scope that is not open"))?;
        Ok((frame, std::mem::take(&mut self.weights)))
    }

    /// Marks scope `frame` as the one whose sources are being saved (`None` once they are).
    pub(super) fn set_closing(&mut self, frame: Option<usize>) {
        self.closing = frame;
    }

    /// Keeps what closed scope `frame` recomputes from: its function, its saved sources, and
    /// its output (matched when a later operation saves it).
    pub(super) fn finish(&mut self, frame: usize, closing: &Recompute<'_>, sources: Vec<(u64, bool)>) -> Result<()> {
        let out = closing.output;
        let id = TensorIdentity::of(out);
        let whole = out.is_contiguous()
            && id.storage_offset == 0
            && id.storage_nbytes == (out.numel() * out.kind().elt_size_in_bytes()) as u64;
        let Some(Some(f)) = self.frames.get_mut(frame) else {
            return Err(Error::internal(format!("recompute scope {frame} is gone")));
        };
        f.f = Some(closing.f.clone());
        f.sources = sources;
        f.output_sizes = out.size();
        // An output that is not its storage's only tensor cannot be rebuilt from a recomputed
        // one: later saves of it are stored the usual way.
        if whole && out.requires_grad() {
            if let Some(watch) = StorageWatch::of(out) {
                self.outputs.push(Output {
                    storage_ptr: id.storage_ptr,
                    watch,
                    frame,
                });
            }
        }
        Ok(())
    }

    /// What `t`, being saved, is: a tensor saved inside the open scope, a view of a closed
    /// scope's output, or neither. A member is counted in its scope.
    pub(super) fn member_for(&mut self, records: &Records, t: &Tensor, identity: &TensorIdentity) -> Membership {
        let (frame, slot) = if let Some(frame) = self.open {
            // The same tensor saved twice in the scope is one member.
            let Some(Some(f)) = self.frames.get_mut(frame) else { return Membership::Outside };
            if let Some(idx) = records.find_identity(identity) {
                if let Some(Member { slot: Slot::Saved(i), .. }) =
                    records.get(idx).and_then(|r| r.recompute.as_ref()).filter(|m| m.frame == frame)
                {
                    f.order.push(*i);
                    return Membership::Duplicate(idx);
                }
            }
            f.saved.push(t.size());
            f.order.push(f.saved.len() - 1);
            (frame, Slot::Saved(f.saved.len() - 1))
        } else {
            // A scope's sources are stored, even when one is another scope's output (see
            // `Scopes::excludes`).
            if self.outputs.is_empty() || self.closing.is_some() {
                return Membership::Outside;
            }
            self.outputs.retain(|o| o.watch.alive());
            let Some(o) = self.outputs.iter().find(|o| o.storage_ptr == identity.storage_ptr) else {
                return Membership::Outside;
            };
            (
                o.frame,
                Slot::Output {
                    sizes: identity.sizes.clone(),
                    strides: identity.strides.clone(),
                    offset: identity.storage_offset,
                },
            )
        };
        if let Some(Some(f)) = self.frames.get_mut(frame) {
            f.members += 1;
            f.output_members += usize::from(matches!(slot, Slot::Output { .. }));
        }
        Membership::Member(Member { frame, slot })
    }

    /// The tensor `member` stands for, or what recomputing its scope takes. With `early_stop`
    /// a recomputation whose output nothing saved stops at its last save.
    pub(super) fn lookup(&self, member: &Member, early_stop: bool) -> Result<Recomputation> {
        let frame = self.frame(member.frame)?;
        if let Some(c) = &frame.cache {
            return serve(c, &member.slot).map(Recomputation::Served);
        }
        let f = frame
            .f
            .clone()
            .ok_or_else(|| Error::internal("backward through a recompute scope whose function panicked in the forward"))?;
        let stop_after = (early_stop && frame.output_members == 0 && !frame.order.is_empty()).then_some(frame.order.len());
        Ok(Recomputation::Needed {
            f,
            sources: frame.sources.clone(),
            stop_after,
        })
    }

    /// Keeps a recomputation of `member`'s scope (every tensor it saved, in order, and its
    /// output unless it stopped early; checked against the forward; the first one kept wins)
    /// and serves `member` from it.
    pub(super) fn store(&mut self, member: &Member, output: Option<Tensor>, saved: Vec<Tensor>) -> Result<Tensor> {
        let frame = self.frame_mut(member.frame)?;
        if frame.cache.is_none() {
            let saved = check(frame, output.as_ref(), saved)?;
            frame.cache = Some(Recomputed { saved, output });
        }
        match &frame.cache {
            Some(c) => serve(c, &member.slot),
            None => Err(Error::internal("a recomputation vanished")),
        }
    }

    fn frame(&self, i: usize) -> Result<&Frame> {
        self.frames
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::internal(format!("recompute scope {i} is gone")))
    }

    fn frame_mut(&mut self, i: usize) -> Result<&mut Frame> {
        self.frames
            .get_mut(i)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::internal(format!("recompute scope {i} is gone")))
    }
}

/// The recomputation saved what the forward saved, save for save and shape for shape (and
/// returned an output of the forward's shape, unless it stopped early): its tensors, one per
/// member.
fn check(frame: &Frame, output: Option<&Tensor>, saved: Vec<Tensor>) -> Result<Vec<Tensor>> {
    let shapes: Vec<Vec<i64>> = saved.iter().map(Tensor::size).collect();
    let forward: Vec<&Vec<i64>> = frame.order.iter().filter_map(|&i| frame.saved.get(i)).collect();
    let output_differs = output.is_some_and(|o| o.size() != frame.output_sizes);
    if shapes.len() != forward.len() || shapes.iter().zip(&forward).any(|(a, b)| a != *b) || output_differs {
        let output = output.map_or_else(|| "stopped at its last save".to_owned(), |o| format!("returned {:?}", o.size()));
        let err: HookError = format!(
            "recomputing a scope saved {} tensors of shapes {:?} and {output}; the forward saved {} of shapes {:?} and returned {:?}: the function given to `recompute` must compute the same thing from the same sources (no randomness; and a fused operation that picks its kernel as it runs, such as scaled_dot_product_attention on CUDA, may pick another on backward's thread: call one kernel explicitly)",
            shapes.len(),
            shapes,
            forward.len(),
            forward,
            frame.output_sizes
        )
        .into();
        return Err(Error::Saved(err));
    }
    // The first save of each member (a later one of the same member is the same tensor).
    let mut members: Vec<Option<Tensor>> = (0..frame.saved.len()).map(|_| None).collect();
    for (&i, t) in frame.order.iter().zip(saved) {
        if let Some(m @ None) = members.get_mut(i) {
            *m = Some(t);
        }
    }
    members
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.ok_or_else(|| Error::internal(format!("recompute scope member {i} was never saved"))))
        .collect()
}

fn serve(c: &Recomputed, slot: &Slot) -> Result<Tensor> {
    match slot {
        Slot::Saved(i) => c
            .saved
            .get(*i)
            .map(Tensor::shallow_clone)
            .ok_or_else(|| Error::internal(format!("recomputed tensor {i} is missing"))),
        Slot::Output { sizes, strides, offset } => {
            // A view of the output saved after the recomputation stopped without it (a forward
            // run while backward is under way).
            let output = c
                .output
                .as_ref()
                .ok_or_else(|| Error::internal("a view of a recompute scope's output is unpacked after its recomputation stopped without it"))?;
            Ok(output.f_as_strided(sizes.as_slice(), strides.as_slice(), *offset)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recomputes;

    #[test]
    fn the_scopes_that_recompute_are_spread_evenly() {
        let chosen = |f: f64| (0..8).filter(|&i| recomputes(f, i)).collect::<Vec<u64>>();
        assert_eq!(chosen(1.0), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(chosen(0.5), [1, 3, 5, 7]);
        assert_eq!(chosen(0.25), [3, 7]);
        assert!(chosen(0.0).is_empty());
        assert_eq!(chosen(0.75).len(), 6);
    }
}
