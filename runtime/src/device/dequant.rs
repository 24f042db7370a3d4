//! Stagehand's own CUDA kernel for the one step of a quantized stream that libtorch runs slowly:
//! an INT8 payload times its float32 scale a group, rounded into the compute dtype. libtorch
//! computes `q * scale` into a bfloat16 output as a mixed-dtype elementwise loop that casts each
//! operand on its own (0.63 ms for a 201 M-element block on an H100, a third of its memory
//! bandwidth), and the stream pays it at every load, on the compute stream.
//!
//! The kernel is PTX text, generated below: building needs no CUDA compiler, and the driver
//! compiles it for whatever device loads it (`cuModuleLoadData`). Its arithmetic is libtorch's:
//! the element converted to float32 (exact), times the scale in float32 rounded to nearest, then
//! rounded to nearest even into bfloat16 (a NaN becomes libtorch's 0x7FC0) or IEEE half, or
//! stored as float32. A thread takes four elements with one 4-byte load and one 8- or 16-byte
//! store where the pointers allow, one element otherwise.
//!
//! Where the kernel cannot run (a device whose driver refuses the module, an unsupported dtype,
//! a group that is not a power of two), [`dequantize_int8`] says so and the caller uses
//! libtorch's kernels: the values are the same, only slower. A refused module is reported once
//! a device, as a warning on the bus ([`unreported_refusal`]).

use crate::error::{Error, Result};
use cudarc::driver::{result, sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};
use tch::{Kind, Tensor};

/// Output dtypes the kernel writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    Bf16,
    F16,
    F32,
}

impl Out {
    fn of(kind: Kind) -> Option<Out> {
        match kind {
            Kind::BFloat16 => Some(Out::Bf16),
            Kind::Half => Some(Out::F16),
            Kind::Float => Some(Out::F32),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Out::Bf16 => "bf16",
            Out::F16 => "f16",
            Out::F32 => "f32",
        }
    }

    fn bytes(self) -> usize {
        match self {
            Out::F32 => 4,
            _ => 2,
        }
    }
}

const OUTS: [Out; 3] = [Out::Bf16, Out::F16, Out::F32];

fn entry_name(out: Out, wide: bool) -> String {
    format!("stagehand_dequant_i8_{}{}", out.name(), if wide { "_x4" } else { "" })
}

/// PTX that rounds float32 register `f` into the 16-bit pattern of `out` in 32-bit register
/// `r` (its low half), with `%r20`-`%r21`, `%h1` and `%p2` as scratch.
fn convert(out: Out, f: &str, r: &str) -> String {
    match out {
        // Round to nearest even on the bits, as c10::BFloat16 does; a NaN is its quiet 0x7FC0.
        Out::Bf16 => format!(
            "\tmov.b32 %r20, {f};\n\tshr.u32 %r21, %r20, 16;\n\tand.b32 %r21, %r21, 1;\n\tadd.u32 %r21, %r21, 32767;\n\
             \tadd.u32 %r21, %r20, %r21;\n\tshr.u32 {r}, %r21, 16;\n\tsetp.nan.f32 %p2, {f}, {f};\n\tselp.b32 {r}, 32704, {r}, %p2;\n"
        ),
        Out::F16 => format!("\tcvt.rn.f16.f32 %h1, {f};\n\tcvt.u32.u16 {r}, %h1;\n"),
        Out::F32 => String::new(),
    }
}

