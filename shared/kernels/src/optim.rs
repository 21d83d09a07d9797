//! Optimizer steps as elementwise kernels, following torch.optim's
//! single-tensor implementations operation by operation (the same order of
//! f32 roundings as `provider/src/exec/optim.rs`): SGD (momentum, dampening,
//! Nesterov, weight decay), Adam and AdamW (optionally AMSGrad) and RMSprop
//! (momentum, centered). Structural choices (Nesterov, AMSGrad, centered,
//! momentum or not) are baked into the source; the scalars, including the
//! per-step bias corrections computed in f64 as Python does, travel in a
//! uniform written each step ([`OptimizerConfig::uniform`]).

use crate::accuracy::Tracked;
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

fn lerp<T: StepArith>(a: T, b: T, w: f32) -> T {
    if w.abs() < 0.5 {
        a + T::of(w) * (b - a)
    } else {
        b - (b - a) * T::of(1.0 - w)
    }
}

/// The arithmetic of an optimizer step: f32 itself (the reference) or
/// [`Tracked`] (the reference with its error bound).
trait StepArith:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// A value both the kernel and the reference hold exactly (an input or
    /// a uniform).
    fn of(v: f32) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
}

impl StepArith for f32 {
    fn of(v: f32) -> Self {
        v
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
}

impl StepArith for Tracked {
    fn of(v: f32) -> Self {
        Tracked::exact(v)
    }
    fn sqrt(self) -> Self {
        Tracked::sqrt(self)
    }
    fn max(self, other: Self) -> Self {
        Tracked::max(self, other)
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
        self.each_element(step, param, grad, state);
    }

    /// [`Self::reference_step`] on values that carry a bound on their
    /// distance from the exact result (WGSL's accuracy for each operation
    /// of the kernel), for checks whose conditioning depends on the data
    /// (centered RMSprop subtracts two nearly equal averages).
    pub fn tracked_step(
        &self,
        step: u64,
        param: &mut [Tracked],
        grad: &[f32],
        state: &mut [Vec<Tracked>],
    ) {
        self.each_element(step, param, grad, state);
    }

    fn each_element<T: StepArith>(
        &self,
        step: u64,
        param: &mut [T],
        grad: &[f32],
        state: &mut [Vec<T>],
    ) {
        let u: Vec<f32> = self.uniform(step).into_iter().map(f32::from_bits).collect();
        let mut slots = [T::of(0.0); 3];
        for i in 0..param.len() {
            for (slot, s) in slots.iter_mut().zip(state.iter()) {
                *slot = s[i];
            }
            param[i] = self.element(&u, param[i], T::of(grad[i]), &mut slots[..state.len()]);
            for (s, slot) in state.iter_mut().zip(slots) {
                s[i] = slot;
            }
        }
    }

