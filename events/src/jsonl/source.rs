//! The decoded bytes of telemetry, with where each byte comes from.
//!
//! A [`ByteSource`] hands out a file's decoded bytes a piece at a time, like `BufRead`, and says
//! where they start ([`Position`]: a segment of a rotated run, a byte of it to decode from, and
//! decoded bytes to skip), so that a reader can come back to any line later. Between the bytes
//! it says where compressed frames begin, what was damaged, where a rotated run's next segment
//! begins, and whether a file being written has nothing more yet.
//!
//! [`RunSource`] reads a telemetry file as one logical stream: plain or zstd (told apart by
//! the first bytes), across the segments of a rotated run. A missing segment is an error that
//! names it, never a silent end.

use super::rotation;
use super::zst::{self, ZstdStream};
use std::fs::File;
use std::io::{self, BufRead, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Where a line starts: open segment `segment`, start decoding at byte `raw` (a frame's start
/// in a compressed file, the line itself in a plain one) and skip `skip` decoded bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position {
    pub segment: u32,
    pub raw: u64,
    pub skip: u64,
}

impl Position {
    /// The position `n` decoded bytes further (within the same piece of data).
    pub(crate) fn plus(self, n: usize, compressed: bool) -> Position {
        if compressed {
            Position { skip: self.skip + n as u64, ..self }
        } else {
            Position { raw: self.raw + n as u64, ..self }
        }
    }
}

/// A damaged place in a compressed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// Where the damaged frame (or the bytes that are no frame) starts.
    pub at: Position,
    /// Events the damaged frame held, when its record says.
    pub events: Option<u64>,
    /// The frame began (its `Frame` piece and some of its bytes were handed out) before the
    /// damage showed.
    pub began: bool,
    pub detail: String,
}

/// One piece of a decoded stream.
#[derive(Debug)]
pub enum Piece<'a> {
    /// Decoded bytes; `at` is where the first one comes from. Stays until consumed.
    Data { bytes: &'a [u8], at: Position, compressed: bool },
    /// A compressed frame begins; its record says how many events it holds.
    Frame { events: Option<u64> },
    /// A frame record says `before` events were written to this file (segment) before its
    /// frame: lets a reader count what damage without records lost.
    Count { before: u64 },
    /// Something was damaged and skipped.
    Damage(Damage),
    /// The next segment of a rotated run begins.
    Segment { index: u32, path: PathBuf },
    /// A file being followed has nothing more for now.
    Pending,
    /// The end.
    End,
}

/// Decoded telemetry bytes with their positions (see the module's doc).
pub trait ByteSource: Send {
    /// The next piece. `Data` is returned again until consumed; every other piece once.
    fn fill(&mut self) -> io::Result<Piece<'_>>;
    /// Consumes `n` bytes of the `Data` last returned.
    fn consume(&mut self, n: usize);
    /// Raw bytes read so far (for progress).
    fn raw_read(&self) -> u64;
}

/// Plain bytes from any `BufRead` (tests, standard input): one segment, positions are offsets.
#[derive(Debug)]
pub struct Plain<R> {
    inner: R,
    offset: u64,
}

impl<R: BufRead> Plain<R> {
    /// Bytes of `inner`, the first at offset `offset`.
    pub fn new(inner: R, offset: u64) -> Plain<R> {
        Plain { inner, offset }
    }
}

impl<R: BufRead + Send> ByteSource for Plain<R> {
    fn fill(&mut self) -> io::Result<Piece<'_>> {
        let at = Position { segment: 0, raw: self.offset, skip: 0 };
        loop {
            match self.inner.fill_buf() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
                Ok(_) => break,
            }
        }
        Ok(match self.inner.fill_buf()? {
            [] => Piece::End,
            bytes => Piece::Data { bytes, at, compressed: false },
        })
    }

    fn consume(&mut self, n: usize) {
        self.inner.consume(n);
        self.offset += n as u64;
    }

    fn raw_read(&self) -> u64 {
        self.offset
    }
}

