//! The host optimizer's own Adam/AdamW kernel for mixed precision: one pass over a parameter
//! that reads its 16-bit (or float32) gradient, updates the float32 master and the moments in
//! whatever storage they use, and writes the 16-bit copy the next load streams. libtorch's fused
//! kernel needs every tensor in one dtype, which would cost a conversion pass for the gradient,
//! a float32 state and another pass for the copy; memory traffic is what bounds this step.
//!
//! The work is split into chunks of [`CHUNK`] elements over a thread pool; inside a chunk,
//! every [`QUANT_BLOCK`] elements are converted to float32 scratch, updated there, and written
//! back, so the update itself is a plain float32 loop the compiler vectorizes: for AVX2, and
//! for compressed moments AVX-512 where the CPU has it, chosen at run time. Every path
//! computes the same bits (a test runs each one this CPU has against the portable one).
//!
//! The arithmetic follows libtorch's fused CPU Adam: weight decay (decoupled for AdamW, added
//! to the gradient for Adam), `m = m + (1 - beta1)(g - m)`, `v = beta2 v + (1 - beta2) g^2`,
//! `p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`, with the step's scalars
//! computed in float64 and the elements in float32.

use crate::precision::QUANT_BLOCK;
use rayon::prelude::*;

/// Elements one task updates (a multiple of [`QUANT_BLOCK`]).
pub const CHUNK: usize = 64 * QUANT_BLOCK;

/// One Adam step's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
    /// AdamW's decoupled weight decay (else Adam's L2 term added to the gradient).
    pub decoupled: bool,
    /// The step number after this step (1 for the first).
    pub step: u64,
    /// Gradients are multiplied by this first (1 / the loss scale; 1 without scaling).
    pub grad_scale: f32,
}

/// A gradient as it landed on the host.
#[derive(Debug, Clone, Copy)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    /// Bfloat16 bit patterns.
    Bf16(&'a [u16]),
    /// IEEE half bit patterns.
    F16(&'a [u16]),
}

impl Grad<'_> {
    fn len(&self) -> usize {
        match self {
            Grad::F32(s) => s.len(),
            Grad::Bf16(s) | Grad::F16(s) => s.len(),
        }
    }
}

/// The first and second moments in their storage.
#[derive(Debug)]
pub enum Moments<'a> {
    F32 { m: &'a mut [f32], v: &'a mut [f32] },
    Bf16 { m: &'a mut [u16], v: &'a mut [u16] },
    /// Codes (see [`encode_signed`], [`encode_unsigned`]) with a float32 scale per
    /// [`QUANT_BLOCK`] elements.
    Int8 {
        m: &'a mut [u8],
        v: &'a mut [u8],
        m_scale: &'a mut [f32],
        v_scale: &'a mut [f32],
    },
}

