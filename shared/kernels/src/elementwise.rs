//! Elementwise kernels: the activations (Relu, exact-erf Gelu, Sigmoid, Tanh,
//! Identity, and in [`activations`] leaky ReLU, ELU, SELU, softplus,
//! softsign, tanhshrink, log-sigmoid, hardshrink, hardtanh, softshrink and
//! threshold with their parameters) and the unary arithmetic ONNX graphs use
//! (Neg, Abs, Sqrt, Reciprocal, Exp, Log) forward and backward, the
//! numpy-broadcast binary ops (Add, Sub,
//! Mul, Div) forward and backward (the backward sums over the broadcast
//! dimensions), and Dropout with a counter-based RNG that the CPU reference
//! and the WGSL compute bit for bit.

use super::accuracy::Tracked;
use super::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, numel, one_d, strides};

mod activations;

pub use activations::{ACTIVATIONS, Activation, F32Bits, SELU_ALPHA, SELU_SCALE};

/// An activation, applied elementwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unary {
    Relu,
    /// `0.5 x (1 + erf(x / sqrt 2))`, torch's default (`approximate="none"`).
    Gelu,
    /// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, torch's
    /// `approximate="tanh"` (GPT-2's `gelu_new`).
    GeluTanh,
    Sigmoid,
    Tanh,
    Identity,
    Neg,
    Abs,
    Sqrt,
    Reciprocal,
    Exp,
    Log,
    /// The other activations of `torch.nn`, with their parameters.
    Activation(Activation),
}

/// Every unary op the checks and the comparisons with libtorch run: the
/// basic ones, then [`ACTIVATIONS`].
pub const UNARIES: [Unary; BASIC_UNARIES.len() + ACTIVATIONS.len()] = {
    let mut all = [Unary::Identity; BASIC_UNARIES.len() + ACTIVATIONS.len()];
    let mut i = 0;
    while i < BASIC_UNARIES.len() {
        all[i] = BASIC_UNARIES[i];
        i += 1;
    }
    let mut j = 0;
    while j < ACTIVATIONS.len() {
        all[i + j] = Unary::Activation(ACTIVATIONS[j]);
        j += 1;
    }
    all
};

const BASIC_UNARIES: [Unary; 12] = [
    Unary::Relu,
    Unary::Gelu,
    Unary::GeluTanh,
    Unary::Sigmoid,
    Unary::Tanh,
    Unary::Identity,
    Unary::Neg,
    Unary::Abs,
    Unary::Sqrt,
    Unary::Reciprocal,
    Unary::Exp,
    Unary::Log,
];

/// WGSL helpers shared by the activations. WGSL has no `erf`, so this is
/// Abramowitz & Stegun 7.1.26 (absolute error under 1.5e-7); `tanh` and the
/// sigmoid are written so that large |x| saturates instead of overflowing to
/// NaN, which some backends' builtins do. Their slopes, `1 - tanh^2` and
/// `s (1 - s)`, are computed from `exp(-|x|)` directly (`sech2`,
/// `sigmoid_slope`): as differences of nearly equal values they lose most
/// of their digits where |x| is large.
const ACTIVATION_HELPERS: &str = r"
fn erf_approx(x: f32) -> f32 {
    let s = sign(x);
    let a = abs(x);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return s * (1.0 - poly * exp(-a * a));
}
fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}
fn tanh_safe(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - e) / (1.0 + e);
}
fn sech2(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    let d = 1.0 + e;
    return 4.0 * e / (d * d);
}
fn sigmoid_slope(x: f32) -> f32 {
    let e = exp(-abs(x));
    let d = 1.0 + e;
    return e / (d * d);
}
";