    /// One parameter's step: the kernel's operations in its order.
    fn element<T: StepArith>(&self, u: &[f32], p: T, grad: T, state: &mut [T]) -> T {
        let c = |k: usize| T::of(u[k]);
        match *self {
            OptimizerConfig::Sgd {
                momentum, nesterov, ..
            } => {
                let mut d_p = grad + p * c(3);
                if momentum != 0.0 {
                    let buf = if u[4] != 0.0 {
                        d_p
                    } else {
                        state[0] * c(1) + d_p * c(2)
                    };
                    state[0] = buf;
                    d_p = if nesterov { d_p + buf * c(1) } else { buf };
                }
                p + d_p * T::of(-u[0])
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
                let (mut p, mut g) = (p, grad);
                if weight_decay != 0.0 {
                    if matches!(self, OptimizerConfig::AdamW { .. }) {
                        p = p * c(7);
                    } else {
                        g = g + p * c(5);
                    }
                }
                let m = lerp(state[0], g, u[1]);
                state[0] = m;
                let v = state[1] * c(2) + g * c(3) * g;
                state[1] = v;
                let second = if amsgrad {
                    let s = state[2].max(v);
                    state[2] = s;
                    s
                } else {
                    v
                };
                let denom = second.sqrt() / c(6) + c(4);
                p + m / denom * T::of(-u[0])
            }
            OptimizerConfig::RmsProp {
                momentum, centered, ..
            } => {
                let g = grad + p * c(4);
                let sa = state[0] * c(1) + g * c(2) * g;
                state[0] = sa;
                let avg = if centered {
                    let ga = lerp(state[1], g, u[2]);
                    state[1] = ga;
                    (sa - ga * ga).sqrt() + c(3)
                } else {
                    sa.sqrt() + c(3)
                };
                if momentum > 0.0 {
                    let slot = state.len() - 1;
                    let buf = state[slot] * c(5) + g / avg;
                    state[slot] = buf;
                    p + buf * T::of(-u[0])
                } else {
                    p + g / avg * T::of(-u[0])
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

    /// f32 as the slackest GPU WGSL allows: each division off by 2 ULP and
    /// each `sqrt` by 4, in a direction that varies with the value.
    #[derive(Debug, Clone, Copy)]
    struct Slack(f32);

    impl Slack {
        fn nudge(v: f32, ulps: u32) -> f32 {
            let up = v.to_bits().count_ones().is_multiple_of(2);
            (0..ulps).fold(v, |v, _| if up { v.next_up() } else { v.next_down() })
        }
    }

    impl std::ops::Add for Slack {
        type Output = Self;
        fn add(self, o: Self) -> Self {
            Slack(self.0 + o.0)
        }
    }
    impl std::ops::Sub for Slack {
        type Output = Self;
        fn sub(self, o: Self) -> Self {
            Slack(self.0 - o.0)
        }
    }
    impl std::ops::Mul for Slack {
        type Output = Self;
        fn mul(self, o: Self) -> Self {
            Slack(self.0 * o.0)
        }
    }
    impl std::ops::Div for Slack {
        type Output = Self;
        fn div(self, o: Self) -> Self {
            Slack(Slack::nudge(self.0 / o.0, 2))
        }
    }
    impl StepArith for Slack {
        fn of(v: f32) -> Self {
            Slack(v)
        }
        fn sqrt(self) -> Self {
            Slack(Slack::nudge(self.0.sqrt(), 4))
        }
        fn max(self, other: Self) -> Self {
            Slack(self.0.max(other.0))
        }
    }

    /// Gradients whose running averages nearly cancel in centered RMSprop:
    /// the same value with a small wobble, step after step.
    fn gradients(len: usize, step: u64, seed: u64) -> Vec<f32> {
        let base = crate::sample_matrix(len, seed);
        let wobble = crate::sample_matrix(len, seed ^ (step + 10));
        base.iter()
            .zip(&wobble)
            .map(|(b, w)| b + w * 1e-3)
            .collect()
    }

    #[test]
    fn a_gpu_using_all_of_wgsls_slack_stays_within_the_tracked_bounds() {
        for o in optimizer_cases() {
            let len = 500;
            let start = crate::sample_matrix(len, 3);
            let states = o.state_names().len();
            let mut want = start.clone();
            let mut want_state = vec![vec![0.0f32; len]; states];
            let mut slack: Vec<Slack> = start.iter().map(|&v| Slack(v)).collect();
            let mut slack_state = vec![vec![Slack(0.0); len]; states];
            let mut tracked: Vec<Tracked> = start.iter().map(|&v| Tracked::exact(v)).collect();
            let mut tracked_state = vec![vec![Tracked::exact(0.0); len]; states];
            for step in 1..=3 {
                let g = gradients(len, step, 7);
                o.reference_step(step, &mut want, &g, &mut want_state);
                o.each_element(step, &mut slack, &g, &mut slack_state);
                o.tracked_step(step, &mut tracked, &g, &mut tracked_state);
            }
            let mut pairs: Vec<(&[f32], &[Slack], &[Tracked])> = vec![(&want, &slack, &tracked)];
            for k in 0..states {
                pairs.push((&want_state[k], &slack_state[k], &tracked_state[k]));
            }
            for (which, (want, got, bound)) in pairs.into_iter().enumerate() {
                for i in 0..len {
                    let err = (f64::from(got[i].0) - f64::from(want[i])).abs();
                    let allowed = f64::from(bound[i].between_two());
                    assert!(
                        err <= allowed,
                        "{o:?} buffer {which}[{i}]: {} vs {}, error {err:e} over {allowed:e}",
                        got[i].0,
                        want[i]
                    );
                }
            }
        }
    }

    #[test]
    fn tracked_bounds_stay_near_rounding_where_nothing_cancels() {
        let o = optimizer_cases()[0];
        let mut tracked: Vec<Tracked> = [1.0f32, -2.0, 0.5]
            .iter()
            .map(|&v| Tracked::exact(v))
            .collect();
        o.tracked_step(1, &mut tracked, &[0.25, 0.5, -1.0], &mut []);
        for t in &tracked {
            assert!(t.error <= 4.0 * crate::accuracy::U * t.value.abs(), "{t:?}");
        }
    }
}
