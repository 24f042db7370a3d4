//! Quantized safetensors files: what `WeightRuntime::save_quantized` writes and
//! `WeightRuntime::quantize_from_file` reads back without quantizing again.
//!
//! A quantized parameter `name` is two tensors: `name` (its elements in the format's dtype,
//! `I8` or `F8_E4M3`, in the parameter's shape) and `name@scales` (`F32`, one a group); a
//! parameter stored at full width is `name` in its dtype. The header's metadata names the format
//! (`stagehand.quant.format`), the group (`stagehand.quant.group`) and each quantized
//! parameter's error as measured when it was quantized (`stagehand.quant.errors`, a JSON object
//! of `name: [max_rel, sum_err, sum_abs]`), so a block read back reports what its quantization
//! cost. Files are untrusted: every tensor's dtype and shape, the group and the scales are
//! checked before anything is written.

use super::{write_param, ErrorSums, QuantFormat, QuantLayout};
use crate::tensorfile::{write, Bytes, Entry, Reader};
use crate::error::{Error, Result};
use crate::weights::registry::BlockSpec;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tch::{Kind, Tensor};

/// The key of a quantized parameter's scales.
pub const SCALES_SUFFIX: &str = "@scales";
const META_FORMAT: &str = "stagehand.quant.format";
const META_GROUP: &str = "stagehand.quant.group";
const META_ERRORS: &str = "stagehand.quant.errors";

/// One quantized block to save: its layout, payload views and errors.
pub(crate) struct Saved<'a> {
    pub spec: &'a BlockSpec,
    pub views: &'a [(Tensor, Option<Tensor>)],
    pub errors: &'a [ErrorSums],
}

