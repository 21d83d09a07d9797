//! The activations of `torch.nn` beyond ReLU, GELU, sigmoid and tanh, with
//! torch's formulas, defaults and behaviour at the kinks, forward and
//! backward: leaky ReLU, ELU, SELU, softplus, softsign, tanhshrink,
//! log-sigmoid, hardshrink, hardtanh, softshrink and threshold. (Softmin is
//! `softmax(-x)`, lowered by the stage from the existing kernels.)
//!
//! Each is a [`super::Unary::Activation`]: one elementwise kernel forward
//! and one backward, with parameters baked into the WGSL as exact f32 bit
//! patterns, a CPU reference in f64 rounded once, and its error bound
//! composed from WGSL's stated accuracy through the WGSL's own formula
//! ([`Activation::tracked`]). The comparisons at the kinks are torch's
//! (`x > 0` for leaky ReLU, `x <= 0` for ELU and SELU, `beta x > threshold`
//! for softplus, `-lambd <= x <= lambd` for the shrinks' zero band, `x <=
//! min_val || x >= max_val` for hardtanh's zero gradient, `x <= threshold`
//! for threshold), made on the same f32 values by the kernels and the
//! references, so both take the same branch.

use std::fmt;

use crate::accuracy::Tracked;

use super::{sigmoid_tracked, tanh_tracked};

/// An f32 parameter of an [`Activation`], held as its bit pattern so that
/// [`super::Unary`], a key of compiled kernels, stays `Eq + Hash`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct F32Bits(u32);

impl F32Bits {
    pub const fn new(v: f32) -> Self {
        Self(v.to_bits())
    }

    pub const fn get(self) -> f32 {
        f32::from_bits(self.0)
    }

    /// The value in WGSL, bit for bit: `bitcast` of its pattern where it
    /// is finite (WGSL has no infinite constants; the model refuses those
    /// parameters, and a non-finite one here becomes the nearest finite).
    fn wgsl(self) -> String {
        if self.get().is_finite() {
            format!("bitcast<f32>({}u)", self.0)
        } else {
            crate::spec::f32_lit(self.get())
        }
    }

    fn f64(self) -> f64 {
        f64::from(self.get())
    }
}

impl fmt::Debug for F32Bits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.get())
    }
}

impl From<f32> for F32Bits {
    fn from(v: f32) -> Self {
        Self::new(v)
    }
}

/// SELU's constants as torch writes them (`torch.nn.SELU`).
pub const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
pub const SELU_SCALE: f64 = 1.050_700_987_355_480_5;
/// `SELU_SCALE * SELU_ALPHA`, the slope of the negative side at 0.
const SELU_SCALE_ALPHA: f64 = SELU_SCALE * SELU_ALPHA;

/// An activation with torch's semantics; parameters are torch's, named as
/// torch names them ([`ACTIVATIONS`] lists each with torch's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x` where `x > 0`, else `negative_slope * x` (torch's default 0.01).
    LeakyRelu { negative_slope: F32Bits },
    /// `x` where `x > 0`, else `alpha (exp(x) - 1)` (default alpha 1).
    Elu { alpha: F32Bits },
    /// `scale x` where `x > 0`, else `scale alpha (exp(x) - 1)`, with
    /// [`SELU_SCALE`] and [`SELU_ALPHA`].
    Selu,
    /// `log(1 + exp(beta x)) / beta`, and `x` where `beta x > threshold`
    /// (defaults beta 1, threshold 20).
    Softplus { beta: F32Bits, threshold: F32Bits },
    /// `x / (1 + |x|)`.
    Softsign,
    /// `x - tanh(x)`.
    Tanhshrink,
    /// `log(sigmoid(x))`, as `min(x, 0) - log(1 + exp(-|x|))`.
    LogSigmoid,
    /// 0 where `-lambd <= x <= lambd`, else `x` (default lambd 0.5).
    Hardshrink { lambd: F32Bits },
    /// `x` clamped to `[min_val, max_val]` (defaults -1, 1); the gradient
    /// is 0 at and beyond either end.
    Hardtanh { min_val: F32Bits, max_val: F32Bits },
    /// 0 where `-lambd <= x <= lambd`, else `x` moved `lambd` toward 0
    /// (default lambd 0.5).
    Softshrink { lambd: F32Bits },
    /// `value` where `x <= threshold`, else `x` (no defaults in torch).
    Threshold { threshold: F32Bits, value: F32Bits },
}

