//! Every view drawn into a `TestBackend` at 80x24 and at 120x40 from the recorded fixture,
//! compared with reviewed snapshots; and what the screens promise at 80x24 checked directly:
//! abbreviated numbers that are never cut, the watermarks on the gauge, tab labels that fit, the
//! whole disconnect reason with its countdown, a progress line while a file loads, sort order in
//! the header, the step time and VRAM breakdowns.

mod common;

use common::*;
use ratatui::style::Color;
use stagehand_events::synthetic::{self, SyntheticRun};
use stagehand_events::{BlockId, BlockState, ReplayStatus};
use stagehand_dashboard::app::{
    Control, Detail, Link, LiveStatus, Loading, ReplayInfo, Skipped, SourceStatus, State, View, ViewState,
};
use stagehand_dashboard::filter::Filter;
use stagehand_dashboard::keys::Action;
use stagehand_dashboard::theme::Theme;
use std::time::Duration;

fn view(v: View) -> ViewState {
    ViewState {
        view: v,
        ..Default::default()
    }
}

#[test]
fn fixture_is_the_generators_output() {
    let fresh = synthetic::jsonl(SyntheticRun::default());
    if std::env::var_os("STAGEHAND_UPDATE_FIXTURES").is_some() {
        std::fs::write(RUN, &fresh).expect("writes the fixture");
    }
    let recorded = std::fs::read_to_string(RUN).expect("fixture exists");
    assert_eq!(recorded, fresh, "regenerate with STAGEHAND_UPDATE_FIXTURES=1");
}

#[test]
fn every_view_at_80x24_and_120x40() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    for v in View::ALL {
        let name = v.title().to_lowercase().replace(' ', "_");
        let t = draw_at(&state, &view(v), &theme, SMALL);
        insta::assert_snapshot!(format!("small_{name}"), t.backend());
        let t = draw_at(&state, &view(v), &theme, LARGE);
        insta::assert_snapshot!(format!("large_{name}"), t.backend());
    }
}

#[test]
fn mid_run_in_ascii_without_colour() {
    // At the start of step 2: one step finished, the second under way.
    let (state, _) = replayed(RUN, &[Control::StepTraining(2)]);
    assert_eq!(state.snapshot.step, 2);
    let theme = Theme { color: false, ascii: true };
    for v in [View::Overview, View::Time, View::Memory, View::Residency, View::Conductor] {
        let t = draw_at(&state, &view(v), &theme, SMALL);
        let s = screen(&t);
        assert!(s.lines().all(|l| l.is_ascii()), "non-ASCII in {v:?}:\n{s}");
        let name = v.title().to_lowercase().replace(' ', "_");
        insta::assert_snapshot!(format!("ascii_step2_{name}"), t.backend());
    }
}

#[test]
fn overlays_help_and_details() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    let mut vs = view(View::Residency);
    vs.help = true;
    insta::assert_snapshot!("help", draw(&state, &vs, &theme).backend());
    let small_help = screen(&draw_at(&state, &vs, &theme, SMALL));
    assert!(small_help.contains("s  S"), "the sort keys are in the help:\n{small_help}");

    let mut vs = view(View::Residency);
    vs.detail = Some(Detail::Block(BlockId(2)));
    insta::assert_snapshot!("block_detail", draw(&state, &vs, &theme).backend());

    let dropped = state
        .recent
        .iter()
        .find(|e| e.kind.name() == "events_dropped")
        .map(|e| e.seq)
        .expect("the fixture drops events");
    let mut vs = view(View::Events);
    vs.detail = Some(Detail::Event(dropped));
    insta::assert_snapshot!("event_detail", draw(&state, &vs, &theme).backend());
}

#[test]
fn events_filtered_and_scrolled() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let mut vs = view(View::Events);
    vs.filter = Filter::parse("kind:residency block:2");
    vs.event_sel = Some(1);
    let t = draw(&state, &vs, &Theme::default());
    insta::assert_snapshot!("events_filtered", t.backend());

    let mut vs = view(View::Events);
    vs.filter_input = Some("kind:sl".into());
    let s = screen(&draw(&state, &vs, &Theme::default()));
    assert!(s.contains("filter /kind:sl"), "{s}");
}

