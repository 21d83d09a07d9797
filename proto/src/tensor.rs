//! Tensors on the wire: a name, a shape, an element type and raw little-endian
//! bytes. Activations and gradients may travel as f16 or bf16 to halve the
//! bytes, or as blockwise int8 ([`WireDType::I8Block`]) to take about a
//! quarter; data, labels and parameters travel as f32 (or i64 for integers).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Elements per block of an int8 tensor ([`WireDType::I8Block`]), each block
/// sharing one f32 scale, its absmax. 64 keeps the bytes at most 0.27 of
/// f32's (`(64 + 4) / (64 * 4)` = 0.265625 for whole blocks; a short last
/// block costs more, still at most 0.27 from 256 elements on) while an
/// element's rounding error stays within its own block's absmax / 254, so
/// one outlier coarsens only its 63 neighbours.
pub const INT8_BLOCK: usize = 64;

/// Element type of a [`WireTensor`]; also the job file's `wire_dtype`
/// setting (activations and gradients, float types only), spelled in
/// lowercase there (`"int8"` for [`WireDType::I8Block`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireDType {
    F32,
    F16,
    Bf16,
    I64,
    /// Blockwise int8, for activations and gradients only: a tensor of `n`
    /// elements is `ceil(n / INT8_BLOCK)` little-endian f32 scales (each
    /// block's absmax; a block is [`INT8_BLOCK`] consecutive row-major
    /// elements, the last one possibly shorter), then `n` i8 values, `q =
    /// round(v / scale * 127)` in -127..=127, read back as `q * (scale /
    /// 127)`. A block of zeros has scale 0. Lossy to within absmax / 254
    /// per block, so never for parameters or optimizer state.
    #[serde(rename = "int8")]
    I8Block,
}

impl WireDType {
    /// Bytes per element; an int8 tensor also carries a 4-byte scale per
    /// [`INT8_BLOCK`] elements, so count a tensor's bytes with
    /// [`bytes_for`](Self::bytes_for).
    pub fn size(self) -> usize {
        match self {
            WireDType::F32 => 4,
            WireDType::F16 | WireDType::Bf16 => 2,
            WireDType::I64 => 8,
            WireDType::I8Block => 1,
        }
    }

    /// Bytes a tensor of `numel` elements of this type takes, or `None` when
    /// that overflows.
    pub fn bytes_for(self, numel: usize) -> Option<usize> {
        match self {
            WireDType::I8Block => numel
                .div_ceil(INT8_BLOCK)
                .checked_mul(4)?
                .checked_add(numel),
            _ => numel.checked_mul(self.size()),
        }
    }

    /// Whether it carries floats (every type but i64; int8 carries them
    /// quantized).
    pub fn is_float(self) -> bool {
        !matches!(self, WireDType::I64)
    }

    /// Whether values are quantized against a per-block scale (int8): fit
    /// for activations and gradients, never for parameters or optimizer
    /// state, which keep their precision.
    pub fn is_quantized(self) -> bool {
        matches!(self, WireDType::I8Block)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WireDType::F32 => "f32",
            WireDType::F16 => "f16",
            WireDType::Bf16 => "bf16",
            WireDType::I64 => "i64",
            WireDType::I8Block => "int8",
        }
    }

    /// The first invalid element of `data`, the bytes at offset `at` of a
    /// tensor of this type that is `total` bytes in all: a float that is
    /// infinite or NaN; for int8, a scale that is not finite and
    /// non-negative or a value of -128. The caller has checked that `data`
    /// holds whole elements (for int8: whole scales) and that `total` is a
    /// whole tensor's length.
    pub(crate) fn first_invalid(self, data: &[u8], at: usize, total: usize) -> Option<Invalid> {
        let floats = |found: Option<usize>| found.map(|i| Invalid::NotFinite(at / self.size() + i));
        match self {
            WireDType::F32 => floats(first_non_finite::<4>(data, 0x7f80_0000)),
            WireDType::F16 => floats(first_non_finite::<2>(data, 0x7c00)),
            WireDType::Bf16 => floats(first_non_finite::<2>(data, 0x7f80)),
            WireDType::I64 => None,
            WireDType::I8Block => {
                let split = int8_scale_bytes(total).unwrap_or(total);
                let scales = &data[..split.saturating_sub(at).min(data.len())];
                // A scale is valid when its sign bit is clear and its
                // exponent is not all ones (not infinite, not NaN).
                if let Some(i) = scales
                    .chunks_exact(4)
                    .position(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) >= 0x7f80_0000)
                {
                    return Some(Invalid::Scale(at / 4 + i));
                }
                let first_value = at.max(split) - split;
                data[scales.len()..]
                    .iter()
                    .position(|&q| q == 0x80)
                    .map(|i| Invalid::Int8Min(first_value + i))
            }
        }
    }
}

