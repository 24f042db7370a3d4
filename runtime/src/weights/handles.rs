//! A saved-tensor store for the weight runtime alone: managed weights become handles to their
//! block (so evicting the block frees its memory), everything else is kept as a detached
//! tensor, deduplicated by storage identity.

use crate::saved::{WeightResolver, WeightSave};
use crate::torch::{HookError, SavedTensorStore, TensorIdentity};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tch::Tensor;

enum Saved {
    Weight(WeightSave),
    Kept { tensor: Tensor, identity: TensorIdentity, refs: u32 },
}

/// Weights as handles, the rest kept as is.
pub struct WeightStore {
    resolver: Arc<dyn WeightResolver>,
    next: AtomicU64,
    saved: Mutex<HashMap<u64, Saved>>,
    by_identity: Mutex<HashMap<TensorIdentity, u64>>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore").field("saved", &self.len()).finish()
    }
}

impl WeightStore {
    /// A store that asks `resolver` about every saved tensor.
    pub fn new(resolver: Arc<dyn WeightResolver>) -> WeightStore {
        WeightStore {
            resolver,
            next: AtomicU64::new(1),
            saved: Mutex::new(HashMap::new()),
            by_identity: Mutex::new(HashMap::new()),
        }
    }

    /// Saved entries alive now (weights and kept tensors).
    pub fn len(&self) -> usize {
        self.saved.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// True when nothing is saved.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SavedTensorStore for WeightStore {
    fn pack(&self, tensor: Tensor) -> Result<u64, HookError> {
        if let Some(save) = self.resolver.resolve(&tensor) {
            let h = self.next.fetch_add(1, Ordering::Relaxed);
            self.saved
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(h, Saved::Weight(save));
            return Ok(h);
        }
        let identity = TensorIdentity::of(&tensor);
        let mut by_id = self.by_identity.lock().unwrap_or_else(|p| p.into_inner());
        let mut saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&h) = by_id.get(&identity) {
            if let Some(Saved::Kept { refs, .. }) = saved.get_mut(&h) {
                *refs += 1;
                return Ok(h);
            }
        }
        let h = self.next.fetch_add(1, Ordering::Relaxed);
        // Detached: the store must not keep the output's grad_fn alive (a reference cycle).
        saved.insert(
            h,
            Saved::Kept {
                tensor: tensor.detach(),
                identity: identity.clone(),
                refs: 1,
            },
        );
        by_id.insert(identity, h);
        Ok(h)
    }

    fn unpack(&self, handle: u64) -> Result<Tensor, HookError> {
        let weight = {
            let saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
            match saved.get(&handle) {
                Some(Saved::Kept { tensor, .. }) => return Ok(tensor.shallow_clone()),
                Some(Saved::Weight(w)) => w.clone(),
                None => return Err(format!("unknown saved-tensor handle {handle}").into()),
            }
        };
        // Outside the store's lock: materialising may load blocks.
        self.resolver.materialize(&weight)
    }

    fn release(&self, handle: u64) {
        let mut by_id = self.by_identity.lock().unwrap_or_else(|p| p.into_inner());
        let mut saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        match saved.get_mut(&handle) {
            Some(Saved::Kept { refs, identity, .. }) => {
                *refs -= 1;
                if *refs == 0 {
                    by_id.remove(identity);
                    saved.remove(&handle);
                }
            }
            Some(Saved::Weight(w)) => {
                self.resolver.release(w);
                saved.remove(&handle);
            }
            None => {}
        }
    }
}
