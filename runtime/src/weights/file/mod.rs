//! File-backed blocks: frozen weights stream from a safetensors file through a pinned slab to
//! the device. Eviction just drops the device copy; the file is the canonical copy, so no host
//! RAM holds the block between uses.
//!
//! The run reads the file at every load, so the file must not change while the run lasts.
//! A change stops the run with [`Error::WeightsFileChanged`] (naming the file and what
//! changed) instead of a crash or silently different weights:
//!
//! - the file's size and modification time, recorded when a block is backed by it, are checked
//!   before and after every read of a block's bytes (a few microseconds);
//! - bytes are read with `pread`, so a file truncated in the middle of a read is a short read,
//!   an error, not the SIGBUS a memory map raises (`watched.rs` says what that costs);
//! - a checksum of each tensor's bytes, taken at its first read, is compared at every later
//!   one, for rewrites that keep the size and the modification time (a rewrite within the
//!   filesystem's timestamp granularity, or one that restores the time). By default
//!   ([`FileCheck::Sampled`]) it is a CRC32C of 16 windows of 4 KiB spread over each larger
//!   tensor (smaller ones whole), a few microseconds, so a rewrite of a few bytes between the
//!   windows that keeps the modification time goes unseen. [`FileCheck::Full`]
//!   (`WeightConfig::file_check`) sums every byte instead and sees any rewrite, at the cost
//!   `benches/integrity.rs` measures: staging a 64 MiB block from the page cache took 1.94x the
//!   sampled check's time on the development host (4.42 GB/s against 8.56 GB/s).
//!
//! Touching the file (a new modification time, the same bytes) counts as a change. Replacing it
//! (a new file renamed over the path) does not: the run keeps reading the file it opened.

mod watched;

use super::registry::{BlockSpec, ParamSpec};
use crate::error::{Error, Result};
use crate::tensorfile::kind_of;
use safetensors::tensor::Metadata;
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;
use tch::Tensor;
use watched::WatchedFile;

/// How much of a tensor's bytes the checksum that guards a file-backed block covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileCheck {
    /// 16 windows of 4 KiB spread over each tensor (smaller tensors whole): a few
    /// microseconds a load; a rewrite between the windows that restores the file's
    /// modification time goes unseen.
    #[default]
    Sampled,
    /// Every byte of every tensor at every load: any rewrite is seen, at the cost of summing
    /// every byte read (`benches/integrity.rs` measures it).
    Full,
}

/// The largest header a safetensors file may have (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Bytes of each window the checksum of a tensor's bytes samples.
const SAMPLE_WINDOW_BYTES: usize = 4096;
/// Windows sampled per tensor; a tensor up to this many windows' bytes is summed whole.
const SAMPLE_WINDOWS: usize = 16;

/// One tensor of a block in the file.
#[derive(Debug)]
struct Span {
    /// Its key in the file.
    key: String,
    /// Its first byte in the file.
    start: u64,
    len: usize,
    /// The checksum of its sampled bytes at their first read.
    sum: OnceLock<u32>,
}

/// A block's tensors inside one safetensors file.
pub struct FileSource {
    file: WatchedFile,
    /// Each parameter's tensor, in block order.
    spans: Vec<Span>,
    check: FileCheck,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource").field("path", &self.file.path()).finish_non_exhaustive()
    }
}

impl FileSource {
    /// The file's path, as shown in messages.
    pub fn path(&self) -> &str {
        self.file.path()
    }

    /// Opens `path` and finds `key_prefix + name` for every parameter of `spec`, checking dtype
    /// and shape, its bytes checked by sampling. Errors name the file, the key and what differs.
    pub fn open(path: &std::path::Path, spec: &BlockSpec, key_prefix: &str) -> Result<FileSource> {
        FileSource::open_checked(path, spec, key_prefix, FileCheck::Sampled)
    }

