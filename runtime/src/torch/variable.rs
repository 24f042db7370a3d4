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
}
