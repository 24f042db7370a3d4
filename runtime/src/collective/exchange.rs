//! The in-process rendezvous of a group's ranks (one process, a thread per rank): each round,
//! every rank deposits a value under a tag and, once all have, each reads what it needs from
//! all of them. It carries what is small or host-side (losses, flags, norms, NCCL's unique id,
//! barriers) and, on the host device, the collectives themselves.
//!
//! Rounds are numbered per rank, so a rank that has read round k may deposit into round k + 1
//! while the others still read k (the deposits of a round being gathered and those of the round
//! being read are kept apart). Every rank must call the same rounds in the same order: the tags
//! must agree, and a rank that deposits another tag stops the group with both tags named, rather
//! than pairing values that do not belong together. A rank that does not arrive within the
//! group's timeout is declared failed; a rank that failed wakes every waiter.

use super::faults::Faults;
use crate::error::Result;
use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank looks at the group's fault state (a round completing wakes it at
/// once).
const FAULT_POLL: Duration = Duration::from_millis(50);

/// One rank's deposit: its round's tag and value.
pub(crate) type Deposit = (String, Box<dyn Any + Send>);

#[derive(Default)]
struct Rounds {
    /// Rounds completed: every rank deposited.
    completed: u64,
    /// The round being gathered (number `completed`), one deposit per rank.
    gathering: Vec<Option<Deposit>>,
    /// The last completed round, while its ranks read it.
    done: Vec<Option<Deposit>>,
    /// The round each rank deposits into next.
    next: Vec<u64>,
}

/// The rendezvous of one group.
pub(crate) struct Exchange {
    faults: Arc<Faults>,
    rounds: Mutex<Rounds>,
    cv: Condvar,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange").field("world", &self.faults.world()).finish_non_exhaustive()
    }
}

impl Exchange {
    /// The rendezvous of the group whose failure state is `faults`.
    pub(crate) fn new(faults: Arc<Faults>) -> Arc<Exchange> {
        let world = faults.world();
        let ex = Arc::new(Exchange {
            faults,
            rounds: Mutex::new(Rounds {
                gathering: (0..world).map(|_| None).collect(),
                done: (0..world).map(|_| None).collect(),
                next: vec![0; world],
                ..Rounds::default()
            }),
            cv: Condvar::new(),
        });
        // A failure anywhere wakes every waiter now, not at its next poll.
        let weak = Arc::downgrade(&ex);
        ex.faults.on_raise(move || {
            if let Some(ex) = weak.upgrade() {
                let _guard = ex.lock();
                ex.cv.notify_all();
            }
        });
        ex
    }

    fn lock(&self) -> MutexGuard<'_, Rounds> {
        self.rounds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The group's failure state.
    #[cfg(test)]
    pub(crate) fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// Ranks in the group.
    pub(crate) fn world(&self) -> usize {
        self.faults.world()
    }

