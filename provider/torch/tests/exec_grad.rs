//! Backward of the libtorch executor against central finite differences in
//! f64, for ops whose gradients are easy to get wrong: the gradient w.r.t. a
//! stage input (arriving from a previous stage) and w.r.t. every trainable
//! parameter, given an arbitrary output gradient.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use std::collections::BTreeMap;
use std::ops::Range;

use exec_common::*;
use rookery_model::{DType, Graph, Op, Param};
use rookery_torch::exec::{TorchExecutor, stage_boundary};
use tch::{Device, Kind, Tensor};

const H: f64 = 1e-5;

fn perturbed(x: &Tensor, i: usize, delta: f64) -> Tensor {
    let mut v = vals(x);
    v[i] += delta;
    t64(&v, &x.size()).to_kind(x.kind())
}

/// sum over outputs of sum(output * weight)
fn objective(outs: &[(String, Tensor)], weights: &[(String, Tensor)]) -> f64 {
    outs.iter()
        .zip(weights)
        .map(|((_, y), (_, w))| (y * w).sum(Kind::Double).double_value(&[]))
        .sum()
}

fn run(
    exec: &mut TorchExecutor,
    inputs: &[(String, Tensor)],
    train: bool,
) -> Vec<(String, Tensor)> {
    // Same seed and sample offset every time, so a dropout mask is a constant.
    exec.set_step_seed(5);
    let f = exec.forward(inputs, train).unwrap();
    exec.discard(f.micro_batch).unwrap();
    f.outputs
}

/// Checks every input gradient and parameter gradient of stage `range` of `g`.
fn check_grads(
    g: &Graph,
    range: Range<usize>,
    inputs: Vec<(String, Tensor)>,
    params: BTreeMap<String, Tensor>,
    train: bool,
) {
    let outputs = stage_boundary(g, range.end).unwrap();
    let mut exec = TorchExecutor::new(g, range, outputs, owned(&params), Device::Cpu).unwrap();
    let weights: Vec<(String, Tensor)> = run(&mut exec, &inputs, train)
        .into_iter()
        .enumerate()
        .map(|(k, (n, y))| {
            let w = pseudo(y.numel(), 100 + k as u64);
            (
                n,
                Tensor::from_slice(&w)
                    .reshape(y.size())
                    .to_kind(Kind::Double),
            )
        })
        .collect();

    exec.set_step_seed(5);
    let f = exec.forward(&inputs, train).unwrap();
    let input_grads = exec.backward(f.micro_batch, &weights).unwrap();
    let param_grads: BTreeMap<String, Tensor> = exec.gradients().unwrap().into_iter().collect();
    exec.zero_grad().unwrap();
    assert_eq!(input_grads.len(), exec.grad_input_names().len());

    for (name, grad) in &input_grads {
        let k = inputs.iter().position(|(n, _)| n == name).unwrap();
        let x = &inputs[k].1;
        let mut numeric = Vec::new();
        for i in 0..x.numel() {
            let mut at = |delta: f64| {
                let mut feed: Vec<(String, Tensor)> = inputs
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect();
                feed[k].1 = perturbed(x, i, delta);
                objective(&run(&mut exec, &feed, train), &weights)
            };
            numeric.push((at(H) - at(-H)) / (2.0 * H));
        }
        assert_close(&vals(grad), &numeric, 1e-6, &format!("d/d{name}"));
    }

    let trainable: Vec<&Param> = g
        .params
        .iter()
        .filter(|p| {
            p.kind == rookery_model::ParamKind::Trainable && exec.param_names().contains(&p.name)
        })
        .collect();
    assert_eq!(
        param_grads.len(),
        trainable.len(),
        "every trainable parameter got a gradient"
    );
    for p in trainable {
        let value = &params[&p.name];
        let mut numeric = Vec::new();
        for i in 0..value.numel() {
            let mut at = |delta: f64| {
                exec.set_parameters(&[(p.name.clone(), perturbed(value, i, delta))])
                    .unwrap();
                objective(&run(&mut exec, &inputs, train), &weights)
            };
            numeric.push((at(H) - at(-H)) / (2.0 * H));
        }
        exec.set_parameters(&[(p.name.clone(), value.shallow_clone())])
            .unwrap();
        assert_close(
            &vals(&param_grads[&p.name]),
            &numeric,
            1e-6,
            &format!("d/d{}", p.name),
        );
    }
}

fn rand64(shape: &[i64], seed: u64) -> Tensor {
    let n: i64 = shape.iter().product();
    Tensor::from_slice(&pseudo(n as usize, seed))
        .reshape(shape)
        .to_kind(Kind::Double)
}