/// Every activation with torch's defaults, then with other parameters: what
/// the standard checks and the comparisons with libtorch run.
pub const ACTIVATIONS: [Activation; 18] = {
    use Activation::*;
    let p = F32Bits::new;
    [
        LeakyRelu {
            negative_slope: p(0.01),
        },
        LeakyRelu {
            negative_slope: p(0.2),
        },
        Elu { alpha: p(1.0) },
        Elu { alpha: p(0.5) },
        Selu,
        Softplus {
            beta: p(1.0),
            threshold: p(20.0),
        },
        Softplus {
            beta: p(2.0),
            threshold: p(5.0),
        },
        Softsign,
        Tanhshrink,
        LogSigmoid,
        Hardshrink { lambd: p(0.5) },
        Hardshrink { lambd: p(1.5) },
        Hardtanh {
            min_val: p(-1.0),
            max_val: p(1.0),
        },
        Hardtanh {
            min_val: p(-2.0),
            max_val: p(3.0),
        },
        Softshrink { lambd: p(0.5) },
        Softshrink { lambd: p(1.25) },
        Threshold {
            threshold: p(0.1),
            value: p(20.0),
        },
        Threshold {
            threshold: p(-1.0),
            value: p(-3.5),
        },
    ]
};

/// WGSL helpers of these activations, beside the shared ones: softplus of
/// `z` that cannot overflow, and log-sigmoid's slope `1 - sigmoid(v)`
/// from `exp(-|v|)` (torch's own way), which never divides by an
/// overflowed `exp`.
pub(super) const HELPERS: &str = r"
fn log1p_safe(u: f32) -> f32 {
    if (u < 0.0078125) {
        return u * (1.0 - u * (0.5 - u * (0.33333334 - u * 0.25)));
    }
    return log(1.0 + u);
}
fn softplus_stable(z: f32) -> f32 {
    return max(z, 0.0) + log1p_safe(exp(-abs(z)));
}
fn logsigmoid_slope(v: f32) -> f32 {
    let e = exp(-abs(v));
    return select(e, 1.0, v < 0.0) / (1.0 + e);
}
";

/// Below this `log1p_safe` sums four terms of `log(1 + u)`'s series:
/// WGSL's `log` is only absolutely accurate (`2^-21`) near 1, which is
/// most of a tiny result (softplus and log-sigmoid far out on their flat
/// side, as ONNX's Mish cases reach).
const LOG1P_SERIES_BELOW: f64 = 0.007_812_5;

/// `log1p_safe` of the WGSL helpers, operation by operation; the series'
/// truncation is under `u^5 / 5`.
fn log1p_tracked(u: Tracked) -> Tracked {
    let one = Tracked::exact(1.0);
    if u.value < LOG1P_SERIES_BELOW {
        let lit = Tracked::literal;
        let series = u * (one - u * (lit(0.5) - u * (lit(1.0 / 3.0) - u * lit(0.25))));
        series.approximating(u.value.abs().powi(5) / 5.0)
    } else {
        (one + u).ln()
    }
}

