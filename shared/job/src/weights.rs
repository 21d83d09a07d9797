//! Weights files in the safetensors format, named as the PyTorch `state_dict`,
//! so `model.load_state_dict(safetensors.torch.load_file(path))` loads them.
//!
//! Values are held as f32. A tensor may be written as I64 instead: PyTorch
//! keeps BatchNorm's `num_batches_tracked` as int64, and although
//! `load_state_dict` copies an F32 value into it just as well, writing I64
//! makes the file match `model.state_dict()` exactly.
//! (I64 values pass through f32 here, so they are exact up to 2^24.)

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use rookery_model::DType;
use rookery_proto::{Bytes, WireDType, WireTensor};
use safetensors::SafeTensors;

use crate::error::JobError;

/// One `state_dict` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Row-major, `prod(shape)` values (for I64, integral values).
    pub values: Vec<f32>,
}

impl WeightTensor {
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, values: Vec<f32>) -> Self {
        WeightTensor {
            name: name.into(),
            shape,
            dtype: DType::F32,
            values,
        }
    }

    pub fn i64(name: impl Into<String>, shape: Vec<usize>, values: Vec<f32>) -> Self {
        WeightTensor {
            dtype: DType::I64,
            ..WeightTensor::f32(name, shape, values)
        }
    }
}

impl From<(String, Vec<usize>, Vec<f32>)> for WeightTensor {
    fn from((name, shape, values): (String, Vec<usize>, Vec<f32>)) -> Self {
        WeightTensor::f32(name, shape, values)
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The safetensors encoding of `tensors`, laid out in the order given, with
/// `__metadata__ = {"format": "pt"}` as `safetensors.torch.save_file` writes.
/// Errors (`InvalidInput`) on a duplicate or reserved name, or values that do
/// not fill the shape.
pub fn to_safetensors_bytes(tensors: &[WeightTensor]) -> io::Result<Vec<u8>> {
    let mut entries = Vec::with_capacity(tensors.len());
    for t in tensors {
        let numel: usize = t.shape.iter().product();
        if numel != t.values.len() {
            return Err(invalid(format!(
                "weight `{}`: shape {:?} needs {numel} values, got {}",
                t.name,
                t.shape,
                t.values.len()
            )));
        }
        let (dtype, size) = match t.dtype {
            DType::F32 => ("F32", 4),
            DType::I64 => ("I64", 8),
        };
        entries.push((
            t.name.as_str(),
            dtype,
            serde_json::json!(t.shape),
            numel * size,
        ));
    }
    let (json, offset) = safetensors_header(entries)?;
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    for t in tensors {
        match t.dtype {
            DType::F32 => t.values.iter().for_each(|v| out.extend(v.to_le_bytes())),
            DType::I64 => t
                .values
                .iter()
                .for_each(|v| out.extend((v.round() as i64).to_le_bytes())),
        }
    }
    Ok(out)
}

/// A safetensors header for tensors stored one after another, each `(name,
/// dtype, shape, bytes)`, padded so the data starts 8-byte aligned as the
/// reference writer does; and the data's total length. Errors
/// (`InvalidInput`) on a duplicate or reserved name.
fn safetensors_header<'a>(
    entries: impl IntoIterator<Item = (&'a str, &'a str, serde_json::Value, usize)>,
) -> io::Result<(String, usize)> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in entries {
        if name == "__metadata__" || header.contains_key(name) {
            return Err(invalid(format!(
                "weight name `{name}` is reserved or repeated"
            )));
        }
        let end = offset + bytes;
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_string(&header).map_err(io::Error::other)?;
    while (8 + json.len()) % 8 != 0 {
        json.push(' ');
    }
    Ok((json, offset))
}

/// Writes `tensors` to `path` atomically: to `PATH.tmp` in the same folder,
/// fsynced, then renamed over `path` (and the folder fsynced, where possible).
pub fn write_safetensors(path: &Path, tensors: &[WeightTensor]) -> io::Result<()> {
    let bytes = to_safetensors_bytes(tensors)?;
    write_atomically(path, |f| f.write_all(&bytes))
}

/// Writes a file atomically: `write` fills `PATH.tmp` in the same folder,
/// which is fsynced and renamed over `path` (and the folder fsynced, where
/// possible).
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut io::BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let mut tmp_name = path
        .file_name()
        .ok_or_else(|| invalid(format!("{}: not a file path", path.display())))?
        .to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let written = (|| {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        let mut f = io::BufWriter::with_capacity(1 << 20, f);
        write(&mut f)?;
        let f = f.into_inner().map_err(io::IntoInnerError::into_error)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        // Makes the rename durable on Linux; not possible everywhere, so best effort.
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads a weights file: F32 and I64 tensors (I64 values become f32 with
/// `dtype: I64`), sorted by name. Other dtypes are an error naming the tensor.
pub fn read_safetensors(path: &Path) -> Result<Vec<WeightTensor>, JobError> {
    let shown = path.display().to_string();
    let bytes =
        std::fs::read(path).map_err(|e| JobError::file(&shown, format!("cannot read: {e}")))?;
    let st = parse_safetensors(&bytes, &shown)?;
    let mut out: Vec<WeightTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let (dtype, values) = match view.dtype() {
                safetensors::Dtype::F32 => (
                    DType::F32,
                    view.data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                safetensors::Dtype::I64 => (
                    DType::I64,
                    view.data()
                        .chunks_exact(8)
                        .map(|c| {
                            let mut a = [0u8; 8];
                            a.copy_from_slice(c);
                            i64::from_le_bytes(a) as f32
                        })
                        .collect(),
                ),
                other => {
                    return Err(JobError::file(
                        &shown,
                        format!(
                            "weight `{name}` is {other:?}; only F32 (and I64 counters) are read"
                        ),
                    ));
                }
            };
            Ok(WeightTensor {
                shape: view.shape().to_vec(),
                name,
                dtype,
                values,
            })
        })
        .collect::<Result<_, _>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Parses a safetensors buffer with the `safetensors` crate, after checking
/// what its 0.3 release does not: every data offset inside the buffer (so its
/// own arithmetic cannot overflow).
pub(crate) fn parse_safetensors<'a>(
    bytes: &'a [u8],
    shown: &str,
) -> Result<SafeTensors<'a>, JobError> {
    let bad =
        |reason: String| JobError::file(shown, format!("not a valid safetensors file: {reason}"));
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(bad("shorter than its 8-byte header length".into()));
    };
    let n = u64::from_le_bytes(*len);
    if n > rest.len() as u64 {
        return Err(bad(format!(
            "the header claims {n} bytes, the file has {} after the length",
            rest.len()
        )));
    }
    let (head, data) = rest.split_at(n as usize);
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(head).map_err(|e| bad(format!("header: {e}")))?;
    for (name, info) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor `{name}` has no data_offsets [begin, end]")))?;
        for o in offsets {
            match o.as_u64() {
                Some(o) if o <= data.len() as u64 => {}
                _ => {
                    return Err(bad(format!(
                        "tensor `{name}`: data offset {o} is outside the {} bytes of data",
                        data.len()
                    )));
                }
            }
        }
    }
    SafeTensors::deserialize(bytes).map_err(|e| bad(format!("{e:?}")))
}

