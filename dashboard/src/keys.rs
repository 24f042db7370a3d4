//! Keys to actions: one pure function, and the help table drawn from the same place.
//!
//! The keys follow htop, nvitop and tokio-console: `q` quits, `?` shows help, `Tab` and the
//! number keys switch views, arrows or `j`/`k` move, `Enter` opens details, `Esc` goes back,
//! `/` filters, `s`/`S` sort, `space` pauses; in replay, arrows left/right step, `[`/`]` step by training
//! step, `<`/`>` seek, `+`/`-` change speed, `Home`/`End` jump to the start or the end.

use crate::app::{Control, View};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

/// What a key does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    Quit,
    Help,
    NextView,
    PrevView,
    GoView(View),
    Up(usize),
    Down(usize),
    Top,
    Bottom,
    Enter,
    Back,
    StartFilter,
    FilterChar(char),
    FilterBackspace,
    FilterCommit,
    FilterCancel,
    /// Sort the view's table by its next column.
    SortNext,
    /// Reverse the order of the view's table.
    SortReverse,
    /// Asks the source (pause, seek, speed).
    Control(Control),
}

/// What the key map needs to know about the screen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyContext {
    /// A filter is being typed: printable keys are text.
    pub typing_filter: bool,
    /// The source is a replay: seek and speed keys apply.
    pub replay: bool,
}

/// Rows moved by `PageUp`/`PageDown`.
pub const PAGE: usize = 10;

/// The action of a key, if it has one here.
pub fn map_key(key: KeyEvent, ctx: KeyContext) -> Option<Action> {
    if key.kind == KeyEventKind::Release {
        return None;
    }
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    if ctrl && key.code == KeyCode::Char('c') {
        return Some(Action::Quit);
    }
    if ctx.typing_filter {
        return match key.code {
            KeyCode::Enter => Some(Action::FilterCommit),
            KeyCode::Esc => Some(Action::FilterCancel),
            KeyCode::Backspace => Some(Action::FilterBackspace),
            KeyCode::Char(c) if !ctrl => Some(Action::FilterChar(c)),
            _ => None,
        };
    }
    let replay = |c: Control| ctx.replay.then_some(Action::Control(c));
    match key.code {
        KeyCode::Char('q') => Some(Action::Quit),
        KeyCode::Char('?') | KeyCode::F(1) => Some(Action::Help),
        KeyCode::Tab => Some(Action::NextView),
        KeyCode::BackTab => Some(Action::PrevView),
        KeyCode::Char(c @ '1'..='9') => {
            let i = c as usize - '1' as usize;
            View::ALL.get(i).map(|v| Action::GoView(*v))
        }
        KeyCode::Up | KeyCode::Char('k') => Some(Action::Up(1)),
        KeyCode::Down | KeyCode::Char('j') => Some(Action::Down(1)),
        KeyCode::PageUp => Some(Action::Up(PAGE)),
        KeyCode::PageDown => Some(Action::Down(PAGE)),
        KeyCode::Char('g') => Some(Action::Top),
        KeyCode::Char('G') => Some(Action::Bottom),
        KeyCode::Enter => Some(Action::Enter),
        KeyCode::Esc => Some(Action::Back),
        KeyCode::Char('/') => Some(Action::StartFilter),
        KeyCode::Char('s') => Some(Action::SortNext),
        KeyCode::Char('S') => Some(Action::SortReverse),
        KeyCode::Char(' ') | KeyCode::Char('p') => Some(Action::Control(Control::TogglePause)),
        KeyCode::Left | KeyCode::Char('h') => replay(Control::StepEvents(-1)),
        KeyCode::Right | KeyCode::Char('l') => replay(Control::StepEvents(1)),
        KeyCode::Char('[') => replay(Control::StepTraining(-1)),
        KeyCode::Char(']') => replay(Control::StepTraining(1)),
        KeyCode::Char('<') | KeyCode::Char(',') => replay(Control::SeekFraction(-0.05)),
        KeyCode::Char('>') | KeyCode::Char('.') => replay(Control::SeekFraction(0.05)),
        KeyCode::Char('+') | KeyCode::Char('=') => replay(Control::Faster),
        KeyCode::Char('-') | KeyCode::Char('_') => replay(Control::Slower),
        KeyCode::Home => replay(Control::ToStart),
        KeyCode::End => replay(Control::ToEnd),
        _ => None,
    }
}

