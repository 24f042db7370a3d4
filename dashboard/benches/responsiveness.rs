//! How many events per second `stagehand-top` keeps up with: events go through the same path as
//! in the binary (`State::ingest`, then one `views::draw` per frame into a `TestBackend`).
//!
//! Run: `cargo bench -p stagehand-dashboard --bench responsiveness`
//!
//! Prints, for each view: the frame time when fed 10,000 events/s at 30 frames/s (334 events a
//! frame), and the highest sustained rate (as many events a frame as fit in a 33 ms frame).

use ratatui::backend::TestBackend;
use ratatui::Terminal;
use stagehand::events::Event;
use stagehand_dashboard::app::{State, Update, View, ViewState};
use stagehand::events::synthetic::{self, SyntheticRun};
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
            state.ingest(Update::Event(Box::new(e)));
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
        state.ingest(Update::Event(Box::new(e.clone())));
    }
    let ingest = t.elapsed();
    println!(
        "ingest only: {:.0} events/s ({:.2} us/event)",
        events.len() as f64 / ingest.as_secs_f64(),
        ingest.as_secs_f64() * 1e6 / events.len() as f64
    );

    // The live path's extra work: SSE lines parsed and decoded from JSON.
    let lines: Vec<String> = events
        .iter()
        .map(|e| {
            let m = stagehand::events::StreamMessage::Event { event: Box::new(e.clone()) };
            format!("data: {}", serde_json::to_string(&m).expect("serializes"))
        })
        .collect();
    let mut parser = stagehand_dashboard::source::SseParser::default();
    let t = Instant::now();
    let mut n = 0usize;
    for l in &lines {
        parser.line("event: event");
        parser.line(l);
        if let Some(m) = parser.line("") {
            if stagehand_dashboard::source::decode(&m).is_ok() {
                n += 1;
            }
        }
    }
    let decode = t.elapsed();
    println!(
        "SSE parse + JSON decode: {:.0} events/s ({:.2} us/event)",
        n as f64 / decode.as_secs_f64(),
        decode.as_secs_f64() * 1e6 / n as f64
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
