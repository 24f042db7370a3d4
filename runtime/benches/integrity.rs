//! What the integrity checks cost on this host, in GB/s (the median of the repetitions):
//!
//! - the checksum of spilled activations: CRC32C (`crc32c`, SSE 4.2's instruction, the
//!   runtime's) against CRC32 (`crc32fast`, carry-less multiplies) over buffers the size of a
//!   large spill, which come from memory as a spill's do (it lands by DMA), and over 1 MiB in
//!   cache (the speed of the code rather than of memory);
//! - reading a file-backed block's bytes into a staging buffer, from the page cache: a copy out
//!   of a memory map (the old reader, which a truncated file kills with SIGBUS) against `pread`
//!   (the reader now, which reports a short read), and `pread` followed by a CRC32C of every
//!   byte (what a full checksum would cost, against the sampled one the runtime takes);
//! - the runtime's whole staging path ([`FileSource::stage`]: size and modification time
//!   checked before and after, bytes read, checksum verified), with the sampled checksum (the
//!   default) and with the full one (`FileCheck::Full`), and what the full check costs as a
//!   ratio of the two.
//!
//! Run: `cargo bench -p stagehand-runtime --bench integrity` (`INTEGRITY_MIB` sets the buffer
//! and block size, default 64; `INTEGRITY_REPS` the repetitions, default 15).

use stagehand::weights::file::{FileCheck, FileSource};
use stagehand::weights::BlockSpec;
use std::hint::black_box;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Instant;

/// Passes over the 1 MiB buffer per run: the first brings it into cache (the case before it
/// swept the cache), the others measure the code rather than memory.
const CACHED_PASSES: usize = 32;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A measured case: its name, the bytes one run covers, and the run (given the staging buffer).
type Case<'a> = (&'static str, usize, Box<dyn Fn(&mut [u8]) + 'a>);

/// Median GB/s of each case over `reps` rounds; every round runs each case once, so a change in
/// the machine's load (it is shared) touches every case alike. One round first warms them
/// (page faults, the page cache, the CPU's clock).
fn measure(cases: &[Case<'_>], dst: &mut [u8], reps: usize) -> Vec<f64> {
    let mut secs = vec![Vec::with_capacity(reps); cases.len()];
    for round in 0..=reps {
        for (i, (_, _, run)) in cases.iter().enumerate() {
            let t = Instant::now();
            run(dst);
            if round > 0 {
                secs[i].push(t.elapsed().as_secs_f64());
            }
        }
    }
    cases
        .iter()
        .zip(secs)
        .map(|((_, bytes, _), mut s)| {
            s.sort_by(f64::total_cmp);
            *bytes as f64 / s[s.len() / 2] / 1e9
        })
        .collect()
}

/// A buffer of pseudo-random bytes (a checksum's speed does not depend on them, but zero pages
/// could be shared and make copies look faster than they are).
fn noise(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let mib = env("INTEGRITY_MIB", 64);
    let reps = env("INTEGRITY_REPS", 15).max(1);
    let len = mib << 20;
    let data = noise(len);
    println!("integrity: {mib} MiB buffers, median of {reps}");

    // A file of four blocks, read back block by block as a run streams them, and the runtime's
    // own staging path over a safetensors file of one block of one u8 parameter.
    let blocks = 4;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("weights.bin");
    {
        let mut f = std::fs::File::create(&path)?;
        for _ in 0..blocks {
            f.write_all(&data)?;
        }
    }
    let file = std::fs::File::open(&path)?;
    // SAFETY: the file is this bench's own, in its own temporary folder; nothing changes it.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let st = dir.path().join("block.safetensors");
    let w = tch::Tensor::from_slice(&data);
    tch::Tensor::write_safetensors(&[("w", &w)], &st)?;
    let spec = BlockSpec::layout(
        stagehand::events::BlockId(0),
        "block",
        &[("w".to_string(), w)],
    )?;
    let source = FileSource::open(&st, &spec, "")?;
    let full = FileSource::open_checked(&st, &spec, "", FileCheck::Full)?;
    // Page-aligned, like a pinned slab (an unaligned destination slows the kernel's copy).
    let mut slab = memmap2::MmapMut::map_anon(len)?;
    slab.fill(1);

    let cached = &data[..(1 << 20).min(len)];
    let total = blocks * len;
    let (file, map, data) = (&file, &map, &data);
    let cases: Vec<Case<'_>> = vec![
        (
            "checksum  crc32 (crc32fast), all",
            len,
            Box::new(|_| {
                black_box(crc32fast::hash(black_box(data)));
            }),
        ),
        (
            "checksum  crc32c (crc32c), all",
            len,
            Box::new(|_| {
                black_box(crc32c::crc32c(black_box(data)));
            }),
        ),
        (
            "checksum  crc32 (crc32fast), 1 MiB",
            CACHED_PASSES * cached.len(),
            Box::new(|_| {
                for _ in 0..CACHED_PASSES {
                    black_box(crc32fast::hash(black_box(cached)));
                }
            }),
        ),
        (
            "checksum  crc32c (crc32c), 1 MiB",
            CACHED_PASSES * cached.len(),
            Box::new(|_| {
                for _ in 0..CACHED_PASSES {
                    black_box(crc32c::crc32c(black_box(cached)));
                }
            }),
        ),
        (
            "block read  mmap copy",
            total,
            Box::new(|dst: &mut [u8]| {
                for b in 0..blocks {
                    dst.copy_from_slice(&map[b * len..(b + 1) * len]);
                }
                black_box(dst);
            }),
        ),
        (
            "block read  pread",
            total,
            Box::new(|dst: &mut [u8]| {
                for b in 0..blocks {
                    file.read_exact_at(dst, (b * len) as u64).expect("read");
                }
                black_box(dst);
            }),
        ),
        (
            "block read  pread + crc32c of all",
            total,
            Box::new(|dst: &mut [u8]| {
                for b in 0..blocks {
                    file.read_exact_at(dst, (b * len) as u64).expect("read");
                    black_box(crc32c::crc32c(dst));
                }
            }),
        ),
        (
            "stage  FileSource::stage, sampled",
            len,
            Box::new(|dst: &mut [u8]| source.stage(&spec, dst).expect("stage")),
        ),
        (
            "stage  FileSource::stage, full check",
            len,
            Box::new(|dst: &mut [u8]| full.stage(&spec, dst).expect("stage")),
        ),
    ];
    let rates = measure(&cases, &mut slab, reps);
    for ((name, _, _), gb) in cases.iter().zip(&rates) {
        println!("{name:<40} {gb:6.2} GB/s");
    }
    let n = rates.len();
    println!(
        "full check / sampled staging time: {:.2}x (WeightConfig::file_check = Full)",
        rates[n - 2] / rates[n - 1]
    );
    Ok(())
}
