//! How far two f32 evaluations of one computation may differ: bounds from
//! the magnitudes involved, the lengths of the reductions, and the accuracy
//! WGSL promises for its approximate functions, instead of a tolerance tuned
//! on one machine.
//!
//! Floating-point addition is not associative, so our kernels (summing in
//! the order their workgroups do, with whatever vector width the driver
//! uses: lavapipe's follows the host CPU) and libtorch (in its blocked
//! order) both round differently from the exact result, and from each
//! other. The classical bounds (Higham, *Accuracy and Stability of
//! Numerical Algorithms*, ch. 3) say by how much at most:
//! - a sum or dot product of `n` terms computed in any order is within
//!   `gamma(n) * sum |a_i * b_i|` of the exact value;
//! - a function WGSL computes to within `k` ULPs is within `k * 2u` of the
//!   exact value, relative to the result (u = 2^-24 is half an ULP at 1);
//! - two results each within `e` of the exact value are within `2e` of each
//!   other.
//!
//! An [`ErrorBound`] gathers these for one computation; tests build it from
//! the computation's reductions and functions and check every element of
//! its result with [`ErrorBound::check`].

// WGSL's stated accuracy lives with the kernels, whose own checks are
// bounded by it too.
pub use rookery_kernels::accuracy::{
    DIVISION_ULPS as WGSL_DIVISION_ULPS, INVERSE_SQRT_ULPS as WGSL_INVERSE_SQRT_ULPS,
    U as F32_UNIT_ROUNDOFF, exp_ulps as wgsl_exp_ulps,
};

/// `gamma(n) = n u / (1 - n u)`: the relative error bound of a sum of `n`
/// terms (or a dot product of length `n`) in f32, whatever the order.
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * F32_UNIT_ROUNDOFF;
    assert!(nu < 0.5, "a reduction of {n} terms has no useful f32 bound");
    nu / (1.0 - nu)
}

/// How far the f32 value of `sum a_i * b_i` may be from the exact one.
pub fn dot_error(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "a dot product of two equal lengths");
    gamma(a.len()) * a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>()
}

/// A bound on the difference between two f32 evaluations of one
/// computation, relative to the magnitude each element is computed from:
/// `|got - want| <= relative * magnitude`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorBound {
    pub relative: f64,
}

impl ErrorBound {
    /// Exact: copies and permutations.
    pub const EXACT: Self = Self { relative: 0.0 };

    /// One evaluation's bound for a computation whose reductions add up
    /// `terms` terms along the way to each result (the lengths of the dot
    /// products, sums and means it chains), with `ulps` ULPs of WGSL's
    /// approximate functions (division, `inverseSqrt`, `exp`) on the way.
    pub fn of(terms: usize, ulps: f64) -> Self {
        Self {
            relative: gamma(terms.max(1)) + ulps * 2.0 * F32_UNIT_ROUNDOFF,
        }
    }

    /// Two evaluations, each within `self` of the exact value: within twice
    /// it of each other.
    pub fn between_two(self) -> Self {
        self.times(2.0)
    }

    /// `self` carried through a computation that multiplies errors by at
    /// most `factor` (a Lipschitz constant, a number of repetitions whose
    /// errors add up).
    pub fn times(self, factor: f64) -> Self {
        Self {
            relative: self.relative * factor,
        }
    }

    /// The largest difference allowed for an element computed from values
    /// of size `magnitude`.
    pub fn allowed(self, magnitude: f64) -> f64 {
        self.relative * magnitude
    }

    /// Checks `got` against `want` element by element, each against the
    /// magnitude its element is computed from; `what` names the
    /// computation in the failure, which shows the bound it broke.
    pub fn check(self, got: &[f64], want: &[f64], magnitudes: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths differ");
        assert_eq!(got.len(), magnitudes.len(), "{what}: one magnitude each");
        for (i, ((g, w), m)) in got.iter().zip(want).zip(magnitudes).enumerate() {
            let err = (g - w).abs();
            let allowed = self.allowed(*m);
            assert!(
                err <= allowed,
                "{what}[{i}]: got {g}, want {w} (error {err:e} > {allowed:e}, \
                 {:.3e} of the magnitude {m:e})\n got {got:?}\nwant {want:?}",
                self.relative
            );
        }
    }
}

/// The magnitude each element of a tensor is computed from, when its
/// computation mixes all of the tensor's scale into every element (a
/// normalisation, a reduction whose terms are about as large as its
/// results): its own size or the tensor's largest, whichever is larger.
pub fn tensor_magnitudes(values: &[f64]) -> Vec<f64> {
    let largest = values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    values.iter().map(|v| v.abs().max(largest)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dot_products_f32_error_stays_within_its_bound() {
        let a: Vec<f64> = crate::pseudo(1000, 1).into_iter().map(f64::from).collect();
        let b: Vec<f64> = crate::pseudo(1000, 2).into_iter().map(f64::from).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        let f32_sum: f32 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f32) * (*y as f32))
            .sum();
        let bound = dot_error(&a, &b);
        assert!(
            (f64::from(f32_sum) - exact).abs() <= bound,
            "{f32_sum} {exact} {bound}"
        );
        // And the bound is no wild overestimate: within a few thousand
        // roundings of the terms' size.
        assert!(bound < 1e-3 * a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum::<f64>());
    }

    #[test]
    fn bounds_compose_and_check() {
        let one = ErrorBound::of(100, WGSL_DIVISION_ULPS);
        assert!((one.relative - (gamma(100) + 5.0 * F32_UNIT_ROUNDOFF)).abs() < 1e-15);
        let two = one.between_two();
        assert_eq!(two.allowed(3.0), 2.0 * one.allowed(3.0));
        two.check(&[1.0, -2.0], &[1.0, -2.0], &[1.0, 2.0], "equal");
        assert_eq!(tensor_magnitudes(&[0.5, -4.0]), vec![4.0, 4.0]);
        assert_eq!(wgsl_exp_ulps(-2.0), 7.0);
        ErrorBound::EXACT.check(&[0.25], &[0.25], &[0.0], "exact");
    }

    #[test]
    #[should_panic(expected = "error")]
    fn a_difference_beyond_the_bound_fails() {
        ErrorBound::of(10, 0.0).check(&[1.001], &[1.0], &[1.0], "far");
    }
}
