//! Host-side tensors the importer computes with: initializer values decoded from
//! `TensorProto` (inline or external data) and the small constants that shape
//! arithmetic folds to. Floats are kept in f64 but rounded to f32 after every
//! operation on an f32 tensor, so folded values equal what an ONNX runtime would
//! compute; integers are kept in i64 and wrapped to their declared width.

use super::pb::TensorProto;
use super::pb::tensor_proto::{DataLocation, DataType};

/// Element types the importer understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    F32,
    F64,
    I8,
    U8,
    I16,
    I32,
    I64,
    Bool,
}

impl Elem {
    /// Maps an ONNX `TensorProto.DataType` code; `None` for types Rookery has no use for.
    pub(crate) fn from_onnx(code: i32) -> Option<Elem> {
        Some(match DataType::try_from(code).ok()? {
            DataType::Float => Elem::F32,
            DataType::Double => Elem::F64,
            DataType::Int8 => Elem::I8,
            DataType::Uint8 => Elem::U8,
            DataType::Int16 => Elem::I16,
            DataType::Int32 => Elem::I32,
            DataType::Int64 => Elem::I64,
            DataType::Bool => Elem::Bool,
            _ => return None,
        })
    }

    pub(crate) fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F64)
    }

    fn byte_size(self) -> usize {
        match self {
            Elem::I8 | Elem::U8 | Elem::Bool => 1,
            Elem::I16 => 2,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }

    /// Brings an integer into this type's range the way a C cast would.
    pub(crate) fn wrap(self, v: i64) -> i64 {
        match self {
            Elem::I8 => i64::from(v as i8),
            Elem::U8 => i64::from(v as u8),
            Elem::I16 => i64::from(v as i16),
            Elem::I32 => i64::from(v as i32),
            Elem::Bool => i64::from(v != 0),
            _ => v,
        }
    }

    /// Rounds a float to this type's precision.
    pub(crate) fn round(self, v: f64) -> f64 {
        match self {
            Elem::F32 => f64::from(v as f32),
            _ => v,
        }
    }
}

/// Element values: floats or integers (booleans are integers 0/1).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Data {
    Float(Vec<f64>),
    Int(Vec<i64>),
}

/// A tensor whose values are known at import time.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tensor {
    pub elem: Elem,
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub(crate) fn ints(shape: Vec<usize>, values: Vec<i64>) -> Tensor {
        Tensor {
            elem: Elem::I64,
            shape,
            data: Data::Int(values),
        }
    }

    /// Element count (saturating: an absurd shape is rejected later, not a panic).
    pub(crate) fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    pub(crate) fn len(&self) -> usize {
        match &self.data {
            Data::Float(v) => v.len(),
            Data::Int(v) => v.len(),
        }
    }

    /// Values as integers (floats truncated toward zero, as ONNX `Cast` does).
    pub(crate) fn as_i64(&self) -> Vec<i64> {
        match &self.data {
            Data::Int(v) => v.clone(),
            Data::Float(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }

    pub(crate) fn as_f64(&self) -> Vec<f64> {
        match &self.data {
            Data::Float(v) => v.clone(),
            Data::Int(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Converts to another element type with ONNX `Cast` semantics.
    pub(crate) fn cast(&self, to: Elem) -> Tensor {
        let data = if to.is_float() {
            Data::Float(self.as_f64().into_iter().map(|x| to.round(x)).collect())
        } else if to == Elem::Bool {
            let nonzero = match &self.data {
                Data::Float(v) => v.iter().map(|&x| i64::from(x != 0.0)).collect(),
                Data::Int(v) => v.iter().map(|&x| i64::from(x != 0)).collect(),
            };
            Data::Int(nonzero)
        } else {
            Data::Int(self.as_i64().into_iter().map(|x| to.wrap(x)).collect())
        };
        Tensor {
            elem: to,
            shape: self.shape.clone(),
            data,
        }
    }

    /// Same values in a new shape (element count already checked by the caller).
    pub(crate) fn reshaped(&self, shape: Vec<usize>) -> Tensor {
        Tensor {
            shape,
            ..self.clone()
        }
    }

    /// Picks elements by flat index.
    pub(crate) fn pick(&self, shape: Vec<usize>, idx: &[usize]) -> Tensor {
        let data = match &self.data {
            Data::Float(v) => Data::Float(idx.iter().map(|&i| v[i]).collect()),
            Data::Int(v) => Data::Int(idx.iter().map(|&i| v[i]).collect()),
        };
        Tensor {
            elem: self.elem,
            shape,
            data,
        }
    }

    /// Values as f32, for parameters and constants stored in the graph.
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        self.as_f64().into_iter().map(|x| x as f32).collect()
    }

    pub(crate) fn all_zero(&self) -> bool {
        match &self.data {
            Data::Float(v) => v.iter().all(|&x| x == 0.0),
            Data::Int(v) => v.iter().all(|&x| x == 0),
        }
    }
}

/// Where a tensor's bytes live when they are not inline.
pub(crate) struct ExternalRef {
    pub location: String,
    pub offset: usize,
    pub length: Option<usize>,
}

/// Reads the `external_data` entries of a tensor stored outside the model file.
pub(crate) fn external_ref(t: &TensorProto) -> Result<Option<ExternalRef>, String> {
    if t.data_location() != DataLocation::External {
        return Ok(None);
    }
    let (mut location, mut offset, mut length) = (None, 0, None);
    for kv in &t.external_data {
        let value = kv.value();
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("external_data {:?} = {value:?} is not a number", kv.key()))
        };
        match kv.key() {
            "location" => location = Some(value.to_string()),
            "offset" => offset = number()?,
            "length" => length = Some(number()?),
            _ => {}
        }
    }
    let location = location.ok_or("stored externally but has no `location`")?;
    Ok(Some(ExternalRef {
        location,
        offset,
        length,
    }))
}

/// A tensor's element type, shape and element count, without its values.
pub(crate) fn header(t: &TensorProto) -> Result<(Elem, Vec<usize>, usize), String> {
    let code = t.data_type();
    let elem = Elem::from_onnx(code).ok_or_else(|| {
        let name = DataType::try_from(code).map_or("unknown", |d| d.as_str_name());
        format!("element type {name} ({code}) is not supported")
    })?;
    if t.segment.is_some() {
        return Err("segmented tensors are not supported".into());
    }
    let shape = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("negative dimension in {:?}", t.dims)))
        .collect::<Result<Vec<_>, _>>()?;
    let n = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("dimensions {:?} overflow", t.dims))?;
    Ok((elem, shape, n))
}

