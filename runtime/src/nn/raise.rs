//! How a layer reports a failure from `forward`, which cannot return one: it panics. Inside a
//! caller that wants the error back (the handle's step, through [`catching`]), the panic carries
//! the typed [`Error`] itself, so what the caller gets is the runtime's own error with its
//! figures (a [`Error::DeviceFull`] stays one), never its text parsed back. Anywhere else the
//! panic is an ordinary message, as tch's own layers panic.

use crate::error::Error;
use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A layer's failure, as the payload of its panic inside [`catching`].
#[derive(Debug)]
pub(crate) struct LayerFailure {
    /// The layer's name (its path).
    pub(crate) layer: String,
    pub(crate) error: Error,
}

thread_local! {
    /// How many [`catching`] calls are running on this thread (they may nest).
    static CATCHING: Cell<u32> = const { Cell::new(0) };
}

/// Raises `error` from layer `layer`'s `forward`.
///
/// Inside [`catching`] it unwinds with a [`LayerFailure`] through `resume_unwind`, which skips
/// the panic hook: a `panic_any` payload that is not a string prints as `Box<dyn Any>`, and the
/// catcher, which always receives it, says what happened. Elsewhere it panics with the message.
pub(crate) fn raise(layer: &str, error: Error) -> ! {
    if CATCHING.with(Cell::get) > 0 {
        std::panic::resume_unwind(Box::new(LayerFailure { layer: layer.to_owned(), error }))
    }
    panic!("stagehand layer '{layer}': {error}")
}

/// Runs `f`, catching its panic; a layer's failure inside it unwinds as a [`LayerFailure`]
/// payload (downcast it), any other panic as it was raised.
pub(crate) fn catching<T>(f: impl FnOnce() -> T) -> Result<T, Box<dyn Any + Send>> {
    /// Leaves the scope even when `f` unwinds.
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            CATCHING.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    CATCHING.with(|c| c.set(c.get().saturating_add(1)));
    let _scope = Scope;
    catch_unwind(AssertUnwindSafe(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Error {
        Error::DeviceFull { what: "a slab".into(), requested_bytes: 8, allocated_bytes: 4, budget_bytes: 10 }
    }

    #[test]
    fn inside_a_catcher_the_error_keeps_its_type() {
        let payload = catching(|| raise("fc", full())).expect_err("it unwinds");
        let failure = payload.downcast::<LayerFailure>().expect("a typed payload");
        assert_eq!(failure.layer, "fc");
        assert!(matches!(failure.error, Error::DeviceFull { requested_bytes: 8, budget_bytes: 10, .. }), "{:?}", failure.error);
        // The scope ended with the unwind: a later failure outside it is a message again.
        let text = catch_unwind(|| raise("fc", full())).expect_err("it panics");
        let text = text.downcast_ref::<String>().expect("a message");
        assert!(text.starts_with("stagehand layer 'fc': device out of memory: a slab needs 8 bytes"), "{text}");
    }

    #[test]
    fn other_panics_pass_through_unchanged() {
        let payload = catching(|| panic!("index out of range")).expect_err("it unwinds");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"index out of range"));
        assert_eq!(catching(|| 3).ok(), Some(3));
    }
}
