//! The trace conversion streams: its peak heap does not grow with the input. A counting
//! allocator measures the peak while converting a run, and the same run repeated twenty times
//! over (fed from a reader that makes the lines as they are read, so the input costs nothing).

use stagehand_events::synthetic::{self, SyntheticRun};
use std::io::Read;

#[path = "../../events/tests/support/counting_alloc.rs"]
mod counting_alloc;

/// The lines of a run, `times` over, with sequence numbers and times that keep growing.
struct Repeated {
    lines: Vec<String>,
    times: usize,
    i: usize,
    offset_ns: u64,
    span_ns: u64,
    cur: std::io::Cursor<Vec<u8>>,
}

impl Read for Repeated {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = self.cur.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            if self.i >= self.lines.len() * self.times {
                return Ok(0);
            }
            let (rep, k) = (self.i / self.lines.len(), self.i % self.lines.len());
            if k == 0 && rep > 0 {
                self.offset_ns += self.span_ns;
            }
            let mut e: stagehand_events::Event = serde_json::from_str(&self.lines[k]).expect("a fixture line");
            e.t_ns += self.offset_ns;
            e.seq += (rep * self.lines.len()) as u64;
            let mut line = serde_json::to_vec(&e).expect("json");
            line.push(b'\n');
            self.cur = std::io::Cursor::new(line);
            self.i += 1;
        }
    }
}

fn peak_converting(times: usize) -> (usize, u64) {
    let text = synthetic::jsonl(SyntheticRun::finished(10));
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let span_ns = lines
        .last()
        .and_then(|l| serde_json::from_str::<stagehand_events::Event>(l).ok())
        .map_or(1, |e| e.t_ns + 1);
    let input = Repeated { lines, times, i: 0, offset_ns: 0, span_ns, cur: std::io::Cursor::new(Vec::new()) };
    let (summary, peak) =
        counting_alloc::peak_above(|| stagehand_exporter::trace::convert(std::io::BufReader::new(input), std::io::sink()).expect("converts"));
    (peak, summary.report.events)
}

#[test]
fn peak_memory_does_not_grow_with_the_input() {
    let (small, small_events) = peak_converting(1);
    let (large, large_events) = peak_converting(20);
    assert_eq!(large_events, 20 * small_events);
    println!("peak heap: {small} bytes for {small_events} events, {large} bytes for {large_events} events");
    // Holding the events (or the trace) would grow the peak twentyfold; streaming keeps it flat.
    assert!(large < small + small / 2 + (256 << 10), "{small} -> {large} bytes");
}
