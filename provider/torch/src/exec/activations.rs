//! The activations of `torch.nn` beyond ReLU, GELU, sigmoid and tanh on
//! libtorch, forward and backward as torch computes them. tch's bindings
//! drop ATen's defaulted scalar arguments (`elu` has no `alpha`,
//! `leaky_relu` no slope), so with torch's defaults each is its ATen op,
//! and with other parameters the same arithmetic in ATen ops whose autograd
//! gives torch's gradient, kinks included:
//!
//! - leaky ReLU: `where(x > 0, x, x * slope)`, the gradient `g` or `g *
//!   slope` as `leaky_relu_backward`'s;
//! - ELU: `where(x > 0, x, alpha * elu(x))` (`elu(x)` is `expm1(x)` at and
//!   below 0), so the gradient there is `(g * alpha) * exp(x)`, in
//!   `elu_backward`'s order;
//! - softplus: `where(beta x > threshold, x, softplus(beta x) / beta)`;
//! - hardshrink, hardtanh and softshrink: `where` over torch's own
//!   comparisons, the gradient 0 where torch's is (hardtanh's at its ends,
//!   where `clamp`'s would pass it);
//! - softsign and tanhshrink are torch's own compositions
//!   (`torch.nn.functional`), threshold and SELU ATen ops with every
//!   parameter.

use rookery_kernels::elementwise::Activation;
use tch::{TchError, Tensor};

/// `a` applied to `x`, with autograd's backward.
pub fn activation(x: &Tensor, a: Activation) -> Result<Tensor, TchError> {
    Ok(match a {
        Activation::LeakyRelu { negative_slope } => {
            let slope = negative_slope.get();
            if slope == 0.01 {
                x.f_leaky_relu()?
            } else {
                x.f_where_self(&x.f_gt(0.0)?, &x.f_mul_scalar(f64::from(slope))?)?
            }
        }
        Activation::Elu { alpha } => {
            let unit = x.f_elu()?;
            if alpha.get() == 1.0 {
                unit
            } else {
                x.f_where_self(&x.f_gt(0.0)?, &unit.f_mul_scalar(f64::from(alpha.get()))?)?
            }
        }
        Activation::Selu => x.f_selu()?,
        Activation::Softplus { beta, threshold } => {
            let (b, t) = (beta.get(), threshold.get());
            if (b, t) == (1.0, 20.0) {
                x.f_softplus()?
            } else {
                // torch compares the f32 product `x * beta` with the threshold.
                let z = x.f_mul_scalar(f64::from(b))?;
                let soft = z.f_softplus()?.f_div_scalar(f64::from(b))?;
                x.f_where_self(&z.f_gt(f64::from(t))?, &soft)?
            }
        }
        Activation::Softsign => x.f_div(&x.f_abs()?.f_add_scalar(1.0)?)?,
        Activation::Tanhshrink => x.f_sub(&x.f_tanh()?)?,
        Activation::LogSigmoid => x.f_log_sigmoid()?,
        Activation::Hardshrink { lambd } => {
            let l = lambd.get();
            if l == 0.5 {
                x.f_hardshrink()?
            } else {
                let band = zero_band(x, l)?;
                x.f_where_scalarother(&band.f_logical_not()?, 0.0)?
            }
        }
        Activation::Hardtanh { min_val, max_val } => {
            let (lo, hi) = (min_val.get(), max_val.get());
            if (lo, hi) == (-1.0, 1.0) {
                x.f_hardtanh()?
            } else {
                let (lo, hi) = (f64::from(lo), f64::from(hi));
                // `clamp`'s values, with hardtanh's gradient: none at and
                // beyond the ends.
                let outside = x.f_le(lo)?.f_logical_or(&x.f_ge(hi)?)?;
                let ends = x.f_clamp(lo, hi)?.f_detach()?;
                ends.f_where_self(&outside, x)?
            }
        }
        Activation::Softshrink { lambd } => {
            let l = lambd.get();
            if l == 0.5 {
                x.f_softshrink()?
            } else {
                let l = f64::from(l);
                let below = x.f_add_scalar(l)?.f_where_scalarother(&x.f_lt(-l)?, 0.0)?;
                x.f_sub_scalar(l)?.f_where_self(&x.f_gt(l)?, &below)?
            }
        }
        Activation::Threshold { threshold, value } => {
            x.f_threshold(f64::from(threshold.get()), f64::from(value.get()))?
        }
    })
}

/// torch's shrinks' zero band, `-lambd <= x <= lambd`.
fn zero_band(x: &Tensor, lambd: f32) -> Result<Tensor, TchError> {
    let l = f64::from(lambd);
    x.f_ge(-l)?.f_logical_and(&x.f_le(l)?)
}
