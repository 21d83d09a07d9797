//! Blockwise int8, the wire's `I8Block` (`rookery_proto::tensor`), made and
//! read on the device, so a stage reads back and uploads the packed bytes
//! (about 0.27 of f32's) instead of f32 values.
//!
//! The payload of `n` values is `ceil(n / 64)` little-endian f32 scales
//! (each block's absmax; a block holding a value that is not finite gets a
//! NaN scale and zeros, which every receiver refuses), then the `n` i8
//! values `q = round(v / scale * 127)` (half away from zero) in
//! -127..=127, read back as `q * (scale / 127)`. On the device the payload
//! is `u32` words holding exactly those bytes in order (four values a word,
//! the first in the low byte; the last word zero-padded), so the bytes read
//! back are the payload.
//!
//! [`Int8Block::quantize_reference`] and [`Int8Block::dequantize_reference`]
//! are the wire's own encoder and decoder, bit for bit. The kernels match
//! them as far as WGSL lets them:
//! - the scales exactly: the absmax is a maximum of the values' magnitude
//!   bits (positive floats order as their bits), exact, whatever the
//!   device does with subnormals;
//! - each value's level may be one off where `v / scale * 127` lies within
//!   WGSL's division error of a half-integer ([`level_window`]): the kernel
//!   divides values and scales brought exactly (by powers of two, in
//!   integer arithmetic) into the range where WGSL states the division's
//!   accuracy, so subnormals and scales near `f32::MAX` round as any
//!   others;
//! - decoded values within [`Int8Block::dequantize_bounds`] of the
//!   reference's: a division by 127 (the scale likewise brought into
//!   `[1, 2)` first), a product, and a device's flushing of subnormal
//!   results to zero.

use crate::accuracy::{DIV, SAFETY, Tracked, U};
use crate::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, declare, flat_index_wgsl, kinds};

/// Values per block, each block sharing one scale (the wire's `INT8_BLOCK`).
pub const BLOCK: usize = 64;

/// The bits of the NaN scale of a block holding a value that is not finite
/// (Rust's `f32::NAN`, as the wire's encoder writes it).
pub const NAN_SCALE: u32 = 0x7fc0_0000;

/// Largest level magnitude; -128 never occurs.
const LEVELS: f32 = 127.0;

/// Quantization of `len` f32 values into the wire's blockwise int8, and
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Int8Block {
    pub len: usize,
}

/// Splits a positive finite non-zero f32's bits into a significand in
/// `[2^23, 2^24)` and an exponent, `value = significand * 2^(exponent -
/// 23)`; subnormals are normalised, in integer arithmetic.
const SPLIT_WGSL: &str = "\
fn split(bits: u32) -> vec2<i32> {
    let field = bits >> 23u;
    let mantissa = bits & 0x7fffffu;
    if (field == 0u) {
        let shift = 23u - firstLeadingBit(mantissa);
        return vec2<i32>(i32(mantissa << shift), -126 - i32(shift));
    }
    return vec2<i32>(i32(mantissa | 0x800000u), i32(field) - 127);
}
";

/// The level of the value of bits `v` in a block of scale bits `s` (finite,
/// non-zero), as its two's-complement byte. `|v| <= s`, so the value's
/// exponent is at most the scale's; both are brought by the same power of
/// two to the scale's in `[1, 2)`, exactly (a value 2^9 or more below the
/// scale has level 0 however it rounds).
const LEVEL_WGSL: &str = "\
fn level(v: u32, s: u32) -> u32 {
    let magnitude = v & 0x7fffffffu;
    if (magnitude == 0u) { return 0u; }
    let sv = split(magnitude);
    let ss = split(s);
    let d = sv.y - ss.y;
    if (d < -8) { return 0u; }
    let vn = bitcast<f32>((u32(d + 127) << 23u) | (u32(sv.x) & 0x7fffffu));
    let sn = bitcast<f32>((u32(ss.x) & 0x7fffffu) | 0x3f800000u);
    let t = vn / sn * 127.0;
    var r = floor(t);
    if (t - r >= 0.5) { r = r + 1.0; }
    let q = u32(min(r, 127.0));
    return select(q, (256u - q) & 0xffu, (v & 0x80000000u) != 0u);
}
";

impl Int8Block {
    pub fn new(len: usize) -> Self {
        Self { len }
    }

    /// Blocks, and so scales.
    pub fn blocks(&self) -> usize {
        self.len.div_ceil(BLOCK)
    }

