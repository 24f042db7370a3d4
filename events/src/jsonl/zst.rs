//! zstd framing for telemetry files, and a decoder that streams within frames.
//!
//! The sink compresses each batch it writes into its own zstd frame, preceded by a *frame
//! record*: a zstd skippable frame (which every zstd decoder passes over, `zstd -d` included)
//! holding the number of events in the frame, its decoded and compressed sizes, a CRC32C of
//! its compressed bytes, the events written to the file (segment) before it, and a CRC32C of
//! the record itself. The running count lets a reader count exactly the events lost even where
//! damage destroyed records too. A file is then a sequence of independent frames, which lets a writer
//! roll a failed batch back, a follower decode a growing file frame by frame, and the replay
//! index start decoding at any frame.
//!
//! [`ZstdStream`] decodes such a file (or any zstd file) in bounded memory, whatever it holds:
//!
//! - it streams within a frame: at most one output window ([`OUT_CHUNK`]) of decoded bytes is
//!   held, and the decoder's window is at most 2^[`WINDOW_LOG_MAX`] bytes;
//! - a frame may decode to at most [`MAX_RATIO`] times its compressed size (and never to more
//!   than its record says), and a whole file to at most that ratio of its size: a small file
//!   that decodes to gigabytes is refused, not decoded;
//! - a frame whose record's checksum does not match, or that fails to decode, costs that frame:
//!   the stream resynchronises on the next frame and reports the loss in events (exact where the
//!   frame had a record).

use super::source::{Damage, Piece, Position};
use std::collections::VecDeque;
use std::io::{self, Read};
use zstd::stream::raw::{DParameter, Decoder, InBuffer, Operation, OutBuffer};

/// The first four bytes of every zstd frame.
pub const MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// The first four bytes of a frame record (a zstd skippable frame, magic `0x184D2A5E`).
pub const RECORD_MAGIC: [u8; 4] = [0x5E, 0x2A, 0x4D, 0x18];
/// What a frame record's payload starts with (a skippable frame of another tool does not).
const RECORD_TAG: [u8; 4] = *b"SHF1";
/// Bytes of a record's payload, little-endian: the tag, then events, decoded and compressed
/// sizes and the frame's CRC32C (`u32` each), the events before it (`u64`), and the CRC32C of
/// the payload before it (`u32`).
const RECORD_PAYLOAD: usize = 32;
/// Bytes of a whole frame record.
pub const RECORD_BYTES: usize = 8 + RECORD_PAYLOAD;
/// Compression level of written files (fast, about 10x on telemetry).
pub const LEVEL: i32 = 3;
/// The largest decoding window accepted (16 MiB): a frame that asks for more is damaged. The
/// sink's frames decode to at most [`MAX_FRAME_DECODED`] bytes.
pub const WINDOW_LOG_MAX: u32 = 24;
/// Decoded bytes of the largest frame the sink writes (batches are cut before this).
pub const MAX_FRAME_DECODED: usize = 8 << 20;
/// Most decoded bytes per compressed byte. Telemetry compresses about 10 to 30 times; a frame
/// (or a file) that decodes to more is not telemetry, and decoding it would only cost time.
pub const MAX_RATIO: u64 = 256;
/// Decoded bytes allowed beyond the ratio: one full zstd block, and the start of a stream.
const RATIO_SLACK: u64 = 1 << 20;
/// Largest compressed frame that is checked against its record before it is decoded (the
/// frame is held while checked); a larger one streams unchecked.
const MAX_CHECKED: u64 = 32 << 20;
/// Bytes of a frame without a record kept for resynchronising inside it after damage.
const MAX_HELD: u64 = 8 << 20;
/// Decoding work (bytes fed to the decoder and searched for frames) per byte read, at most.
const MAX_WORK: u64 = 64;
/// Bytes read from the source at a time.
const READ_CHUNK: usize = 128 << 10;
/// Decoded bytes handed out at a time.
pub const OUT_CHUNK: usize = 128 << 10;

/// True when `head` starts like a compressed telemetry file: a zstd frame or a skippable frame
/// (a frame record).
pub fn is_zstd(head: &[u8]) -> bool {
    head.starts_with(&MAGIC) || is_skippable(head)
}