/// The bytes of an int8 tensor of `total` bytes that are its scales, or
/// `None` when no element count gives `total` bytes. A tensor of `b > 0`
/// blocks takes between `68 (b - 1) + 5` and `68 b` bytes, so `b` is
/// `ceil(total / 68)`.
pub(crate) fn int8_scale_bytes(total: usize) -> Option<usize> {
    let blocks = total.div_ceil(INT8_BLOCK + 4);
    let numel = total.checked_sub(4 * blocks)?;
    (numel.div_ceil(INT8_BLOCK) == blocks).then_some(4 * blocks)
}

/// What makes an element of a tensor's bytes unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Invalid {
    /// Float element `index` is infinite or NaN.
    NotFinite(usize),
    /// The scale of int8 block `block` is NaN, infinite or negative.
    Scale(usize),
    /// Int8 element `index` is -128.
    Int8Min(usize),
}

impl Invalid {
    pub(crate) fn error(self, name: &str) -> TensorError {
        let name = name.to_string();
        match self {
            Invalid::NotFinite(index) => TensorError::NotFinite { name, index },
            Invalid::Scale(block) => TensorError::Scale { name, block },
            Invalid::Int8Min(index) => TensorError::Int8Min { name, index },
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
    #[error(
        "tensor `{name}`: the scale of int8 block {block} is not a finite, non-negative number"
    )]
    Scale { name: String, block: usize },
    #[error(
        "tensor `{name}`: int8 element {index} is -128, outside the -127..=127 quantization writes"
    )]
    Int8Min { name: String, index: usize },
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
        WireDType::I8Block => encode_int8(values),
    }
}

/// Blockwise int8 ([`WireDType::I8Block`]): the blocks' scales, then the
/// values. A block holding a non-finite value gets a NaN scale (and zeros),
/// which [`WireTensor::check`] refuses.
fn encode_int8(values: &[f32]) -> Vec<u8> {
    let blocks = values.len().div_ceil(INT8_BLOCK);
    let mut out = vec![0u8; 4 * blocks + values.len()];
    let (scales, quantized) = out.split_at_mut(4 * blocks);
    for ((block, scale_bytes), q) in values
        .chunks(INT8_BLOCK)
        .zip(scales.chunks_exact_mut(4))
        .zip(quantized.chunks_mut(INT8_BLOCK))
    {
        let scale = if block.iter().all(|v| v.is_finite()) {
            block.iter().fold(0.0f32, |m, v| m.max(v.abs()))
        } else {
            f32::NAN
        };
        scale_bytes.copy_from_slice(&scale.to_le_bytes());
        if scale > 0.0 {
            for (q, v) in q.iter_mut().zip(block) {
                *q = ((v / scale * 127.0).round().clamp(-127.0, 127.0) as i8) as u8;
            }
        }
    }
    out
}

/// The values of a checked int8 tensor's bytes, `split` of which are scales.
fn decode_int8(data: &[u8], split: usize) -> Vec<f32> {
    let (scales, quantized) = data.split_at(split);
    scales
        .chunks_exact(4)
        .zip(quantized.chunks(INT8_BLOCK))
        .flat_map(|(scale, block)| {
            let step = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]) / 127.0;
            block.iter().map(move |&q| f32::from(q as i8) * step)
        })
        .collect()
}