/// One kernel: `q` (int8), `s` (float32, one a group of `1 << shift` elements), `o` (the
/// output). Scalar: elements `first..count`, one a thread. Wide: quads `0..count`, four
/// elements a thread, with `q` 4-byte and `o` 4-element aligned.
fn entry(out: Out, wide: bool) -> String {
    let name = entry_name(out, wide);
    let params = if wide {
        ".param .u64 q_ptr, .param .u64 s_ptr, .param .u64 o_ptr, .param .u64 count, .param .u32 shift"
    } else {
        ".param .u64 q_ptr, .param .u64 s_ptr, .param .u64 o_ptr, .param .u64 count, .param .u32 shift, .param .u64 first"
    };
    let mut s = format!(
        ".visible .entry {name}({params})\n{{\n\t.reg .pred %p<3>;\n\t.reg .b16 %h<2>;\n\t.reg .b32 %r<24>;\n\t.reg .b64 %rd<16>;\n\t.reg .f32 %f<8>;\n\
         \tld.param.u64 %rd1, [q_ptr];\n\tld.param.u64 %rd2, [s_ptr];\n\tld.param.u64 %rd3, [o_ptr];\n\tld.param.u64 %rd4, [count];\n\tld.param.u32 %r1, [shift];\n\
         \tcvta.to.global.u64 %rd1, %rd1;\n\tcvta.to.global.u64 %rd2, %rd2;\n\tcvta.to.global.u64 %rd3, %rd3;\n\
         \tmov.u32 %r2, %ctaid.x;\n\tmov.u32 %r3, %ntid.x;\n\tmov.u32 %r4, %tid.x;\n\tmov.u32 %r5, %nctaid.x;\n\
         \tmul.wide.u32 %rd5, %r2, %r3;\n\tcvt.u64.u32 %rd6, %r4;\n\tadd.u64 %rd5, %rd5, %rd6;\n\tmul.wide.u32 %rd7, %r5, %r3;\n"
    );
    if !wide {
        s += "\tld.param.u64 %rd6, [first];\n\tadd.u64 %rd5, %rd5, %rd6;\n";
    }
    s += "$L_loop:\n\tsetp.ge.u64 %p1, %rd5, %rd4;\n\t@%p1 bra $L_done;\n";
    if wide {
        // %rd8: the quad's first element; its scale is shared (a group holds whole quads).
        s += "\tshl.b64 %rd8, %rd5, 2;\n\tadd.u64 %rd9, %rd1, %rd8;\n\tld.global.b32 %r6, [%rd9];\n\
              \tshr.u64 %rd10, %rd8, %r1;\n\tshl.b64 %rd10, %rd10, 2;\n\tadd.u64 %rd10, %rd2, %rd10;\n\tld.global.f32 %f1, [%rd10];\n";
        for (lane, (r, f)) in ["%r7", "%r8", "%r9", "%r10"].iter().zip(["%f2", "%f3", "%f4", "%f5"]).enumerate() {
            s += &format!("\tbfe.s32 {r}, %r6, {}, 8;\n\tcvt.rn.f32.s32 {f}, {r};\n\tmul.rn.f32 {f}, {f}, %f1;\n", lane * 8);
        }
        match out {
            Out::F32 => {
                s += "\tshl.b64 %rd11, %rd8, 2;\n\tadd.u64 %rd11, %rd3, %rd11;\n\tst.global.v4.f32 [%rd11], {%f2, %f3, %f4, %f5};\n";
            }
            _ => {
                for (f, r) in ["%f2", "%f3", "%f4", "%f5"].iter().zip(["%r11", "%r12", "%r13", "%r14"]) {
                    s += &convert(out, f, r);
                }
                s += "\tshl.b32 %r15, %r12, 16;\n\tor.b32 %r15, %r15, %r11;\n\tshl.b32 %r16, %r14, 16;\n\tor.b32 %r16, %r16, %r13;\n\
                      \tshl.b64 %rd11, %rd8, 1;\n\tadd.u64 %rd11, %rd3, %rd11;\n\tst.global.v2.b32 [%rd11], {%r15, %r16};\n";
            }
        }
    } else {
        s += "\tadd.u64 %rd8, %rd1, %rd5;\n\tld.global.s8 %r6, [%rd8];\n\
              \tshr.u64 %rd9, %rd5, %r1;\n\tshl.b64 %rd9, %rd9, 2;\n\tadd.u64 %rd9, %rd2, %rd9;\n\tld.global.f32 %f1, [%rd9];\n\
              \tcvt.rn.f32.s32 %f2, %r6;\n\tmul.rn.f32 %f2, %f2, %f1;\n";
        match out {
            Out::F32 => s += "\tshl.b64 %rd10, %rd5, 2;\n\tadd.u64 %rd10, %rd3, %rd10;\n\tst.global.f32 [%rd10], %f2;\n",
            _ => {
                s += &convert(out, "%f2", "%r11");
                s += "\tcvt.u16.u32 %h1, %r11;\n\tshl.b64 %rd10, %rd5, 1;\n\tadd.u64 %rd10, %rd3, %rd10;\n\tst.global.b16 [%rd10], %h1;\n";
            }
        }
    }
    s += "\tadd.u64 %rd5, %rd5, %rd7;\n\tbra $L_loop;\n$L_done:\n\tret;\n}\n\n";
    s
}

