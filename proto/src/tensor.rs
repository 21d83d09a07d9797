//! Tensors on the wire: a name, a shape, an element type and raw little-endian
//! bytes. Activations and gradients may travel as f16 or bf16 to halve the
//! bytes; data, labels and parameters travel as f32 (or i64 for integers).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Element type of a [`WireTensor`]; also the job file's `wire_dtype`
/// setting (activations and gradients, float types only), spelled in
/// lowercase there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireDType {
    F32,
    F16,
    Bf16,
    I64,
}

impl WireDType {
    pub fn size(self) -> usize {
        match self {
            WireDType::F32 => 4,
            WireDType::F16 | WireDType::Bf16 => 2,
            WireDType::I64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, WireDType::I64)
    }

    /// Index of the first infinite or NaN element of little-endian `data`
    /// of this type (never for i64).
    pub fn first_non_finite(self, data: &[u8]) -> Option<usize> {
        match self {
            WireDType::F32 => first_non_finite::<4>(data, 0x7f80_0000),
            WireDType::F16 => first_non_finite::<2>(data, 0x7c00),
            WireDType::Bf16 => first_non_finite::<2>(data, 0x7f80),
            WireDType::I64 => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WireDType::F32 => "f32",
            WireDType::F16 => "f16",
            WireDType::Bf16 => "bf16",
            WireDType::I64 => "i64",
        }
    }
}

/// One named tensor in a frame.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    pub name: String,
    pub dtype: WireDType,
    pub shape: Vec<u32>,
    /// Row-major, little-endian elements. Decoded by [`crate::decode_frame`],
    /// this is a view into the received frame, so relaying a tensor never
    /// copies its bytes out of the frame.
    #[serde(with = "frame_bytes")]
    pub data: Bytes,
}

impl std::fmt::Debug for WireTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WireTensor({} {} {:?}, {} bytes)",
            self.name,
            self.dtype.as_str(),
            self.shape,
            self.data.len()
        )
    }
}

/// Why a tensor's bytes cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor `{name}`: {len} bytes do not hold shape {shape:?} of {dtype}")]
    Size {
        name: String,
        len: usize,
        shape: Vec<u32>,
        dtype: &'static str,
    },
    #[error("tensor `{name}`: element {index} is not finite")]
    NotFinite { name: String, index: usize },
    #[error("tensor `{name}` is {got}, expected {expected}")]
    DType {
        name: String,
        got: &'static str,
        expected: &'static str,
    },
}

fn encode_f32(values: &[f32], dtype: WireDType) -> Vec<u8> {
    match dtype {
        WireDType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        WireDType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        WireDType::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        WireDType::I64 => values
            .iter()
            .flat_map(|v| (*v as i64).to_le_bytes())
            .collect(),
    }
}

