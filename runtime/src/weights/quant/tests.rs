use super::*;
use crate::events::BlockId;

/// Weights as a trained model has them: mostly small, a few outliers per row.
fn weights(rows: i64, cols: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    let w = Tensor::randn([rows, cols], (Kind::Float, tch::Device::Cpu)) * 0.02;
    let spikes = Tensor::rand([rows, cols], (Kind::Float, tch::Device::Cpu)).gt(0.995).to_kind(Kind::Float);
    w + spikes * Tensor::randn([rows, cols], (Kind::Float, tch::Device::Cpu)) * 0.5
}

fn spec_of(params: &[(&str, Tensor)], kind: Option<Kind>) -> BlockSpec {
    let named: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect();
    BlockSpec::layout_as(BlockId(0), "b", &named, kind).expect("layout")
}

#[test]
fn quantize_then_dequantize_stays_within_the_stated_error() {
    // 300 columns: rows are not whole groups, so groups straddle rows and the last is partial.
    let w = weights(64, 300, 1);
    for format in QuantFormat::ALL {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let q = quantize(&w, format, QUANT_GROUP, kind, "w").expect("quantize");
            let bound = error_bound(format, kind);
            assert!(q.error.max_rel <= bound, "{format} into {kind:?}: max {} > {bound}", q.error.max_rel);
            assert!(q.error.max_rel > 0.0, "{format} into {kind:?}: an error is measured");
            // Checked again from scratch: every element against its group's largest magnitude.
            let back = Tensor::empty([w.numel() as i64], (kind, tch::Device::Cpu));
            dequantize_into(&back, &q.q, &q.scales, QUANT_GROUP, format).expect("dequantize");
            let x = w.reshape([-1]);
            let err = (&x - back.to_kind(Kind::Float)).abs();
            let n = x.numel() as i64;
            let groups = (n + QUANT_GROUP as i64 - 1) / QUANT_GROUP as i64;
            // The mean error the per-element bound implies: each group's bound times its size.
            let mut implied = 0.0;
            for g in 0..groups {
                let len = (QUANT_GROUP as i64).min(n - g * QUANT_GROUP as i64);
                let top = f64::try_from(x.narrow(0, g * QUANT_GROUP as i64, len).abs().max()).expect("max");
                let worst = f64::try_from(err.narrow(0, g * QUANT_GROUP as i64, len).max()).expect("max");
                assert!(worst <= bound * top + 1e-12, "{format} {kind:?} group {g}: error {worst} of magnitude {top}");
                implied += bound * top * len as f64;
            }
            let mean = q.error.mean_rel();
            let sum_abs = f64::try_from(x.abs().sum(Kind::Double)).expect("sum");
            assert!(mean > 0.0 && mean <= implied / sum_abs, "{format} {kind:?}: mean {mean}");
            let direct = f64::try_from(err.sum(Kind::Double)).expect("sum") / sum_abs;
            assert!((mean - direct).abs() <= 1e-9 * direct.max(1e-12), "the report's mean is the errors' sum over the magnitudes'");
        }
    }
    // INT8 keeps a group's largest element exactly (it maps to ±127) when the compute dtype is
    // float32.
    let q = quantize(&w, QuantFormat::Int8, QUANT_GROUP, Kind::Float, "w").expect("quantize");
    assert_eq!(i64::try_from(q.q.to_kind(Kind::Int64).abs().max()).expect("max"), 127);
}

#[test]
fn a_group_of_zeros_and_hostile_values() {
    let w = Tensor::zeros([2, 256], (Kind::Float, tch::Device::Cpu));
    let _ = w.get(1).fill_(0.5);
    let q = quantize(&w, QuantFormat::Int8, QUANT_GROUP, Kind::Float, "w").expect("zeros quantize");
    let back = Tensor::empty([512], (Kind::Float, tch::Device::Cpu));
    dequantize_into(&back, &q.q, &q.scales, QUANT_GROUP, QuantFormat::Int8).expect("dequantize");
    assert!(back.equal(&w.reshape([-1])), "zeros and a constant come back exactly");
    for bad in [f64::NAN, f64::INFINITY] {
        let _ = w.get(0).get(3).fill_(bad);
        let e = quantize(&w, QuantFormat::Fp8E4m3, QUANT_GROUP, Kind::Float, "blocks.0.w").err().expect("refused");
        assert!(e.to_string().contains("'blocks.0.w'") && e.to_string().contains("NaN or infinite"), "{e}");
    }
}

