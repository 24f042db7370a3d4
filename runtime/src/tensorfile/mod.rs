//! safetensors files as the checkpoints, the optimizer's state and the quantized weights' files
//! need them: written tensor by tensor (a tensor's bytes are
//! produced only when the writer reaches it, so a model larger than memory can be saved from
//! its host copies and files), read through a memory map (only the tensors asked for are
//! copied). Input files are untrusted: the safetensors crate checks the header (size, offsets,
//! lengths against dtype and shape) before anything is read.

pub(crate) mod atomic;

use crate::error::{Error, Result};
use atomic::write_atomic;
use safetensors::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// Where one tensor's bytes come from when the writer reaches it.
pub(crate) enum Bytes<'a> {
    /// A contiguous CPU tensor, written from its memory.
    Ready(Tensor),
    /// Made on demand (read from a file, copied from the device), then written and dropped.
    Later(Box<dyn Fn() -> Result<Tensor> + 'a>),
}

/// One tensor to write.
pub(crate) struct Entry<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    kind: Kind,
    bytes: Bytes<'a>,
    failed: &'a RefCell<Option<Error>>,
}

/// The bytes of a contiguous CPU tensor.
fn bytes_of(t: &Tensor) -> &[u8] {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: `t` is a contiguous CPU tensor (checked by every caller) of `len` bytes, alive for
    // the borrow.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, len) }
}

/// `t` as a contiguous CPU tensor (itself when it already is one).
pub(crate) fn cpu_contiguous(t: &Tensor) -> Result<Tensor> {
    let t = if t.device() == tch::Device::Cpu { t.detach() } else { t.f_to_device(tch::Device::Cpu)? };
    Ok(if t.is_contiguous() { t } else { t.f_contiguous()? })
}

impl<'a> Entry<'a> {
    /// An entry named `name` (for errors) of dtype `kind` and shape `shape`; `failed` collects the
    /// first error of a `Later` source (a writer cannot return one).
    pub(crate) fn new(name: &str, kind: Kind, shape: &[i64], bytes: Bytes<'a>, failed: &'a RefCell<Option<Error>>) -> Result<Entry<'a>> {
        let dtype = dtype_of(kind).ok_or_else(|| Error::Config {
            field: "checkpoint",
            value: format!("'{name}' of dtype {kind:?}"),
            expected: "a dtype safetensors stores (floats, integers, bool); save to .ot instead".into(),
        })?;
        let shape: Vec<usize> = shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect();
        let len = shape.iter().product::<usize>() * kind.elt_size_in_bytes();
        if let Bytes::Ready(t) = &bytes {
            if t.device() != tch::Device::Cpu || !t.is_contiguous() || t.numel() * t.kind().elt_size_in_bytes() != len {
                return Err(Error::internal(format!("'{name}': a ready tensor must be contiguous on the CPU")));
            }
        }
        Ok(Entry { dtype, shape, len, kind, bytes, failed })
    }
}

impl View for Entry<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match &self.bytes {
            Bytes::Ready(t) => Cow::Borrowed(bytes_of(t)),
            Bytes::Later(make) => {
                let made = make().and_then(|t| {
                    let t = cpu_contiguous(&t)?;
                    if t.kind() != self.kind || bytes_of(&t).len() != self.len {
                        return Err(Error::internal("a tensor changed dtype or size while being saved"));
                    }
                    Ok(bytes_of(&t).to_vec())
                });
                match made {
                    Ok(v) => Cow::Owned(v),
                    Err(e) => {
                        self.failed.borrow_mut().get_or_insert(e);
                        // The file is discarded: write the promised length so the writer goes on.
                        Cow::Owned(vec![0; self.len])
                    }
                }
            }
        }
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

