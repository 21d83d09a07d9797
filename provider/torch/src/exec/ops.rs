//! Op set v1 on libtorch: each [`Op`] is one (or a few) ATen calls with the
//! semantics of the PyTorch module it stands for, so autograd supplies every
//! backward. Dropout is the exception: its mask comes from a counter-based hash
//! (see [`dropout_noise`]) so that any split of a batch into stages and
//! micro-batches draws the same mask as one pass over the whole batch.

use rookery_kernels::dropout;
use rookery_kernels::elementwise::Unary;
use rookery_kernels::gemm::Precision;
use rookery_kernels::gemm::precision::{F16_MAX, GRAD_SCALE};
use rookery_model::Op;
use tch::{Kind, Tensor};

/// Why one op failed; the executor adds the node name and op.
#[derive(Debug)]
pub(crate) enum OpFailure {
    /// libtorch refused the call (shape or dtype mismatch, ...).
    Torch(tch::TchError),
    /// We refused the inputs before libtorch could (e.g. an index out of range,
    /// which on CUDA would be a device-side assert that poisons the context).
    Invalid(String),
    /// An op this backend has no mapping for yet.
    Unsupported,
}

impl From<tch::TchError> for OpFailure {
    fn from(e: tch::TchError) -> Self {
        OpFailure::Torch(e)
    }
}

type OpResult = Result<Tensor, OpFailure>;

/// Everything about the current pass an op may depend on besides its inputs.
pub(crate) struct OpContext<'a> {
    /// PyTorch's `module.train()`: dropout active, BatchNorm uses and updates batch statistics.
    pub train: bool,
    /// Per-step seed for dropout masks.
    pub seed: u64,
    /// Index, within the step's whole batch, of this micro-batch's first sample.
    pub sample_offset: u64,
    /// The node's name; it selects the node's own dropout stream.
    pub node: &'a str,
    /// How matrix products compute (the job's `precision`).
    pub precision: Precision,
}

/// `x` rounded to f16 (clamped to its range, to nearest, ties to even),
/// passing gradients through unchanged: a mixed-precision GEMM operand.
fn rounded(x: &Tensor) -> OpResult {
    let r = x
        .f_clamp(-f64::from(F16_MAX), f64::from(F16_MAX))?
        .f_to_kind(Kind::Half)?
        .f_to_kind(Kind::Float)?;
    // `r` forward (x - x is exactly 0), the identity backward.
    Ok(r.detach().f_add(&x.f_sub(&x.detach())?)?)
}

/// `y` unchanged forward, whose gradient is rounded to f16 after scaling by
/// [`GRAD_SCALE`] (and scaled back): what the GEMMs of our kernels'
/// backward see of a mixed-precision product's output gradient.
fn gradient_rounded(y: &Tensor) -> OpResult {
    let s = f64::from(GRAD_SCALE);
    // Autograd rounds the gradient where it casts it back to f16.
    let w = y
        .f_div_scalar(s)?
        .f_clamp(-f64::from(F16_MAX), f64::from(F16_MAX))?
        .f_to_kind(Kind::Half)?
        .f_to_kind(Kind::Float)?
        .f_mul_scalar(s)?;
    // Forward `w + (y - w) = y` exactly (w is y rounded more coarsely);
    // backward only through `w`.
    Ok(w.f_add(&y.f_sub(&w)?.detach())?)
}

/// The product `gemm(a, b)` as a mixed-precision GEMM of our kernels
/// computes it: operands rounded to f16, f32 sums, and (backward) the
/// output's gradient rounded as [`gradient_rounded`] says.
fn mixed_product(
    a: &Tensor,
    b: &Tensor,
    gemm: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor, tch::TchError>,
) -> OpResult {
    gradient_rounded(&gemm(&rounded(a)?, &rounded(b)?)?)
}

/// `y + bias` broadcast along `axis` of `y` (the channel of a convolution,
/// the last of a linear layer), or `y` without one.
fn plus_bias(y: Tensor, bias: Option<&Tensor>, rank: usize, axis: usize) -> OpResult {
    let Some(bias) = bias else {
        return Ok(y);
    };
    let mut shape = vec![1i64; rank];
    shape[axis] = -1;
    Ok(y.f_add(&bias.f_reshape(shape.as_slice())?)?)
}

