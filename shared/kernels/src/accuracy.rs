//! WGSL's stated accuracy for f32 (the WGSL specification, "Floating Point
//! Accuracy"), as relative error bounds, so a kernel's tolerance is composed
//! from the operations it does rather than read off one machine's results.
//! Real GPUs use all of the slack the specification allows (division and
//! `inverseSqrt` are approximations there), while lavapipe and SwiftShader
//! mostly round correctly, so a tolerance fitted to CI's results fails on
//! donors' cards.

/// Unit roundoff of f32: `+`, `-` and `*` are correctly rounded, so each
/// is off by at most this much relative to its exact result (half an ULP
/// at 1, 2^-24).
pub const U: f64 = 1.0 / 16_777_216.0;

/// One ULP of an f32, relative to the value (at most `2 U`).
pub const ULP: f64 = 2.0 * U;

/// `x / y` is within this many ULPs (for `|y|` in `[2^-126, 2^126]`).
pub const DIVISION_ULPS: f64 = 2.5;

/// `inverseSqrt(x)` is within this many ULPs.
pub const INVERSE_SQRT_ULPS: f64 = 2.0;

/// `exp(x)` is within `3 + 2 |x|` ULPs.
pub fn exp_ulps(x: f64) -> f64 {
    3.0 + 2.0 * x.abs()
}

/// [`DIVISION_ULPS`] as a relative error.
pub const DIV: f64 = DIVISION_ULPS * ULP;

/// [`INVERSE_SQRT_ULPS`] as a relative error.
pub const INVERSE_SQRT: f64 = INVERSE_SQRT_ULPS * ULP;

/// Error models here are first order (products of two errors are left
/// out), and a GPU may fuse a multiply and an add into one rounding; this
/// factor covers both.
pub const SAFETY: f64 = 2.0;

/// Worst-case error of adding `n` terms one after another in f32 whose
/// absolute values sum to `abs_total` (Higham's `gamma_(n-1)` bound, to
/// first order).
pub fn sum_error(n: usize, abs_total: f64) -> f64 {
    n.saturating_sub(1) as f64 * U * abs_total
}
