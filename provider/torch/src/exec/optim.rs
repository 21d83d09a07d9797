//! Optimizers written out with no-grad tensor ops, following PyTorch's
//! single-tensor (`foreach=False`) implementations in `torch/optim/*.py` line by
//! line, so a stage steps exactly as `torch.optim` would: SGD (momentum,
//! dampening, Nesterov, weight decay), Adam and AdamW (optionally AMSGrad) and
//! RMSprop (momentum, centered). State is kept per parameter name, so each
//! stage's optimizer holds only its own parameters' state, and averaging
//! parameters by name across clusters leaves it in place.
//!
//! ATen's `add(other, alpha)` / `addcmul(.., value)` / `addcdiv(.., value)`
//! have no tch binding with the scalar, so they are spelled as a multiply then
//! an add: the same formula, which can differ from the fused kernels in the last
//! bit of a float. In-place tch ops also return a handle to the tensor they
//! changed; `let _ =` drops those handles.

use std::collections::BTreeMap;

use tch::Tensor;

use super::ExecError;

pub use rookery_model::OptimizerConfig;

/// One parameter's state; which slots are used depends on the optimizer.
#[derive(Debug, Default)]
struct ParamState {
    step: u64,
    momentum_buffer: Option<Tensor>,
    exp_avg: Option<Tensor>,
    exp_avg_sq: Option<Tensor>,
    max_exp_avg_sq: Option<Tensor>,
    square_avg: Option<Tensor>,
    grad_avg: Option<Tensor>,
}

/// The state slots' names, as `torch.optim` names them in a `state_dict`.
pub use rookery_proto::train::OPTIMIZER_SLOTS as SLOTS;

impl ParamState {
    fn slot(&self, name: &str) -> Option<&Tensor> {
        match name {
            "momentum_buffer" => self.momentum_buffer.as_ref(),
            "exp_avg" => self.exp_avg.as_ref(),
            "exp_avg_sq" => self.exp_avg_sq.as_ref(),
            "max_exp_avg_sq" => self.max_exp_avg_sq.as_ref(),
            "square_avg" => self.square_avg.as_ref(),
            "grad_avg" => self.grad_avg.as_ref(),
            _ => None,
        }
    }

    fn slot_mut(&mut self, name: &str) -> Option<&mut Option<Tensor>> {
        Some(match name {
            "momentum_buffer" => &mut self.momentum_buffer,
            "exp_avg" => &mut self.exp_avg,
            "exp_avg_sq" => &mut self.exp_avg_sq,
            "max_exp_avg_sq" => &mut self.max_exp_avg_sq,
            "square_avg" => &mut self.square_avg,
            "grad_avg" => &mut self.grad_avg,
            _ => return None,
        })
    }
}

/// One parameter's exported state: its name, step count and state tensors
/// by slot name.
pub type ExportedState<'a> = (String, u64, Vec<(&'static str, &'a Tensor)>);

/// An optimizer with per-parameter state, keyed by parameter name.
#[derive(Debug)]
pub struct TorchOptimizer {
    config: OptimizerConfig,
    state: BTreeMap<String, ParamState>,
}

/// The slot's tensor, created as zeros like `like` on first use (as PyTorch's
/// lazy state initialisation does).
fn slot<'a>(slot: &'a mut Option<Tensor>, like: &Tensor) -> Result<&'a mut Tensor, ExecError> {
    if slot.is_none() {
        *slot = Some(like.f_zeros_like()?);
    }
    slot.as_mut()
        .ok_or_else(|| ExecError::Optimizer("state slot vanished".into()))
}

impl TorchOptimizer {
    pub fn new(config: OptimizerConfig) -> Result<Self, ExecError> {
        config.validate().map_err(ExecError::Optimizer)?;
        Ok(Self {
            config,
            state: BTreeMap::new(),
        })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Changes the learning rate (for schedules), keeping the state.
    pub fn set_lr(&mut self, lr: f64) -> Result<(), ExecError> {
        let config = self.config.with_lr(lr);
        config.validate().map_err(ExecError::Optimizer)?;
        self.config = config;
        Ok(())
    }

    /// The state of every parameter updated so far, by name: its step count
    /// and its state tensors by slot name (as `torch.optim`'s `state_dict`).
    pub fn export(&self) -> Vec<ExportedState<'_>> {
        self.state
            .iter()
            .map(|(name, s)| {
                let slots = SLOTS
                    .iter()
                    .filter_map(|&slot| s.slot(slot).map(|t| (slot, t)))
                    .collect();
                (name.clone(), s.step, slots)
            })
            .collect()
    }

