//! A group's failure state: the first rank that failed and why. Every blocking operation of
//! the group (a rendezvous, a collective, a wait for another rank's optimizer step) checks it,
//! and raising it runs the group's abort hooks (NCCL's `ncclCommAbort` on every communicator),
//! so that no rank waits for one that is gone.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Why a group stopped: the rank that failed first, its device, and the cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub device: String,
    pub cause: String,
}

impl Fault {
    /// The error every rank returns once the group stopped.
    pub fn error(&self) -> Error {
        Error::RankFailed { rank: self.rank, device: self.device.clone(), cause: self.cause.clone() }
    }
}

type Hook = Box<dyn Fn() + Send + Sync>;

/// The group's failure state, shared by its ranks.
pub(crate) struct Faults {
    raised: AtomicBool,
    first: Mutex<Option<Fault>>,
    /// Run once, by the first raise (aborting communicators, waking waiters).
    hooks: Mutex<Vec<Hook>>,
    /// Each rank's device, for the messages.
    devices: Vec<String>,
    /// How long a rank waits for the others at one rendezvous or collective before it declares
    /// the missing rank failed.
    timeout: Duration,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults").field("first", &*self.lock()).field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl Faults {
    /// The failure state of a group whose rank `r` computes on `devices[r]`.
    pub(crate) fn new(devices: Vec<String>, timeout: Duration) -> Faults {
        Faults {
            raised: AtomicBool::new(false),
            first: Mutex::new(None),
            hooks: Mutex::new(Vec::new()),
            devices,
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Fault>> {
        self.first.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ranks in the group.
    pub(crate) fn world(&self) -> usize {
        self.devices.len()
    }

    /// Rank `r`'s device, as messages name it.
    pub(crate) fn device(&self, rank: usize) -> String {
        self.devices.get(rank).cloned().unwrap_or_else(|| format!("rank {rank}"))
    }

    /// How long one wait for the other ranks may last.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `hook` when the group stops (at once if it has stopped already).
    pub(crate) fn on_raise(&self, hook: impl Fn() + Send + Sync + 'static) {
        if self.is_raised() {
            hook();
            return;
        }
        self.hooks.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(hook));
        // Raised between the check and the push: the raiser may have run the hooks already.
        if self.is_raised() {
            for h in self.hooks.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
                h();
            }
        }
    }

    /// Records that rank `rank` failed with `cause` (only the first failure is kept: later ones
    /// are usually the others noticing it) and runs the abort hooks. Returns the group's fault.
    pub(crate) fn raise(&self, rank: usize, cause: impl Into<String>) -> Fault {
        let fault = {
            let mut first = self.lock();
            if first.is_none() {
                *first = Some(Fault { rank, device: self.device(rank), cause: cause.into() });
            }
            first.clone().expect("a fault was just recorded")
        };
        if !self.raised.swap(true, Ordering::SeqCst) {
            let hooks: Vec<Hook> = std::mem::take(&mut *self.hooks.lock().unwrap_or_else(|p| p.into_inner()));
            for h in hooks {
                h();
            }
        }
        fault
    }

    /// Whether a rank failed.
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    /// The group's fault, once one was raised.
    pub(crate) fn fault(&self) -> Option<Fault> {
        self.lock().clone()
    }

    /// `Err` naming the failed rank once the group stopped.
    pub(crate) fn check(&self) -> Result<()> {
        match self.is_raised().then(|| self.fault()).flatten() {
            Some(f) => Err(f.error()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn the_first_fault_wins_and_hooks_run_once() {
        let f = Faults::new(vec!["cuda:0".into(), "cuda:1".into()], Duration::from_secs(1));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        f.on_raise(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert!(f.check().is_ok());
        let first = f.raise(1, "out of memory");
        let second = f.raise(0, "aborted by rank 1");
        assert_eq!(first, second);
        assert_eq!(first.rank, 1);
        assert_eq!(first.device, "cuda:1");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let e = f.check().expect_err("stopped").to_string();
        assert!(e.contains("rank 1 (cuda:1) failed: out of memory"), "{e}");
        // A hook registered after the fault runs at once.
        let r = ran.clone();
        f.on_raise(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}
