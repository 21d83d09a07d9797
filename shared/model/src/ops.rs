//! Op set v1: attributes, shape inference and cost estimates. Ops are plain data
//! (an enum with numeric attributes), which is what makes a graph safe to accept
//! from anyone: the executing backends (tch, WGSL, CPU reference) own the code.

use serde::{Deserialize, Serialize};

use rookery_kernels::conv::Conv2d;
use rookery_kernels::elementwise::{Activation, F32Bits, Unary};
use rookery_kernels::pool::Pool2d;

use crate::tensor::{DType, TensorInfo};

/// One operation. Inputs are positional tensor names on the [`crate::Node`];
/// parameters are ordinary inputs (as ONNX initializers are).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op")]
pub enum Op {
    /// PyTorch `nn.Linear` / ONNX `Gemm(transB=1)`: inputs x [.., in], weight [out, in], bias? [out].
    #[serde(alias = "Gemm")]
    Linear,
    /// Numpy-style matmul of rank >= 2 tensors, batch dimensions broadcast.
    MatMul,
    Add,
    /// Elementwise `a - b`, broadcast like [`Op::Add`].
    Sub,
    Mul,
    /// Elementwise `a / b`, broadcast like [`Op::Add`] (attention's `/ sqrt(d)`).
    Div,
    Relu,
    Gelu,
    /// GELU's tanh approximation (PyTorch `approximate="tanh"`).
    GeluTanh,
    Sigmoid,
    Tanh,
    /// Elementwise `-x` (ONNX `Neg`).
    Neg,
    /// Elementwise `|x|`.
    Abs,
    /// Elementwise square root (NaN below 0, as IEEE has it).
    Sqrt,
    /// Elementwise `1 / x`.
    Reciprocal,
    Exp,
    /// Elementwise natural logarithm.
    Log,
    /// torch `nn.LeakyReLU`, ONNX `LeakyRelu`: `x` where `x > 0`, else
    /// `negative_slope * x`.
    LeakyRelu {
        #[serde(default = "default_negative_slope")]
        negative_slope: f32,
    },
    /// torch `nn.ELU`, ONNX `Elu`: `alpha (exp(x) - 1)` at and below 0.
    Elu {
        #[serde(default = "one")]
        alpha: f32,
    },
    /// torch `nn.SELU`, ONNX `Selu` with its default constants.
    Selu,
    /// torch `nn.Softplus`: `log(1 + exp(beta x)) / beta`, and `x` where
    /// `beta x > threshold`.
    Softplus {
        #[serde(default = "one")]
        beta: f32,
        #[serde(default = "twenty")]
        threshold: f32,
    },
    /// `x / (1 + |x|)`.
    Softsign,
    /// `x - tanh(x)`.
    Tanhshrink,
    /// `log(sigmoid(x))`, computed without overflow.
    LogSigmoid,
    /// 0 where `-lambd <= x <= lambd`, else `x`.
    Hardshrink {
        #[serde(default = "half")]
        lambd: f32,
    },
    /// `x` clamped to `[min_val, max_val]`, gradient 0 at and beyond the ends
    /// (also ReLU6, and ONNX `Clip` with constant bounds).
    Hardtanh {
        #[serde(default = "minus_one")]
        min_val: f32,
        #[serde(default = "one")]
        max_val: f32,
    },
    /// 0 where `-lambd <= x <= lambd`, else `x` moved `lambd` toward 0.
    Softshrink {
        #[serde(default = "half")]
        lambd: f32,
    },
    /// torch `nn.Threshold`: `value` where `x <= threshold`, else `x`.
    Threshold {
        threshold: f32,
        value: f32,
    },
    /// `softmax(-x)` along `axis` (torch `nn.Softmin`).
    Softmin {
        axis: i64,
    },
    Softmax {
        axis: i64,
    },
    LogSoftmax {
        axis: i64,
    },
    /// Inputs x [N, C, H, W], weight [O, C/groups, kh, kw], bias? [O].
    Conv2d {
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
    },
    MaxPool2d {
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        /// Spacing of a window's taps (ONNX `dilations`, torch `dilation`).
        #[serde(default = "adjacent", skip_serializing_if = "is_adjacent")]
        dilation: [usize; 2],
        /// Output sizes round up (`ceil_mode`).
        #[serde(default, skip_serializing_if = "is_false")]
        ceil_mode: bool,
    },
    AvgPool2d {
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        #[serde(default, skip_serializing_if = "is_false")]
        ceil_mode: bool,
        /// Padding counts in the divisor: PyTorch's default, ONNX's
        /// `count_include_pad = 1`.
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        count_include_pad: bool,
    },
    /// [N, C, H, W] -> [N, C, 1, 1].
    GlobalAveragePool,
    /// Inputs x [N, C, ..], weight [C], bias [C], running_mean [C], running_var [C],
    /// optionally num_batches_tracked []. Train/eval is the job's mode, not the graph's.
    BatchNorm {
        eps: f32,
        momentum: f32,
    },
    /// Normalises dimensions `axis..`; inputs x, weight?, bias? shaped like those dimensions.
    LayerNorm {
        axis: i64,
        eps: f32,
    },
    /// ONNX `Flatten`: [d0..d(axis-1), d(axis)..] -> [prod(front), prod(back)].
    Flatten {
        axis: i64,
    },
    /// ONNX `Reshape`: 0 copies the input dimension, -1 is inferred.
    Reshape {
        shape: Vec<i64>,
    },
    Transpose {
        perm: Vec<usize>,
    },
    Concat {
        axis: i64,
    },
    /// Elements `start..end` along `axis` (ONNX `Slice` with step 1, `Split`,
    /// and a `Gather` of consecutive constant indices: attention's q, k, v).
    Slice {
        axis: i64,
        start: usize,
        end: usize,
    },
    Dropout {
        p: f32,
    },
    /// ONNX `Gather` (PyTorch `nn.Embedding` is `Gather(weight, indices, axis=0)`):
    /// inputs data, indices (i64).
    #[serde(alias = "Embedding")]
    Gather {
        axis: i64,
    },
    Identity,
}