    /// Rank `rank` deposits `value` under `tag`, waits until every rank has deposited into this
    /// round, then `read`s every deposit (in rank order, under the exchange's lock: take copies
    /// or shallow clones, compute outside). Fails, naming the failed rank, when a rank failed,
    /// deposited another tag, or did not arrive within the group's timeout.
    pub(crate) fn round<R>(
        &self,
        rank: usize,
        tag: &str,
        value: Box<dyn Any + Send>,
        read: impl FnOnce(&[Option<Deposit>]) -> R,
    ) -> Result<R> {
        let world = self.world();
        if rank >= world {
            return Err(crate::error::Error::internal(format!("rank {rank} in a group of {world}")));
        }
        self.faults.check()?;
        let mut st = self.lock();
        let mine = st.next[rank];
        // Rounds are numbered per rank: this one is the round being gathered.
        if mine != st.completed {
            return Err(crate::error::Error::internal(format!(
                "rank {rank} deposits into round {mine} while round {} is being gathered",
                st.completed
            )));
        }
        st.gathering[rank] = Some((tag.to_owned(), value));
        if st.gathering.iter().all(Option::is_some) {
            // The last to arrive checks that every rank called the same thing.
            let mismatch = st
                .gathering
                .iter()
                .enumerate()
                .find_map(|(r, d)| d.as_ref().filter(|(t, _)| t != tag).map(|(t, _)| (r, t.clone())));
            if let Some((other, their)) = mismatch {
                drop(st);
                let f = self.faults.raise(
                    rank.max(other),
                    format!("the ranks disagree on the collective: rank {other} called {their} while rank {rank} called {tag} (every rank must run the same blocks, steps and calls in the same order)"),
                );
                return Err(f.error());
            }
            let gathered = std::mem::replace(&mut st.gathering, (0..world).map(|_| None).collect());
            st.done = gathered;
            st.completed += 1;
            self.cv.notify_all();
        } else {
            let t0 = Instant::now();
            while st.completed == mine {
                if self.faults.is_raised() {
                    drop(st);
                    self.faults.check()?;
                    return Err(crate::error::Error::internal("the group stopped without a fault"));
                }
                if t0.elapsed() > self.faults.timeout() {
                    let missing: Vec<usize> = (0..world).filter(|&r| st.gathering[r].is_none()).collect();
                    drop(st);
                    let late = missing.first().copied().unwrap_or(rank);
                    let f = self.faults.raise(
                        late,
                        format!(
                            "did not reach {tag} within {:.0} s (rank {rank} waited; ranks missing: {missing:?}): it stopped, hangs, or runs other steps",
                            self.faults.timeout().as_secs_f64()
                        ),
                    );
                    return Err(f.error());
                }
                st = self.cv.wait_timeout(st, FAULT_POLL).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        st.next[rank] = mine + 1;
        Ok(read(&st.done))
    }

    /// Every rank's `value`, in rank order.
    pub(crate) fn all_gather<T: Clone + Send + 'static>(&self, rank: usize, tag: &str, value: T) -> Result<Vec<T>> {
        let tag_owned = tag.to_owned();
        self.round(rank, tag, Box::new(value), |all| {
            all.iter()
                .map(|d| d.as_ref().and_then(|(_, v)| v.downcast_ref::<T>().cloned()))
                .collect::<Option<Vec<T>>>()
        })?
        .ok_or_else(|| crate::error::Error::internal(format!("{tag_owned}: a rank deposited another type")))
    }

    /// Waits until every rank reached the barrier `tag`.
    pub(crate) fn barrier(&self, rank: usize, tag: &str) -> Result<()> {
        self.round(rank, tag, Box::new(()), |_| ())
    }

    /// The sum of every rank's `value`, added in rank order (so every rank gets the same bits).
    pub(crate) fn sum_f64(&self, rank: usize, tag: &str, value: f64) -> Result<f64> {
        Ok(self.all_gather(rank, tag, value)?.into_iter().fold(0.0, |a, v| a + v))
    }

    /// Whether any rank's `flag` is set.
    pub(crate) fn any(&self, rank: usize, tag: &str, flag: bool) -> Result<bool> {
        Ok(self.all_gather(rank, tag, flag)?.into_iter().any(|f| f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(n: usize, timeout_ms: u64) -> Arc<Exchange> {
        let devices = (0..n).map(|r| format!("host:{r}")).collect();
        Exchange::new(Arc::new(Faults::new(devices, Duration::from_millis(timeout_ms))))
    }

    #[test]
    fn ranks_gather_in_rank_order_round_after_round() {
        let ex = group(3, 10_000);
        let out: Vec<Vec<Vec<u64>>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let ex = &ex;
                    s.spawn(move || (0..50).map(|k| ex.all_gather(r, "g", (r * 100 + k) as u64).expect("gather")).collect())
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for per_rank in &out {
            for (k, got) in per_rank.iter().enumerate() {
                assert_eq!(got, &vec![k as u64, 100 + k as u64, 200 + k as u64]);
            }
        }
        let sums: Vec<f64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3).map(|r| {
                let ex = &ex;
                s.spawn(move || ex.sum_f64(r, "s", 0.1 * (r + 1) as f64).expect("sum"))
            }).collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(sums.iter().all(|&s| s.to_bits() == ((0.0 + 0.1) + 0.2 + 0.30000000000000004f64).to_bits()), "{sums:?}");
    }

    #[test]
    fn a_missing_rank_times_out_and_names_itself() {
        let ex = group(2, 200);
        let e = ex.barrier(0, "barrier 'step 3'").expect_err("rank 1 never comes").to_string();
        assert!(e.contains("rank 1 (host:1) failed: did not reach barrier 'step 3'"), "{e}");
        // Everyone sees it from now on.
        assert!(ex.barrier(1, "later").expect_err("stopped").to_string().contains("rank 1 (host:1)"));
    }

    #[test]
    fn a_fault_wakes_a_waiting_rank_at_once() {
        let ex = group(2, 60_000);
        let t0 = Instant::now();
        let e = std::thread::scope(|s| {
            let w = s.spawn(|| ex.barrier(0, "b"));
            std::thread::sleep(Duration::from_millis(100));
            ex.faults().raise(1, "out of memory");
            w.join().expect("rank 0")
        })
        .expect_err("rank 1 failed")
        .to_string();
        assert!(e.contains("rank 1 (host:1) failed: out of memory"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(30), "woken by the fault, not by the timeout");
    }

    #[test]
    fn ranks_that_call_different_things_stop_the_group() {
        let ex = group(2, 10_000);
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| ex.barrier(0, "reduce-scatter of block 'blocks.1'"));
            let b = s.spawn(|| ex.barrier(1, "reduce-scatter of block 'blocks.2'"));
            (a.join().expect("0"), b.join().expect("1"))
        });
        let e = a.err().or(b.err()).expect("a mismatch is an error").to_string();
        assert!(e.contains("the ranks disagree"), "{e}");
        assert!(e.contains("blocks.1") && e.contains("blocks.2"), "{e}");
    }
}
