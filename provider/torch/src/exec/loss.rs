//! Losses the Leaf computes: cross-entropy over logits with i64 class labels
//! and mean squared error, both with PyTorch's `reduction="mean"`.
//!
//! Micro-batching: a batch of `B` samples split into micro-batches of `m_i`
//! samples gives the same gradients as one pass with the mean loss when each
//! micro-batch's mean loss is scaled by its share `m_i / B`, because
//! `mean_B = sum_i (m_i / B) * mean_{m_i}`. [`micro_batch_loss`] applies that
//! scale, so summing the returned values over a step's micro-batches gives the
//! batch's mean loss and the accumulated parameter gradients are the batch's.

use rookery_model::Loss;
use tch::{Kind, Reduction, Tensor};

use super::ExecError;

/// One micro-batch's loss and the gradient that starts backward on the Leaf.
#[derive(Debug)]
pub struct LossOutput {
    /// The micro-batch's own mean loss.
    pub mean: f64,
    /// `mean * m_i / B`: this micro-batch's contribution to the batch's mean loss.
    pub scaled: f64,
    /// Gradient of the scaled loss w.r.t. the output, for [`super::TorchExecutor::backward`].
    pub grad: Tensor,
}

/// The loss of one micro-batch whose step has `batch_size` samples in all
/// (dimension 0 of `output` and `labels` is the micro-batch's sample count).
///
/// - [`Loss::CrossEntropy`]: `output` is logits `[N, C]` or `[N, C, d..]`,
///   `labels` i64 classes `[N]` or `[N, d..]` in `[0, C)`; as `nn.CrossEntropyLoss()`.
/// - [`Loss::Mse`]: `labels` floats shaped like `output`; as `nn.MSELoss()`.
pub fn micro_batch_loss(
    loss: Loss,
    output: &Tensor,
    labels: &Tensor,
    batch_size: usize,
) -> Result<LossOutput, ExecError> {
    check(loss, output, labels)?;
    let samples = output.size().first().copied().unwrap_or(0);
    if samples <= 0 || batch_size == 0 || samples as usize > batch_size {
        return Err(ExecError::Loss(format!(
            "a micro-batch of {samples} samples cannot be part of a batch of {batch_size}"
        )));
    }
    let share = samples as f64 / batch_size as f64;
    let labels = place_labels(loss, output, labels)?;
    let x = output.f_detach()?.f_set_requires_grad(true)?;
    let (mean, scaled) = tch::with_grad(|| -> Result<_, ExecError> {
        let mean = raw(loss, &x, &labels)?;
        let scaled = if share == 1.0 {
            mean.shallow_clone()
        } else {
            mean.f_mul_scalar(share)?
        };
        scaled.f_backward()?;
        Ok((mean, scaled))
    })?;
    let grad = x.f_grad()?;
    if !grad.defined() {
        return Err(ExecError::Loss("the loss produced no gradient".into()));
    }
    Ok(LossOutput {
        mean: mean.f_double_value(&[])?,
        scaled: scaled.f_double_value(&[])?,
        grad,
    })
}

/// The mean loss without gradients, for evaluation.
pub fn loss_value(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<f64, ExecError> {
    check(loss, output, labels)?;
    let labels = place_labels(loss, output, labels)?;
    let value = tch::no_grad(|| raw(loss, output, &labels))?;
    Ok(value.f_double_value(&[])?)
}

/// Labels on the output's device; MSE targets also in its float kind, which
/// `mse_loss` requires.
fn place_labels(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<Tensor, ExecError> {
    let labels = labels.f_to_device(output.device())?;
    Ok(match loss {
        Loss::CrossEntropy => labels,
        Loss::Mse => labels.f_to_kind(output.kind())?,
    })
}

fn raw(loss: Loss, x: &Tensor, labels: &Tensor) -> Result<Tensor, ExecError> {
    Ok(match loss {
        Loss::CrossEntropy => {
            x.f_cross_entropy_loss(labels, None::<Tensor>, Reduction::Mean, -100, 0.0)?
        }
        Loss::Mse => x.f_mse_loss(labels, Reduction::Mean)?,
    })
}

/// Checks shapes, dtypes and class ranges up front: libtorch would refuse most
/// of these too, but an out-of-range class on CUDA is a device-side assert.
fn check(loss: Loss, output: &Tensor, labels: &Tensor) -> Result<(), ExecError> {
    let (o, l) = (output.size(), labels.size());
    if !super::is_float(output.kind()) {
        return Err(ExecError::Loss(format!(
            "the model output must be floating point, got {:?}",
            output.kind()
        )));
    }
    match loss {
        Loss::CrossEntropy => {
            if labels.kind() != Kind::Int64 {
                return Err(ExecError::Loss(format!(
                    "cross-entropy labels must be i64 class indices, got {:?}",
                    labels.kind()
                )));
            }
            let mut expected = o.clone();
            if o.len() < 2 {
                return Err(ExecError::Loss(format!(
                    "cross-entropy needs logits [N, C, ..], got shape {o:?}"
                )));
            }
            let classes = expected.remove(1);
            if l != expected {
                return Err(ExecError::Loss(format!(
                    "labels of shape {l:?} do not fit logits {o:?} (expected {expected:?})"
                )));
            }
            if labels.numel() > 0 {
                let lo = labels.f_min()?.f_int64_value(&[])?;
                let hi = labels.f_max()?.f_int64_value(&[])?;
                if lo < 0 || hi >= classes {
                    return Err(ExecError::Loss(format!(
                        "labels span [{lo}, {hi}] but there are {classes} classes"
                    )));
                }
            }
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
        }
    }
    Ok(())
}
