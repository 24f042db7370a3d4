//! The host optimizer's step alone, per parameter storage: libtorch's fused AdamW over float32
//! tensors (the fp32 path), and Stagehand's mixed kernel with bf16 gradients in, float32
//! masters, moments in fp32, bf16 and int8, and the bf16 copy out (the bf16 path), on each
//! vector instruction set the CPU has (AVX2, AVX-512). Prints each
//! one's time, its bytes moved through host memory (every array read once and written once,
//! in place) and that rate, beside a plain copy's rate measured in the same run: the host's
//! memory bandwidth is what bounds this step.
//!
//! `HO_PARAMS` elements (default 256 Mi), in `HO_CHUNKS` tensors (default 16); threads: rayon's
//! global pool (`RAYON_NUM_THREADS`) for the mixed kernel, libtorch's for its own.
//!
//! Run: `cargo bench -p stagehand-runtime --bench host_optimizer`.

use stagehand::optim::kernel::{self, AdamHyper, Copy16, Grad, Isa};
use stagehand::optim::moments::StoredMoments;
use stagehand::StateStorage;
use stagehand::precision::QUANT_BLOCK;
use stagehand::torch::optim::{fused_adam, AdamStep, FusedAdam};
use std::time::Instant;
use tch::{Kind, Tensor};


fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Best of `rounds` after one warm-up.
fn best(rounds: usize, mut f: impl FnMut(u64)) -> f64 {
    f(1);
    (0..rounds)
        .map(|i| {
            let t0 = Instant::now();
            f(i as u64 + 2);
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    stagehand::torch::init();
    let n = env("HO_PARAMS", 256 << 20);
    let chunks = env("HO_CHUNKS", 16).max(1);
    let per = n / chunks;
    let rounds = 5;
    println!("host optimizer step over {n} parameters in {chunks} tensors, best of {rounds}");

    // The host's bandwidth: one copy of a float32 array, counting bytes read and written.
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let copy_s = best(rounds, |_| {
        use rayon::prelude::*;
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
    });
    let copy_gbps = 8.0 * n as f64 / copy_s / 1e9;
    println!("  copy (8 B an element)                          {:8.1} ms  {copy_gbps:6.1} GB/s", copy_s * 1e3);
    drop((src, dst));

    let report = |name: &str, s: f64, bytes: f64| {
        println!(
            "  {name:46} {:8.1} ms  {:6.1} GB/s  ({bytes} B an element, {:.2}x the copy's rate)",
            s * 1e3,
            bytes * n as f64 / s / 1e9,
            bytes * n as f64 / s / 1e9 / copy_gbps
        );
    };

    // fp32: libtorch's fused AdamW, as the handle runs an all-float32 block.
    {
        let mk = |v: f64| (0..chunks).map(|_| Tensor::full([per as i64], v, (Kind::Float, tch::Device::Cpu))).collect::<Vec<_>>();
        let (p, g, m, v) = (mk(0.1), mk(0.01), mk(0.0), mk(0.0));
        let st: Vec<Tensor> = (0..chunks).map(|_| Tensor::zeros([], (Kind::Float, tch::Device::Cpu))).collect();
        let h = AdamStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
        let s = best(rounds, |_| tch::no_grad(|| fused_adam(FusedAdam::AdamW, &p, &g, &m, &v, &st, h)).expect("fused AdamW"));
        // p, m, v read and written, g read.
        report("fp32: libtorch fused AdamW", s, 28.0);
    }

    // bf16: the mixed kernel, each moment storage, on each instruction set this CPU has (the
    // handle takes AVX2 for float32 moments and the widest for the others: `kernel::adam`).
    let g: Vec<Vec<u16>> = (0..chunks).map(|_| vec![kernel::f32_to_bf16(0.01); per]).collect();
    for storage in [StateStorage::Fp32, StateStorage::Bf16, StateStorage::Int8] {
        for isa in Isa::available().into_iter().filter(|&i| i != Isa::Portable) {
            let mut p: Vec<Vec<f32>> = (0..chunks).map(|_| vec![0.1; per]).collect();
            let mut copy: Vec<Vec<u16>> = (0..chunks).map(|_| vec![0; per]).collect();
            let mut moments: Vec<StoredMoments> = (0..chunks).map(|_| StoredMoments::zeros(storage, per)).collect();
            let s = best(rounds, |step| {
                let h = AdamHyper { lr: 1e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8, decoupled: true, step, grad_scale: 1.0 };
                for c in 0..chunks {
                    kernel::adam_on(isa, &mut p[c], Grad::Bf16(&g[c]), moments[c].moments(), Copy16::Bf16(&mut copy[c]), &h, None)
                        .expect("mixed kernel");
                }
            });
            // Master read and written (8), gradient read (2), copy written (2), moments read and
            // written in their storage.
            let moments = match storage {
                StateStorage::Fp32 => 16.0,
                StateStorage::Bf16 => 8.0,
                StateStorage::Int8 => 4.0 + 16.0 / QUANT_BLOCK as f64,
            };
            report(&format!("bf16: mixed kernel, {storage} moments, {isa:?}"), s, 12.0 + moments);
        }
    }
}