/// Writes wire tensors (their bytes are already little-endian, as the file
/// stores them) as a safetensors file, atomically, each tensor's bytes going
/// to the file from where they lie: the server writes a large model's
/// checkpoint without a second copy of it in memory. Errors
/// (`InvalidInput`) as [`to_safetensors_bytes`].
pub fn write_wire_safetensors(path: &Path, tensors: &[WireTensor]) -> io::Result<()> {
    let mut entries = Vec::with_capacity(tensors.len());
    for t in tensors {
        t.check_size().map_err(|e| invalid(e.to_string()))?;
        let dtype = match t.dtype {
            WireDType::F32 => "F32",
            WireDType::F16 => "F16",
            WireDType::Bf16 => "BF16",
            WireDType::I64 => "I64",
            // Quantized activations and gradients are never weights.
            WireDType::I8Block => {
                return Err(invalid(format!(
                    "tensor `{}` is int8, which weights files do not hold",
                    t.name
                )));
            }
        };
        entries.push((
            t.name.as_str(),
            dtype,
            serde_json::json!(t.shape),
            t.data.len(),
        ));
    }
    let (json, _) = safetensors_header(entries)?;
    write_atomically(path, |f| {
        f.write_all(&(json.len() as u64).to_le_bytes())?;
        f.write_all(json.as_bytes())?;
        for t in tensors {
            f.write_all(&t.data)?;
        }
        Ok(())
    })
}

/// Reads a safetensors file as wire tensors (F32, F16, BF16 and I64), sorted
/// by name, each a view into the one buffer holding the file: its data is in
/// memory once.
pub fn read_wire_safetensors(path: &Path) -> Result<Vec<WireTensor>, JobError> {
    let shown = path.display().to_string();
    let bytes = Bytes::from(
        std::fs::read(path).map_err(|e| JobError::file(&shown, format!("cannot read: {e}")))?,
    );
    let st = parse_safetensors(&bytes, &shown)?;
    let mut out: Vec<WireTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => WireDType::F32,
                safetensors::Dtype::F16 => WireDType::F16,
                safetensors::Dtype::BF16 => WireDType::Bf16,
                safetensors::Dtype::I64 => WireDType::I64,
                other => {
                    return Err(JobError::file(
                        &shown,
                        format!(
                            "tensor `{name}` is {other:?}; only F32, F16, BF16 and I64 are read"
                        ),
                    ));
                }
            };
            let tensor = WireTensor {
                shape: view.shape().iter().map(|&d| d as u32).collect(),
                dtype,
                data: bytes.slice_ref(view.data()),
                name,
            };
            tensor
                .check_size()
                .map_err(|e| JobError::file(&shown, e.to_string()))?;
            Ok(tensor)
        })
        .collect::<Result<_, _>>()?;
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}