impl Activation {
    pub fn name(self) -> &'static str {
        match self {
            Activation::LeakyRelu { .. } => "leaky_relu",
            Activation::Elu { .. } => "elu",
            Activation::Selu => "selu",
            Activation::Softplus { .. } => "softplus",
            Activation::Softsign => "softsign",
            Activation::Tanhshrink => "tanhshrink",
            Activation::LogSigmoid => "logsigmoid",
            Activation::Hardshrink { .. } => "hardshrink",
            Activation::Hardtanh { .. } => "hardtanh",
            Activation::Softshrink { .. } => "softshrink",
            Activation::Threshold { .. } => "threshold",
        }
    }

    /// The parameters in torch's order.
    pub fn params(self) -> Vec<f32> {
        match self {
            Activation::LeakyRelu { negative_slope: a }
            | Activation::Elu { alpha: a }
            | Activation::Hardshrink { lambd: a }
            | Activation::Softshrink { lambd: a } => vec![a.get()],
            Activation::Softplus {
                beta: a,
                threshold: b,
            }
            | Activation::Hardtanh {
                min_val: a,
                max_val: b,
            }
            | Activation::Threshold {
                threshold: a,
                value: b,
            } => vec![a.get(), b.get()],
            Activation::Selu
            | Activation::Softsign
            | Activation::Tanhshrink
            | Activation::LogSigmoid => vec![],
        }
    }

    /// The name with the parameters, `leaky_relu(0.2)`: distinct for each
    /// parameter set, for kernel labels and check names.
    pub fn label(self) -> String {
        let params = self.params();
        if params.is_empty() {
            return self.name().to_string();
        }
        let shown: Vec<String> = params.iter().map(|p| format!("{p:?}")).collect();
        format!("{}({})", self.name(), shown.join(","))
    }

    /// Where the formula changes branch (torch's comparisons decide there):
    /// 0 for the ReLU-like ones and where `|x|` bends, `+-lambd`, the
    /// clamp's ends, `threshold / beta` and `threshold`.
    pub fn kinks(self) -> Vec<f32> {
        match self {
            Activation::LeakyRelu { .. }
            | Activation::Elu { .. }
            | Activation::Selu
            | Activation::Softsign
            | Activation::Tanhshrink
            | Activation::LogSigmoid => vec![0.0],
            Activation::Softplus { beta, threshold } => vec![threshold.get() / beta.get()],
            Activation::Hardshrink { lambd } | Activation::Softshrink { lambd } => {
                vec![-lambd.get(), lambd.get()]
            }
            Activation::Hardtanh { min_val, max_val } => vec![min_val.get(), max_val.get()],
            Activation::Threshold { threshold, .. } => vec![threshold.get()],
        }
    }

    /// The forward as a WGSL expression of `v`.
    pub(super) fn fwd_expr(self) -> String {
        match self {
            Activation::LeakyRelu { negative_slope: s } => {
                format!("select(v * {}, v, v > 0.0)", s.wgsl())
            }
            Activation::Elu { alpha } => {
                format!("select(v, {} * (exp(v) - 1.0), v <= 0.0)", alpha.wgsl())
            }
            Activation::Selu => {
                format!(
                    "select({SELU_SCALE:?} * v, {SELU_SCALE_ALPHA:?} * (exp(v) - 1.0), v <= 0.0)"
                )
            }
            Activation::Softplus { beta, threshold } => {
                let (b, t) = (beta.wgsl(), threshold.wgsl());
                format!("select(softplus_stable(v * {b}) / {b}, v, v * {b} > {t})")
            }
            Activation::Softsign => "v / (1.0 + abs(v))".into(),
            Activation::Tanhshrink => "v - tanh_safe(v)".into(),
            Activation::LogSigmoid => "min(v, 0.0) - log1p_safe(exp(-abs(v)))".into(),
            Activation::Hardshrink { lambd } => {
                let l = lambd.wgsl();
                format!("select(v, 0.0, v >= -{l} && v <= {l})")
            }
            Activation::Hardtanh { min_val, max_val } => {
                format!("min(max(v, {}), {})", min_val.wgsl(), max_val.wgsl())
            }
            Activation::Softshrink { lambd } => {
                let l = lambd.wgsl();
                format!("select(select(0.0, v + {l}, v < -{l}), v - {l}, v > {l})")
            }
            Activation::Threshold { threshold, value } => {
                format!("select(v, {}, v <= {})", value.wgsl(), threshold.wgsl())
            }
        }
    }

    /// `dy * f'(v)` as a WGSL expression of `v` and `g`, in torch's order of
    /// operations where it has one.
    pub(super) fn bwd_expr(self) -> String {
        match self {
            // torch's leaky_relu_backward: `x > 0 ? g : g * slope`.
            Activation::LeakyRelu { negative_slope: s } => {
                format!("select(g * {}, g, v > 0.0)", s.wgsl())
            }
            // torch's elu_backward on the input: `g * alpha * exp(x)` at and below 0.
            Activation::Elu { alpha } => {
                format!("select(g, g * {} * exp(v), v <= 0.0)", alpha.wgsl())
            }
            Activation::Selu => {
                format!("select(g * {SELU_SCALE:?}, g * {SELU_SCALE_ALPHA:?} * exp(v), v <= 0.0)")
            }
            // torch's softplus_backward: `g * e / (e + 1)`, `e = exp(beta x)`,
            // which is the sigmoid of `beta x`.
            Activation::Softplus { beta, threshold } => {
                let (b, t) = (beta.wgsl(), threshold.wgsl());
                format!("select(g * sigmoid(v * {b}), g, v * {b} > {t})")
            }
            Activation::Softsign => "g / ((1.0 + abs(v)) * (1.0 + abs(v)))".into(),
            // `1 - (1 - tanh^2)`, written without the cancellation.
            Activation::Tanhshrink => "g * tanh_safe(v) * tanh_safe(v)".into(),
            Activation::LogSigmoid => "g * logsigmoid_slope(v)".into(),
            Activation::Hardshrink { lambd } | Activation::Softshrink { lambd } => {
                let l = lambd.wgsl();
                format!("select(g, 0.0, v >= -{l} && v <= {l})")
            }
            // torch's hardtanh_backward: 0 at and beyond either end.
            Activation::Hardtanh { min_val, max_val } => format!(
                "select(g, 0.0, v <= {} || v >= {})",
                min_val.wgsl(),
                max_val.wgsl()
            ),
            Activation::Threshold { threshold, .. } => {
                format!("select(g, 0.0, v <= {})", threshold.wgsl())
            }
        }
    }

    /// The forward and backward as the WGSL computes them, each with its
    /// error bound; `v` and `g` are exact inputs.
    pub(super) fn tracked(self, v: Tracked, g: Tracked) -> (Tracked, Tracked) {
        let exact = Tracked::exact;
        let lit = Tracked::literal;
        let one = exact(1.0);
        let zero = (exact(0.0), exact(0.0));
        let x = v.value as f32;
        let param = |p: F32Bits| exact(p.get());
        match self {
            Activation::LeakyRelu { negative_slope: s } => {
                if x > 0.0 {
                    (v, g)
                } else {
                    (v * param(s), g * param(s))
                }
            }
            Activation::Elu { alpha } => {
                if x <= 0.0 {
                    let a = param(alpha);
                    (a * (v.exp() - one), g * a * v.exp())
                } else {
                    (v, g)
                }
            }
            Activation::Selu => {
                if x <= 0.0 {
                    let sa = lit(SELU_SCALE_ALPHA);
                    (sa * (v.exp() - one), g * sa * v.exp())
                } else {
                    (lit(SELU_SCALE) * v, g * lit(SELU_SCALE))
                }
            }
            Activation::Softplus { beta, threshold } => {
                if x * beta.get() > threshold.get() {
                    return (v, g);
                }
                let z = v * param(beta);
                let soft = neg_max(-z) + log1p_tracked((-z.abs()).exp());
                (soft / param(beta), g * sigmoid_tracked(z))
            }
            Activation::Softsign => {
                let d = one + v.abs();
                (v / d, g / (d * d))
            }
            Activation::Tanhshrink => {
                let t = tanh_tracked(v);
                (v - t, g * t * t)
            }
            Activation::LogSigmoid => {
                let e = (-v.abs()).exp();
                let top = if x < 0.0 { one } else { e };
                let y = -neg_max(v) - log1p_tracked(e);
                (y, g * (top / (one + e)))
            }
            Activation::Hardshrink { lambd } => {
                let l = lambd.get();
                if x >= -l && x <= l { zero } else { (v, g) }
            }
            Activation::Hardtanh { min_val, max_val } => {
                let (lo, hi) = (min_val.get(), max_val.get());
                let y = exact(x.max(lo).min(hi));
                (y, if x <= lo || x >= hi { exact(0.0) } else { g })
            }
            Activation::Softshrink { lambd } => {
                let l = lambd.get();
                if x > l {
                    (v - param(lambd), g)
                } else if x < -l {
                    (v + param(lambd), g)
                } else {
                    zero
                }
            }
            Activation::Threshold { threshold, value } => {
                if x <= threshold.get() {
                    (param(value), exact(0.0))
                } else {
                    (v, g)
                }
            }
        }
    }

    /// The forward in f64, exactly torch's formula, for an f32 input.
    pub(super) fn reference(self, x: f32) -> f64 {
        let v = f64::from(x);
        match self {
            Activation::LeakyRelu { negative_slope: s } => {
                if x > 0.0 {
                    v
                } else {
                    v * s.f64()
                }
            }
            Activation::Elu { alpha } => {
                if x <= 0.0 {
                    alpha.f64() * v.exp_m1()
                } else {
                    v
                }
            }
            Activation::Selu => {
                if x <= 0.0 {
                    SELU_SCALE_ALPHA * v.exp_m1()
                } else {
                    SELU_SCALE * v
                }
            }
            Activation::Softplus { beta, threshold } => {
                // torch compares the f32 product.
                if x * beta.get() > threshold.get() {
                    v
                } else {
                    let z = v * beta.f64();
                    (z.max(0.0) + (-z.abs()).exp().ln_1p()) / beta.f64()
                }
            }
            Activation::Softsign => v / (1.0 + v.abs()),
            Activation::Tanhshrink => v - v.tanh(),
            Activation::LogSigmoid => v.min(0.0) - (-v.abs()).exp().ln_1p(),
            Activation::Hardshrink { lambd } => {
                let l = lambd.get();
                if x >= -l && x <= l { 0.0 } else { v }
            }
            Activation::Hardtanh { min_val, max_val } => v.max(min_val.f64()).min(max_val.f64()),
            Activation::Softshrink { lambd } => {
                let l = lambd.get();
                if x > l {
                    v - lambd.f64()
                } else if x < -l {
                    v + lambd.f64()
                } else {
                    0.0
                }
            }
            Activation::Threshold { threshold, value } => {
                if x <= threshold.get() {
                    value.f64()
                } else {
                    v
                }
            }
        }
    }

    /// `dy * f'(x)` in f64, with torch's gradient at the kinks.
    pub(super) fn reference_backward(self, x: f32, dy: f32) -> f64 {
        let (v, g) = (f64::from(x), f64::from(dy));
        match self {
            Activation::LeakyRelu { negative_slope: s } => {
                if x > 0.0 {
                    g
                } else {
                    g * s.f64()
                }
            }
            Activation::Elu { alpha } => {
                if x <= 0.0 {
                    g * alpha.f64() * v.exp()
                } else {
                    g
                }
            }
            Activation::Selu => {
                if x <= 0.0 {
                    g * SELU_SCALE_ALPHA * v.exp()
                } else {
                    g * SELU_SCALE
                }
            }
            Activation::Softplus { beta, threshold } => {
                if x * beta.get() > threshold.get() {
                    g
                } else {
                    g / (1.0 + (-v * beta.f64()).exp())
                }
            }
            Activation::Softsign => g / (1.0 + v.abs()).powi(2),
            Activation::Tanhshrink => g * v.tanh().powi(2),
            Activation::LogSigmoid => g / (1.0 + v.exp()),
            Activation::Hardshrink { lambd } | Activation::Softshrink { lambd } => {
                let l = lambd.get();
                if x >= -l && x <= l { 0.0 } else { g }
            }
            Activation::Hardtanh { min_val, max_val } => {
                if x <= min_val.get() || x >= max_val.get() {
                    0.0
                } else {
                    g
                }
            }
            Activation::Threshold { threshold, .. } => {
                if x <= threshold.get() {
                    0.0
                } else {
                    g
                }
            }
        }
    }
}

