//! Which block of which weight runtime manages each variable, process-wide. A variable streams
//! through one block of one runtime: between uses it points at that runtime's placeholder, so a
//! second runtime (or a second block) registering it would take the placeholder for its value
//! and train on it. A second claim is an error at registration, before the variable is touched.

use crate::error::{Error, Result};
use crate::torch::VariableId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tch::Tensor;

#[derive(Debug)]
struct Claim {
    owner: u64,
    block: String,
}

static CLAIMS: Mutex<BTreeMap<VariableId, Claim>> = Mutex::new(BTreeMap::new());
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A new owner id (one per weight runtime).
pub(crate) fn owner() -> u64 {
    NEXT_OWNER.fetch_add(1, Ordering::Relaxed)
}

/// Claims `params` for block `block` of `owner`, all or none.
pub(crate) fn claim(owner: u64, block: &str, params: &[(String, Tensor)]) -> Result<()> {
    let mut claims = CLAIMS.lock().unwrap_or_else(|p| p.into_inner());
    let ids: Vec<VariableId> = params.iter().map(|(_, t)| VariableId::of(t)).collect();
    for (i, (name, _)) in params.iter().enumerate() {
        let id = ids[i];
        if let Some(c) = claims.get(&id) {
            let whose = if c.owner == owner { "this runtime" } else { "another weight runtime" };
            return Err(Error::misuse(
                format!("registering variable '{name}' in block '{block}': block '{}' of {whose} manages it already", c.block),
                "each variable in one block of one runtime (one WeightRuntime per VarStore; a weight used in two places is used through the layer that owns it, e.g. Managed::run)",
            ));
        }
        if ids[..i].contains(&id) {
            return Err(Error::misuse(
                format!("registering variable '{name}' twice in block '{block}'"),
                "each variable once in a block",
            ));
        }
    }
    for id in ids {
        claims.insert(id, Claim { owner, block: block.to_string() });
    }
    Ok(())
}

/// Gives back the claims of `params` (a registration that failed after claiming them).
pub(crate) fn unclaim(params: &[VariableId]) {
    let mut claims = CLAIMS.lock().unwrap_or_else(|p| p.into_inner());
    for id in params {
        claims.remove(id);
    }
}

/// Gives back every claim of `owner` (its runtime is gone: its variables are no longer
/// placeholders it refills).
pub(crate) fn release(owner: u64) {
    CLAIMS.lock().unwrap_or_else(|p| p.into_inner()).retain(|_, c| c.owner != owner);
}