/// Whether `head` starts a zstd skippable frame (magic `0x184D2A5?`).
fn is_skippable(head: &[u8]) -> bool {
    head.len() >= 4 && head[0] & 0xF0 == 0x50 && head[1..4] == RECORD_MAGIC[1..4]
}

/// The start of a frame record, as bytes: no line of JSON holds them (NUL and control bytes).
const RECORD_SIGNATURE: [u8; 12] = [0x5E, 0x2A, 0x4D, 0x18, RECORD_PAYLOAD as u8, 0, 0, 0, b'S', b'H', b'F', b'1'];
/// Bytes looked at for a frame record when a file's first bytes say neither JSON nor zstd (a
/// compressed file whose start was damaged).
pub(crate) const SNIFF_BYTES: usize = 64 << 10;

/// What the first bytes of an input say it is: `Some(true)` compressed, `Some(false)` plain,
/// `None` not yet known (more bytes could tell). `complete`: no more bytes will come.
pub(crate) fn sniff(head: &[u8], complete: bool) -> Option<bool> {
    if head.len() < 4 && could_be_zstd(head) && !complete {
        return None;
    }
    if is_zstd(head) {
        return Some(true);
    }
    match head.first() {
        None => Some(false),
        // JSON lines start with an object (or blank space).
        Some(b) if *b == b'{' || b.is_ascii_whitespace() => Some(false),
        // Neither: a compressed file whose first bytes were damaged has a frame record soon.
        Some(_) => {
            let found = head.windows(RECORD_SIGNATURE.len()).any(|w| w == RECORD_SIGNATURE);
            if found {
                Some(true)
            } else if complete || head.len() >= SNIFF_BYTES {
                Some(false)
            } else {
                None
            }
        }
    }
}

/// Whether `head` (fewer than 4 bytes so far) could still start a compressed file.
pub(crate) fn could_be_zstd(head: &[u8]) -> bool {
    match head.split_first() {
        None => true,
        Some((first, rest)) => {
            head.len() < 4 && (MAGIC.starts_with(head) || (first & 0xF0 == 0x50 && RECORD_MAGIC[1..].starts_with(rest)))
        }
    }
}

/// The first place in `hay` where a zstd frame or a frame record starts.
fn find_frame(hay: &[u8]) -> Option<usize> {
    memchr::memchr2_iter(MAGIC[0], RECORD_MAGIC[0], hay).find(|&i| {
        let w = &hay[i..];
        w.starts_with(&MAGIC) || w.starts_with(&RECORD_MAGIC)
    })
}

/// What a frame record says about the data frame after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameRecord {
    pub(crate) events: u32,
    pub(crate) decoded: u32,
    pub(crate) compressed: u32,
    pub(crate) crc: u32,
    /// Events written to the file (segment) before this frame.
    pub(crate) before: u64,
}

impl FrameRecord {
    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[..4].copy_from_slice(&RECORD_MAGIC);
        b[4..8].copy_from_slice(&(RECORD_PAYLOAD as u32).to_le_bytes());
        b[8..12].copy_from_slice(&RECORD_TAG);
        b[12..16].copy_from_slice(&self.events.to_le_bytes());
        b[16..20].copy_from_slice(&self.decoded.to_le_bytes());
        b[20..24].copy_from_slice(&self.compressed.to_le_bytes());
        b[24..28].copy_from_slice(&self.crc.to_le_bytes());
        b[28..36].copy_from_slice(&self.before.to_le_bytes());
        let own = crc32c::crc32c(&b[8..36]);
        b[36..40].copy_from_slice(&own.to_le_bytes());
        b
    }

    /// A record from its payload, when it is one of ours and its sizes are possible.
    fn parse(payload: &[u8]) -> Option<FrameRecord> {
        if payload.len() != RECORD_PAYLOAD || payload[..4] != RECORD_TAG {
            return None;
        }
        let word = |i: usize| u32::from_le_bytes([payload[i], payload[i + 1], payload[i + 2], payload[i + 3]]);
        if crc32c::crc32c(&payload[..28]) != word(28) {
            return None;
        }
        let before = u64::from(word(20)) | (u64::from(word(24)) << 32);
        let r = FrameRecord { events: word(4), decoded: word(8), compressed: word(12), crc: word(16), before };
        // A record that claims more than a frame may hold is as damaged as its frame.
        let plausible = r.compressed > 0
            && u64::from(r.decoded) <= MAX_RATIO * u64::from(r.compressed) + RATIO_SLACK
            && u64::from(r.events) <= u64::from(r.decoded);
        plausible.then_some(r)
    }
}