/// The module's text: every output dtype, scalar and wide.
pub(crate) fn ptx() -> String {
    let mut s = String::from(".version 6.0\n.target sm_50\n.address_size 64\n\n");
    for out in OUTS {
        for wide in [false, true] {
            s += &entry(out, wide);
        }
    }
    s
}

/// The module loaded into one device's primary context.
struct Loaded {
    ctx: Arc<CudaContext>,
    /// `(out, wide)` -> function.
    functions: Vec<((Out, bool), sys::CUfunction)>,
}

// SAFETY: a CUfunction is a handle into a module that stays loaded for the process's life (it is
// never unloaded); the driver API may be called with it from any thread once the context is
// current there.
unsafe impl Send for Loaded {}
// SAFETY: as above; nothing in it is mutated after loading.
unsafe impl Sync for Loaded {}

impl Loaded {
    fn load(ordinal: usize) -> std::result::Result<Loaded, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("opening the device's context: {e}"))?;
        ctx.bind_to_thread().map_err(|e| format!("binding the context: {e}"))?;
        let text = CString::new(ptx()).map_err(|e| format!("the module's text: {e}"))?;
        // SAFETY: a NUL-terminated PTX image; the context is current on this thread.
        let module = unsafe { result::module::load_data(text.as_ptr() as *const c_void) }.map_err(|e| format!("loading the module: {e}"))?;
        let mut functions = Vec::new();
        for out in OUTS {
            for wide in [false, true] {
                let name = CString::new(entry_name(out, wide)).map_err(|e| e.to_string())?;
                // SAFETY: the module was just loaded and is never unloaded.
                let f = unsafe { result::module::get_function(module, name) }.map_err(|e| format!("finding {}: {e}", entry_name(out, wide)))?;
                functions.push(((out, wide), f));
            }
        }
        Ok(Loaded { ctx, functions })
    }

    fn function(&self, out: Out, wide: bool) -> Option<sys::CUfunction> {
        self.functions.iter().find(|(k, _)| *k == (out, wide)).map(|(_, f)| *f)
    }
}

/// A device's module, or why the driver would not load it.
type Loading = std::result::Result<Arc<Loaded>, String>;

/// A device's module as first loaded, and whether a refusal was reported.
struct Entry {
    loading: Loading,
    reported: bool,
}

/// Each device's module (loaded once a device, and not tried again after a refusal).
fn modules() -> std::sync::MutexGuard<'static, HashMap<usize, Entry>> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    MODULES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
}

fn loaded(ordinal: usize) -> Loading {
    modules()
        .entry(ordinal)
        .or_insert_with(|| Entry { loading: Loaded::load(ordinal).map(Arc::new), reported: false })
        .loading
        .clone()
}

/// Why the driver refused the kernel's module on device `ordinal`, the first time it is asked
/// after a refusal (then `None`): the caller reports the slower path once.
pub(crate) fn unreported_refusal(ordinal: usize) -> Option<String> {
    let mut modules = modules();
    let entry = modules.get_mut(&ordinal)?;
    match &entry.loading {
        Err(why) if !entry.reported => {
            entry.reported = true;
            Some(why.clone())
        }
        _ => None,
    }
}

/// A launch's arguments, in the entries' parameter order.
struct Args {
    q: u64,
    s: u64,
    o: u64,
    /// Quads (wide) or elements (scalar) to stop at.
    count: u64,
    shift: u32,
    /// The scalar entry's first element.
    first: u64,
}