fn encode_i64(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl WireTensor {
    /// Encodes f32 values as `dtype` (f32, f16, bf16 or int8, which
    /// quantizes; i64 rounds toward zero).
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

    /// Bytes its shape and dtype need (for int8 its scales too), or `None`
    /// when that overflows.
    pub fn expected_len(&self) -> Option<usize> {
        let numel = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))?;
        self.dtype.bytes_for(numel)
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

    /// [`check_size`](Self::check_size), and every float element finite;
    /// for int8, every scale finite and non-negative and no value -128.
    pub fn check(&self) -> Result<(), TensorError> {
        self.check_size()?;
        // Straight off the bytes: relays check every tensor, so no copy.
        match self.dtype.first_invalid(&self.data, 0, self.data.len()) {
            Some(bad) => Err(bad.error(&self.name)),
            None => Ok(()),
        }
    }

    /// The elements as f32 (i64 converts with rounding to the nearest f32;
    /// int8 is dequantized, after the checks on its scales and values that
    /// [`check`](Self::check) makes).
    pub fn to_f32(&self) -> Result<Vec<f32>, TensorError> {
        self.check_size()?;
        let d = &self.data;
        Ok(match self.dtype {
            WireDType::I8Block => {
                if let Some(bad) = self.dtype.first_invalid(d, 0, d.len()) {
                    return Err(bad.error(&self.name));
                }
                decode_int8(d, int8_scale_bytes(d.len()).unwrap_or(0))
            }
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

    /// Deterministic pseudo-random numbers in [0, 1).
    fn noise(seed: u64) -> impl FnMut() -> f32 {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn int8(shape: &[usize], values: &[f32]) -> WireTensor {
        WireTensor::from_f32("q", shape, values, WireDType::I8Block)
    }

    #[test]
    fn int8_round_trips_within_its_block_absmax_over_254() {
        let mut next = noise(3);
        // Magnitudes from 1e-3 to 1e3, an outlier block and a short last one.
        let mut values: Vec<f32> = (0..1000)
            .map(|i| (next() - 0.5) * 10f32.powi(i / 64 % 7 - 3))
            .collect();
        values[130] = 5.0e4;
        let t = int8(&[8, 125], &values);
        t.check().unwrap();
        let back = t.to_f32().unwrap();
        assert_eq!(back.len(), values.len());
        for (b, (block, got)) in values
            .chunks(INT8_BLOCK)
            .zip(back.chunks(INT8_BLOCK))
            .enumerate()
        {
            let absmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // absmax / 254 from rounding to the nearest of 255 levels, and
            // a few f32 roundings (each at most 2^-24 relative) on top.
            let bound = absmax * (1.0 / 254.0 + 1e-6);
            for (v, g) in block.iter().zip(got) {
                assert!((v - g).abs() <= bound, "block {b}: {v} came back {g}");
            }
        }
        // Zeros come back exactly, alone or beside a block that is not.
        let mut values = vec![0.0f32; 130];
        assert_eq!(int8(&[130], &values).to_f32().unwrap(), values);
        values[100] = -2.5;
        let back = int8(&[130], &values).to_f32().unwrap();
        assert!(back[..64].iter().all(|&v| v == 0.0));
        assert!((back[100] + 2.5).abs() <= 2.5e-6, "{}", back[100]);
    }

    #[test]
    fn int8_bytes_are_the_values_and_a_scale_per_block_of_64() {
        for (n, bytes) in [(0, 0), (1, 5), (64, 68), (65, 73), (1000, 1064)] {
            let t = int8(&[n], &vec![1.0; n]);
            assert_eq!(t.data.len(), bytes, "{n} elements");
            assert_eq!(t.expected_len(), Some(bytes));
            assert_eq!(WireDType::I8Block.bytes_for(n), Some(bytes));
            assert_eq!(int8_scale_bytes(bytes), Some(4 * n.div_ceil(64)));
            assert_eq!(t.check_size(), Ok(()));
        }
        // At most 0.27 of f32's bytes: exactly (64 + 4) / 256 = 0.265625 for
        // whole blocks, and at most 0.27 for any n >= 256 (a short last
        // block of n = 64 k + r costs 4 bytes, within 0.08 n once k >= 4).
        for n in (1..=4096).filter(|&n| n >= 256 || n % 64 == 0) {
            let ratio = WireDType::I8Block.bytes_for(n).unwrap() as f64 / (4 * n) as f64;
            assert!(ratio <= 0.27, "{n}: {ratio}");
            if n % 64 == 0 {
                assert_eq!(ratio, 0.265625);
            }
        }
        // Lengths no element count gives, and overflow.
        for len in [1, 2, 3, 4, 69, 70, 71, 72] {
            assert_eq!(int8_scale_bytes(len), None, "{len}");
        }
        assert_eq!(WireDType::I8Block.bytes_for(usize::MAX), None);
        let mut t = int8(&[3], &[1.0, 2.0, 3.0]);
        t.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(matches!(t.check(), Err(TensorError::Size { .. })));
    }

    #[test]
    fn int8_refuses_bad_scales_and_minus_128() {
        let values: Vec<f32> = (0..200).map(|i| i as f32 - 100.0).collect();
        let good = int8(&[200], &values);
        assert_eq!(good.check(), Ok(()));
        let with = |offset: usize, bytes: &[u8]| {
            let mut data = good.data.to_vec();
            data[offset..offset + bytes.len()].copy_from_slice(bytes);
            WireTensor {
                data: data.into(),
                ..good.clone()
            }
        };
        for scale in [f32::NAN, f32::INFINITY, -1.0, -0.0] {
            let t = with(8, &scale.to_le_bytes());
            let want = Err(TensorError::Scale {
                name: "q".into(),
                block: 2,
            });
            assert_eq!(t.check(), want, "{scale}");
            assert_eq!(t.to_f32().map(|_| ()), want, "{scale}");
        }
        let t = with(16 + 150, &[0x80]);
        let want = Err(TensorError::Int8Min {
            name: "q".into(),
            index: 150,
        });
        assert_eq!(t.check(), want);
        assert_eq!(t.to_f32().map(|_| ()), want);
        // A non-finite value quantizes to a NaN scale that check refuses.
        let mut values = vec![1.0f32; 100];
        values[70] = f32::INFINITY;
        assert_eq!(
            int8(&[100], &values).check(),
            Err(TensorError::Scale {
                name: "q".into(),
                block: 1
            })
        );
        values[70] = f32::NAN;
        assert!(int8(&[100], &values).to_f32().is_err());
    }

    #[test]
    fn random_int8_bytes_never_panic_and_check_agrees_with_to_f32() {
        let mut next = noise(11);
        for n in 0..400usize {
            let right = WireDType::I8Block.bytes_for(n).unwrap();
            for extra in [0isize, -1, 1] {
                let len = right.saturating_add_signed(extra);
                let mut data: Vec<u8> = (0..len).map(|_| (next() * 256.0) as u8).collect();
                // Valid scales half the time, so the values get checked too.
                if n % 2 == 0 {
                    for s in data.chunks_exact_mut(4).take(n.div_ceil(64)) {
                        s.copy_from_slice(&(next() * 8.0).to_le_bytes());
                    }
                }
                let t = WireTensor::from_le_bytes("r", &[n], WireDType::I8Block, data);
                let checked = t.check();
                let values = t.to_f32();
                assert_eq!(checked.is_ok(), values.is_ok(), "{n} + {extra}");
                if len != right {
                    assert!(matches!(checked, Err(TensorError::Size { .. })));
                }
                if let Ok(values) = values {
                    assert!(values.iter().all(|v| v.is_finite()));
                    assert_eq!(values.len(), n);
                }
            }
        }
    }

    #[test]
    fn int8_is_spelled_int8_in_the_job_file_and_keeps_its_place_on_the_wire() {
        let text = serde_json::to_string(&WireDType::I8Block).unwrap();
        assert_eq!(text, "\"int8\"");
        assert_eq!(WireDType::I8Block.as_str(), "int8");
        let back: WireDType = serde_json::from_str("\"int8\"").unwrap();
        assert_eq!(back, WireDType::I8Block);
        // A new variant goes last, so the others keep their postcard tags.
        assert_eq!(postcard::to_allocvec(&WireDType::I64).unwrap(), [3]);
        assert_eq!(postcard::to_allocvec(&WireDType::I8Block).unwrap(), [4]);
        assert!(WireDType::I8Block.is_float() && WireDType::I8Block.is_quantized());
    }
}
