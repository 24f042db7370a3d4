//! [`HostPool`]: the pinned host memory that weight blocks' host copies and gradient buffers are
//! cut from, kept across models.
//!
//! Pinning is slow (page-locking a few GiB takes seconds on a GPU host), and it is paid again by
//! every model that allocates its own. The pool pins memory in chunks and hands out ranges of
//! them as [`HostBuffer`]s; a buffer dropped (its block gone: a model shut down with
//! `Stagehand::shutdown_keep_pool`, or its runtime dropped) returns its range, and the next
//! model's blocks are cut from it without pinning anything. Several models on one handle share
//! one pool; a pool handed to a new handle (`StagehandBuilder::host_pool`) serves its model.
//!
//! Ranges are first-fit in address order, page-aligned, and adjacent free ranges merge. A
//! request no free range holds pins a new chunk of at least [`DEFAULT_CHUNK_BYTES`].

use super::buffer::{HostBuffer, Lender};
use super::Device;
use crate::error::Result;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// The least a new chunk pins (a request larger than it pins exactly its own size): small enough
/// that a small model's pool stays small, large enough that a model's many blocks need few
/// chunks.
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;

/// Every range starts on a page (the host buffers' own alignment).
const RANGE_ALIGN: usize = 4096;

/// What a pool holds and what it did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostPoolStats {
    /// Chunks pinned, and their bytes.
    pub chunks: usize,
    pub pinned_bytes: u64,
    /// Bytes handed out now.
    pub in_use_bytes: u64,
    /// Milliseconds spent pinning chunks (the allocations themselves).
    pub pin_ms: f64,
    /// Bytes handed out from chunks pinned before the request, without pinning anything, and the
    /// milliseconds those requests took (the pool's own bookkeeping).
    pub served_bytes: u64,
    pub serve_ms: f64,
}

#[derive(Debug)]
struct Chunk {
    buf: HostBuffer,
    /// Free ranges: offset -> length.
    free: BTreeMap<usize, usize>,
}

#[derive(Debug)]
struct State {
    chunks: Vec<Chunk>,
    stats: HostPoolStats,
}

