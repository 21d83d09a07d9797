//! Losses the Leaf computes: cross-entropy over logits with i64 class labels
//! (classes at dimension 1 or last, with `ignore_index`) and mean squared
//! error, both with PyTorch's `reduction="mean"`.
//!
//! Micro-batching: a step's mean loss is the sum of its per-target losses
//! over its `T` targets (cross-entropy: the labels that are not
//! `ignore_index`; MSE: its samples, each sample's mean counting once). A
//! micro-batch contributes `sum_i / T`, which is what [`micro_batch_loss`]
//! backpropagates, so summing the returned `scaled` over a step's
//! micro-batches gives the step's mean loss and the accumulated parameter
//! gradients are the whole step's, however the ignored targets fall.

use rookery_model::{ClassAxis, Loss};
use tch::{Kind, Reduction, Tensor};

use super::ExecError;

/// One micro-batch's loss and the gradient that starts backward on the Leaf.
#[derive(Debug)]
pub struct LossOutput {
    /// The micro-batch's summed per-target loss.
    pub sum: f64,
    /// `sum / step_targets`: this micro-batch's contribution to the step's mean loss.
    pub scaled: f64,
    /// Gradient of the scaled loss w.r.t. the output, for [`super::TorchExecutor::backward`].
    pub grad: Tensor,
}

/// The targets a step's mean loss divides by: `labels`' entries other than
/// `ignore_index` for cross-entropy, its samples (dimension 0) for MSE.
pub fn loss_targets(loss: Loss, labels: &Tensor) -> Result<u64, ExecError> {
    Ok(match loss {
        Loss::CrossEntropy { ignore_index, .. } => host_labels(labels)?
            .iter()
            .filter(|&&l| l != ignore_index)
            .count() as u64,
        Loss::Mse => labels.size().first().copied().unwrap_or(0).max(0) as u64,
    })
}

/// Class labels as host integers, in order. A micro-batch's labels are a
/// few (they arrived over the wire): checking and counting them here costs
/// one copy, where libtorch ops cost a dispatch each, a good part of what a
/// small micro-batch cost the Leaf.
fn host_labels(labels: &Tensor) -> Result<Vec<i64>, ExecError> {
    Ok(Vec::<i64>::try_from(&labels.f_reshape([-1])?)?)
}

/// The loss of one micro-batch of a step whose mean divides by
/// `step_targets` ([`loss_targets`] of the whole step's labels).
///
/// - [`Loss::CrossEntropy`]: `output` is logits `[N, C, d..]` (classes at
///   dimension 1) or `[N, d.., C]` (classes last), `labels` i64 classes
///   shaped like the logits without the class dimension, each in `[0, C)` or
///   `ignore_index`; as `nn.CrossEntropyLoss(ignore_index=..)`.
/// - [`Loss::Mse`]: `labels` floats shaped like `output`; as `nn.MSELoss()`.
pub fn micro_batch_loss(
    loss: Loss,
    output: &Tensor,
    labels: &Tensor,
    step_targets: u64,
) -> Result<LossOutput, ExecError> {
    let x = output.f_detach()?.f_set_requires_grad(true)?;
    let (sum, scaled) = scaled_loss(loss, &x, labels, step_targets)?;
    tch::with_grad(|| scaled.f_backward())?;
    let grad = x.f_grad()?;
    if !grad.defined() {
        return Err(ExecError::Loss("the loss produced no gradient".into()));
    }
    Ok(LossOutput {
        sum: sum.f_double_value(&[])?,
        scaled: scaled.f_double_value(&[])?,
        grad,
    })
}

/// [`micro_batch_loss`]'s checks and forward, on `output` as it is (still
/// part of the stage's autograd graph, or not): the summed per-target loss
/// and `sum / step_targets`, both recorded for backward. The Leaf
/// backpropagates the latter through its stage in one pass
/// ([`super::TorchExecutor::backward_from_loss`]).
pub fn scaled_loss(
    loss: Loss,
    output: &Tensor,
    labels: &Tensor,
    step_targets: u64,
) -> Result<(Tensor, Tensor), ExecError> {
    let own = check(loss, output, labels)?;
    let samples = output.size().first().copied().unwrap_or(0);
    if samples <= 0 || own > step_targets {
        return Err(ExecError::Loss(format!(
            "a micro-batch of {samples} samples and {own} targets cannot be part of a step of {step_targets} targets"
        )));
    }
    let labels = place_labels(loss, output, labels)?;
    tch::with_grad(|| -> Result<_, ExecError> {
        let sum = summed(loss, output, &labels)?;
        // With every target ignored there is nothing to learn (torch's mean
        // would be 0/0); the gradient is zero rather than NaN.
        let scaled = sum.f_div_scalar(step_targets.max(1) as f64)?;
        Ok((sum, scaled))
    })
}