/// `max(-t, 0)` negated is `min(t, 0)`; `neg_max(-z)` is WGSL's `max(z,
/// 0.0)` and `-neg_max(v)` its `min(v, 0.0)`: exact, carrying the
/// operand's error.
fn neg_max(t: Tracked) -> Tracked {
    (-t).max(Tracked::exact(0.0))
}

#[cfg(test)]
mod tests {
    use super::super::{UNARIES, Unary};
    use super::*;
    use crate::accuracy::{DIVISION_ULPS, LOG_ABSOLUTE, exp_ulps};

    fn unary(a: Activation) -> Unary {
        Unary::Activation(a)
    }

    #[test]
    fn every_activation_is_in_the_standard_list_and_labels_are_distinct() {
        let labels: std::collections::HashSet<String> =
            ACTIVATIONS.iter().map(|a| a.label()).collect();
        assert_eq!(labels.len(), ACTIVATIONS.len());
        for a in ACTIVATIONS {
            assert!(UNARIES.contains(&unary(a)), "{}", a.label());
        }
        let names: std::collections::HashSet<&str> = ACTIVATIONS.iter().map(|a| a.name()).collect();
        assert_eq!(names.len(), 11);
        assert_eq!(ACTIVATIONS[1].label(), "leaky_relu(0.2)");
    }