#[derive(Debug)]
pub(super) struct Shared {
    device: Device,
    chunk_bytes: usize,
    /// New chunks grow with what is pinned, up to this (`chunk_bytes` for a pool that does not
    /// grow its chunks).
    max_chunk_bytes: usize,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a map insert or remove and counters: consistent after a panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Lender for Shared {
    /// Gives a range back (a pooled buffer dropped), merging it with free neighbours.
    fn release(&self, chunk: usize, offset: usize, len: usize) {
        let mut st = self.lock();
        st.stats.in_use_bytes = st.stats.in_use_bytes.saturating_sub(len as u64);
        let Some(c) = st.chunks.get_mut(chunk) else { return };
        let (mut start, mut len) = (offset, len);
        if let Some((&prev, &plen)) = c.free.range(..start).next_back() {
            if prev + plen == start {
                c.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(&next_len) = c.free.get(&(start + len)) {
            c.free.remove(&(start + len));
            len += next_len;
        }
        c.free.insert(start, len);
    }
}

/// Pinned host memory for weight blocks, shared by the models of a handle and handed from one
/// handle to the next. Cheap to clone; clones share the pool. The memory is freed when the pool
/// and every buffer cut from it are gone.
#[derive(Debug, Clone)]
pub struct HostPool {
    shared: Arc<Shared>,
}

impl HostPool {
    /// An empty pool on `device` (pinned memory on CUDA, plain memory on the host device), which
    /// pins chunks of at least [`DEFAULT_CHUNK_BYTES`] as requests need them.
    pub fn new(device: &Device) -> HostPool {
        HostPool::with_chunk_bytes(device, DEFAULT_CHUNK_BYTES)
    }

    /// An empty pool whose new chunks hold at least `chunk_bytes`.
    pub fn with_chunk_bytes(device: &Device, chunk_bytes: usize) -> HostPool {
        HostPool::growing(device, chunk_bytes, chunk_bytes)
    }

    /// An empty pool whose new chunks hold at least what it pinned so far, from `first_chunk`
    /// up to `max_chunk` bytes: a pool that serves little pins little, one that serves much pins
    /// it in fewer, larger chunks (pinning a large chunk runs faster per byte).
    pub fn growing(device: &Device, first_chunk: usize, max_chunk: usize) -> HostPool {
        let chunk_bytes = first_chunk.max(RANGE_ALIGN);
        HostPool {
            shared: Arc::new(Shared {
                device: device.clone(),
                chunk_bytes,
                max_chunk_bytes: max_chunk.max(chunk_bytes),
                state: Mutex::new(State { chunks: Vec::new(), stats: HostPoolStats::default() }),
            }),
        }
    }

    /// Pins `bytes` more now, in one chunk (before a model's blocks are registered, so they are
    /// cut from one allocation instead of the chunks their requests would make one by one).
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut st = self.shared.lock();
        self.pin(&mut st, bytes.next_multiple_of(RANGE_ALIGN))?;
        Ok(())
    }

    /// Whether the pool serves `device`: the same CUDA device (pinned memory belongs to the
    /// device's primary context, which every handle on that device shares), or a host device.
    pub fn is_on(&self, device: &Device) -> bool {
        let (a, b) = (self.shared.device.info(), device.info());
        a.kind == b.kind && a.index == b.index
    }

    /// The bytes a request for `bytes` takes from a chunk: whole pages, at least one.
    pub fn range_bytes(bytes: usize) -> usize {
        bytes.max(1).next_multiple_of(RANGE_ALIGN)
    }

    /// A buffer of `bytes` bytes cut from a free range, pinning a new chunk when none holds it.
    /// Its contents are whatever the range held before (callers write what they read).
    pub fn alloc(&self, bytes: usize) -> Result<HostBuffer> {
        let t0 = Instant::now();
        let len = HostPool::range_bytes(bytes);
        let mut st = self.shared.lock();
        let (chunk, offset, served) = match find(&st.chunks, len) {
            Some((c, o)) => (c, o, true),
            None => {
                let grown = (st.stats.pinned_bytes as usize).clamp(self.shared.chunk_bytes, self.shared.max_chunk_bytes);
                let c = self.pin(&mut st, len.max(grown))?;
                (c, 0, false)
            }
        };
        let c = &mut st.chunks[chunk];
        let free = c.free.remove(&offset).unwrap_or(0);
        if free > len {
            c.free.insert(offset + len, free - len);
        }
        let ptr = c.buf.as_slice().as_ptr().wrapping_add(offset) as *mut u8;
        let pinned = c.buf.is_pinned();
        st.stats.in_use_bytes += len as u64;
        if served {
            st.stats.served_bytes += len as u64;
            st.stats.serve_ms += t0.elapsed().as_secs_f64() * 1e3;
        }
        drop(st);
        // SAFETY: `ptr..ptr + bytes` lies inside chunk `chunk` (`offset + len <= chunk length`,
        // from its free map), which the pool keeps alive for as long as the buffer holds
        // `shared`; the range is removed from the free map until the buffer gives it back, so
        // no other buffer overlaps it.
        Ok(unsafe { HostBuffer::pooled(ptr, bytes, pinned, self.shared.clone(), chunk, offset, len) })
    }

    /// The least a new chunk pins.
    pub fn chunk_bytes(&self) -> usize {
        self.shared.chunk_bytes
    }

    /// The most a new chunk pins for a request smaller than it.
    pub fn max_chunk_bytes(&self) -> usize {
        self.shared.max_chunk_bytes
    }

    /// What the pool holds and did.
    pub fn stats(&self) -> HostPoolStats {
        self.shared.lock().stats
    }

    /// Pins a new chunk of `bytes`; its index.
    fn pin(&self, st: &mut State, bytes: usize) -> Result<usize> {
        let t0 = Instant::now();
        let buf = self.shared.device.alloc_host(bytes)?;
        st.stats.pin_ms += t0.elapsed().as_secs_f64() * 1e3;
        st.stats.chunks += 1;
        st.stats.pinned_bytes += bytes as u64;
        st.chunks.push(Chunk { buf, free: BTreeMap::from([(0, bytes)]) });
        Ok(st.chunks.len() - 1)
    }
}

/// The first free range of at least `len` bytes: (chunk, offset).
fn find(chunks: &[Chunk], len: usize) -> Option<(usize, usize)> {
    chunks
        .iter()
        .enumerate()
        .find_map(|(i, c)| c.free.iter().find(|(_, &l)| l >= len).map(|(&o, _)| (i, o)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_ranges_serve_the_next_requests_without_pinning() {
        let dev = Device::host(1 << 20);
        let pool = HostPool::with_chunk_bytes(&dev, 64 << 10);
        let a = pool.alloc(10_000).expect("a");
        let b = pool.alloc(20_000).expect("b");
        let s = pool.stats();
        assert_eq!((s.chunks, s.pinned_bytes), (1, 64 << 10), "both from the first chunk");
        assert_eq!(s.in_use_bytes, (12_288 + 20_480) as u64);
        assert_eq!(a.len(), 10_000);
        let (pa, pb) = (a.as_slice().as_ptr() as usize, b.as_slice().as_ptr() as usize);
        assert_eq!(pa % RANGE_ALIGN, 0);
        assert!(pb >= pa + 10_000, "ranges never overlap");
        drop(a);
        drop(b);
        assert_eq!(pool.stats().in_use_bytes, 0);
        // The freed ranges merged back into one: a request for all of them fits.
        let c = pool.alloc(64 << 10).expect("the whole chunk");
        assert_eq!(c.as_slice().as_ptr() as usize, pa);
        let s = pool.stats();
        assert_eq!((s.chunks, s.served_bytes), (1, 20_480 + (64 << 10)), "b and c served without pinning");
        // A request no range holds pins a chunk of its own size.
        let d = pool.alloc(200 << 10).expect("larger");
        assert_eq!(pool.stats().chunks, 2);
        drop((c, d));
        // Buffers outlive nothing: the pool's clones and buffers keep the chunks alive.
        let kept = pool.alloc(1000).expect("kept");
        drop(pool);
        assert_eq!(kept.as_slice().len(), 1000);
    }

    #[test]
    fn a_growing_pool_pins_larger_chunks_as_it_grows_up_to_its_largest() {
        let dev = Device::host(1 << 20);
        let pool = HostPool::growing(&dev, 4096, 32 << 10);
        // Pages one by one: chunks of 4, 4, 8, 16 and 32 KiB hold the first 16, then 32 KiB
        // chunks (the largest) the rest.
        let bufs: Vec<_> = (0..16).map(|_| pool.alloc(4096).expect("buffer")).collect();
        let s = pool.stats();
        assert_eq!((s.chunks, s.pinned_bytes), (5, 64 << 10));
        let more: Vec<_> = (0..9).map(|_| pool.alloc(4096).expect("buffer")).collect();
        let s = pool.stats();
        assert_eq!((s.chunks, s.pinned_bytes), (7, 128 << 10));
        drop((bufs, more));
        assert_eq!(pool.max_chunk_bytes(), 32 << 10);
    }

    #[test]
    fn a_reserved_chunk_serves_a_model_in_one_piece() {
        let dev = Device::host(1 << 20);
        let pool = HostPool::with_chunk_bytes(&dev, 4096);
        pool.reserve(1 << 20).expect("reserve");
        let bufs: Vec<_> = (0..8).map(|_| pool.alloc(100_000).expect("buffer")).collect();
        let s = pool.stats();
        assert_eq!(s.chunks, 1, "every block from the reserved chunk");
        assert_eq!(s.served_bytes, 8 * 102_400);
        drop(bufs);
    }
}