    /// Bytes of the payload: the scales, then a byte per value.
    pub fn payload_bytes(&self) -> usize {
        4 * self.blocks() + self.len
    }

    /// `u32` words holding the payload on the device.
    pub fn payload_words(&self) -> usize {
        self.payload_bytes().div_ceil(4)
    }

    /// Words of values (four values each), after the scales' words.
    fn value_words(&self) -> usize {
        self.len.div_ceil(4)
    }

    /// Bindings `x` (the f32 values, bound as their `u32` bits) and
    /// `packed` (`payload_words` words). Each invocation packs four
    /// values; a workgroup of 64 covers four whole blocks and finds each
    /// block's absmax with a workgroup atomic over the magnitudes' bits
    /// (those of infinities and NaNs are the largest, so a block holding one
    /// is known by its maximum).
    pub fn quantize(&self) -> KernelSpec {
        let wg = DEFAULT_WORKGROUP;
        let words = self.value_words();
        let bindings = [
            ("x", Binding::Read, "u32"),
            ("packed", Binding::ReadWrite, "u32"),
        ];
        let (len, blocks) = (self.len, self.blocks());
        let per_block = BLOCK / 4;
        let groups_per_wg = wg as usize / per_block;
        let index = flat_index_wgsl(words, wg);
        let wgsl = format!(
            "// int8_quantize: generated by rookery_kernels.\n{decls}\n{SPLIT_WGSL}\n{LEVEL_WGSL}\n\
             var<workgroup> absmax: array<atomic<u32>, {groups_per_wg}>;\n\n\
             @compute @workgroup_size({wg}, 1, 1)\n\
             fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n\
             \x20   let w = {index};\n\
             \x20   let slot = lid / {per_block}u;\n\
             \x20   if (lid < {groups_per_wg}u) {{ atomicStore(&absmax[lid], 0u); }}\n\
             \x20   workgroupBarrier();\n\
             \x20   var bits = vec4<u32>(0u, 0u, 0u, 0u);\n\
             \x20   for (var k = 0u; k < 4u; k = k + 1u) {{\n\
             \x20       let e = 4u * w + k;\n\
             \x20       if (e < {len}u) {{\n\
             \x20           bits[k] = x[e];\n\
             \x20           atomicMax(&absmax[slot], bits[k] & 0x7fffffffu);\n\
             \x20       }}\n\
             \x20   }}\n\
             \x20   workgroupBarrier();\n\
             \x20   let m = atomicLoad(&absmax[slot]);\n\
             \x20   let finite = m < 0x7f800000u;\n\
             \x20   let b = w / {per_block}u;\n\
             \x20   if (w % {per_block}u == 0u && b < {blocks}u) {{\n\
             \x20       packed[b] = select({nan}u, m, finite);\n\
             \x20   }}\n\
             \x20   if (w < {words}u) {{\n\
             \x20       var word = 0u;\n\
             \x20       if (finite && m != 0u) {{\n\
             \x20           for (var k = 0u; k < 4u; k = k + 1u) {{\n\
             \x20               if (4u * w + k < {len}u) {{ word = word | (level(bits[k], m) << (8u * k)); }}\n\
             \x20           }}\n\
             \x20       }}\n\
             \x20       packed[{blocks}u + w] = word;\n\
             \x20   }}\n}}\n",
            decls = declare(&bindings),
            nan = NAN_SCALE,
        );
        KernelSpec {
            label: "int8_quantize".into(),
            wgsl,
            entry: "main",
            bindings: kinds(&bindings),
            workgroups: crate::spec::linear_groups(words, wg),
        }
    }