/// `data` (holding `events` lines) compressed as one frame, after its frame record; `before`
/// events were written to the file (segment) before it.
pub(crate) fn compress_frame(data: &[u8], events: u64, before: u64) -> io::Result<Vec<u8>> {
    let frame = zstd::bulk::compress(data, LEVEL)?;
    let too_big = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("a frame {what} is over 4 GiB"));
    let record = FrameRecord {
        events: u32::try_from(events).map_err(|_| too_big("of events"))?,
        decoded: u32::try_from(data.len()).map_err(|_| too_big("decoded"))?,
        compressed: u32::try_from(frame.len()).map_err(|_| too_big("compressed"))?,
        crc: crc32c::crc32c(&frame),
        before,
    };
    let mut out = Vec::with_capacity(RECORD_BYTES + frame.len());
    out.extend_from_slice(&record.encode());
    out.extend_from_slice(&frame);
    Ok(out)
}

/// Where the decoder is.
#[derive(Debug)]
enum State {
    /// At a frame boundary; `record` is a record read just before (its offset, and it).
    Between { record: Option<(u64, FrameRecord)> },
    /// Inside a data frame.
    InFrame(InFrame),
    /// Nothing more will come.
    Ended,
}

#[derive(Debug)]
struct InFrame {
    /// Where the frame's group starts (its record, or the frame itself): positions decode from
    /// here.
    group_at: u64,
    /// The frame's first byte.
    frame_at: u64,
    record: Option<FrameRecord>,
    /// The frame was checked against its record: its compressed bytes are known good.
    checked: bool,
    consumed: u64,
    decoded: u64,
}

/// The decoded bytes of a compressed telemetry stream, frame by frame, in bounded memory (see
/// the module's doc). Offsets are the source's, from `raw_at` on.
pub(crate) struct ZstdStream<R> {
    src: R,
    /// Raw bytes held: `raw[0]` is at source offset `raw_at`.
    raw: Vec<u8>,
    raw_at: u64,
    /// The next raw byte to look at (a source offset).
    next: u64,
    /// Raw bytes read from the source so far.
    read_total: u64,
    /// The source may grow (a file being written): its end is "not yet", not "the end".
    follow: bool,
    dec: Decoder<'static>,
    state: State,
    out: Box<[u8]>,
    out_start: usize,
    out_end: usize,
    out_at: Position,
    /// Decoded bytes still to drop before handing any out (opened inside a frame).
    skip_left: u64,
    decoded_total: u64,
    work: u64,
    /// The last thing seen was damage: bytes that are no frame right after it are part of it.
    after_damage: bool,
    segment: u32,
    notices: VecDeque<Piece<'static>>,
}