    #[test]
    fn parameters_reach_the_wgsl_bit_for_bit() {
        let a = Activation::Threshold {
            threshold: F32Bits::new(0.1),
            value: F32Bits::new(20.0),
        };
        let fwd = unary(a).forward(8).wgsl;
        assert!(
            fwd.contains(&format!("bitcast<f32>({}u)", 0.1f32.to_bits())),
            "{fwd}"
        );
        assert!(
            fwd.contains(&format!("bitcast<f32>({}u)", 20.0f32.to_bits())),
            "{fwd}"
        );
        assert_ne!(fwd, unary(ACTIVATIONS[17]).forward(8).wgsl);
        assert!(unary(a).forward(8).label.starts_with("threshold(0.1,20.0)"));
    }

    /// torch's values at and around each kink, by hand from torch's
    /// definitions (`x > 0`, `x <= 0`, `|x| <= lambd`, ...).
    #[test]
    fn kinks_follow_torch() {
        let p = F32Bits::new;
        let at = |a: Activation, x: f32| (a.reference(x), a.reference_backward(x, 1.0));
        let leaky = Activation::LeakyRelu {
            negative_slope: p(0.2),
        };
        assert_eq!(at(leaky, 0.0), (0.0, f64::from(0.2f32)));
        let elu = Activation::Elu { alpha: p(0.5) };
        assert_eq!(at(elu, 0.0), (0.0, 0.5));
        assert_eq!(at(Activation::Selu, 0.0), (0.0, SELU_SCALE_ALPHA));
        let sp = Activation::Softplus {
            beta: p(2.0),
            threshold: p(5.0),
        };
        // At beta x == threshold torch is still on the soft side.
        let (y, dx) = at(sp, 2.5);
        assert!((y - (2.0 * 5f64.exp().ln_1p()) / 4.0).abs() < 1e-12 && dx < 1.0);
        assert_eq!(at(sp, 2.5f32.next_up()), (f64::from(2.5f32.next_up()), 1.0));
        for shrink in [
            Activation::Hardshrink { lambd: p(0.5) },
            Activation::Softshrink { lambd: p(0.5) },
        ] {
            assert_eq!(at(shrink, 0.5), (0.0, 0.0));
            assert_eq!(at(shrink, -0.5), (0.0, 0.0));
            assert_eq!(at(shrink, 0.5f32.next_up()).1, 1.0);
        }
        let hardtanh = Activation::Hardtanh {
            min_val: p(-2.0),
            max_val: p(3.0),
        };
        assert_eq!(at(hardtanh, -2.0), (-2.0, 0.0));
        assert_eq!(at(hardtanh, 3.0), (3.0, 0.0));
        assert_eq!(at(hardtanh, 5.0), (3.0, 0.0));
        assert_eq!(at(hardtanh, 2.5), (2.5, 1.0));
        let threshold = Activation::Threshold {
            threshold: p(0.1),
            value: p(20.0),
        };
        assert_eq!(at(threshold, 0.1), (20.0, 0.0));
        assert_eq!(at(threshold, 0.1f32.next_up()).1, 1.0);
        assert_eq!(at(Activation::Softsign, 0.0), (0.0, 1.0));
        assert_eq!(at(Activation::LogSigmoid, 0.0), (-(2f64.ln()), 0.5));
    }