/// Converts an attribute stored as f32 to the f64 the user wrote: `0.1f32` is
/// 0.10000000149..., but the graph came from `momentum=0.1` in Python, whose
/// ATen call receives the double 0.1. The shortest decimal that round-trips
/// the f32 recovers it.
pub(crate) fn f64_of(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&d| d as i64).collect()
}

/// Resolves a possibly negative axis against `rank` (`inclusive` allows `rank`).
fn axis(a: i64, rank: usize, inclusive: bool) -> Result<usize, OpFailure> {
    let r = rank as i64;
    let resolved = if a < 0 { a + r } else { a };
    let limit = if inclusive { r + 1 } else { r };
    if resolved < 0 || resolved >= limit.max(1) {
        return Err(OpFailure::Invalid(format!(
            "axis {a} out of range for a rank-{rank} input"
        )));
    }
    Ok(resolved as usize)
}

/// Whether [`apply`] has a mapping for `op`, so a stage can refuse a graph
/// when it is assigned rather than at its first forward. Keep in step with
/// [`apply`]'s arms.
pub(crate) fn supported(op: &Op) -> bool {
    op.as_unary().is_some()
        || matches!(
            op,
            Op::Linear
                | Op::MatMul
                | Op::Add
                | Op::Sub
                | Op::Mul
                | Op::Div
                | Op::Softmax { .. }
                | Op::LogSoftmax { .. }
                | Op::Softmin { .. }
                | Op::Conv2d { .. }
                | Op::MaxPool2d { .. }
                | Op::AvgPool2d { .. }
                | Op::GlobalAveragePool
                | Op::BatchNorm { .. }
                | Op::LayerNorm { .. }
                | Op::Flatten { .. }
                | Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Concat { .. }
                | Op::Slice { .. }
                | Op::Dropout { .. }
                | Op::Gather { .. }
                | Op::Identity
        )
}

