//! Gradient accumulation on the host. A parameter's first gradient of an accumulation window
//! goes straight to its pinned host buffer (the sum); a later one (a micro-batch after the
//! first, a weight used twice) goes to a spare pinned buffer of its own, and once that copy has
//! landed a worker thread adds it into the sum, `sum += incoming`, on a rayon pool of its own:
//! the float32 sum of the two rounded once to the gradients' dtype (to nearest even), as
//! libtorch's adds round it on the host and on CUDA, so the result is the one autograd makes
//! when it accumulates into `.grad`.
//!
//! Why on the host: the device's way (`super::accumulate`, the default) brings each sum so far
//! back over the link to add to it there, which doubles backward's copies and makes the compute
//! stream wait for those reads. Here the device only copies out, as for a first gradient, and
//! never waits; the host pays a pass over the gradient's bytes per micro-batch (six bytes of
//! memory traffic per bf16 element), which is worth it only where the link, not the host's
//! memory bandwidth, is short: on an H100's 16-core host the adds ran at 8-9 GB/s of gradients
//! beside the copies and the optimizer and held the training thread back (the benchmark notes).
//! A block's host step waits for its adds (`AddsDone`).
//!
//! Buffers: while its adds run, a sum belongs to the worker (the block's `buf` is `None`, as
//! while a copy writes it) and comes home once the last one is done; spare buffers are cut from
//! the runtime's host pool, kept for the next window, and bounded (`HostSum::take_spare`).

use crate::device::{HostBuffer, HostPool};
use crate::error::{Error, Result};
use crate::events::BlockId;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tch::Kind;

/// A parameter's host gradient: (block, index into the block's `grads`).
pub(crate) type Key = (BlockId, usize);

/// One add: `incoming` (landed) into the sum of `key`.
struct Add {
    key: Key,
    incoming: HostBuffer,
    kind: Kind,
    numel: i64,
}

/// A sum at the worker: its buffer (`None` while the worker adds into it) and its adds queued or
/// running.
struct Held {
    buf: Option<HostBuffer>,
    adds: usize,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Add>,
    sums: HashMap<Key, Held>,
    /// Sums whose adds are all done, to go home.
    done: Vec<(Key, HostBuffer)>,
    /// Incoming buffers the worker is done with.
    returned: Vec<HostBuffer>,
    /// The worker is adding.
    running: bool,
    failed: Option<String>,
    shutdown: bool,
    busy: Duration,
    added_bytes: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when an add is queued or done, or the worker stops.
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The end of every add held for a block's sums ([`HostSum::adds_done`]): what its host step
/// waits for. The sums stay where the optimizer's views read them.
#[derive(Clone)]
pub(crate) struct AddsDone {
    shared: Arc<Shared>,
    block: BlockId,
}

impl std::fmt::Debug for AddsDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddsDone").field("block", &self.block).finish()
    }
}

impl AddsDone {
    fn held(&self, st: &State) -> bool {
        st.sums.keys().any(|k| k.0 == self.block)
    }

