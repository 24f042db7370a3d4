//! The Adam moments the mixed kernel updates, owned in their storage (float32, bfloat16 or
//! 8-bit block-wise codes).

use super::kernel::{self, Moments};
use crate::precision::{StateStorage, QUANT_BLOCK};

/// One parameter's Adam moments in their storage, owned, for the mixed kernel ([`kernel::adam`]
/// takes them as [`Moments`]).
#[derive(Debug)]
pub enum StoredMoments {
    F32 { m: Vec<f32>, v: Vec<f32> },
    Bf16 { m: Vec<u16>, v: Vec<u16> },
    Int8 { m: Vec<u8>, v: Vec<u8>, m_scale: Vec<f32>, v_scale: Vec<f32> },
}

/// `n` zeros, their pages touched now by every core: a fresh allocation's pages are mapped at
/// their first write, which for gigabytes of optimizer state would otherwise fall on the first
/// host steps, one thread each.
fn touched<T: Copy + Default + Send + Sync>(n: usize) -> Vec<T> {
    use rayon::prelude::*;
    let mut v = vec![T::default(); n];
    v.par_chunks_mut(1 << 16).for_each(|c| c.fill(T::default()));
    v
}

impl StoredMoments {
    /// `n` zeros in `storage`, their pages touched by every core.
    pub fn zeros(storage: StateStorage, n: usize) -> StoredMoments {
        match storage {
            StateStorage::Fp32 => StoredMoments::F32 { m: touched(n), v: touched(n) },
            StateStorage::Bf16 => StoredMoments::Bf16 { m: touched(n), v: touched(n) },
            StateStorage::Int8 => {
                let blocks = n.div_ceil(QUANT_BLOCK);
                // Scales of 0: every code decodes to 0 (the state starts at zero).
                StoredMoments::Int8 { m: touched(n), v: touched(n), m_scale: touched(blocks), v_scale: touched(blocks) }
            }
        }
    }

    /// The kernel's view of them.
    pub fn moments(&mut self) -> Moments<'_> {
        match self {
            StoredMoments::F32 { m, v } => Moments::F32 { m, v },
            StoredMoments::Bf16 { m, v } => Moments::Bf16 { m, v },
            StoredMoments::Int8 { m, v, m_scale, v_scale } => Moments::Int8 { m, v, m_scale, v_scale },
        }
    }

    /// Both moments as float32 (decoded).
    pub(crate) fn decoded(&self) -> (Vec<f32>, Vec<f32>) {
        match self {
            StoredMoments::F32 { m, v } => (m.clone(), v.clone()),
            StoredMoments::Bf16 { m, v } => (m.iter().map(|&x| kernel::bf16_to_f32(x)).collect(), v.iter().map(|&x| kernel::bf16_to_f32(x)).collect()),
            StoredMoments::Int8 { m, v, m_scale, v_scale } => (
                m.iter().enumerate().map(|(i, &c)| kernel::decode_signed(c, m_scale[i / QUANT_BLOCK])).collect(),
                v.iter().enumerate().map(|(i, &c)| kernel::decode_unsigned(c, v_scale[i / QUANT_BLOCK])).collect(),
            ),
        }
    }

    /// Replaces both moments with `m`, `v` (rounded to nearest in the storage).
    pub(crate) fn encode(&mut self, m_in: &[f32], v_in: &[f32]) {
        match self {
            StoredMoments::F32 { m, v } => {
                m.copy_from_slice(m_in);
                v.copy_from_slice(v_in);
            }
            StoredMoments::Bf16 { m, v } => {
                for (d, &x) in m.iter_mut().zip(m_in) {
                    *d = kernel::f32_to_bf16(x);
                }
                for (d, &x) in v.iter_mut().zip(v_in) {
                    *d = kernel::f32_to_bf16(x);
                }
            }
            StoredMoments::Int8 { m, v, m_scale, v_scale } => {
                // Half of the random range: rounding to nearest.
                const HALF: u32 = 1 << 31;
                for (b, (mc, vc)) in m.chunks_mut(QUANT_BLOCK).zip(v.chunks_mut(QUANT_BLOCK)).enumerate() {
                    let r = b * QUANT_BLOCK..(b * QUANT_BLOCK + mc.len());
                    let am = m_in[r.clone()].iter().fold(0f32, |a, x| a.max(x.abs()));
                    let av = v_in[r.clone()].iter().fold(0f32, |a, &x| a.max(x));
                    let (im, iv) = (if am > 0.0 { 1.0 / am } else { 0.0 }, if av > 0.0 { 1.0 / av } else { 0.0 });
                    for (j, i) in r.enumerate() {
                        mc[j] = kernel::encode_signed(m_in[i] * im, HALF);
                        vc[j] = kernel::encode_unsigned(v_in[i] * iv, HALF);
                    }
                    m_scale[b] = am;
                    v_scale[b] = av;
                }
            }
        }
    }
}