/// Runs one op. `ins` are the node's inputs in graph order (parameters included).
pub(crate) fn apply(op: &Op, ins: &[&Tensor], ctx: &OpContext<'_>) -> OpResult {
    let Some(&x) = ins.first() else {
        return Err(OpFailure::Invalid("node has no inputs".into()));
    };
    let arg = |i: usize| -> Result<&Tensor, OpFailure> {
        ins.get(i)
            .copied()
            .ok_or_else(|| OpFailure::Invalid(format!("missing input {i}")))
    };
    Ok(match op {
        Op::Linear if ctx.precision == Precision::Mixed => {
            // The bias is added after the product, as the kernels' store does.
            let y = mixed_product(x, arg(1)?, |x, w| x.f_linear(w, None::<&Tensor>))?;
            let rank = y.dim();
            plus_bias(y, ins.get(2).copied(), rank, rank.saturating_sub(1))?
        }
        Op::Linear => x.f_linear(arg(1)?, ins.get(2).copied())?,
        Op::MatMul if ctx.precision == Precision::Mixed => {
            mixed_product(x, arg(1)?, |a, b| a.f_matmul(b))?
        }
        Op::MatMul => x.f_matmul(arg(1)?)?,
        Op::Add => x.f_add(arg(1)?)?,
        Op::Sub => x.f_sub(arg(1)?)?,
        Op::Mul => x.f_mul(arg(1)?)?,
        Op::Div => x.f_div(arg(1)?)?,
        Op::Relu => x.f_relu()?,
        // nn.GELU's default is the exact erf form, not the tanh approximation.
        Op::Gelu => x.f_gelu("none")?,
        Op::GeluTanh => x.f_gelu("tanh")?,
        Op::Sigmoid => x.f_sigmoid()?,
        Op::Tanh => x.f_tanh()?,
        Op::Neg => x.f_neg()?,
        Op::Abs => x.f_abs()?,
        Op::Sqrt => x.f_sqrt()?,
        Op::Reciprocal => x.f_reciprocal()?,
        Op::Exp => x.f_exp()?,
        Op::Log => x.f_log()?,
        Op::Softmax { axis } => x.f_softmax(*axis, None::<Kind>)?,
        Op::LogSoftmax { axis } => x.f_log_softmax(*axis, None::<Kind>)?,
        // torch.nn.functional.softmin: `(-x).softmax(dim)`.
        Op::Softmin { axis } => x.f_neg()?.f_softmax(*axis, None::<Kind>)?,
        _ if let Some(Unary::Activation(a)) = op.as_unary() => super::activation(x, a)?,
        Op::Conv2d {
            stride,
            padding,
            dilation,
            groups,
        } if ctx.precision == Precision::Mixed => {
            let y = mixed_product(x, arg(1)?, |x, w| {
                x.f_conv2d(
                    w,
                    None::<&Tensor>,
                    i64s(stride),
                    i64s(padding),
                    i64s(dilation),
                    *groups as i64,
                )
            })?;
            plus_bias(y, ins.get(2).copied(), 4, 1)?
        }
        Op::Conv2d {
            stride,
            padding,
            dilation,
            groups,
        } => x.f_conv2d(
            arg(1)?,
            ins.get(2).copied(),
            i64s(stride),
            i64s(padding),
            i64s(dilation),
            *groups as i64,
        )?,
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
        } => x.f_max_pool2d(
            i64s(kernel),
            i64s(stride),
            i64s(padding),
            i64s(dilation),
            *ceil_mode,
        )?,
        Op::AvgPool2d {
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
        } => x.f_avg_pool2d(
            i64s(kernel),
            i64s(stride),
            i64s(padding),
            *ceil_mode,
            *count_include_pad,
            None::<i64>,
        )?,
        Op::GlobalAveragePool => {
            if x.dim() == 4 {
                // What nn.AdaptiveAvgPool2d((1, 1)) runs, so the rounding matches too.
                x.f_adaptive_avg_pool2d([1i64, 1])?
            } else {
                let dims: Vec<i64> = (2..x.dim() as i64).collect();
                x.f_mean_dim(dims.as_slice(), true, None::<Kind>)?
            }
        }
        Op::BatchNorm { eps, momentum } => batch_norm(x, ins, ctx.train, *eps, *momentum)?,
        Op::LayerNorm { axis: a, eps } => {
            let a = axis(*a, x.dim(), false)?;
            let shape = x.size()[a..].to_vec();
            x.f_layer_norm(
                shape.as_slice(),
                ins.get(1).copied(),
                ins.get(2).copied(),
                f64_of(*eps),
                true,
            )?
        }
        Op::Flatten { axis: a } => {
            let size = x.size();
            let a = axis(*a, size.len(), true)?;
            let front: i64 = size[..a].iter().product();
            let back: i64 = size[a..].iter().product();
            x.f_reshape([front, back])?
        }
        Op::Reshape { shape } => {
            let size = x.size();
            let mut target = Vec::with_capacity(shape.len());
            for (i, &d) in shape.iter().enumerate() {
                // ONNX: 0 copies the input's dimension at the same position.
                target.push(match d {
                    0 => *size.get(i).ok_or_else(|| {
                        OpFailure::Invalid(format!(
                            "0 at position {i} copies a dimension {size:?} does not have"
                        ))
                    })?,
                    d => d,
                });
            }
            x.f_reshape(target.as_slice())?
        }
        Op::Transpose { perm } => x.f_permute(i64s(perm))?,
        Op::Concat { axis } => Tensor::f_cat(ins, *axis)?,
        Op::Slice {
            axis: a,
            start,
            end,
        } => {
            let a = axis(*a, x.dim(), false)?;
            x.f_narrow(a as i64, *start as i64, end.saturating_sub(*start) as i64)?
        }
        Op::Dropout { p } => {
            if !ctx.train || *p == 0.0 {
                x.shallow_clone()
            } else {
                x.f_mul(&dropout_noise(x, *p, ctx)?)?
            }
        }
        Op::Gather { axis } => gather(x, arg(1)?, *axis)?,
        Op::Identity => x.shallow_clone(),
        // The op set grows in `rookery-model` (e.g. for ONNX import) ahead of the
        // backends; an op added there without a mapping here must reach the
        // job as a clear error, not break this crate's build.
        #[allow(unreachable_patterns)]
        _ => return Err(OpFailure::Unsupported),
    })
}