/// Bytes read from a plain input at a time.
const PLAIN_CHUNK: usize = 256 << 10;

/// Plain input that may grow.
#[derive(Debug)]
struct PlainInput<R> {
    src: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The offset of `buf[start]`.
    at: u64,
    segment: u32,
}

/// What the input turned out to be.
#[derive(Debug)]
enum Kind<R> {
    /// Not known yet: fewer than four bytes are there (a file just created).
    Unknown { src: Option<R>, head: Vec<u8>, at: Position },
    Plain(PlainInput<R>),
    Zstd(Box<ZstdStream<Prefixed<R>>>),
}

/// One input (a file, one segment of a run, standard input), plain or compressed as its first
/// bytes say, decoded.
#[derive(Debug)]
pub struct Stream<R> {
    kind: Kind<R>,
    follow: bool,
    path: PathBuf,
}

impl<R: Read + Send> Stream<R> {
    /// Decodes `src` (named `label` in messages), which starts at the input's first byte;
    /// when `follow`, its end means "nothing more yet".
    pub fn new(src: R, label: impl Into<PathBuf>, follow: bool) -> io::Result<Stream<R>> {
        Stream::start(src, label.into(), 0, follow)
    }

    /// Decodes `src`, the first byte of segment `segment`.
    fn start(src: R, label: PathBuf, segment: u32, follow: bool) -> io::Result<Stream<R>> {
        let at = Position { segment, raw: 0, skip: 0 };
        let mut s = Stream { kind: Kind::Unknown { src: Some(src), head: Vec::new(), at }, follow, path: label };
        s.try_decide()?;
        Ok(s)
    }

    /// Decodes `src`, which starts at `at` of an input known to be `compressed` or not.
    fn at(src: R, label: &Path, at: Position, compressed: bool, follow: bool) -> io::Result<Stream<R>> {
        let mut s = Stream { kind: Kind::Unknown { src: Some(src), head: Vec::new(), at }, follow, path: label.to_path_buf() };
        s.decide(compressed)?;
        Ok(s)
    }

    /// Decides plain or compressed once the first bytes tell (or the input is final).
    fn try_decide(&mut self) -> io::Result<()> {
        let follow = self.follow;
        let decision = {
            let Kind::Unknown { src: Some(src), head, .. } = &mut self.kind else { return Ok(()) };
            loop {
                let want = match zst::sniff(head, false) {
                    Some(compressed) => break Some(compressed),
                    None if head.len() < 4 => 4 - head.len(),
                    None => zst::SNIFF_BYTES.saturating_sub(head.len()).max(1),
                };
                let len = head.len();
                head.resize(len + want, 0);
                let n = read_full(src, &mut head[len..])?;
                head.truncate(len + n);
                if n < want {
                    // No more for now: decide if that is all, else wait for more.
                    break zst::sniff(head, !follow);
                }
            }
        };
        match decision {
            Some(compressed) => self.decide(compressed),
            None => Ok(()),
        }
    }

    fn decide(&mut self, compressed: bool) -> io::Result<()> {
        let Kind::Unknown { src, head, at } = &mut self.kind else { return Ok(()) };
        let (Some(src), head, at) = (src.take(), std::mem::take(head), *at) else { return Ok(()) };
        // The bytes already read go first.
        self.kind = if compressed {
            let mut z = ZstdStream::new(Prefixed::new(head, src), at.raw, at.skip, at.segment)?;
            z.set_follow(self.follow);
            Kind::Zstd(Box::new(z))
        } else {
            let mut buf = vec![0u8; PLAIN_CHUNK].into_boxed_slice();
            buf[..head.len()].copy_from_slice(&head);
            Kind::Plain(PlainInput { src, buf, start: 0, end: head.len(), at: at.raw, segment: at.segment })
        };
        Ok(())
    }

