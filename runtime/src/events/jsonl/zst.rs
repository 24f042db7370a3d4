//! zstd framing for telemetry files.
//!
//! The sink compresses each batch it writes into its own zstd frame. A file is then a sequence
//! of independent frames, which zstd decodes as one stream, and which lets a writer roll a failed
//! batch back, a follower decode a growing file frame by frame, and the replay index start
//! decoding at any frame.

use std::io::{self, BufRead, Read};
use std::sync::{Arc, Mutex};

/// The first four bytes of every zstd frame.
pub const MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// Compression level of written files (fast, about 10x on telemetry).
pub const LEVEL: i32 = 3;
/// Largest compressed frame a follower or the index holds whole; the sink's frames are far
/// smaller (one batch each).
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// True when `head` starts like a zstd frame.
pub fn is_zstd(head: &[u8]) -> bool {
    head.starts_with(&MAGIC)
}

/// A decoder of every frame in `r`.
pub(crate) fn decoder<R: BufRead>(r: R) -> io::Result<zstd::stream::read::Decoder<'static, R>> {
    zstd::stream::read::Decoder::with_buffer(r)
}

/// `data` compressed as one frame.
pub(crate) fn compress_frame(data: &[u8]) -> io::Result<Vec<u8>> {
    zstd::bulk::compress(data, LEVEL)
}

/// Length of the complete frame at the start of `raw`, or `None` while it is incomplete.
pub(crate) fn frame_len(raw: &[u8]) -> Option<usize> {
    zstd::zstd_safe::find_frame_compressed_size(raw)
        .ok()
        .filter(|n| *n > 0 && *n <= raw.len())
}

/// Decodes one frame, handing the output to `out` in chunks (never all at once: a small frame
/// can decode to a lot).
pub(crate) fn decode_frame(frame: &[u8], mut out: impl FnMut(&[u8])) -> io::Result<()> {
    let mut d = zstd::stream::read::Decoder::with_buffer(frame)?.single_frame();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match d.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => out(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// What went wrong with a compressed stream, shared between a [`Lenient`] decoder and the reader
/// that reports it.
pub(crate) type Damage = Arc<Mutex<Option<String>>>;

/// The decoded bytes of a compressed stream, where damaged or cut-off data ends the stream the
/// way a cut-off plain file ends, instead of failing the whole read: a writer killed mid-frame
/// leaves an incomplete last frame, and the events before it are still good. What happened is
/// kept in the [`Damage`] for the reader's report.
pub(crate) struct Lenient<R: BufRead> {
    inner: zstd::stream::read::Decoder<'static, R>,
    damage: Damage,
}

impl<R: BufRead> Lenient<R> {
    pub(crate) fn new(r: R) -> io::Result<(Lenient<R>, Damage)> {
        let damage = Damage::default();
        Ok((Lenient { inner: decoder(r)?, damage: damage.clone() }, damage))
    }
}

impl<R: BufRead> Read for Lenient<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.inner.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let mut d = self.damage.lock().unwrap_or_else(|p| p.into_inner());
                    d.get_or_insert_with(|| format!("compressed data ends damaged or cut off: {e}"));
                    return Ok(0);
                }
                ok => return ok,
            }
        }
    }
}