#[test]
fn only_matrices_worth_it_are_quantized() {
    let spec = spec_of(
        &[
            ("b.w", weights(32, 256, 2)),
            ("b.bias", Tensor::zeros([32], (Kind::Float, tch::Device::Cpu))),
            ("b.tiny", Tensor::zeros([2, 4], (Kind::Float, tch::Device::Cpu))),
            ("b.ids", Tensor::zeros([4, 64], (Kind::Int64, tch::Device::Cpu))),
        ],
        Some(Kind::BFloat16),
    );
    let l = QuantLayout::new(&spec, QuantFormat::Int8, QUANT_GROUP).expect("a layout");
    let q: Vec<bool> = l.params.iter().map(|p| p.groups.is_some()).collect();
    assert_eq!(q, [true, false, false, false]);
    assert_eq!(l.params[0].groups, Some(64));
    assert!(l.bytes < spec.bytes && l.offset + l.bytes == spec.bytes, "{l:?}");
    let vectors = spec_of(&[("b.bias", Tensor::zeros([4096], (Kind::Float, tch::Device::Cpu)))], None);
    assert!(QuantLayout::new(&vectors, QuantFormat::Int8, QUANT_GROUP).is_none(), "nothing worth quantizing");
}

/// Runs `ops` over the block's bytes as a GPU would (a step's reads and writes in any order),
/// checking that no step writes a byte that it or a later step still reads and that every
/// parameter byte is written exactly once.
fn simulate(spec: &BlockSpec, layout: &QuantLayout, ops: &[DequantOp]) {
    let mut live = vec![false; spec.bytes];
    let mark = |from: usize, len: usize, live: &mut Vec<bool>| live[from..from + len].iter_mut().for_each(|b| *b = true);
    for (p, q) in spec.params.iter().zip(&layout.params) {
        mark(layout.offset + q.data, q.data_bytes, &mut live);
        if let Some(g) = q.groups {
            mark(layout.offset + q.scales, 4 * g, &mut live);
        }
        let _ = p;
    }
    let mut written = vec![0u8; spec.bytes];
    let mut stashed = false;
    for op in ops {
        match *op {
            DequantOp::Stash { from } => {
                assert!(!stashed, "one stash");
                assert!(live[..from].iter().all(|b| !b), "the stash leaves no unread byte behind");
                live[from..].iter_mut().for_each(|b| *b = false);
                stashed = true;
            }
            DequantOp::Chunk { param, start, len, stashed: from_stash } => {
                assert_eq!(from_stash, stashed, "chunks read the stash exactly after it");
                let p = &spec.params[param];
                let q = &layout.params[param];
                let c = p.kind.elt_size_in_bytes();
                let (w0, w1) = (p.offset + start * c, p.offset + (start + len) * c);
                let reads: Vec<(usize, usize)> = match q.groups {
                    None => vec![(layout.offset + q.data + start * c, len * c)],
                    Some(_) => {
                        assert_eq!(start % layout.group, 0, "a chunk starts on a group");
                        let g0 = start / layout.group;
                        vec![(layout.offset + q.data + start, len), (layout.offset + q.scales + 4 * g0, 4 * len.div_ceil(layout.group))]
                    }
                };
                assert!(live[w0..w1].iter().all(|b| !b), "{op:?} writes payload bytes still to be read");
                for (at, n) in reads {
                    if !from_stash {
                        assert!(live[at..at + n].iter().all(|b| *b), "{op:?} reads a byte twice or one overwritten");
                        live[at..at + n].iter_mut().for_each(|b| *b = false);
                    }
                }
                written[w0..w1].iter_mut().for_each(|b| *b += 1);
            }
        }
    }
    assert!(live.iter().all(|b| !b), "every payload byte read");
    for p in &spec.params {
        assert!(written[p.offset..p.offset + p.bytes].iter().all(|&n| n == 1), "'{}' written once", p.name);
    }
}