    /// Replaces the state of parameter `name` (what [`TorchOptimizer::export`]
    /// gave), so the next update continues exactly where the exported one
    /// left off. Unknown slot names are refused; tensors are taken as given
    /// (the caller puts them on the parameter's device).
    pub fn import(
        &mut self,
        name: &str,
        steps: u64,
        slots: Vec<(String, Tensor)>,
    ) -> Result<(), ExecError> {
        let mut state = ParamState {
            step: steps,
            ..ParamState::default()
        };
        for (slot, t) in slots {
            let place = state.slot_mut(&slot).ok_or_else(|| {
                ExecError::Optimizer(format!(
                    "`{slot}` is not an optimizer state slot (known: {SLOTS:?})"
                ))
            })?;
            *place = Some(t);
        }
        self.state.insert(name.to_string(), state);
        Ok(())
    }

    /// Steps taken for parameter `name` (0 before its first update).
    pub fn steps(&self, name: &str) -> u64 {
        self.state.get(name).map_or(0, |s| s.step)
    }

    /// Updates `param` in place from `grad` (neither is tracked by autograd
    /// during the update). `param` must be the tensor the model reads.
    pub fn update(&mut self, name: &str, param: &Tensor, grad: &Tensor) -> Result<(), ExecError> {
        if param.size() != grad.size() {
            return Err(ExecError::Optimizer(format!(
                "gradient of `{name}` has shape {:?}, the parameter {:?}",
                grad.size(),
                param.size()
            )));
        }
        let config = self.config;
        let state = self.state.entry(name.to_string()).or_default();
        let grad = grad.f_detach()?;
        tch::no_grad(|| match config {
            OptimizerConfig::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => sgd(
                param,
                grad,
                state,
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            ),
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            }
            | OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            } => adam(
                param,
                grad,
                state,
                AdamArgs {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    amsgrad,
                    decoupled: matches!(config, OptimizerConfig::AdamW { .. }),
                },
            ),
            OptimizerConfig::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => rmsprop(
                param,
                grad,
                state,
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            ),
        })
    }
}

/// `grad + alpha * other`, as `grad.add(other, alpha=alpha)`.
fn add_scaled(t: &Tensor, other: &Tensor, alpha: f64) -> Result<Tensor, ExecError> {
    Ok(if alpha == 1.0 {
        t.f_add(other)?
    } else {
        t.f_add(&other.f_mul_scalar(alpha)?)?
    })
}

/// `_single_tensor_sgd`.
#[allow(clippy::too_many_arguments)]
fn sgd(
    param: &Tensor,
    grad: Tensor,
    state: &mut ParamState,
    lr: f64,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    weight_decay: f64,
) -> Result<(), ExecError> {
    let mut p = param.shallow_clone();
    let mut d_p = grad;
    if weight_decay != 0.0 {
        d_p = add_scaled(&d_p, &p, weight_decay)?;
    }
    if momentum != 0.0 {
        let buf = match state.momentum_buffer.take() {
            // The first step copies the gradient: no dampening applied to it.
            None => d_p.f_detach_copy()?,
            Some(mut buf) => {
                let _ = buf.f_mul_scalar_(momentum)?;
                let _ = buf.f_add_(&if dampening == 0.0 {
                    d_p.shallow_clone()
                } else {
                    d_p.f_mul_scalar(1.0 - dampening)?
                })?;
                buf
            }
        };
        d_p = if nesterov {
            add_scaled(&d_p, &buf, momentum)?
        } else {
            buf.shallow_clone()
        };
        state.momentum_buffer = Some(buf);
    }
    state.step += 1;
    let _ = p.f_add_(&d_p.f_mul_scalar(-lr)?)?;
    Ok(())
}