/// `F.batch_norm` with the module's running statistics. In training mode ATen
/// updates `running_mean` / `running_var` in place (they are our buffer tensors)
/// and, like `nn.BatchNorm*d`, we count the batch in `num_batches_tracked`.
fn batch_norm(x: &Tensor, ins: &[&Tensor], train: bool, eps: f32, momentum: f32) -> OpResult {
    if ins.len() < 5 {
        return Err(OpFailure::Invalid(format!(
            "expects x, weight, bias, running_mean, running_var, got {} inputs",
            ins.len()
        )));
    }
    let size = x.size();
    if train {
        // The check nn.BatchNorm makes in Python (ATen would return zeros and
        // divide the unbiased running variance by zero).
        let per_channel: i64 =
            size.first().copied().unwrap_or(1) * size.iter().skip(2).product::<i64>();
        if per_channel <= 1 {
            return Err(OpFailure::Invalid(format!(
                "expected more than 1 value per channel when training, got input size {size:?}"
            )));
        }
    }
    let out = x.f_batch_norm(
        Some(ins[1]),
        Some(ins[2]),
        Some(ins[3]),
        Some(ins[4]),
        train,
        f64_of(momentum),
        f64_of(eps),
        true,
    )?;
    if train && let Some(count) = ins.get(5) {
        let _ = tch::no_grad(|| count.shallow_clone().f_add_scalar_(1i64))?;
    }
    Ok(out)
}

/// ONNX Gather (and so `nn.Embedding`): indices may be negative (counted from
/// the end, as ONNX allows); anything outside `[-n, n)` is refused here.
fn gather(data: &Tensor, indices: &Tensor, a: i64) -> OpResult {
    if indices.kind() != Kind::Int64 {
        return Err(OpFailure::Invalid(format!(
            "indices must be i64, got {:?}",
            indices.kind()
        )));
    }
    let size = data.size();
    let a = axis(a, size.len(), false)?;
    let n = size[a];
    let mut idx = indices.shallow_clone();
    if indices.numel() > 0 {
        let lo = indices.f_min()?.f_int64_value(&[])?;
        let hi = indices.f_max()?.f_int64_value(&[])?;
        if lo < -n || hi >= n {
            return Err(OpFailure::Invalid(format!(
                "index out of range: indices span [{lo}, {hi}] but axis {a} has size {n}"
            )));
        }
        if lo < 0 {
            // torch's remainder takes the divisor's sign, so -1 becomes n - 1.
            idx = indices.f_remainder(n)?;
        }
    }
    if a == 0 && size.len() == 2 {
        // Exactly nn.Embedding (no padding index), including its backward.
        return Ok(Tensor::f_embedding(data, &idx, -1, false, false)?);
    }
    let picked = data.f_index_select(a as i64, &idx.f_reshape([-1i64])?)?;
    let mut shape = size[..a].to_vec();
    shape.extend(idx.size());
    shape.extend(&size[a + 1..]);
    Ok(picked.f_reshape(shape.as_slice())?)
}

/// The dropout multiplier (0 or `1 / (1 - p)`, as ATen's `input * noise`), drawn
/// so a pipeline and a single process agree, by the rules of
/// `rookery_kernels::dropout` (which our WGSL kernel follows too);
/// dimension 0 is the batch.
pub(crate) fn dropout_noise(x: &Tensor, p: f32, ctx: &OpContext<'_>) -> OpResult {
    let size = x.size();
    let numel: i64 = size.iter().product();
    let per_sample = if size.is_empty() || size[0] == 0 {
        numel.max(1)
    } else {
        numel / size[0]
    } as u64;
    let key = dropout::key(ctx.seed, ctx.node);
    let first = ctx.sample_offset.wrapping_mul(per_sample);
    let noise = dropout::noise(key, first, numel as usize, p, dropout::scale(p));
    Ok(Tensor::f_from_slice(&noise)?
        .f_reshape(size.as_slice())?
        .f_to_kind(x.kind())?
        .f_to_device(x.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_convert_to_the_decimal_the_user_wrote() {
        assert_eq!(f64_of(0.1), 0.1);
        assert_eq!(f64_of(1e-5), 1e-5);
        assert_eq!(f64_of(0.5), 0.5);
    }

    #[test]
    fn negative_and_inclusive_axes_resolve_like_onnx() {
        assert_eq!(axis(-1, 3, false).ok(), Some(2));
        assert_eq!(axis(3, 3, true).ok(), Some(3));
        assert!(axis(3, 3, false).is_err());
        assert!(axis(-4, 3, false).is_err());
    }
}
