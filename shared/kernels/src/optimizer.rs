//! Optimizer hyper-parameters: data only, named and defaulted as in
//! `torch.optim`, validated with `torch.optim`'s own wording. The one type
//! for them everywhere: job files, the wire (`Assign`), and the executors
//! (our kernels in [`crate::optim`], libtorch's port in `rookery-torch`).
//! It lives here, the lowest crate, so nothing converts it.

use serde::{Deserialize, Serialize};

/// Hyper-parameters, named as in `torch.optim`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum OptimizerConfig {
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        weight_decay: f64,
    },
    /// `torch.optim.Adam`: weight decay added to the gradient (L2).
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        amsgrad: bool,
    },
    /// `torch.optim.AdamW`: weight decay applied to the parameter (decoupled).
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        amsgrad: bool,
    },
    RmsProp {
        lr: f64,
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: bool,
    },
}

impl OptimizerConfig {
    /// `torch.optim.SGD(lr=lr)` defaults: no momentum, no weight decay.
    pub fn sgd(lr: f64) -> Self {
        OptimizerConfig::Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    /// `torch.optim.Adam(lr=lr)` defaults: betas (0.9, 0.999), eps 1e-8.
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }

    /// `torch.optim.AdamW(lr=lr)` defaults: as Adam with weight decay 0.01.
    pub fn adamw(lr: f64) -> Self {
        OptimizerConfig::AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            amsgrad: false,
        }
    }

    /// `torch.optim.RMSprop(lr=lr)` defaults: alpha 0.99, eps 1e-8.
    pub fn rmsprop(lr: f64) -> Self {
        OptimizerConfig::RmsProp {
            lr,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        }
    }

    /// The same settings with learning rate `lr` (a schedule's value).
    pub fn with_lr(mut self, lr: f64) -> Self {
        match &mut self {
            OptimizerConfig::Sgd { lr: l, .. }
            | OptimizerConfig::Adam { lr: l, .. }
            | OptimizerConfig::AdamW { lr: l, .. }
            | OptimizerConfig::RmsProp { lr: l, .. } => *l = lr,
        }
        self
    }

    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. }
            | OptimizerConfig::Adam { lr, .. }
            | OptimizerConfig::AdamW { lr, .. }
            | OptimizerConfig::RmsProp { lr, .. } => lr,
        }
    }

    /// The checks `torch.optim` constructors make, with their wording.
    pub fn validate(&self) -> Result<(), String> {
        let non_negative = |what: &str, v: f64| {
            if v >= 0.0 && v.is_finite() {
                Ok(())
            } else {
                Err(format!("Invalid {what}: {v}"))
            }
        };
        let beta = |i: usize, v: f64| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("Invalid beta parameter at index {i}: {v}"))
            }
        };
        non_negative("learning rate", self.lr())?;
        match *self {
            OptimizerConfig::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
                ..
            } => {
                non_negative("momentum value", momentum)?;
                non_negative("weight_decay value", weight_decay)?;
                if !dampening.is_finite() {
                    return Err(format!("Invalid dampening value: {dampening}"));
                }
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err("Nesterov momentum requires a momentum and zero dampening".into());
                }
            }
            OptimizerConfig::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            }
            | OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                non_negative("epsilon value", eps)?;
                beta(0, beta1)?;
                beta(1, beta2)?;
                non_negative("weight_decay value", weight_decay)?;
            }
            OptimizerConfig::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                ..
            } => {
                non_negative("epsilon value", eps)?;
                non_negative("momentum value", momentum)?;
                non_negative("weight_decay value", weight_decay)?;
                non_negative("alpha value", alpha)?;
            }
        }
        Ok(())
    }
}