    /// Bindings `packed` (a checked payload: finite non-negative scales, no
    /// -128) and `y` (`len` f32 values). Each invocation unpacks four
    /// values.
    pub fn dequantize(&self) -> KernelSpec {
        let wg = DEFAULT_WORKGROUP;
        let words = self.value_words();
        let bindings = [
            ("packed", Binding::Read, "u32"),
            ("y", Binding::ReadWrite, "f32"),
        ];
        let (len, blocks) = (self.len, self.blocks());
        let per_block = BLOCK / 4;
        let index = flat_index_wgsl(words, wg);
        let wgsl = format!(
            "// int8_dequantize: generated by rookery_kernels.\n{decls}\n{SPLIT_WGSL}\n\
             @compute @workgroup_size({wg}, 1, 1)\n\
             fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n\
             \x20   let w = {index};\n\
             \x20   if (w >= {words}u) {{ return; }}\n\
             \x20   let s = packed[w / {per_block}u];\n\
             \x20   let word = packed[{blocks}u + w];\n\
             \x20   var step = 0.0;\n\
             \x20   var e = 0;\n\
             \x20   if (s != 0u) {{\n\
             \x20       let ss = split(s);\n\
             \x20       step = bitcast<f32>((u32(ss.x) & 0x7fffffu) | 0x3f800000u) / 127.0;\n\
             \x20       e = ss.y;\n\
             \x20   }}\n\
             \x20   for (var k = 0u; k < 4u; k = k + 1u) {{\n\
             \x20       let i = 4u * w + k;\n\
             \x20       if (i < {len}u) {{\n\
             \x20           let q = i32(word << (24u - 8u * k)) >> 24u;\n\
             \x20           y[i] = ldexp(f32(q) * step, e);\n\
             \x20       }}\n\
             \x20   }}\n}}\n",
            decls = declare(&bindings),
        );
        KernelSpec {
            label: "int8_dequantize".into(),
            wgsl,
            entry: "main",
            bindings: kinds(&bindings),
            workgroups: crate::spec::linear_groups(words, wg),
        }
    }

    /// The payload of `x` (its first `len` values), exactly as the wire's
    /// encoder writes it.
    pub fn quantize_reference(&self, x: &[f32]) -> Vec<u8> {
        let x = &x[..self.len.min(x.len())];
        let blocks = self.blocks();
        let mut out = vec![0u8; self.payload_bytes()];
        let (scales, levels) = out.split_at_mut(4 * blocks);
        for ((block, scale_bytes), q) in x
            .chunks(BLOCK)
            .zip(scales.chunks_exact_mut(4))
            .zip(levels.chunks_mut(BLOCK))
        {
            let scale = scale_of(block);
            scale_bytes.copy_from_slice(&scale.to_le_bytes());
            if scale > 0.0 {
                for (q, v) in q.iter_mut().zip(block) {
                    *q = ((v / scale * LEVELS).round().clamp(-LEVELS, LEVELS) as i8) as u8;
                }
            }
        }
        out
    }

