//! The identity of a variable: its `TensorImpl`, which every handle of it shares (a shallow
//! clone, the copy a `VarStore` keeps) and which survives `set_data` (how the weight runtime
//! points a parameter at a slot or a placeholder). Two handles are the same variable exactly
//! when their ids are equal; storage addresses are no substitute (a placeholder's or a freed
//! tensor's address can be reused).

use super::ffi;
use tch::Tensor;

/// A variable's identity (its `TensorImpl` address); 0 for an undefined tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VariableId(usize);

impl VariableId {
    /// The identity of `t`.
    pub fn of(t: &Tensor) -> VariableId {
        // SAFETY: `t` is a live tensor; the shim only reads the address of its TensorImpl.
        VariableId(unsafe { ffi::stagehand_tensor_impl(t.as_ptr()) } as usize)
    }
}

/// Handles of `t`'s variable alive now (shallow clones, the bases of its views), less the one
/// a live autograd graph's gradient accumulator holds; `t` itself counts.
pub(crate) fn handles(t: &Tensor) -> usize {
    // SAFETY: `t` is a live tensor; the shim only reads reference counts.
    let n = unsafe { ffi::stagehand_tensor_handles(t.as_ptr()) };
    usize::try_from(n).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_of_one_variable_share_an_id_that_set_data_keeps() {
        let mut a = Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu));
        let b = a.shallow_clone();
        let c = a.copy();
        assert_eq!(VariableId::of(&a), VariableId::of(&b));
        assert_ne!(VariableId::of(&a), VariableId::of(&c));
        a.set_data(&Tensor::ones([5], (tch::Kind::Float, tch::Device::Cpu)));
        assert_eq!(VariableId::of(&a), VariableId::of(&b));
        assert_eq!(b.size(), [5]);
        assert_ne!(VariableId::of(&a.detach()), VariableId::of(&a), "a detached view is another variable");
    }

    #[test]
    fn handles_count_clones_and_views_but_not_a_live_graph() {
        let a = Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        assert_eq!(handles(&a), 1);
        let b = a.shallow_clone();
        assert_eq!(handles(&a), 2);
        let v = a.tr();
        assert_eq!(handles(&a), 3, "a view keeps its base");
        drop((b, v));
        let y = (&a * 2.0).sum(tch::Kind::Float);
        assert_eq!(handles(&a), 1, "the graph's accumulator is not a handle");
        drop(y);
        assert_eq!(handles(&a), 1);
    }
}
