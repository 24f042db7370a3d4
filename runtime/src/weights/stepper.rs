//! The host optimizer's worker: one thread that steps streamed blocks on the host while the
//! training thread goes on (the rest of backward, the next forward). It lives beside the weights
//! because their scheduler orders it and gates loads on it; the optimizer (a layer above) makes
//! the steps and hands them over as [`Job`]s. Of the jobs whose gradients have landed, the one
//! whose block the next forward needs first runs first, so the next forward waits as little as
//! possible; a job still waiting for its copies never holds up one that could run (backward
//! queues the block the next forward needs first last, so that job is the one most often still
//! in flight). Where none can run yet, the oldest runs (waiting for its copies), which lands
//! first. The weight runtime asks
//! [`Stepper::is_pending`] before it loads a block, and never copies host weights that are being
//! changed.
//!
//! Each job uses libtorch's CPU kernels, which spread one parameter's update over the worker's
//! threads: every core by default, or as many as [`Stepper::set_threads`] says. Fewer leave cores
//! to the training thread, which launches the GPU's kernels while the optimizer runs; a training
//! thread that waits for a core leaves the GPU idle.

use crate::error::{Error, Result};
use crate::events::{BlockId, Bus, EventKind};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One block's optimizer step; `pool` is the worker's thread pool for kernels of Stagehand's
/// own (`None`: rayon's global pool, one thread per core).
pub(crate) trait Job: Send {
    /// The step itself, once [`wait_ready`](Self::wait_ready) has returned.
    fn run(&mut self, pool: Option<&rayon::ThreadPool>) -> Result<()>;

    /// Waits for the copies the step reads or must not overlap (its gradients landing, a load
    /// still reading the block).
    fn wait_ready(&mut self) -> Result<()> {
        Ok(())
    }

    /// Whether those copies have completed (never blocks).
    fn is_ready(&self) -> bool {
        true
    }
}

/// What a host step waits for before it touches its block's host memory.
#[derive(Debug, Clone)]
pub(crate) enum Ready {
    /// A copy's completion: a gradient landing, a load still reading the block's weights.
    Copy(crate::device::StreamEvent),
    /// The host adds of the block's later gradients into their sums (`super::host_sum`).
    Adds(super::host_sum::AddsDone),
}

impl Ready {
    /// Blocks until it happened.
    pub(crate) fn wait(&self) -> Result<()> {
        match self {
            Ready::Copy(e) => e.synchronize(),
            Ready::Adds(a) => a.wait(),
        }
    }

    /// Whether it happened (never blocks).
    pub(crate) fn is_complete(&self) -> bool {
        match self {
            Ready::Copy(e) => e.is_complete(),
            Ready::Adds(a) => a.is_complete(),
        }
    }
}

/// A queued job, where it comes in the order of submission (the order its copies were issued
/// in), and when it was queued.
struct Queued {
    seq: u64,
    at: Instant,
    job: Box<dyn Job>,
}

/// Makes a block's step: given the block, which of its parameters received a gradient in this
/// window, and what must complete before the step may touch its host memory.
pub(crate) type JobMaker = Box<dyn FnMut(crate::events::BlockId, &[bool], Vec<Ready>) -> Result<Box<dyn Job>> + Send>;

#[derive(Default)]
struct State {
    /// Queued jobs by (priority, block): the lowest priority value among the ready ones runs
    /// first.
    queue: BTreeMap<(u64, u32), Queued>,
    /// The next job's place in the order of submission.
    seq: u64,
    /// Blocks queued or running.
    pending: HashSet<BlockId>,
    failed: Option<String>,
    shutdown: bool,
    busy: Duration,
    /// Threads for libtorch's CPU kernels on the worker (`None`: libtorch's default).
    threads: Option<usize>,
}

impl State {
    /// Takes the next job to run: the most urgent ready one, else the oldest.
    fn next(&mut self) -> Option<(u32, Queued)> {
        let key = match self.queue.iter().find(|(_, q)| q.job.is_ready()) {
            Some((k, _)) => *k,
            None => *self.queue.iter().min_by_key(|(_, q)| q.seq)?.0,
        };
        self.queue.remove(&key).map(|q| (key.1, q))
    }
}

