//! Who gets a connection slot. A connection starts *pending*: it holds one of a small number of
//! pending places for a short time, during which it must finish its TLS handshake and send a
//! request that passes the access rules (the token, when there is one). That request *admits*
//! it: it moves to the main cap ([`ServerConfig::max_connections`]) and keeps its slot as long as
//! it lives (a stream, a WebSocket, keep-alive requests).
//!
//! A pending connection that takes too long is closed, and when the pending places are full the
//! oldest pending connection is closed to make room for the new one, once it has had
//! [`GRACE`] to send its request: a burst of real clients connecting at once (a hundred
//! watchers after a restart) may briefly take up to [`BURST`] times the places; beyond that the
//! oldest goes whatever its age. A new connection is never turned away. So clients without the token, or that never finish a
//! handshake, can only churn the pending places: they never hold a slot an admitted client
//! needs, and a real client (which sends its request at once) gets in however many idle sockets
//! are opened.
//!
//! [`ServerConfig::max_connections`]: crate::ServerConfig::max_connections

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// How long a pending connection may not be pushed out: time for a real client's handshake and
/// first request.
pub(crate) const GRACE: Duration = Duration::from_millis(500);
/// How many times the pending places new connections may take while all are within their grace.
pub(crate) const BURST: usize = 4;

/// One connection's standing, shared by its task and its requests (as a request extension).
#[derive(Debug)]
pub(crate) struct Ticket {
    admitted: AtomicBool,
    /// The main slot, once admitted.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    main: Arc<Semaphore>,
    /// Told when the connection should close (pushed out of the pending places) or was
    /// admitted (its pending deadline no longer holds).
    changed: Notify,
    evicted: AtomicBool,
}

/// Why admitting a request's connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl Ticket {
    /// Whether the connection was admitted.
    pub(crate) fn admitted(&self) -> bool {
        self.admitted.load(Ordering::Acquire)
    }

    /// Whether the connection was pushed out of the pending places.
    pub(crate) fn evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Admits the connection (a request passed the access rules): takes a main slot, or fails
    /// when all are taken.
    pub(crate) fn admit(&self) -> Result<(), Full> {
        if self.admitted() {
            return Ok(());
        }
        let permit = self.main.clone().try_acquire_owned().map_err(|_| Full)?;
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(permit);
        self.admitted.store(true, Ordering::Release);
        self.changed.notify_one();
        Ok(())
    }

    /// Resolves when the connection was admitted or pushed out.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.changed.notify_one();
    }
}

/// The pending places and the main cap.
#[derive(Debug)]
pub(crate) struct Admission {
    main: Arc<Semaphore>,
    max_main: usize,
    max_pending: usize,
    /// Pending connections, oldest first, with when they came.
    pending: Mutex<VecDeque<(Weak<Ticket>, Instant)>>,
}

impl Admission {
    pub(crate) fn new(max_main: usize, max_pending: usize) -> Admission {
        Admission {
            main: Arc::new(Semaphore::new(max_main)),
            max_main,
            max_pending: max_pending.max(1),
            pending: Mutex::new(VecDeque::new()),
        }
    }

    /// A ticket for a new connection, in a pending place: when they are all taken, the oldest
    /// pending connection is told to close (while it is within its grace, only once the places
    /// are taken [`BURST`] times over).
    pub(crate) fn arrive(&self) -> Arc<Ticket> {
        let ticket = Arc::new(Ticket {
            admitted: AtomicBool::new(false),
            slot: Mutex::new(None),
            main: self.main.clone(),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        });
        let mut q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        q.retain(|(w, _)| w.upgrade().is_some_and(|t| !t.admitted() && !t.evicted()));
        while q.len() >= self.max_pending {
            let past_grace = q.front().is_some_and(|(_, at)| at.elapsed() >= GRACE);
            if !past_grace && q.len() < self.max_pending * BURST {
                break;
            }
            if let Some(oldest) = q.pop_front().and_then(|(w, _)| w.upgrade()) {
                oldest.evict();
            }
        }
        q.push_back((Arc::downgrade(&ticket), Instant::now()));
        ticket
    }

    /// Connections waiting to be admitted now.
    pub(crate) fn pending(&self) -> usize {
        let q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().filter(|(w, _)| w.upgrade().is_some_and(|t| !t.admitted() && !t.evicted())).count()
    }

    /// Admitted connections now.
    pub(crate) fn admitted(&self) -> usize {
        self.max_main - self.main.available_permits()
    }

    /// Waits (up to `limit`) for every admitted connection to close.
    pub(crate) async fn drain(&self, limit: std::time::Duration) {
        let all = u32::try_from(self.max_main).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(limit, self.main.acquire_many(all)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_pending_connection_makes_room_and_admitted_ones_are_never_pushed_out() {
        let a = Admission::new(2, 3);
        let first = a.arrive();
        first.admit().expect("a main slot");
        let pending: Vec<_> = (0..3).map(|_| a.arrive()).collect();
        assert_eq!(a.pending(), 3);
        // Within their grace, a burst may take more places, up to its bound ...
        let burst: Vec<_> = (0..3 * 3).map(|_| a.arrive()).collect();
        assert!(pending.iter().chain(&burst).all(|t| !t.evicted()));
        assert_eq!(a.pending(), 12);
        // ... beyond which the oldest goes, whatever its age.
        let over = a.arrive();
        assert!(pending[0].evicted() && !over.evicted());
        assert_eq!(a.pending(), 12);
        std::thread::sleep(GRACE);
        let newest = a.arrive();
        assert!(pending[1].evicted(), "past its grace, the oldest pending one goes");
        assert!(!first.evicted() && !newest.evicted());
        newest.admit().expect("the second main slot");
        assert_eq!(pending[2].admit(), Err(Full), "the main cap holds");
        assert_eq!(a.admitted(), 2);
        drop(first);
        assert_eq!(a.admitted(), 1, "a closed connection gives its slot back");
        pending[2].admit().expect("room again");
    }
}
