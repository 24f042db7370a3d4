//! Sortable tables: their columns, each column's sort key, and the order a table is in. No
//! ratatui here: the state sorts rows (so that a selection means the same row the view draws)
//! and the views draw the order in the header (`step ▼`).
//!
//! `s` moves a table's sort to its next column (each column starts in the order that puts the
//! interesting rows first: biggest sizes, longest waits, newest steps), `S` reverses it.

use std::cmp::Ordering;
use stagehand_events::snapshot::{BlockView, DenialRecord, StepRecord, TransferRecord};

/// The tables that sort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TableId {
    /// Residency: one row per weight block.
    Blocks,
    /// Step time: one row per recent step.
    StepTimes,
    /// Transfers: the most recent copies.
    Transfers,
    /// Activations: one row per recent step.
    ActivationSteps,
    /// Conductor: the most recent denials.
    Denials,
}

impl TableId {
    /// Every sortable table.
    pub const ALL: [TableId; 5] = [
        TableId::Blocks,
        TableId::StepTimes,
        TableId::Transfers,
        TableId::ActivationSteps,
        TableId::Denials,
    ];

    /// The table's columns, in display order.
    pub fn columns(self) -> &'static [Column] {
        match self {
            TableId::Blocks => BLOCK_COLUMNS,
            TableId::StepTimes => STEP_TIME_COLUMNS,
            TableId::Transfers => TRANSFER_COLUMNS,
            TableId::ActivationSteps => ACTIVATION_COLUMNS,
            TableId::Denials => DENIAL_COLUMNS,
        }
    }

    /// The order a table starts in.
    pub fn default_sort(self) -> Sort {
        match self {
            // Blocks in registration order; the rest newest first.
            TableId::Blocks => Sort { column: 0, descending: false },
            _ => Sort { column: 0, descending: true },
        }
    }

    fn index(self) -> usize {
        TableId::ALL.iter().position(|t| *t == self).unwrap_or(0)
    }
}

/// One column of a sortable table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column {
    /// The header text.
    pub title: &'static str,
    /// Whether choosing this column sorts it descending first (sizes, waits: biggest first).
    pub descending_first: bool,
}

const fn col(title: &'static str, descending_first: bool) -> Column {
    Column { title, descending_first }
}

const BLOCK_COLUMNS: &[Column] = &[
    col("id", false),
    col("name", false),
    col("state", false),
    col("ref", true),
    col("size", true),
    col("loads", true),
    col("evict", true),
    col("last", true),
];
const STEP_TIME_COLUMNS: &[Column] = &[
    col("step", true),
    col("total", true),
    col("compute", true),
    col("h2d wait", true),
    col("d2h wait", true),
    col("stalls", true),
    col("optim", true),
    col("other", true),
];
const TRANSFER_COLUMNS: &[Column] = &[
    col("seq", true),
    col("dir", false),
    col("owner", false),
    col("bytes", true),
    col("time", true),
    col("GB/s", false),
];
const ACTIVATION_COLUMNS: &[Column] = &[
    col("step", true),
    col("saved", true),
    col("kept", true),
    col("spilled", true),
    col("restored", true),
    col("stalls", true),
    col("spill bytes", true),
    col("peak", true),
];
const DENIAL_COLUMNS: &[Column] = &[
    col("seq", true),
    col("step", true),
    col("phase", false),
    col("owner", false),
    col("what", false),
    col("reason", false),
];

/// The order a table is in: by which column, which way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sort {
    pub column: usize,
    pub descending: bool,
}

/// The order of every sortable table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sorts([Sort; TableId::ALL.len()]);

impl Default for Sorts {
    fn default() -> Self {
        Sorts(TableId::ALL.map(TableId::default_sort))
    }
}

impl Sorts {
    /// The order of `t`.
    pub fn get(&self, t: TableId) -> Sort {
        self.0[t.index()]
    }

    /// Sorts `t` by its next column, in that column's first direction.
    pub fn next_column(&mut self, t: TableId) {
        let cols = t.columns();
        let s = &mut self.0[t.index()];
        s.column = (s.column + 1) % cols.len();
        s.descending = cols[s.column].descending_first;
    }

    /// Reverses the order of `t`.
    pub fn reverse(&mut self, t: TableId) {
        let s = &mut self.0[t.index()];
        s.descending = !s.descending;
    }
}

/// A value to sort by.
#[derive(Debug, Clone, PartialEq)]
pub enum Key<'a> {
    N(f64),
    S(&'a str),
}

impl Key<'_> {
    fn cmp(&self, o: &Key<'_>) -> Ordering {
        match (self, o) {
            (Key::N(a), Key::N(b)) => a.total_cmp(b),
            (Key::S(a), Key::S(b)) => a.cmp(b),
            (Key::N(_), Key::S(_)) => Ordering::Less,
            (Key::S(_), Key::N(_)) => Ordering::Greater,
        }
    }
}

/// Rows sorted stably by `key` of the sort's column; ties keep their given order.
pub fn sorted<'a, T>(mut rows: Vec<&'a T>, sort: Sort, key: impl for<'b> Fn(&'b T, usize) -> Key<'b>) -> Vec<&'a T> {
    rows.sort_by(|a, b| {
        let o = key(a, sort.column).cmp(&key(b, sort.column));
        if sort.descending {
            o.reverse()
        } else {
            o
        }
    });
    rows
}

fn n<T: Into<f64>>(v: T) -> Key<'static> {
    Key::N(v.into())
}

