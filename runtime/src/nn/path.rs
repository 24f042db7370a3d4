//! [`Path`]: a path in a [`ManagedVarStore`] with tch's conventions. It derefs to and borrows as
//! a `tch::nn::Path`, so tch's own constructors take it (`nn::layer_norm(&p / "ln", ..)`: a
//! variable Stagehand does not manage, placed on the compute device when the model first runs),
//! keeps its group across `/`, and makes any constructor's variables one managed block
//! ([`Path::manage`]).

use super::managed::{Managed, ManagedT};
use super::store::ManagedVarStore;
use crate::error::{Error, Result};
use std::borrow::Borrow;

/// A path in a [`ManagedVarStore`].
#[derive(Debug, Clone)]
pub struct Path<'a> {
    inner: tch::nn::Path<'a>,
    store: &'a ManagedVarStore,
}

impl<'a> std::ops::Deref for Path<'a> {
    type Target = tch::nn::Path<'a>;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl<'a> Borrow<tch::nn::Path<'a>> for Path<'a> {
    fn borrow(&self) -> &tch::nn::Path<'a> {
        &self.inner
    }
}

impl<'a> Borrow<tch::nn::Path<'a>> for &Path<'a> {
    fn borrow(&self) -> &tch::nn::Path<'a> {
        &self.inner
    }
}

impl<'a, T: ToString> std::ops::Div<T> for &Path<'a> {
    type Output = Path<'a>;
    fn div(self, rhs: T) -> Path<'a> {
        self.sub(rhs)
    }
}

impl<'a, T: ToString> std::ops::Div<T> for Path<'a> {
    type Output = Path<'a>;
    fn div(self, rhs: T) -> Path<'a> {
        self.sub(rhs)
    }
}

// The store's root is made here, beside the paths: the store knows nothing of them.
impl ManagedVarStore {
    /// The root path, for the drop-in constructors (and tch's own).
    pub fn root(&self) -> Path<'_> {
        Path::new(self.raw_var_store().root(), self)
    }
}

impl<'a> Path<'a> {
    pub(crate) fn new(inner: tch::nn::Path<'a>, store: &'a ManagedVarStore) -> Path<'a> {
        Path { inner, store }
    }

    /// The sub-path `s` (tch's `sub`), in the same group.
    pub fn sub<T: ToString>(&self, s: T) -> Path<'a> {
        Path { inner: self.inner.sub(s), store: self.store }
    }

    /// The same path whose new variables join optimizer group `group` (tch's `set_group`), so
    /// `Optimizer::set_weight_decay_group` and `set_lr_group` address them.
    pub fn set_group(&self, group: usize) -> Path<'a> {
        Path { inner: self.inner.set_group(group), store: self.store }
    }

    /// The device the model computes on: where inputs belong and where the variables Stagehand
    /// does not manage live once the model has run. (The VarStore itself may be on the CPU,
    /// where tch's constructors initialise variables; `(*path).device()` is that one.)
    pub fn device(&self) -> tch::Device {
        self.store.device()
    }

    /// The variable `name` under this path (tch's `get`), for a variable Stagehand does not
    /// manage. A managed variable points at a placeholder between uses, so asking for one is an
    /// error that says where its value is instead (never a tensor of zeros).
    pub fn get(&self, name: &str) -> Result<Option<tch::Tensor>> {
        if name.contains('.') {
            return Err(Error::Config {
                field: "name",
                value: format!("'{name}'"),
                expected: "a variable's name under this path, without '.' (a sub-path is `&path / \"blocks\" / 0`)".into(),
            });
        }
        let Some(t) = self.inner.get(name) else { return Ok(None) };
        let full = self.inner.path(name);
        if self.store.managed_names().contains(&full) {
            return Err(Error::misuse(
                format!("reading managed variable '{full}' outside its layer"),
                "its value through Managed::variables, ManagedVarStore::var_store or Stagehand::var_store, or the variable itself inside Managed::run",
            ));
        }
        Ok(Some(t))
    }

    /// The store.
    pub fn store(&self) -> &'a ManagedVarStore {
        self.store
    }

    /// The path as a VarStore name prefix (`blocks.0.attn`).
    pub(crate) fn name(&self) -> String {
        self.inner.components().collect::<Vec<_>>().join(".")
    }

    /// Makes a layer with `build` on this path and manages every variable it made as one block
    /// (a custom layer whose weights come from `p.var`, `p.randn`, ...): the layer runs with
    /// its block resident, like the drop-in layers. Variables a forward changes in place (batch
    /// norm's running statistics) must stay unmanaged: make them outside `build`.
    pub fn manage<M>(&self, build: impl FnOnce(&tch::nn::Path<'a>) -> M) -> Result<Managed<M>> {
        let (inner, binding) = self.managed(build)?;
        Ok(Managed::new(inner, binding))
    }

    /// [`manage`](Self::manage) for a layer that is a `ModuleT`.
    pub fn manage_t<M>(&self, build: impl FnOnce(&tch::nn::Path<'a>) -> M) -> Result<ManagedT<M>> {
        let (inner, binding) = self.managed(build)?;
        Ok(ManagedT::new(inner, binding))
    }

    fn managed<M>(&self, build: impl FnOnce(&tch::nn::Path<'a>) -> M) -> Result<(M, super::managed::Binding)> {
        let before = self.store.variable_ids();
        let inner = build(&self.inner);
        let params = self.store.added_since(&before);
        if params.is_empty() {
            return Err(Error::misuse(
                format!("managing the layer made on '{}'", self.name()),
                "a constructor that makes its variables on the path it is given",
            ));
        }
        Ok((inner, self.store.register(self.name(), params)))
    }

    /// Registers a drop-in layer made on this path whose variables are `tensors`.
    pub(crate) fn register(&self, tensors: &[&tch::Tensor]) -> super::managed::Binding {
        let params = self.store.names_of(tensors);
        self.store.register(self.name(), params)
    }
}
