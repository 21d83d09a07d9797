//! Forward values of every op in op set v1 on the libtorch executor, each
//! against a hand-computed value or an independent plain-Rust loop on tiny
//! inputs.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use exec_common::*;
use rookery_model::{DType, Op};
use rookery_torch::exec::TorchExecutor;
use tch::{Device, Tensor};

#[test]
fn linear_is_x_times_weight_transposed_plus_bias() {
    let x = t(&[1., 2., 3., -1., 0., 2.], &[2, 3]);
    let w = param("w", &[2, 3], vec![1., 0., -1., 0.5, 0.5, 0.5]);
    let b = param("b", &[2], vec![0.25, -1.]);
    let y = eval_op(Op::Linear, &[("x", &x)], vec![w, b]);
    // Row 0: [1-3, 0.5*(1+2+3)] + b; row 1: [-1-2, 0.5*(-1+0+2)] + b.
    assert_close(&vals(&y), &[-1.75, 2., -2.75, -0.5], 1e-6, "linear");
    assert_eq!(y.size(), [2, 2]);

    let w = param("w", &[1, 3], vec![1., 1., 1.]);
    let y = eval_op(Op::Linear, &[("x", &x)], vec![w]);
    assert_close(&vals(&y), &[6., 1.], 1e-6, "linear without bias");
}

#[test]
fn matmul_broadcasts_batch_dimensions() {
    let a: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..6).map(|i| (i as f32) - 2.5).collect();
    let y = eval_op(
        Op::MatMul,
        &[("a", &t(&a, &[2, 2, 3]))],
        vec![param("b", &[3, 2], b.clone())],
    );
    let mut want = Vec::new();
    for bt in 0..2 {
        for i in 0..2 {
            for j in 0..2 {
                let s: f32 = (0..3).map(|k| a[bt * 6 + i * 3 + k] * b[k * 2 + j]).sum();
                want.push(f64::from(s));
            }
        }
    }
    assert_eq!(y.size(), [2, 2, 2]);
    assert_close(&vals(&y), &want, 1e-6, "matmul");
}

#[test]
fn add_sub_mul_div_broadcast_like_numpy() {
    let a = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let y = eval_op(
        Op::Add,
        &[("a", &a)],
        vec![param("b", &[3], vec![10., 20., 30.])],
    );
    assert_close(&vals(&y), &[11., 22., 33., 14., 25., 36.], 0.0, "add");
    let c = t(&[2., -1.], &[2, 1]);
    let y = eval_op(Op::Mul, &[("a", &a), ("c", &c)], vec![]);
    assert_close(&vals(&y), &[2., 4., 6., -4., -5., -6.], 0.0, "mul");
    let y = eval_op(Op::Sub, &[("a", &a), ("c", &c)], vec![]);
    assert_close(&vals(&y), &[-1., 0., 1., 5., 6., 7.], 0.0, "sub");
    let y = eval_op(Op::Div, &[("a", &a), ("c", &c)], vec![]);
    assert_close(&vals(&y), &[0.5, 1., 1.5, -4., -5., -6.], 0.0, "div");
}

#[test]
fn activations_match_their_formulas() {
    let xs = [-2.0f32, -0.5, 0.0, 0.5, 1.0, 3.0];
    let x = t(&xs, &[6]);
    let relu = vals(&eval_op(Op::Relu, &[("x", &x)], vec![]));
    assert_close(&relu, &[0., 0., 0., 0.5, 1., 3.], 0.0, "relu");
    let sig = vals(&eval_op(Op::Sigmoid, &[("x", &x)], vec![]));
    let want: Vec<f64> = xs
        .iter()
        .map(|&v| 1.0 / (1.0 + (-f64::from(v)).exp()))
        .collect();
    assert_close(&sig, &want, 1e-6, "sigmoid");
    let tanh = vals(&eval_op(Op::Tanh, &[("x", &x)], vec![]));
    let want: Vec<f64> = xs.iter().map(|&v| f64::from(v).tanh()).collect();
    assert_close(&tanh, &want, 1e-6, "tanh");
    // Exact (erf) GELU: x * Phi(x); Phi from tables, not the tanh approximation
    // (which gives 0.841192 at 1 and -0.045402 at -2).
    let gelu = vals(&eval_op(Op::Gelu, &[("x", &x)], vec![]));
    let want = [
        -2.0 * 0.022_750_131_948_179_2,
        -0.5 * 0.308_537_538_725_986_9,
        0.0,
        0.5 * 0.691_462_461_274_013_1,
        0.841_344_746_068_542_9,
        3.0 * 0.998_650_101_968_369_9,
    ];
    assert_close(&gelu, &want, 1e-6, "gelu");
}

