//! The file reader on its own: headers, checked reads, the sampled checksum.

use super::watched::WatchedFile;
use super::*;
use crate::events::BlockId;
use std::path::Path;
use tch::Kind;

/// A safetensors file of one f32 tensor `w` of `n` elements (0, 1, 2, ...) and its block.
fn one_tensor(path: &Path, n: i64) -> BlockSpec {
    let w = Tensor::arange(n, (Kind::Float, tch::Device::Cpu));
    Tensor::write_safetensors(&[("w", &w)], path).expect("write");
    BlockSpec::layout(BlockId(0), "b", &[("w".to_string(), w)]).expect("layout")
}

fn changed(e: &Error) -> &str {
    match e {
        Error::WeightsFileChanged { change, .. } => change,
        other => panic!("expected a changed weights file, got {other}"),
    }
}

#[test]
fn an_unchanged_file_stages_its_bytes_every_time() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.safetensors");
    let spec = one_tensor(&path, 50_000);
    let src = FileSource::open(&path, &spec, "").expect("open");
    let mut dst = vec![0u8; spec.bytes];
    for _ in 0..3 {
        src.stage(&spec, &mut dst).expect("stage");
    }
    let back = src.read_param(0, &spec.params[0]).expect("read");
    assert!(back.equal(&Tensor::arange(50_000, (Kind::Float, tch::Device::Cpu))));
    assert_eq!(&dst[4..8], &1f32.to_le_bytes());
}

#[test]
fn a_short_read_is_a_truncation_not_a_crash() {
    // What a truncation racing a read looks like once the size was checked: the read itself
    // comes up short, and says so.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.safetensors");
    one_tensor(&path, 1000);
    let f = WatchedFile::open(&path).expect("open");
    std::fs::File::options()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(100)
        .expect("truncate");
    let mut buf = vec![0u8; 400];
    let e = f.read_at(&mut buf, 50, "tensor 'w'").expect_err("short");
    assert!(
        changed(&e).contains("ended before byte 450 of tensor 'w'"),
        "{e}"
    );
    assert!(
        changed(&f.check().expect_err("shortened")).contains("shortened"),
        "{e}"
    );
}

#[test]
fn a_grown_or_touched_file_is_a_change() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.safetensors");
    one_tensor(&path, 1000);
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let file = std::fs::File::options()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_modified(old).expect("date");
    let f = WatchedFile::open(&path).expect("open");
    f.check().expect("as opened");
    file.set_modified(std::time::SystemTime::now())
        .expect("touch");
    assert!(changed(&f.check().expect_err("touched")).contains("modified after the run opened it"));
    let f = WatchedFile::open(&path).expect("open");
    file.set_len(f.len() + 1).expect("grow");
    assert!(changed(&f.check().expect_err("grown")).contains("(grown)"));
}

#[test]
fn headers_that_do_not_describe_the_file_are_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.safetensors");
    let spec = one_tensor(&path, 1000);
    let good = std::fs::read(&path).expect("read");
    let refused = |bytes: &[u8], says: &str| {
        std::fs::write(&path, bytes).expect("write");
        let e = FileSource::open(&path, &spec, "").expect_err("refused");
        assert!(
            matches!(e, Error::Io { .. }) && e.to_string().contains(says),
            "{e}"
        );
    };
    refused(b"junk", "4 bytes, too short for a header");
    refused(
        &u64::MAX.to_le_bytes(),
        "not a safetensors file: a header of",
    );
    let mut no_json = good.clone();
    no_json[8] = b'[';
    refused(&no_json, "not a safetensors file");
    refused(&good[..good.len() - 4], "its header describes");
    std::fs::write(&path, &good).expect("write");
    let e = FileSource::open(&path, &spec, "model.").expect_err("no such key");
    assert!(
        e.to_string()
            .contains("tensor 'model.w' is not in the file"),
        "{e}"
    );
}

#[test]
fn the_sampled_checksum_covers_small_tensors_whole_and_spans_large_ones() {
    let small = vec![7u8; SAMPLE_WINDOW_BYTES * SAMPLE_WINDOWS];
    let mut other = small.clone();
    other[12_345] ^= 1;
    assert_ne!(
        sampled_sum(&small),
        sampled_sum(&other),
        "every byte of a small tensor counts"
    );
    let large = vec![7u8; 10 << 20];
    let last = large.len() - SAMPLE_WINDOW_BYTES;
    let flipped = |at: usize| {
        let mut other = large.clone();
        other[at] ^= 1;
        sampled_sum(&other) != sampled_sum(&large)
    };
    for at in [0, last / 3, large.len() - 1] {
        assert!(flipped(at), "byte {at} is sampled");
    }
    // The limit of sampling: a byte between two windows.
    assert!(
        !flipped(last / (2 * (SAMPLE_WINDOWS - 1))),
        "bytes between the windows are not"
    );
}

#[test]
fn a_rewrite_between_the_windows_that_restores_the_time_is_seen_only_by_the_full_check() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.safetensors");
    // 16 MiB: far larger than the sampled windows.
    let spec = one_tensor(&path, 4 << 20);
    let when = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    std::fs::File::options().write(true).open(&path).and_then(|f| f.set_modified(when)).expect("date");
    let open = |check| FileSource::open_checked(&path, &spec, "", check).expect("open");
    let (sampled, full) = (open(FileCheck::Sampled), open(FileCheck::Full));
    assert_eq!((sampled.check(), full.check()), (FileCheck::Sampled, FileCheck::Full));
    let mut dst = vec![0u8; spec.bytes];
    sampled.stage(&spec, &mut dst).expect("first read");
    full.stage(&spec, &mut dst).expect("first read");
    // 4 KiB rewritten halfway between two sampled windows, the modification time put back.
    let len = std::fs::metadata(&path).expect("meta").len();
    let data_start = len - spec.bytes as u64;
    let last = spec.bytes - SAMPLE_WINDOW_BYTES;
    let between = (last / (SAMPLE_WINDOWS - 1)) / 2;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::options().write(true).open(&path).expect("open");
        f.write_all_at(&[0x7f; 4096], data_start + between as u64).expect("rewrite");
        f.set_modified(when).expect("time put back");
    }
    sampled.stage(&spec, &mut dst).expect("sampling does not see it: its documented limit");
    let e = full.stage(&spec, &mut dst).expect_err("the full check sees it");
    assert!(changed(&e).contains("differ from their first read"), "{e}");
}