struct Shared {
    state: Mutex<State>,
    /// Where each step is reported (`host_step`).
    bus: Bus,
    /// Signalled when a job is queued, a job finishes, or the worker stops.
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The worker thread and its queue.
pub(crate) struct Stepper {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Stepper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("Stepper")
            .field("queued", &st.queue.len())
            .field("pending", &st.pending.len())
            .finish()
    }
}

impl Stepper {
    /// Starts the worker thread; each step it runs is reported on `bus`.
    pub(crate) fn new(bus: Bus) -> Result<Stepper> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            bus,
            cv: Condvar::new(),
        });
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("stagehand-optim".into())
            .spawn(move || work(&s))
            .map_err(|e| Error::internal(format!("starting the optimizer thread: {e}")))?;
        Ok(Stepper {
            shared,
            worker: Some(worker),
        })
    }

    /// Queues `block`'s step; `priority` orders the queue (lower runs first).
    pub(crate) fn submit(&self, block: BlockId, priority: u64, job: Box<dyn Job>) {
        let mut st = self.shared.lock();
        st.pending.insert(block);
        let seq = st.seq;
        st.seq += 1;
        st.queue.insert((priority, block.0), Queued { seq, at: Instant::now(), job });
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Whether `block` has a step queued or running.
    pub(crate) fn is_pending(&self, block: BlockId) -> bool {
        self.shared.lock().pending.contains(&block)
    }

    /// Blocks until `block`'s step (if any) has run; returns how long it waited. A failed step
    /// is reported here (and by every later call) as an error.
    pub(crate) fn wait(&self, block: BlockId) -> Result<Duration> {
        let t0 = Instant::now();
        let mut st = self.shared.lock();
        loop {
            if let Some(e) = &st.failed {
                return Err(Error::internal(format!("the host optimizer failed: {e}")));
            }
            if !st.pending.contains(&block) {
                return Ok(t0.elapsed());
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocks until every queued step has run.
    pub(crate) fn wait_all(&self) -> Result<Duration> {
        let t0 = Instant::now();
        let mut st = self.shared.lock();
        loop {
            if let Some(e) = &st.failed {
                return Err(Error::internal(format!("the host optimizer failed: {e}")));
            }
            if st.pending.is_empty() {
                return Ok(t0.elapsed());
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// How many threads the worker's steps use from the next job on (`None`: libtorch's default
    /// for a new thread, one per core unless set otherwise; `Some(0)` counts as 1).
    pub(crate) fn set_threads(&self, threads: Option<usize>) {
        self.shared.lock().threads = threads;
    }

    /// Time the worker spent running jobs since the last call.
    pub(crate) fn take_busy(&self) -> Duration {
        std::mem::take(&mut self.shared.lock().busy)
    }
}

fn work(shared: &Shared) {
    // libtorch's default for a new thread (OMP_NUM_THREADS, or a count set process-wide), read
    // before this thread sets its own: what `None` goes back to.
    let default = usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1);
    let mut applied = None;
    // Stagehand's own kernels run on a pool of the same size (rayon's global pool when unset).
    let mut pool: Option<rayon::ThreadPool> = None;
    let mut st = shared.lock();
    loop {
        if st.shutdown {
            return;
        }
        let Some((block, mut queued)) = st.next() else {
            st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let threads = st.threads;
        drop(st);
        if threads != applied {
            crate::torch::optim::set_local_intra_op_threads(threads.unwrap_or(default));
            pool = threads.and_then(|n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n.max(1))
                    .thread_name(|i| format!("stagehand-optim-{i}"))
                    .build()
                    .ok()
            });
            applied = threads;
        }
        let t0 = Instant::now();
        let mut ready_at = t0;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            queued.job.wait_ready()?;
            ready_at = Instant::now();
            queued.job.run(pool.as_ref())
        }));
        let took = t0.elapsed();
        if matches!(result, Ok(Ok(()))) {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            shared.bus.publish(EventKind::HostStep {
                block: BlockId(block),
                queued_ms: ms(t0.duration_since(queued.at)),
                waited_ms: ms(ready_at.duration_since(t0)),
                ran_ms: ms(ready_at.elapsed()),
            });
        }
        st = shared.lock();
        st.busy += took;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => st.failed = Some(format!("block {block}: {e}")),
            Err(_) => st.failed = Some(format!("block {block}: the step panicked")),
        }
        st.pending.remove(&BlockId(block));
        shared.cv.notify_all();
    }
}