/// `data -> prev = Identity(data) -> y = op(prev, params...)`, checked as the
/// second stage, so `prev` arrives from "another stage" and needs a gradient.
fn check_op(op: Op, x_shape: &[i64], params: &[(&str, &[usize])], train: bool) {
    let x = rand64(x_shape, 1);
    let mut names = vec!["prev".to_string()];
    let mut ps = Vec::new();
    let mut values = BTreeMap::new();
    for (k, (name, shape)) in params.iter().enumerate() {
        let n: usize = shape.iter().product();
        ps.push(param(name, shape, vec![0.0; n]));
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        values.insert(name.to_string(), rand64(&dims, 10 + k as u64));
        names.push(name.to_string());
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let g = Graph {
        inputs: vec![input("data", &x)],
        params: ps,
        nodes: vec![node("prev", Op::Identity, &["data"]), node("y", op, &names)],
        outputs: vec!["y".into()],
    };
    check_grads(&g, 1..2, vec![("prev".into(), x)], values, train);
}

#[test]
fn linear_and_matmul_gradients_match_finite_differences() {
    check_op(Op::Linear, &[3, 4], &[("w", &[2, 4]), ("b", &[2])], false);
    check_op(Op::MatMul, &[2, 3, 4], &[("m", &[4, 2])], false);
}

#[test]
fn conv2d_gradients_match_finite_differences() {
    let op = Op::Conv2d {
        stride: [2, 1],
        padding: [1, 1],
        dilation: [1, 2],
        groups: 2,
    };
    check_op(
        op,
        &[2, 4, 4, 5],
        &[("k", &[2, 2, 2, 2]), ("b", &[2])],
        false,
    );
}

#[test]
fn pooling_gradients_match_finite_differences() {
    let win = |k, s, p| ([k; 2], [s; 2], [p; 2]);
    let (kernel, stride, padding) = win(2, 1, 1);
    check_op(
        Op::MaxPool2d {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
            ceil_mode: false,
        },
        &[1, 2, 3, 3],
        &[],
        false,
    );
    check_op(
        Op::MaxPool2d {
            kernel,
            stride: [2, 2],
            padding,
            dilation: [2, 1],
            ceil_mode: true,
        },
        &[1, 2, 5, 4],
        &[],
        false,
    );
    let (kernel, stride, padding) = win(3, 2, 1);
    check_op(
        Op::AvgPool2d {
            kernel,
            stride,
            padding,
            ceil_mode: true,
            count_include_pad: false,
        },
        &[1, 2, 4, 4],
        &[],
        false,
    );
    check_op(Op::GlobalAveragePool, &[2, 2, 2, 3], &[], false);
}

#[test]
fn normalisation_gradients_match_finite_differences() {
    check_op(
        Op::LayerNorm {
            axis: -1,
            eps: 1e-5,
        },
        &[3, 5],
        &[("w", &[5]), ("b", &[5])],
        false,
    );
    check_op(Op::Softmax { axis: 1 }, &[2, 4], &[], false);
    check_op(Op::LogSoftmax { axis: -1 }, &[2, 4], &[], false);

    // BatchNorm in training mode: the gradient flows through the batch statistics.
    let x = rand64(&[4, 3], 1);
    let stats = |v: f32| vec![v; 3];
    let g = Graph {
        inputs: vec![input("data", &x)],
        params: vec![
            param("w", &[3], vec![0.0; 3]),
            param("b", &[3], vec![0.0; 3]),
            buffer("rm", &[3], DType::F32, stats(0.0)),
            buffer("rv", &[3], DType::F32, stats(1.0)),
        ],
        nodes: vec![
            node("prev", Op::Identity, &["data"]),
            node(
                "y",
                Op::BatchNorm {
                    eps: 1e-5,
                    momentum: 0.1,
                },
                &["prev", "w", "b", "rm", "rv"],
            ),
        ],
        outputs: vec!["y".into()],
    };
    let values = BTreeMap::from([
        ("w".to_string(), rand64(&[3], 2)),
        ("b".to_string(), rand64(&[3], 3)),
        (
            "rm".to_string(),
            Tensor::zeros([3], (Kind::Double, Device::Cpu)),
        ),
        (
            "rv".to_string(),
            Tensor::ones([3], (Kind::Double, Device::Cpu)),
        ),
    ]);
    check_grads(&g, 1..2, vec![("prev".into(), x)], values, true);
}

#[test]
fn elementwise_gradients_match_finite_differences() {
    check_op(Op::Gelu, &[2, 3], &[], false);
    check_op(Op::Tanh, &[2, 3], &[], false);
    check_op(Op::Sigmoid, &[2, 3], &[], false);
    check_op(Op::Mul, &[2, 3], &[("s", &[3])], false);
    check_op(Op::Add, &[2, 3], &[("s", &[2, 3])], false);
    // A fixed seed and offset make the mask a constant multiplier.
    check_op(Op::Dropout { p: 0.4 }, &[4, 5], &[], true);
}

#[test]
fn concat_and_embedding_gradients_match_finite_differences() {
    check_op(Op::Concat { axis: 1 }, &[2, 3], &[("c", &[2, 2])], false);

    // nn.Embedding: the table's gradient sums the rows each token picked.
    let tokens = ti(&[1, 3, 1, 0, 2, 1], &[2, 3]);
    let g = Graph {
        inputs: vec![input("tok", &tokens)],
        params: vec![param("emb", &[4, 2], vec![0.0; 8])],
        nodes: vec![node("y", Op::Gather { axis: 0 }, &["emb", "tok"])],
        outputs: vec!["y".into()],
    };
    let values = BTreeMap::from([("emb".to_string(), rand64(&[4, 2], 4))]);
    check_grads(&g, 0..1, vec![("tok".into(), tokens)], values, false);
}

#[test]
fn gradient_of_a_tensor_passed_through_a_stage_adds_both_paths() {
    // a = Linear(x); stage [1, 3): h = Tanh(a), y = Add(h, a) -- but `a` also
    // leaves the stage unchanged for a later one, so its gradient has three parts.
    let x = rand64(&[3, 2], 1);
    let g = Graph {
        inputs: vec![input("x", &x)],
        params: vec![param("w", &[2, 2], vec![0.0; 4])],
        nodes: vec![
            node("a", Op::Linear, &["x", "w"]),
            node("h", Op::Tanh, &["a"]),
            node("y", Op::Add, &["h", "a"]),
            node("z", Op::Mul, &["y", "a"]),
        ],
        outputs: vec!["z".into()],
    };
    assert_eq!(stage_boundary(&g, 3).unwrap(), ["a", "y"]);
    check_grads(
        &g,
        1..3,
        vec![("a".into(), rand64(&[3, 2], 2))],
        BTreeMap::new(),
        false,
    );
}
