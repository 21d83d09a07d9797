//! Mixed precision for the matrix products (a job's `precision = "mixed"`):
//! both operands of every GEMM enter its multiply-adds rounded to f16, the
//! sums accumulate in f32, and everything else (weights and their master
//! copy, optimizer state, activations between kernels, every other op)
//! stays f32. Every executor rounds the same way, to nearest with ties to
//! even, with exact operations only ([`round_f16`], [`ROUND_HALF_WGSL`]), so
//! the operands are the same everywhere and results differ only by f32
//! accumulation order. On adapters with cooperative matrices (tensor cores)
//! the rounded operands are staged as f16 and multiplied there; elsewhere
//! (browsers, CPUs, lavapipe) the rounded values stay in f32. How far the
//! result is from the f32 product is [`MixedBound`].
//!
//! A gradient operand is multiplied by [`GRAD_SCALE`] before it is rounded
//! and the sum divided by it after (both exact: powers of two), a static
//! loss scale: a step's gradients are small (a mean over many targets), and
//! f16's normal range starts at 6.1e-5.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

/// How the matrix products of a stage compute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 operands, f32 accumulation.
    #[default]
    F32,
    /// f16 operands, f32 accumulation.
    Mixed,
}

impl Precision {
    /// What a check's or a benchmark's name adds for this precision:
    /// nothing for f32, ` mixed` for mixed.
    pub fn mark(self) -> &'static str {
        match self {
            Precision::F32 => "",
            Precision::Mixed => " mixed",
        }
    }
}

/// Which operand of a GEMM is a gradient (scaled by [`GRAD_SCALE`] under
/// [`Precision::Mixed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

/// The factor a gradient operand is multiplied by before rounding to f16:
/// gradients from 6e-8 to 64 keep f16's full relative precision; larger
/// elements are clamped to 64.
pub const GRAD_SCALE: f32 = 1024.0;

/// The largest finite f16.
pub const F16_MAX: f32 = 65_504.0;

/// `v` rounded to the nearest f16 (ties to even), clamped to f16's finite
/// range, subnormals kept: what [`ROUND_HALF_WGSL`] computes on a GPU.
pub fn round_f16(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    let v = v.clamp(-F16_MAX, F16_MAX);
    // f16 keeps 10 fraction bits; below 2^-14 its spacing stays 2^-24.
    let exp = (((v.to_bits() >> 23) & 0xff) as i32 - 127).max(-14);
    let quantum = 2f32.powi(exp - 10);
    // Both divisions by a power of two are exact.
    (v / quantum).round_ties_even() * quantum
}

/// WGSL of `fn round_half(v: f32) -> f32`, [`round_f16`] on a GPU. WGSL's
/// own conversion to f16 may round either way and needs `shader-f16`, and
/// `pack2x16float` is missing on some drivers (wgpu's
/// `SHADER_F16_IN_F32`). Here `v` is scaled by a power of two so that f16's
/// last place is 1, rounded (`round` ties to even), and scaled back: every
/// step exact. The powers are built from their bits: `ldexp` cost more than
/// the whole rest on an H100 (a mixed GEMM ran at half the f32 one's speed).
pub const ROUND_HALF_WGSL: &str = "fn round_half(v: f32) -> f32 {
    let c = clamp(v, -65504.0, 65504.0);
    let e = max((bitcast<u32>(c) >> 23u) & 0xffu, 113u);
    return round(c * bitcast<f32>((264u - e) << 23u)) * bitcast<f32>((e - 10u) << 23u);
}
";

/// `v` as a mixed-precision GEMM sees it: scaled, rounded to f16, scaled
/// back.
pub fn round_operand(v: &[f32], scale: f32) -> Vec<f32> {
    v.iter().map(|&x| round_f16(x * scale) / scale).collect()
}

/// `v` as a GEMM of `precision` multiplies it: itself in f32, else
/// [`round_operand`] with `scale` ([`GRAD_SCALE`] for a gradient).
pub fn operand(precision: Precision, v: &[f32], scale: f32) -> std::borrow::Cow<'_, [f32]> {
    match precision {
        Precision::F32 => std::borrow::Cow::Borrowed(v),
        Precision::Mixed => std::borrow::Cow::Owned(round_operand(v, scale)),
    }
}

/// How far a mixed-precision GEMM output may be from the exact product of
/// its f32 operands, beyond f32 accumulation ([`super::gemm_tol`]):
/// `rel * sum |a_i b_i| + abs_per_term * k`.
///
/// Each operand is rounded to its nearest f16: a relative error of at most
/// 2^-11 for normal values, or an absolute one of at most 2^-25 (half the
/// subnormals' spacing) over its scale. A product of two such operands is
/// off by at most `(2 * 2^-11 + 2^-22) |a b|` plus the absolute errors
/// times the other operand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixedBound {
    pub rel: f64,
    pub abs_per_term: f64,
}

impl MixedBound {
    /// The bound for operands no larger than `a_max` and `b_max` in
    /// magnitude, with scales `scale_a` and `scale_b`.
    pub fn new(a_max: f32, b_max: f32, scale_a: f32, scale_b: f32) -> Self {
        let unit = 2f64.powi(-11);
        let subnormal = 2f64.powi(-25);
        let (da, db) = (
            subnormal / f64::from(scale_a),
            subnormal / f64::from(scale_b),
        );
        let (a, b) = (f64::from(a_max), f64::from(b_max));
        Self {
            rel: 2.0 * unit + unit * unit,
            abs_per_term: a * db + b * da + da * db,
        }
    }

    /// Per-output bounds, from each output's `sum |a_i b_i|` (the reference
    /// product of the operands' magnitudes) and its `k` terms.
    pub fn per_output(&self, sum_abs: &[f32], k: usize) -> Vec<f32> {
        sum_abs
            .iter()
            .map(|&s| (self.rel * f64::from(s) + self.abs_per_term * k as f64) as f32)
            .collect()
    }
}