/// Where the 16-bit copy of the updated parameter goes, if anywhere.
#[derive(Debug)]
pub enum Copy16<'a> {
    None,
    Bf16(&'a mut [u16]),
    F16(&'a mut [u16]),
}

/// What a kernel call was given that does not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("adam kernel: {0}")]
pub struct KernelError(String);

// ---- conversions --------------------------------------------------------------------------

// The 16-bit conversions are the precision module's (the host's gradient sums use them too).
pub use crate::precision::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// The first moment's 8-bit code of `x` in [-1, 1] (its block's values over their largest
/// magnitude): a sign bit, 4 exponent bits `e` and 3 mantissa bits `k`, meaning
/// `(1 + k/8) 2^-e` for `e` < 15 and `k/8 * 2^-14` for `e` = 15. `r` (uniform random bits)
/// rounds stochastically: the code's expected value is `x`, so that a moment's small steps are
/// not rounded away every time (deterministic rounding freezes Adam's second moment once its
/// per-step change falls under half the code spacing, which biases every later update). Relative
/// error at most 1/8 down to 2^-14 of the block's largest magnitude.
#[inline(always)]
pub fn encode_signed(x: f32, r: u32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    (sign | encode_magnitude(x.abs(), 15, r)) as u8
}

/// The second moment's 8-bit code of `x` in [0, 1]: 5 exponent bits and 3 mantissa bits, the
/// same rule with `e` up to 31 (down to 2^-30 of the block's largest value).
#[inline(always)]
pub fn encode_unsigned(x: f32, r: u32) -> u8 {
    encode_magnitude(x, 31, r) as u8
}

/// `(e << 3) | k` for `x` in [0, 1] with exponents 0..`emax` (`emax`: the subnormal row),
/// rounded up with probability equal to the fraction dropped. Branch-free, so that the
/// compiler vectorizes the loops that call it.
#[inline(always)]
fn encode_magnitude(x: f32, emax: u32, r: u32) -> u32 {
    let bits = x.clamp(0.0, 1.0).to_bits();
    // Normal codes: the 20 dropped mantissa bits against 20 random ones. A carry out of the
    // mantissa lands in the exponent: the next power of two, as it should.
    // (Wrapping: a NaN, which no clamp removes, has bits past 1.0's. Its code is meaningless
    // but must not panic; the parameter it belongs to is NaN already.)
    let t = bits.wrapping_add(r >> 12) >> 20;
    let normal = (127u32.wrapping_sub(t >> 3) << 3) | (t & 7);
    // The subnormal row: multiples of 2^-(emax-1) / 8; rounding up past 7 is the smallest
    // normal code.
    // floor(scaled + u) without a float-to-integer conversion (which does not vectorize on x86
    // without AVX-512): adding 2^23 rounds `z` (below 9) to the nearest integer, which the
    // low bits of the sum then hold; one less where that rounded up. (For a normal `x`, whose
    // code is the other one, `z` is larger and `k` meaningless: hence the wrapping.)
    let z = f32::from_bits(bits) * f32::from_bits((127 + emax + 2) << 23) + ((r >> 8) as i32) as f32 * (1.0 / 16_777_216.0);
    let t = z + 8_388_608.0;
    let k = (t.to_bits() & 0x7f_ffff).wrapping_sub(u32::from(t - 8_388_608.0 > z));
    let sub = if k >= 8 { (emax - 1) << 3 } else { (emax << 3) | k };
    if bits >> 23 >= 127 - (emax - 1) {
        normal
    } else {
        sub
    }
}

/// The magnitude of `(e << 3) | k` (see [`encode_magnitude`]), branch-free.
#[inline(always)]
fn decode_magnitude(c: u32, emax: u32) -> f32 {
    let (e, k) = (c >> 3, c & 7);
    let normal = f32::from_bits(((127 - e) << 23) | (k << 20));
    let sub = (k as i32) as f32 * f32::from_bits((127 - (emax + 2)) << 23);
    if e < emax {
        normal
    } else {
        sub
    }
}

/// The value of a first-moment code times its block's scale.
#[inline(always)]
pub fn decode_signed(code: u8, scale: f32) -> f32 {
    let c = u32::from(code);
    let mag = decode_magnitude(c & 0x7f, 15);
    f32::from_bits(mag.to_bits() | ((c & 0x80) << 24)) * scale
}

/// The value of a second-moment code times its block's scale.
#[inline(always)]
pub fn decode_unsigned(code: u8, scale: f32) -> f32 {
    decode_magnitude(u32::from(code), 31) * scale
}

/// Bfloat16 of `x` rounded stochastically with the random bits `r` (state storage only; the
/// weights' copy rounds to nearest, as libtorch does).
#[inline(always)]
pub fn f32_to_bf16_stochastic(x: f32, r: u32) -> u16 {
    let bits = x.to_bits();
    // Adding under 2^16 to an infinity's bits leaves its top half: infinities stay. A NaN whose
    // payload sits in the low half could become one: it is kept quiet instead.
    let rounded = (bits.wrapping_add(r >> 16) >> 16) as u16;
    let nan = ((bits >> 16) | 0x40) as u16;
    if x.is_nan() {
        nan
    } else {
        rounded
    }
}

/// Uniform random bits for element `i` of a step (`salt` tells the two moments apart): a
/// stateless hash (Chris Wellons' lowbias32) of the element's position mixed with the step and
/// salt, so a step's rounding depends on nothing but its position and runs repeat; 32-bit
/// multiplies only, which vectorize.
#[inline(always)]
fn random_bits(i: u32, key: u32) -> u32 {
    let mut x = i ^ key;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// Random bits for both moments of element `i` from one hash (half the multiplies of two): the
/// second moment's are the first's with their halves swapped. Each is uniform; the first
/// moment's rounding reads their top 20 to 24 bits, the second's the swapped word's, so the two
/// share at most their 8 least significant threshold bits.
#[inline(always)]
fn moment_bits(i: u32, key: u32) -> (u32, u32) {
    let r = random_bits(i, key);
    (r, r.rotate_left(16))
}

/// The key of a step's random bits for one moment.
#[inline(always)]
fn step_key(step: u64, salt: u32) -> u32 {
    random_bits((step as u32).wrapping_mul(0x85EB_CA6B) ^ ((step >> 32) as u32), salt)
}

// ---- the kernel -----------------------------------------------------------------------------

/// The step's scalars, in float32 as the elements use them.
#[derive(Debug, Clone, Copy)]
struct Scalars {
    beta1_c: f32,
    beta2: f32,
    beta2_c: f32,
    /// lr * wd for AdamW (0 otherwise).
    decay: f32,
    /// wd for Adam (0 otherwise).
    l2: f32,
    step_size: f32,
    bias2_sqrt: f32,
    eps: f32,
    grad_scale: f32,
    step: u64,
}

impl Scalars {
    fn of(h: &AdamHyper) -> Scalars {
        let t = h.step.max(1) as i32;
        let bias1 = 1.0 - h.beta1.powi(t);
        let bias2 = 1.0 - h.beta2.powi(t);
        Scalars {
            beta1_c: (1.0 - h.beta1) as f32,
            beta2: h.beta2 as f32,
            beta2_c: (1.0 - h.beta2) as f32,
            decay: if h.decoupled { (h.lr * h.weight_decay) as f32 } else { 0.0 },
            l2: if h.decoupled { 0.0 } else { h.weight_decay as f32 },
            step_size: (h.lr / bias1) as f32,
            bias2_sqrt: bias2.sqrt() as f32,
            eps: h.eps as f32,
            grad_scale: h.grad_scale,
            step: h.step,
        }
    }
}

/// The element update over float32 scratch: the part the compiler vectorizes.
#[inline(always)]
fn update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: Scalars) {
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let mut gi = g[i] * s.grad_scale;
        let mut pi = p[i];
        pi -= s.decay * pi;
        gi += s.l2 * pi;
        let mi = m[i] + s.beta1_c * (gi - m[i]);
        let vi = s.beta2 * v[i] + s.beta2_c * gi * gi;
        let denom = vi.sqrt() / s.bias2_sqrt + s.eps;
        p[i] = pi - s.step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

/// The largest magnitude in `x` (0 for none; a NaN is passed over, as `f32::max` does). Eight
/// lanes of running maxima over whole groups of eight, folded at the end: a single running
/// maximum is a dependency chain, and `f32::max`'s NaN rule keeps the compiler from turning
/// even the lanes into SIMD maxima, while a plain comparison becomes one.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    #[inline(always)]
    fn larger(a: f32, b: f32) -> f32 {
        // NaN compares false: the running maximum stays.
        if b > a {
            b
        } else {
            a
        }
    }
    let mut lanes = [0f32; 8];
    let groups = x.chunks_exact(8);
    let tail = groups.remainder();
    for g in groups {
        for (l, &v) in lanes.iter_mut().zip(g) {
            *l = larger(*l, v.abs());
        }
    }
    let mut most = lanes.iter().fold(0f32, |a, &b| larger(a, b));
    for &v in tail {
        most = larger(most, v.abs());
    }
    most
}

/// Raw views of one call's buffers, shared by the chunk tasks, each of which touches a disjoint
/// range.
struct Views {
    n: usize,
    param: *mut f32,
    grad: (u8, *const u8),
    state: (u8, [*mut u8; 4]),
    out: (u8, *mut u16),
}

// SAFETY: every task reads and writes only the elements of its own chunk (and the scales of its
// own quantization blocks, chunks being multiples of a block), so no two threads touch the same
// memory; the caller's exclusive borrows outlive the parallel loop.
unsafe impl Send for Views {}
// SAFETY: as above.
unsafe impl Sync for Views {}

const G_F32: u8 = 0;
const G_BF16: u8 = 1;
const G_F16: u8 = 2;
const S_F32: u8 = 0;
const S_BF16: u8 = 1;
const S_INT8: u8 = 2;
const O_NONE: u8 = 0;
/// Salt of the moments' rounding bits.
const SALT: u32 = 0x6D6F_3121;
const O_BF16: u8 = 1;
const O_F16: u8 = 2;

/// The instructions a chunk's loops are compiled for. Each path computes the same bits (IEEE
/// operations element by element, no fused multiply-adds the source does not write), only at
/// another width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 (foundation, byte and word, vector lengths): 16 lanes, and the float-integer
    /// conversions and masks the 8-bit moments' codes use.
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    /// The widest this CPU has (every feature its functions enable).
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every path this CPU can run, widest first (the tests compare them, the host optimizer's
    /// bench times them).
    pub fn available() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Portable].into_iter().filter(|i| i.runs_here()).collect()
    }

    /// Whether this CPU can run this path: every narrower path than its best.
    pub fn runs_here(self) -> bool {
        let rank = |i: Isa| match i {
            Isa::Avx512 => 2,
            Isa::Avx2 => 1,
            Isa::Portable => 0,
        };
        rank(self) <= rank(Isa::best())
    }
}

