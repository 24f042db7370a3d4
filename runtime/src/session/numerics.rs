//! The handle's side of the numeric guards: the loss and the gradients that stay on the device
//! (resident blocks, unmanaged parameters) are observed here; block outputs and the gradients of
//! streamed blocks are observed where blocks run and where gradients leave the device. The step's
//! flags are read once, at its end.

use super::Stagehand;
use crate::error::Result;
use crate::guards::{NonFinite, Site};
use std::collections::HashSet;
use tch::Tensor;

impl Stagehand {
    pub(super) fn guards_begin(&self) {
        if let Some(g) = &self.guards {
            g.begin_step();
        }
    }

    pub(super) fn guard_loss(&self, loss: &Tensor) {
        if let Some(g) = &self.guards {
            g.observe(None, Site::Loss, loss);
        }
    }

    /// After backward: gradients of resident blocks and of unmanaged parameters, which never
    /// leave the device (streamed blocks' gradients were observed as they left).
    pub(super) fn guard_gradients(&self) {
        let Some(g) = &self.guards else { return };
        let resident: HashSet<usize> = self.plan().map(|p| p.resident_blocks.into_iter().collect()).unwrap_or_default();
        let vars = self.store.raw_var_store().variables();
        for (i, spec) in self.weights().blocks().into_iter().enumerate() {
            if !resident.contains(&i) {
                continue;
            }
            for p in &spec.params {
                if let Some(t) = vars.get(&p.name) {
                    if let Ok(grad) = t.f_grad() {
                        g.observe(Some(spec.id), Site::Gradient, &grad);
                    }
                }
            }
        }
        for (_, t) in self.store.unmanaged_trainable() {
            if let Ok(grad) = t.f_grad() {
                g.observe(None, Site::Gradient, &grad);
            }
        }
    }

    /// Reads the step's flags (once) and publishes the first non-finite value found.
    pub(super) fn guards_end(&self) -> Result<Option<NonFinite>> {
        match &self.guards {
            Some(g) => g.finish_step(),
            None => Ok(None),
        }
    }
}
