//! The parts the insight views break things into, each with one colour and one letter (for
//! no-colour and ASCII modes) used by every bar and legend: a step's time
//! ([`StepTimeBreakdown`]) and device memory by owner ([`VramByOwner`]).

use super::widgets::Swatch;
use crate::theme::Theme;
use ratatui::style::{Color, Style};
use stagehand_events::{StepTimeBreakdown, VramByOwner};

/// The parts of a step's time, in the order bars stack them.
pub(crate) const TIME_PARTS: [(&str, Color, &str); 7] = [
    ("compute", Color::Green, "C"),
    ("h2d wait", Color::Red, "H"),
    ("d2h wait", Color::Magenta, "D"),
    ("weight stall", Color::Yellow, "W"),
    ("restore stall", Color::LightRed, "R"),
    ("optimizer", Color::Blue, "O"),
    ("other", Color::Gray, "."),
];

/// The values of [`TIME_PARTS`] for one step, in ms.
pub(crate) fn time_values(t: &StepTimeBreakdown) -> [f64; 7] {
    [
        t.compute_ms,
        t.h2d_wait_ms,
        t.d2h_wait_ms,
        t.weight_stall_ms,
        t.restore_stall_ms,
        t.optimizer_ms,
        t.other_ms,
    ]
}

/// The owners of device memory, in the order bars stack them.
pub(crate) const OWNER_PARTS: [(&str, Color, &str); 5] = [
    ("weights", Color::Green, "W"),
    ("kept acts", Color::Cyan, "K"),
    ("restored", Color::Blue, "R"),
    ("in flight", Color::Yellow, "F"),
    ("other", Color::Gray, "o"),
];

/// The values of [`OWNER_PARTS`] for one reading, in bytes.
pub(crate) fn owner_values(o: &VramByOwner) -> [u64; 5] {
    [
        o.weights_bytes,
        o.activations_kept_bytes,
        o.activations_restored_bytes,
        o.copies_in_flight_bytes,
        o.other_bytes,
    ]
}

/// The swatch of a part: a coloured block, or its letter without colour or Unicode.
pub(crate) fn swatch(part: (&'static str, Color, &'static str), theme: &Theme) -> Swatch {
    let (name, color, letter) = part;
    if theme.color && !theme.ascii {
        Swatch { name, style: Style::default().fg(color), glyph: "█" }
    } else if theme.color {
        Swatch { name, style: Style::default().fg(color), glyph: letter }
    } else {
        Swatch { name, style: Style::default(), glyph: letter }
    }
}

/// Swatches of the time parts paired with one step's values.
pub(crate) fn time_parts(t: &StepTimeBreakdown, theme: &Theme) -> Vec<(Swatch, f64)> {
    TIME_PARTS.iter().zip(time_values(t)).map(|(p, v)| (swatch(*p, theme), v)).collect()
}

/// Swatches of the owners paired with one reading's bytes.
pub(crate) fn owner_parts(o: &VramByOwner, theme: &Theme) -> Vec<(Swatch, f64)> {
    OWNER_PARTS.iter().zip(owner_values(o)).map(|(p, v)| (swatch(*p, theme), v as f64)).collect()
}
