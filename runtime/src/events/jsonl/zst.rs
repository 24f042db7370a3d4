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

/// What went wrong with a compressed stream, shared between a [`Frames`] decoder and the reader
/// that reports it: one entry per damaged place, taken by the reader as it goes.
pub(crate) type Damage = Arc<Mutex<DamageLog>>;

/// Damaged places not yet reported: messages for the first ones, a count for the rest (a file
/// of nothing but damaged frames must not grow memory).
#[derive(Debug, Default)]
pub(crate) struct DamageLog {
    pub(crate) messages: Vec<String>,
    pub(crate) more: u64,
}

/// Messages a [`DamageLog`] holds before it only counts.
const DAMAGE_MESSAGES: usize = 100;

fn note(damage: &Damage, msg: String) {
    let mut d = damage.lock().unwrap_or_else(|p| p.into_inner());
    if d.messages.len() < DAMAGE_MESSAGES {
        d.messages.push(msg);
    } else {
        d.more = d.more.saturating_add(1);
    }
}

/// Decodes one frame held in memory.
type FrameDecoder = zstd::stream::read::Decoder<'static, io::BufReader<io::Cursor<Vec<u8>>>>;
/// Decodes what is left of a stream (held bytes, then the source).
type StreamDecoder<R> = zstd::stream::read::Decoder<'static, io::BufReader<io::Chain<io::Cursor<Vec<u8>>, R>>>;

/// The decoded bytes of a compressed stream, frame by frame. A damaged frame is skipped and the
/// frames after it still read; an incomplete last frame (a writer killed mid-frame) ends the
/// stream the way a cut-off plain file ends. Either is kept in the [`Damage`] for the reader's
/// report instead of failing the whole read. A frame too large to hold (a foreign file written
/// as one frame) is decoded as a stream from there on.
pub(crate) struct Frames<R: Read> {
    src: Option<R>,
    raw: Vec<u8>,
    eof: bool,
    current: Option<FrameDecoder>,
    tail: Option<StreamDecoder<R>>,
    damage: Damage,
}

impl<R: Read> Frames<R> {
    pub(crate) fn new(src: R) -> (Frames<R>, Damage) {
        let damage = Damage::default();
        let f = Frames { src: Some(src), raw: Vec::new(), eof: false, current: None, tail: None, damage: damage.clone() };
        (f, damage)
    }
}

impl<R: Read> Read for Frames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(t) = &mut self.tail {
                return match t.read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        note(&self.damage, format!("compressed data ends damaged or cut off: {e}"));
                        self.tail = None;
                        self.eof = true;
                        Ok(0)
                    }
                    ok => ok,
                };
            }
            if let Some(d) = &mut self.current {
                match d.read(buf) {
                    Ok(0) => self.current = None,
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        note(&self.damage, format!("a damaged compressed frame was skipped: {e}"));
                        self.current = None;
                    }
                }
                continue;
            }
            if let Some(n) = frame_len(&self.raw) {
                let frame: Vec<u8> = self.raw.drain(..n).collect();
                self.current = Some(zstd::stream::read::Decoder::new(io::Cursor::new(frame))?.single_frame());
                continue;
            }
            if self.eof {
                if !self.raw.is_empty() {
                    note(&self.damage, format!("{} bytes of an incomplete compressed frame at the end", self.raw.len()));
                    self.raw.clear();
                }
                return Ok(0);
            }
            if self.raw.len() > MAX_FRAME_BYTES {
                if let Some(src) = self.src.take() {
                    let rest = io::Cursor::new(std::mem::take(&mut self.raw)).chain(src);
                    self.tail = Some(zstd::stream::read::Decoder::new(rest)?);
                    continue;
                }
            }
            let Some(src) = &mut self.src else { return Ok(0) };
            let mut chunk = [0u8; 64 * 1024];
            match src.read(&mut chunk) {
                Ok(0) => self.eof = true,
                Ok(k) => self.raw.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}