/// Writes `blocks`' payloads to `path` (atomically), every block in one format and group.
pub(crate) fn save(path: &Path, blocks: &[Saved<'_>]) -> Result<()> {
    let mut format_group: Option<(QuantFormat, usize)> = None;
    let failed = RefCell::new(None);
    let mut entries = Vec::new();
    let mut errors: BTreeMap<String, [f64; 3]> = BTreeMap::new();
    for b in blocks {
        let layout = b.spec.quant.as_ref().ok_or_else(|| Error::internal(format!("saving block '{}', which is not quantized", b.spec.name)))?;
        match format_group {
            None => format_group = Some((layout.format, layout.group)),
            Some(fg) if fg != (layout.format, layout.group) => {
                return Err(Error::Config {
                    field: "save_quantized",
                    value: format!("blocks in {} groups of {} and {} groups of {}", fg.0, fg.1, layout.format, layout.group),
                    expected: "every quantized block in one format and group size (one file each)".into(),
                })
            }
            Some(_) => {}
        }
        for (i, (p, (data, scales))) in b.spec.params.iter().zip(b.views).enumerate() {
            let data = crate::tensorfile::cpu_contiguous(data)?;
            let shape = p.shape.clone();
            entries.push((p.name.clone(), Entry::new(&p.name, data.kind(), &shape, Bytes::Ready(data.f_view(shape.as_slice())?), &failed)?));
            if let Some(s) = scales {
                let s = crate::tensorfile::cpu_contiguous(s)?;
                let key = format!("{}{SCALES_SUFFIX}", p.name);
                entries.push((key.clone(), Entry::new(&key, Kind::Float, &s.size(), Bytes::Ready(s), &failed)?));
                let e = b.errors.get(i).copied().unwrap_or_default();
                errors.insert(p.name.clone(), [e.max_rel, e.sum_err, e.sum_abs]);
            }
        }
    }
    let Some((format, group)) = format_group else {
        return Err(Error::Config {
            field: "save_quantized",
            value: "a runtime with no quantized block".into(),
            expected: "at least one quantized block (WeightRuntime::quantize, or a model declared quantized)".into(),
        });
    };
    let metadata = HashMap::from([
        (META_FORMAT.to_owned(), format.name().to_owned()),
        (META_GROUP.to_owned(), group.to_string()),
        (META_ERRORS.to_owned(), serde_json::to_string(&errors).map_err(|e| Error::internal(e.to_string()))?),
    ]);
    write(path, entries, Some(metadata), &failed)
}

/// A safetensors file to fill quantized blocks from: already quantized by Stagehand, or a
/// full-width one (bf16, fp16, fp32) whose tensors are quantized as they are read.
pub(crate) struct Source {
    reader: Reader,
    path: String,
    /// The file's format and group and its tensors' errors, when it is a quantized file.
    quantized: Option<(QuantFormat, usize, HashMap<String, [f64; 3]>)>,
}

impl Source {
    pub(crate) fn open(path: &Path) -> Result<Source> {
        let reader = Reader::open(path)?;
        let meta = reader.metadata()?;
        let path_s = path.display().to_string();
        let invalid = |m: String| Error::Io { path: path_s.clone(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, m) };
        let quantized = match meta.get(META_FORMAT) {
            None => None,
            Some(f) => {
                let format: QuantFormat = f.parse().map_err(|e: String| invalid(format!("{META_FORMAT}: {e}")))?;
                let group = meta
                    .get(META_GROUP)
                    .and_then(|g| g.parse::<usize>().ok())
                    .filter(|&g| (1..=1 << 20).contains(&g))
                    .ok_or_else(|| invalid(format!("{META_GROUP} is {:?}: a group size from 1 to 1048576", meta.get(META_GROUP))))?;
                let errors: HashMap<String, [f64; 3]> = match meta.get(META_ERRORS) {
                    Some(j) => serde_json::from_str(j).map_err(|e| invalid(format!("{META_ERRORS}: {e}")))?,
                    None => return Err(invalid(format!("{META_ERRORS} is missing: each quantized tensor's error, as Stagehand's save_quantized writes it"))),
                };
                Some((format, group, errors))
            }
        };
        Ok(Source { reader, path: path_s, quantized })
    }

    /// The format and group of an already quantized file.
    pub(crate) fn format(&self) -> Option<(QuantFormat, usize)> {
        self.quantized.as_ref().map(|(f, g, _)| (*f, *g))
    }

    fn invalid(&self, m: String) -> Error {
        Error::Io { path: self.path.clone(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, m) }
    }

    /// Writes parameter `i` of `spec` (laid out as `layout`) into its payload views `views` from
    /// tensor `key`: copied as it is from a quantized file, quantized from a full-width one.
    /// Its error.
    pub(crate) fn fill(&self, spec: &BlockSpec, layout: &QuantLayout, i: usize, key: &str, views: &(Tensor, Option<Tensor>)) -> Result<ErrorSums> {
        let p = &spec.params[i];
        let (kind, shape) = self.reader.describe(key)?.ok_or_else(|| self.invalid(format!("tensor '{key}' is not in the file")))?;
        if shape != p.shape {
            return Err(self.invalid(format!("tensor '{key}' has shape {shape:?}, expected {:?}", p.shape)));
        }
        match (&self.quantized, &views.1) {
            (Some((format, group, errors)), Some(scales)) => {
                if kind != super::element_kind(*format) || *format != layout.format || *group != layout.group {
                    return Err(self.invalid(format!(
                        "tensor '{key}' is {kind:?} in groups of {group}, expected {:?} in groups of {} ({})",
                        super::element_kind(layout.format),
                        layout.group,
                        layout.format
                    )));
                }
                let skey = format!("{key}{SCALES_SUFFIX}");
                let want = vec![scales.numel() as i64];
                match self.reader.describe(&skey)? {
                    Some((Kind::Float, s)) if s == want => {}
                    other => return Err(self.invalid(format!("tensor '{skey}' is {other:?}, expected Float {want:?}"))),
                }
                let s = self.reader.read(&skey)?;
                let ok = f64::try_from(s.f_isfinite()?.f_logical_and(&s.f_ge(0.0)?)?.f_all()?)? != 0.0;
                if !ok {
                    return Err(self.invalid(format!("tensor '{skey}' holds a negative, NaN or infinite scale")));
                }
                let q = self.reader.read(key)?.f_reshape([-1])?;
                tch::no_grad(|| -> Result<()> {
                    views.0.shallow_clone().f_copy_(&q)?;
                    scales.shallow_clone().f_copy_(&s)?;
                    Ok(())
                })?;
                let [max_rel, sum_err, sum_abs] = errors
                    .get(key)
                    .copied()
                    .ok_or_else(|| self.invalid(format!("no recorded error for tensor '{key}'")))?;
                Ok(ErrorSums { max_rel, sum_err, sum_abs })
            }
            _ => {
                if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double) && views.1.is_some() {
                    return Err(self.invalid(format!("tensor '{key}' is {kind:?}: a floating tensor to quantize")));
                }
                write_param(spec, layout, i, &self.reader.read(key)?, views)
            }
        }
    }
}