fn softmax_rows(x: &[f32], rows: usize, cols: usize, log: bool) -> Vec<f64> {
    let mut out = Vec::new();
    for r in 0..rows {
        let row: Vec<f64> = x[r * cols..(r + 1) * cols]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for v in row {
            out.push(if log {
                v - m - z.ln()
            } else {
                (v - m).exp() / z
            });
        }
    }
    out
}

#[test]
fn softmax_and_log_softmax_normalise_the_given_axis() {
    let xs = [1.0f32, 2.0, 3.0, -1.0, 0.0, 100.0];
    let x = t(&xs, &[2, 3]);
    let y = eval_op(Op::Softmax { axis: -1 }, &[("x", &x)], vec![]);
    assert_close(&vals(&y), &softmax_rows(&xs, 2, 3, false), 1e-6, "softmax");
    let y = eval_op(Op::LogSoftmax { axis: 1 }, &[("x", &x)], vec![]);
    assert_close(
        &vals(&y),
        &softmax_rows(&xs, 2, 3, true),
        1e-5,
        "log_softmax",
    );
    // Axis 0: columns. Transposed data through the row helper, compared transposed back.
    let y = eval_op(Op::Softmax { axis: 0 }, &[("x", &x)], vec![]);
    let cols = softmax_rows(&[1., -1., 2., 0., 3., 100.], 3, 2, false);
    let want: Vec<f64> = (0..2)
        .flat_map(|r| (0..3).map(move |c| (r, c)))
        .map(|(r, c)| cols[c * 2 + r])
        .collect();
    assert_close(&vals(&y), &want, 1e-6, "softmax axis 0");
}

/// Plain loops over the definition of a 2-D convolution (cross-correlation);
/// indices, not iterators, so the code reads like the formula.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn conv_ref(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    k: &[f32],
    [o, kh, kw]: [usize; 3],
    bias: &[f32],
    stride: usize,
    pad: usize,
    dil: usize,
    groups: usize,
) -> (Vec<f64>, [usize; 4]) {
    let oh = (h + 2 * pad - dil * (kh - 1) - 1) / stride + 1;
    let ow = (w + 2 * pad - dil * (kw - 1) - 1) / stride + 1;
    let cg = c / groups;
    let og = o / groups;
    let mut out = Vec::new();
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for i in 0..oh {
                for j in 0..ow {
                    let mut s = f64::from(bias[oc]);
                    for ic in 0..cg {
                        for u in 0..kh {
                            for v in 0..kw {
                                let y = (i * stride + u * dil) as isize - pad as isize;
                                let z = (j * stride + v * dil) as isize - pad as isize;
                                if y < 0 || z < 0 || y >= h as isize || z >= w as isize {
                                    continue;
                                }
                                let xi = ((b * c + g * cg + ic) * h + y as usize) * w + z as usize;
                                let ki = ((oc * cg + ic) * kh + u) * kw + v;
                                s += f64::from(x[xi]) * f64::from(k[ki]);
                            }
                        }
                    }
                    out.push(s);
                }
            }
        }
    }
    (out, [n, o, oh, ow])
}

