//! The filter typed after `/`: over events (Events view) and blocks (Residency view).

use stagehand_events::{snapshot, BlockId, Event};

/// A filter over events (Events view) and blocks (Residency view), typed after `/`.
///
/// Words are ANDed: `kind:resid` (kind name contains), `block:3`, `step:2` or `step:2-4`; a bare
/// word matches the kind name, or for blocks the block name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filter {
    pub text: String,
    kinds: Vec<String>,
    words: Vec<String>,
    block: Option<u32>,
    steps: Option<(u64, u64)>,
    /// Words that did not parse, shown so a typo is visible.
    pub invalid: Vec<String>,
}

impl Filter {
    /// Parses a filter; an empty text matches everything.
    pub fn parse(text: &str) -> Filter {
        let mut f = Filter {
            text: text.trim().to_owned(),
            ..Default::default()
        };
        for word in text.split_whitespace() {
            let lower = word.to_ascii_lowercase();
            if let Some(k) = lower.strip_prefix("kind:") {
                f.kinds.push(k.to_owned());
            } else if let Some(b) = lower.strip_prefix("block:") {
                match b.parse() {
                    Ok(n) => f.block = Some(n),
                    Err(_) => f.invalid.push(word.to_owned()),
                }
            } else if let Some(s) = lower.strip_prefix("step:") {
                let range = match s.split_once('-') {
                    Some((a, b)) => a.parse().ok().zip(b.parse().ok()),
                    None => s.parse().ok().map(|n| (n, n)),
                };
                match range {
                    Some(r) => f.steps = Some(r),
                    None => f.invalid.push(word.to_owned()),
                }
            } else {
                f.words.push(lower);
            }
        }
        f
    }

    /// True when the filter lets everything through.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Whether an event passes.
    pub fn matches_event(&self, e: &Event) -> bool {
        let name = e.kind.name();
        self.kinds.iter().all(|k| name.contains(k.as_str()))
            && self.words.iter().all(|w| name.contains(w.as_str()))
            && self.block.is_none_or(|b| e.kind.block() == Some(BlockId(b)))
            && self.steps.is_none_or(|(a, b)| (a..=b).contains(&e.step))
    }

    /// Whether a block passes (the Residency view).
    pub fn matches_block(&self, b: &snapshot::BlockView) -> bool {
        self.block.is_none_or(|id| b.id == BlockId(id))
            && self
                .words
                .iter()
                .all(|w| b.name.to_ascii_lowercase().contains(w.as_str()) || b.state.as_str().contains(w.as_str()))
            && self.kinds.iter().all(|k| b.state.as_str().contains(k.as_str()))
    }
}
