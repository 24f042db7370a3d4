//! What the trainer tests share.

use std::sync::{Mutex, MutexGuard};

/// The runs draw their weights and batches from libtorch's global generator: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Takes this test binary's turn, with the hook engine installed and one intra-op thread
/// (libtorch's CPU reductions then sum in one order in every run).
pub fn serial() -> MutexGuard<'static, ()> {
    let turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    stagehand::torch::init();
    stagehand::torch::hooks::install().expect("hook engine");
    tch::set_num_threads(1);
    turn
}
