use super::*;
use crate::filter::Filter;
use stagehand_events::synthetic::{events, SyntheticRun};

fn fed() -> (State, Vec<Event>) {
    let ev = events(SyntheticRun::default());
    let mut s = State::new();
    for e in &ev {
        s.ingest(SourceUpdate::Event(Box::new(e.clone())));
    }
    (s, ev)
}

#[test]
fn ingesting_events_matches_the_shared_reducer() {
    let (s, ev) = fed();
    assert_eq!(s.snapshot, Snapshot::from_events(&ev));
    assert_eq!(s.recent.len(), ev.len().min(RECENT_EVENTS));
    assert_eq!(s.recent.back().map(|e| e.seq), ev.last().map(|e| e.seq));
}

#[test]
fn recent_events_stay_bounded() {
    let ev = events(SyntheticRun { blocks: 32, steps: 400, end_mid_step: false });
    assert!(ev.len() > RECENT_EVENTS);
    let mut s = State::new();
    for e in &ev {
        s.ingest(SourceUpdate::Event(Box::new(e.clone())));
    }
    assert_eq!(s.recent.len(), RECENT_EVENTS);
    assert_eq!(s.recent.front().map(|e| e.seq), Some(ev[ev.len() - RECENT_EVENTS].seq));
}

#[test]
fn a_reset_without_history_drops_events_newer_than_the_snapshot() {
    let (mut s, ev) = fed();
    let back = Snapshot::from_events(&ev[..50]);
    s.ingest(SourceUpdate::Reset { snapshot: Box::new(back.clone()), history: None });
    assert_eq!(s.snapshot, back);
    assert_eq!(s.recent.back().map(|e| e.seq), Some(50));
    assert_eq!(s.resets, 1);
    s.ingest(SourceUpdate::Reset { snapshot: Box::new(back), history: Some(ev[40..50].to_vec()) });
    assert_eq!(s.recent.len(), 10);
    s.ingest(SourceUpdate::Lagged(7));
    s.ingest(SourceUpdate::Lagged(3));
    assert_eq!(s.lagged, 10);
}

#[test]
fn filters_by_kind_block_and_step() {
    let (s, _) = fed();
    let f = Filter::parse("kind:residency block:2 step:1-2");
    let hits: Vec<&Event> = s.filtered_events(&f).collect();
    assert!(!hits.is_empty());
    for e in &hits {
        assert_eq!(e.kind.name(), "residency");
        assert_eq!(e.kind.block(), Some(BlockId(2)));
        assert!((1..=2).contains(&e.step));
    }
    let bare = Filter::parse("dropped");
    assert_eq!(s.filtered_events(&bare).count(), 1);
    let bad = Filter::parse("block:x step:");
    assert_eq!(bad.invalid, vec!["block:x".to_owned(), "step:".to_owned()]);
    assert!(Filter::parse("  ").is_empty());
    let blocks = Filter::parse("blocks.1");
    let sorts = Sorts::default();
    assert!(s.sorted_blocks(&blocks, &sorts).iter().all(|b| b.name.contains("blocks.1")));
    assert!(s.sorted_blocks(&Filter::parse("gpu_ready"), &sorts).iter().all(|b| b.state == BlockState::GpuReady));
}

#[test]
fn view_actions_move_selection_and_open_details() {
    let (s, _) = fed();
    let mut v = ViewState::default();
    v.apply(Action::GoView(View::Residency), &s);
    v.apply(Action::Down(3), &s);
    assert_eq!(v.block_sel, 3);
    v.apply(Action::Down(100), &s);
    assert_eq!(v.block_sel, s.snapshot.blocks.len() - 1);
    v.apply(Action::Top, &s);
    assert_eq!(v.block_sel, 0);
    v.apply(Action::Enter, &s);
    assert_eq!(v.detail, Some(Detail::Block(BlockId(0))));
    v.apply(Action::Back, &s);
    assert_eq!(v.detail, None);

    for _ in 0..5 {
        v.apply(Action::SortNext, &s);
    }
    // By loads, most first; Enter opens the row drawn first.
    assert_eq!(v.sorts.get(TableId::Blocks), sort::Sort { column: 5, descending: true });
    v.apply(Action::Enter, &s);
    let first = s.sorted_blocks(&v.filter, &v.sorts)[0].id;
    assert_eq!(v.detail, Some(Detail::Block(first)));
    let most_loaded = s.snapshot.blocks.iter().map(|b| b.loads).max();
    assert_eq!(s.snapshot.block(first).map(|b| b.loads), most_loaded);
    v.apply(Action::Back, &s);
    v.apply(Action::SortReverse, &s);
    assert!(!v.sorts.get(TableId::Blocks).descending);

    v.apply(Action::NextView, &s);
    assert_eq!(v.view, View::Pools);
    v.apply(Action::SortNext, &s);
    assert_eq!(v.sorts, {
        let mut x = Sorts::default();
        x.next_column(TableId::Blocks);
        x.next_column(TableId::Blocks);
        x.next_column(TableId::Blocks);
        x.next_column(TableId::Blocks);
        x.next_column(TableId::Blocks);
        x.reverse(TableId::Blocks);
        x
    }, "a view without a table ignores the sort keys");
    v.apply(Action::GoView(View::Events), &s);
    assert_eq!(v.event_sel, None, "follows the tail");
    v.apply(Action::Up(1), &s);
    let n = s.recent.len();
    assert_eq!(v.event_sel, Some(n - 2));
    v.apply(Action::Enter, &s);
    assert_eq!(v.detail, Some(Detail::Event(s.recent[n - 2].seq)));
    v.apply(Action::Down(1), &s);
    assert_eq!(v.event_sel, None, "back at the tail follows again");
    v.apply(Action::NextView, &s);
    assert_eq!(v.view, View::Overview, "tab wraps around");
    v.apply(Action::PrevView, &s);
    assert_eq!(v.view, View::Events);
}

#[test]
fn filter_typing_commits_and_escape_clears() {
    let (s, _) = fed();
    let mut v = ViewState::default();
    v.apply(Action::StartFilter, &s);
    for c in "kind:pack".chars() {
        v.apply(Action::FilterChar(c), &s);
    }
    v.apply(Action::FilterChar('x'), &s);
    v.apply(Action::FilterBackspace, &s);
    assert_eq!(v.filter_input.as_deref(), Some("kind:pack"));
    v.apply(Action::FilterCommit, &s);
    assert_eq!(v.filter_input, None);
    assert_eq!(v.filter.text, "kind:pack");
    assert!(s.filtered_events(&v.filter).all(|e| e.kind.name() == "pack"));
    v.apply(Action::Back, &s);
    assert!(v.filter.is_empty());
    v.apply(Action::StartFilter, &s);
    v.apply(Action::FilterChar('z'), &s);
    v.apply(Action::FilterCancel, &s);
    assert!(v.filter.is_empty() && v.filter_input.is_none());
}

#[test]
fn source_controls_pass_through_and_quit_sets_the_flag() {
    let s = State::new();
    let mut v = ViewState::default();
    assert_eq!(v.apply(Action::Control(Control::Faster), &s), Some(Control::Faster));
    assert_eq!(v.apply(Action::Help, &s), None);
    assert!(v.help);
    v.apply(Action::Back, &s);
    assert!(!v.help);
    v.apply(Action::Quit, &s);
    assert!(v.quit);
}