    /// Whether the input may still grow.
    pub fn set_follow(&mut self, follow: bool) {
        self.follow = follow;
        if let Kind::Zstd(z) = &mut self.kind {
            z.set_follow(follow);
        }
    }

    /// What the input is called in messages.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl<R: Read + Send> ByteSource for Stream<R> {
    fn fill(&mut self) -> io::Result<Piece<'_>> {
        if matches!(self.kind, Kind::Unknown { .. }) {
            self.try_decide()?;
        }
        match &mut self.kind {
            Kind::Unknown { .. } => Ok(Piece::Pending),
            Kind::Zstd(z) => z.fill(),
            Kind::Plain(p) => {
                if p.start == p.end {
                    let n = loop {
                        match p.src.read(&mut p.buf) {
                            Ok(n) => break n,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    };
                    p.start = 0;
                    p.end = n;
                    if n == 0 {
                        return Ok(if self.follow { Piece::Pending } else { Piece::End });
                    }
                }
                let at = Position { segment: p.segment, raw: p.at, skip: 0 };
                Ok(Piece::Data { bytes: &p.buf[p.start..p.end], at, compressed: false })
            }
        }
    }

    fn consume(&mut self, n: usize) {
        match &mut self.kind {
            Kind::Unknown { .. } => {}
            Kind::Zstd(z) => z.consume(n),
            Kind::Plain(p) => {
                let n = n.min(p.end - p.start);
                p.start += n;
                p.at += n as u64;
            }
        }
    }

    fn raw_read(&self) -> u64 {
        match &self.kind {
            Kind::Unknown { head, .. } => head.len() as u64,
            Kind::Zstd(z) => z.raw_read(),
            Kind::Plain(p) => p.at + (p.end - p.start) as u64,
        }
    }
}

fn open_file(path: &Path) -> io::Result<File> {
    let file = File::open(path)?;
    if file.metadata()?.is_dir() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "is a folder, not a telemetry file"));
    }
    Ok(file)
}

/// Segment `at.segment` of a run (at `path`), opened at `at`.
fn open_segment(path: &Path, at: Position, follow: bool) -> io::Result<Stream<File>> {
    let mut file = open_file(path)?;
    if at.raw == 0 && at.skip == 0 {
        return Stream::start(file, path.to_path_buf(), at.segment, follow);
    }
    // Opened inside: the kind is what the first bytes say.
    let mut head = vec![0u8; zst::SNIFF_BYTES];
    let n = read_full(&mut file, &mut head)?;
    head.truncate(n);
    file.seek(SeekFrom::Start(at.raw))?;
    Stream::at(file, path, at, zst::sniff(&head, true).unwrap_or(false), follow)
}

/// Bytes already read, then the rest of a reader.
#[derive(Debug)]
pub(crate) struct Prefixed<R> {
    head: Vec<u8>,
    at: usize,
    rest: R,
}

impl<R> Prefixed<R> {
    pub(crate) fn new(head: Vec<u8>, rest: R) -> Prefixed<R> {
        Prefixed { head, at: 0, rest }
    }
}

impl<R: Read> Read for Prefixed<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.at < self.head.len() {
            let n = (self.head.len() - self.at).min(buf.len());
            buf[..n].copy_from_slice(&self.head[self.at..self.at + n]);
            self.at += n;
            return Ok(n);
        }
        self.rest.read(buf)
    }
}

