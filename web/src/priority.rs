//! The server's threads run below the training run's priority: watchers are served from the
//! CPU time the run leaves, so a training job never slows down because people watch it (a
//! run's host work, such as its optimizer on every core, otherwise waits for the slowest core,
//! and a core busy with the server makes every step wait).

/// How much lower than the process the server's threads run (a `nice` value: 0 to 19).
pub const NICENESS: i32 = 10;

/// Lowers the calling thread's priority by [`NICENESS`] (Linux: each thread has its own nice
/// value). Raising it again would need privileges; lowering never does. Elsewhere, nothing.
pub fn lower_this_thread() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `gettid` has no preconditions; `getpriority`/`setpriority` on the calling
        // thread's id only read and set that thread's nice value.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            let _ = libc::setpriority(libc::PRIO_PROCESS, tid, (now + NICENESS).min(19));
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn a_thread_can_lower_its_own_priority() {
        let nice = std::thread::spawn(|| {
            let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
            super::lower_this_thread();
            let after = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
            (before, after)
        })
        .join()
        .expect("thread");
        assert_eq!(nice.1, (nice.0 + super::NICENESS).min(19));
        let main = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        assert_eq!(main, nice.0, "only that thread");
    }
}