#[test]
fn damaged_file_shows_the_rest_and_reports_what_it_skipped() {
    let (state, src) = replayed(DAMAGED, &[Control::ToEnd]);
    let report = src.report();
    assert_eq!(report.skipped_total, 4, "{report:?}");
    assert!(state.snapshot.events_applied > 100);
    assert_eq!(state.snapshot.blocks.len(), 8);
    let t = draw(&state, &view(View::Overview), &Theme::default());
    let s = screen(&t);
    assert!(s.contains("skipped 4 (2 malformed, 1 of unknown kind, 1 truncated)"), "{s}");
    insta::assert_snapshot!("damaged_overview", t.backend());
    let small = screen(&draw_at(&state, &view(View::Overview), &Theme::default(), SMALL));
    assert!(small.contains("skipped 4 (2 malformed, 1 of unknown kind, 1 truncated)"), "{small}");
}

/// The end of the fixture run with counts far larger than the fixture's, as a long run has.
fn long_run_state() -> State {
    let (mut state, _) = replayed(RUN, &[Control::ToEnd]);
    let s = &mut state.snapshot;
    s.transfers.h2d.count = 14_600;
    s.transfers.d2h.count = 3_200_000;
    s.activations.counts.kept = 8_430;
    s.activations.counts.spilled = 123_456;
    s.activations.counts.pool_hits = 1_234_567;
    s.weights.prefetch_hits = 98_765;
    s.weights.evictions = 45_678;
    s.conductor.denials = 12_345;
    s.conductor.slot_denials = 67_890;
    state
}

#[test]
fn at_80x24_numbers_are_abbreviated_never_cut() {
    let state = long_run_state();
    let theme = Theme::default();
    let over = screen(&draw_at(&state, &view(View::Overview), &theme, SMALL));
    assert!(over.contains("kept/spill 8.43k / 123k"), "{over}");
    assert!(over.contains("12.3k (+67.9k)"), "{over}");
    // The watermarks: named with their values, and marked on the gauge.
    assert!(over.contains("L 700 MiB") && over.contains("H 900 MiB"), "{over}");
    let gauge = over.lines().find(|l| l.contains('█') && l.contains('%') && l.contains('L')).expect("the gauge");
    assert!(gauge.contains('H'), "{gauge}");
    let xfer = screen(&draw_at(&state, &view(View::Transfers), &theme, SMALL));
    assert!(xfer.contains("copies 14.6k") && xfer.contains("copies 3.20M"), "{xfer}");
    for v in View::ALL {
        let s = screen(&draw_at(&state, &view(v), &theme, SMALL));
        let head: Vec<&str> = s.lines().take(2).collect();
        assert!(head[0].contains("dropped 17"), "{v:?}: {}", head[0]);
        // Every tab number, and the current view's whole title.
        assert!(head[1].contains(&format!("{} {}", v.index() + 1, v.title())), "{v:?}: {}", head[1]);
        for i in 1..=View::ALL.len() {
            assert!(head[1].contains(&i.to_string()), "{v:?}: {}", head[1]);
        }
    }
}

#[test]
fn every_view_draws_at_any_size_without_panicking() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    for theme in [Theme::default(), Theme { color: false, ascii: true }] {
        for v in View::ALL {
            for (w, h) in [(20, 5), (40, 12), (80, 24), (81, 25), (100, 30), (157, 43), (240, 70)] {
                let mut vs = view(v);
                draw_at(&state, &vs, &theme, (w, h));
                vs.help = true;
                draw_at(&state, &vs, &theme, (w, h));
            }
        }
    }
}

