//! Colours and symbols: usage bands (green up to 60%, yellow up to 80%, red above), one colour
//! per residency state, and the no-colour and ASCII modes.

use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::border;
use stagehand_events::BlockState;

/// How the UI draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Theme {
    /// Colours on (off with `--no-color` or `NO_COLOR`).
    pub color: bool,
    /// Only ASCII characters (`--ascii`), for terminals without Unicode.
    pub ascii: bool,
}

impl Default for Theme {
    fn default() -> Self {
        Theme {
            color: true,
            ascii: false,
        }
    }
}

/// A usage band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Band {
    /// Up to 60%.
    Ok,
    /// Up to 80%.
    Warm,
    /// Above 80%.
    Hot,
}

/// The band of a fraction in 0..=1.
pub fn band(fraction: f64) -> Band {
    if fraction <= 0.60 {
        Band::Ok
    } else if fraction <= 0.80 {
        Band::Warm
    } else {
        Band::Hot
    }
}

/// ASCII box drawing.
const ASCII_BORDER: border::Set = border::Set {
    top_left: "+",
    top_right: "+",
    bottom_left: "+",
    bottom_right: "+",
    vertical_left: "|",
    vertical_right: "|",
    horizontal_top: "-",
    horizontal_bottom: "-",
};

impl Theme {
    /// The theme for the flags and the environment (`NO_COLOR` set and not empty turns colour off).
    pub fn from_flags(no_color: bool, ascii: bool, no_color_env: Option<&str>) -> Theme {
        let env_off = no_color_env.is_some_and(|v| !v.is_empty());
        Theme {
            color: !(no_color || env_off),
            ascii,
        }
    }

    fn fg(&self, c: Color) -> Style {
        if self.color {
            Style::default().fg(c)
        } else {
            Style::default()
        }
    }

    /// The style of a usage band.
    pub fn band(&self, fraction: f64) -> Style {
        match band(fraction) {
            Band::Ok => self.fg(Color::Green),
            Band::Warm => self.fg(Color::Yellow),
            Band::Hot => self.fg(Color::Red).add_modifier(if self.color {
                Modifier::empty()
            } else {
                Modifier::BOLD
            }),
        }
    }

    /// The colour of a residency state.
    pub fn state_color(state: BlockState) -> Color {
        match state {
            BlockState::Unloaded => Color::DarkGray,
            BlockState::HostStaged => Color::Blue,
            BlockState::Prefetching => Color::Cyan,
            BlockState::GpuReady => Color::Green,
            BlockState::Evicting => Color::Yellow,
            BlockState::GpuFreeing => Color::Magenta,
        }
    }

    /// The style of a residency state.
    pub fn state(&self, state: BlockState) -> Style {
        self.fg(Theme::state_color(state))
    }

    /// One character for a state, for the itinerary strip (readable without colour).
    pub fn state_glyph(&self, state: BlockState) -> &'static str {
        match (state, self.ascii) {
            (BlockState::Unloaded, true) => ".",
            (BlockState::HostStaged, true) => "s",
            (BlockState::Prefetching, true) => ">",
            (BlockState::GpuReady, true) => "#",
            (BlockState::Evicting, true) => "<",
            (BlockState::GpuFreeing, true) => "x",
            (BlockState::Unloaded, false) => "·",
            (BlockState::HostStaged, false) => "▫",
            (BlockState::Prefetching, false) => "▸",
            (BlockState::GpuReady, false) => "█",
            (BlockState::Evicting, false) => "◂",
            (BlockState::GpuFreeing, false) => "╳",
        }
    }

    /// Borders of blocks.
    pub fn border(&self) -> border::Set {
        if self.ascii {
            ASCII_BORDER
        } else {
            border::ROUNDED
        }
    }

    /// Filled and empty cells of bars.
    pub fn bar_cells(&self) -> (&'static str, &'static str) {
        if self.ascii {
            ("#", ".")
        } else {
            ("█", "░")
        }
    }

    /// Eight levels for sparklines, lowest first.
    pub fn spark_levels(&self) -> [&'static str; 9] {
        if self.ascii {
            [" ", ".", ".", ":", ":", "|", "|", "#", "#"]
        } else {
            [" ", "▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"]
        }
    }

    /// Separator between header fields.
    pub fn sep(&self) -> &'static str {
        if self.ascii {
            " | "
        } else {
            " │ "
        }
    }

    /// Emphasis (bold, kept without colour).
    pub fn strong(&self) -> Style {
        Style::default().add_modifier(Modifier::BOLD)
    }

    /// Dim text (labels).
    pub fn dim(&self) -> Style {
        self.fg(Color::DarkGray)
    }

    /// Something wrong (drops, errors, denials).
    pub fn alert(&self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }

    /// The selected row.
    pub fn selected(&self) -> Style {
        Style::default().add_modifier(Modifier::REVERSED)
    }

    /// Accent (titles, the active tab).
    pub fn accent(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bands_split_at_sixty_and_eighty_percent() {
        assert_eq!(band(0.0), Band::Ok);
        assert_eq!(band(0.60), Band::Ok);
        assert_eq!(band(0.61), Band::Warm);
        assert_eq!(band(0.80), Band::Warm);
        assert_eq!(band(0.81), Band::Hot);
        assert_eq!(band(1.5), Band::Hot);
    }

    #[test]
    fn six_states_six_colours() {
        let mut colours: Vec<String> =
            BlockState::ALL.iter().map(|s| format!("{:?}", Theme::state_color(*s))).collect();
        colours.sort();
        colours.dedup();
        assert_eq!(colours.len(), 6);
        let mut glyphs: Vec<&str> = BlockState::ALL
            .iter()
            .map(|s| Theme { color: false, ascii: true }.state_glyph(*s))
            .collect();
        glyphs.sort();
        glyphs.dedup();
        assert_eq!(glyphs.len(), 6);
    }

    #[test]
    fn no_color_from_flag_or_environment() {
        assert!(Theme::from_flags(false, false, None).color);
        assert!(!Theme::from_flags(true, false, None).color);
        assert!(!Theme::from_flags(false, false, Some("1")).color);
        assert!(Theme::from_flags(false, false, Some("")).color, "NO_COLOR='' does not count");
        let plain = Theme { color: false, ascii: true };
        assert_eq!(plain.band(0.9).fg, None);
        assert_eq!(plain.state(BlockState::GpuReady).fg, None);
        assert!(plain.border().top_left.is_ascii());
        assert!(plain.spark_levels().iter().all(|s| s.is_ascii()));
    }
}
