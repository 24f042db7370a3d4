//! Renders a terminal capture with colours (`tmux capture-pane -e -p`) to an SVG image: each
//! cell at its place in a monospace grid, with its colours and weight. How the screenshots in
//! `docs/screenshots/` were made from `stagehand-top` running against the host demo:
//!
//! ```sh
//! tmux new-session -d -s top -x 120 -y 40 'stagehand-top --connect 127.0.0.1:7878'
//! tmux capture-pane -t top -e -p | cargo run -p stagehand-dashboard --example ansi2svg -- 120 40 > top.svg
//! ```

use std::fmt::Write as _;
use std::io::Read;

/// Cell size in pixels, and the font.
const CW: f64 = 8.4;
const CH: f64 = 17.0;
const FONT: &str = "DejaVu Sans Mono, Menlo, Consolas, monospace";
const BG: &str = "#1e1e1e";
const FG: &str = "#d4d4d4";

/// The xterm palette's first 16 colours, as most terminals draw them.
const ANSI: [&str; 16] = [
    "#000000", "#cd3131", "#0dbc79", "#e5e510", "#2472c8", "#bc3fbc", "#11a8cd", "#e5e5e5", "#666666", "#f14c4c",
    "#23d18b", "#f5f543", "#3b8eea", "#d670d6", "#29b8db", "#ffffff",
];

fn colour(c: vt100::Color, default: &str) -> String {
    match c {
        vt100::Color::Default => default.to_owned(),
        vt100::Color::Idx(i) if (i as usize) < 16 => ANSI[i as usize].to_owned(),
        vt100::Color::Idx(i) if i >= 232 => {
            let v = 8 + 10 * (i as u32 - 232);
            format!("#{v:02x}{v:02x}{v:02x}")
        }
        vt100::Color::Idx(i) => {
            let i = i as u32 - 16;
            let step = |v: u32| if v == 0 { 0 } else { 55 + 40 * v };
            format!("#{:02x}{:02x}{:02x}", step(i / 36), step((i / 6) % 6), step(i % 6))
        }
        vt100::Color::Rgb(r, g, b) => format!("#{r:02x}{g:02x}{b:02x}"),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let cols: u16 = args.next().and_then(|a| a.parse().ok()).unwrap_or(80);
    let rows: u16 = args.next().and_then(|a| a.parse().ok()).unwrap_or(24);
    let mut input = Vec::new();
    std::io::stdin().read_to_end(&mut input)?;
    // A capture ends its lines with bare newlines: as a terminal, each is a carriage return too.
    let text = String::from_utf8_lossy(&input).replace('\n', "\r\n");
    let mut parser = vt100::Parser::new(rows, cols, 0);
    parser.process(text.trim_end_matches("\r\n").as_bytes());
    let screen = parser.screen();

    let (w, h) = (cols as f64 * CW, rows as f64 * CH);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="{FONT}" font-size="14">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="{BG}"/>"#);
    for r in 0..rows {
        let y = r as f64 * CH;
        for c in 0..cols {
            let Some(cell) = screen.cell(r, c) else { continue };
            let (mut fg, mut bg) = (colour(cell.fgcolor(), FG), colour(cell.bgcolor(), BG));
            if cell.inverse() {
                std::mem::swap(&mut fg, &mut bg);
            }
            let x = c as f64 * CW;
            if bg != BG {
                let _ = writeln!(svg, r#"<rect x="{x:.1}" y="{y:.1}" width="{CW:.1}" height="{CH:.1}" fill="{bg}"/>"#);
            }
            let s = cell.contents();
            if s.trim().is_empty() {
                continue;
            }
            // Block elements fill their cell exactly, so bars join without seams.
            if let Some(frac) = match s.as_str() {
                "█" => Some(1.0),
                "▇" => Some(7.0 / 8.0),
                "▆" => Some(6.0 / 8.0),
                "▅" => Some(5.0 / 8.0),
                "▄" => Some(4.0 / 8.0),
                "▃" => Some(3.0 / 8.0),
                "▂" => Some(2.0 / 8.0),
                "▁" => Some(1.0 / 8.0),
                _ => None,
            } {
                let top = y + CH * (1.0 - frac);
                let _ = writeln!(svg, r#"<rect x="{x:.1}" y="{top:.1}" width="{CW:.1}" height="{:.1}" fill="{fg}"/>"#, CH * frac);
                continue;
            }
            // Shades as translucent cells, aligned with the blocks beside them.
            if let Some(alpha) = match s.as_str() {
                "░" => Some(0.25),
                "▒" => Some(0.5),
                "▓" => Some(0.75),
                _ => None,
            } {
                let _ = writeln!(svg, r#"<rect x="{x:.1}" y="{y:.1}" width="{CW:.1}" height="{CH:.1}" fill="{fg}" fill-opacity="{alpha}"/>"#);
                continue;
            }
            let weight = if cell.bold() { r#" font-weight="bold""# } else { "" };
            let _ = writeln!(
                svg,
                r#"<text x="{x:.1}" y="{:.1}" fill="{fg}"{weight} xml:space="preserve">{}</text>"#,
                y + CH * 0.78,
                escape(&s)
            );
        }
    }
    svg.push_str("</svg>\n");
    print!("{svg}");
    Ok(())
}
