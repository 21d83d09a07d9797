//! Optimizer steps as elementwise kernels, following torch.optim's
//! single-tensor implementations operation by operation (the same order of
//! f32 roundings as `provider/src/exec/optim.rs`): SGD (momentum, dampening,
//! Nesterov, weight decay), Adam and AdamW (optionally AMSGrad) and RMSprop
//! (momentum, centered). Structural choices (Nesterov, AMSGrad, centered,
//! momentum or not) are baked into the source; the scalars, including the
//! per-step bias corrections computed in f64 as Python does, travel in a
//! uniform written each step ([`OptimizerConfig::uniform`]).

use crate::optimizer::OptimizerConfig;
use crate::spec::{Binding, DEFAULT_WORKGROUP, KernelSpec, one_d};

/// torch's `lerp` with a scalar weight (ATen's two-branch formula).
const LERP: &str = r"
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if (abs(w) < 0.5) {
        return a + w * (b - a);
    }
    return b - (b - a) * (1.0 - w);
}
struct U { v0: vec4<f32>, v1: vec4<f32> }
";

fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

impl OptimizerConfig {
    /// State buffers per parameter, each shaped like it, in binding order
    /// after `param` and `grad`.
    pub fn state_names(&self) -> Vec<&'static str> {
        match *self {
            OptimizerConfig::Sgd { momentum, .. } => {
                if momentum != 0.0 {
                    vec!["momentum_buffer"]
                } else {
                    vec![]
                }
            }
            OptimizerConfig::Adam { amsgrad, .. } | OptimizerConfig::AdamW { amsgrad, .. } => {
                let mut v = vec!["exp_avg", "exp_avg_sq"];
                if amsgrad {
                    v.push("max_exp_avg_sq");
                }
                v
            }
            OptimizerConfig::RmsProp {
                momentum, centered, ..
            } => {
                let mut v = vec!["square_avg"];
                if centered {
                    v.push("grad_avg");
                }
                if momentum > 0.0 {
                    v.push("momentum_buffer");
                }
                v
            }
        }
    }

    /// The uniform of step `step` (1 for the first update): eight f32s.
    pub fn uniform(&self, step: u64) -> Vec<u32> {
        let v: [f64; 8] = match *self {
            OptimizerConfig::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                ..
            } => [
                lr,
                momentum,
                1.0 - dampening,
                weight_decay,
                if step <= 1 { 1.0 } else { 0.0 },
                0.0,
                0.0,
                0.0,
            ],
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            }
            | OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                let s = step as f64;
                let bc1 = 1.0 - beta1.powf(s);
                let bc2 = 1.0 - beta2.powf(s);
                [
                    lr / bc1,
                    1.0 - beta1,
                    beta2,
                    1.0 - beta2,
                    eps,
                    weight_decay,
                    bc2.sqrt(),
                    1.0 - lr * weight_decay,
                ]
            }
            OptimizerConfig::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                ..
            } => [
                lr,
                alpha,
                1.0 - alpha,
                eps,
                weight_decay,
                momentum,
                0.0,
                0.0,
            ],
        };
        v.iter().map(|&x| (x as f32).to_bits()).collect()
    }

    /// One step over `len` elements: bindings `u` (the uniform), `param`
    /// (read-write), `grad`, then the [`Self::state_names`] (read-write).
    pub fn step(&self, len: usize) -> KernelSpec {
        let states = self.state_names();
        let mut bindings = vec![
            ("u", Binding::Uniform, "U"),
            ("param", Binding::ReadWrite, "f32"),
            ("grad", Binding::Read, "f32"),
        ];
        bindings.extend(states.iter().map(|&s| (s, Binding::ReadWrite, "f32")));
        let decoupled = matches!(self, OptimizerConfig::AdamW { .. });
        let body = match *self {
            OptimizerConfig::Sgd {
                momentum, nesterov, ..
            } => {
                let mut b = String::from(
                    "    let lr = u.v0.x;\n    let p = param[i];\n    var d_p = grad[i] + p * u.v0.w;\n",
                );
                if momentum != 0.0 {
                    b += "    var buf = d_p;\n    if (u.v1.x == 0.0) {\n        buf = momentum_buffer[i] * u.v0.y + d_p * u.v0.z;\n    }\n    momentum_buffer[i] = buf;\n";
                    b += if nesterov {
                        "    d_p = d_p + buf * u.v0.y;\n"
                    } else {
                        "    d_p = buf;\n"
                    };
                }
                b + "    param[i] = p + d_p * -lr;"
            }
            OptimizerConfig::Adam {
                weight_decay,
                amsgrad,
                ..
            }
            | OptimizerConfig::AdamW {
                weight_decay,
                amsgrad,
                ..
            } => {
                let mut b = String::from("    var p = param[i];\n    var g = grad[i];\n");
                if weight_decay != 0.0 {
                    b += if decoupled {
                        "    p = p * u.v1.w;\n"
                    } else {
                        "    g = g + p * u.v1.y;\n"
                    };
                }
                b += "    let m = lerp(exp_avg[i], g, u.v0.y);\n    exp_avg[i] = m;\n";
                b += "    let v = exp_avg_sq[i] * u.v0.z + g * u.v0.w * g;\n    exp_avg_sq[i] = v;\n";
                if amsgrad {
                    b += "    let second = max(max_exp_avg_sq[i], v);\n    max_exp_avg_sq[i] = second;\n";
                } else {
                    b += "    let second = v;\n";
                }
                b + "    let denom = sqrt(second) / u.v1.z + u.v1.x;\n    param[i] = p + m / denom * -u.v0.x;"
            }
            OptimizerConfig::RmsProp {
                momentum, centered, ..
            } => {
                let mut b = String::from(
                    "    let p = param[i];\n    let g = grad[i] + p * u.v1.x;\n    let sa = square_avg[i] * u.v0.y + g * u.v0.z * g;\n    square_avg[i] = sa;\n",
                );
                if centered {
                    b += "    let ga = lerp(grad_avg[i], g, u.v0.z);\n    grad_avg[i] = ga;\n    let avg = sqrt(sa - ga * ga) + u.v0.w;\n";
                } else {
                    b += "    let avg = sqrt(sa) + u.v0.w;\n";
                }
                if momentum > 0.0 {
                    b + "    let buf = momentum_buffer[i] * u.v1.y + g / avg;\n    momentum_buffer[i] = buf;\n    param[i] = p + buf * -u.v0.x;"
                } else {
                    b + "    param[i] = p + g / avg * -u.v0.x;"
                }
            }
        };
        let name = match self {
            OptimizerConfig::Sgd { .. } => "sgd_step",
            OptimizerConfig::AdamW { .. } => "adamw_step",
            OptimizerConfig::Adam { .. } => "adam_step",
            OptimizerConfig::RmsProp { .. } => "rmsprop_step",
        };
        one_d(name, &bindings, LERP, len, DEFAULT_WORKGROUP, &body)
    }

    /// CPU reference of step `step` (1-based), in f32 in the kernel's order:
    /// updates `param` and `state` (one vector per [`Self::state_names`]).
    pub fn reference_step(
        &self,
        step: u64,
        param: &mut [f32],
        grad: &[f32],
        state: &mut [Vec<f32>],
    ) {
        let u: Vec<f32> = self.uniform(step).into_iter().map(f32::from_bits).collect();
        let decoupled = matches!(self, OptimizerConfig::AdamW { .. });
        for i in 0..param.len() {
            let p = param[i];
            match *self {
                OptimizerConfig::Sgd {
                    momentum, nesterov, ..
                } => {
                    let mut d_p = grad[i] + p * u[3];
                    if momentum != 0.0 {
                        let buf = if u[4] != 0.0 {
                            d_p
                        } else {
                            state[0][i] * u[1] + d_p * u[2]
                        };
                        state[0][i] = buf;
                        d_p = if nesterov { d_p + buf * u[1] } else { buf };
                    }
                    param[i] = p + d_p * -u[0];
                }
                OptimizerConfig::Adam {
                    weight_decay,
                    amsgrad,
                    ..
                }
                | OptimizerConfig::AdamW {
                    weight_decay,
                    amsgrad,
                    ..
                } => {
                    let (mut p, mut g) = (p, grad[i]);
                    if weight_decay != 0.0 {
                        if decoupled {
                            p *= u[7];
                        } else {
                            g += p * u[5];
                        }
                    }
                    let m = lerp(state[0][i], g, u[1]);
                    state[0][i] = m;
                    let v = state[1][i] * u[2] + g * u[3] * g;
                    state[1][i] = v;
                    let second = if amsgrad {
                        let s = state[2][i].max(v);
                        state[2][i] = s;
                        s
                    } else {
                        v
                    };
                    let denom = second.sqrt() / u[6] + u[4];
                    param[i] = p + m / denom * -u[0];
                }
                OptimizerConfig::RmsProp {
                    momentum, centered, ..
                } => {
                    let g = grad[i] + p * u[4];
                    let sa = state[0][i] * u[1] + g * u[2] * g;
                    state[0][i] = sa;
                    let avg = if centered {
                        let ga = lerp(state[1][i], g, u[2]);
                        state[1][i] = ga;
                        (sa - ga * ga).sqrt() + u[3]
                    } else {
                        sa.sqrt() + u[3]
                    };
                    if momentum > 0.0 {
                        let slot = state.len() - 1;
                        let buf = state[slot][i] * u[5] + g / avg;
                        state[slot][i] = buf;
                        param[i] = p + buf * -u[0];
                    } else {
                        param[i] = p + g / avg * -u[0];
                    }
                }
            }
        }
    }
}

