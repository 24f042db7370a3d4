//! How many events per second `stagehand-top` keeps up with: events go through the same path as
//! in the binary (`State::ingest`, then one `views::draw` per frame into a `TestBackend`).
//!
//! Run: `cargo bench -p stagehand-dashboard --bench responsiveness`
//!
//! Prints, for each view: the frame time when fed 10,000 events/s at 30 frames/s (334 events a
//! frame), and the highest sustained rate (as many events a frame as fit in a 33 ms frame).

use ratatui::backend::TestBackend;
use ratatui::Terminal;
use stagehand_events::Event;
use stagehand_dashboard::app::{State, SourceUpdate, View, ViewState};
use stagehand_dashboard::source::sse::{Item, Limits, LineReader, SseParser};
use stagehand_dashboard::source::{ReplaySource, Source};
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_dashboard::theme::Theme;
use stagehand_dashboard::views;
use std::time::{Duration, Instant};

const FPS: u32 = 30;
const RATE: usize = 10_000;

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Feeds `per_frame` events then draws, for `frames` frames; returns each frame's time.
fn run(events: &[Event], view: View, per_frame: usize, frames: usize) -> Vec<Duration> {
    let mut term = Terminal::new(TestBackend::new(160, 48)).expect("test terminal");
    let mut state = State::new();
    let vs = ViewState { view, ..Default::default() };
    let theme = Theme::default();
    let mut times = Vec::with_capacity(frames);
    let mut i = 0;
    for _ in 0..frames {
        let t = Instant::now();
        for _ in 0..per_frame {
            // Loop over the run, renumbering so sequence numbers keep growing.
            let mut e = events[i % events.len()].clone();
            e.seq = i as u64 + 1;
            state.ingest(SourceUpdate::Event(Box::new(e)));
            i += 1;
        }
        term.draw(|f| views::draw(f, &state, &vs, &theme)).expect("draws");
        times.push(t.elapsed());
    }
    std::hint::black_box(&state);
    times
}

fn main() {
    let events = synthetic::events(SyntheticRun { blocks: 24, steps: 200, end_mid_step: false });
    println!("synthetic run: {} events; screen 160x48", events.len());

    // Ingest alone.
    let mut state = State::new();
    let t = Instant::now();
    for e in &events {
        state.ingest(SourceUpdate::Event(Box::new(e.clone())));
    }
    let ingest = t.elapsed();
    println!(
        "ingest only: {:.0} events/s ({:.2} us/event)",
        events.len() as f64 / ingest.as_secs_f64(),
        ingest.as_secs_f64() * 1e6 / events.len() as f64
    );

    // The live path's extra work: SSE lines read (bounded), parsed and decoded from JSON.
    let mut wire = Vec::new();
    for e in &events {
        let m = stagehand_events::StreamMessage::Event { event: Box::new(e.clone()) };
        wire.extend_from_slice(b"event: event\ndata: ");
        wire.extend(serde_json::to_vec(&m).expect("serializes"));
        wire.extend_from_slice(b"\n\n");
    }
    let t = Instant::now();
    let mut lines = LineReader::new(std::io::BufReader::new(wire.as_slice()), Limits::default().max_line);
    let mut parser = SseParser::new(Limits::default());
    let mut buf = Vec::new();
    let mut n = 0usize;
    while let Some(info) = lines.next_line(&mut buf).expect("reads memory") {
        if let Some(Item::Message(m)) = parser.line(&buf, info) {
            if stagehand_dashboard::source::decode(&m).is_ok() {
                n += 1;
            }
        }
    }
    let decode = t.elapsed();
    println!(
        "SSE read + parse + JSON decode: {:.0} events/s ({:.2} us/event)",
        n as f64 / decode.as_secs_f64(),
        decode.as_secs_f64() * 1e6 / n as f64
    );

    // A large telemetry file: how soon the first events are there to draw, and the whole load.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("big.jsonl");
    let text = synthetic::jsonl(SyntheticRun { blocks: 24, steps: 1000, end_mid_step: false });
    std::fs::write(&path, &text).expect("writes the file");
    let t = Instant::now();
    let mut src = ReplaySource::open_in_background(&path, false).expect("opens");
    let mut out = Vec::new();
    while src.is_empty() {
        src.poll(Instant::now(), &mut out);
    }
    let first = t.elapsed();
    src.finish_loading();
    let all = t.elapsed();
    println!(
        "replay of a {:.0} MB file ({} events): first events after {:.1?}, all after {:.2?} ({:.0} MB/s)",
        text.len() as f64 / 1e6,
        src.len(),
        first,
        all,
        text.len() as f64 / 1e6 / all.as_secs_f64()
    );

    let per_frame = RATE / FPS as usize + 1;
    let budget = Duration::from_secs(1) / FPS;
    println!("\nat {RATE} events/s, {FPS} frames/s ({per_frame} events a frame, frame budget {budget:?}):");
    println!("{:<12} {:>10} {:>10} {:>10} {:>16}", "view", "p50", "p99", "max", "max events/s");
    let mut worst = f64::MAX;
    for v in View::ALL {
        let mut times = run(&events, v, per_frame, 300);
        let (p50, p99, max) = (percentile(&mut times, 0.5), percentile(&mut times, 0.99), *times.last().expect("frames"));
        // Highest sustained rate: grow the batch until a frame takes the whole budget.
        let big = 20_000;
        let t = Instant::now();
        let frames = 20;
        run(&events, v, big, frames);
        let rate = (big * frames) as f64 / t.elapsed().as_secs_f64();
        // Frames must still be drawn: the rate at FPS frames/s is what fits around them.
        let draw_share = p50.as_secs_f64() * FPS as f64;
        let sustained = rate * (1.0 - draw_share).max(0.0);
        worst = worst.min(sustained);
        println!(
            "{:<12} {:>10.2?} {:>10.2?} {:>10.2?} {:>16.0}",
            v.title(),
            p50,
            p99,
            max,
            sustained
        );
    }
    println!("\nslowest view keeps up with {worst:.0} events/s at {FPS} frames/s");
}