/// Writes `entries` to `path` atomically, with `metadata` in the header; `failed` is the cell the
/// entries report a failing source in (the file is then discarded).
pub(crate) fn write(
    path: &Path,
    entries: Vec<(String, Entry<'_>)>,
    metadata: Option<HashMap<String, String>>,
    failed: &RefCell<Option<Error>>,
) -> Result<()> {
    write_atomic(path, |tmp| {
        safetensors::serialize_to_file(entries, metadata, tmp).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        match failed.borrow_mut().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })
}

/// A safetensors file mapped for reading.
pub(crate) struct Reader {
    path: String,
    mmap: memmap2::Mmap,
}

impl Reader {
    /// Maps `path` and checks its header.
    pub(crate) fn open(path: &Path) -> Result<Reader> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map; a checkpoint rewritten while it is being loaded is the usual
        // mmap hazard, which atomic saves (a new file renamed over the old) avoid.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let r = Reader { path: path.display().to_string(), mmap };
        r.parsed()?;
        Ok(r)
    }

    fn invalid(&self, message: String) -> Error {
        Error::Io {
            path: self.path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, message),
        }
    }

    fn parsed(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| self.invalid(format!("not a safetensors file: {e}")))
    }

    /// The header's metadata.
    pub(crate) fn metadata(&self) -> Result<HashMap<String, String>> {
        let (_, meta) = SafeTensors::read_metadata(&self.mmap).map_err(|e| self.invalid(format!("not a safetensors file: {e}")))?;
        Ok(meta.metadata().clone().unwrap_or_default())
    }

    /// Every tensor's name.
    pub(crate) fn names(&self) -> Result<Vec<String>> {
        Ok(self.parsed()?.names().into_iter().map(|s| s.to_string()).collect())
    }

    /// The dtype and shape of `name`, if the file has it.
    pub(crate) fn describe(&self, name: &str) -> Result<Option<(Kind, Vec<i64>)>> {
        let st = self.parsed()?;
        let Ok(v) = st.tensor(name) else { return Ok(None) };
        let kind = kind_of(v.dtype()).ok_or_else(|| self.invalid(format!("tensor '{name}' has dtype {:?}, which libtorch lacks", v.dtype())))?;
        let shape = v
            .shape()
            .iter()
            .map(|&d| i64::try_from(d).map_err(|_| self.invalid(format!("tensor '{name}' has a dimension of {d}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((kind, shape)))
    }

    /// `name` as a new CPU tensor.
    pub(crate) fn read(&self, name: &str) -> Result<Tensor> {
        let (kind, shape) = self.describe(name)?.ok_or_else(|| self.invalid(format!("no tensor '{name}'")))?;
        let st = self.parsed()?;
        let v = st.tensor(name).map_err(|e| self.invalid(format!("tensor '{name}': {e}")))?;
        Ok(Tensor::f_from_data_size(v.data(), &shape, kind)?)
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
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::F8_E5M2 => Kind::Float8e5m2,
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
        Kind::Float8e4m3fn => Dtype::F8_E4M3,
        Kind::Float8e5m2 => Dtype::F8_E5M2,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_lazily_read_back_exactly_and_hostile_files_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("x.safetensors");
        let failed = RefCell::new(None);
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[1i64, -2, 3]);
        let b2 = b.shallow_clone();
        let entries = vec![
            ("a".to_string(), Entry::new("a", Kind::Float, &[2, 3], Bytes::Ready(a.shallow_clone()), &failed).expect("a")),
            ("b".to_string(), Entry::new("b", Kind::Int64, &[3], Bytes::Later(Box::new(move || Ok(b2.shallow_clone()))), &failed).expect("b")),
        ];
        let meta: HashMap<String, String> = [("k".to_string(), "v".to_string())].into();
        write(&path, entries, Some(meta), &failed).expect("write");
        let r = Reader::open(&path).expect("open");
        assert!(r.read("a").expect("a").equal(&a));
        assert!(r.read("b").expect("b").equal(&b));
        assert_eq!(r.describe("a").expect("describe"), Some((Kind::Float, vec![2, 3])));
        assert_eq!(r.describe("zz").expect("describe"), None);
        assert_eq!(r.metadata().expect("meta")["k"], "v");
        // Interoperable with tch's own reader.
        let theirs = Tensor::read_safetensors(&path).expect("tch reads it");
        assert_eq!(theirs.len(), 2);

        // A source that fails discards the file: the old one stays.
        let failed2 = RefCell::new(None);
        let bad = vec![(
            "c".to_string(),
            Entry::new("c", Kind::Float, &[2], Bytes::Later(Box::new(|| Err(Error::internal("gone")))), &failed2).expect("c"),
        )];
        let e = write(&path, bad, None, &failed2).expect_err("fails");
        assert!(e.to_string().contains("gone"), "{e}");
        assert!(Reader::open(&path).expect("old file").read("a").is_ok());

        // Hostile bytes: a header length past the end, garbage, an empty file.
        for junk in [vec![0xffu8; 16], b"not a tensor file".to_vec(), Vec::new()] {
            let p = dir.path().join("junk.safetensors");
            std::fs::write(&p, &junk).expect("write junk");
            let e = Reader::open(&p).err().expect("refused");
            assert!(e.to_string().contains("not a safetensors file"), "{e}");
        }
    }
}