/// Reads until `buf` is full or the end of the file.
pub(crate) fn read_full(f: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A telemetry file read as one stream: plain or compressed, across a rotated run's segments.
#[derive(Debug)]
pub struct RunSource {
    base: PathBuf,
    index: u32,
    current: Stream<File>,
    /// Segments known to exist after the current one (read mode: listed at open).
    last: u32,
    follow: bool,
    /// Raw bytes of the segments finished before the current one.
    done_bytes: u64,
}

impl RunSource {
    /// Opens the run whose first segment is `base`, from `at`. Every segment from the first to
    /// the last that exists must be there: a gap is an error naming the missing one. When
    /// `follow`, the file (and the run) may still grow.
    pub fn open(base: &Path, at: Position, follow: bool) -> io::Result<RunSource> {
        let segments = rotation::list(base)?;
        let last = segments.len().saturating_sub(1) as u32;
        if at.segment > last {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("segment {} of the run is not there", rotation::segment_path(base, at.segment).display()),
            ));
        }
        let path = rotation::segment_path(base, at.segment);
        // A segment with a later one is complete, whatever `follow` says.
        let current = open_segment(&path, at, follow && at.segment == last)?;
        Ok(RunSource { base: base.to_path_buf(), index: at.segment, current, last, follow, done_bytes: 0 })
    }

    /// The first segment's path.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The segment being read.
    pub fn current_path(&self) -> &Path {
        &self.current.path
    }

    /// The index of the segment being read.
    pub fn current_index(&self) -> u32 {
        self.index
    }

    /// Raw bytes of the segment being read, read so far.
    pub fn current_raw_read(&self) -> u64 {
        self.current.raw_read()
    }

    /// Whether a later segment exists (so the current one is complete); an error when a
    /// segment after the next exists without the next (a gap).
    fn next_exists(&mut self) -> io::Result<bool> {
        if self.index < self.last {
            return Ok(true);
        }
        if !self.follow {
            return Ok(false);
        }
        let next = rotation::segment_path(&self.base, self.index + 1);
        if next.exists() {
            self.last = self.index + 1;
            return Ok(true);
        }
        // A later segment without the next one (deleted, or never written) is a gap.
        rotation::list(&self.base).map(|_| false)
    }
}

/// What a piece was, without its bytes.
pub(crate) enum Peeked {
    Data,
    Other(Piece<'static>),
    Pending,
    End,
}

/// `p` without its borrow: data is only noted (asking again returns it again).
pub(crate) fn peeked(p: Piece<'_>) -> Peeked {
    match p {
        Piece::Data { .. } => Peeked::Data,
        Piece::Frame { events } => Peeked::Other(Piece::Frame { events }),
        Piece::Count { before } => Peeked::Other(Piece::Count { before }),
        Piece::Damage(d) => Peeked::Other(Piece::Damage(d)),
        Piece::Segment { index, path } => Peeked::Other(Piece::Segment { index, path }),
        Piece::Pending => Peeked::Pending,
        Piece::End => Peeked::End,
    }
}

impl ByteSource for RunSource {
    fn fill(&mut self) -> io::Result<Piece<'_>> {
        loop {
            match peeked(self.current.fill()?) {
                Peeked::Data => return self.current.fill(),
                Peeked::Other(p) => return Ok(p),
                Peeked::Pending if self.next_exists()? => {
                    // The segment is complete: what is cut off at its end is damage now.
                    self.current.set_follow(false);
                }
                Peeked::Pending => return Ok(Piece::Pending),
                Peeked::End if self.next_exists()? => {
                    self.done_bytes += self.current.raw_read();
                    self.index += 1;
                    let path = rotation::segment_path(&self.base, self.index);
                    let start = Position { segment: self.index, raw: 0, skip: 0 };
                    self.current = open_segment(&path, start, self.follow && self.index >= self.last).map_err(|e| {
                        if e.kind() == io::ErrorKind::NotFound {
                            io::Error::new(
                                io::ErrorKind::NotFound,
                                format!(
                                    "segment '{}' of the rotated run '{}' is missing: it was there, and is no more",
                                    path.display(),
                                    self.base.display()
                                ),
                            )
                        } else {
                            e
                        }
                    })?;
                    return Ok(Piece::Segment { index: self.index, path });
                }
                Peeked::End => return Ok(Piece::End),
            }
        }
    }

    fn consume(&mut self, n: usize) {
        self.current.consume(n);
    }

    fn raw_read(&self) -> u64 {
        self.done_bytes + self.current.raw_read()
    }
}