/// Sort key of a block row.
pub fn block_key(b: &BlockView, column: usize) -> Key<'_> {
    match column {
        1 => Key::S(&b.name),
        2 => Key::S(b.state.as_str()),
        3 => n(b.refcount),
        4 => Key::N(b.bytes as f64),
        5 => Key::N(b.loads as f64),
        6 => Key::N(b.evictions as f64),
        7 => Key::N(b.last_seq as f64),
        _ => n(b.id.0),
    }
}

/// Sort key of a step's time breakdown (steps without one sort as zero).
pub fn step_time_key(r: &StepRecord, column: usize) -> Key<'_> {
    let t = r.time.unwrap_or_default();
    Key::N(match column {
        1 => t.step_ms,
        2 => t.compute_ms,
        3 => t.h2d_wait_ms,
        4 => t.d2h_wait_ms,
        5 => t.weight_stall_ms + t.restore_stall_ms,
        6 => t.optimizer_ms,
        7 => t.other_ms,
        _ => r.step as f64,
    })
}

/// Sort key of a completed copy.
pub fn transfer_key(t: &TransferRecord, column: usize) -> Key<'_> {
    match column {
        1 => Key::S(t.dir.as_str()),
        2 => Key::S(t.owner.as_str()),
        3 => Key::N(t.bytes as f64),
        // Copies that were not timed sort below every timed one.
        4 => Key::N(t.duration_ms.unwrap_or(f64::NEG_INFINITY)),
        5 => Key::N(t.gbps().unwrap_or(f64::NEG_INFINITY)),
        _ => Key::N(t.seq as f64),
    }
}

/// Sort key of a step's activation metrics (steps without them sort as zero).
pub fn activation_key(r: &StepRecord, column: usize) -> Key<'_> {
    let Some(m) = &r.activations else {
        return Key::N(if column == 0 { r.step as f64 } else { 0.0 });
    };
    Key::N(match column {
        1 => m.activations_saved as f64,
        2 => m.activations_kept as f64,
        3 => m.activations_spilled as f64,
        4 => m.activations_restored as f64,
        5 => m.stall_time_ms,
        6 => m.spill_bytes as f64,
        7 => m.vram_peak_mib,
        _ => r.step as f64,
    })
}

/// Sort key of a denial.
pub fn denial_key(d: &DenialRecord, column: usize) -> Key<'_> {
    match column {
        1 => Key::N(d.step as f64),
        2 => Key::S(d.phase.as_str()),
        3 => Key::S(d.owner.as_str()),
        4 => Key::S(&d.what),
        5 => Key::S(d.reason.as_str()),
        _ => Key::N(d.seq as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s_cycles_columns_and_capital_s_reverses() {
        let mut s = Sorts::default();
        assert_eq!(s.get(TableId::Blocks), Sort { column: 0, descending: false });
        s.next_column(TableId::Blocks);
        assert_eq!(s.get(TableId::Blocks), Sort { column: 1, descending: false });
        s.next_column(TableId::Blocks);
        s.next_column(TableId::Blocks);
        assert_eq!(s.get(TableId::Blocks), Sort { column: 3, descending: true }, "ref: biggest first");
        s.reverse(TableId::Blocks);
        assert!(!s.get(TableId::Blocks).descending);
        for _ in 0..BLOCK_COLUMNS.len() - 3 {
            s.next_column(TableId::Blocks);
        }
        assert_eq!(s.get(TableId::Blocks).column, 0, "wraps around");
        assert_eq!(s.get(TableId::Transfers), TableId::Transfers.default_sort(), "tables are independent");
    }

    #[test]
    fn sorting_is_stable_and_honours_the_direction() {
        let rows = [(3, "b"), (1, "a"), (3, "a"), (2, "c")];
        let refs: Vec<&(i32, &str)> = rows.iter().collect();
        fn key<'b>(r: &'b (i32, &'static str), c: usize) -> Key<'b> {
            if c == 0 { Key::N(r.0 as f64) } else { Key::S(r.1) }
        }
        let by_num = sorted(refs.clone(), Sort { column: 0, descending: true }, key);
        assert_eq!(by_num, [&(3, "b"), &(3, "a"), &(2, "c"), &(1, "a")]);
        let by_name = sorted(refs, Sort { column: 1, descending: false }, key);
        assert_eq!(by_name, [&(1, "a"), &(3, "a"), &(3, "b"), &(2, "c")]);
    }

    #[test]
    fn copies_that_were_not_timed_sort_below_the_timed_ones() {
        use stagehand_events::{Direction, Owner, TransferId};
        let rec = |seq: u64, duration_ms: Option<f64>| TransferRecord {
            seq,
            t_ns: seq,
            id: TransferId(seq),
            dir: Direction::H2d,
            owner: Owner::Weights,
            bytes: 1 << 20,
            duration_ms,
        };
        let rows = [rec(1, Some(2.0)), rec(2, None), rec(3, Some(1.0))];
        let by_time = sorted(rows.iter().collect(), Sort { column: 4, descending: false }, transfer_key);
        assert_eq!(by_time.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 3, 1]);
        let by_rate = sorted(rows.iter().collect(), Sort { column: 5, descending: true }, transfer_key);
        assert_eq!(by_rate.iter().map(|r| r.seq).collect::<Vec<_>>(), [3, 1, 2]);
    }

    #[test]
    fn every_table_has_a_key_for_every_column() {
        assert_eq!(BLOCK_COLUMNS.len(), 8);
        assert_eq!(STEP_TIME_COLUMNS.len(), 8);
        assert_eq!(TRANSFER_COLUMNS.len(), 6);
        assert_eq!(ACTIVATION_COLUMNS.len(), 8);
        assert_eq!(DENIAL_COLUMNS.len(), 6);
    }
}
