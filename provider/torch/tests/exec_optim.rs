//! The hand-written optimizers: one step against values worked out by hand from
//! PyTorch's documented formulas, and many steps against libtorch's own C++
//! `torch::optim` (the port of `torch.optim` that ships inside libtorch, reached
//! through tch's `COptimizer`).
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use exec_common::*;
use rookery_model::{Graph, Op};
use rookery_torch::exec::{ExecError, OptimizerConfig, TorchExecutor, TorchOptimizer};
use tch::{COptimizer, Device, Kind, Tensor};

fn one_step(config: OptimizerConfig, p: &[f32], g: &[f32]) -> Vec<f64> {
    let mut opt = TorchOptimizer::new(config).unwrap();
    let param = t(p, &[p.len() as i64]);
    opt.update("p", &param, &t(g, &[g.len() as i64])).unwrap();
    assert_eq!(opt.steps("p"), 1);
    vals(&param)
}

const P: [f32; 3] = [1.0, -2.0, 0.5];
const G: [f32; 3] = [0.5, -1.0, 0.25];

#[test]
fn sgd_first_step_is_minus_lr_times_gradient() {
    let got = one_step(OptimizerConfig::sgd(0.1), &P, &G);
    assert_close(&got, &[0.95, -1.9, 0.475], 1e-7, "sgd");
    // Momentum's first step copies the gradient (no dampening): the same result.
    let got = one_step(
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            nesterov: false,
            weight_decay: 0.0,
        },
        &P,
        &G,
    );
    assert_close(&got, &[0.95, -1.9, 0.475], 1e-7, "sgd momentum, first step");
    // Weight decay 0.1 adds 0.1 * p to the gradient: [0.6, -1.2, 0.3].
    let got = one_step(
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.1,
        },
        &P,
        &G,
    );
    assert_close(&got, &[0.94, -1.88, 0.47], 1e-7, "sgd weight decay");
}

#[test]
fn sgd_momentum_and_nesterov_second_steps_follow_the_buffer() {
    let (lr, mu) = (0.1, 0.9);
    let g2 = [0.1f32, 0.2, -0.3];
    for nesterov in [false, true] {
        let mut opt = TorchOptimizer::new(OptimizerConfig::Sgd {
            lr,
            momentum: mu,
            dampening: 0.0,
            nesterov,
            weight_decay: 0.0,
        })
        .unwrap();
        let p = t(&P, &[3]);
        opt.update("p", &p, &t(&G, &[3])).unwrap();
        opt.update("p", &p, &t(&g2, &[3])).unwrap();
        let want: Vec<f64> = (0..3)
            .map(|i| {
                let (g1, g2) = (f64::from(G[i]), f64::from(g2[i]));
                // Step 1: buf = g1; Nesterov steps along g1 + mu * buf.
                let d1 = if nesterov { g1 + mu * g1 } else { g1 };
                let buf = mu * g1 + g2;
                let d2 = if nesterov { g2 + mu * buf } else { buf };
                f64::from(P[i]) - lr * d1 - lr * d2
            })
            .collect();
        assert_close(&vals(&p), &want, 1e-6, &format!("nesterov {nesterov}"));
    }
}

#[test]
fn adam_first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
    // m = (1 - b1) g and v = (1 - b2) g^2 cancel their bias corrections, so the
    // first step is lr * g / (|g| + eps).
    let got = one_step(OptimizerConfig::adam(0.1), &P, &G);
    let want: Vec<f64> = P
        .iter()
        .zip(G)
        .map(|(&p, g)| f64::from(p) - 0.1 * f64::from(g) / (f64::from(g).abs() + 1e-8))
        .collect();
    assert_close(&got, &want, 1e-7, "adam");
    assert_close(&got, &[0.9, -1.9, 0.4], 1e-6, "adam, rounded");

    // AdamW first shrinks the weights by lr * wd = 0.001.
    let got = one_step(OptimizerConfig::adamw(0.1), &P, &G);
    assert_close(
        &got,
        &[0.999 - 0.1, -1.998 + 0.1, 0.4995 - 0.1],
        1e-6,
        "adamw",
    );

    // Adam's L2 weight decay enters the gradient instead (its sign here is unchanged).
    let got = one_step(
        OptimizerConfig::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
            amsgrad: false,
        },
        &P,
        &G,
    );
    assert_close(&got, &[0.9, -1.9, 0.4], 1e-6, "adam weight decay");
}

#[test]
fn rmsprop_first_step_divides_by_the_root_mean_square() {
    // v = (1 - alpha) g^2 = 0.01 g^2, so g / sqrt(v) = 10 sign(g).
    let got = one_step(OptimizerConfig::rmsprop(0.01), &P, &G);
    assert_close(&got, &[0.9, -1.9, 0.4], 1e-6, "rmsprop");
    // Centered: v - (0.01 g)^2 = 0.0099 g^2.
    let got = one_step(
        OptimizerConfig::RmsProp {
            lr: 0.01,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: true,
        },
        &P,
        &G,
    );
    let s = 0.01 / 0.0099f64.sqrt();
    assert_close(
        &got,
        &[1.0 - s, -2.0 + s, 0.5 - s],
        1e-6,
        "rmsprop centered",
    );
}

/// Gradients that change sign and size from step to step.
fn grad_at(step: usize, n: usize) -> Tensor {
    let v: Vec<f32> = (0..n)
        .map(|i| ((step * 7 + i * 3) as f32 * 0.37).sin() * (1.0 + i as f32 * 0.1))
        .collect();
    Tensor::from_slice(&v)
}