fn default_negative_slope() -> f32 {
    0.01
}

fn one() -> f32 {
    1.0
}

fn minus_one() -> f32 {
    -1.0
}

fn half() -> f32 {
    0.5
}

fn twenty() -> f32 {
    20.0
}

fn adjacent() -> [usize; 2] {
    [1, 1]
}

fn is_adjacent(d: &[usize; 2]) -> bool {
    *d == [1, 1]
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Why an op rejected its inputs; the graph adds the node name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum OpError {
    Shape(String),
    Invalid(String),
}

type OpResult<T> = Result<T, OpError>;

fn shape_err<T>(msg: impl Into<String>) -> OpResult<T> {
    Err(OpError::Shape(msg.into()))
}

fn invalid<T>(msg: impl Into<String>) -> OpResult<T> {
    Err(OpError::Invalid(msg.into()))
}

/// Element count, saturating: estimates for absurd shapes must not overflow.
fn numel(shape: &[usize]) -> u64 {
    shape
        .iter()
        .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
}

/// Largest tensor shape inference accepts (2^40 elements, terabytes): anything
/// larger comes from a broken or hostile graph, and rejecting it keeps every
/// estimate far from overflowing.
const MAX_ELEMENTS: u64 = 1 << 40;

/// Resolves a possibly negative axis against `rank` (`inclusive` allows `rank` itself).
fn axis_of(axis: i64, rank: usize, inclusive: bool) -> OpResult<usize> {
    let r = rank as i64 + i64::from(inclusive);
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a >= r.max(1) {
        return invalid(format!("axis {axis} out of range for rank {rank}"));
    }
    Ok(a as usize)
}

fn broadcast(a: &[usize], b: &[usize]) -> OpResult<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return shape_err(format!("cannot broadcast {a:?} with {b:?}")),
        };
    }
    Ok(out)
}