impl Unary {
    pub fn name(self) -> &'static str {
        match self {
            Unary::Relu => "relu",
            Unary::Gelu => "gelu",
            Unary::GeluTanh => "gelu_tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::Tanh => "tanh",
            Unary::Identity => "identity",
            Unary::Neg => "neg",
            Unary::Abs => "abs",
            Unary::Sqrt => "sqrt",
            Unary::Reciprocal => "reciprocal",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Activation(a) => a.name(),
        }
    }

    /// [`Self::name`] with the parameters where there are any
    /// (`leaky_relu(0.2)`): distinct for each kernel, for labels and check
    /// names.
    pub fn label(self) -> String {
        match self {
            Unary::Activation(a) => a.label(),
            _ => self.name().to_string(),
        }
    }

    /// The inputs where the op changes branch, each with its two f32
    /// neighbours: where a kernel must make torch's comparison (`>` or
    /// `>=`) to agree with it. 0 comes as `+-0.0` with `+-1e-30` beside
    /// it, not the subnormals next to it: WGSL lets a GPU flush those to
    /// zero, which would move them onto the kink.
    pub fn kinks(self) -> Vec<f32> {
        let points = match self {
            Unary::Relu | Unary::Abs => vec![0.0],
            Unary::Activation(a) => a.kinks(),
            _ => Vec::new(),
        };
        let mut out = Vec::new();
        for p in points {
            if p == 0.0 {
                out.extend([-1e-30, -0.0, 0.0, 1e-30]);
            } else {
                out.extend([p.next_down(), p, p.next_up()]);
            }
        }
        out
    }

    /// Maps a sample in `[-4, 4)` into the op's domain, away from where its
    /// derivative blows up (checks and tests feed these).
    pub fn domain(self, v: f32) -> f32 {
        match self {
            Unary::Sqrt | Unary::Log => v.abs() + 0.125,
            Unary::Reciprocal => v.signum() * (v.abs() + 0.25),
            _ => v,
        }
    }

    /// Per-element bounds on how far the kernel's forward and backward may
    /// be from the references, from WGSL's stated accuracy of the builtins
    /// each uses ([`crate::accuracy`]), composed through the kernel's own
    /// formulas (the activation helpers included).
    pub fn error_bounds(self, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        x.iter()
            .zip(dy)
            .map(|(&v, &g)| {
                let (y, dx) = self.tracked(Tracked::exact(v), Tracked::exact(g));
                (y.between_two(), dx.between_two())
            })
            .unzip()
    }

    /// The forward `f(v)` and backward `g f'(v)` as the WGSL computes them,
    /// each with its error bound.
    fn tracked(self, v: Tracked, g: Tracked) -> (Tracked, Tracked) {
        let exact = Tracked::exact;
        let lit = Tracked::literal;
        match self {
            Unary::Identity => (v, g),
            Unary::Relu => {
                let on = v.value > 0.0;
                (v.max(exact(0.0)), if on { g } else { exact(0.0) })
            }
            Unary::Neg => (-v, -g),
            Unary::Abs => (v.abs(), g),
            Unary::Sqrt => (v.sqrt(), g / (exact(2.0) * v.sqrt())),
            Unary::Reciprocal => {
                let r = exact(1.0) / v;
                (r, -g * r * r)
            }
            Unary::Exp => (v.exp(), g * v.exp()),
            Unary::Log => (v.ln(), g / v),
            Unary::Activation(a) => a.tracked(v, g),
            Unary::Sigmoid => (sigmoid_tracked(v), g * sigmoid_slope_tracked(v)),
            Unary::Tanh => (tanh_tracked(v), g * sech2_tracked(v)),
            Unary::Gelu => {
                let cdf = lit(0.5) * (exact(1.0) + erf_tracked(v * lit(FRAC_1_SQRT_2)));
                let pdf = lit(0.398_942_280_401_432_7) * (lit(-0.5) * v * v).exp();
                (v * cdf, g * (cdf + v * pdf))
            }
            Unary::GeluTanh => {
                let inner = lit(SQRT_2_OVER_PI) * (v + lit(0.044715) * v * v * v);
                let t = tanh_tracked(inner);
                let slope = lit(SQRT_2_OVER_PI) * (exact(1.0) + lit(3.0 * 0.044715) * v * v);
                let half = lit(0.5) * (exact(1.0) + t);
                let dx = g * (half + lit(0.5) * v * sech2_tracked(inner) * slope);
                (lit(0.5) * v * (exact(1.0) + t), dx)
            }
        }
    }

    fn fwd_expr(self) -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed(match self {
            Unary::Relu => "max(v, 0.0)",
            Unary::Gelu => "0.5 * v * (1.0 + erf_approx(v * 0.70710678118654752))",
            Unary::GeluTanh => {
                "0.5 * v * (1.0 + tanh_safe(0.79788456080286536 * (v + 0.044715 * v * v * v)))"
            }
            Unary::Sigmoid => "sigmoid(v)",
            Unary::Tanh => "tanh_safe(v)",
            Unary::Identity => "v",
            Unary::Neg => "-v",
            Unary::Abs => "abs(v)",
            Unary::Sqrt => "sqrt(v)",
            Unary::Reciprocal => "1.0 / v",
            Unary::Exp => "exp(v)",
            Unary::Log => "log(v)",
            Unary::Activation(a) => return a.fwd_expr().into(),
        })
    }

    /// `dy * f'(v)`.
    fn bwd_expr(self) -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed(match self {
            // torch's threshold_backward: the gradient at 0 is 0.
            Unary::Relu => "select(0.0, g, v > 0.0)",
            Unary::Gelu => {
                "g * (0.5 * (1.0 + erf_approx(v * 0.70710678118654752)) + v * 0.39894228040143268 * exp(-0.5 * v * v))"
            }
            // torch's GeluBackward with approximate="tanh", term by term.
            Unary::GeluTanh => {
                "g * (0.5 * (1.0 + tanh_safe(0.79788456080286536 * (v + 0.044715 * v * v * v))) \
                 + 0.5 * v * sech2(0.79788456080286536 * (v + 0.044715 * v * v * v)) \
                 * 0.79788456080286536 * (1.0 + 3.0 * 0.044715 * v * v))"
            }
            Unary::Sigmoid => "g * sigmoid_slope(v)",
            Unary::Tanh => "g * sech2(v)",
            Unary::Identity => "g",
            Unary::Neg => "-g",
            // torch's: the gradient times sign(x), 0 at 0.
            Unary::Abs => "g * sign(v)",
            Unary::Sqrt => "g / (2.0 * sqrt(v))",
            // torch's: -g * (1/x)^2.
            Unary::Reciprocal => "-g * (1.0 / v) * (1.0 / v)",
            Unary::Exp => "g * exp(v)",
            Unary::Log => "g / v",
            Unary::Activation(a) => return a.bwd_expr().into(),
        })
    }

    /// The WGSL helpers the kernels call.
    fn helpers(self) -> String {
        match self {
            Unary::Activation(_) => format!("{ACTIVATION_HELPERS}{}", activations::HELPERS),
            _ => ACTIVATION_HELPERS.to_string(),
        }
    }

    /// Forward: bindings `x` (read), `y` (write), `len` elements.
    pub fn forward(self, len: usize) -> KernelSpec {
        one_d(
            format!("{}_fwd", self.label()),
            &[
                ("x", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            &self.helpers(),
            len,
            DEFAULT_WORKGROUP,
            &format!("    let v = x[i];\n    y[i] = {};", self.fwd_expr()),
        )
    }

    /// Backward: bindings `x` (the forward input), `dy` (read), `dx` (write).
    pub fn backward(self, len: usize) -> KernelSpec {
        one_d(
            format!("{}_bwd", self.label()),
            &[
                ("x", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("dx", Binding::ReadWrite, "f32"),
            ],
            &self.helpers(),
            len,
            DEFAULT_WORKGROUP,
            &format!(
                "    let v = x[i];\n    let g = dy[i];\n    dx[i] = {};",
                self.bwd_expr()
            ),
        )
    }

    /// CPU reference of the forward, in f64 rounded once.
    pub fn reference(self, x: &[f32]) -> Vec<f32> {
        x.iter()
            .map(|&x| {
                let v = f64::from(x);
                (match self {
                    Unary::Relu => v.max(0.0),
                    Unary::Gelu => 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2)),
                    Unary::GeluTanh => 0.5 * v * (1.0 + gelu_tanh_inner(v).tanh()),
                    Unary::Sigmoid => 1.0 / (1.0 + (-v).exp()),
                    Unary::Tanh => v.tanh(),
                    Unary::Identity => v,
                    Unary::Neg => -v,
                    Unary::Abs => v.abs(),
                    Unary::Sqrt => v.sqrt(),
                    Unary::Reciprocal => 1.0 / v,
                    Unary::Exp => v.exp(),
                    Unary::Log => v.ln(),
                    Unary::Activation(a) => a.reference(x),
                }) as f32
            })
            .collect()
    }

    /// CPU reference of the backward: `dx = dy * f'(x)`.
    pub fn reference_backward(self, x: &[f32], dy: &[f32]) -> Vec<f32> {
        x.iter()
            .zip(dy)
            .map(|(&x, &dy)| {
                let (v, g) = (f64::from(x), f64::from(dy));
                (match self {
                    Unary::Relu => {
                        if v > 0.0 {
                            g
                        } else {
                            0.0
                        }
                    }
                    Unary::Gelu => {
                        let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
                        let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                        g * (cdf + v * pdf)
                    }
                    Unary::GeluTanh => {
                        let t = gelu_tanh_inner(v).tanh();
                        let inner_slope =
                            (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * v * v);
                        g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * inner_slope)
                    }
                    Unary::Sigmoid => {
                        let s = 1.0 / (1.0 + (-v).exp());
                        g * s * (1.0 - s)
                    }
                    Unary::Tanh => g * (1.0 - v.tanh().powi(2)),
                    Unary::Identity => g,
                    Unary::Neg => -g,
                    Unary::Abs => {
                        if v == 0.0 {
                            0.0
                        } else {
                            g * v.signum()
                        }
                    }
                    Unary::Sqrt => g / (2.0 * v.sqrt()),
                    Unary::Reciprocal => -g / (v * v),
                    Unary::Exp => g * v.exp(),
                    Unary::Log => g / v,
                    Unary::Activation(a) => a.reference_backward(x, dy),
                }) as f32
            })
            .collect()
    }
}

