//! The segments of a rotated telemetry file: `run.jsonl` is segment 0, then `run.0001.jsonl`,
//! `run.0002.jsonl`, ... (`run.0001.jsonl.zst` when compressed). Readers take them as one
//! logical file; a segment missing between two that exist is an error naming it.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

/// Segments a run may have, at most (a bound on what a folder listing can make a reader hold).
pub const MAX_SEGMENTS: u32 = 1 << 20;

/// The file name of `base` split where its `.jsonl` extension starts (the whole name, and no
/// extension, when it has none).
fn split(base: &Path) -> (String, String) {
    let name = base.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    match name.find(".jsonl") {
        Some(i) => (name[..i].to_owned(), name[i..].to_owned()),
        None => (name, String::new()),
    }
}

/// The path of segment `n` of a rotated file: `run.jsonl` is segment 0, `run.0001.jsonl` segment
/// 1 (`run.0001.jsonl.zst` when compressed).
pub fn segment_path(base: &Path, n: u32) -> PathBuf {
    if n == 0 {
        return base.to_path_buf();
    }
    let (stem, ext) = split(base);
    base.with_file_name(format!("{stem}.{n:04}{ext}"))
}

/// The segment number a file name has in the run of `base`, if it is one of its segments.
fn segment_number(stem: &str, ext: &str, name: &str) -> Option<u32> {
    let digits = name.strip_prefix(stem)?.strip_prefix('.')?.strip_suffix(ext)?;
    if digits.len() < 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().filter(|n| *n >= 1)
}

/// The segments of the run whose first file is `base`, in order: `base` itself (which must
/// exist), then every numbered segment beside it. An error names the first segment missing
/// below the highest one there.
pub fn list(base: &Path) -> io::Result<Vec<PathBuf>> {
    std::fs::metadata(base)?;
    let (stem, ext) = split(base);
    let dir = match base.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from("."),
    };
    let mut found = BTreeSet::new();
    // Not a folder (a device's): no segments beside it.
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            if let Some(n) = name.to_str().and_then(|n| segment_number(&stem, &ext, n)) {
                if n > MAX_SEGMENTS {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("segment '{}' is numbered above {MAX_SEGMENTS}: not a segment this writer makes", entry.path().display()),
                    ));
                }
                found.insert(n);
            }
        }
    }
    let mut out = vec![base.to_path_buf()];
    for (expected, n) in (1u32..).zip(&found) {
        if *n != expected {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "segment '{}' of the rotated run '{}' is missing (segments up to '{}' are there): the run cannot be read as one",
                    segment_path(base, expected).display(),
                    base.display(),
                    segment_path(base, *found.iter().next_back().unwrap_or(n)).display()
                ),
            ));
        }
        out.push(segment_path(base, *n));
    }
    Ok(out)
}

/// The segments of a rotated file that exist, in order, starting with `base` (stopping at the
/// first one missing; [`list`] says when one is missing).
pub fn segments(base: &Path) -> Vec<PathBuf> {
    (0..).map(|n| segment_path(base, n)).take_while(|p| p.exists()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_others_are_not_segments() {
        let base = Path::new("/x/run.jsonl.zst");
        assert_eq!(segment_path(base, 3), Path::new("/x/run.0003.jsonl.zst"));
        assert_eq!(segment_number("run", ".jsonl.zst", "run.0003.jsonl.zst"), Some(3));
        assert_eq!(segment_number("run", ".jsonl.zst", "run.12345.jsonl.zst"), Some(12345));
        for other in ["run.jsonl.zst", "run.03.jsonl.zst", "run.0000.jsonl.zst", "run.flight-0001-x.jsonl",
            "run.jsonl.zst.trace.json", "run.0003.jsonl"] {
            assert_eq!(segment_number("run", ".jsonl.zst", other), None, "{other}");
        }
    }

    #[test]
    fn a_gap_is_an_error_naming_the_missing_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("run.jsonl");
        for n in [0, 1, 3] {
            std::fs::write(segment_path(&base, n), "").expect("write");
        }
        let e = list(&base).expect_err("a gap");
        assert!(e.to_string().contains("run.0002.jsonl") && e.to_string().contains("run.0003.jsonl"), "{e}");
        std::fs::write(segment_path(&base, 2), "").expect("write");
        assert_eq!(list(&base).expect("whole").len(), 4);
    }
}