#[test]
fn conv2d_matches_direct_loops_with_stride_padding_dilation_and_groups() {
    for (stride, pad, dil, groups) in [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (2, 1, 1, 4)] {
        let (n, c, h, w, o, kh, kw) = (2, 4, 6, 5, 4, 3, 2);
        let x = pseudo(n * c * h * w, 1);
        let k = pseudo(o * (c / groups) * kh * kw, 2);
        let bias = pseudo(o, 3);
        let (want, shape) = conv_ref(
            &x,
            [n, c, h, w],
            &k,
            [o, kh, kw],
            &bias,
            stride,
            pad,
            dil,
            groups,
        );
        let op = Op::Conv2d {
            stride: [stride; 2],
            padding: [pad; 2],
            dilation: [dil; 2],
            groups,
        };
        let y = eval_op(
            op,
            &[("x", &t(&x, &[n as i64, c as i64, h as i64, w as i64]))],
            vec![
                param("k", &[o, c / groups, kh, kw], k.clone()),
                param("b", &[o], bias.clone()),
            ],
        );
        assert_eq!(
            dims(&y),
            shape,
            "stride {stride} pad {pad} dil {dil} groups {groups}"
        );
        assert_close(&vals(&y), &want, 1e-5, "conv2d");
    }
}

/// Max or mean (zero padding counted, as nn.AvgPool2d) over each window.
fn pool_ref(
    x: &[f32],
    [n, c, h, w]: [usize; 4],
    k: usize,
    s: usize,
    p: usize,
    max: bool,
) -> Vec<f64> {
    let oh = (h + 2 * p - k) / s + 1;
    let ow = (w + 2 * p - k) / s + 1;
    let mut out = Vec::new();
    for plane in 0..n * c {
        for i in 0..oh {
            for j in 0..ow {
                let mut acc = if max { f64::NEG_INFINITY } else { 0.0 };
                for u in 0..k {
                    for v in 0..k {
                        let y = (i * s + u) as isize - p as isize;
                        let z = (j * s + v) as isize - p as isize;
                        let inside = y >= 0 && z >= 0 && y < h as isize && z < w as isize;
                        let val = if inside {
                            f64::from(x[(plane * h + y as usize) * w + z as usize])
                        } else if max {
                            f64::NEG_INFINITY
                        } else {
                            0.0
                        };
                        acc = if max { acc.max(val) } else { acc + val };
                    }
                }
                out.push(if max { acc } else { acc / (k * k) as f64 });
            }
        }
    }
    out
}

#[test]
fn max_and_average_pooling_match_direct_loops() {
    let shape = [1, 2, 5, 5];
    let x = pseudo(50, 7);
    let xt = t(&x, &[1, 2, 5, 5]);
    for (k, s, p) in [(2, 2, 0), (3, 2, 1), (3, 1, 1)] {
        let op = Op::MaxPool2d {
            kernel: [k; 2],
            stride: [s; 2],
            padding: [p; 2],
            dilation: [1, 1],
            ceil_mode: false,
        };
        let y = eval_op(op, &[("x", &xt)], vec![]);
        assert_close(
            &vals(&y),
            &pool_ref(&x, shape, k, s, p, true),
            0.0,
            "max pool",
        );
        let op = Op::AvgPool2d {
            kernel: [k; 2],
            stride: [s; 2],
            padding: [p; 2],
            ceil_mode: false,
            count_include_pad: true,
        };
        let y = eval_op(op, &[("x", &xt)], vec![]);
        assert_close(
            &vals(&y),
            &pool_ref(&x, shape, k, s, p, false),
            1e-6,
            "avg pool",
        );
    }
    let y = eval_op(Op::GlobalAveragePool, &[("x", &xt)], vec![]);
    assert_eq!(y.size(), [1, 2, 1, 1]);
    let mean = |c: usize| {
        x[c * 25..(c + 1) * 25]
            .iter()
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / 25.0
    };
    assert_close(&vals(&y), &[mean(0), mean(1)], 1e-6, "global average pool");
}

fn bn_graph(x: &Tensor) -> (rookery_model::Graph, TorchExecutor) {
    single_op(
        Op::BatchNorm {
            eps: 1e-5,
            momentum: 0.1,
        },
        &[("x", x)],
        vec![
            param("w", &[2], vec![2.0, 0.5]),
            param("b", &[2], vec![1.0, -1.0]),
            buffer("rm", &[2], DType::F32, vec![0.0, 1.0]),
            buffer("rv", &[2], DType::F32, vec![1.0, 4.0]),
            buffer("nbt", &[], DType::I64, vec![0.0]),
        ],
    )
}

