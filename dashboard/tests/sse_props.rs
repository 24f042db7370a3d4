//! Property tests of the live-stream parser (SSE lines into messages, messages into updates)
//! with arbitrary input: it never panics, never holds more than its bounds, and reads back
//! exactly the messages a well-behaved server writes, however the bytes are split.

use proptest::prelude::*;
use stagehand_dashboard::source::sse::{Item, Limits, LineReader, SseMessage, SseParser};
use stagehand_dashboard::source::decode;
use std::io::{BufReader, Read};

const LIMITS: Limits = Limits { max_line: 256, max_message: 512 };

/// A reader that hands its bytes out in the given chunk sizes.
struct Chunked {
    data: Vec<u8>,
    at: usize,
    sizes: Vec<usize>,
    turn: usize,
}

impl Read for Chunked {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at >= self.data.len() {
            return Ok(0);
        }
        let want = self.sizes.get(self.turn % self.sizes.len().max(1)).copied().unwrap_or(7).max(1);
        self.turn += 1;
        let n = want.min(buf.len()).min(self.data.len() - self.at);
        buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn parse(data: Vec<u8>, sizes: Vec<usize>, buf_cap: usize) -> (Vec<Item>, usize) {
    let reader = BufReader::with_capacity(buf_cap, Chunked { data, at: 0, sizes, turn: 0 });
    let mut lines = LineReader::new(reader, LIMITS.max_line);
    let mut parser = SseParser::new(LIMITS);
    let mut buf = Vec::new();
    let mut items = Vec::new();
    let mut most_held = 0;
    while let Some(info) = lines.next_line(&mut buf).expect("in-memory reads do not fail") {
        assert!(buf.len() <= LIMITS.max_line, "a line of {} bytes was kept", buf.len());
        items.extend(parser.line(&buf, info));
        most_held = most_held.max(parser.held());
    }
    (items, most_held)
}

proptest! {
    // Bounded for CI: a few hundred small cases a property, no files written.
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_nor_exceed_the_bounds(
        data in proptest::collection::vec(any::<u8>(), 0..4096),
        sizes in proptest::collection::vec(1usize..64, 1..8),
        cap in 1usize..32,
    ) {
        let (items, held) = parse(data, sizes, cap);
        prop_assert!(held <= LIMITS.max_message + 64);
        for item in items {
            if let Item::Message(m) = item {
                prop_assert!(m.data.len() <= LIMITS.max_message);
                // Decoding what came is total: an update or a refusal, never a panic.
                let _ = decode(&m);
            }
        }
    }

    #[test]
    fn sse_shaped_noise_never_panics(
        lines in proptest::collection::vec(
            prop_oneof![
                Just(String::new()),
                "[a-z]{0,8}",
                "data: [ -~]{0,300}",
                "event: [a-z_]{0,70}",
                ": [ -~]{0,20}",
                "data: \\{\"type\":\"(event|snapshot|lagged)\"[ -~]{0,80}",
            ],
            0..64,
        ),
        crlf in any::<bool>(),
    ) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let text: String = lines.iter().map(|l| format!("{l}{nl}")).collect();
        let (items, held) = parse(text.into_bytes(), vec![5, 17, 64], 16);
        prop_assert!(held <= LIMITS.max_message + 64);
        for item in items {
            if let Item::Message(m) = item {
                let _ = decode(&m);
            }
        }
    }

    #[test]
    fn messages_a_server_writes_come_back_whole(
        msgs in proptest::collection::vec(("[a-z]{1,10}", proptest::collection::vec("[ -~]{0,40}", 1..4)), 0..16),
        sizes in proptest::collection::vec(1usize..50, 1..6),
    ) {
        let mut text = String::from(": hello\n\n");
        let mut want = Vec::new();
        for (event, data) in &msgs {
            text.push_str(&format!("event: {event}\n"));
            for d in data {
                text.push_str(&format!("data: {d}\n"));
            }
            text.push('\n');
            // A value that starts with a space loses one, as SSE says.
            let data: Vec<&str> = data.iter().map(|d| d.as_str()).collect();
            want.push(Item::Message(SseMessage { event: event.clone(), data: data.join("\n") }));
        }
        let (items, _) = parse(text.into_bytes(), sizes, 8);
        prop_assert_eq!(items, want);
    }
}