/// `1 / sqrt(2)` and `sqrt(2 / pi)`, the GELUs' constants.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// Abramowitz & Stegun 7.1.26's largest error against `erf`.
const ERF_APPROX_ERROR: f64 = 1.5e-7;

/// `erf_approx` of the WGSL helpers, operation by operation.
fn erf_tracked(x: Tracked) -> Tracked {
    let lit = Tracked::literal;
    let one = Tracked::exact(1.0);
    let a = x.abs();
    let t = one / (one + lit(0.3275911) * a);
    let poly = t
        * (lit(0.254829592)
            + t * (lit(-0.284496736)
                + t * (lit(1.421413741) + t * (lit(-1.453152027) + t * lit(1.061405429)))));
    let r = (one - poly * (-a * a).exp()).approximating(ERF_APPROX_ERROR);
    if x.value < 0.0 { -r } else { r }
}

/// `sigmoid` of the WGSL helpers.
fn sigmoid_tracked(x: Tracked) -> Tracked {
    let one = Tracked::exact(1.0);
    one / (one + (-x).exp())
}

/// `tanh_safe` of the WGSL helpers: `sign(x) (1 - e) / (1 + e)` with
/// `e = exp(-2 |x|)`.
fn tanh_tracked(x: Tracked) -> Tracked {
    let one = Tracked::exact(1.0);
    let e = (Tracked::exact(-2.0) * x.abs()).exp();
    let r = (one - e) / (one + e);
    if x.value < 0.0 { -r } else { r }
}

