//! Dropout masks drawn from a counter-based hash, the one definition the
//! libtorch executor (which multiplies by [`noise`]) and the WGSL kernel
//! ([`DropoutMask::forward`]) share, so any split of a batch into stages,
//! micro-batches and backends draws the same mask as one pass over the batch:
//!
//! - `key = mix(seed ^ mix(fnv1a(node name)))`: one stream per node and step;
//! - the element at sample `s` of a micro-batch whose first sample is
//!   `offset` in the step's batch, at flat position `j` within the sample, has
//!   the global index `g = (offset + s) * per_sample + j`;
//! - `u = (mix(key + (g + 1) * GOLDEN) >> 40) / 2^24` (the g-th output of a
//!   SplitMix64 generator seeded with `key`, exact in f32);
//! - the element is kept (multiplied by `1 / (1 - p)`) when `u >= p`, else 0.
//!
//! WGSL has no 64-bit integers; the kernel emulates them with `vec2<u32>`
//! (low, high) words.

use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, f32_lit, one_d};

/// SplitMix64's output function: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a, the same name hash `rookery_model::init` uses for parameter streams.
pub fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The stream of node `node` in the step of `seed`.
pub fn key(seed: u64, node: &str) -> u64 {
    mix(seed ^ mix(fnv1a(node)))
}

/// `1 / (1 - p)` as the libtorch executor scales kept elements: `1 - p`
/// computed in f64 from the decimal `p` was written as (the shortest one
/// that round-trips the f32, as Python's `p=0.1` gives ATen the double 0.1),
/// rounded to f32, then inverted in f32.
pub fn scale(p: f32) -> f32 {
    let p64: f64 = p.to_string().parse().unwrap_or(f64::from(p));
    1.0 / ((1.0 - p64) as f32)
}

/// The multipliers of `len` elements starting at global index `first`.
pub fn noise(key: u64, first: u64, len: usize, p: f32, scale: f32) -> Vec<f32> {
    (0..len as u64)
        .map(|j| {
            let g = first.wrapping_add(j);
            let h = mix(key.wrapping_add(g.wrapping_add(1).wrapping_mul(GOLDEN)));
            let u = (h >> 40) as f32 * (1.0 / (1u32 << 24) as f32);
            if u >= p { scale } else { 0.0 }
        })
        .collect()
}

/// Dropout of `len` elements with probability `p`, kept ones scaled by `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    pub len: usize,
    pub p: f32,
    pub scale: f32,
}

const U64_WGSL: &str = "\
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
fn mul32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu; let a1 = a >> 16u; let b0 = b & 0xffffu; let b1 = b >> 16u;
    let p00 = a0 * b0; let p01 = a0 * b1; let p10 = a1 * b0; let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return vec2<u32>((p00 & 0xffffu) | (mid << 16u), p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = mul32(a.x, b.x);
    return vec2<u32>(lo.x, lo.y + a.x * b.y + a.y * b.x);
}
fn shr64(a: vec2<u32>, n: u32) -> vec2<u32> {
    return vec2<u32>((a.x >> n) | (a.y << (32u - n)), a.y >> n);
}
fn mix64(z0: vec2<u32>) -> vec2<u32> {
    var z = mul64(z0 ^ shr64(z0, 30u), vec2<u32>(0x1ce4e5b9u, 0xbf58476du));
    z = mul64(z ^ shr64(z, 27u), vec2<u32>(0x133111ebu, 0x94d049bbu));
    return z ^ shr64(z, 31u);
}
";

impl DropoutMask {
    /// Bindings `args` (u32: key low, key high, first low, first high), `x`,
    /// `y = x * noise` and `noise` (the multipliers, kept for the backward).
    pub fn forward(&self) -> KernelSpec {
        let body = format!(
            "    let key = vec2<u32>(args[0], args[1]);\n\
             \x20   let g = add64(vec2<u32>(args[2], args[3]), vec2<u32>(i, 0u));\n\
             \x20   let h = mix64(add64(key, mul64(add64(g, vec2<u32>(1u, 0u)), vec2<u32>(0x7f4a7c15u, 0x9e3779b9u))));\n\
             \x20   let u = f32(h.y >> 8u) * {inv};\n\
             \x20   let m = select(0.0, {scale}, u >= {p});\n\
             \x20   noise[i] = m;\n    y[i] = x[i] * m;",
            inv = f32_lit(1.0 / (1u32 << 24) as f32),
            scale = f32_lit(self.scale),
            p = f32_lit(self.p),
        );
        one_d(
            "dropout_fwd",
            &[
                ("args", Binding::Read, "u32"),
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
                ("noise", Binding::ReadWrite, "f32"),
            ],
            U64_WGSL,
            self.len,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// CPU reference of [`Self::forward`]: `(y, noise)`.
    pub fn reference(&self, args: [u32; 4], x: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let key = u64::from(args[0]) | (u64::from(args[1]) << 32);
        let first = u64::from(args[2]) | (u64::from(args[3]) << 32);
        let m = noise(key, first, self.len, self.p, self.scale);
        let y = x.iter().zip(&m).map(|(x, m)| x * m).collect();
        (y, m)
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn dropout_shader_validates() {
        let d = DropoutMask {
            len: 37,
            p: 0.25,
            scale: scale(0.25),
        };
        validate::spec(&d.forward());
    }

    #[test]
    fn masks_are_pinned_and_keep_about_one_minus_p() {
        let k = key(7, "drop");
        let m = noise(k, 0, 4000, 0.3, scale(0.3));
        let kept = m.iter().filter(|&&v| v > 0.0).count();
        assert!((2650..2950).contains(&kept), "{kept} kept of 4000");
        // Pinned (computed independently, in Python): a change here would
        // break every checkpointed run's reproducibility.
        assert_eq!(k, 0xd15a_d266_ff94_712f);
        let pattern: String = m[..32]
            .iter()
            .map(|&v| if v > 0.0 { '1' } else { '0' })
            .collect();
        assert_eq!(pattern, "11011101011111100001011111110101");
        // The window at `first` is the tail of a longer mask from 0.
        assert_eq!(noise(k, 1000, 50, 0.3, scale(0.3)), m[1000..1050].to_vec());
    }
}