struct AdamArgs {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    decoupled: bool,
}

/// `_single_tensor_adam` (AdamW is its `decoupled_weight_decay=True` branch).
fn adam(
    param: &Tensor,
    grad: Tensor,
    state: &mut ParamState,
    a: AdamArgs,
) -> Result<(), ExecError> {
    let mut p = param.shallow_clone();
    let mut grad = grad;
    state.step += 1;
    if a.weight_decay != 0.0 {
        if a.decoupled {
            let _ = p.f_mul_scalar_(1.0 - a.lr * a.weight_decay)?;
        } else {
            grad = add_scaled(&grad, &p, a.weight_decay)?;
        }
    }
    let exp_avg = slot(&mut state.exp_avg, &p)?;
    let _ = exp_avg.f_lerp_(&grad, 1.0 - a.beta1)?;
    let exp_avg = exp_avg.shallow_clone();
    let exp_avg_sq = slot(&mut state.exp_avg_sq, &p)?;
    let _ = exp_avg_sq.f_mul_scalar_(a.beta2)?;
    let _ = exp_avg_sq.f_add_(&grad.f_mul_scalar(1.0 - a.beta2)?.f_mul(&grad)?)?;
    let exp_avg_sq = exp_avg_sq.shallow_clone();

    // Python floats (f64), as `_get_value(step_t)` makes them.
    let step = state.step as f64;
    let bias_correction1 = 1.0 - a.beta1.powf(step);
    let bias_correction2 = 1.0 - a.beta2.powf(step);
    let step_size = a.lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.sqrt();

    let second = if a.amsgrad {
        let max = slot(&mut state.max_exp_avg_sq, &p)?;
        let m = max.f_maximum(&exp_avg_sq)?;
        max.f_copy_(&m)?;
        m
    } else {
        exp_avg_sq
    };
    let denom = second
        .f_sqrt()?
        .f_div_scalar(bias_correction2_sqrt)?
        .f_add_scalar(a.eps)?;
    let _ = p.f_add_(&exp_avg.f_div(&denom)?.f_mul_scalar(-step_size)?)?;
    Ok(())
}

/// `_single_tensor_rmsprop`.
#[allow(clippy::too_many_arguments)]
fn rmsprop(
    param: &Tensor,
    grad: Tensor,
    state: &mut ParamState,
    lr: f64,
    alpha: f64,
    eps: f64,
    weight_decay: f64,
    momentum: f64,
    centered: bool,
) -> Result<(), ExecError> {
    let mut p = param.shallow_clone();
    let mut grad = grad;
    state.step += 1;
    if weight_decay != 0.0 {
        grad = add_scaled(&grad, &p, weight_decay)?;
    }
    let square_avg = slot(&mut state.square_avg, &p)?;
    let _ = square_avg.f_mul_scalar_(alpha)?;
    let _ = square_avg.f_add_(&grad.f_mul_scalar(1.0 - alpha)?.f_mul(&grad)?)?;
    let square_avg = square_avg.shallow_clone();
    let mut avg = if centered {
        let grad_avg = slot(&mut state.grad_avg, &p)?;
        let _ = grad_avg.f_lerp_(&grad, 1.0 - alpha)?;
        let mut v = square_avg.f_sub(&grad_avg.f_mul(grad_avg)?)?;
        let _ = v.f_sqrt_()?;
        v
    } else {
        square_avg.f_sqrt()?
    };
    let _ = avg.f_add_scalar_(eps)?;
    if momentum > 0.0 {
        let buf = slot(&mut state.momentum_buffer, &p)?;
        let _ = buf.f_mul_scalar_(momentum)?;
        let _ = buf.f_add_(&grad.f_div(&avg)?)?;
        let buf = buf.shallow_clone();
        let _ = p.f_add_(&buf.f_mul_scalar(-lr)?)?;
    } else {
        let _ = p.f_add_(&grad.f_div(&avg)?.f_mul_scalar(-lr)?)?;
    }
    Ok(())
}