/// Runs ours and libtorch's C++ optimizer side by side for 20 steps.
fn against_libtorch(ours: OptimizerConfig, mut theirs: COptimizer) {
    let n = 6;
    let init: Vec<f32> = pseudo(n, 3);
    let mine = Tensor::from_slice(&init);
    let reference = Tensor::from_slice(&init).set_requires_grad(true);
    theirs.add_parameters(&reference, 0).unwrap();
    let mut opt = TorchOptimizer::new(ours).unwrap();
    for step in 0..20 {
        let g = grad_at(step, n);
        theirs.zero_grad().unwrap();
        // d/dp sum(p * g) = g: the C++ optimizer reads p.grad.
        (&reference * &g).sum(Kind::Float).backward();
        theirs.step().unwrap();
        opt.update("w", &mine, &g).unwrap();
        assert_close(
            &vals(&mine),
            &vals(&reference.detach()),
            2e-6,
            &format!("{ours:?} step {step}"),
        );
    }
}

#[test]
fn sgd_matches_libtorch_over_many_steps() {
    for (momentum, dampening, nesterov, wd) in [
        (0.0, 0.0, false, 0.0),
        (0.9, 0.0, false, 0.01),
        (0.9, 0.3, false, 0.0),
        (0.8, 0.0, true, 0.05),
    ] {
        let lr = 0.05;
        against_libtorch(
            OptimizerConfig::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay: wd,
            },
            COptimizer::sgd(lr, momentum, dampening, wd, nesterov).unwrap(),
        );
    }
}

#[test]
fn adam_and_adamw_match_libtorch_over_many_steps() {
    for (wd, amsgrad) in [(0.0, false), (0.1, false), (0.0, true)] {
        let (lr, b1, b2, eps) = (0.01, 0.9, 0.99, 1e-8);
        against_libtorch(
            OptimizerConfig::Adam {
                lr,
                beta1: b1,
                beta2: b2,
                eps,
                weight_decay: wd,
                amsgrad,
            },
            COptimizer::adam(lr, b1, b2, wd, eps, amsgrad).unwrap(),
        );
        let wd = wd + 0.01;
        against_libtorch(
            OptimizerConfig::AdamW {
                lr,
                beta1: b1,
                beta2: b2,
                eps,
                weight_decay: wd,
                amsgrad,
            },
            COptimizer::adamw(lr, b1, b2, wd, eps, amsgrad).unwrap(),
        );
    }
}

#[test]
fn rmsprop_matches_libtorch_over_many_steps() {
    for (momentum, centered, wd) in [(0.0, false, 0.0), (0.9, false, 0.01), (0.5, true, 0.0)] {
        let (lr, alpha, eps) = (0.01, 0.9, 1e-8);
        against_libtorch(
            OptimizerConfig::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay: wd,
                momentum,
                centered,
            },
            COptimizer::rms_prop(lr, alpha, eps, wd, momentum, centered).unwrap(),
        );
    }
}

#[test]
fn parameters_without_a_gradient_are_not_stepped() {
    // `unused` feeds a node whose output leaves nowhere: like PyTorch, which skips
    // parameters whose .grad is None, AdamW's weight decay must not touch it.
    let x = t(&pseudo(6, 1), &[2, 3]);
    let g = Graph {
        inputs: vec![input("x", &x)],
        params: vec![
            param("w", &[2, 3], pseudo(6, 2)),
            param("unused", &[2, 3], pseudo(6, 3)),
        ],
        nodes: vec![
            node("y", Op::Linear, &["x", "w"]),
            node("dead", Op::Linear, &["x", "unused"]),
        ],
        outputs: vec!["y".into()],
    };
    let mut exec =
        TorchExecutor::new(&g, 0..2, vec!["y".into()], init_params(&g, 0), Device::Cpu).unwrap();
    let before: Vec<(String, Tensor)> = exec.parameters().unwrap();
    let mut opt = TorchOptimizer::new(OptimizerConfig::adamw(0.1)).unwrap();
    for _ in 0..2 {
        let f = exec
            .forward(&[("x".into(), x.shallow_clone())], true)
            .unwrap();
        let ones = f.outputs[0].1.ones_like();
        exec.backward(f.micro_batch, &[("y".into(), ones)]).unwrap();
        exec.step(&mut opt).unwrap();
        assert!(
            exec.gradients().unwrap().is_empty(),
            "step clears gradients"
        );
    }
    let after = exec.parameters().unwrap();
    assert_eq!(opt.steps("w"), 2);
    assert_eq!(opt.steps("unused"), 0);
    assert_ne!(vals(&before[0].1), vals(&after[0].1));
    assert_eq!(vals(&before[1].1), vals(&after[1].1));
}

#[test]
fn invalid_hyper_parameters_are_refused_as_pytorch_does() {
    let bad = [
        OptimizerConfig::sgd(-0.1),
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 0.0,
        },
        OptimizerConfig::Adam {
            lr: 0.1,
            beta1: 1.0,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        },
        OptimizerConfig::RmsProp {
            lr: 0.1,
            alpha: -0.5,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        },
    ];
    for config in bad {
        let e = TorchOptimizer::new(config).unwrap_err();
        assert!(matches!(e, ExecError::Optimizer(_)), "{config:?}: {e}");
    }
    let mut opt = TorchOptimizer::new(OptimizerConfig::sgd(0.1)).unwrap();
    let e = opt
        .update("p", &t(&[1.0, 2.0], &[2]), &t(&[1.0], &[1]))
        .unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
    assert!(opt.set_lr(f64::NAN).is_err());
    opt.set_lr(0.5).unwrap();
    assert_eq!(opt.config().lr(), 0.5);
}