/// Output size of a convolution or pooling window along one dimension.
fn window_out(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dil: usize,
    what: &str,
) -> OpResult<usize> {
    if kernel == 0 || stride == 0 || dil == 0 {
        return invalid(format!("{what}: kernel, stride and dilation must be >= 1"));
    }
    // Checked: graphs come from strangers (and ONNX files), and an absurd
    // attribute must be an error, not an overflow.
    let (Some(span), Some(padded)) = (
        dil.checked_mul(kernel - 1).and_then(|s| s.checked_add(1)),
        pad.checked_mul(2).and_then(|p| p.checked_add(len)),
    ) else {
        return invalid(format!(
            "{what}: kernel {kernel}, dilation {dil} or padding {pad} out of range"
        ));
    };
    if padded < span {
        return shape_err(format!(
            "{what}: window {span} larger than padded input {padded}"
        ));
    }
    Ok((padded - span) / stride + 1)
}

fn f32_input(x: &TensorInfo, which: &str) -> OpResult<()> {
    if x.dtype != DType::F32 {
        return invalid(format!("{which} must be f32, got {:?}", x.dtype));
    }
    Ok(())
}

impl Op {
    /// [`Op::MaxPool2d`] when `max`, else [`Op::AvgPool2d`]: layer specs and
    /// ONNX files both describe the two with the same fields.
    pub(crate) fn pool2d(
        max: bool,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Op {
        if max {
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
                dilation: adjacent(),
                ceil_mode: false,
            }
        } else {
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode: false,
                count_include_pad: true,
            }
        }
    }

    /// A pooling op's windows over `planes` planes of `h x w`: what every
    /// executor runs and shape inference sizes the output by. `None` for
    /// other ops and for geometry no executor runs (padding over half the
    /// window, as PyTorch refuses, or a window without a tap inside the
    /// input).
    pub fn pool_geometry(&self, planes: usize, h: usize, w: usize) -> Option<Pool2d> {
        let (kernel, stride, padding, dilation, ceil, include) = match *self {
            Op::MaxPool2d {
                kernel,
                stride,
                padding,
                dilation,
                ceil_mode,
            } => (kernel, stride, padding, dilation, ceil_mode, true),
            Op::AvgPool2d {
                kernel,
                stride,
                padding,
                ceil_mode,
                count_include_pad,
            } => (
                kernel,
                stride,
                padding,
                [1, 1],
                ceil_mode,
                count_include_pad,
            ),
            _ => return None,
        };
        Pool2d::new(planes, h, w, kernel, stride, padding)?.with_options(dilation, ceil, include)
    }

    /// A convolution's geometry for input `x [N, C, H, W]` and `weight [O,
    /// C/groups, kh, kw]` (with a bias or not): what every executor runs and
    /// the planner sizes. `None` for other ops, for shapes of another rank
    /// and for geometry [`Conv2d::new`] refuses.
    pub fn conv_geometry(&self, x: &[usize], weight: &[usize], bias: bool) -> Option<Conv2d> {
        let Op::Conv2d {
            stride,
            padding,
            dilation,
            groups,
        } = *self
        else {
            return None;
        };
        let (&[n, c, h, w], &[o, _, kh, kw]) = (x, weight) else {
            return None;
        };
        Conv2d::new(
            [n, c, h, w],
            o,
            [kh, kw],
            stride,
            padding,
            dilation,
            groups,
            bias,
        )
    }

    /// The elementwise kernel of a one-input op that maps each element on
    /// its own (activations, unary arithmetic, `Identity`): the one list
    /// every executor lowers these from.
    pub fn as_unary(&self) -> Option<Unary> {
        Some(match self {
            Op::Relu => Unary::Relu,
            Op::Gelu => Unary::Gelu,
            Op::GeluTanh => Unary::GeluTanh,
            Op::Sigmoid => Unary::Sigmoid,
            Op::Tanh => Unary::Tanh,
            Op::Neg => Unary::Neg,
            Op::Abs => Unary::Abs,
            Op::Sqrt => Unary::Sqrt,
            Op::Reciprocal => Unary::Reciprocal,
            Op::Exp => Unary::Exp,
            Op::Log => Unary::Log,
            Op::Identity => Unary::Identity,
            _ => Unary::Activation(self.activation()?),
        })
    }

    /// The kernels' [`Activation`] of the parametrised activations.
    fn activation(&self) -> Option<Activation> {
        let p = F32Bits::new;
        Some(match *self {
            Op::LeakyRelu { negative_slope } => Activation::LeakyRelu {
                negative_slope: p(negative_slope),
            },
            Op::Elu { alpha } => Activation::Elu { alpha: p(alpha) },
            Op::Selu => Activation::Selu,
            Op::Softplus { beta, threshold } => Activation::Softplus {
                beta: p(beta),
                threshold: p(threshold),
            },
            Op::Softsign => Activation::Softsign,
            Op::Tanhshrink => Activation::Tanhshrink,
            Op::LogSigmoid => Activation::LogSigmoid,
            Op::Hardshrink { lambd } => Activation::Hardshrink { lambd: p(lambd) },
            Op::Hardtanh { min_val, max_val } => Activation::Hardtanh {
                min_val: p(min_val),
                max_val: p(max_val),
            },
            Op::Softshrink { lambd } => Activation::Softshrink { lambd: p(lambd) },
            Op::Threshold { threshold, value } => Activation::Threshold {
                threshold: p(threshold),
                value: p(value),
            },
            _ => return None,
        })
    }

    /// Refuses an activation's parameters torch refuses, or that no
    /// executor could honour (non-finite values, which JSON cannot carry).
    fn check_activation(&self) -> OpResult<()> {
        let Some(a) = self.activation() else {
            return Ok(());
        };
        if let Some(v) = a.params().iter().find(|v| !v.is_finite()) {
            return invalid(format!("parameter {v} must be finite"));
        }
        match *self {
            Op::Softplus { beta: 0.0, .. } => invalid("beta must not be 0"),
            Op::Softshrink { lambd } if lambd < 0.0 => {
                invalid(format!("lambd = {lambd} must be >= 0"))
            }
            Op::Hardtanh { min_val, max_val } if min_val > max_val => invalid(format!(
                "min_val = {min_val} must not exceed max_val = {max_val}"
            )),
            _ => Ok(()),
        }
    }

    /// The op's name as used in error messages and plans.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Linear => "Linear",
            Op::MatMul => "MatMul",
            Op::Add => "Add",
            Op::Sub => "Sub",
            Op::Mul => "Mul",
            Op::Div => "Div",
            Op::Relu => "Relu",
            Op::Gelu => "Gelu",
            Op::GeluTanh => "GeluTanh",
            Op::Sigmoid => "Sigmoid",
            Op::Tanh => "Tanh",
            Op::Neg => "Neg",
            Op::Abs => "Abs",
            Op::Sqrt => "Sqrt",
            Op::Reciprocal => "Reciprocal",
            Op::Exp => "Exp",
            Op::Log => "Log",
            Op::LeakyRelu { .. } => "LeakyRelu",
            Op::Elu { .. } => "Elu",
            Op::Selu => "Selu",
            Op::Softplus { .. } => "Softplus",
            Op::Softsign => "Softsign",
            Op::Tanhshrink => "Tanhshrink",
            Op::LogSigmoid => "LogSigmoid",
            Op::Hardshrink { .. } => "Hardshrink",
            Op::Hardtanh { .. } => "Hardtanh",
            Op::Softshrink { .. } => "Softshrink",
            Op::Threshold { .. } => "Threshold",
            Op::Softmin { .. } => "Softmin",
            Op::Softmax { .. } => "Softmax",
            Op::LogSoftmax { .. } => "LogSoftmax",
            Op::Conv2d { .. } => "Conv2d",
            Op::MaxPool2d { .. } => "MaxPool2d",
            Op::AvgPool2d { .. } => "AvgPool2d",
            Op::GlobalAveragePool => "GlobalAveragePool",
            Op::BatchNorm { .. } => "BatchNorm",
            Op::LayerNorm { .. } => "LayerNorm",
            Op::Flatten { .. } => "Flatten",
            Op::Reshape { .. } => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Concat { .. } => "Concat",
            Op::Slice { .. } => "Slice",
            Op::Dropout { .. } => "Dropout",
            Op::Gather { .. } => "Gather",
            Op::Identity => "Identity",
        }
    }

    /// Smallest and largest number of inputs.
    fn arity(&self) -> (usize, usize) {
        match self {
            Op::Linear => (2, 3),
            Op::MatMul | Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Gather { .. } => (2, 2),
            Op::Conv2d { .. } => (2, 3),
            Op::BatchNorm { .. } => (5, 6),
            Op::LayerNorm { .. } => (1, 3),
            Op::Concat { .. } => (1, usize::MAX),
            _ => (1, 1),
        }
    }

    /// Backward FLOPs as a multiple of forward FLOPs. Ops with weights compute
    /// gradients for both the input and the weight (2x); elementwise ops only
    /// for the input (1x); data movement has no arithmetic.
    pub fn backward_factor(&self) -> f64 {
        match self {
            Op::Linear | Op::MatMul | Op::Conv2d { .. } => 2.0,
            Op::Flatten { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Identity
            | Op::Gather { .. } => 0.0,
            Op::BatchNorm { .. } | Op::LayerNorm { .. } => 2.0,
            _ => 1.0,
        }
    }

    /// Output shape and dtype for the given inputs.
    pub(crate) fn infer(&self, ins: &[TensorInfo]) -> OpResult<TensorInfo> {
        let out = self.infer_unchecked(ins)?;
        if numel(&out.shape) > MAX_ELEMENTS {
            return shape_err(format!("output shape {:?} is implausibly large", out.shape));
        }
        Ok(out)
    }

    fn infer_unchecked(&self, ins: &[TensorInfo]) -> OpResult<TensorInfo> {
        let (lo, hi) = self.arity();
        if ins.len() < lo || ins.len() > hi {
            let want = if lo == hi {
                format!("{lo}")
            } else if hi == usize::MAX {
                format!("at least {lo}")
            } else {
                format!("{lo} to {hi}")
            };
            return invalid(format!("expects {want} inputs, got {}", ins.len()));
        }
        let x = &ins[0];
        let f32_out = |shape: Vec<usize>| TensorInfo {
            shape,
            dtype: DType::F32,
        };
        match self {
            Op::Linear => {
                f32_input(x, "input")?;
                let w = &ins[1].shape;
                let Some(&k) = x.shape.last() else {
                    return shape_err("input must have rank >= 1");
                };
                if w.len() != 2 || w[1] != k {
                    return shape_err(format!(
                        "weight {w:?} must be [out, {k}] for input {:?}",
                        x.shape
                    ));
                }
                if let Some(b) = ins.get(2)
                    && b.shape != [w[0]]
                {
                    return shape_err(format!("bias {:?} must be [{}]", b.shape, w[0]));
                }
                let mut out = x.shape.clone();
                let last = out.len() - 1;
                out[last] = w[0];
                Ok(f32_out(out))
            }
            Op::MatMul => {
                let (a, b) = (&x.shape, &ins[1].shape);
                f32_input(x, "a")?;
                f32_input(&ins[1], "b")?;
                if a.len() < 2 || b.len() < 2 {
                    return shape_err(format!("operands {a:?} and {b:?} must have rank >= 2"));
                }
                let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
                let (k2, n) = (b[b.len() - 2], b[b.len() - 1]);
                if k != k2 {
                    return shape_err(format!("inner dimensions differ: {a:?} x {b:?}"));
                }
                let mut out = broadcast(&a[..a.len() - 2], &b[..b.len() - 2])?;
                out.extend([m, n]);
                Ok(f32_out(out))
            }
            Op::Add | Op::Sub | Op::Mul | Op::Div => {
                f32_input(x, "a")?;
                f32_input(&ins[1], "b")?;
                Ok(f32_out(broadcast(&x.shape, &ins[1].shape)?))
            }
            Op::Relu
            | Op::Gelu
            | Op::GeluTanh
            | Op::Sigmoid
            | Op::Tanh
            | Op::Neg
            | Op::Abs
            | Op::Sqrt
            | Op::Reciprocal
            | Op::Exp
            | Op::Log
            | Op::LeakyRelu { .. }
            | Op::Elu { .. }
            | Op::Selu
            | Op::Softplus { .. }
            | Op::Softsign
            | Op::Tanhshrink
            | Op::LogSigmoid
            | Op::Hardshrink { .. }
            | Op::Hardtanh { .. }
            | Op::Softshrink { .. }
            | Op::Threshold { .. }
            | Op::Dropout { .. } => {
                f32_input(x, "input")?;
                self.check_activation()?;
                if let Op::Dropout { p } = self
                    && !(0.0..1.0).contains(p)
                {
                    return invalid(format!("p = {p} must be in [0, 1)"));
                }
                Ok(x.clone())
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Softmin { axis } => {
                f32_input(x, "input")?;
                axis_of(*axis, x.shape.len(), false)?;
                Ok(x.clone())
            }
            Op::Conv2d {
                stride,
                padding,
                dilation,
                groups,
            } => {
                f32_input(x, "input")?;
                let (s, w) = (&x.shape, &ins[1].shape);
                if s.len() != 4 || w.len() != 4 {
                    return shape_err(format!("input {s:?} and weight {w:?} must both be rank 4"));
                }
                let g = *groups;
                if g == 0 || s[1] % g != 0 || w[0] % g != 0 {
                    return shape_err(format!(
                        "groups {g} must divide input channels {} and output channels {}",
                        s[1], w[0]
                    ));
                }
                if w[1] != s[1] / g {
                    return shape_err(format!(
                        "weight {w:?} expects {} input channels per group, input {s:?} has {}",
                        w[1],
                        s[1] / g
                    ));
                }
                if let Some(b) = ins.get(2)
                    && b.shape != [w[0]]
                {
                    return shape_err(format!("bias {:?} must be [{}]", b.shape, w[0]));
                }
                let h = window_out(s[2], w[2], stride[0], padding[0], dilation[0], "height")?;
                let wd = window_out(s[3], w[3], stride[1], padding[1], dilation[1], "width")?;
                Ok(f32_out(vec![s[0], w[0], h, wd]))
            }
            Op::MaxPool2d {
                kernel, padding, ..
            }
            | Op::AvgPool2d {
                kernel, padding, ..
            } => {
                f32_input(x, "input")?;
                let s = &x.shape;
                if s.len() != 4 {
                    return shape_err(format!("input {s:?} must be [N, C, H, W]"));
                }
                let Some(pool) = s[0]
                    .checked_mul(s[1])
                    .and_then(|planes| self.pool_geometry(planes, s[2], s[3]))
                else {
                    return invalid(format!(
                        "no valid pooling of {s:?} with kernel {kernel:?} and padding \
                         {padding:?} (padding at most half the window, every window with a \
                         tap inside the input)"
                    ));
                };
                let (h, w) = pool.out_hw();
                Ok(f32_out(vec![s[0], s[1], h, w]))
            }
            Op::GlobalAveragePool => {
                f32_input(x, "input")?;
                let s = &x.shape;
                if s.len() < 3 {
                    return shape_err(format!("input {s:?} must be [N, C, spatial..]"));
                }
                let mut out = s[..2].to_vec();
                out.extend(std::iter::repeat_n(1, s.len() - 2));
                Ok(f32_out(out))
            }
            Op::BatchNorm { eps, momentum } => {
                f32_input(x, "input")?;
                if *eps <= 0.0 || !(0.0..=1.0).contains(momentum) {
                    return invalid(format!(
                        "eps {eps} must be > 0 and momentum {momentum} in [0, 1]"
                    ));
                }
                let s = &x.shape;
                if s.len() < 2 {
                    return shape_err(format!("input {s:?} must be [N, C, ..]"));
                }
                let names = ["weight", "bias", "running_mean", "running_var"];
                for (t, name) in ins[1..5].iter().zip(names) {
                    if t.shape != [s[1]] {
                        return shape_err(format!(
                            "{name} {:?} must be [{}] for input {s:?}",
                            t.shape, s[1]
                        ));
                    }
                }
                if let Some(t) = ins.get(5)
                    && !(t.shape.is_empty() || t.shape == [1])
                {
                    return shape_err(format!(
                        "num_batches_tracked {:?} must be a scalar",
                        t.shape
                    ));
                }
                Ok(x.clone())
            }
            Op::LayerNorm { axis, eps } => {
                f32_input(x, "input")?;
                if *eps <= 0.0 {
                    return invalid(format!("eps {eps} must be > 0"));
                }
                let a = axis_of(*axis, x.shape.len(), false)?;
                let norm = &x.shape[a..];
                for (t, name) in ins[1..].iter().zip(["weight", "bias"]) {
                    if t.shape != norm {
                        return shape_err(format!(
                            "{name} {:?} must be {norm:?} (input {:?} from axis {a})",
                            t.shape, x.shape
                        ));
                    }
                }
                Ok(x.clone())
            }
            Op::Flatten { axis } => {
                let a = axis_of(*axis, x.shape.len(), true)?;
                let front = x.shape[..a].iter().product();
                let back = x.shape[a..].iter().product();
                Ok(TensorInfo {
                    shape: vec![front, back],
                    dtype: x.dtype,
                })
            }
            Op::Reshape { shape } => {
                let total = numel(&x.shape);
                let mut out = Vec::with_capacity(shape.len());
                let mut infer_at = None;
                for (i, &d) in shape.iter().enumerate() {
                    match d {
                        -1 if infer_at.is_none() => {
                            infer_at = Some(i);
                            out.push(1);
                        }
                        0 => match x.shape.get(i) {
                            Some(&d) => out.push(d),
                            None => {
                                return shape_err(format!(
                                    "0 at position {i} copies a dimension {:?} does not have",
                                    x.shape
                                ));
                            }
                        },
                        d if d > 0 => out.push(d as usize),
                        _ => return invalid(format!("bad target shape {shape:?}")),
                    }
                }
                let known = numel(&out);
                if let Some(i) = infer_at {
                    if known == 0 || !total.is_multiple_of(known) {
                        return shape_err(format!(
                            "cannot reshape {:?} ({total} elements) to {shape:?}",
                            x.shape
                        ));
                    }
                    out[i] = (total / known) as usize;
                } else if known != total {
                    return shape_err(format!(
                        "cannot reshape {:?} ({total} elements) to {shape:?}",
                        x.shape
                    ));
                }
                Ok(TensorInfo {
                    shape: out,
                    dtype: x.dtype,
                })
            }
            Op::Transpose { perm } => {
                let mut seen = vec![false; x.shape.len()];
                if perm.len() != x.shape.len() {
                    return shape_err(format!(
                        "perm {perm:?} does not match rank of {:?}",
                        x.shape
                    ));
                }
                for &p in perm {
                    match seen.get_mut(p) {
                        Some(s) if !*s => *s = true,
                        _ => return invalid(format!("perm {perm:?} is not a permutation")),
                    }
                }
                Ok(TensorInfo {
                    shape: perm.iter().map(|&p| x.shape[p]).collect(),
                    dtype: x.dtype,
                })
            }
            Op::Concat { axis } => {
                let a = axis_of(*axis, x.shape.len(), false)?;
                let mut out = x.shape.clone();
                for t in &ins[1..] {
                    let same_rest = t.shape.len() == x.shape.len()
                        && (0..x.shape.len()).all(|i| i == a || t.shape[i] == x.shape[i]);
                    if !same_rest || t.dtype != x.dtype {
                        return shape_err(format!(
                            "{:?} and {:?} differ outside axis {a}",
                            x.shape, t.shape
                        ));
                    }
                    out[a] += t.shape[a];
                }
                Ok(TensorInfo {
                    shape: out,
                    dtype: x.dtype,
                })
            }
            Op::Slice { axis, start, end } => {
                let a = axis_of(*axis, x.shape.len(), false)?;
                if start >= end || *end > x.shape[a] {
                    return shape_err(format!(
                        "elements {start}..{end} of axis {a} of {:?}",
                        x.shape
                    ));
                }
                let mut out = x.shape.clone();
                out[a] = end - start;
                Ok(TensorInfo {
                    shape: out,
                    dtype: x.dtype,
                })
            }
            Op::Gather { axis } => {
                let idx = &ins[1];
                if idx.dtype != DType::I64 {
                    return invalid(format!("indices must be i64, got {:?}", idx.dtype));
                }
                let a = axis_of(*axis, x.shape.len(), false)?;
                let mut out = x.shape[..a].to_vec();
                out.extend(&idx.shape);
                out.extend(&x.shape[a + 1..]);
                Ok(TensorInfo {
                    shape: out,
                    dtype: x.dtype,
                })
            }
            Op::Identity => Ok(x.clone()),
        }
    }

    /// Forward FLOPs for the whole (example-batch) input; a multiply-add counts 2.
    pub(crate) fn flops(&self, ins: &[TensorInfo], out: &TensorInfo) -> u64 {
        let n_out = numel(&out.shape);
        match self {
            Op::Linear => {
                let k = ins[0].shape.last().copied().unwrap_or(1) as u64;
                mac_flops(n_out, k, ins.len() > 2)
            }
            Op::MatMul => {
                let k = ins[0].shape.last().copied().unwrap_or(1) as u64;
                mac_flops(n_out, k, false)
            }
            Op::Conv2d { .. } => {
                let per_out = numel(ins[1].shape.get(1..).unwrap_or_default());
                mac_flops(n_out, per_out, ins.len() > 2)
            }
            Op::MaxPool2d { kernel, .. } | Op::AvgPool2d { kernel, .. } => {
                n_out.saturating_mul(numel(kernel))
            }
            Op::GlobalAveragePool => numel(&ins[0].shape),
            Op::Add
            | Op::Sub
            | Op::Mul
            | Op::Div
            | Op::Relu
            | Op::Neg
            | Op::Abs
            | Op::Reciprocal
            | Op::LeakyRelu { .. }
            | Op::Hardshrink { .. }
            | Op::Hardtanh { .. }
            | Op::Softshrink { .. }
            | Op::Threshold { .. }
            | Op::Dropout { .. } => n_out,
            Op::Softsign => n_out.saturating_mul(3),
            Op::Sqrt | Op::Exp | Op::Log => n_out.saturating_mul(4),
            // Transcendentals cost more than one FLOP; these are the usual rough counts.
            Op::Sigmoid | Op::Tanh | Op::Elu { .. } | Op::Selu => n_out.saturating_mul(4),
            Op::Tanhshrink => n_out.saturating_mul(5),
            Op::Gelu | Op::GeluTanh | Op::Softplus { .. } | Op::LogSigmoid => {
                n_out.saturating_mul(8)
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => n_out.saturating_mul(5),
            Op::Softmin { .. } => n_out.saturating_mul(6),
            Op::BatchNorm { .. } | Op::LayerNorm { .. } => n_out.saturating_mul(5),
            Op::Flatten { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Gather { .. }
            | Op::Identity => 0,
        }
    }
}

/// Multiply-adds (2 FLOPs each) of `k` per output element, plus a bias add.
fn mac_flops(n_out: u64, k: u64, bias: bool) -> u64 {
    n_out
        .saturating_mul(k)
        .saturating_mul(2)
        .saturating_add(if bias { n_out } else { 0 })
}