    /// Blocks until every add held for the block ran.
    pub(crate) fn wait(&self) -> Result<()> {
        let mut st = self.shared.lock();
        loop {
            failed(&st)?;
            if !self.held(&st) {
                return Ok(());
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether every add held for the block ran (never blocks).
    pub(crate) fn is_complete(&self) -> bool {
        !self.held(&self.shared.lock())
    }
}

/// The worker and the spare buffers.
pub(crate) struct HostSum {
    shared: Arc<Shared>,
    /// Started by the first add: a run that never accumulates starts no threads.
    worker: Option<JoinHandle<()>>,
    threads: usize,
    /// Spare incoming buffers.
    spare: Vec<HostBuffer>,
    /// Bytes of incoming buffers this sink holds: spare, in copies, at the worker.
    held: u64,
}

impl std::fmt::Debug for HostSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("HostSum").field("queued", &st.queue.len()).field("sums", &st.sums.len()).field("held", &self.held).finish()
    }
}

impl HostSum {
    /// Host sums whose adds run on `threads` threads.
    pub(crate) fn new(threads: usize) -> HostSum {
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), cv: Condvar::new() });
        HostSum { shared, worker: None, threads: threads.max(1), spare: Vec::new(), held: 0 }
    }

    fn start(&mut self) -> Result<()> {
        if self.worker.is_some() {
            return Ok(());
        }
        let s = self.shared.clone();
        let threads = self.threads;
        let worker = std::thread::Builder::new()
            .name("stagehand-gradsum".into())
            .spawn(move || work(&s, threads))
            .map_err(|e| Error::internal(format!("starting the gradient-sum thread: {e}")))?;
        self.worker = Some(worker);
        Ok(())
    }

    /// A spare buffer of at least `bytes` for an incoming gradient. Past `cap` bytes of incoming
    /// buffers held, waits for the worker to give one back (`land_one` lands the oldest incoming
    /// copy, so that the worker has something to give back); a gradient larger than every spare
    /// may go over the cap by itself.
    pub(crate) fn take_spare(
        &mut self,
        bytes: usize,
        cap: u64,
        pool: &HostPool,
        mut land_one: impl FnMut(&mut HostSum) -> Result<bool>,
    ) -> Result<HostBuffer> {
        loop {
            self.take_returned();
            let fits = self.spare.iter().enumerate().filter(|(_, b)| b.len() >= bytes).min_by_key(|(_, b)| b.len()).map(|(i, _)| i);
            if let Some(i) = fits {
                return Ok(self.spare.swap_remove(i));
            }
            if self.held + bytes as u64 <= cap || self.held == self.spare_bytes() {
                // Room for one more, or nothing out to wait for: spares too small go back to
                // the pool first.
                while self.held + bytes as u64 > cap {
                    let Some(small) = self.spare.pop() else { break };
                    self.held -= small.len() as u64;
                }
                let buf = pool.alloc(bytes)?;
                self.held += buf.len() as u64;
                return Ok(buf);
            }
            if !land_one(self)? {
                self.wait_returned()?;
            }
        }
    }

    fn spare_bytes(&self) -> u64 {
        self.spare.iter().map(|b| b.len() as u64).sum()
    }

    /// Moves the buffers the worker gave back to the spares.
    fn take_returned(&mut self) {
        let returned = std::mem::take(&mut self.shared.lock().returned);
        self.spare.extend(returned);
    }

    /// Blocks until the worker gives an incoming buffer back (or has nothing left to give).
    fn wait_returned(&mut self) -> Result<()> {
        let mut st = self.shared.lock();
        while st.returned.is_empty() && (st.running || !st.queue.is_empty()) {
            failed(&st)?;
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    /// Takes `key`'s sum for one more add (a later gradient on its way): from the worker, which
    /// has it already (an add before this one), or from `home` (landed).
    pub(crate) fn hold(&mut self, key: Key, home: &mut Option<HostBuffer>) -> Result<()> {
        self.start()?;
        let mut st = self.shared.lock();
        failed(&st)?;
        if let Some(h) = st.sums.get_mut(&key) {
            h.adds += 1;
            return Ok(());
        }
        let buf = match st.done.iter().position(|(k, _)| *k == key) {
            Some(i) => st.done.swap_remove(i).1,
            None => home.take().ok_or_else(|| Error::internal(format!("block {}: a gradient's sum is neither home nor at its worker", key.0)))?,
        };
        st.sums.insert(key, Held { buf: Some(buf), adds: 1 });
        Ok(())
    }

    /// Queues the add of `incoming` (landed) into `key`'s sum, held for it by [`hold`](Self::hold).
    pub(crate) fn add(&mut self, key: Key, incoming: HostBuffer, kind: Kind, numel: i64) -> Result<()> {
        let mut st = self.shared.lock();
        failed(&st)?;
        if !st.sums.contains_key(&key) {
            return Err(Error::internal(format!("block {}: a gradient to add without its sum held", key.0)));
        }
        st.queue.push_back(Add { key, incoming, kind, numel });
        drop(st);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// A spare that carried no gradient after all (its copy failed): it goes back to the spares
    /// and `key`'s hold for it ends.
    pub(crate) fn give_back(&mut self, key: Key, buf: HostBuffer) {
        self.spare.push(buf);
        let mut st = self.shared.lock();
        if let Some(h) = st.sums.get_mut(&key) {
            h.adds = h.adds.saturating_sub(1);
            if h.adds == 0 {
                if let Some(Held { buf: Some(b), .. }) = st.sums.remove(&key) {
                    st.done.push((key, b));
                }
            }
        }
    }

    /// What `id`'s host step waits for while a sum of its is held for an add (`None`: none is).
    pub(crate) fn adds_done(&self, id: BlockId) -> Option<AddsDone> {
        let held = self.shared.lock().sums.keys().any(|k| k.0 == id);
        held.then(|| AddsDone { shared: self.shared.clone(), block: id })
    }

    /// The sums whose adds are all done (of `id`, or every block's), to go home.
    pub(crate) fn take_home(&mut self, id: Option<BlockId>) -> Result<Vec<(Key, HostBuffer)>> {
        self.take_returned();
        let mut st = self.shared.lock();
        failed(&st)?;
        let (home, stay): (Vec<_>, Vec<_>) = std::mem::take(&mut st.done).into_iter().partition(|(k, _)| id.is_none_or(|i| k.0 == i));
        st.done = stay;
        Ok(home)
    }

    /// Blocks until no sum `of` selects is held: every add queued for it ran. The caller has
    /// queued the adds of every later gradient it sent (landed their copies) first.
    pub(crate) fn wait(&self, of: impl Fn(Key) -> bool) -> Result<()> {
        let mut st = self.shared.lock();
        loop {
            failed(&st)?;
            if !st.sums.keys().any(|&k| of(k)) {
                return Ok(());
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Gives every spare buffer back to its pool.
    pub(crate) fn release_spares(&mut self) {
        self.take_returned();
        for b in self.spare.drain(..) {
            self.held = self.held.saturating_sub(b.len() as u64);
        }
    }

    /// Time the worker spent adding, and bytes of gradients it added, since the last call.
    pub(crate) fn take_work(&self) -> (Duration, u64) {
        let mut st = self.shared.lock();
        (std::mem::take(&mut st.busy), std::mem::take(&mut st.added_bytes))
    }
}

fn failed(st: &State) -> Result<()> {
    match &st.failed {
        Some(e) => Err(Error::internal(format!("adding gradients on the host: {e}"))),
        None => Ok(()),
    }
}

impl Drop for HostSum {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.cv.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn work(shared: &Shared, threads: usize) {
    // A pool of the adds' own: libtorch's thread count is not set here, as setting it would
    // also set it for every thread that first runs a libtorch kernel afterwards.
    let pool = match rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("stagehand-gradsum-{i}")).build() {
        Ok(p) => p,
        Err(e) => {
            let mut st = shared.lock();
            st.failed = Some(format!("starting the gradient-sum threads: {e}"));
            shared.cv.notify_all();
            return;
        }
    };
    let mut st = shared.lock();
    loop {
        if st.shutdown {
            return;
        }
        let Some(add) = st.queue.pop_front() else {
            st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let Some(mut sum) = st.sums.get_mut(&add.key).and_then(|h| h.buf.take()) else {
            st.failed.get_or_insert_with(|| format!("block {}: an add without its sum", add.key.0));
            shared.cv.notify_all();
            continue;
        };
        st.running = true;
        drop(st);
        let t0 = Instant::now();
        let result = add_into(&pool, &mut sum, &add);
        let took = t0.elapsed();
        st = shared.lock();
        st.running = false;
        st.busy += took;
        if let Err(e) = result {
            st.failed.get_or_insert_with(|| e.to_string());
        } else {
            st.added_bytes += add.numel as u64 * add.kind.elt_size_in_bytes() as u64;
        }
        st.returned.push(add.incoming);
        let finished = match st.sums.get_mut(&add.key) {
            Some(h) => {
                h.adds -= 1;
                h.buf = Some(sum);
                h.adds == 0
            }
            None => false,
        };
        if finished {
            if let Some(Held { buf: Some(b), .. }) = st.sums.remove(&add.key) {
                st.done.push((add.key, b));
            }
        }
        shared.cv.notify_all();
    }
}

/// Elements each task of the pool adds.
const CHUNK: usize = 1 << 16;

/// `sum += incoming`, both `add.numel` elements of `add.kind` at the start of their buffers,
/// on `pool` (a gradient of one chunk or less on the calling thread: a hand-over to the pool
/// costs more than such an add): each element in float32, rounded once to the dtype (to
/// nearest even), as libtorch's adds on the host and on CUDA round them.
fn add_into(pool: &rayon::ThreadPool, sum: &mut HostBuffer, add: &Add) -> Result<()> {
    use crate::precision::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    use rayon::prelude::*;
    let n = usize::try_from(add.numel).map_err(|_| Error::internal("a gradient of negative length"))?;
    let bytes = n * add.kind.elt_size_in_bytes();
    if sum.len() < bytes || add.incoming.len() < bytes {
        return Err(Error::internal(format!(
            "a gradient of {bytes} bytes for buffers of {} and {}",
            sum.len(),
            add.incoming.len()
        )));
    }
    let (s, g) = (&mut sum.as_mut_slice()[..bytes], &add.incoming.as_slice()[..bytes]);
    fn words<'a, T: Copy>(s: &'a mut [u8], g: &'a [u8]) -> Result<(&'a mut [T], &'a [T])> {
        // SAFETY: u16 and f32 have no invalid bit patterns; `align_to` keeps within the
        // slices and says where alignment fails (checked: the pool's buffers are aligned).
        let (a, s, c) = unsafe { s.align_to_mut::<T>() };
        let (d, g, e) = unsafe { g.align_to::<T>() };
        if !(a.is_empty() && c.is_empty() && d.is_empty() && e.is_empty()) {
            return Err(Error::internal("a host gradient buffer not aligned to its dtype"));
        }
        Ok((s, g))
    }
    fn chunks<T: Copy + Send + Sync>(pool: &rayon::ThreadPool, s: &mut [T], g: &[T], f: impl Fn(T, T) -> T + Sync) {
        let run = |s: &mut [T], g: &[T]| s.iter_mut().zip(g).for_each(|(a, b)| *a = f(*a, *b));
        if s.len() <= CHUNK {
            run(s, g);
        } else {
            pool.install(|| s.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(s, g)| run(s, g)));
        }
    }
    match add.kind {
        Kind::Float => {
            let (s, g) = words::<f32>(s, g)?;
            chunks(pool, s, g, |a, b| a + b);
        }
        Kind::BFloat16 => {
            let (s, g) = words::<u16>(s, g)?;
            chunks(pool, s, g, |a, b| f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)));
        }
        Kind::Half => {
            let (s, g) = words::<u16>(s, g)?;
            chunks(pool, s, g, |a, b| f32_to_f16(f16_to_f32(a) + f16_to_f32(b)));
        }
        k => return Err(Error::internal(format!("adding gradients of {k:?} on the host"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use tch::Tensor;

    fn filled(pool: &HostPool, values: &Tensor) -> HostBuffer {
        let bytes = values.numel() * values.kind().elt_size_in_bytes();
        let buf = pool.alloc(bytes).expect("alloc");
        let view = super::super::registry::param_tensor(&buf, 0, &[values.numel() as i64], values.kind()).expect("view");
        view.shallow_clone().copy_(values);
        buf
    }

    fn read(buf: &HostBuffer, kind: Kind, numel: i64) -> Tensor {
        super::super::registry::param_tensor(buf, 0, &[numel], kind).expect("view").copy()
    }

    /// Three later gradients into one sum, in bf16, fp16 and fp32, through spares bounded to one
    /// gradient: the sum is libtorch's own `((s + a) + b) + c` in the gradients' dtype, bit for
    /// bit, the spares never exceed their bound, and the sum comes home once its adds ran.
    #[test]
    fn later_gradients_add_up_as_libtorch_adds_them_within_the_spares_bound() {
        let pool = HostPool::new(&Device::host(1 << 30));
        for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
            let n = 10_000i64;
            let g: Vec<Tensor> = (0..4).map(|i| (Tensor::randn([n], (Kind::Float, tch::Device::Cpu)) * (i + 1)).to_kind(kind)).collect();
            let want = ((&g[0] + &g[1]) + &g[2]) + &g[3];
            let bytes = (n as usize) * kind.elt_size_in_bytes();
            let mut sums = HostSum::new(2);
            let key = (BlockId(7), 1);
            let mut home = Some(filled(&pool, &g[0]));
            for later in &g[1..] {
                sums.hold(key, &mut home).expect("hold");
                assert!(home.is_none(), "the worker holds the sum");
                // Held for an add not queued yet: a step of the block would wait.
                assert!(sums.adds_done(BlockId(7)).is_some_and(|d| !d.is_complete()));
                let spare = sums.take_spare(bytes, bytes as u64, &pool, |_| Ok(false)).expect("spare");
                assert!(sums.held <= bytes as u64, "{} bytes of spares held", sums.held);
                let v = super::super::registry::param_tensor(&spare, 0, &[n], kind).expect("view");
                v.shallow_clone().copy_(later);
                drop(v);
                sums.add(key, spare, kind, n).expect("add");
            }
            if let Some(done) = sums.adds_done(BlockId(7)) {
                done.wait().expect("adds ran");
                assert!(done.is_complete());
            }
            assert!(sums.adds_done(BlockId(7)).is_none());
            let mut back = sums.take_home(Some(BlockId(7))).expect("home");
            assert_eq!(back.len(), 1);
            let (k, buf) = back.remove(0);
            assert_eq!(k, key);
            assert!(read(&buf, kind, n).equal(&want), "{kind:?}: the host sum differs from libtorch's");
            let (_, added) = sums.take_work();
            assert_eq!(added, 3 * bytes as u64);
        }
    }

    /// An add the worker cannot do (a gradient longer than its buffers) fails loudly at every later
    /// call, never hangs a wait.
    #[test]
    fn a_failed_add_is_an_error_not_a_hang() {
        let pool = HostPool::new(&Device::host(1 << 30));
        let mut sums = HostSum::new(1);
        let key = (BlockId(0), 0);
        let mut home = Some(pool.alloc(64).expect("alloc"));
        sums.hold(key, &mut home).expect("hold");
        let big = pool.alloc(4096).expect("alloc");
        sums.add(key, big, Kind::Float, 1 << 22).expect("queued");
        let e = sums.wait(|_| true).expect_err("failed add");
        assert!(e.to_string().contains("adding gradients on the host"), "{e}");
        assert!(sums.take_home(None).is_err());
        let mut again = Some(pool.alloc(64).expect("alloc"));
        assert!(sums.hold((BlockId(1), 0), &mut again).is_err());
    }
}