#[test]
fn batch_norm_training_normalises_by_batch_statistics_and_updates_running_ones() {
    // [N=4, C=2]: channel 0 = 1, 2, 3, 6; channel 1 = 0, 0, 4, 4.
    let x = t(&[1., 0., 2., 0., 3., 4., 6., 4.], &[4, 2]);
    let (_, mut exec) = bn_graph(&x);
    let f = exec
        .forward(&[("x".into(), x.shallow_clone())], true)
        .unwrap();
    let (m0, m1) = (3.0, 2.0);
    let (v0, v1) = (14.0 / 4.0, 16.0 / 4.0); // biased variances
    let norm = |v: f64, m: f64, var: f64| (v - m) / (var + 1e-5f64).sqrt();
    let want: Vec<f64> = [1., 0., 2., 0., 3., 4., 6., 4.]
        .chunks(2)
        .flat_map(|r| {
            [
                2.0 * norm(r[0], m0, v0) + 1.0,
                0.5 * norm(r[1], m1, v1) - 1.0,
            ]
        })
        .collect();
    assert_close(&vals(&f.outputs[0].1), &want, 1e-5, "batch norm (train)");
    exec.discard(f.micro_batch).unwrap();

    let p: std::collections::BTreeMap<String, Tensor> =
        exec.parameters().unwrap().into_iter().collect();
    // Running statistics use the unbiased variance (n - 1 = 3), momentum 0.1.
    assert_close(
        &vals(&p["rm"]),
        &[0.9 * 0.0 + 0.1 * m0, 0.9 * 1.0 + 0.1 * m1],
        1e-6,
        "running mean",
    );
    assert_close(
        &vals(&p["rv"]),
        &[0.9 * 1.0 + 0.1 * 14.0 / 3.0, 0.9 * 4.0 + 0.1 * 16.0 / 3.0],
        1e-6,
        "running var",
    );
    assert_eq!(vals(&p["nbt"]), [1.0]);

    // Eval mode uses the running statistics and changes nothing.
    let y = exec
        .evaluate(&[("x".into(), x.shallow_clone())])
        .unwrap()
        .remove(0)
        .1;
    let (rm, rv) = (vals(&p["rm"]), vals(&p["rv"]));
    let want: Vec<f64> = [1., 0., 2., 0., 3., 4., 6., 4.]
        .chunks(2)
        .flat_map(|r| {
            [
                2.0 * norm(r[0], rm[0], rv[0]) + 1.0,
                0.5 * norm(r[1], rm[1], rv[1]) - 1.0,
            ]
        })
        .collect();
    assert_close(&vals(&y), &want, 1e-5, "batch norm (eval)");
    let again: std::collections::BTreeMap<String, Tensor> =
        exec.parameters().unwrap().into_iter().collect();
    assert_eq!(vals(&again["nbt"]), [1.0]);
    assert_eq!(vals(&again["rm"]), rm);
}

#[test]
fn batch_norm_over_images_uses_every_pixel_of_a_channel() {
    let xs = pseudo(2 * 2 * 3 * 3, 11);
    let x = t(&xs, &[2, 2, 3, 3]);
    let (_, mut exec) = bn_graph(&x);
    let f = exec
        .forward(&[("x".into(), x.shallow_clone())], true)
        .unwrap();
    let y = vals(&f.outputs[0].1);
    let (w, b) = ([2.0, 0.5], [1.0, -1.0]);
    for c in 0..2 {
        let idx: Vec<usize> = (0..2)
            .flat_map(|n| (0..9).map(move |k| (n * 2 + c) * 9 + k))
            .collect();
        let m = idx.iter().map(|&i| f64::from(xs[i])).sum::<f64>() / 18.0;
        let v = idx
            .iter()
            .map(|&i| (f64::from(xs[i]) - m).powi(2))
            .sum::<f64>()
            / 18.0;
        for &i in &idx {
            let want = w[c] * (f64::from(xs[i]) - m) / (v + 1e-5).sqrt() + b[c];
            assert!(
                (y[i] - want).abs() < 1e-5,
                "channel {c} element {i}: {} vs {want}",
                y[i]
            );
        }
    }
}

