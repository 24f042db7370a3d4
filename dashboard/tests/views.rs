//! Every view drawn into a `TestBackend` at 120x36 from the recorded fixture, compared with
//! reviewed snapshots.

mod common;

use common::*;
use ratatui::style::Color;
use stagehand::events::{BlockId, BlockState};
use stagehand_dashboard::app::{Control, Detail, Filter, View, ViewState};
use stagehand::events::synthetic::{self, SyntheticRun};
use stagehand_dashboard::theme::Theme;

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
fn every_view_at_the_end_of_the_run() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    for v in View::ALL {
        let t = draw(&state, &view(v), &theme);
        insta::assert_snapshot!(format!("end_{}", v.title().to_lowercase()), t.backend());
    }
}

#[test]
fn mid_run_in_ascii_without_colour() {
    // At the start of step 2: one step finished, the second under way.
    let (state, _) = replayed(RUN, &[Control::StepTraining(2)]);
    assert_eq!(state.snapshot.step, 2);
    let theme = Theme { color: false, ascii: true };
    for v in [View::Overview, View::Residency, View::Conductor] {
        let t = draw(&state, &view(v), &theme);
        let screen = t.backend().to_string();
        assert!(
            screen.lines().all(|l| l.is_ascii()),
            "non-ASCII in {v:?}:\n{screen}"
        );
        insta::assert_snapshot!(format!("ascii_step2_{}", v.title().to_lowercase()), t.backend());
    }
}

#[test]
fn overlays_help_and_details() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let theme = Theme::default();
    let mut vs = view(View::Residency);
    vs.help = true;
    insta::assert_snapshot!("help", draw(&state, &vs, &theme).backend());

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
    let screen = draw(&state, &vs, &Theme::default()).backend().to_string();
    assert!(screen.contains("filter /kind:sl"), "{screen}");
}

#[test]
fn damaged_file_shows_the_rest_and_reports_what_it_skipped() {
    let (state, src) = replayed(DAMAGED, &[Control::ToEnd]);
    let report = src.report();
    assert_eq!(report.skipped_total, 4, "{report:?}");
    assert!(state.snapshot.events_applied > 100);
    assert_eq!(state.snapshot.blocks.len(), 8);
    let t = draw(&state, &view(View::Overview), &Theme::default());
    let screen = t.backend().to_string();
    assert!(
        screen.contains("skipped 4 (2 malformed, 1 of unknown kind, 1 truncated)"),
        "{screen}"
    );
    insta::assert_snapshot!("damaged_overview", t.backend());
}

#[test]
fn residency_states_are_coloured() {
    let (state, _) = replayed(RUN, &[Control::ToEnd]);
    let t = draw(&state, &view(View::Residency), &Theme::default());
    let buf = t.backend().buffer();
    let cells = |y: u16| -> Vec<String> { (0..W).map(|x| buf[(x, y)].symbol().to_string()).collect() };
    let find = |row: &[String], pat: &str| -> Option<u16> {
        let chars: Vec<char> = pat.chars().collect();
        (0..row.len().saturating_sub(chars.len())).find(|&x| {
            chars.iter().enumerate().all(|(i, c)| row[x + i] == c.to_string())
        }).map(|x| x as u16)
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