fn encode_i64(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl WireTensor {
    /// Encodes f32 values as `dtype` (f32, f16 or bf16; i64 rounds toward zero).
    pub fn from_f32(
        name: impl Into<String>,
        shape: &[usize],
        values: &[f32],
        dtype: WireDType,
    ) -> Self {
        // The loops live in functions that are not generic, so they are
        // compiled here, with this crate's optimisation, not in every caller.
        Self::from_le_bytes(name, shape, dtype, encode_f32(values, dtype))
    }

    pub fn from_i64(name: impl Into<String>, shape: &[usize], values: &[i64]) -> Self {
        Self::from_le_bytes(name, shape, WireDType::I64, encode_i64(values))
    }

    /// A tensor whose elements are already `dtype`'s little-endian bytes
    /// (copied out of a device tensor, say); not checked against the shape.
    pub fn from_le_bytes(
        name: impl Into<String>,
        shape: &[usize],
        dtype: WireDType,
        data: Vec<u8>,
    ) -> Self {
        WireTensor {
            name: name.into(),
            dtype,
            shape: shape.iter().map(|&d| d as u32).collect(),
            data: data.into(),
        }
    }

    /// Elements the shape declares; `usize::MAX` when that overflows (a peer
    /// can declare any shape; [`check_size`](Self::check_size) refuses it).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
            .unwrap_or(usize::MAX)
    }

    pub fn shape_usize(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Bytes its shape and dtype need, or `None` when that overflows.
    pub fn expected_len(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d as usize))
    }

    /// Checks that the bytes hold exactly the declared shape.
    pub fn check_size(&self) -> Result<(), TensorError> {
        if self.expected_len() == Some(self.data.len()) {
            Ok(())
        } else {
            Err(TensorError::Size {
                name: self.name.clone(),
                len: self.data.len(),
                shape: self.shape.clone(),
                dtype: self.dtype.as_str(),
            })
        }
    }

    /// [`check_size`](Self::check_size), and every float element finite.
    pub fn check(&self) -> Result<(), TensorError> {
        self.check_size()?;
        // Straight off the bytes: relays check every tensor, so no copy.
        let bad = self.dtype.first_non_finite(&self.data);
        match bad {
            Some(index) => Err(TensorError::NotFinite {
                name: self.name.clone(),
                index,
            }),
            None => Ok(()),
        }
    }

    /// The elements as f32 (i64 converts with rounding to the nearest f32).
    pub fn to_f32(&self) -> Result<Vec<f32>, TensorError> {
        self.check_size()?;
        let d = &self.data;
        Ok(match self.dtype {
            WireDType::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            WireDType::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            WireDType::Bf16 => d
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            WireDType::I64 => d
                .chunks_exact(8)
                .map(|c| {
                    i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
                })
                .collect(),
        })
    }

    pub fn to_i64(&self) -> Result<Vec<i64>, TensorError> {
        self.check_size()?;
        if self.dtype != WireDType::I64 {
            return Err(TensorError::DType {
                name: self.name.clone(),
                got: self.dtype.as_str(),
                expected: "i64",
            });
        }
        Ok(self
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
}

/// Index of the first element whose exponent bits (`exponent_mask`) are all
/// set, that is an infinity or a NaN, among little-endian elements of `N`
/// bytes. Blocks are first tested with a branch-free fold, which the compiler
/// vectorises; only a block that fails is searched element by element.
fn first_non_finite<const N: usize>(data: &[u8], exponent_mask: u32) -> Option<usize> {
    const BLOCK: usize = 1024;
    let is_bad = |element: &[u8]| {
        let mut le = [0u8; 4];
        le[..N].copy_from_slice(element);
        u32::from_le_bytes(le) & exponent_mask == exponent_mask
    };
    data.chunks(BLOCK * N)
        .enumerate()
        .find_map(|(block_index, block)| {
            let any_bad = block
                .chunks_exact(N)
                .fold(false, |acc, element| acc | is_bad(element));
            any_bad
                .then(|| block.chunks_exact(N).position(is_bad))
                .flatten()
                .map(|i| block_index * BLOCK + i)
        })
}

/// Serde for tensor bytes: a byte string on the wire; decoded as a view into
/// the frame that [`crate::decode_frame`] is decoding, or as a copy otherwise.
pub(crate) mod frame_bytes {
    use std::cell::RefCell;

    use bytes::Bytes;
    use serde::{Deserializer, Serializer, de};

    thread_local! {
        /// The frame being decoded on this thread, if it can be shared.
        static FRAME: RefCell<Option<Bytes>> = const { RefCell::new(None) };
    }

    /// Runs `decode` with `frame` as the frame that decoded tensors may share.
    pub(crate) fn sharing<R>(frame: &Bytes, decode: impl FnOnce() -> R) -> R {
        struct Reset(Option<Bytes>);
        impl Drop for Reset {
            fn drop(&mut self) {
                FRAME.with(|f| *f.borrow_mut() = self.0.take());
            }
        }
        let _reset = Reset(FRAME.with(|f| f.borrow_mut().replace(frame.clone())));
        decode()
    }

    fn share(slice: &[u8]) -> Bytes {
        FRAME.with(|f| match &*f.borrow() {
            Some(frame) if contains(frame, slice) => frame.slice_ref(slice),
            _ => Bytes::copy_from_slice(slice),
        })
    }

    fn contains(frame: &[u8], slice: &[u8]) -> bool {
        let outer = frame.as_ptr_range();
        let inner = slice.as_ptr_range();
        outer.start <= inner.start && inner.end <= outer.end
    }

    pub fn serialize<S: Serializer>(data: &Bytes, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(data)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Bytes, D::Error> {
        deserializer.deserialize_bytes(Visitor)
    }

    struct Visitor;

    impl<'de> de::Visitor<'de> for Visitor {
        type Value = Bytes;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("tensor bytes")
        }

        fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Bytes, E> {
            Ok(share(v))
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
            Ok(Bytes::copy_from_slice(v))
        }

        fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
            Ok(v.into())
        }

        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(b) = seq.next_element()? {
                v.push(b);
            }
            Ok(v.into())
        }
    }
}

pub(crate) use frame_bytes::sharing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_each_dtype_within_its_precision() {
        let values = [0.0f32, 1.5, -2.25, 1e-3, 3.0e4];
        for (dtype, tol) in [
            (WireDType::F32, 0.0),
            (WireDType::F16, 1e-3),
            (WireDType::Bf16, 8e-3),
        ] {
            let t = WireTensor::from_f32("x", &[5], &values, dtype);
            assert_eq!(t.data.len(), 5 * dtype.size());
            let back = t.to_f32().unwrap();
            for (a, b) in values.iter().zip(&back) {
                assert!(
                    (a - b).abs() <= tol * a.abs().max(1.0),
                    "{dtype:?}: {a} vs {b}"
                );
            }
        }
        let t = WireTensor::from_i64("y", &[2], &[3, -7]);
        assert_eq!(t.to_i64().unwrap(), vec![3, -7]);
        assert!(
            WireTensor::from_f32("z", &[1], &[1.0], WireDType::F32)
                .to_i64()
                .is_err()
        );
    }

    #[test]
    fn wrong_sizes_and_non_finite_values_are_refused() {
        let mut t = WireTensor::from_f32("x", &[2, 2], &[1.0, 2.0, 3.0, 4.0], WireDType::F32);
        assert!(t.check().is_ok());
        t.data.truncate(t.data.len() - 1);
        assert!(matches!(t.check(), Err(TensorError::Size { .. })));
        let t = WireTensor::from_f32("x", &[2], &[1.0, f32::NAN], WireDType::F16);
        assert_eq!(
            t.check(),
            Err(TensorError::NotFinite {
                name: "x".into(),
                index: 1
            })
        );
        // Found past the first vectorised block, at its exact index.
        let mut values = vec![0.5f32; 3000];
        values[2500] = f32::INFINITY;
        for dtype in [WireDType::F32, WireDType::F16, WireDType::Bf16] {
            let t = WireTensor::from_f32("big", &[3000], &values, dtype);
            assert_eq!(
                t.check(),
                Err(TensorError::NotFinite {
                    name: "big".into(),
                    index: 2500
                }),
                "{dtype:?}"
            );
        }
        // A shape whose byte count overflows is a size error, not a panic.
        let t = WireTensor {
            name: "h".into(),
            dtype: WireDType::F32,
            shape: vec![u32::MAX, u32::MAX, u32::MAX],
            data: Bytes::new(),
        };
        assert!(t.check().is_err());
    }
}
