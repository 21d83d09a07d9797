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

/// `log(x)` for `x` in `[0.5, 2]` is within this absolute error.
pub const LOG_ABSOLUTE: f64 = 1.0 / 2_097_152.0;

/// [`DIVISION_ULPS`] as a relative error.
pub const DIV: f64 = DIVISION_ULPS * ULP;

/// [`INVERSE_SQRT_ULPS`] as a relative error.
pub const INVERSE_SQRT: f64 = INVERSE_SQRT_ULPS * ULP;

/// `sqrt(x)`: inherited from `1.0 / inverseSqrt(x)`.
pub const SQRT: f64 = INVERSE_SQRT + DIV;

/// Error models here are first order (products of two errors are left
/// out, except in [`Tracked`]'s multiplication, where an operand may be
/// smaller than its own error, as `tanh` near 0 is), and a GPU may fuse a
/// multiply and an add into one rounding; this factor covers both.
pub const SAFETY: f64 = 2.0;

/// Worst-case error of adding `n` terms one after another in f32 whose
/// absolute values sum to `abs_total` (Higham's `gamma_(n-1)` bound, to
/// first order).
pub fn sum_error(n: usize, abs_total: f64) -> f64 {
    n.saturating_sub(1) as f64 * U * abs_total
}

/// Worst-case error of a workgroup sum of `n` terms whose absolute values
/// sum to `abs_total`: each of `threads` invocations adds every
/// `threads`-th term in turn, then a tree halves the partial sums. No term
/// passes through more than `ceil(n / threads) - 1 + log2(threads)`
/// roundings, far fewer than a sequential sum's `n - 1`.
pub fn workgroup_sum_error(n: usize, threads: usize, abs_total: f64) -> f64 {
    let threads = threads.max(1);
    let depth = n.div_ceil(threads).saturating_sub(1) + threads.ilog2() as usize;
    depth.min(n.saturating_sub(1)) as f64 * U * abs_total
}

/// A value computed in f32 with a bound on its distance from the exact
/// result (running error analysis, to first order): each operation adds
/// its own rounding or WGSL's stated accuracy to the errors its operands
/// carry, scaled by how much the operation amplifies them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tracked {
    /// The exact result, approximated in f64.
    pub value: f64,
    /// How far an f32 evaluation may be from it.
    pub error: f64,
}

impl Tracked {
    /// A value held exactly.
    pub fn exact(v: f32) -> Self {
        Self {
            value: f64::from(v),
            error: 0.0,
        }
    }

    /// A WGSL literal: the constant `c` rounded to the nearest f32.
    pub fn literal(c: f64) -> Self {
        Self {
            value: c,
            error: U * c.abs(),
        }
    }

    /// `abs` is exact, as are negation and `sign`.
    pub fn abs(self) -> Self {
        Self {
            value: self.value.abs(),
            error: self.error,
        }
    }

    /// The value an approximation (a polynomial standing for `erf`)
    /// computes, `within` of the function it stands for.
    pub fn approximating(self, within: f64) -> Self {
        Self {
            value: self.value,
            error: self.error + within,
        }
    }

    fn rounded(value: f64, error: f64, relative: f64) -> Self {
        Self {
            value,
            error: error + relative * value.abs(),
        }
    }

    /// `sqrt`: near zero the derivative bound is useless, and `|sqrt(x) -
    /// sqrt(y)| <= sqrt(|x - y|)` takes over.
    pub fn sqrt(self) -> Self {
        let value = self.value.max(0.0).sqrt();
        let propagated = if value > 0.0 {
            (self.error / (2.0 * value)).min(self.error.sqrt())
        } else {
            self.error.sqrt()
        };
        Self::rounded(value, propagated, SQRT)
    }

    /// `exp`: the operand's error grows by the derivative, `exp(x)`; WGSL
    /// allows `3 + 2 |x|` ULPs.
    pub fn exp(self) -> Self {
        let value = self.value.exp();
        Self::rounded(value, value * self.error, exp_ulps(self.value) * ULP)
    }

    /// `log` (natural): the operand's error divided by `x`; WGSL allows an
    /// absolute `2^-21` for `x` in `[0.5, 2]` and 3 ULPs elsewhere.
    pub fn ln(self) -> Self {
        let value = self.value.ln();
        let propagated = self.error / self.value.abs();
        if (0.5..=2.0).contains(&self.value) {
            Self {
                value,
                error: propagated + LOG_ABSOLUTE,
            }
        } else {
            Self::rounded(value, propagated, 3.0 * ULP)
        }
    }

    /// `max`: exact, so only the operands' errors.
    pub fn max(self, other: Self) -> Self {
        Self {
            value: self.value.max(other.value),
            error: self.error.max(other.error),
        }
    }

    /// How far two f32 evaluations (the kernel's and the reference's), each
    /// within `error` of the exact value, may be from each other.
    pub fn between_two(self) -> f32 {
        (SAFETY * 2.0 * self.error) as f32
    }
}

impl std::ops::Neg for Tracked {
    type Output = Self;
    fn neg(self) -> Self {
        Self {
            value: -self.value,
            error: self.error,
        }
    }
}

impl std::ops::Add for Tracked {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self::rounded(self.value + o.value, self.error + o.error, U)
    }
}

impl std::ops::Sub for Tracked {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self::rounded(self.value - o.value, self.error + o.error, U)
    }
}

impl std::ops::Mul for Tracked {
    type Output = Self;
    /// The product of the two errors is kept: it is what is left where both
    /// operands are smaller than their errors (`t * t` for a `t = tanh(x)`
    /// computed near 0, whose error dwarfs it).
    fn mul(self, o: Self) -> Self {
        let error = self.value.abs() * o.error + o.value.abs() * self.error + self.error * o.error;
        Self::rounded(self.value * o.value, error, U)
    }
}

impl std::ops::Div for Tracked {
    type Output = Self;
    fn div(self, o: Self) -> Self {
        let value = self.value / o.value;
        let error = (self.error + value.abs() * o.error) / o.value.abs();
        Self::rounded(value, error, DIV)
    }
}