impl Args {
    /// Pointers to the arguments the wide (`wide`) or the scalar entry takes, valid while
    /// `self` is neither moved nor dropped.
    fn params(&mut self, wide: bool) -> Vec<*mut c_void> {
        let mut p = vec![
            &mut self.q as *mut u64 as *mut c_void,
            &mut self.s as *mut u64 as *mut c_void,
            &mut self.o as *mut u64 as *mut c_void,
            &mut self.count as *mut u64 as *mut c_void,
            &mut self.shift as *mut u32 as *mut c_void,
        ];
        if !wide {
            p.push(&mut self.first as *mut u64 as *mut c_void);
        }
        p
    }
}

/// Threads a block.
const THREADS: u32 = 256;
/// Blocks a launch at most; the kernels stride over the rest.
const MAX_BLOCKS: u64 = 1 << 16;

/// Writes `q * scales` (int8 elements, one float32 scale a group of `group`) into `dst` (its
/// dtype bfloat16, half or float32), all three contiguous on the same CUDA device, as a kernel
/// queued on the compute stream. Returns `false` without doing anything where the kernel does
/// not apply (not CUDA, another dtype, a group that is not a power of two, a module the driver
/// refused): the caller then uses libtorch's kernels.
pub(crate) fn dequantize_int8(dst: &Tensor, q: &Tensor, scales: &Tensor, group: usize) -> Result<bool> {
    let tch::Device::Cuda(ordinal) = dst.device() else { return Ok(false) };
    let Some(out) = Out::of(dst.kind()) else { return Ok(false) };
    let n = q.numel();
    if n == 0 {
        return Ok(true);
    }
    let same_device = q.device() == dst.device() && scales.device() == dst.device();
    let shapes = dst.numel() == n && scales.numel() >= n.div_ceil(group.max(1)) && q.kind() == Kind::Int8 && scales.kind() == Kind::Float;
    let contiguous = dst.is_contiguous() && q.is_contiguous() && scales.is_contiguous();
    if !same_device || !shapes || !contiguous {
        return Err(Error::internal(format!(
            "dequantizing {n} int8 elements into {} {:?} ones with {} scales: tensors that do not fit together",
            dst.numel(),
            dst.kind(),
            scales.numel()
        )));
    }
    if !group.is_power_of_two() {
        return Ok(false);
    }
    let Ok(module) = loaded(ordinal) else { return Ok(false) };
    module.ctx.bind_to_thread().map_err(|source| Error::Cuda { what: "binding the context for dequantization", source })?;
    let mut args = Args { q: q.data_ptr() as u64, s: scales.data_ptr() as u64, o: dst.data_ptr() as u64, count: 0, shift: group.trailing_zeros(), first: 0 };
    let launch = |f: sys::CUfunction, threads: u64, params: &mut [*mut c_void]| -> Result<()> {
        let blocks = threads.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32;
        // SAFETY: `params` point at values of the entry's parameter types, alive for the call;
        // the pointers address `n` elements of each tensor on this device, which the caller
        // keeps alive until the compute stream has run the kernel (libtorch's caching
        // allocator frees in compute-stream order); stream null is the compute stream.
        unsafe { result::launch_kernel(f, (blocks, 1, 1), (THREADS, 1, 1), 0, std::ptr::null_mut(), params) }
            .map_err(|source| Error::Cuda { what: "launching the dequantization kernel", source })
    };
    let wide_ok = group >= 4 && args.q % 4 == 0 && args.o % (4 * out.bytes() as u64) == 0;
    let quads = if wide_ok { (n / 4) as u64 } else { 0 };
    if quads > 0 {
        let f = module.function(out, true).ok_or_else(|| Error::internal("the wide dequantization kernel is missing"))?;
        args.count = quads;
        launch(f, quads, &mut args.params(true))?;
    }
    let first = quads * 4;
    if first < n as u64 {
        let f = module.function(out, false).ok_or_else(|| Error::internal("the dequantization kernel is missing"))?;
        (args.count, args.first) = (n as u64, first);
        launch(f, n as u64 - first, &mut args.params(false))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_names_every_entry_once_and_balances_its_braces() {
        let text = ptx();
        for out in OUTS {
            for wide in [false, true] {
                let name = format!(".entry {}(", entry_name(out, wide));
                assert_eq!(text.matches(&name).count(), 1, "{name}");
            }
        }
        assert_eq!(text.matches('{').count(), text.matches('}').count());
    }

    /// Every output dtype, the wide and the scalar kernel (misaligned pointers, a partial last
    /// group, fewer than four elements), and hostile scales, against libtorch's own arithmetic
    /// on the CPU: the same values.
    #[test]
    fn on_cuda_it_writes_what_libtorch_computes() {
        if !tch::Cuda::is_available() {
            return eprintln!("skipping the CUDA check: no CUDA device");
        }
        let dev = tch::Device::Cuda(0);
        let group = 128usize;
        tch::manual_seed(7);
        for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
            // (elements, elements skipped before q, before the output)
            for (n, skip_q, skip_o) in [(128 * 777 + 77, 0i64, 0i64), (128 * 64, 1, 0), (1000, 0, 3), (3, 0, 0)] {
                let n = n as i64;
                let q_all = Tensor::randint_low(-127, 128, [n + skip_q], (Kind::Int8, tch::Device::Cpu));
                let groups = (n as usize).div_ceil(group) as i64;
                let s_cpu = Tensor::rand([groups], (Kind::Float, tch::Device::Cpu)) * 1e-2;
                let hostile = [f64::INFINITY, f64::NAN, 0.0, 1e-42, 3.0e38, -2.5];
                for (i, v) in hostile.iter().enumerate().take(groups as usize) {
                    let _ = s_cpu.narrow(0, i as i64, 1).fill_(*v);
                }
                let q_cpu = q_all.narrow(0, skip_q, n);
                let expected = (q_cpu.to_kind(Kind::Float) * s_cpu.repeat_interleave_self_int(group as i64, 0, None).narrow(0, 0, n)).to_kind(kind);
                let q = q_all.to_device(dev);
                let q = q.narrow(0, skip_q, n);
                let s = s_cpu.to_device(dev);
                let o_all = Tensor::zeros([n + skip_o], (kind, dev));
                let o = o_all.narrow(0, skip_o, n);
                assert!(dequantize_int8(&o, &q, &s, group).expect("launch"), "{kind:?}: the kernel ran");
                let got = o.to_device(tch::Device::Cpu).to_kind(Kind::Float);
                let want = expected.to_kind(Kind::Float);
                let same = got.eq_tensor(&want).logical_or(&got.isnan().logical_and(&want.isnan()));
                let wrong = i64::try_from(same.logical_not().sum(Kind::Int64)).expect("count");
                assert_eq!(wrong, 0, "{kind:?}, {n} elements, q at +{skip_q}, output at +{skip_o}: {wrong} differ");
                let untouched = o_all.narrow(0, 0, skip_o).to_device(tch::Device::Cpu);
                assert!(bool::try_from(untouched.eq(0).all()).expect("bool"), "nothing written before the output");
            }
        }
    }

    #[test]
    fn a_refused_module_is_reported_once() {
        // An ordinal no machine has, so no test loads a real module under it.
        let ordinal = 4096;
        assert_eq!(unreported_refusal(ordinal), None, "nothing was tried");
        modules().insert(ordinal, Entry { loading: Err("loading the module: refused".into()), reported: false });
        assert_eq!(unreported_refusal(ordinal).as_deref(), Some("loading the module: refused"));
        assert_eq!(unreported_refusal(ordinal), None, "reported already");
    }

    #[test]
    fn on_the_host_it_declines_and_the_caller_keeps_libtorchs_kernels() {
        let q = Tensor::from_slice(&[1i8, -2, 3]);
        let s = Tensor::from_slice(&[0.5f32]);
        let d = Tensor::zeros([3], (Kind::BFloat16, tch::Device::Cpu));
        assert!(!dequantize_int8(&d, &q, &s, 128).expect("no error on the host"));
    }
}
