//! Optimizer state made to fit a variable: state read from a file, or from another rank's
//! shard, is checked against the variable's shape and copied to its device and dtype. Both the
//! optimizer (state waiting for a block's host optimizer) and the state files use it.

use super::Algorithm;
use crate::error::{Error, Result};
use crate::torch::ParamState;
use tch::Tensor;

/// `st` as state for `like` (a parameter): every tensor must have the parameter's shape, and is
/// copied to its device and dtype.
pub(super) fn fit_state(algorithm: &Algorithm, name: &str, st: &ParamState, like: &Tensor) -> Result<ParamState> {
    let fields = algorithm.state_fields();
    let mut tensors: [Option<Tensor>; 3] = [None, None, None];
    for (i, t) in st.tensors.iter().enumerate() {
        let Some(t) = t else { continue };
        if t.size() != like.size() {
            return Err(Error::Corrupt(format!(
                "optimizer state '{name}/{}' has shape {:?}, but the variable has shape {:?}",
                fields[i],
                t.size(),
                like.size()
            )));
        }
        let out = Tensor::f_empty(like.size().as_slice(), (like.kind(), like.device()))?;
        tch::no_grad(|| out.detach().f_copy_(t))?;
        tensors[i] = Some(out);
    }
    Ok(ParamState { step: st.step, tensors })
}