#[test]
fn sort_order_shows_in_the_header_and_orders_the_rows() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    let mut vs = view(View::Residency);
    // id -> name -> state -> ref -> size (largest first), then reversed.
    for _ in 0..5 {
        vs.apply(Action::SortNext, &state);
    }
    let s = screen(&draw_at(&state, &vs, &theme, SMALL));
    assert!(s.contains("loads▼"), "{s}");
    let rows: Vec<&str> = s.lines().filter(|l| l.contains("blocks.")).collect();
    assert!(rows[0].contains("blocks.0"), "most loads first:\n{s}");
    vs.apply(Action::SortReverse, &state);
    let s = screen(&draw_at(&state, &vs, &theme, SMALL));
    assert!(s.contains("loads▲"), "{s}");
    let rows: Vec<&str> = s.lines().filter(|l| l.contains("blocks.")).collect();
    assert!(rows.last().is_some_and(|r| r.contains("blocks.0")), "fewest first:\n{s}");

    let mut vs = view(View::Time);
    vs.apply(Action::SortNext, &state);
    let s = screen(&draw_at(&state, &vs, &theme, LARGE));
    assert!(s.contains("total▼") && s.contains("by total, largest first"), "{s}");
}

fn live(link: Link, skipped: Skipped) -> SourceStatus {
    SourceStatus::Live(LiveStatus { url: "http://127.0.0.1:7878/api/stream".into(), link, skipped })
}

#[test]
fn a_lost_connection_shows_its_whole_reason_and_the_countdown_once() {
    let mut state = State::new();
    let error = "Connection Failed: Connect error: Connection refused (os error 111)".to_owned();
    state.source = live(
        Link::Disconnected { error: error.clone(), retry_in: Duration::from_millis(2340), attempt: 4 },
        Skipped::default(),
    );
    for (w, h) in [(200, 30), (80, 24)] {
        let s = screen(&draw_at(&state, &view(View::Overview), &Theme::default(), (w, h)));
        let joined: String = s.lines().map(str::trim_end).collect::<Vec<_>>().join(" ");
        assert!(joined.contains(&error), "{w} columns:\n{s}");
        assert!(s.contains("retrying in 2.3 s (attempt 5)"), "{w} columns:\n{s}");
        assert_eq!(s.matches("127.0.0.1:7878").count(), 1, "the address once:\n{s}");
    }
    let s = screen(&draw_at(&state, &view(View::Overview), &Theme::default(), (80, 24)));
    insta::assert_snapshot!("small_disconnected", s);

    state.source = live(Link::Connected, Skipped { oversize: 2, unreadable: 1, implausible: 3 });
    let s = screen(&draw_at(&state, &view(View::Overview), &Theme::default(), (120, 40)));
    assert!(s.contains("refused 6 messages from the server: 2 over 32 MiB, 1 unreadable, 3 with implausible ids"), "{s}");
}

#[test]
fn a_file_that_is_still_loading_shows_its_progress() {
    let (mut state, _) = replayed(RUN, &[Control::StepTraining(1)]);
    state.source = SourceStatus::Replay(ReplayInfo {
        path: "big.jsonl".into(),
        status: ReplayStatus {
            position: 40,
            total: 250_000,
            paused: false,
            speed: 1.0,
            t_ns: 0,
            end_t_ns: 0,
            step: 1,
            following: false,
            indexing: false,
        },
        report: "read 250000 events from 250000 lines".into(),
        skipped: 0,
        loading: Some(Loading { bytes_read: 120 << 20, total_bytes: 266 << 20, events: 250_000 }),
    });
    let s = screen(&draw_at(&state, &view(View::Overview), &Theme::default(), SMALL));
    let line = s.lines().nth(2).expect("a status line");
    assert!(line.contains("loading big.jsonl 45%"), "{s}");
    assert!(line.contains("120 MiB of 266 MiB, 250k events"), "{s}");
}