    /// Opens `path` as [`FileSource::open`] does, its bytes checked as `check` says.
    pub fn open_checked(path: &std::path::Path, spec: &BlockSpec, key_prefix: &str, check: FileCheck) -> Result<FileSource> {
        let file = WatchedFile::open(path)?;
        let (data_start, header) = read_header(&file)?;
        let mut spans = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let key = format!("{key_prefix}{}", p.name);
            let info = header.info(&key).ok_or_else(|| invalid(&file, format!("tensor '{key}' is not in the file")))?;
            let kind = kind_of(info.dtype);
            let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
            if kind != Some(p.kind) || shape != p.shape {
                // A file in the model's own dtype, under mixed precision: the blocks stream the
                // file's bytes as they are, so the file must hold the 16-bit copy.
                let hint = if kind == Some(p.declared) && p.kind != p.declared && shape == p.shape {
                    format!(" (the run streams weights in {:?}: write the file in that dtype)", p.kind)
                } else {
                    String::new()
                };
                return Err(invalid(
                    &file,
                    format!(
                        "tensor '{key}' is {:?} {:?}, expected {:?} {:?}{hint}",
                        info.dtype, shape, p.kind, p.shape
                    ),
                ));
            }
            let (s, e) = info.data_offsets;
            spans.push(Span {
                key,
                start: data_start + s as u64,
                len: e - s,
                sum: OnceLock::new(),
            });
        }
        Ok(FileSource { file, spans, check })
    }

    /// How the bytes are checked.
    pub fn check(&self) -> FileCheck {
        self.check
    }

    /// Copies every parameter into `dst` at its offset in the block layout.
    pub fn stage(&self, spec: &BlockSpec, dst: &mut [u8]) -> Result<()> {
        self.file.check()?;
        for (p, span) in spec.params.iter().zip(&self.spans) {
            let d = dst.get_mut(p.offset..p.offset + span.len).ok_or_else(|| Error::TooLarge {
                what: format!("parameter '{}'", p.name),
                needed: (p.offset + span.len) as u64,
                limit: "the staging slab is smaller".into(),
            })?;
            self.read(span, d)?;
        }
        // A change while the bytes were read (a rewrite racing them) shows here.
        self.file.check()
    }

    /// Parameter `index` (described by `p`) as a new CPU tensor.
    pub fn read_param(&self, index: usize, p: &ParamSpec) -> Result<Tensor> {
        let span = self
            .spans
            .get(index)
            .ok_or_else(|| Error::UnknownBlock(format!("{}: parameter {index}", self.file.path())))?;
        let t = Tensor::f_empty(p.shape.as_slice(), (p.kind, tch::Device::Cpu))?;
        if span.len > 0 {
            // SAFETY: `t` is a fresh contiguous CPU tensor of exactly `span.len` bytes (dtype
            // and shape were checked against the file in `open`), and nothing else refers to it.
            let dst = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, span.len) };
            self.file.check()?;
            self.read(span, dst)?;
            self.file.check()?;
        }
        Ok(t)
    }

    /// Reads one tensor's bytes into `dst` and compares their checksum with the first read's.
    fn read(&self, span: &Span, dst: &mut [u8]) -> Result<()> {
        self.file.read_at(dst, span.start, &format!("tensor '{}'", span.key))?;
        let now = match self.check {
            FileCheck::Sampled => sampled_sum(dst),
            FileCheck::Full => crc32c::crc32c(dst),
        };
        let first = *span.sum.get_or_init(|| now);
        if now != first {
            return Err(self.file.changed(format!(
                "the bytes of tensor '{}' differ from their first read (checksum {first:08x}, now {now:08x}), though its size and modification time are as they were",
                span.key
            )));
        }
        Ok(())
    }
}

/// An error for a file that is not a usable safetensors file.
fn invalid(file: &WatchedFile, message: String) -> Error {
    Error::Io {
        path: file.path().to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, message),
    }
}

/// The header of a safetensors file (8 bytes of length, then JSON) and where its data begins,
/// read without mapping the file.
fn read_header(file: &WatchedFile) -> Result<(u64, Metadata)> {
    let not_safetensors = |why: String| invalid(file, format!("not a safetensors file: {why}"));
    if file.len() < 8 {
        return Err(not_safetensors(format!(
            "{} bytes, too short for a header",
            file.len()
        )));
    }
    let mut n = [0u8; 8];
    file.read_at(&mut n, 0, "the header's length")?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || 8 + n > file.len() {
        return Err(not_safetensors(format!(
            "a header of {n} bytes in a file of {} bytes",
            file.len()
        )));
    }
    let mut json = vec![0u8; n as usize];
    file.read_at(&mut json, 8, "the header")?;
    let header: Metadata =
        serde_json::from_slice(&json).map_err(|e| not_safetensors(e.to_string()))?;
    let end = 8 + n + header.data_len() as u64;
    if end != file.len() {
        return Err(not_safetensors(format!(
            "its header describes {end} bytes, the file holds {}",
            file.len()
        )));
    }
    Ok((8 + n, header))
}

/// CRC32C of a tensor's bytes: whole up to `SAMPLE_WINDOWS` windows, else of that many windows
/// spread evenly from its first byte to its last.
fn sampled_sum(bytes: &[u8]) -> u32 {
    if bytes.len() <= SAMPLE_WINDOW_BYTES * SAMPLE_WINDOWS {
        return crc32c::crc32c(bytes);
    }
    let last = bytes.len() - SAMPLE_WINDOW_BYTES;
    (0..SAMPLE_WINDOWS).fold(0, |sum, i| {
        let at = last * i / (SAMPLE_WINDOWS - 1);
        crc32c::crc32c_append(sum, &bytes[at..at + SAMPLE_WINDOW_BYTES])
    })
}

#[cfg(test)]
mod tests;
