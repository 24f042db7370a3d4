//! Autocast and TF32: libtorch's mixed-precision switches, which tch exposes only for CUDA and
//! with float16 as the only dtype.
//!
//! Autocast is per thread and per device type. [`Autocast::enter`] turns it on for one device
//! type with a given dtype and puts the previous state back when dropped, so scopes nest;
//! [`AutocastState`] captures a thread's state so another thread (the autograd engine's, which
//! runs a recompute scope's function again in backward) can run under the same one.

use super::ffi;
use crate::error::{Error, Result};
use std::os::raw::{c_char, c_int};
use tch::Kind;

/// libtorch's ScalarType code of the floating kinds autocast takes.
fn scalar_type(kind: Kind) -> Result<c_int> {
    match kind {
        Kind::BFloat16 => Ok(15),
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        other => Err(Error::Config {
            field: "autocast dtype",
            value: format!("{other:?}"),
            expected: "BFloat16, Half or Float".into(),
        }),
    }
}

fn kind_of(code: c_int) -> Kind {
    match code {
        15 => Kind::BFloat16,
        5 => Kind::Half,
        _ => Kind::Float,
    }
}

/// A thread's autocast state for one device type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastState {
    /// CUDA (else the CPU).
    pub cuda: bool,
    pub enabled: bool,
    /// The lower-precision dtype autocast casts to.
    pub dtype: Kind,
}

impl AutocastState {
    /// This thread's state for CUDA (`cuda`) or the CPU.
    pub fn current(cuda: bool) -> AutocastState {
        let (mut enabled, mut dtype) = (0, 0);
        // SAFETY: two out-parameters on the stack.
        unsafe { ffi::stagehand_autocast_get(c_int::from(cuda), &mut enabled, &mut dtype) };
        AutocastState {
            cuda,
            enabled: enabled != 0,
            dtype: kind_of(dtype),
        }
    }

    /// Makes this the calling thread's state until the guard drops.
    pub fn apply(self) -> Result<Autocast> {
        Autocast::set(self)
    }
}

/// This thread runs under an autocast state until the guard drops, which puts back the state it
/// found. Not `Send`: autocast state belongs to the thread that set it.
#[derive(Debug)]
pub struct Autocast {
    previous: AutocastState,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Autocast {
    /// Autocast on for CUDA (`cuda`) or the CPU, casting to `dtype` (BFloat16 or Half).
    pub fn enter(cuda: bool, dtype: Kind) -> Result<Autocast> {
        Autocast::set(AutocastState { cuda, enabled: true, dtype })
    }

    fn set(state: AutocastState) -> Result<Autocast> {
        let previous = AutocastState::current(state.cuda);
        write(state, true)?;
        Ok(Autocast {
            previous,
            _not_send: std::marker::PhantomData,
        })
    }
}

fn write(s: AutocastState, enter: bool) -> Result<()> {
    let dtype = scalar_type(s.dtype)?;
    let mut err = [0 as c_char; 512];
    // SAFETY: scalar arguments and an error buffer of the stated length.
    let rc = unsafe {
        ffi::stagehand_autocast_set(c_int::from(s.cuda), c_int::from(s.enabled), dtype, c_int::from(enter), err.as_mut_ptr(), err.len())
    };
    if rc != 0 {
        return Err(Error::internal(format!("setting autocast: {}", ffi::message(&err))));
    }
    Ok(())
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // The previous dtype was read from libtorch, so it is one `write` accepts.
        let _ = write(self.previous, false);
    }
}

/// Turns TF32 on or off for float32 matmuls and convolutions on CUDA, for the whole process
/// (torch's `allow_tf32` switches). Returns whether it was on.
pub fn set_tf32(on: bool) -> bool {
    // SAFETY: no arguments beyond a flag.
    let was = unsafe { ffi::stagehand_tf32() } != 0;
    // SAFETY: as above.
    unsafe { ffi::stagehand_set_tf32(c_int::from(on)) };
    was
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Tensor};

    #[test]
    fn autocast_on_the_cpu_computes_matmuls_in_bf16_and_puts_the_state_back() {
        let a = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
        let before = AutocastState::current(false);
        assert!(!before.enabled);
        {
            let _g = Autocast::enter(false, Kind::BFloat16).expect("autocast");
            assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
            // Softmax computes in float32 under autocast.
            let s = a.matmul(&b).log_softmax(-1, Kind::Float);
            assert_eq!(s.kind(), Kind::Float);
            let st = AutocastState::current(false);
            assert!(st.enabled && st.dtype == Kind::BFloat16);
            {
                let _off = AutocastState { cuda: false, enabled: false, dtype: Kind::BFloat16 }.apply().expect("off");
                assert_eq!(a.matmul(&b).kind(), Kind::Float);
            }
            assert_eq!(a.matmul(&b).kind(), Kind::BFloat16, "the inner scope put the state back");
        }
        assert_eq!(AutocastState::current(false), before);
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
    }

    #[test]
    fn a_captured_state_applies_on_another_thread() {
        let _g = Autocast::enter(false, Kind::BFloat16).expect("autocast");
        let state = AutocastState::current(false);
        let kind = std::thread::spawn(move || {
            let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
            let plain = a.matmul(&a).kind();
            let _g = state.apply().expect("apply");
            (plain, a.matmul(&a).kind())
        })
        .join()
        .expect("thread");
        assert_eq!(kind, (Kind::Float, Kind::BFloat16));
    }

    #[test]
    fn tf32_switches_and_reports_its_previous_state() {
        let was = set_tf32(true);
        assert!(set_tf32(was));
        assert_eq!(set_tf32(was), was);
    }

    #[test]
    fn only_floating_kinds_are_autocast_dtypes() {
        assert!(Autocast::enter(false, Kind::Int64).is_err());
    }
}