#[test]
fn the_insight_views_break_down_time_and_vram() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    let t = state.snapshot.step_record(3).and_then(|r| r.time).expect("step 3 has its breakdown");
    let s = screen(&draw_at(&state, &view(View::Time), &theme, SMALL));
    assert!(s.contains("Step 3 took 88.0 ms"), "{s}");
    assert!(s.contains("compute 63.0 ms 72%"), "{s}");
    assert!(s.contains(&format!("h2d wait {:.2} ms", t.h2d_wait_ms)), "{s}");
    assert!(s.contains("optimizer 12.0 ms 14%"), "{s}");
    assert!(s.contains("Findings (1)") && s.contains("events were dropped"), "{s}");
    assert!(s.contains("→ change telemetry_level: summary"), "the knob:\n{s}");

    let peak = state.snapshot.step_record(3).and_then(|r| r.vram_at_peak).expect("step 3 has its peak");
    let s = screen(&draw_at(&state, &view(View::Memory), &theme, SMALL));
    assert!(s.contains("Step 3 fullest reading: 288 MiB, peak 288 MiB"), "{s}");
    assert_eq!(peak.weights_bytes, 192 << 20);
    assert!(s.contains("weights 192 MiB 67%"), "{s}");
    assert!(s.contains("Now (step 4 forward): 920 MiB of 1.00 GiB"), "{s}");
    assert!(s.contains("kept acts 388 MiB 42%"), "{s}");

    let s = screen(&draw_at(&state, &view(View::Overview), &theme, SMALL));
    assert!(s.contains("Findings: 1"), "the overview summarises the findings:\n{s}");
    assert!(s.contains("compute 63.0 ms 72%"), "and the last step's time:\n{s}");
}

#[test]
fn residency_states_are_coloured() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let t = draw(&state, &view(View::Residency), &Theme::default());
    let buf = t.backend().buffer();
    let cells = |y: u16| -> Vec<String> { (0..W).map(|x| buf[(x, y)].symbol().to_string()).collect() };
    let find = |row: &[String], pat: &str| -> Option<u16> {
        let chars: Vec<char> = pat.chars().collect();
        (0..row.len().saturating_sub(chars.len()))
            .find(|&x| chars.iter().enumerate().all(|(i, c)| row[x + i] == c.to_string()))
            .map(|x| x as u16)
    };
    let header_y = (0..H).find(|&y| find(&cells(y), "name").is_some()).expect("table header");
    let state_x = find(&cells(header_y), "state").expect("state column");
    let mut seen = Vec::new();
    for b in &state.snapshot.blocks {
        let y = (header_y..H)
            .find(|&y| find(&cells(y), &format!(" {} ", b.name)).is_some())
            .unwrap_or_else(|| panic!("{} not in the table", b.name));
        assert_eq!(buf[(state_x, y)].fg, Theme::state_color(b.state), "{}", b.name);
        seen.push(b.state);
    }
    for st in BlockState::ALL {
        assert!(seen.contains(&st), "no block shows {st}");
    }
    let plain = draw(&state, &view(View::Residency), &Theme { color: false, ascii: false });
    let buf = plain.backend().buffer();
    assert!((0..H).all(|y| (0..W).all(|x| buf[(x, y)].fg == Color::Reset)));
}

#[test]
fn extreme_numbers_from_a_server_draw_without_panicking() {
    use stagehand_events::snapshot::{ClassView, OwnersReading, VramReading};
    use stagehand_events::{StepTimeBreakdown, VramByOwner};
    let (mut state, _) = replayed(RUN, &[Control::ToEnd]);
    let s = &mut state.snapshot;
    s.step = u64::MAX;
    s.t_ns = u64::MAX;
    s.dropped_events = u64::MAX;
    s.telemetry_lost = u64::MAX;
    s.vram = Some(VramReading { t_ns: 0, allocated_bytes: u64::MAX, reserved_bytes: u64::MAX, peak_allocated_bytes: u64::MAX });
    let huge = VramByOwner {
        allocated_bytes: u64::MAX,
        weights_bytes: u64::MAX,
        activations_kept_bytes: u64::MAX,
        activations_restored_bytes: u64::MAX,
        copies_in_flight_bytes: u64::MAX,
        other_bytes: u64::MAX,
    };
    s.vram_owners = Some(OwnersReading { t_ns: 0, step: u64::MAX, phase: Default::default(), owners: huge });
    s.vram_owners_history.push_back(OwnersReading { t_ns: 0, step: 1, phase: Default::default(), owners: huge });
    for r in s.steps.iter_mut() {
        r.vram_at_peak = Some(huge);
        r.time = Some(StepTimeBreakdown { step_ms: f64::MAX, compute_ms: f64::INFINITY, h2d_wait_ms: f64::NAN, ..Default::default() });
    }
    for p in [&mut s.weight_pool, &mut s.activation_pool].into_iter().flatten() {
        p.classes = vec![ClassView { slab_bytes: u64::MAX, slabs: u32::MAX, in_use: u32::MAX, peak_in_use: u32::MAX, hits: u64::MAX, exhausted: u64::MAX }];
        p.pageable_bytes = u64::MAX;
    }
    s.transfers.h2d.count = u64::MAX;
    s.transfers.h2d.bytes = u64::MAX;
    s.activations.counts.kept = u64::MAX;
    s.conductor.active_bytes = u64::MAX;
    for b in s.blocks.iter_mut() {
        b.bytes = u64::MAX;
        b.loads = u64::MAX;
    }
    state.lagged = u64::MAX;
    for v in View::ALL {
        for size in [SMALL, LARGE] {
            draw_at(&state, &view(v), &Theme::default(), size);
        }
    }
}