/// Every key, for the help overlay and the README: (keys, what they do, replay only).
pub const HELP: &[(&str, &str, bool)] = &[
    ("q  Ctrl-C", "quit", false),
    ("?  F1", "show or hide this help", false),
    ("Tab  Shift-Tab", "next / previous view", false),
    ("1..9", "Overview, Step time, VRAM, Residency, Pools, Transfers, Activations, Conductor, Events", false),
    ("Up Down  k j", "move the selection", false),
    ("PgUp PgDn", "move the selection by a page", false),
    ("g  G", "first row / last row (Events: follow the tail)", false),
    ("Enter", "details of the selected block or event", false),
    ("Esc", "close details or help; clear the filter", false),
    ("/", "filter: kind:NAME block:N step:N or step:A-B, words", false),
    ("s  S", "sort the table by the next column / reverse the order", false),
    ("space  p", "pause or resume (live: freeze the display)", false),
    ("Left Right  h l", "step one event back / forward", true),
    ("[  ]", "step one training step back / forward", true),
    ("<  >", "seek 5% of the file back / forward", true),
    ("-  +", "half / double the speed", true),
    ("Home  End", "jump to the start / the end", true),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn key(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    const LIVE: KeyContext = KeyContext { typing_filter: false, replay: false };
    const REPLAY: KeyContext = KeyContext { typing_filter: false, replay: true };
    const TYPING: KeyContext = KeyContext { typing_filter: true, replay: true };

    #[test]
    fn the_usual_keys() {
        assert_eq!(map_key(key(KeyCode::Char('q')), LIVE), Some(Action::Quit));
        assert_eq!(
            map_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL), LIVE),
            Some(Action::Quit)
        );
        assert_eq!(map_key(key(KeyCode::Char('?')), LIVE), Some(Action::Help));
        assert_eq!(map_key(key(KeyCode::Tab), LIVE), Some(Action::NextView));
        assert_eq!(map_key(key(KeyCode::BackTab), LIVE), Some(Action::PrevView));
        assert_eq!(map_key(key(KeyCode::Char('1')), LIVE), Some(Action::GoView(View::Overview)));
        assert_eq!(map_key(key(KeyCode::Char('2')), LIVE), Some(Action::GoView(View::Time)));
        assert_eq!(map_key(key(KeyCode::Char('9')), LIVE), Some(Action::GoView(View::Events)));
        assert_eq!(map_key(key(KeyCode::Char('0')), LIVE), None);
        assert_eq!(map_key(key(KeyCode::Char('s')), LIVE), Some(Action::SortNext));
        assert_eq!(map_key(key(KeyCode::Char('S')), LIVE), Some(Action::SortReverse));
        assert_eq!(map_key(key(KeyCode::Char('j')), LIVE), Some(Action::Down(1)));
        assert_eq!(map_key(key(KeyCode::Up), LIVE), Some(Action::Up(1)));
        assert_eq!(map_key(key(KeyCode::PageDown), LIVE), Some(Action::Down(PAGE)));
        assert_eq!(map_key(key(KeyCode::Enter), LIVE), Some(Action::Enter));
        assert_eq!(map_key(key(KeyCode::Esc), LIVE), Some(Action::Back));
        assert_eq!(map_key(key(KeyCode::Char('/')), LIVE), Some(Action::StartFilter));
        assert_eq!(
            map_key(key(KeyCode::Char(' ')), LIVE),
            Some(Action::Control(Control::TogglePause))
        );
    }

    #[test]
    fn seek_and_speed_keys_only_in_replay() {
        for code in [KeyCode::Left, KeyCode::Right, KeyCode::Char('+'), KeyCode::Home, KeyCode::End, KeyCode::Char('[')] {
            assert_eq!(map_key(key(code), LIVE), None, "{code:?} in live mode");
        }
        assert_eq!(
            map_key(key(KeyCode::Left), REPLAY),
            Some(Action::Control(Control::StepEvents(-1)))
        );
        assert_eq!(
            map_key(key(KeyCode::Char(']')), REPLAY),
            Some(Action::Control(Control::StepTraining(1)))
        );
        assert_eq!(
            map_key(key(KeyCode::Char('>')), REPLAY),
            Some(Action::Control(Control::SeekFraction(0.05)))
        );
        assert_eq!(map_key(key(KeyCode::Char('-')), REPLAY), Some(Action::Control(Control::Slower)));
        assert_eq!(map_key(key(KeyCode::End), REPLAY), Some(Action::Control(Control::ToEnd)));
    }

    #[test]
    fn typing_a_filter_takes_printable_keys_as_text() {
        assert_eq!(map_key(key(KeyCode::Char('q')), TYPING), Some(Action::FilterChar('q')));
        assert_eq!(map_key(key(KeyCode::Char('1')), TYPING), Some(Action::FilterChar('1')));
        assert_eq!(map_key(key(KeyCode::Char(' ')), TYPING), Some(Action::FilterChar(' ')));
        assert_eq!(map_key(key(KeyCode::Enter), TYPING), Some(Action::FilterCommit));
        assert_eq!(map_key(key(KeyCode::Esc), TYPING), Some(Action::FilterCancel));
        assert_eq!(map_key(key(KeyCode::Backspace), TYPING), Some(Action::FilterBackspace));
        assert_eq!(map_key(key(KeyCode::Tab), TYPING), None);
    }

    #[test]
    fn releases_are_ignored() {
        let mut k = key(KeyCode::Char('q'));
        k.kind = KeyEventKind::Release;
        assert_eq!(map_key(k, LIVE), None);
    }

    #[test]
    fn help_lists_every_view_key() {
        let all: String = HELP.iter().map(|(k, d, _)| format!("{k} {d}\n")).collect();
        for v in View::ALL {
            assert!(all.contains(v.title()), "help does not name {}", v.title());
        }
    }
}