/// One Adam(W) step over one parameter. `pool`: the threads to use (`None`: rayon's global pool).
pub fn adam(
    param: &mut [f32],
    grad: Grad<'_>,
    moments: Moments<'_>,
    out: Copy16<'_>,
    h: &AdamHyper,
    pool: Option<&rayon::ThreadPool>,
) -> Result<(), KernelError> {
    // Float32 moments are bound by memory: the 16-lane path bought them at most 7% on one
    // thread and nothing on two (development machine), and is not measured on the GPU hosts'
    // CPUs, where wide instructions may lower the clock the training thread shares. The
    // compressed moments' codes are bound by arithmetic and take it (1.3x there).
    let isa = match (&moments, Isa::best()) {
        (Moments::F32 { .. }, Isa::Avx512) => Isa::Avx2,
        (_, best) => best,
    };
    adam_on(isa, param, grad, moments, out, h, pool)
}

/// [`adam`] on the path `isa`, which must be one of [`Isa::available`] (a wider one is refused).
pub fn adam_on(
    isa: Isa,
    param: &mut [f32],
    grad: Grad<'_>,
    moments: Moments<'_>,
    out: Copy16<'_>,
    h: &AdamHyper,
    pool: Option<&rayon::ThreadPool>,
) -> Result<(), KernelError> {
    if !isa.runs_here() {
        return Err(KernelError(format!("this CPU cannot run the {isa:?} path; it has {:?}", Isa::available())));
    }
    let n = param.len();
    let bad = |what: &str, len: usize| Err(KernelError(format!("{what} has {len} elements, the parameter {n}")));
    if grad.len() != n {
        return bad("the gradient", grad.len());
    }
    let blocks = n.div_ceil(QUANT_BLOCK);
    let state = match moments {
        Moments::F32 { m, v } => {
            if m.len() != n || v.len() != n {
                return bad("the moments", m.len().min(v.len()));
            }
            (S_F32, [m.as_mut_ptr() as *mut u8, v.as_mut_ptr() as *mut u8, std::ptr::null_mut(), std::ptr::null_mut()])
        }
        Moments::Bf16 { m, v } => {
            if m.len() != n || v.len() != n {
                return bad("the moments", m.len().min(v.len()));
            }
            (S_BF16, [m.as_mut_ptr() as *mut u8, v.as_mut_ptr() as *mut u8, std::ptr::null_mut(), std::ptr::null_mut()])
        }
        Moments::Int8 { m, v, m_scale, v_scale } => {
            if m.len() != n || v.len() != n {
                return bad("the moments", m.len().min(v.len()));
            }
            if m_scale.len() != blocks || v_scale.len() != blocks {
                return Err(KernelError(format!(
                    "the scales have {} and {} entries, {blocks} expected for {n} elements",
                    m_scale.len(),
                    v_scale.len()
                )));
            }
            (
                S_INT8,
                [m.as_mut_ptr(), v.as_mut_ptr(), m_scale.as_mut_ptr() as *mut u8, v_scale.as_mut_ptr() as *mut u8],
            )
        }
    };
    let out = match out {
        Copy16::None => (O_NONE, std::ptr::null_mut()),
        Copy16::Bf16(o) | Copy16::F16(o) if o.len() != n => return bad("the 16-bit copy", o.len()),
        Copy16::Bf16(o) => (O_BF16, o.as_mut_ptr()),
        Copy16::F16(o) => (O_F16, o.as_mut_ptr()),
    };
    let grad = match grad {
        Grad::F32(g) => (G_F32, g.as_ptr() as *const u8),
        Grad::Bf16(g) => (G_BF16, g.as_ptr() as *const u8),
        Grad::F16(g) => (G_F16, g.as_ptr() as *const u8),
    };
    let views = Views { n, param: param.as_mut_ptr(), grad, state, out };
    let s = Scalars::of(h);
    let chunks = n.div_ceil(CHUNK);
    let run = || {
        (0..chunks).into_par_iter().for_each(|c| {
            let start = c * CHUNK;
            let end = (start + CHUNK).min(views.n);
            // SAFETY: `start..end` is this task's own range (see `Views`); `isa` is one this
            // CPU has (checked above against `Isa::available`).
            unsafe { chunk(isa, &views, start, end, s) }
        })
    };
    match pool {
        Some(p) => p.install(run),
        None => run(),
    }
    Ok(())
}