impl Drop for Stepper {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Record(Arc<Mutex<Vec<u32>>>, u32, Arc<AtomicU32>);
    impl Job for Record {
        fn run(&mut self, _: Option<&rayon::ThreadPool>) -> Result<()> {
            // Hold the first job until every job is queued, so the order is the queue's.
            while self.2.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            self.0.lock().expect("log").push(self.1);
            Ok(())
        }
    }

    #[test]
    fn jobs_run_in_priority_order_and_waits_return_when_done() {
        let s = Stepper::new(Bus::disabled()).expect("thread");
        let log = Arc::new(Mutex::new(Vec::new()));
        let go = Arc::new(AtomicU32::new(0));
        // The first job starts at once (and holds); the rest queue up and run by priority.
        s.submit(BlockId(9), 0, Box::new(Record(log.clone(), 9, go.clone())));
        for (b, prio) in [(3, 30), (1, 10), (2, 20)] {
            s.submit(BlockId(b), prio, Box::new(Record(log.clone(), b, go.clone())));
        }
        assert!(s.is_pending(BlockId(2)));
        go.store(1, Ordering::SeqCst);
        s.wait(BlockId(2)).expect("waits");
        s.wait_all().expect("all");
        assert_eq!(*log.lock().expect("log"), [9, 1, 2, 3]);
        assert!(!s.is_pending(BlockId(3)));
    }

    /// Records its block as it starts, then waits for its flag, as a step waits for its copies;
    /// ready as the flag says.
    struct Gated(Arc<Mutex<Vec<u32>>>, u32, Arc<AtomicU32>);
    impl Job for Gated {
        fn wait_ready(&mut self) -> Result<()> {
            self.0.lock().expect("log").push(self.1);
            while !self.is_ready() {
                std::thread::yield_now();
            }
            Ok(())
        }
        fn run(&mut self, _: Option<&rayon::ThreadPool>) -> Result<()> {
            Ok(())
        }
        fn is_ready(&self) -> bool {
            self.2.load(Ordering::SeqCst) != 0
        }
    }

    #[test]
    fn a_job_whose_copies_are_in_flight_never_holds_up_one_that_can_run() {
        let s = Stepper::new(Bus::disabled()).expect("thread");
        let log = Arc::new(Mutex::new(Vec::new()));
        let go = Arc::new(AtomicU32::new(0));
        let (yes, no) = (Arc::new(AtomicU32::new(1)), Arc::new(AtomicU32::new(0)));
        s.submit(BlockId(9), 0, Box::new(Record(log.clone(), 9, go.clone())));
        // As backward queues them: the least urgent first, the most urgent last and in flight.
        s.submit(BlockId(3), 30, Box::new(Gated(log.clone(), 3, yes.clone())));
        s.submit(BlockId(2), 20, Box::new(Gated(log.clone(), 2, yes.clone())));
        s.submit(BlockId(1), 10, Box::new(Gated(log.clone(), 1, no.clone())));
        go.store(1, Ordering::SeqCst);
        // Bounded: a worker stuck on the job in flight would never get here.
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.is_pending(BlockId(3)) {
            if Instant::now() > deadline {
                no.store(1, Ordering::SeqCst); // lets the worker go, so the stepper can stop
                panic!("the ready jobs waited for the one in flight: {:?}", log.lock().expect("log"));
            }
            std::thread::yield_now();
        }
        // The ready ones ran, the more urgent first; the one in flight, left alone, runs last
        // (waiting for its copies).
        assert_eq!(log.lock().expect("log")[..3], [9, 2, 3]);
        assert!(s.is_pending(BlockId(1)));
        no.store(1, Ordering::SeqCst);
        s.submit(BlockId(5), 50, Box::new(Gated(log.clone(), 5, yes.clone())));
        s.wait_all().expect("all");
        assert_eq!(log.lock().expect("log")[3..], [1, 5]);
    }