/// Decodes a tensor's values. `external` holds the bytes of an externally stored
/// tensor (already cut to its offset and length), else `None` for inline data.
pub(crate) fn decode(t: &TensorProto, external: Option<&[u8]>) -> Result<Tensor, String> {
    let (elem, shape, n) = header(t)?;
    let raw = external.or(t.raw_data.as_deref().filter(|r| !r.is_empty()));
    let data = match raw {
        Some(bytes) => from_le_bytes(elem, bytes, n)?,
        None => typed_fields(t, elem),
    };
    let tensor = Tensor { elem, shape, data };
    if tensor.len() != n {
        return Err(format!(
            "holds {} values for shape {:?} ({n} elements)",
            tensor.len(),
            t.dims
        ));
    }
    Ok(tensor)
}

/// A floating-point tensor's values as f32, as a weight keeps them: raw f32
/// bytes go straight across (a model's weights are most of its file, so no
/// wider copy is made of them).
pub(crate) fn decode_f32(t: &TensorProto, external: Option<&[u8]>) -> Result<Vec<f32>, String> {
    let (elem, _, n) = header(t)?;
    let raw = external.or(t.raw_data.as_deref().filter(|r| !r.is_empty()));
    match (elem, raw) {
        (Elem::F32, Some(bytes)) => {
            if n.checked_mul(4) != Some(bytes.len()) {
                return Err(format!(
                    "has {} bytes of data, {n} elements of 4 bytes need {}",
                    bytes.len(),
                    n.saturating_mul(4)
                ));
            }
            Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        _ => decode(t, external).map(|t| t.to_f32()),
    }
}

fn from_le_bytes(elem: Elem, bytes: &[u8], n: usize) -> Result<Data, String> {
    let size = elem.byte_size();
    if n.checked_mul(size) != Some(bytes.len()) {
        return Err(format!(
            "has {} bytes of data, {n} elements of {size} bytes need {}",
            bytes.len(),
            n.saturating_mul(size)
        ));
    }
    let chunks = bytes.chunks_exact(size);
    // chunks_exact yields slices of exactly `size` bytes, so each try_into succeeds;
    // the fallbacks only keep this free of unwrap.
    Ok(match elem {
        Elem::F32 => Data::Float(
            chunks
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap_or([0; 4]))))
                .collect(),
        ),
        Elem::F64 => Data::Float(
            chunks
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        Elem::I64 => Data::Int(
            chunks
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        Elem::I32 => Data::Int(
            chunks
                .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap_or([0; 4]))))
                .collect(),
        ),
        Elem::I16 => Data::Int(
            chunks
                .map(|c| i64::from(i16::from_le_bytes(c.try_into().unwrap_or([0; 2]))))
                .collect(),
        ),
        Elem::I8 => Data::Int(bytes.iter().map(|&b| i64::from(b as i8)).collect()),
        Elem::U8 => Data::Int(bytes.iter().map(|&b| i64::from(b)).collect()),
        Elem::Bool => Data::Int(bytes.iter().map(|&b| i64::from(b != 0)).collect()),
    })
}

/// The typed repeated fields ONNX uses when `raw_data` is absent.
fn typed_fields(t: &TensorProto, elem: Elem) -> Data {
    match elem {
        Elem::F32 => Data::Float(t.float_data.iter().map(|&x| f64::from(x)).collect()),
        Elem::F64 => Data::Float(t.double_data.clone()),
        Elem::I64 => Data::Int(t.int64_data.clone()),
        // ONNX packs every narrower integer type and bool into int32_data.
        Elem::I32 | Elem::I16 | Elem::I8 | Elem::U8 | Elem::Bool => Data::Int(
            t.int32_data
                .iter()
                .map(|&x| elem.wrap(i64::from(x)))
                .collect(),
        ),
    }
}