/// Updates elements `start..end` (block-aligned start), compiled for `isa`.
///
/// # Safety
/// `start..end` lies within the views and no other thread touches it; the CPU has `isa`.
unsafe fn chunk(isa: Isa, v: &Views, start: usize, end: usize, s: Scalars) {
    match isa {
        // SAFETY: the CPU has the features; the caller's guarantee passes on.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { chunk_avx512(v, start, end, s) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { chunk_avx2(v, start, end, s) },
        // SAFETY: the caller's guarantee passes on.
        _ => unsafe { chunk_body(v, start, end, s) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_avx2(v: &Views, start: usize, end: usize, s: Scalars) {
    // SAFETY: as `chunk`'s; inlined here, so compiled with the features above.
    unsafe { chunk_body(v, start, end, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn chunk_avx512(v: &Views, start: usize, end: usize, s: Scalars) {
    // SAFETY: as `chunk`'s; inlined here, so compiled with the features above.
    unsafe { chunk_body(v, start, end, s) }
}

#[inline(always)]
unsafe fn chunk_body(v: &Views, start: usize, end: usize, s: Scalars) {
    let mut g = [0f32; QUANT_BLOCK];
    let mut m = [0f32; QUANT_BLOCK];
    let mut q = [0f32; QUANT_BLOCK];
    let mut b = start;
    while b < end {
        let k = (end - b).min(QUANT_BLOCK);
        // SAFETY: `b..b + k` is inside this task's range; every pointer addresses `n` elements
        // of its type (checked by `adam`), scales one per block.
        unsafe {
            let p = std::slice::from_raw_parts_mut(v.param.add(b), k);
            match v.grad.0 {
                G_F32 => g[..k].copy_from_slice(std::slice::from_raw_parts((v.grad.1 as *const f32).add(b), k)),
                G_BF16 => {
                    let src = std::slice::from_raw_parts((v.grad.1 as *const u16).add(b), k);
                    for (d, &x) in g[..k].iter_mut().zip(src) {
                        *d = bf16_to_f32(x);
                    }
                }
                _ => {
                    let src = std::slice::from_raw_parts((v.grad.1 as *const u16).add(b), k);
                    for (d, &x) in g[..k].iter_mut().zip(src) {
                        *d = f16_to_f32(x);
                    }
                }
            }
            let block = b / QUANT_BLOCK;
            match v.state.0 {
                S_F32 => {
                    let mm = std::slice::from_raw_parts_mut((v.state.1[0] as *mut f32).add(b), k);
                    let vv = std::slice::from_raw_parts_mut((v.state.1[1] as *mut f32).add(b), k);
                    update(p, &g[..k], mm, vv, s);
                }
                S_BF16 => {
                    let mm = std::slice::from_raw_parts_mut((v.state.1[0] as *mut u16).add(b), k);
                    let vv = std::slice::from_raw_parts_mut((v.state.1[1] as *mut u16).add(b), k);
                    for i in 0..k {
                        m[i] = bf16_to_f32(mm[i]);
                        q[i] = bf16_to_f32(vv[i]);
                    }
                    update(p, &g[..k], &mut m[..k], &mut q[..k], s);
                    let key = step_key(s.step, SALT);
                    for i in 0..k {
                        let (rm, rv) = moment_bits((b + i) as u32, key);
                        mm[i] = f32_to_bf16_stochastic(m[i], rm);
                        vv[i] = f32_to_bf16_stochastic(q[i], rv);
                    }
                }
                _ => {
                    let mm = std::slice::from_raw_parts_mut(v.state.1[0].add(b), k);
                    let vv = std::slice::from_raw_parts_mut(v.state.1[1].add(b), k);
                    let ms = &mut *(v.state.1[2] as *mut f32).add(block);
                    let vs = &mut *(v.state.1[3] as *mut f32).add(block);
                    let (sm, sv) = (*ms, *vs);
                    for i in 0..k {
                        m[i] = decode_signed(mm[i], sm);
                        q[i] = decode_unsigned(vv[i], sv);
                    }
                    update(p, &g[..k], &mut m[..k], &mut q[..k], s);
                    let (am, av) = (abs_max(&m[..k]), abs_max(&q[..k]));
                    let (im, iv) = (if am > 0.0 { 1.0 / am } else { 0.0 }, if av > 0.0 { 1.0 / av } else { 0.0 });
                    let key = step_key(s.step, SALT);
                    for i in 0..k {
                        let (rm, rv) = moment_bits((b + i) as u32, key);
                        mm[i] = encode_signed(m[i] * im, rm);
                        vv[i] = encode_unsigned(q[i] * iv, rv);
                    }
                    *ms = am;
                    *vs = av;
                }
            }
            match v.out.0 {
                O_BF16 => {
                    let o = std::slice::from_raw_parts_mut(v.out.1.add(b), k);
                    for (d, &x) in o.iter_mut().zip(p.iter()) {
                        *d = f32_to_bf16(x);
                    }
                }
                O_F16 => {
                    let o = std::slice::from_raw_parts_mut(v.out.1.add(b), k);
                    for (d, &x) in o.iter_mut().zip(p.iter()) {
                        *d = f32_to_f16(x);
                    }
                }
                _ => {}
            }
        }
        b += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    fn hyper(step: u64, decoupled: bool) -> AdamHyper {
        AdamHyper { lr: 1e-2, beta1: 0.9, beta2: 0.999, weight_decay: 0.1, eps: 1e-8, decoupled, step, grad_scale: 1.0 }
    }

    #[test]
    fn bf16_conversions_round_to_nearest_even_as_libtorch() {
        let xs: Vec<f32> = (0..20000).map(|i| ((i as f32) * 0.37).sin() * 10f32.powi(i % 9 - 4)).chain([0.0, -0.0, 1e-40, f32::MAX, f32::INFINITY]).collect();
        let t = Tensor::from_slice(&xs).to_kind(Kind::BFloat16);
        let ours: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
        let theirs: Vec<f32> = Vec::try_from(t.to_kind(Kind::Float)).expect("values");
        for (i, (&o, &t)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(bf16_to_f32(o).to_bits(), t.to_bits(), "element {i}: {}", xs[i]);
        }
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn stochastic_bf16_keeps_infinities_and_nans() {
        let low_nan = f32::from_bits(0x7f80_0001);
        assert!(low_nan.is_nan());
        for r in [0, 0x8000_0000, u32::MAX] {
            assert_eq!(bf16_to_f32(f32_to_bf16_stochastic(f32::INFINITY, r)), f32::INFINITY);
            assert_eq!(bf16_to_f32(f32_to_bf16_stochastic(f32::NEG_INFINITY, r)), f32::NEG_INFINITY);
            assert!(bf16_to_f32(f32_to_bf16_stochastic(f32::NAN, r)).is_nan());
            assert!(bf16_to_f32(f32_to_bf16_stochastic(low_nan, r)).is_nan(), "a NaN whose payload is in the low half");
            assert!(bf16_to_f32(f32_to_bf16(low_nan)).is_nan());
        }
    }

    #[test]
    fn codes_round_trip_within_an_eighth() {
        for i in 0..100_000u32 {
            let x = (i as f32 / 100_000.0).powi(3);
            let r = random_bits(i, step_key(1, 0));
            let s = decode_signed(encode_signed(x, r), 1.0);
            let ns = decode_signed(encode_signed(-x, r), 1.0);
            assert_eq!(s, -ns);
            if x >= 2f32.powi(-14) {
                assert!((s - x).abs() <= x / 8.0 + 1e-12, "signed {x} -> {s}");
            } else {
                assert!((s - x).abs() <= 2f32.powi(-17) + 1e-12, "signed subnormal {x} -> {s}");
            }
            let u = decode_unsigned(encode_unsigned(x, r), 1.0);
            if x >= 2f32.powi(-30) {
                assert!((u - x).abs() <= x / 8.0 + 1e-12, "unsigned {x} -> {u}");
            }
        }
        for r in [0, u32::MAX] {
            assert_eq!(decode_signed(encode_signed(1.0, r), 1.0), 1.0);
            assert_eq!(decode_unsigned(encode_unsigned(1.0, r), 1.0), 1.0);
            assert_eq!(decode_unsigned(encode_unsigned(0.0, r), 1.0), 0.0);
            assert_eq!(decode_signed(encode_signed(0.0, r), 1.0), 0.0);
        }
    }

    #[test]
    fn every_code_decodes_to_its_defining_value() {
        for c in 0..=255u8 {
            let u = u32::from(c);
            let (e, k) = ((u >> 3) as i32, (u & 7) as f32);
            let want = if e < 31 { (1.0 + k / 8.0) * 2f32.powi(-e) } else { k / 8.0 * 2f32.powi(-30) };
            assert_eq!(decode_unsigned(c, 1.0), want, "unsigned code {c}");
            let (neg, e) = (u & 0x80 != 0, ((u >> 3) & 15) as i32);
            let mag = if e < 15 { (1.0 + k / 8.0) * 2f32.powi(-e) } else { k / 8.0 * 2f32.powi(-14) };
            assert_eq!(decode_signed(c, 1.0), if neg { -mag } else { mag }, "signed code {c}");
            // A value a code stands for (within a block's range, at most 1) encodes back to that
            // code when the random bits add nothing.
            if mag > 0.0 && mag <= 1.0 && !neg {
                assert_eq!(encode_signed(mag, 0), c, "signed {mag}");
            }
            if want > 0.0 && want <= 1.0 {
                assert_eq!(encode_unsigned(want, 0), c, "unsigned {want}");
            }
        }
    }

    #[test]
    fn stochastic_codes_are_unbiased() {
        // A value between two codes decodes, on average over the random bits, to itself.
        for x in [0.3f32, 0.0123, 3e-5, 1e-9] {
            let n = 20_000u64;
            let mean_s: f64 = (0..n).map(|i| f64::from(decode_signed(encode_signed(x, random_bits(i as u32, step_key(7, 1))), 1.0))).sum::<f64>() / n as f64;
            let mean_u: f64 = (0..n).map(|i| f64::from(decode_unsigned(encode_unsigned(x, random_bits(i as u32, step_key(7, 2))), 1.0))).sum::<f64>() / n as f64;
            assert!((mean_s / f64::from(x) - 1.0).abs() < 0.01 || x < 1e-8, "signed {x}: mean {mean_s}");
            assert!((mean_u / f64::from(x) - 1.0).abs() < 0.01, "unsigned {x}: mean {mean_u}");
            let mean_b: f64 = (0..n).map(|i| f64::from(bf16_to_f32(f32_to_bf16_stochastic(x, random_bits(i as u32, step_key(3, 4)))))).sum::<f64>() / n as f64;
            assert!((mean_b / f64::from(x) - 1.0).abs() < 1e-3, "bf16 {x}: mean {mean_b}");
        }
    }

    /// The reference: libtorch's AdamW (or Adam) over a float32 copy, five steps.
    fn reference(p0: &[f32], grads: &[Vec<f32>], decoupled: bool) -> Vec<f32> {
        use tch::nn::OptimizerConfig;
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var_copy("w", &Tensor::from_slice(p0));
        let mut opt = if decoupled {
            tch::nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.1, eps: 1e-8, amsgrad: false }.build(&vs, 1e-2)
        } else {
            tch::nn::Adam { beta1: 0.9, beta2: 0.999, wd: 0.1, eps: 1e-8, amsgrad: false }.build(&vs, 1e-2)
        }
        .expect("optimizer");
        for g in grads {
            crate::torch::optim::set_grad(&w, Some(&Tensor::from_slice(g))).expect("grad");
            opt.step();
        }
        Vec::try_from(w.detach()).expect("values")
    }

    fn data(n: usize, steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
        let p: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let g = (0..steps)
            .map(|s| (0..n).map(|i| (((i * 31 + s * 17) % 997) as f32 / 997.0 - 0.5) * 10f32.powi((i % 5) as i32 - 3)).collect())
            .collect();
        (p, g)
    }

    #[test]
    fn fp32_state_matches_libtorchs_adamw_and_adam() {
        let n = 3 * CHUNK + 77;
        let (p0, grads) = data(n, 5);
        for decoupled in [true, false] {
            let want = reference(&p0, &grads, decoupled);
            let mut p = p0.clone();
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            for (t, g) in grads.iter().enumerate() {
                let h = hyper(t as u64 + 1, decoupled);
                adam(&mut p, Grad::F32(g), Moments::F32 { m: &mut m, v: &mut v }, Copy16::None, &h, None).expect("step");
            }
            let worst = p.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
            assert!(worst < 1e-5, "decoupled {decoupled}: worst relative difference {worst}");
        }
    }

    #[test]
    fn bf16_gradients_write_the_bf16_copy_of_the_master() {
        let n = CHUNK + 300;
        let (p0, grads) = data(n, 3);
        let g16: Vec<Vec<u16>> = grads.iter().map(|g| g.iter().map(|&x| f32_to_bf16(x)).collect()).collect();
        let g_up: Vec<Vec<f32>> = g16.iter().map(|g| g.iter().map(|&x| bf16_to_f32(x)).collect()).collect();
        let want = reference(&p0, &g_up, true);
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut copy = vec![0u16; n];
        for (t, g) in g16.iter().enumerate() {
            adam(&mut p, Grad::Bf16(g), Moments::F32 { m: &mut m, v: &mut v }, Copy16::Bf16(&mut copy), &hyper(t as u64 + 1, true), None)
                .expect("step");
        }
        let worst = p.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
        assert!(worst < 1e-5, "worst {worst}");
        assert!(copy.iter().zip(&p).all(|(&c, &x)| c == f32_to_bf16(x)), "the copy is the master rounded");
    }

    #[test]
    fn scaled_fp16_gradients_are_unscaled() {
        let n = 1000;
        let (p0, grads) = data(n, 2);
        let scale = 1024.0f32;
        let g16: Vec<Vec<u16>> = grads.iter().map(|g| g.iter().map(|&x| f32_to_f16(x * scale)).collect()).collect();
        let g_up: Vec<Vec<f32>> = g16.iter().map(|g| g.iter().map(|&x| f16_to_f32(x) / scale).collect()).collect();
        let want = reference(&p0, &g_up, true);
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let mut copy = vec![0u16; n];
        for (t, g) in g16.iter().enumerate() {
            let h = AdamHyper { grad_scale: 1.0 / scale, ..hyper(t as u64 + 1, true) };
            adam(&mut p, Grad::F16(g), Moments::F32 { m: &mut m, v: &mut v }, Copy16::F16(&mut copy), &h, None).expect("step");
        }
        let worst = p.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
        assert!(worst < 1e-5, "worst {worst}");
    }

    #[test]
    fn compressed_state_optimizes_as_fp32_state_does() {
        // Adam on a noisy quadratic (each element pulled to its own target at its own scale,
        // as a model's parameters are): every storage must reach about the loss fp32 state
        // reaches.
        let n = 2 * CHUNK + 5;
        let target: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 10f32.powi((i % 4) as i32 - 3)).collect();
        let loss = |p: &[f32]| p.iter().zip(&target).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>() / n as f64;
        let start = vec![0f32; n];
        let blocks = n.div_ceil(QUANT_BLOCK);
        let mut runs: Vec<(&str, Vec<f32>)> = Vec::new();
        for storage in ["fp32", "bf16", "int8"] {
            let mut p = start.clone();
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            let (mut hm, mut hv) = (vec![0u16; n], vec![0u16; n]);
            let (mut qm, mut qv) = (vec![0u8; n], vec![0u8; n]);
            let (mut ms, mut vs) = (vec![0f32; blocks], vec![0f32; blocks]);
            for t in 0..300u64 {
                let g: Vec<f32> = p
                    .iter()
                    .zip(&target)
                    .enumerate()
                    .map(|(i, (a, b))| 2.0 * (a - b) + (random_bits(i as u32, step_key(t, 9)) as f32 / u32::MAX as f32 - 0.5) * 0.02)
                    .collect();
                let h = AdamHyper { lr: 1e-2, weight_decay: 0.0, ..hyper(t + 1, true) };
                let moments = match storage {
                    "fp32" => Moments::F32 { m: &mut m, v: &mut v },
                    "bf16" => Moments::Bf16 { m: &mut hm, v: &mut hv },
                    _ => Moments::Int8 { m: &mut qm, v: &mut qv, m_scale: &mut ms, v_scale: &mut vs },
                };
                adam(&mut p, Grad::F32(&g), moments, Copy16::None, &h, None).expect("step");
            }
            runs.push((storage, p));
        }
        let (first, exact) = (loss(&start), loss(&runs[0].1));
        assert!(exact < first / 100.0, "fp32 state converges: {first} -> {exact}");
        for (name, p) in &runs[1..] {
            let l = loss(p);
            // Measured: bf16 within 0.1%, int8 within 1.5% of fp32 state's final loss.
            assert!((l - exact).abs() <= 0.05 * exact, "{name} state: loss {l} against fp32 state's {exact} (start {first})");
        }
    }

    #[test]
    fn every_instruction_set_computes_the_same_bits() {
        // Hostile values among ordinary ones: infinities, NaNs, subnormals, zeros of both signs,
        // moments' scales of 0; every storage, every gradient and copy dtype, a ragged end.
        let n = 2 * CHUNK + 3 * QUANT_BLOCK + 7;
        let (p0, grads) = data(n, 3);
        let special = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40, -0.0, 0.0, f32::MAX, -1e-30];
        let spiked = |v: &[f32], every: usize| -> Vec<f32> {
            v.iter().enumerate().map(|(i, &x)| if i % every == 0 { special[(i / every) % special.len()] } else { x }).collect()
        };
        let p0 = spiked(&p0, 997);
        let paths = Isa::available();
        assert!(paths.contains(&Isa::Portable));
        type Run = (Vec<u32>, Vec<u8>, Vec<u16>);
        let run = |isa: Isa, storage: &str, grad16: bool| -> Run {
            let blocks = n.div_ceil(QUANT_BLOCK);
            let mut p = p0.clone();
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            let (mut hm, mut hv) = (vec![0u16; n], vec![0u16; n]);
            let (mut qm, mut qv) = (vec![0u8; n], vec![0u8; n]);
            let (mut ms, mut vs) = (vec![0f32; blocks], vec![0f32; blocks]);
            let mut copy = vec![0u16; n];
            for (t, g) in grads.iter().enumerate() {
                let g = spiked(g, 1009 + t);
                let g16: Vec<u16> = g.iter().map(|&x| f32_to_f16(x)).collect();
                let grad = if grad16 { Grad::F16(&g16) } else { Grad::F32(&g) };
                let moments = match storage {
                    "fp32" => Moments::F32 { m: &mut m, v: &mut v },
                    "bf16" => Moments::Bf16 { m: &mut hm, v: &mut hv },
                    _ => Moments::Int8 { m: &mut qm, v: &mut qv, m_scale: &mut ms, v_scale: &mut vs },
                };
                let out = if grad16 { Copy16::F16(&mut copy) } else { Copy16::Bf16(&mut copy) };
                adam_on(isa, &mut p, grad, moments, out, &hyper(t as u64 + 1, t % 2 == 0), None).expect("step");
            }
            let mut state: Vec<u8> = m.iter().chain(&v).chain(&ms).chain(&vs).flat_map(|x| x.to_bits().to_le_bytes()).collect();
            state.extend(hm.iter().chain(&hv).flat_map(|x| x.to_le_bytes()));
            state.extend(qm.iter().chain(&qv));
            (p.iter().map(|x| x.to_bits()).collect(), state, copy)
        };
        for storage in ["fp32", "bf16", "int8"] {
            for grad16 in [false, true] {
                let want = run(Isa::Portable, storage, grad16);
                for &isa in &paths {
                    assert!(run(isa, storage, grad16) == want, "{isa:?}, {storage} moments, 16-bit gradients {grad16}: other bits than the portable path's");
                }
            }
        }
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let mut p = vec![0f32; 10];
        let g = vec![0f32; 9];
        let (mut m, mut v) = (vec![0f32; 10], vec![0f32; 10]);
        let e = adam(&mut p, Grad::F32(&g), Moments::F32 { m: &mut m, v: &mut v }, Copy16::None, &hyper(1, true), None)
            .expect_err("short gradient");
        assert!(e.to_string().contains("the gradient has 9 elements"), "{e}");
        let (mut qm, mut qv) = (vec![0u8; 10], vec![0u8; 10]);
        let (mut ms, mut vs) = (vec![0f32; 2], vec![0f32; 1]);
        let g = vec![0f32; 10];
        let e = adam(
            &mut p,
            Grad::F32(&g),
            Moments::Int8 { m: &mut qm, v: &mut qv, m_scale: &mut ms, v_scale: &mut vs },
            Copy16::None,
            &hyper(1, true),
            None,
        )
        .expect_err("scales");
        assert!(e.to_string().contains("scales"), "{e}");
    }
}
