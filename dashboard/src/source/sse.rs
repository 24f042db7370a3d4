//! Server-Sent Events from a server that may be hostile: lines and messages are bounded, and
//! what is over a bound is skipped (and counted by the caller) without ever being held whole.
//!
//! [`LineReader`] reads lines of at most `max_line` bytes from any `BufRead`; the rest of a
//! longer line is read and thrown away as it arrives. [`SseParser`] assembles lines into
//! messages of at most `max_message` bytes of data; a message over it is dropped as its lines
//! come in and reported as [`Item::Skipped`] when its blank line ends it. So an endless `data:`
//! line, or endless `data:` lines without a blank line, cost at most the bounds in memory.

use std::io::{self, BufRead};

/// The longest line kept, in bytes. A snapshot of a long run is a few MiB of JSON.
pub const MAX_LINE: usize = 32 << 20;
/// The most data one message may carry, in bytes.
pub const MAX_MESSAGE: usize = 32 << 20;
/// The longest `event:` name (the protocol's names are a few letters).
const MAX_EVENT_NAME: usize = 64;

/// How large lines and messages may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_line: usize,
    pub max_message: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_line: MAX_LINE, max_message: MAX_MESSAGE }
    }
}

/// One Server-Sent Events message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseMessage {
    pub event: String,
    pub data: String,
}

/// Why a message was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// A line or the message was over its bound.
    Oversize,
    /// A line was not UTF-8.
    NotUtf8,
}

/// What a line completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Message(SseMessage),
    Skipped(Skip),
}

/// Reads lines of at most `max_line` bytes; longer lines are consumed to their end and
/// reported as cut.
#[derive(Debug)]
pub struct LineReader<R> {
    inner: R,
    max_line: usize,
}

/// One line read by a [`LineReader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineInfo {
    /// The line was longer than the bound: the buffer holds its first `max_line` bytes.
    pub cut: bool,
    /// The line ended with a newline (false only for the last bytes before end of stream).
    pub complete: bool,
}

impl<R: BufRead> LineReader<R> {
    /// Lines of `inner`, at most `max_line` bytes each.
    pub fn new(inner: R, max_line: usize) -> LineReader<R> {
        LineReader { inner, max_line }
    }

    /// The reader underneath.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The reader underneath.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Reads the next line into `buf` (cleared first, without the newline). `Ok(None)` at the
    /// end of the stream.
    pub fn next_line(&mut self, buf: &mut Vec<u8>) -> io::Result<Option<LineInfo>> {
        buf.clear();
        let mut cut = false;
        let mut any = false;
        loop {
            let chunk = match self.inner.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                return Ok(any.then_some(LineInfo { cut, complete: false }));
            }
            any = true;
            let (part, done) = match chunk.iter().position(|b| *b == b'\n') {
                Some(i) => (&chunk[..i], Some(i + 1)),
                None => (chunk, None),
            };
            let room = self.max_line - buf.len().min(self.max_line);
            if part.len() > room {
                cut = true;
            }
            buf.extend_from_slice(&part[..part.len().min(room)]);
            let used = done.unwrap_or(chunk.len());
            self.inner.consume(used);
            if done.is_some() {
                return Ok(Some(LineInfo { cut, complete: true }));
            }
        }
    }
}

/// Turns SSE lines into messages (the subset the protocol uses: `event:`, `data:`, comments),
/// holding at most `max_message` bytes of data.
#[derive(Debug, Default)]
pub struct SseParser {
    limits: Limits,
    event: String,
    data: String,
    /// `data:` lines of this message so far (an empty one counts: it adds a newline).
    data_lines: usize,
    has_data: bool,
    skip: Option<Skip>,
}

impl SseParser {
    /// A parser with these bounds.
    pub fn new(limits: Limits) -> SseParser {
        SseParser { limits, ..Default::default() }
    }

    /// Bytes of data held for the message being assembled (never more than the bound).
    pub fn held(&self) -> usize {
        self.data.len() + self.event.len()
    }

    fn spoil(&mut self, why: Skip) {
        // Give the memory back at once: an endless message must not hold it.
        self.data = String::new();
        self.skip.get_or_insert(why);
    }

