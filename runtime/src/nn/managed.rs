//! A layer whose weights Stagehand manages: [`Managed`] (a `Module`) and [`ManagedT`] (a
//! `ModuleT`, such as batch norm) wrap any tch layer, and run it with its block resident.
//!
//! Outside a run the layer's variables point at placeholders, so the layer itself is private:
//! [`Managed::run`] hands it out with the block resident (tied weights, custom use), and
//! [`Managed::variables`] gives the real values. In block mode, [`Managed::in_block`] makes any
//! layer over a registered block a `Module` that runs in it.

use crate::error::{Error, Result};
use crate::events::BlockId;
use crate::torch::SavedTensorHooks;
use crate::weights::WeightRuntime;
use std::cell::RefCell;
use std::sync::Arc;
use tch::nn::{Module, ModuleT};
use tch::Tensor;

thread_local! {
    /// Hooks turned on by layer mode on this thread, one per runtime (the newest wins).
    static HOOKS: RefCell<Vec<(usize, SavedTensorHooks)>> = const { RefCell::new(Vec::new()) };
}

/// Turns off the saved-tensor hooks layer mode turned on for this thread.
pub fn release_hooks() {
    HOOKS.with(|h| {
        let mut v = h.borrow_mut();
        // Reverse order: each guard restores the store that was active before it.
        while let Some(g) = v.pop() {
            drop(g);
        }
    });
}

/// The table of layers a binding points into (the store's), as a binding uses it: a trait of
/// this file's, so that a layer needs nothing of the store.
pub(crate) trait LayerTable: Send + Sync + std::fmt::Debug {
    /// Layer `i`'s name.
    fn layer_name(&self, i: usize) -> String;
    /// The block layer `i` runs in (the table is sealed first).
    fn block_of(&self, i: usize) -> Result<BlockId>;
    /// The weights' runtime.
    fn runtime(&self) -> &WeightRuntime;
    /// Layer `i`'s variables by name, with their values.
    fn values(&self, i: usize) -> Result<Vec<(String, Tensor)>>;
}

/// How a layer is tied to the runtime.
#[derive(Debug, Clone)]
enum State {
    /// Layer `index` of the table, whose block it runs in.
    Layer { table: Arc<dyn LayerTable>, index: usize, hooks: bool },
    /// A block-mode block (registered by the user).
    Block { rt: WeightRuntime, id: BlockId, hooks: bool },
    /// A layer with no variables: nothing to manage.
    Plain,
    /// It could not be registered; why.
    Failed(String),
}

/// A layer's tie to its block.
#[derive(Debug, Clone)]
pub(crate) struct Binding {
    name: String,
    state: State,
}

impl Binding {
    pub(crate) fn layer(table: Arc<dyn LayerTable>, index: usize, hooks: bool) -> Binding {
        Binding {
            name: table.layer_name(index),
            state: State::Layer { table, index, hooks },
        }
    }

    pub(crate) fn in_block(rt: &WeightRuntime, id: BlockId, hooks: bool) -> Result<Binding> {
        let name = rt.blocks().get(id.0 as usize).map(|b| b.name.clone()).ok_or_else(|| Error::UnknownBlock(id.to_string()))?;
        Ok(Binding {
            name,
            state: State::Block { rt: rt.clone(), id, hooks },
        })
    }

    pub(crate) fn plain(name: String) -> Binding {
        Binding { name, state: State::Plain }
    }

    pub(crate) fn failed(name: String, why: String) -> Binding {
        Binding { name, state: State::Failed(why) }
    }

    fn block(&self) -> Result<BlockId> {
        match &self.state {
            State::Layer { table, index, .. } => table.block_of(*index),
            State::Block { id, .. } => Ok(*id),
            State::Plain => Err(Error::misuse(
                format!("the block of layer '{}'", self.name),
                "a layer with variables (this one has none, so nothing streams)",
            )),
            State::Failed(why) => Err(Error::misuse(format!("using layer '{}'", self.name), why.clone())),
        }
    }