    /// `v` moved `ulps` ULPs away from zero (an exact 0 stays: the bounds
    /// are relative, and below the normal range WGSL allows flushing to 0).
    fn slack(v: f32, ulps: f64) -> f32 {
        if v == 0.0 {
            return v;
        }
        (0..ulps.ceil() as u32).fold(v, |v, _| if v >= 0.0 { v.next_up() } else { v.next_down() })
    }

    /// The WGSL of the transcendental activations in f32, with every `exp`,
    /// `log` and division as far off as WGSL allows: `(y, dx)`.
    fn emulate(a: Activation, v: f32, g: f32) -> (f32, f32) {
        let exp = |x: f32| slack(x.exp(), exp_ulps(f64::from(x)));
        let div = |a: f32, b: f32| slack(a / b, DIVISION_ULPS);
        // Inside [0.5, 2] WGSL's log is within an absolute 2^-21.
        let log = |x: f32| {
            let y = x.ln();
            if (0.5..=2.0).contains(&x) {
                y + LOG_ABSOLUTE as f32 * y.signum()
            } else {
                slack(y, 3.0)
            }
        };
        let log1p = |u: f32| {
            if f64::from(u) < LOG1P_SERIES_BELOW {
                u * (1.0 - u * (0.5 - u * (0.333_333_34 - u * 0.25)))
            } else {
                log(1.0 + u)
            }
        };
        let tanh = |x: f32| {
            let e = exp(-2.0 * x.abs());
            x.signum() * div(1.0 - e, 1.0 + e)
        };
        let sigmoid = |x: f32| div(1.0, 1.0 + exp(-x));
        match a {
            Activation::Elu { alpha } => {
                let a = alpha.get();
                if v <= 0.0 {
                    (a * (exp(v) - 1.0), g * a * exp(v))
                } else {
                    (v, g)
                }
            }
            Activation::Selu => {
                let (s, sa) = (SELU_SCALE as f32, SELU_SCALE_ALPHA as f32);
                if v <= 0.0 {
                    (sa * (exp(v) - 1.0), g * sa * exp(v))
                } else {
                    (s * v, g * s)
                }
            }
            Activation::Softplus { beta, threshold } => {
                let b = beta.get();
                let z = v * b;
                if z > threshold.get() {
                    (v, g)
                } else {
                    let soft = z.max(0.0) + log1p(exp(-z.abs()));
                    (div(soft, b), g * sigmoid(z))
                }
            }
            Activation::Softsign => {
                let d = 1.0 + v.abs();
                (div(v, d), div(g, d * d))
            }
            Activation::Tanhshrink => {
                let t = tanh(v);
                (v - t, g * t * t)
            }
            Activation::LogSigmoid => {
                let e = exp(-v.abs());
                let top = if v < 0.0 { 1.0 } else { e };
                (v.min(0.0) - log1p(e), g * div(top, 1.0 + e))
            }
            _ => unreachable!("only the transcendental activations"),
        }
    }

