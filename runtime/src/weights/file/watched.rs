//! A weights file as the run opened it: its size and modification time recorded then, checked
//! before and after every read, and bytes read with `pread`.
//!
//! `pread` rather than a memory map: a mapped file truncated under a copy out of the map raises
//! SIGBUS and kills the process, and a check before the copy cannot close that window (it lasts
//! as long as the copy, and a run that streams its weights spends much of its time copying).
//! `pread` reports the same truncation as a short read, an error. It costs some bandwidth: on
//! the 2-core development host, 6.8 GB/s against 7.1 to 7.3 GB/s for a copy out of a warm map,
//! into a page-aligned buffer like a pinned slab (`benches/integrity.rs`).

use crate::error::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::SystemTime;

/// An open weights file and what it was when opened.
pub(super) struct WatchedFile {
    path: String,
    file: File,
    len: u64,
    /// `None` where the filesystem keeps no modification time (then only the size is checked).
    modified: Option<SystemTime>,
}

impl WatchedFile {
    /// Opens `path` read-only and records its size and modification time.
    pub(super) fn open(path: &Path) -> Result<WatchedFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        Ok(WatchedFile {
            path: path.display().to_string(),
            file,
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }

    /// The file's path, as shown in messages.
    pub(super) fn path(&self) -> &str {
        &self.path
    }

    /// The file's size when it was opened.
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Fails when the file's size or modification time differ from those it was opened with.
    /// Read from the open file, not the path: a file renamed over the path is not the one the
    /// run reads, and leaves it as it was.
    pub(super) fn check(&self) -> Result<()> {
        let meta = self.file.metadata().map_err(|e| Error::io(&self.path, e))?;
        if meta.len() != self.len {
            let how = if meta.len() < self.len {
                "shortened"
            } else {
                "grown"
            };
            return Err(self.changed(format!(
                "it is {} bytes, {} when the run opened it ({how})",
                meta.len(),
                self.len
            )));
        }
        if meta.modified().ok() != self.modified {
            return Err(self.changed(
                "it was modified after the run opened it (same size, new modification time)".into(),
            ));
        }
        Ok(())
    }

    /// Fills `dst` from `offset`; a file that ends first (truncated while being read) is a
    /// change, not a short read.
    pub(super) fn read_at(&self, dst: &mut [u8], offset: u64, what: &str) -> Result<()> {
        self.file
            .read_exact_at(dst, offset)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => self.changed(format!(
                    "it ended before byte {} of {what} (truncated while being read)",
                    offset + dst.len() as u64
                )),
                _ => Error::io(&self.path, e),
            })
    }

    /// The error for a change to this file.
    pub(super) fn changed(&self, change: String) -> Error {
        Error::WeightsFileChanged {
            path: self.path.clone(),
            change,
        }
    }
}