impl<R> std::fmt::Debug for ZstdStream<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZstdStream").field("next", &self.next).field("state", &self.state).finish_non_exhaustive()
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl<R: Read> ZstdStream<R> {
    /// Decodes `src`, whose first byte is at offset `at` (of segment `segment`), dropping the
    /// first `skip` decoded bytes.
    pub(crate) fn new(src: R, at: u64, skip: u64, segment: u32) -> io::Result<ZstdStream<R>> {
        let mut dec = Decoder::new()?;
        dec.set_parameter(DParameter::WindowLogMax(WINDOW_LOG_MAX))?;
        Ok(ZstdStream {
            src,
            raw: Vec::new(),
            raw_at: at,
            next: at,
            read_total: 0,
            follow: false,
            dec,
            state: State::Between { record: None },
            out: vec![0u8; OUT_CHUNK].into_boxed_slice(),
            out_start: 0,
            out_end: 0,
            out_at: Position { segment, raw: at, skip: 0 },
            skip_left: skip,
            decoded_total: 0,
            work: 0,
            after_damage: false,
            segment,
            notices: VecDeque::new(),
        })
    }

    /// Whether the source may still grow (its end then means "pending").
    pub(crate) fn set_follow(&mut self, follow: bool) {
        self.follow = follow;
    }

    /// Raw bytes read so far.
    pub(crate) fn raw_read(&self) -> u64 {
        self.read_total
    }

    /// The source offset just past what was read.
    fn raw_end(&self) -> u64 {
        self.raw_at + self.raw.len() as u64
    }

    /// Reads more raw bytes; false at the source's end (for now).
    fn read_more(&mut self) -> io::Result<bool> {
        self.compact();
        let len = self.raw.len();
        self.raw.resize(len + READ_CHUNK, 0);
        loop {
            match self.src.read(&mut self.raw[len..]) {
                Ok(n) => {
                    self.raw.truncate(len + n);
                    self.read_total += n as u64;
                    return Ok(n > 0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.raw.truncate(len);
                    return Err(e);
                }
            }
        }
    }

    /// Makes sure `n` bytes from `next` are held; false when the source ends first.
    fn want(&mut self, n: u64) -> io::Result<bool> {
        while self.raw_end() < self.next + n {
            if !self.read_more()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Drops held bytes nothing can need again.
    fn compact(&mut self) {
        let keep_from = match &self.state {
            // A frame without a checked record may be damaged: keep it to resynchronise inside.
            State::InFrame(f) if !f.checked && self.next - f.frame_at <= MAX_HELD => f.frame_at + 1,
            State::InFrame(f) if f.checked => f.frame_at,
            _ => self.next,
        };
        let drop = keep_from.saturating_sub(self.raw_at).min(self.raw.len() as u64) as usize;
        if drop > 0 && (drop >= self.raw.len() / 2 || drop > 1 << 20) {
            self.raw.drain(..drop);
            self.raw_at += drop as u64;
        }
    }

    fn held(&self, from: u64, to: u64) -> &[u8] {
        let a = (from - self.raw_at) as usize;
        let b = (to - self.raw_at) as usize;
        &self.raw[a..b]
    }

    fn damage(&mut self, at: u64, events: Option<u64>, began: bool, detail: String) {
        let at = Position { segment: self.segment, raw: at, skip: 0 };
        self.notices.push_back(Piece::Damage(Damage { at, events, began, detail }));
    }

    /// After damage in the frame starting at `frame_at`: where to look for the next frame.
    fn resync_after(&mut self, frame_at: u64, record: Option<FrameRecord>) {
        // The record says where the frame ends; without one, anywhere after its first byte.
        let target = frame_at + record.map_or(1, |r| u64::from(r.compressed));
        if target >= self.raw_at {
            self.next = target;
        }
        self.after_damage = true;
        self.state = State::Between { record: None };
    }

    /// Counts decoding work (bytes fed to the decoder, bytes searched for a frame): however a
    /// file is damaged, reading it costs a bounded multiple of its size.
    fn work(&mut self, n: u64) -> io::Result<()> {
        self.work = self.work.saturating_add(n);
        if self.work > MAX_WORK * self.read_total + (64 << 20) {
            return Err(invalid(format!(
                "damaged beyond repair: {} bytes read took {} bytes of decoding and searching for frames; the rest is not read",
                self.read_total, self.work
            )));
        }
        Ok(())
    }

    /// At the source's end inside something incomplete: pending when following, else damage.
    fn at_end(&mut self) -> Option<Piece<'static>> {
        if self.follow {
            return Some(Piece::Pending);
        }
        let held = self.raw_end().saturating_sub(self.next);
        match std::mem::replace(&mut self.state, State::Ended) {
            State::InFrame(f) => self.damage(
                f.group_at,
                f.record.map(|r| u64::from(r.events)),
                true,
                format!("an incomplete compressed frame at byte {} (the file ends inside it)", f.frame_at),
            ),
            State::Between { record: Some((at, r)) } => self.damage(
                at,
                Some(u64::from(r.events)),
                false,
                format!("an incomplete compressed frame at byte {at} (the file ends inside it)"),
            ),
            State::Between { record: None } if held > 0 => self.damage(
                self.next,
                None,
                false,
                format!("{held} bytes at the end that are not a whole compressed frame"),
            ),
            _ => {}
        }
        None
    }

    /// Skips bytes that start no frame, up to the next frame or record.
    fn skip_garbage(&mut self, record: Option<(u64, FrameRecord)>) -> io::Result<()> {
        let from = self.next;
        let mut at = from + 1;
        let found = loop {
            let end = self.raw_end();
            if at + 4 <= end {
                let hit = find_frame(self.held(at, end));
                self.work(end - at)?;
                if let Some(i) = hit {
                    break Some(at + i as u64);
                }
                // A magic may straddle the next read: keep the last three bytes.
                at = end - 3;
            }
            self.next = at; // what was searched may go
            if !self.read_more()? {
                break None;
            }
        };
        self.next = match found {
            Some(f) => f,
            None if self.follow => at,
            None => self.raw_end(),
        };
        let events = record.map(|(_, r)| u64::from(r.events));
        let place = record.map_or(from, |(a, _)| a);
        // Right after a damaged frame, the bytes are that frame's rest: one damaged place.
        if record.is_some() || !self.after_damage {
            self.damage(place, events, false, format!("{} bytes at byte {from} that are not a compressed frame", self.next - from));
        }
        self.after_damage = true;
        // The record's frame is accounted for: what follows starts afresh.
        self.state = if found.is_none() && !self.follow { State::Ended } else { State::Between { record: None } };
        Ok(())
    }

    /// The next piece of the decoded stream (see [`super::source::ByteSource`]).
    pub(crate) fn fill(&mut self) -> io::Result<Piece<'_>> {
        loop {
            if let Some(p) = self.notices.pop_front() {
                return Ok(p);
            }
            if self.out_start < self.out_end {
                let at = self.out_at;
                return Ok(Piece::Data { bytes: &self.out[self.out_start..self.out_end], at, compressed: true });
            }
            match &self.state {
                State::Ended => return Ok(Piece::End),
                State::Between { record } => {
                    let record = *record;
                    if let Some(p) = self.between(record)? {
                        return Ok(p);
                    }
                }
                State::InFrame(_) => {
                    if let Some(p) = self.decode()? {
                        return Ok(p);
                    }
                }
            }
        }
    }

    /// At a frame boundary: reads the next record or frame header.
    fn between(&mut self, record: Option<(u64, FrameRecord)>) -> io::Result<Option<Piece<'static>>> {
        if !self.want(4)? {
            return Ok(self.at_end());
        }
        let head: [u8; 4] = self.held(self.next, self.next + 4).try_into().map_err(|_| invalid("short head".into()))?;
        if head == MAGIC {
            let frame_at = self.next;
            let group_at = record.map_or(frame_at, |(a, _)| a);
            let rec = record.map(|(_, r)| r);
            let mut checked = false;
            if let Some(r) = rec.filter(|r| u64::from(r.compressed) <= MAX_CHECKED) {
                if !self.want(u64::from(r.compressed))? {
                    return Ok(self.at_end());
                }
                let crc = crc32c::crc32c(self.held(frame_at, frame_at + u64::from(r.compressed)));
                if crc != r.crc {
                    self.damage(
                        group_at,
                        Some(u64::from(r.events)),
                        false,
                        format!("a damaged compressed frame at byte {frame_at} (its checksum does not match its record)"),
                    );
                    self.resync_after(frame_at, Some(r));
                    return Ok(None);
                }
                checked = true;
            }
            self.dec.reinit()?;
            self.after_damage = false;
            self.state = State::InFrame(InFrame { group_at, frame_at, record: rec, checked, consumed: 0, decoded: 0 });
            return Ok(Some(Piece::Frame { events: rec.map(|r| u64::from(r.events)) }));
        }
        if is_skippable(&head) {
            if !self.want(8)? {
                return Ok(self.at_end());
            }
            let h = self.held(self.next, self.next + 8);
            let size = u64::from(u32::from_le_bytes([h[4], h[5], h[6], h[7]]));
            if head == RECORD_MAGIC && size == RECORD_PAYLOAD as u64 {
                if !self.want(RECORD_BYTES as u64)? {
                    return Ok(self.at_end());
                }
                let payload = self.held(self.next + 8, self.next + RECORD_BYTES as u64);
                if let Some(r) = FrameRecord::parse(payload) {
                    if let Some((at, prev)) = record {
                        self.damage(at, Some(u64::from(prev.events)), false, format!("a compressed frame missing after its record at byte {at}"));
                    }
                    let at = self.next;
                    self.next += RECORD_BYTES as u64;
                    self.state = State::Between { record: Some((at, r)) };
                    return Ok(Some(Piece::Count { before: r.before }));
                }
            } else if size <= MAX_HELD {
                // Another tool's skippable frame: passed over, as zstd does.
                if !self.want(8 + size)? {
                    return Ok(self.at_end());
                }
                self.next += 8 + size;
                return Ok(None);
            }
        }
        self.skip_garbage(record)?;
        Ok(None)
    }

    /// Inside a frame: decodes the next output window.
    fn decode(&mut self) -> io::Result<Option<Piece<'static>>> {
        let State::InFrame(f) = &mut self.state else { return Ok(None) };
        let (group_at, frame_at, record) = (f.group_at, f.frame_at, f.record);
        if self.next >= self.raw_end() && !self.read_more()? {
            return Ok(self.at_end());
        }
        let start = (self.next - self.raw_at) as usize;
        let mut input = InBuffer::around(&self.raw[start..]);
        let mut output = OutBuffer::around(&mut self.out[..]);
        let result = self.dec.run(&mut input, &mut output);
        let (took, made) = (input.pos() as u64, output.pos() as u64);
        let State::InFrame(f) = &mut self.state else { return Ok(None) };
        let before = f.decoded;
        f.consumed += took;
        f.decoded += made;
        let (consumed, decoded) = (f.consumed, f.decoded);
        self.next += took;
        self.decoded_total += made;
        self.work(took)?;
        let lost = record.map(|r| u64::from(r.events));
        let hint = match result {
            Ok(h) => h,
            Err(e) => {
                self.damage(group_at, lost, true, format!("a damaged compressed frame at byte {frame_at}: {e}"));
                self.resync_after(frame_at, record);
                return Ok(None);
            }
        };
        if record.is_some_and(|r| decoded > u64::from(r.decoded)) {
            self.damage(group_at, lost, true, format!("a compressed frame at byte {frame_at} decodes to more than its record says"));
            self.resync_after(frame_at, record);
            return Ok(None);
        }
        if decoded > MAX_RATIO * consumed + RATIO_SLACK {
            self.damage(
                group_at,
                lost,
                true,
                format!("a compressed frame at byte {frame_at} decodes to more than {MAX_RATIO} times its size: not telemetry"),
            );
            self.resync_after(frame_at, record);
            return Ok(None);
        }
        if self.decoded_total > MAX_RATIO * self.read_total + RATIO_SLACK {
            return Err(invalid(format!(
                "{} decoded bytes from {} compressed bytes: more than {MAX_RATIO} times, which no telemetry file is; the rest is not read",
                self.decoded_total, self.read_total
            )));
        }
        if hint == 0 {
            self.state = State::Between { record: None };
        }
        // Hand out what was made, less what an opening inside the frame skips.
        let drop = self.skip_left.min(made);
        self.skip_left -= drop;
        self.out_start = drop as usize;
        self.out_end = made as usize;
        self.out_at = Position { segment: self.segment, raw: group_at, skip: before + drop };
        Ok(None)
    }

    /// Consumes `n` bytes of the data `fill` returned.
    pub(crate) fn consume(&mut self, n: usize) {
        let n = n.min(self.out_end - self.out_start);
        self.out_start += n;
        self.out_at.skip += n as u64;
    }
}