    /// The values of a payload, exactly as the wire's decoder reads them.
    pub fn dequantize_reference(&self, payload: &[u8]) -> Vec<f32> {
        let (scales, levels) = payload.split_at((4 * self.blocks()).min(payload.len()));
        scales
            .chunks_exact(4)
            .zip(levels[..self.len.min(levels.len())].chunks(BLOCK))
            .flat_map(|(scale, block)| {
                let step = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]) / LEVELS;
                block.iter().map(move |&q| f32::from(q as i8) * step)
            })
            .collect()
    }

    /// How far the dequantize kernel's value of each element of `payload`
    /// may be from the reference's: WGSL's division by 127 and a rounded
    /// product (with [`SAFETY`] for fusing), plus [`FLUSH`] where a device
    /// flushes a subnormal result to zero.
    pub fn dequantize_bounds(&self, payload: &[u8]) -> Vec<f32> {
        let (scales, levels) = payload.split_at((4 * self.blocks()).min(payload.len()));
        scales
            .chunks_exact(4)
            .zip(levels[..self.len.min(levels.len())].chunks(BLOCK))
            .flat_map(|(scale, block)| {
                let s = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                block.iter().map(move |&q| dequantize_bound(q as i8, s))
            })
            .collect()
    }

    /// Whether `got`, a payload the quantize kernel made of `x`, is one the
    /// kernel may make: the reference's length and scales exactly, and each
    /// level the reference's or, where [`level_window`] allows, one off
    /// it, never -128. The error names the first difference.
    pub fn check_payload(&self, x: &[f32], got: &[u8]) -> Result<(), String> {
        let want = self.quantize_reference(x);
        if got.len() != want.len() {
            return Err(format!(
                "{} payload bytes where the wire has {}",
                got.len(),
                want.len()
            ));
        }
        let split = 4 * self.blocks();
        if let Some(b) =
            (0..self.blocks()).find(|b| got[4 * b..4 * b + 4] != want[4 * b..4 * b + 4])
        {
            let word =
                |p: &[u8]| u32::from_le_bytes([p[4 * b], p[4 * b + 1], p[4 * b + 2], p[4 * b + 3]]);
            return Err(format!(
                "scale of block {b} has bits {:#010x}, the reference {:#010x}",
                word(got),
                word(&want)
            ));
        }
        for (i, (&g, &w)) in got[split..].iter().zip(&want[split..]).enumerate() {
            let (g, w) = (g as i8, w as i8);
            if g == w {
                continue;
            }
            let scale = scale_of(&x[i / BLOCK * BLOCK..((i / BLOCK + 1) * BLOCK).min(self.len)]);
            let t = exact_level(x[i], scale);
            if g == i8::MIN
                || (i16::from(g) - i16::from(w)).abs() > 1
                || !may_be_one_off(x[i], scale)
            {
                return Err(format!(
                    "value {i} ({:e}, level {t} of scale {scale:e}) is level {g}, the reference {w} (one off allowed only within {:e} of a half)",
                    x[i],
                    level_window(t)
                ));
            }
        }
        Ok(())
    }

    /// How far the wire's decoding of a payload the quantize kernel made of
    /// `x` may be from `x` itself: half a step (the block's absmax / 254),
    /// the level's [`level_window`] in steps, the roundings of the step and
    /// of the product, and [`FLUSH`].
    pub fn wire_bounds(&self, x: &[f32]) -> Vec<f32> {
        x[..self.len]
            .chunks(BLOCK)
            .flat_map(|block| {
                let scale = scale_of(block);
                let s = f64::from(scale);
                block.iter().map(move |&v| {
                    let window = level_window(exact_level(v, scale));
                    (s / 254.0 + s / 127.0 * window + 4.0 * U * s + FLUSH) as f32
                })
            })
            .collect()
    }

    /// How far the dequantize kernel's values of the quantize kernel's
    /// payload of `x` may be from the reference's decoding of its own: a
    /// step more where [`check_payload`](Self::check_payload) allows the
    /// level to be one off, and the decoding's own bound at the larger
    /// level.
    pub fn round_trip_bounds(&self, x: &[f32]) -> Vec<f32> {
        let payload = self.quantize_reference(x);
        let levels = &payload[4 * self.blocks()..];
        x[..self.len]
            .chunks(BLOCK)
            .zip(levels.chunks(BLOCK))
            .flat_map(|(block, levels)| {
                let scale = scale_of(block);
                block.iter().zip(levels).map(move |(&v, &q)| {
                    let q = q as i8;
                    if may_be_one_off(v, scale) {
                        // The reference's step, rounded up, and the decoding
                        // at the larger of the two levels.
                        let step = (f64::from(scale) / 127.0 * (1.0 + 4.0 * U)) as f32;
                        let wider = (q.unsigned_abs() + 1).min(127) as i8;
                        step + dequantize_bound(wider, scale)
                    } else {
                        dequantize_bound(q, scale)
                    }
                })
            })
            .collect()
    }
}