/// Magnitudes of `v`, for the `sum |a_i b_i|` of [`MixedBound::per_output`].
pub fn magnitudes(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| x.abs()).collect()
}

/// The largest magnitude in `v`.
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

static TENSOR_CORES: AtomicBool = AtomicBool::new(false);

thread_local! {
    static FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether [`Precision::Mixed`] GEMMs are generated in their tensor-core
/// form: what [`force_tensor_cores`] set on this thread, else whether this
/// process's adapter multiplies f16 tiles with cooperative matrices (set
/// when the GPU context opens one that has them).
pub fn tensor_cores() -> bool {
    FORCED
        .with(|f| f.get())
        .unwrap_or_else(|| TENSOR_CORES.load(Ordering::Relaxed))
}

/// Sets what [`tensor_cores`] says for the process: the GPU context, once
/// it has enabled them on its device.
pub fn set_tensor_cores(on: bool) {
    TENSOR_CORES.store(on, Ordering::Relaxed);
}

/// Makes [`tensor_cores`] say `on` on this thread (`None`: what the
/// process says): how a benchmark times both forms on one adapter, and
/// how tests generate either form without touching their neighbours.
pub fn force_tensor_cores(on: Option<bool>) {
    FORCED.with(|f| f.set(on));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_to_f16_matches_its_representable_values() {
        // Exactly representable values stay.
        for v in [
            0.0f32,
            1.0,
            -2.5,
            65_504.0,
            2f32.powi(-24),
            2f32.powi(-14),
            0.099_975_586,
        ] {
            assert_eq!(round_f16(v), v, "{v}");
        }
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to even.
        assert_eq!(round_f16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(
            round_f16(1.0 + 3.0 * 2f32.powi(-11)),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        assert_eq!(round_f16(1.0 + 2f32.powi(-12)), 1.0);
        assert_eq!(round_f16(0.1), 0.099_975_586);
        // Clamped to the finite range; subnormals on a 2^-24 grid.
        assert_eq!(round_f16(1e9), F16_MAX);
        assert_eq!(round_f16(-1e9), -F16_MAX);
        assert_eq!(round_f16(3.0 * 2f32.powi(-26)), 2f32.powi(-24));
        assert_eq!(round_f16(2f32.powi(-26)), 0.0);
        assert!(round_f16(f32::NAN).is_nan());
    }

    #[test]
    fn rounding_error_stays_within_half_a_unit_in_the_last_place() {
        let mut x = 1e-3f32;
        while x < 6e4 {
            let r = round_f16(x);
            assert!(
                (f64::from(r) - f64::from(x)).abs() <= f64::from(x) * 2f64.powi(-11),
                "{x} -> {r}"
            );
            x *= 1.000_37;
        }
    }

    #[test]
    fn gradients_are_scaled_into_the_normal_range() {
        let g = [1e-7f32, -1e-6, 2.5e-5];
        for (&v, r) in g.iter().zip(round_operand(&g, GRAD_SCALE)) {
            assert!((r - v).abs() <= v.abs() * 2f32.powi(-11), "{v} -> {r}");
        }
        // Unscaled, the smallest would lose most of its bits.
        assert!((round_f16(1e-7) - 1e-7).abs() > 1e-7 * 0.1);
    }

    #[test]
    fn mixed_products_stay_within_the_stated_bound_of_the_f32_ones() {
        use crate::gemm::MatMul;
        // Operands spanning f16's normal range and below it (where the
        // absolute term counts), and gradients a mean loss would give.
        let (m, k, n) = (7, 300, 5);
        let wide = |len: usize, seed: u64| -> Vec<f32> {
            crate::sample_matrix(len, seed)
                .iter()
                .enumerate()
                .map(|(i, v)| v * 10f32.powi((i % 9) as i32 - 6))
                .collect()
        };
        let (a, b) = (wide(m * k, 1), wide(k * n, 2));
        let dc: Vec<f32> = crate::sample_matrix(m * n, 3)
            .iter()
            .map(|v| v * 1e-5)
            .collect();
        let exact = MatMul::new(&[m, k], &[k, n]).unwrap();
        let mixed = MatMul {
            precision: Precision::Mixed,
            ..exact.clone()
        };
        let (want, want_da, _) = exact.reference(&a, &b, &dc);
        let (got, got_da, _) = mixed.reference(&a, &b, &dc);
        let (sums, sums_da, _) =
            exact.reference(&magnitudes(&a), &magnitudes(&b), &magnitudes(&dc));
        let mut worst: f64 = 0.0;
        for (what, got, want, sums, bound, terms) in [
            (
                "c",
                &got,
                &want,
                &sums,
                MixedBound::new(max_abs(&a), max_abs(&b), 1.0, 1.0),
                k,
            ),
            (
                "da",
                &got_da,
                &want_da,
                &sums_da,
                MixedBound::new(max_abs(&dc), max_abs(&b), GRAD_SCALE, 1.0),
                n,
            ),
        ] {
            for ((g, w), allowed) in got.iter().zip(want).zip(bound.per_output(sums, terms)) {
                // f32 rounds the result once more.
                let allowed = f64::from(allowed) + f64::from(w.abs()) * 2f64.powi(-23);
                let error = (f64::from(*g) - f64::from(*w)).abs();
                assert!(
                    error <= allowed,
                    "{what}: {g} against {w}, allowed {allowed:e}"
                );
                worst = worst.max(error / allowed);
            }
        }
        // And the bound is no blanket: some output comes near it.
        assert!(worst > 0.2, "the largest error is {worst} of the bound");
    }
}