#[test]
fn layer_norm_normalises_trailing_dimensions() {
    let xs = [1.0f32, 2., 4., 7., -3., 0., 3., 0.];
    let x = t(&xs, &[2, 4]);
    let w = vec![1.0, 2.0, 0.5, -1.0];
    let b = vec![0.0, 0.1, 0.2, 0.3];
    let y = eval_op(
        Op::LayerNorm {
            axis: -1,
            eps: 1e-5,
        },
        &[("x", &x)],
        vec![param("w", &[4], w.clone()), param("b", &[4], b.clone())],
    );
    let mut want = Vec::new();
    for r in xs.chunks(4) {
        let m = r.iter().map(|&v| f64::from(v)).sum::<f64>() / 4.0;
        let v = r.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / 4.0;
        for (k, &e) in r.iter().enumerate() {
            want.push((f64::from(e) - m) / (v + 1e-5).sqrt() * f64::from(w[k]) + f64::from(b[k]));
        }
    }
    assert_close(&vals(&y), &want, 1e-5, "layer norm");

    // Axis 1 of [2, 2, 2]: each sample's four values together, no affine inputs.
    let x3 = t(&xs, &[2, 2, 2]);
    let y = eval_op(Op::LayerNorm { axis: 1, eps: 1e-5 }, &[("x", &x3)], vec![]);
    let mut want = Vec::new();
    for r in xs.chunks(4) {
        let m = r.iter().map(|&v| f64::from(v)).sum::<f64>() / 4.0;
        let v = r.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / 4.0;
        want.extend(r.iter().map(|&e| (f64::from(e) - m) / (v + 1e-5).sqrt()));
    }
    assert_close(&vals(&y), &want, 1e-5, "layer norm over two axes");
}

#[test]
fn shape_ops_move_data_as_onnx_defines() {
    let xs: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = t(&xs, &[2, 3, 4]);
    let y = eval_op(Op::Flatten { axis: 1 }, &[("x", &x)], vec![]);
    assert_eq!(y.size(), [2, 12]);
    assert_eq!(vals(&y), vals(&x));
    let y = eval_op(Op::Flatten { axis: 0 }, &[("x", &x)], vec![]);
    assert_eq!(y.size(), [1, 24]);
    let y = eval_op(
        Op::Reshape {
            shape: vec![0, -1, 2],
        },
        &[("x", &x)],
        vec![],
    );
    assert_eq!(y.size(), [2, 6, 2]);
    assert_eq!(vals(&y), vals(&x));

    let y = eval_op(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        &[("x", &x)],
        vec![],
    );
    assert_eq!(y.size(), [4, 2, 3]);
    let got = vals(&y);
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                assert_eq!(got[(k * 2 + i) * 3 + j], f64::from(xs[(i * 3 + j) * 4 + k]));
            }
        }
    }

    let a = t(&[1., 2., 3., 4.], &[2, 2]);
    let b = t(&[5., 6.], &[2, 1]);
    let y = eval_op(Op::Concat { axis: -1 }, &[("a", &a), ("b", &b)], vec![]);
    assert_eq!(vals(&y), [1., 2., 5., 3., 4., 6.]);
    let y = eval_op(Op::Identity, &[("a", &a)], vec![]);
    assert_eq!(vals(&y), vals(&a));
}