/// `sech2` of the WGSL helpers: `4 e / (1 + e)^2`, `e = exp(-2 |x|)`.
fn sech2_tracked(x: Tracked) -> Tracked {
    let e = (Tracked::exact(-2.0) * x.abs()).exp();
    let d = Tracked::exact(1.0) + e;
    Tracked::exact(4.0) * e / (d * d)
}

/// `sigmoid_slope` of the WGSL helpers: `e / (1 + e)^2`, `e = exp(-|x|)`.
fn sigmoid_slope_tracked(x: Tracked) -> Tracked {
    let e = (-x.abs()).exp();
    let d = Tracked::exact(1.0) + e;
    e / (d * d)
}

/// `sqrt(2 / pi) (x + 0.044715 x^3)`, the tanh GELU's argument.
fn gelu_tanh_inner(v: f64) -> f64 {
    (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)
}

/// A binary op with numpy broadcasting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

pub const BINARY_OPS: [BinaryOp; 4] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div];

/// Which operand a binary backward differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operand {
    A,
    B,
}

/// Shapes of a broadcast binary op; `out` is numpy's broadcast of `a` and `b`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Broadcast {
    pub a: Vec<usize>,
    pub b: Vec<usize>,
    pub out: Vec<usize>,
}

impl Broadcast {
    /// Numpy's broadcast of two shapes, or `None` where they do not broadcast.
    pub fn new(a: &[usize], b: &[usize]) -> Option<Self> {
        let rank = a.len().max(b.len());
        let pad = |s: &[usize]| {
            let mut v = vec![1; rank - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (pa, pb) = (pad(a), pad(b));
        let out = pa
            .iter()
            .zip(&pb)
            .map(|(&x, &y)| match (x, y) {
                (x, y) if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            a: a.to_vec(),
            b: b.to_vec(),
            out,
        })
    }

    /// Strides of `shape` read at the output's coordinates: 0 along broadcast
    /// dimensions, left-padded to the output's rank.
    fn read_strides(&self, shape: &[usize]) -> Vec<usize> {
        let rank = self.out.len();
        let own = strides(shape);
        (0..rank)
            .map(|d| {
                let Some(sd) = (d + shape.len()).checked_sub(rank) else {
                    return 0;
                };
                if shape[sd] == 1 { 0 } else { own[sd] }
            })
            .collect()
    }

    /// Flat offsets into `a` and `b` of output element `o`.
    fn offsets(&self, o: usize) -> (usize, usize) {
        let (sa, sb, so) = (
            self.read_strides(&self.a),
            self.read_strides(&self.b),
            strides(&self.out),
        );
        let (mut ia, mut ib) = (0, 0);
        for d in 0..self.out.len() {
            let c = (o / so[d]) % self.out[d];
            ia += c * sa[d];
            ib += c * sb[d];
        }
        (ia, ib)
    }

    /// WGSL computing `ia` and `ib` from the output index `o`, unrolled over
    /// the dimensions.
    fn offsets_wgsl(&self) -> String {
        let (sa, sb, so) = (
            self.read_strides(&self.a),
            self.read_strides(&self.b),
            strides(&self.out),
        );
        let mut s = String::from("    var ia = 0u;\n    var ib = 0u;\n");
        for d in 0..self.out.len() {
            if self.out[d] == 1 {
                continue;
            }
            s += &format!("    let c{d} = (o / {}u) % {}u;\n", so[d], self.out[d]);
            if sa[d] != 0 {
                s += &format!("    ia += c{d} * {}u;\n", sa[d]);
            }
            if sb[d] != 0 {
                s += &format!("    ib += c{d} * {}u;\n", sb[d]);
            }
        }
        s
    }
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            BinaryOp::Add => "+",
            BinaryOp::Sub => "-",
            BinaryOp::Mul => "*",
            BinaryOp::Div => "/",
        }
    }

    fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
        }
    }

    /// Forward: bindings `a`, `b` (read), `y` (write, `shapes.out`).
    pub fn forward(self, shapes: &Broadcast) -> KernelSpec {
        let len = numel(&shapes.out);
        let body = format!(
            "    let o = i;\n{}    y[o] = a[ia] {} b[ib];",
            shapes.offsets_wgsl(),
            self.symbol()
        );
        one_d(
            format!("{}_fwd", self.name()),
            &[
                ("a", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("y", Binding::ReadWrite, "f32"),
            ],
            "",
            len,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// The gradient of one output element with respect to `wrt`, times `g`.
    fn grad_expr(self, wrt: Operand) -> &'static str {
        match (self, wrt) {
            (BinaryOp::Add, _) | (BinaryOp::Sub, Operand::A) => "g",
            (BinaryOp::Sub, Operand::B) => "-g",
            (BinaryOp::Mul, Operand::A) => "g * b[ib]",
            (BinaryOp::Mul, Operand::B) => "g * a[ia]",
            (BinaryOp::Div, Operand::A) => "g / b[ib]",
            // torch: -g * a / (b * b)
            (BinaryOp::Div, Operand::B) => "-g * a[ia] / (b[ib] * b[ib])",
        }
    }

    /// Backward for one operand: bindings `a`, `b`, `dy` (read), `d` (write,
    /// shaped like the operand). Each invocation owns one element of the
    /// operand's gradient and sums over the output elements it was broadcast
    /// to, so no atomics are needed and the sum order is fixed.
    pub fn backward(self, shapes: &Broadcast, wrt: Operand) -> KernelSpec {
        let target = match wrt {
            Operand::A => &shapes.a,
            Operand::B => &shapes.b,
        };
        let rank = shapes.out.len();
        let so = strides(&shapes.out);
        let st = strides(target);
        // Output coordinates: from the target element for dimensions it has
        // (size > 1), looped over for broadcast ones.
        let mut fixed = String::from("    var base = 0u;\n");
        let mut loop_dims = Vec::new();
        for d in 0..rank {
            let td = (d + target.len()).checked_sub(rank);
            match td {
                Some(td) if target[td] == shapes.out[d] && target[td] != 1 => {
                    fixed += &format!(
                        "    base += ((i / {}u) % {}u) * {}u;\n",
                        st[td], target[td], so[d]
                    );
                }
                _ if shapes.out[d] > 1 => loop_dims.push(d),
                _ => {}
            }
        }
        let reps: usize = loop_dims.iter().map(|&d| shapes.out[d]).product();
        let loop_strides = strides(&loop_dims.iter().map(|&d| shapes.out[d]).collect::<Vec<_>>());
        let mut offset = String::from("        var o = base;\n");
        for (k, &d) in loop_dims.iter().enumerate() {
            offset += &format!(
                "        o += ((r / {}u) % {}u) * {}u;\n",
                loop_strides[k], shapes.out[d], so[d]
            );
        }
        let body = format!(
            "{fixed}    var acc = 0.0;\n    for (var r = 0u; r < {reps}u; r += 1u) {{\n{offset}\
             \x20       let g = dy[o];\n{}        acc += {};\n    }}\n    d[i] = acc;",
            shapes.offsets_wgsl().replace("    ", "        "),
            self.grad_expr(wrt)
        );
        one_d(
            format!(
                "{}_bwd_{}",
                self.name(),
                if wrt == Operand::A { "a" } else { "b" }
            ),
            &[
                ("a", Binding::Read, "f32"),
                ("b", Binding::Read, "f32"),
                ("dy", Binding::Read, "f32"),
                ("d", Binding::ReadWrite, "f32"),
            ],
            "",
            numel(target),
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    pub fn reference(self, shapes: &Broadcast, a: &[f32], b: &[f32]) -> Vec<f32> {
        (0..numel(&shapes.out))
            .map(|o| {
                let (ia, ib) = shapes.offsets(o);
                self.apply(a[ia], b[ib])
            })
            .collect()
    }

    /// CPU reference of the gradient of `wrt`, summed in f64 over broadcast
    /// dimensions.
    pub fn reference_backward(
        self,
        shapes: &Broadcast,
        a: &[f32],
        b: &[f32],
        dy: &[f32],
        wrt: Operand,
    ) -> Vec<f32> {
        let target_len = match wrt {
            Operand::A => a.len(),
            Operand::B => b.len(),
        };
        let mut acc = vec![0.0f64; target_len];
        for (o, &g) in dy.iter().enumerate() {
            let (ia, ib) = shapes.offsets(o);
            let (g, av, bv) = (f64::from(g), f64::from(a[ia]), f64::from(b[ib]));
            let (t, v) = match (self, wrt) {
                (BinaryOp::Add, Operand::A) | (BinaryOp::Sub, Operand::A) => (ia, g),
                (BinaryOp::Add, Operand::B) => (ib, g),
                (BinaryOp::Sub, Operand::B) => (ib, -g),
                (BinaryOp::Mul, Operand::A) => (ia, g * bv),
                (BinaryOp::Mul, Operand::B) => (ib, g * av),
                (BinaryOp::Div, Operand::A) => (ia, g / bv),
                (BinaryOp::Div, Operand::B) => (ib, -g * av / (bv * bv)),
            };
            acc[t] += v;
        }
        acc.into_iter().map(|v| v as f32).collect()
    }
}

/// Dropout with drop probability `p`: element `i` is kept when
/// [`dropout_hash`]`(seed, i) >= p * 2^32`, and kept elements are scaled by
/// `1 / (1 - p)` like torch's. The mask is recomputed in the backward from
/// the same seed, so nothing is stored between the passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f32,
    pub len: usize,
}

/// PCG's output permutation over 32 bits (O'Neill's `pcg_hash`), applied
/// twice to mix in both halves of the seed.
pub fn dropout_hash(seed: u64, index: u32) -> u32 {
    fn pcg(v: u32) -> u32 {
        let state = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
        let word = ((state >> ((state >> 28).wrapping_add(4))) ^ state).wrapping_mul(277_803_737);
        (word >> 22) ^ word
    }
    pcg(pcg(index ^ seed as u32) ^ (seed >> 32) as u32)
}

const DROPOUT_HELPERS: &str = r"
struct Seed { lo: u32, hi: u32, pad0: u32, pad1: u32 }
fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}
";

impl Dropout {
    /// The keep threshold on the 32-bit hash.
    fn threshold(&self) -> u32 {
        (f64::from(self.p.clamp(0.0, 1.0)) * 4_294_967_296.0).min(4_294_967_295.0) as u32
    }

    fn scale(&self) -> f32 {
        if self.p >= 1.0 {
            0.0
        } else {
            1.0 / (1.0 - self.p)
        }
    }

    /// The uniform the kernels read the seed from.
    pub fn seed_uniform(seed: u64) -> Vec<u32> {
        vec![seed as u32, (seed >> 32) as u32, 0, 0]
    }

    fn spec(&self, label: &str, input: &str, output: &str) -> KernelSpec {
        let body = format!(
            "    let h = pcg(pcg(i ^ seed.lo) ^ seed.hi);\n    {output}[i] = select(0.0, {input}[i] * {}, h >= {}u);",
            super::spec::f32_lit(self.scale()),
            self.threshold()
        );
        one_d(
            label,
            &[
                ("seed", Binding::Uniform, "Seed"),
                (input, Binding::Read, "f32"),
                (output, Binding::ReadWrite, "f32"),
            ],
            DROPOUT_HELPERS,
            self.len,
            DEFAULT_WORKGROUP,
            &body,
        )
    }

    /// Forward: bindings `seed` (uniform, [`Self::seed_uniform`]), `x`, `y`.
    pub fn forward(&self) -> KernelSpec {
        self.spec("dropout_fwd", "x", "y")
    }

    /// Backward: bindings `seed`, `dy`, `dx`; the same mask and scale.
    pub fn backward(&self) -> KernelSpec {
        self.spec("dropout_bwd", "dy", "dx")
    }

    /// CPU reference, for forward (`x`) and backward (`dy`) alike.
    pub fn reference(&self, seed: u64, x: &[f32]) -> Vec<f32> {
        let (threshold, scale) = (self.threshold(), self.scale());
        x.iter()
            .enumerate()
            .map(|(i, &v)| {
                if dropout_hash(seed, i as u32) >= threshold {
                    v * scale
                } else {
                    0.0
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn every_elementwise_shader_validates() {
        for u in UNARIES {
            for len in [1, 63, 64, 1000] {
                validate::spec(&u.forward(len));
                validate::spec(&u.backward(len));
            }
        }
        let shapes = [
            (vec![3, 1, 5], vec![4, 1]),
            (vec![7], vec![2, 3, 7]),
            (vec![1], vec![1]),
            (vec![2, 3], vec![2, 3]),
        ];
        for op in BINARY_OPS {
            for (a, b) in &shapes {
                let s = Broadcast::new(a, b).unwrap();
                validate::spec(&op.forward(&s));
                validate::spec(&op.backward(&s, Operand::A));
                validate::spec(&op.backward(&s, Operand::B));
            }
        }
        for p in [0.0, 0.3, 1.0] {
            validate::spec(&Dropout { p, len: 77 }.forward());
            validate::spec(&Dropout { p, len: 77 }.backward());
        }
    }

    #[test]
    fn broadcast_follows_numpy() {
        assert_eq!(
            Broadcast::new(&[3, 1, 5], &[4, 1]).unwrap().out,
            vec![3, 4, 5]
        );
        assert_eq!(Broadcast::new(&[], &[2]).unwrap().out, vec![2]);
        assert!(Broadcast::new(&[3], &[4]).is_none());
        let s = Broadcast::new(&[2, 1], &[3]).unwrap();
        let y = BinaryOp::Sub.reference(&s, &[10.0, 20.0], &[1.0, 2.0, 3.0]);
        assert_eq!(y, vec![9.0, 8.0, 7.0, 19.0, 18.0, 17.0]);
        let db = BinaryOp::Sub.reference_backward(
            &s,
            &[10.0, 20.0],
            &[1.0, 2.0, 3.0],
            &[1.0; 6],
            Operand::B,
        );
        assert_eq!(db, vec![-2.0, -2.0, -2.0]);
    }

    #[test]
    fn dropout_keeps_about_one_minus_p_and_scales() {
        let d = Dropout {
            p: 0.25,
            len: 10_000,
        };
        let y = d.reference(7, &vec![1.0; 10_000]);
        let kept = y.iter().filter(|&&v| v != 0.0).count();
        assert!((7200..7800).contains(&kept), "{kept}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
        assert_ne!(y, d.reference(8, &vec![1.0; 10_000]));
        assert!(Dropout { p: 0.0, len: 3 }.reference(1, &[1.0, 2.0, 3.0]) == vec![1.0, 2.0, 3.0]);
        assert!(Dropout { p: 1.0, len: 3 }.reference(1, &[1.0, 2.0, 3.0]) == vec![0.0; 3]);
    }

    #[test]
    fn activations_match_hand_values() {
        let y = Unary::Gelu.reference(&[0.0, 1.0, -1.0]);
        assert!((y[1] - 0.841_344_7).abs() < 1e-6 && (y[2] + 0.158_655_3).abs() < 1e-6);
        assert_eq!(
            Unary::Relu.reference_backward(&[0.0, 2.0], &[5.0, 5.0]),
            vec![0.0, 5.0]
        );
    }

    /// `v` moved `ulps` ULPs away from zero.
    fn slack(v: f32, ulps: f64) -> f32 {
        (0..ulps.ceil() as u32).fold(v, |v, _| if v >= 0.0 { v.next_up() } else { v.next_down() })
    }

    /// The activation helpers and formulas of the WGSL in f32, with every
    /// `exp` and division as far off as WGSL allows: `(y, dx)`. The
    /// constants are the WGSL's, digit for digit.
    #[allow(clippy::excessive_precision)]
    fn emulate(op: Unary, v: f32, g: f32) -> (f32, f32) {
        let exp = |x: f32| slack(x.exp(), crate::accuracy::exp_ulps(f64::from(x)));
        let div = |a: f32, b: f32| slack(a / b, crate::accuracy::DIVISION_ULPS);
        let sigmoid = |x: f32| div(1.0, 1.0 + exp(-x));
        let tanh = |x: f32| {
            let e = exp(-2.0 * x.abs());
            x.signum() * div(1.0 - e, 1.0 + e)
        };
        let sech2 = |x: f32| {
            let e = exp(-2.0 * x.abs());
            div(4.0 * e, (1.0 + e) * (1.0 + e))
        };
        let slope = |x: f32| {
            let e = exp(-x.abs());
            div(e, (1.0 + e) * (1.0 + e))
        };
        let erf = |x: f32| {
            let a = x.abs();
            let t = div(1.0, 1.0 + 0.3275911 * a);
            let poly = t
                * (0.254829592
                    + t * (-0.284496736
                        + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
            x.signum() * (1.0 - poly * exp(-a * a))
        };
        let c = std::f32::consts::FRAC_1_SQRT_2;
        let k = 0.797_884_6f32;
        match op {
            Unary::Sigmoid => (sigmoid(v), g * slope(v)),
            Unary::Tanh => (tanh(v), g * sech2(v)),
            Unary::Gelu => (
                0.5 * v * (1.0 + erf(v * c)),
                g * (0.5 * (1.0 + erf(v * c)) + v * 0.398_942_3 * exp(-0.5 * v * v)),
            ),
            Unary::GeluTanh => {
                let inner = k * (v + 0.044715 * v * v * v);
                let t = tanh(inner);
                (
                    0.5 * v * (1.0 + t),
                    g * (0.5 * (1.0 + t)
                        + 0.5 * v * sech2(inner) * k * (1.0 + 3.0 * 0.044715 * v * v)),
                )
            }
            _ => unreachable!("only the helper-based activations"),
        }
    }

    #[test]
    fn activations_in_f32_with_wgsls_slack_stay_within_their_error_bounds() {
        let x: Vec<f32> = crate::sample_matrix(2000, 3)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let dy = crate::sample_matrix(2000, 4);
        for op in [Unary::Sigmoid, Unary::Tanh, Unary::Gelu, Unary::GeluTanh] {
            assert_emulation_within_bounds(op, &x, &dy, |v, g| emulate(op, v, g));
        }
    }

    /// `emulate` (the kernel's formulas in f32 with WGSL's slack) gives,
    /// at each of `x` with upstream gradient `dy`, a forward and backward
    /// within `op`'s error bounds of its references.
    pub(super) fn assert_emulation_within_bounds(
        op: Unary,
        x: &[f32],
        dy: &[f32],
        emulate: impl Fn(f32, f32) -> (f32, f32),
    ) {
        let (want_y, want_dx) = (op.reference(x), op.reference_backward(x, dy));
        let (by, bdx) = op.error_bounds(x, dy);
        for i in 0..x.len() {
            let (y, dx) = emulate(x[i], dy[i]);
            for (what, got, want, bound) in
                [("y", y, want_y[i], by[i]), ("dx", dx, want_dx[i], bdx[i])]
            {
                let err = (f64::from(got) - f64::from(want)).abs();
                assert!(
                    err <= f64::from(bound),
                    "{} at {}: {what} {got} vs {want}, error {err:e} over its bound {bound:e}",
                    op.label(),
                    x[i]
                );
            }
        }
    }

    #[test]
    fn unary_error_bounds_stay_near_the_old_fixed_tolerance() {
        // The checks once held every activation to 2e-6 + 2e-5 |value|,
        // which lavapipe met; the bounds may exceed it a little (GELU's erf
        // approximation, counted whole), never by much.
        let x: Vec<f32> = crate::sample_matrix(500, 5)
            .iter()
            .map(|v| v * 4.0)
            .collect();
        let dy = crate::sample_matrix(500, 6);
        for op in UNARIES {
            let x = op_domain(op, &x);
            let (want_y, want_dx) = (op.reference(&x), op.reference_backward(&x, &dy));
            let (by, bdx) = op.error_bounds(&x, &dy);
            for i in 0..x.len() {
                for (b, want) in [(by[i], want_y[i]), (bdx[i], want_dx[i])] {
                    assert!(
                        b <= 4e-6 + 4e-5 * want.abs(),
                        "{}({}): a bound of {b:e} for {want}",
                        op.name(),
                        x[i]
                    );
                }
            }
        }
        assert!(
            Unary::Relu
                .error_bounds(&x, &dy)
                .0
                .iter()
                .all(|b| *b == 0.0)
        );
    }

    fn op_domain(op: Unary, x: &[f32]) -> Vec<f32> {
        x.iter().map(|v| op.domain(*v)).collect()
    }
}