#[test]
fn the_step_time_says_how_much_of_the_host_optimizer_overlapped_backward() {
    use stagehand_events::{Event, EventKind, Phase, StepTimeBreakdown, WeightStepMetrics};
    let mut state = State::new();
    let at = |seq: u64, kind: EventKind| Event::new(seq, seq, 2, Phase::StepEnd, kind);
    state.snapshot.apply(&at(1, EventKind::WeightStep(WeightStepMetrics { host_steps: 27, host_steps_overlapped: 24, ..Default::default() })));
    state.snapshot.apply(&at(2, EventKind::StepTime(StepTimeBreakdown { step_ms: 300.0, compute_ms: 100.0, optimizer_ms: 200.0, ..Default::default() })));
    let theme = Theme::default();
    let s = screen(&draw_at(&state, &view(View::Time), &theme, LARGE));
    assert!(s.contains("host optimizer: 24 of 27 blocks given to it while backward ran"), "{s}");
    // A step without host steps says nothing of them.
    let (one, _) = replayed(RUN, &[Control::ToEnd]);
    assert!(!screen(&draw_at(&one, &view(View::Time), &theme, LARGE)).contains("host optimizer:"));
}

#[test]
fn a_data_parallel_run_shows_a_row_per_gpu_on_the_overview() {
    use stagehand_events::{Event, EventKind, Phase, StepTimeBreakdown, WeightStepMetrics};
    let mut state = State::new();
    let on = |d: u32, seq: u64, kind: EventKind| Event::new(seq, seq, 3, Phase::Backward, kind).on_device(Some(d));
    for (i, d) in [0u32, 1].into_iter().enumerate() {
        let seq = 10 * i as u64;
        state.snapshot.apply(&on(d, seq + 1, EventKind::StepTime(StepTimeBreakdown { step_ms: 120.0 + d as f64, compute_ms: 100.0, ..Default::default() })));
        let host = if d == 0 { (27, 24) } else { (0, 0) };
        let w = WeightStepMetrics { collective_ms: 4.5, collective_bytes: 64 << 20, host_steps: host.0, host_steps_overlapped: host.1, ..Default::default() };
        state.snapshot.apply(&on(d, seq + 2, EventKind::WeightStep(w)));
    }
    let theme = Theme::default();
    for size in [SMALL, LARGE] {
        let s = screen(&draw_at(&state, &view(View::Overview), &theme, size));
        assert!(s.contains("GPU 0") && s.contains("GPU 1"), "a row per GPU at {size:?}:\n{s}");
        assert!(s.contains("GPUs"), "{s}");
    }
    let s = screen(&draw_at(&state, &view(View::Overview), &theme, LARGE));
    assert!(s.contains("121 ms") && s.contains("4.50 ms"), "each GPU's step and collectives:\n{s}");
    // The host steps given during backward, of those stepped; none stepped shows a dash.
    let row = |gpu: &str| s.lines().find(|l| l.contains(&format!("│{gpu} "))).unwrap_or_default().to_owned();
    assert!(row("GPU 0").contains("24/27") && row("GPU 1").contains("GPU 1") && !row("GPU 1").contains('/'), "host steps in backward:\n{s}");
    // A run on one device has no such box.
    let (one, _) = replayed(RUN, &[Control::ToEnd]);
    assert!(!screen(&draw(&one, &view(View::Overview), &theme)).contains("GPUs"));
}