    #[test]
    fn where_no_job_can_run_yet_the_oldest_runs_first() {
        let s = Stepper::new(Bus::disabled()).expect("thread");
        let log = Arc::new(Mutex::new(Vec::new()));
        let go = Arc::new(AtomicU32::new(0));
        let no = Arc::new(AtomicU32::new(0));
        s.submit(BlockId(9), 0, Box::new(Record(log.clone(), 9, go.clone())));
        for (b, prio) in [(3, 30), (1, 10), (2, 20)] {
            s.submit(BlockId(b), prio, Box::new(Gated(log.clone(), b, no.clone())));
        }
        go.store(1, Ordering::SeqCst);
        // The oldest starts (and waits for its copies); then all land, and urgency decides.
        while log.lock().expect("log").len() < 2 {
            std::thread::yield_now();
        }
        no.store(1, Ordering::SeqCst);
        s.wait_all().expect("all");
        assert_eq!(*log.lock().expect("log"), [9, 3, 1, 2]);
    }

    #[test]
    fn every_step_is_reported_with_its_wait_and_its_run() {
        /// Waits `.0` for its copies, then runs `.1`.
        struct Timed(Duration, Duration);
        impl Job for Timed {
            fn wait_ready(&mut self) -> Result<()> {
                std::thread::sleep(self.0);
                Ok(())
            }
            fn run(&mut self, _: Option<&rayon::ThreadPool>) -> Result<()> {
                std::thread::sleep(self.1);
                Ok(())
            }
        }
        let hub = Arc::new(crate::events::Hub::new());
        let log = Arc::new(Mutex::new(Vec::new()));
        hub.add_sink(Box::new(crate::test_support::Collect(log.clone())));
        let bus = Bus::with_hub(hub, 64);
        let s = Stepper::new(bus.clone()).expect("thread");
        let ms = Duration::from_millis;
        s.submit(BlockId(4), 0, Box::new(Timed(ms(30), ms(10))));
        s.submit(BlockId(2), 1, Box::new(Timed(ms(0), ms(20))));
        s.wait_all().expect("all");
        bus.flush();
        let steps: Vec<_> = log
            .lock()
            .expect("log")
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::HostStep { block, queued_ms, waited_ms, ran_ms } => Some((block.0, queued_ms, waited_ms, ran_ms)),
                _ => None,
            })
            .collect();
        assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), [4, 2]);
        let (_, _, waited, ran) = steps[0];
        assert!(waited >= 30.0 && ran >= 10.0 && ran < waited, "{steps:?}");
        // The second was queued while the first waited and ran.
        let (_, queued, waited, ran) = steps[1];
        assert!(queued >= 40.0 && waited < ran && ran >= 20.0, "{steps:?}");
    }

    /// Reports the intra-op thread count its step would use.
    struct Threads(Arc<Mutex<Vec<i32>>>);
    impl Job for Threads {
        fn run(&mut self, pool: Option<&rayon::ThreadPool>) -> Result<()> {
            self.0.lock().expect("log").push(tch::get_num_threads());
            // Stagehand's kernels get a pool of the same size.
            if let Some(p) = pool {
                assert_eq!(p.current_num_threads() as i32, tch::get_num_threads());
            }
            Ok(())
        }
    }

    #[test]
    fn the_thread_count_applies_to_the_workers_steps_alone() {
        let before = tch::get_num_threads();
        let s = Stepper::new(Bus::disabled()).expect("thread");
        let seen = Arc::new(Mutex::new(Vec::new()));
        for (b, n) in [(1, Some(1)), (2, Some(3)), (3, Some(1)), (4, None)] {
            s.set_threads(n);
            s.submit(BlockId(b), 0, Box::new(Threads(seen.clone())));
            s.wait(BlockId(b)).expect("ran");
        }
        // `None` goes back to what a new thread gets; neither this thread's count nor that
        // default moved.
        let fresh = std::thread::spawn(tch::get_num_threads).join().expect("thread");
        assert_eq!(*seen.lock().expect("log"), [1, 3, 1, fresh]);
        assert_eq!(tch::get_num_threads(), before);
        assert_eq!(fresh, before);
    }

    #[test]
    fn a_failed_step_is_reported_to_every_waiter() {
        struct Fail;
        impl Job for Fail {
            fn run(&mut self, _: Option<&rayon::ThreadPool>) -> Result<()> {
                Err(Error::internal("boom"))
            }
        }
        let s = Stepper::new(Bus::disabled()).expect("thread");
        s.submit(BlockId(4), 0, Box::new(Fail));
        let e = s.wait_all().expect_err("failure reported");
        assert!(e.to_string().contains("block 4: internal error: boom"), "{e}");
        assert!(s.wait(BlockId(1)).is_err());
    }
}