/// A payload's bytes as the `u32` words a device buffer holds (the last
/// zero-padded).
pub fn to_words(payload: &[u8]) -> Vec<u32> {
    payload
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The first `bytes` bytes of a device buffer's words: the payload.
pub fn from_words(words: &[u32], bytes: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(bytes);
    out
}

/// Whether the level of `v` in a block of scale `scale` may be one off the
/// reference's on a device: `v / scale * 127` lies within
/// [`level_window`] of a half-integer.
fn may_be_one_off(v: f32, scale: f32) -> bool {
    let t = exact_level(v, scale);
    scale > 0.0 && (t.abs().fract() - 0.5).abs() <= level_window(t)
}

/// A block's scale as the wire's encoder finds it: its absmax, or NaN when
/// a value is not finite.
fn scale_of(block: &[f32]) -> f32 {
    if block.iter().all(|v| v.is_finite()) {
        block.iter().fold(0.0f32, |m, v| m.max(v.abs()))
    } else {
        f32::NAN
    }
}

/// `v / scale * 127` in f64, exact to far below an f32's rounding (0 for a
/// zero, or a non-finite, scale).
fn exact_level(v: f32, scale: f32) -> f64 {
    if scale > 0.0 && scale.is_finite() {
        f64::from(v) / f64::from(scale) * 127.0
    } else {
        0.0
    }
}

/// How close to a half-integer `t = v / scale * 127` must be for the
/// kernel's level to differ from the reference's. The device divides exact
/// operands (brought into `[1, 2)` by the same power of two) within WGSL's
/// division error and multiplies by 127 with one rounding ([`SAFETY`] for
/// a fused or reordered evaluation); the reference rounds each of the two
/// correctly. Both round half away from zero exactly, so their levels
/// differ only where a half lies between their two `t`s, each within its
/// error of the exact `t`.
pub fn level_window(t: f64) -> f64 {
    let t = t.abs();
    let device = SAFETY * (DIV + U) * t;
    let reference = 2.0 * U * t;
    device.max(reference) + f64::EPSILON * t
}

/// Subnormal results a device may flush to zero: anything below the
/// smallest normal f32.
pub const FLUSH: f64 = f32::MIN_POSITIVE as f64;

/// How far the kernel's decoded `q * (scale / 127)` may be from the
/// reference's: [`Tracked`]'s model of a division by 127 and a product,
/// for two evaluations, plus [`FLUSH`].
pub fn dequantize_bound(q: i8, scale: f32) -> f32 {
    let exact = Tracked::exact;
    let y = exact(f32::from(q)) * (exact(scale) / exact(127.0));
    (f64::from(y.between_two()) + FLUSH) as f32
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;
    use crate::checks::int8_values;

    #[test]
    fn shaders_validate_for_ragged_lengths() {
        for len in [1, 3, 4, 63, 64, 65, 257, 4097] {
            validate::spec(&Int8Block::new(len).quantize());
            validate::spec(&Int8Block::new(len).dequantize());
        }
    }

    #[test]
    fn payloads_are_scales_then_levels_in_whole_words() {
        let q = Int8Block::new(65);
        assert_eq!(
            (q.blocks(), q.payload_bytes(), q.payload_words()),
            (2, 73, 19)
        );
        let payload: Vec<u8> = (0..73).collect();
        let words = to_words(&payload);
        assert_eq!(words.len(), 19);
        assert_eq!(words[18], 72, "the last word zero-padded");
        assert_eq!(from_words(&words, 73), payload);
    }

    #[test]
    fn levels_round_half_away_from_zero_and_a_non_finite_block_gets_a_nan_scale() {
        let mut x = vec![127.0, 0.5, -0.5, 1.5, -126.5, 0.0];
        x.extend([1.0; 58]);
        x.extend([2.0, f32::INFINITY, 3.0]);
        let q = Int8Block::new(x.len());
        let p = q.quantize_reference(&x);
        assert_eq!(p[..4], 127f32.to_le_bytes());
        assert_eq!(p[4..8], NAN_SCALE.to_le_bytes());
        let levels: Vec<i8> = p[8..14].iter().map(|&b| b as i8).collect();
        assert_eq!(levels, [127, 1, -1, 2, -127, 0]);
        assert!(p[8 + 64..].iter().all(|&b| b == 0));
        let y = q.dequantize_reference(&p);
        assert_eq!(y[..4], [127.0, 1.0, -1.0, 2.0]);
        assert!(y[64..].iter().all(|v| v.is_nan()));
    }

    /// The quantize kernel's arithmetic in f32, its division's quotient
    /// moved `nudge` ULPs off the correctly rounded one (WGSL allows 2.5).
    fn emulate_level(v: f32, s: u32, nudge: i32) -> u8 {
        let split = |bits: u32| -> (u32, i32) {
            let (field, mantissa) = (bits >> 23, bits & 0x7f_ffff);
            if field == 0 {
                let shift = 23 - (31 - mantissa.leading_zeros());
                (mantissa << shift, -126 - shift as i32)
            } else {
                (mantissa | 0x80_0000, field as i32 - 127)
            }
        };
        let magnitude = v.to_bits() & 0x7fff_ffff;
        if magnitude == 0 {
            return 0;
        }
        let ((mv, ev), (ms, es)) = (split(magnitude), split(s));
        let d = ev - es;
        if d < -8 {
            return 0;
        }
        let vn = f32::from_bits((((d + 127) as u32) << 23) | (mv & 0x7f_ffff));
        let sn = f32::from_bits(0x3f80_0000 | (ms & 0x7f_ffff));
        let quotient = f32::from_bits((vn / sn).to_bits().wrapping_add_signed(nudge));
        let t = quotient * 127.0;
        let mut r = t.floor();
        if t - r >= 0.5 {
            r += 1.0;
        }
        let q = r.min(127.0) as i8;
        (if v.is_sign_negative() { -q } else { q }) as u8
    }

    fn emulate_quantize(x: &[f32], nudge: impl Fn(usize) -> i32) -> Vec<u8> {
        let q = Int8Block::new(x.len());
        let mut out = vec![0u8; q.payload_bytes()];
        let split = 4 * q.blocks();
        for (b, block) in x.chunks(BLOCK).enumerate() {
            let m = block
                .iter()
                .map(|v| v.to_bits() & 0x7fff_ffff)
                .max()
                .unwrap_or(0);
            let finite = m < 0x7f80_0000;
            let scale = if finite { m } else { NAN_SCALE };
            out[4 * b..4 * b + 4].copy_from_slice(&scale.to_le_bytes());
            for (k, &v) in block.iter().enumerate() {
                let i = b * BLOCK + k;
                if finite && m != 0 {
                    out[split + i] = emulate_level(v, m, nudge(i));
                }
            }
        }
        out
    }

    /// The dequantize kernel's arithmetic: the step `nudge` ULPs off, and
    /// subnormal results flushed to zero.
    fn emulate_dequantize(q: Int8Block, payload: &[u8], nudge: i32) -> Vec<f32> {
        let split = 4 * q.blocks();
        (0..q.len)
            .map(|i| {
                let b = i / BLOCK;
                let s = u32::from_le_bytes(payload[4 * b..4 * b + 4].try_into().unwrap());
                if s == 0 {
                    return 0.0;
                }
                let e = (s >> 23) as i32 - 127;
                let (sn, e) = if e == -127 {
                    let m = s & 0x7f_ffff;
                    let shift = 23 - (31 - m.leading_zeros()) as i32;
                    (
                        f32::from_bits(0x3f80_0000 | ((m << shift) & 0x7f_ffff)),
                        -126 - shift,
                    )
                } else {
                    (f32::from_bits(0x3f80_0000 | (s & 0x7f_ffff)), e)
                };
                let step = f32::from_bits((sn / 127.0).to_bits().wrapping_add_signed(nudge));
                let y = (f32::from(payload[split + i] as i8) * step) as f64 * 2f64.powi(e);
                if y.abs() < FLUSH { 0.0 } else { y as f32 }
            })
            .collect()
    }

    #[test]
    fn an_emulated_device_at_wgsls_division_slack_stays_within_every_bound() {
        let mut one_off = 0;
        for (len, seed) in [(1, 1), (63, 2), (64, 3), (65, 4), (4097, 5), (20_000, 6)] {
            let x = int8_values(len, seed);
            let q = Int8Block::new(len);
            let want = q.dequantize_reference(&q.quantize_reference(&x));
            let (round_trip, wire) = (q.round_trip_bounds(&x), q.wire_bounds(&x));
            for nudge in -2..=2 {
                let got = emulate_quantize(&x, |i| if i % 2 == 0 { nudge } else { -nudge });
                q.check_payload(&x, &got).unwrap();
                one_off += got
                    .iter()
                    .zip(q.quantize_reference(&x))
                    .filter(|(g, w)| *g != w)
                    .count();
                let decoded = q.dequantize_reference(&got);
                let on_device = emulate_dequantize(q, &got, nudge);
                let deq = q.dequantize_bounds(&got);
                for i in 0..len {
                    let near =
                        |a: f32, b: f32, bound: f32| f64::from((a - b).abs()) <= f64::from(bound);
                    assert!(
                        near(on_device[i], decoded[i], deq[i]),
                        "dequantized {i} of {len}"
                    );
                    assert!(
                        near(on_device[i], want[i], round_trip[i]),
                        "round trip {i} of {len}"
                    );
                    assert!(
                        near(decoded[i], x[i], wire[i]),
                        "{i} of {len}: {} for {}",
                        decoded[i],
                        x[i]
                    );
                }
            }
        }
        assert!(
            one_off > 0,
            "the near-half values must make some level one off"
        );
    }

    #[test]
    fn a_level_off_away_from_a_half_or_a_wrong_scale_is_refused() {
        let x = int8_values(200, 9);
        let q = Int8Block::new(200);
        let good = q.quantize_reference(&x);
        q.check_payload(&x, &good).unwrap();
        let split = 4 * q.blocks();
        // A value whose level is far from any half.
        let i = (0..200)
            .find(|&i| {
                let s = scale_of(&x[i / BLOCK * BLOCK..((i / BLOCK + 1) * BLOCK).min(200)]);
                s > 0.0 && !may_be_one_off(x[i], s) && (good[split + i] as i8).abs() < 127
            })
            .unwrap();
        let mut bad = good.clone();
        bad[split + i] = (bad[split + i] as i8 + 1) as u8;
        assert!(
            q.check_payload(&x, &bad)
                .unwrap_err()
                .contains(&format!("value {i} "))
        );
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(
            q.check_payload(&x, &bad)
                .unwrap_err()
                .contains("scale of block 0")
        );
        assert!(q.check_payload(&x, &good[1..]).is_err());
    }
}