#[test]
fn gather_is_embedding_lookup_and_accepts_negative_indices() {
    let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // 4 rows of 3
    let idx = ti(&[3, 0, -1, 1], &[2, 2]);
    // Gather reads (data, indices): the table first, as nn.Embedding exports.
    let g = rookery_model::Graph {
        inputs: vec![input("idx", &idx)],
        params: vec![param("emb", &[4, 3], table)],
        nodes: vec![node("y", Op::Gather { axis: 0 }, &["emb", "idx"])],
        outputs: vec!["y".into()],
    };
    let exec =
        TorchExecutor::new(&g, 0..1, vec!["y".into()], init_params(&g, 0), Device::Cpu).unwrap();
    let y = exec.evaluate(&[("idx".into(), idx)]).unwrap().remove(0).1;
    assert_eq!(y.size(), [2, 2, 3]);
    assert_eq!(
        vals(&y),
        [9., 10., 11., 0., 1., 2., 9., 10., 11., 3., 4., 5.]
    );

    // Axis 1 picks columns.
    let x = t(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let cols = ti(&[2, 0], &[2]);
    let y = eval_op(Op::Gather { axis: 1 }, &[("x", &x), ("i", &cols)], vec![]);
    assert_eq!(vals(&y), [3., 1., 6., 4.]);
}

fn dropout_exec(p: f32, shape: &[i64]) -> (TorchExecutor, Tensor) {
    let x = Tensor::ones(shape, (tch::Kind::Float, Device::Cpu));
    let (_, exec) = single_op(Op::Dropout { p }, &[("x", &x)], vec![]);
    (exec, x)
}

#[test]
fn dropout_is_identity_in_eval_and_scales_kept_values_in_training() {
    let (mut exec, x) = dropout_exec(0.25, &[64, 50]);
    let y = exec
        .evaluate(&[("x".into(), x.shallow_clone())])
        .unwrap()
        .remove(0)
        .1;
    assert_eq!(vals(&y), vals(&x));
    exec.set_step_seed(42);
    let f = exec
        .forward(&[("x".into(), x.shallow_clone())], true)
        .unwrap();
    let got = vals(&f.outputs[0].1);
    let kept = got.iter().filter(|&&v| v != 0.0).count();
    assert!(
        got.iter()
            .all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6)
    );
    let frac = kept as f64 / got.len() as f64;
    assert!((frac - 0.75).abs() < 0.03, "kept fraction {frac}");
}

#[test]
fn dropout_masks_depend_on_seed_node_and_sample_not_on_micro_batching() {
    let (mut exec, x) = dropout_exec(0.5, &[8, 16]);
    let run = |exec: &mut TorchExecutor, x: &Tensor, seed: u64| {
        exec.set_step_seed(seed);
        let f = exec
            .forward(&[("x".into(), x.shallow_clone())], true)
            .unwrap();
        exec.discard(f.micro_batch).unwrap();
        vals(&f.outputs[0].1)
    };
    let whole = run(&mut exec, &x, 7);
    assert_eq!(whole, run(&mut exec, &x, 7), "same seed, same mask");
    assert_ne!(whole, run(&mut exec, &x, 8), "another step, another mask");

    // Three uneven micro-batches forwarded in order draw the whole batch's mask.
    exec.set_step_seed(7);
    let mut parts = Vec::new();
    for (start, len) in [(0, 3), (3, 4), (7, 1)] {
        let f = exec
            .forward(&[("x".into(), x.narrow(0, start, len))], true)
            .unwrap();
        exec.discard(f.micro_batch).unwrap();
        parts.extend(vals(&f.outputs[0].1));
    }
    assert_eq!(parts, whole);
    // An explicit offset gives the same rows regardless of call order.
    let f = exec
        .forward_at(&[("x".into(), x.narrow(0, 5, 2))], true, 5)
        .unwrap();
    exec.discard(f.micro_batch).unwrap();
    assert_eq!(vals(&f.outputs[0].1), whole[5 * 16..7 * 16]);

    // Another node name is another stream.
    let g = rookery_model::Graph {
        inputs: vec![input("x", &x)],
        params: vec![],
        nodes: vec![node("other", Op::Dropout { p: 0.5 }, &["x"])],
        outputs: vec!["other".into()],
    };
    let mut other =
        TorchExecutor::new(&g, 0..1, vec!["other".into()], vec![], Device::Cpu).unwrap();
    assert_ne!(run(&mut other, &x, 7), whole);
}