/// Every optimizer configuration the checks cover: each structural branch.
pub fn optimizer_cases() -> Vec<OptimizerConfig> {
    let mut v = Vec::new();
    for (momentum, dampening, nesterov, weight_decay) in [
        (0.0, 0.0, false, 0.0),
        (0.9, 0.0, false, 0.0),
        (0.9, 0.1, false, 1e-2),
        (0.9, 0.0, true, 1e-3),
    ] {
        v.push(OptimizerConfig::Sgd {
            lr: 0.1,
            momentum,
            dampening,
            nesterov,
            weight_decay,
        });
    }
    for (weight_decay, amsgrad, decoupled) in [
        (0.0, false, false),
        (1e-2, true, false),
        (1e-2, false, true),
        (0.0, true, true),
    ] {
        let (lr, beta1, beta2, eps) = (1e-3, 0.9, 0.999, 1e-8);
        v.push(if decoupled {
            OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            }
        } else {
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            }
        });
    }
    for (weight_decay, momentum, centered) in [
        (0.0, 0.0, false),
        (1e-2, 0.9, true),
        (0.0, 0.5, false),
        (0.0, 0.0, true),
    ] {
        v.push(OptimizerConfig::RmsProp {
            lr: 1e-2,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay,
            momentum,
            centered,
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::spec::validate;
    use super::*;

    #[test]
    fn optimizer_shaders_validate() {
        for o in optimizer_cases() {
            for len in [1, 100, 4097] {
                let spec = o.step(len);
                validate::spec(&spec);
                assert_eq!(spec.bindings.len(), 3 + o.state_names().len());
            }
        }
    }

    #[test]
    fn plain_sgd_is_p_minus_lr_g() {
        let o = OptimizerConfig::Sgd {
            lr: 0.5,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let mut p = vec![1.0, 2.0];
        o.reference_step(1, &mut p, &[2.0, -4.0], &mut []);
        assert_eq!(p, vec![0.0, 4.0]);
    }

    #[test]
    fn adam_first_step_moves_each_parameter_by_about_lr() {
        // With bias correction, Adam's first update is lr * sign(g).
        let o = optimizer_cases()[4];
        let mut p = vec![0.0, 0.0];
        let mut state = vec![vec![0.0; 2]; 2];
        o.reference_step(1, &mut p, &[0.3, -2.0], &mut state);
        assert!(
            (p[0] + 1e-3).abs() < 1e-6 && (p[1] - 1e-3).abs() < 1e-6,
            "{p:?}"
        );
    }
}