    /// Feeds one line (without its newline, as read by a [`LineReader`]); returns what a blank
    /// line completes.
    pub fn line(&mut self, raw: &[u8], info: LineInfo) -> Option<Item> {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.is_empty() && !info.cut {
            let skip = self.skip.take();
            let has_data = std::mem::take(&mut self.has_data);
            let event = std::mem::take(&mut self.event);
            let data = std::mem::take(&mut self.data);
            self.data_lines = 0;
            if let Some(s) = skip {
                return Some(Item::Skipped(s));
            }
            return has_data.then_some(Item::Message(SseMessage { event, data }));
        }
        if raw.first() == Some(&b':') {
            return None; // a comment: keep-alive
        }
        if info.cut {
            // The field name is intact at the start, but the value is not: the message is lost.
            self.has_data = true;
            self.spoil(Skip::Oversize);
            return None;
        }
        let Ok(line) = std::str::from_utf8(raw) else {
            self.has_data = true;
            self.spoil(Skip::NotUtf8);
            return None;
        };
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" if value.len() > MAX_EVENT_NAME => {
                self.has_data = true;
                self.spoil(Skip::Oversize);
            }
            "event" => value.clone_into(&mut self.event),
            "data" => {
                self.has_data = true;
                if self.skip.is_some() {
                    return None;
                }
                let sep = usize::from(self.data_lines > 0);
                if self.data.len() + sep + value.len() > self.limits.max_message {
                    self.spoil(Skip::Oversize);
                } else {
                    if sep == 1 {
                        self.data.push('\n');
                    }
                    self.data.push_str(value);
                    self.data_lines += 1;
                }
            }
            _ => {} // id, retry: not used by this protocol
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Read};

    fn items(text: &[u8], limits: Limits) -> Vec<Item> {
        let mut r = LineReader::new(BufReader::with_capacity(7, text), limits.max_line);
        let mut p = SseParser::new(limits);
        let mut buf = Vec::new();
        let mut out = Vec::new();
        while let Some(info) = r.next_line(&mut buf).expect("reads") {
            out.extend(p.line(&buf, info));
        }
        out
    }

    fn msg(event: &str, data: &str) -> Item {
        Item::Message(SseMessage { event: event.into(), data: data.into() })
    }

    #[test]
    fn lines_make_messages() {
        let got = items(
            b": keep-alive\n\nevent: lagged\r\ndata: {\"missed\":4}\r\n\r\n\ndata:a\ndata: b\n\n",
            Limits::default(),
        );
        assert_eq!(got, [msg("lagged", "{\"missed\":4}"), msg("", "a\nb")]);
        assert_eq!(items(b"data:\ndata:\n\n", Limits::default()), [msg("", "\n")], "empty data lines count");
    }

    #[test]
    fn an_over_long_line_is_skipped_and_the_stream_goes_on() {
        let limits = Limits { max_line: 16, max_message: 64 };
        let text = format!("data: {}\n\nevent: e\ndata: ok\n\n", "x".repeat(100));
        assert_eq!(items(text.as_bytes(), limits), [Item::Skipped(Skip::Oversize), msg("e", "ok")]);
    }

    #[test]
    fn a_message_over_its_bound_is_dropped_as_it_grows() {
        let limits = Limits { max_line: 16, max_message: 20 };
        let mut p = SseParser::new(limits);
        let info = LineInfo { cut: false, complete: true };
        for _ in 0..1000 {
            assert_eq!(p.line(b"data: 0123456789", info), None);
            assert!(p.held() <= 20, "holds {}", p.held());
        }
        assert_eq!(p.line(b"", info), Some(Item::Skipped(Skip::Oversize)));
        assert_eq!(p.line(b"data: fine", info), None);
        assert_eq!(p.line(b"", info), Some(msg("", "fine")));
    }

    #[test]
    fn non_utf8_spoils_only_its_message() {
        let got = items(b"data: \xff\xfe\n\ndata: [1]\n\n", Limits::default());
        assert_eq!(got, [Item::Skipped(Skip::NotUtf8), msg("", "[1]")]);
    }

    /// An endless line: the reader keeps its bound while consuming it.
    struct Endless(u64);
    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0 == 0 {
                let s = b"\n\ndata: after\n\n";
                let n = s.len().min(buf.len());
                buf[..n].copy_from_slice(&s[..n]);
                return Ok(n);
            }
            let n = (buf.len() as u64).min(self.0) as usize;
            buf[..n].fill(b'a');
            self.0 -= n as u64;
            Ok(n)
        }
    }

    #[test]
    fn an_endless_line_costs_only_its_bound() {
        let limits = Limits { max_line: 1 << 10, max_message: 1 << 10 };
        let mut r = LineReader::new(BufReader::new(Endless(64 << 20)), limits.max_line);
        let mut buf = Vec::new();
        let info = r.next_line(&mut buf).expect("reads").expect("a line");
        assert!(info.cut && info.complete);
        assert_eq!(buf.len(), 1 << 10);
        assert!(buf.capacity() <= 4 << 10, "capacity {}", buf.capacity());
    }
}
