//! File-backed blocks: frozen weights stream from a safetensors file (memory-mapped) through a
//! pinned slab to the device. Eviction just drops the device copy; the file is the canonical
//! copy, so no host RAM holds the block between uses.

use super::registry::{BlockSpec, ParamSpec};
use crate::error::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

/// A block's tensors inside one safetensors file.
pub struct FileSource {
    path: String,
    mmap: memmap2::Mmap,
    /// (byte start in the file, bytes) of each parameter, in block order.
    spans: Vec<(usize, usize)>,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource").field("path", &self.path).finish_non_exhaustive()
    }
}

/// The libtorch dtype of a safetensors dtype (`None` for those libtorch lacks).
pub(crate) fn kind_of(d: Dtype) -> Option<Kind> {
    Some(match d {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

/// The safetensors dtype of a libtorch dtype (`None` for those safetensors lacks).
pub(crate) fn dtype_of(k: Kind) -> Option<Dtype> {
    Some(match k {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

impl FileSource {
    /// The file's path, as shown in messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Maps `path` and finds `key_prefix + name` for every parameter of `spec`, checking dtype
    /// and shape. Errors name the file, the key and what differs.
    pub fn open(path: &std::path::Path, spec: &BlockSpec, key_prefix: &str) -> Result<FileSource> {
        let shown = path.display().to_string();
        let io = |message: String| Error::Io {
            path: shown.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, message),
        };
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only; the runtime assumes nobody truncates or
        // rewrites a weight file while it is being streamed (the usual mmap contract).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&mmap).map_err(|e| io(format!("not a safetensors file: {e}")))?;
        let base = mmap.as_ptr() as usize;
        let mut spans = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let key = format!("{key_prefix}{}", p.name);
            let v = st.tensor(&key).map_err(|e| io(format!("tensor '{key}': {e}")))?;
            let kind = kind_of(v.dtype());
            let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
            if kind != Some(p.kind) || shape != p.shape {
                return Err(io(format!(
                    "tensor '{key}' is {:?} {:?}, expected {:?} {:?}",
                    v.dtype(),
                    shape,
                    p.kind,
                    p.shape
                )));
            }
            spans.push((v.data().as_ptr() as usize - base, v.data().len()));
        }
        Ok(FileSource {
            path: shown,
            mmap,
            spans,
        })
    }

    /// Copies every parameter into `buf` at its offset in the block layout.
    pub fn stage(&self, spec: &BlockSpec, dst: &mut [u8]) -> Result<()> {
        for (p, &(start, len)) in spec.params.iter().zip(&self.spans) {
            let range = p.offset..p.offset + len;
            let d = dst.get_mut(range).ok_or_else(|| Error::TooLarge {
                what: format!("parameter '{}'", p.name),
                needed: (p.offset + len) as u64,
                limit: "the staging slab is smaller".into(),
            })?;
            d.copy_from_slice(&self.mmap[start..start + len]);
        }
        Ok(())
    }

    /// Parameter `index` (described by `p`) as a new CPU tensor.
    pub fn read_param(&self, index: usize, p: &ParamSpec) -> Result<Tensor> {
        let &(start, len) = self
            .spans
            .get(index)
            .ok_or_else(|| Error::UnknownBlock(format!("{}: parameter {index}", self.path)))?;
        let t = Tensor::f_empty(p.shape.as_slice(), (p.kind, tch::Device::Cpu))?;
        if len > 0 {
            // SAFETY: `t` is a fresh contiguous CPU tensor of exactly `len` bytes (dtype and
            // shape were checked against the file in `open`).
            unsafe {
                std::ptr::copy_nonoverlapping(self.mmap[start..start + len].as_ptr(), t.data_ptr() as *mut u8, len)
            };
        }
        Ok(t)
    }
}