    #[test]
    fn activations_in_f32_with_wgsls_slack_stay_within_their_error_bounds() {
        let x: Vec<f32> = crate::sample_matrix(2000, 7)
            .iter()
            .map(|v| v * 12.0)
            .collect();
        let dy = crate::sample_matrix(2000, 8);
        let transcendental = ACTIVATIONS.into_iter().filter(|a| {
            matches!(
                a,
                Activation::Elu { .. }
                    | Activation::Selu
                    | Activation::Softplus { .. }
                    | Activation::Softsign
                    | Activation::Tanhshrink
                    | Activation::LogSigmoid
            )
        });
        let mut checked = 0;
        for a in transcendental {
            let op = unary(a);
            // With the kinks and their neighbours: 0 and +-1e-30, where
            // `tanh_safe` is far off relative to its value.
            let kinks = op.kinks();
            let x: Vec<f32> = x.iter().copied().chain(kinks.iter().copied()).collect();
            let dy: Vec<f32> = dy
                .iter()
                .copied()
                .chain(kinks.iter().map(|_| 0.75))
                .collect();
            super::super::tests::assert_emulation_within_bounds(op, &x, &dy, |v, g| {
                emulate(a, v, g)
            });
            checked += 1;
        }
        assert_eq!(checked, 8);
    }

    #[test]
    fn the_exact_activations_have_zero_bounds() {
        let x: Vec<f32> = crate::sample_matrix(300, 9)
            .iter()
            .map(|v| v * 4.0)
            .collect();
        let dy = crate::sample_matrix(300, 10);
        for a in ACTIVATIONS {
            if matches!(
                a,
                Activation::Hardshrink { .. }
                    | Activation::Hardtanh { .. }
                    | Activation::Threshold { .. }
            ) {
                let (by, bdx) = unary(a).error_bounds(&x, &dy);
                assert!(by.iter().chain(&bdx).all(|b| *b == 0.0), "{}", a.label());
            }
        }
    }
}