    /// Runs `f` with the layer's block resident (and the saved-tensor hooks on).
    fn run<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let (rt, hooks) = match &self.state {
            State::Plain => return Ok(f()),
            State::Failed(why) => return Err(Error::misuse(format!("using layer '{}'", self.name), why.clone())),
            State::Layer { table, hooks, .. } => (table.runtime(), *hooks),
            State::Block { rt, hooks, .. } => (rt, *hooks),
        };
        let block = self.block()?;
        rt.ensure_planned()?;
        if hooks {
            let key = rt.identity();
            HOOKS.with(|h| -> Result<()> {
                let mut v = h.borrow_mut();
                if !v.iter().any(|(k, _)| *k == key) {
                    v.push((key, rt.hooks()?));
                }
                Ok(())
            })?;
        }
        // Held until released below, or until `f` unwinds (a libtorch op that panics, an
        // out-of-memory): a block left held would keep its slot from every later load.
        let held = rt.block(block)?;
        // Outside a step (evaluation, sampling) saved weights are handles whose backward is an
        // error: the block's slot holds another block by the time a backward could come.
        let eval = rt.evaluation_hooks()?;
        let out = f();
        drop(eval);
        held.release()?;
        Ok(out)
    }

    /// An input on another device than the one the layer computes on is refused here, with
    /// both named, rather than by libtorch's panic inside the tch layer (a CPU VarStore in layer
    /// mode without `LayerOptions::device` computes on the host, whatever the input's device).
    /// A 0-dim tensor may sit on the CPU beside CUDA ones, as in libtorch.
    fn check_input(&self, xs: &Tensor) -> Result<()> {
        let rt = match &self.state {
            State::Layer { table, .. } => table.runtime(),
            State::Block { rt, .. } => rt,
            State::Plain | State::Failed(_) => return Ok(()),
        };
        let on = rt.device().tch_device();
        if xs.dim() == 0 || xs.device() == on {
            return Ok(());
        }
        let hint = if rt.device().is_cuda() {
            String::new()
        } else {
            " (the host device: in layer mode LayerOptions::device sets where layers compute)".to_string()
        };
        Err(Error::misuse(
            format!("layer '{}' given an input on {:?}", self.name, xs.device()),
            format!("its input on {on:?}, where the layer computes{hint}"),
        ))
    }

    /// Hands a block's output to the numeric guards (nothing when they are off or the layer is
    /// not bound to a runtime).
    fn observe(&self, out: &Tensor) {
        let rt = match &self.state {
            State::Layer { table, .. } => table.runtime(),
            State::Block { rt, .. } => rt,
            State::Plain | State::Failed(_) => return,
        };
        if let Ok(block) = self.block() {
            rt.guards().observe_output(block, out);
        }
    }

    fn values(&self) -> Result<Vec<(String, Tensor)>> {
        match &self.state {
            State::Layer { table, index, .. } => table.values(*index),
            State::Block { rt, id, .. } => {
                let spec = rt.blocks().into_iter().nth(id.0 as usize).ok_or_else(|| Error::UnknownBlock(id.to_string()))?;
                spec.params.iter().enumerate().map(|(i, p)| Ok((p.name.clone(), rt.host_param(*id, i)?))).collect()
            }
            State::Plain => Ok(Vec::new()),
            State::Failed(why) => Err(Error::misuse(format!("reading layer '{}'", self.name), why.clone())),
        }
    }
}

macro_rules! wrapper {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        pub struct $name<M> {
            inner: M,
            binding: Binding,
        }

        impl<M: std::fmt::Debug> std::fmt::Debug for $name<M> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).field("name", &self.binding.name).finish_non_exhaustive()
            }
        }

        impl<M> $name<M> {
            pub(crate) fn new(inner: M, binding: Binding) -> Self {
                $name { inner, binding }
            }

            /// Block mode: `inner`, whose variables are block `id` of `rt`, run with that block
            /// resident and the saved-tensor hooks on, so a block-mode model is a plain tch
            /// `Module` (with `rt.set_auto_step(true)`, steps begin and end by themselves: no
            /// `begin_step`, `run_block` or `end_step` by hand).
            pub fn in_block(rt: &WeightRuntime, id: BlockId, inner: M) -> Result<Self> {
                Ok($name { inner, binding: Binding::in_block(rt, id, true)? })
            }

            /// The layer's name (its path; tch's `__N` suffix when the path was taken).
            pub fn name(&self) -> &str {
                &self.binding.name
            }

            /// The layer's block (registering every layer's block if the model has not run yet).
            ///
            /// # Panics
            /// When the blocks cannot be registered; [`try_block`](Self::try_block) returns the
            /// error instead.
            pub fn block(&self) -> BlockId {
                self.try_block().unwrap_or_else(|e| super::raise::raise(&self.binding.name, e))
            }

            /// The layer's block, or why it has none.
            pub fn try_block(&self) -> Result<BlockId> {
                self.binding.block()
            }

            /// Runs `f` on the tch layer with its block resident, so its variables hold their
            /// values: how a tied weight is used outside its own layer's forward
            /// (`emb.run(|e| xs.matmul(&e.ws.tr()))`). Do not keep the layer's tensors past the
            /// call: afterwards they point at placeholders again (a kept handle is refused at the
            /// next step).
            pub fn run<T>(&self, f: impl FnOnce(&M) -> T) -> Result<T> {
                self.binding.run(|| f(&self.inner))
            }

            /// The layer's variables with their real values (fresh CPU copies), by VarStore name.
            pub fn variables(&self) -> Result<Vec<(String, Tensor)>> {
                self.binding.values()
            }
        }
    };
}

wrapper!(
    /// A tch `Module` whose variables Stagehand manages (streamed as a block).
    Managed
);
wrapper!(
    /// A tch `ModuleT` whose variables Stagehand manages (streamed as a block).
    ManagedT
);

impl<M: Module> Managed<M> {
    /// `forward` with errors returned instead of panicking.
    pub fn try_forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.binding.check_input(xs)?;
        let out = self.run(|m| m.forward(xs))?;
        self.binding.observe(&out);
        Ok(out)
    }
}

impl<M: Module> Module for Managed<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        // `Module::forward` cannot return an error; like tch's own layers, a failure panics.
        self.try_forward(xs).unwrap_or_else(|e| super::raise::raise(&self.binding.name, e))
    }
}

impl<M: ModuleT> ManagedT<M> {
    /// `forward_t` with errors returned instead of panicking.
    pub fn try_forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.binding.check_input(xs)?;
        let out = self.run(|m| m.forward_t(xs, train))?;
        self.binding.observe(&out);
        Ok(out)
    }
}

impl<M: ModuleT> ModuleT for ManagedT<M> {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.try_forward_t(xs, train)
            .unwrap_or_else(|e| super::raise::raise(&self.binding.name, e))
    }
}
