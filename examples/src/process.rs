//! The example binaries as processes: [`Stop`] ends a run cleanly on a signal, [`sibling`] says
//! how to run a sibling binary.
//!
//! The first SIGINT (Ctrl-C) or SIGTERM asks the training loop
//! to stop after the step in progress, and the run then ends as any run does (its summary,
//! `run_ended`, the telemetry flushed); a second one exits at once. Either way the exit status is
//! 128 plus the signal's number (130 for SIGINT, 143 for SIGTERM), as shells expect of a program
//! a signal ended.

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::flag;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The signals a run stops on.
const SIGNALS: [i32; 2] = [SIGINT, SIGTERM];

/// Whether a stop was asked for, and by which signal.
#[derive(Debug, Clone)]
pub struct Stop {
    asked: Arc<AtomicBool>,
    signal: Arc<AtomicUsize>,
}

impl Stop {
    /// Installs the handlers: from now on the first signal sets the flag, a second exits.
    pub fn install() -> Result<Stop> {
        let asked = Arc::new(AtomicBool::new(false));
        let signal = Arc::new(AtomicUsize::new(0));
        for sig in SIGNALS {
            // Registered first, so it sees the flag as the previous signal left it: set means
            // this is the second signal, which exits at once.
            flag::register_conditional_shutdown(sig, 128 + sig, asked.clone())
                .with_context(|| format!("installing the handler of signal {sig}"))?;
            flag::register_usize(sig, signal.clone(), sig as usize)
                .with_context(|| format!("installing the handler of signal {sig}"))?;
            flag::register(sig, asked.clone()).with_context(|| format!("installing the handler of signal {sig}"))?;
        }
        Ok(Stop { asked, signal })
    }

    /// The flag the training loop reads between steps.
    pub fn flag(&self) -> &AtomicBool {
        &self.asked
    }

    /// The signal that asked for the stop, with the exit status it calls for.
    pub fn signal(&self) -> Option<(&'static str, i32)> {
        if !self.asked.load(Ordering::SeqCst) {
            return None;
        }
        let sig = self.signal.load(Ordering::SeqCst) as i32;
        let name = match sig {
            SIGTERM => "SIGTERM",
            _ => "SIGINT (Ctrl-C)",
        };
        Some((name, 128 + if sig == 0 { SIGINT } else { sig }))
    }
}

/// How to run a sibling binary as printed: its path when it was built beside this one (as
/// `scripts/demo` does), its name when it is installed on PATH, else the cargo command that
/// builds and runs it from the repository.
pub fn sibling(name: &str, package: &str) -> String {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .filter(|p| p.exists());
    if let Some(p) = beside {
        let cwd = std::env::current_dir().unwrap_or_default();
        return p.strip_prefix(&cwd).map(std::path::Path::to_path_buf).unwrap_or(p).display().to_string();
    }
    let on_path = std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()));
    if on_path {
        name.to_owned()
    } else {
        format!("cargo run --release -q -p {package} --bin {name} --")
    }
}