#[test]
fn the_dequantization_never_overwrites_what_it_still_reads() {
    let f = |shape: &[i64], kind: Kind| Tensor::zeros(shape, (kind, tch::Device::Cpu));
    let blocks = [
        // A transformer block's shapes, small.
        vec![("qkv", f(&[384, 128], Kind::Float)), ("qkv_b", f(&[384], Kind::Float)), ("fc", f(&[512, 128], Kind::Float)), ("out", f(&[128, 512], Kind::Float))],
        // One matrix whose rows are not whole groups, and a full-width double.
        vec![("a", f(&[100, 77], Kind::Float)), ("d", f(&[333], Kind::Double))],
        vec![("big", f(&[1024, 1024], Kind::Float))],
    ];
    for params in &blocks {
        for kind in [Some(Kind::BFloat16), Some(Kind::Half), None] {
            for format in QuantFormat::ALL {
                let spec = spec_of(params, kind);
                let layout = QuantLayout::new(&spec, format, QUANT_GROUP).expect("layout");
                for min_chunk in [256, 4096, 1 << 16, MIN_CHUNK_BYTES] {
                    let (ops, stash) = plan_with(&spec, &layout, min_chunk);
                    simulate(&spec, &layout, &ops);
                    assert!(stash < layout.bytes + PARAM_ALIGNMENT, "{stash}");
                }
                simulate(&spec, &layout, &layout.ops);
            }
        }
    }
    // A large bf16 block dequantizes mostly in place: a few chunks, a stash of about a
    // MiB, never the payload's size.
    let spec = spec_of(&[("w", f(&[4096, 4096], Kind::Float)), ("w2", f(&[4096, 8192], Kind::Float))], Some(Kind::BFloat16));
    let layout = QuantLayout::new(&spec, QuantFormat::Int8, QUANT_GROUP).expect("layout");
    let chunks = layout.ops.iter().filter(|o| matches!(o, DequantOp::Chunk { stashed: false, .. })).count();
    assert!(chunks <= 16, "{chunks} chunks in place");
    assert!(layout.stash_bytes <= 4 * MIN_CHUNK_BYTES, "stash {} of a {}-byte payload", layout.stash_bytes, layout.bytes);
}

#[test]
fn a_block_dequantized_in_its_own_bytes_equals_its_host_values() {
    let params = [
        ("b.qkv", weights(96, 128, 3)),
        ("b.bias", Tensor::randn([96], (Kind::Float, tch::Device::Cpu))),
        ("b.fc", weights(256, 96, 4)),
    ];
    for kind in [Some(Kind::BFloat16), None] {
        for format in QuantFormat::ALL {
            let mut spec = spec_of(&params, kind);
            let layout = QuantLayout::new(&spec, format, QUANT_GROUP).expect("layout");
            spec.quant = Some(layout.clone());
            let host = crate::device::HostBuffer::pageable(layout.bytes).expect("payload");
            let views = payload_views(&spec, &layout, &host).expect("views");
            for (i, v) in views.iter().enumerate() {
                write_param(&spec, &layout, i, &params[i].1, v).expect("write");
            }
            // The block's device bytes, garbage but for the payload at their end.
            let buf = Tensor::full([spec.bytes as i64], 0x7f, (Kind::Uint8, tch::Device::Cpu));
            let payload = Tensor::from_slice(host.as_slice());
            buf.narrow(0, layout.offset as i64, layout.bytes as i64).copy_(&payload);
            dequantize_block(&buf, &spec).expect("dequantize");
            for (i, p) in spec.params.iter().enumerate() {
                let on_device = crate::weights::block::device_view(&buf, p).expect("view");
                let (data, scales) = &views[i];
                let want = param_value(p, &layout, data, scales.as_ref()).expect("host value");
                assert!(on_device.equal(&want), "{format} {kind:?}: '{}' differs from its host value", p.name);
            }
        }
    }
}