/// The summed per-target loss without gradients, for evaluation.
pub fn loss_sum(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<f64, ExecError> {
    let _ = check(loss, output, labels)?;
    let labels = place_labels(loss, output, labels)?;
    let value = tch::no_grad(|| summed(loss, output, &labels))?;
    Ok(value.f_double_value(&[])?)
}

/// Counted labels whose first highest logit is the label (cross-entropy;
/// 0 for MSE).
pub fn correct(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<u64, ExecError> {
    let Loss::CrossEntropy {
        class_axis,
        ignore_index,
    } = loss
    else {
        return Ok(0);
    };
    let dim = class_axis.dim(output.dim()) as i64;
    let predicted = host_labels(&output.f_argmax(dim, false)?)?;
    let labels = host_labels(labels)?;
    if predicted.len() != labels.len() {
        return Err(ExecError::Loss(format!(
            "{} labels for {} predictions",
            labels.len(),
            predicted.len()
        )));
    }
    Ok(predicted
        .iter()
        .zip(&labels)
        .filter(|&(p, l)| p == l && *l != ignore_index)
        .count() as u64)
}

/// Labels on the output's device; MSE targets also in its float kind, which
/// `mse_loss` requires.
fn place_labels(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<Tensor, ExecError> {
    let labels = labels.f_to_device(output.device())?;
    Ok(match loss {
        Loss::CrossEntropy { .. } => labels,
        Loss::Mse => labels.f_to_kind(output.kind())?,
    })
}

/// The summed per-target loss: cross-entropy summed over counted targets,
/// MSE's mean times the samples.
fn summed(loss: Loss, x: &Tensor, labels: &Tensor) -> Result<Tensor, ExecError> {
    Ok(match loss {
        Loss::CrossEntropy {
            class_axis: ClassAxis::Second,
            ignore_index,
        } => x.f_cross_entropy_loss(labels, None::<Tensor>, Reduction::Sum, ignore_index, 0.0)?,
        Loss::CrossEntropy {
            class_axis: ClassAxis::Last,
            ignore_index,
        } => {
            // As users write it: `logits.view(-1, C)` against `labels.view(-1)`.
            let classes = x.size().last().copied().unwrap_or(0);
            x.f_reshape([-1, classes])?.f_cross_entropy_loss(
                &labels.f_reshape([-1])?,
                None::<Tensor>,
                Reduction::Sum,
                ignore_index,
                0.0,
            )?
        }
        Loss::Mse => {
            let samples = x.size().first().copied().unwrap_or(0);
            x.f_mse_loss(labels, Reduction::Mean)?
                .f_mul_scalar(samples as f64)?
        }
    })
}

/// Checks shapes, dtypes and class ranges up front: libtorch would refuse most
/// of these too, but an out-of-range class on CUDA is a device-side assert.
/// Returns the labels' targets ([`loss_targets`]).
fn check(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<u64, ExecError> {
    let (o, l) = (output.size(), labels.size());
    if !super::is_float(output.kind()) {
        return Err(ExecError::Loss(format!(
            "the model output must be floating point, got {:?}",
            output.kind()
        )));
    }
    match loss {
        Loss::CrossEntropy {
            class_axis,
            ignore_index,
        } => {
            if labels.kind() != Kind::Int64 {
                return Err(ExecError::Loss(format!(
                    "cross-entropy labels must be i64 class indices, got {:?}",
                    labels.kind()
                )));
            }
            if o.len() < 2 {
                return Err(ExecError::Loss(format!(
                    "cross-entropy needs logits with a batch and a class dimension, got shape {o:?}"
                )));
            }
            let dim = class_axis.dim(o.len());
            let classes = o[dim];
            let mut expected = o.clone();
            expected.remove(dim);
            if l != expected {
                return Err(ExecError::Loss(format!(
                    "labels of shape {l:?} do not fit logits {o:?} with classes at dimension {} (expected {expected:?})",
                    class_axis.index()
                )));
            }
            let values = host_labels(labels)?;
            let counted = values.iter().copied().filter(|&l| l != ignore_index);
            if let (Some(lo), Some(hi)) = (counted.clone().min(), counted.clone().max())
                && (lo < 0 || hi >= classes)
            {
                return Err(ExecError::Loss(format!(
                    "labels span [{lo}, {hi}] but there are {classes} classes (the ignore_index {ignore_index} aside)"
                )));
            }
            Ok(counted.count() as u64)
        }
        Loss::Mse => {
            if !super::is_float(labels.kind()) {
                return Err(ExecError::Loss(format!(
                    "MSE targets must be floating point, got {:?}",
                    labels.kind()
                )));
            }
            if l != o {
                return Err(ExecError::Loss(format!(
                    "MSE targets of shape {l:?} differ from the output's {o:?}"
                )));
            }
            Ok(o.first().copied().unwrap_or(0).max(0) as u64)
        }
    }
}
