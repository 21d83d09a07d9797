//! Checks of the blockwise int8 kernels: a payload quantized and dequantized
//! on the device against the wire's own encoding and decoding, and the
//! reference's payload dequantized on the device. The levels and scales
//! themselves are compared byte by byte in `tests/gpu_int8.rs`
//! ([`Int8Block::check_payload`]), which needs the payload's bytes rather
//! than f32 buffers.

use super::{Builder, Check};
use crate::int8::{BLOCK, Int8Block, to_words};
use crate::sample_matrix;

/// `len` values whose blocks take turns, by `seed`, at what the kernels must
/// get right: zeros (and negative zeros), values in `[-1, 1)`, values near
/// `2^127` and near `2^-120`, subnormals, blocks spanning 2^24 in magnitude
/// (levels of values far below the absmax), and values whose level lies
/// within an ULP or two of a half-integer. All finite.
pub fn int8_values(len: usize, seed: u64) -> Vec<f32> {
    let base = sample_matrix(len, seed);
    let kinds = sample_matrix(len.div_ceil(BLOCK), seed ^ 0x18);
    let mut x = Vec::with_capacity(len);
    for (b, block) in base.chunks(BLOCK).enumerate() {
        let kind = ((kinds[b] + 1.0) * 3.5) as usize;
        let at = x.len();
        x.extend(block.iter().enumerate().map(|(i, &v)| match kind {
            0 => {
                if i % 2 == 0 {
                    0.0
                } else {
                    -0.0
                }
            }
            1 => v,
            2 => v * 2f32.powi(126) * 1.99,
            3 => v * 2f32.powi(-120),
            4 => v * 2f32.powi(-130),
            5 => v * 2f32.powi(-((i % 25) as i32)),
            _ => v,
        }));
        if kind >= 6 {
            // A half-integer level, then nudged an ULP or two either way.
            let scale = x[at..].iter().fold(0.0f32, |m, v| m.max(v.abs())).max(0.5);
            x[at] = scale;
            for (i, v) in x[at..].iter_mut().enumerate().skip(1) {
                let level = (i % 127) as f32 + 0.5;
                let mut near = scale * level / 127.0 * v.signum();
                for _ in 0..(i % 3) {
                    near = f32::from_bits(near.to_bits() + 1);
                }
                *v = if near.abs() <= scale { near } else { -*v };
            }
        }
    }
    x
}

/// The values of [`int8_values`] quantized then dequantized on the device,
/// within [`Int8Block::round_trip_bounds`] of the wire's decoding of its
/// own encoding; and the wire's payload dequantized on the device, within
/// [`Int8Block::dequantize_bounds`].
pub fn int8(len: usize, seed: u64) -> Check {
    let q = Int8Block::new(len);
    let x = int8_values(len, seed);
    let payload = q.quantize_reference(&x);
    let want = q.dequantize_reference(&payload);
    let (round_trip, dequantized) = (q.round_trip_bounds(&x), q.dequantize_bounds(&payload));
    let mut c = Builder::default();
    let values = c.f32(x);
    let packed = c.zeros(q.payload_words());
    let y = c.zeros(len);
    let given = c.u32(to_words(&payload));
    let from_given = c.zeros(len);
    c.step(q.quantize(), [values, packed]);
    c.step(q.dequantize(), [packed, y]);
    c.step(q.dequantize(), [given, from_given]);
    c.expect_within("round trip", y, want.clone(), round_trip);
    c.expect_within("dequantized", from_given, want, dequantized);
    c.build(format!("int8[{len}]"))
}
