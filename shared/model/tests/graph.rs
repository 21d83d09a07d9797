//! Shape inference and estimates on known models, checked against hand-computed
//! values; validation errors; serde round trips; seeded initialisation.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use common::G;
use rookery_model::{DType, Graph, GraphError, Init, Op, from_toml};

fn shapes(g: &Graph) -> Vec<(String, Vec<usize>)> {
    let a = g.analyze().unwrap();
    a.nodes
        .iter()
        .map(|n| (n.name.clone(), n.output.shape.clone()))
        .collect()
}

#[test]
fn mlp_on_mnist_shapes_and_estimates() {
    let mut g = G::new("x", &[1, 1, 28, 28], DType::F32);
    g.node("flat", Op::Flatten { axis: 1 }, &["x"]);
    g.linear("fc1", "flat", 784, 128);
    g.node("relu", Op::Relu, &["fc1"]);
    g.linear("fc2", "relu", 128, 10);
    g.node("out", Op::LogSoftmax { axis: -1 }, &["fc2"]);
    let g = g.finish("out");
    let a = g.analyze().unwrap();
    let expect: &[(&str, &[usize])] = &[
        ("flat", &[1, 784]),
        ("fc1", &[1, 128]),
        ("relu", &[1, 128]),
        ("fc2", &[1, 10]),
        ("out", &[1, 10]),
    ];
    for (n, (name, shape)) in a.nodes.iter().zip(expect) {
        assert_eq!(
            (n.name.as_str(), n.output.shape.as_slice()),
            (*name, *shape)
        );
    }
    let fc1 = &a.nodes[1];
    assert_eq!(fc1.param_bytes, (784 * 128 + 128) * 4);
    assert_eq!(fc1.forward_flops_per_sample, 2 * 784 * 128 + 128);
    assert_eq!(
        fc1.backward_flops_per_sample,
        2 * fc1.forward_flops_per_sample
    );
    assert_eq!(fc1.activation_bytes_per_sample, 128 * 4);
    assert_eq!(a.nodes[2].backward_flops_per_sample, 128);
    assert_eq!(
        a.total_param_bytes(),
        ((784 * 128 + 128) + (128 * 10 + 10)) * 4
    );
}

const LENET: &str = r#"
name = "lenet"
input_shape = [1, 28, 28]

[[layers]]
type = "Conv2D"
filters = 6
kernel_size = 5
padding = 2
activation = "relu"

[[layers]]
type = "BatchNormalization2D"

[[layers]]
type = "MaxPooling2D"
pool_size = 2

[[layers]]
type = "Conv2D"
nb_filters = 16
kernel_size = [5, 5]

[[layers]]
type = "Activation"
name = "relu"

[[layers]]
type = "MaxPooling2D"
pool_size = 2
strides = 2

[[layers]]
type = "Flatten"

[[layers]]
type = "Dense"
units = 120
activation = "relu"

[[layers]]
type = "Dropout"
rate = 0.5

[[layers]]
type = "Dense"
n_units = 10
"#;

#[test]
fn lenet_with_batchnorm_and_dropout() {
    let g = from_toml(LENET).unwrap();
    let got = shapes(&g);
    let expect: Vec<(String, Vec<usize>)> = [
        ("0", vec![1, 6, 28, 28]),  // conv 5x5 pad 2
        ("1", vec![1, 6, 28, 28]),  // relu (inline activation is its own module)
        ("2", vec![1, 6, 28, 28]),  // batchnorm
        ("3", vec![1, 6, 14, 14]),  // maxpool 2
        ("4", vec![1, 16, 10, 10]), // conv 5x5 valid
        ("5", vec![1, 16, 10, 10]),
        ("6", vec![1, 16, 5, 5]),
        ("7", vec![1, 400]),
        ("8", vec![1, 120]),
        ("9", vec![1, 120]),
        ("10", vec![1, 120]),
        ("11", vec![1, 10]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    assert_eq!(got, expect);
    let names: Vec<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "0.weight",
            "0.bias",
            "2.weight",
            "2.bias",
            "2.running_mean",
            "2.running_var",
            "2.num_batches_tracked",
            "4.weight",
            "4.bias",
            "8.weight",
            "8.bias",
            "11.weight",
            "11.bias"
        ]
    );
    let a = g.analyze().unwrap();
    // Conv 0: 6 * 28 * 28 outputs, each 1*5*5 multiply-adds, plus bias.
    assert_eq!(
        a.nodes[0].forward_flops_per_sample,
        2 * 6 * 28 * 28 * 25 + 6 * 28 * 28
    );
    // BatchNorm: running stats are buffers (3 tensors: 6 + 6 floats + one i64).
    assert_eq!(a.nodes[2].param_bytes, 12 * 4);
    assert_eq!(a.nodes[2].buffer_bytes, 12 * 4 + 8);
    assert_eq!(g.param("4.weight").unwrap().shape, [16, 6, 5, 5]);
}

#[test]
fn residual_block() {
    let mut g = G::new("x", &[2, 8, 16, 16], DType::F32);
    let w1 = g.param("c1.weight", &[8, 8, 3, 3]);
    let conv = Op::Conv2d {
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
        groups: 1,
    };
    g.node("c1", conv.clone(), &["x", &w1]);
    g.node("r1", Op::Relu, &["c1"]);
    let w2 = g.param("c2.weight", &[8, 4, 3, 3]);
    let grouped = Op::Conv2d {
        stride: [1, 1],
        padding: [2, 2],
        dilation: [2, 2],
        groups: 2,
    };
    g.node("c2", grouped, &["r1", &w2]);
    g.node("sum", Op::Add, &["c2", "x"]);
    g.node("r2", Op::Relu, &["sum"]);
    let w3 = g.param("down.weight", &[16, 8, 1, 1]);
    let down = Op::Conv2d {
        stride: [2, 2],
        padding: [0, 0],
        dilation: [1, 1],
        groups: 1,
    };
    g.node("down", down, &["r2", &w3]);
    g.node("cat", Op::Concat { axis: 1 }, &["down", "down"]);
    g.node(
        "avg",
        Op::AvgPool2d {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
            ceil_mode: false,
            count_include_pad: true,
        },
        &["cat"],
    );
    g.node("gap", Op::GlobalAveragePool, &["avg"]);
    let g = g.finish("gap");
    let got = shapes(&g);
    let expect: &[(&str, &[usize])] = &[
        ("c1", &[2, 8, 16, 16]),
        ("r1", &[2, 8, 16, 16]),
        ("c2", &[2, 8, 16, 16]),
        ("sum", &[2, 8, 16, 16]),
        ("r2", &[2, 8, 16, 16]),
        ("down", &[2, 16, 8, 8]),
        ("cat", &[2, 32, 8, 8]),
        ("avg", &[2, 32, 4, 4]),
        ("gap", &[2, 32, 1, 1]),
    ];
    for ((n, s), (en, es)) in got.iter().zip(expect) {
        assert_eq!((n.as_str(), s.as_slice()), (*en, *es));
    }
    let a = g.analyze().unwrap();
    // Per sample with example batch 2: 8*16*16 outputs * (4*3*3) MACs.
    assert_eq!(a.nodes[2].forward_flops_per_sample, 2 * 8 * 16 * 16 * 36);
    assert_eq!(a.nodes[0].activation_bytes_per_sample, 8 * 16 * 16 * 4);
}

/// A pre-norm transformer encoder block: embedding, 4-head attention, GELU MLP.
pub fn transformer_block() -> Graph {
    let (b, t, d, h, v) = (2, 8, 16, 4, 100);
    let mut g = G::new("tokens", &[b, t], DType::I64);
    let emb = g.param("emb.weight", &[v, d]);
    g.node("emb", Op::Gather { axis: 0 }, &[&emb, "tokens"]);
    let lw = g.param("ln1.weight", &[d]);
    let lb = g.param("ln1.bias", &[d]);
    g.node(
        "ln1",
        Op::LayerNorm {
            axis: -1,
            eps: 1e-5,
        },
        &["emb", &lw, &lb],
    );
    for n in ["q", "k", "v"] {
        g.linear(n, "ln1", d, d);
        let heads = Op::Reshape {
            shape: vec![0, 0, h as i64, -1],
        };
        g.node(&format!("{n}_heads"), heads, &[n]);
    }
    g.node(
        "qt",
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &["q_heads"],
    );
    g.node(
        "kt",
        Op::Transpose {
            perm: vec![0, 2, 3, 1],
        },
        &["k_heads"],
    );
    g.node(
        "vt",
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &["v_heads"],
    );
    g.node("scores", Op::MatMul, &["qt", "kt"]);
    let scale = g.param("scale", &[1]);
    g.node("scaled", Op::Mul, &["scores", &scale]);
    g.node("attn", Op::Softmax { axis: -1 }, &["scaled"]);
    g.node("ctx", Op::MatMul, &["attn", "vt"]);
    g.node(
        "ctx_t",
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &["ctx"],
    );
    g.node(
        "merged",
        Op::Reshape {
            shape: vec![0, 0, -1],
        },
        &["ctx_t"],
    );
    g.linear("proj", "merged", d, d);
    g.node("res1", Op::Add, &["emb", "proj"]);
    let lw = g.param("ln2.weight", &[d]);
    let lb = g.param("ln2.bias", &[d]);
    g.node(
        "ln2",
        Op::LayerNorm { axis: 2, eps: 1e-5 },
        &["res1", &lw, &lb],
    );
    g.linear("ff1", "ln2", d, 4 * d);
    g.node("gelu", Op::Gelu, &["ff1"]);
    g.linear("ff2", "gelu", 4 * d, d);
    g.node("drop", Op::Dropout { p: 0.1 }, &["ff2"]);
    g.node("res2", Op::Add, &["res1", "drop"]);
    g.finish("res2")
}

#[test]
fn transformer_encoder_block() {
    let g = transformer_block();
    let a = g.analyze().unwrap();
    let want: &[(&str, &[usize])] = &[
        ("emb", &[2, 8, 16]),
        ("q_heads", &[2, 8, 4, 4]),
        ("qt", &[2, 4, 8, 4]),
        ("kt", &[2, 4, 4, 8]),
        ("scores", &[2, 4, 8, 8]),
        ("attn", &[2, 4, 8, 8]),
        ("ctx", &[2, 4, 8, 4]),
        ("ctx_t", &[2, 8, 4, 4]),
        ("merged", &[2, 8, 16]),
        ("res1", &[2, 8, 16]),
        ("ff1", &[2, 8, 64]),
        ("res2", &[2, 8, 16]),
    ];
    for (name, shape) in want {
        assert_eq!(a.shape(name), Some(*shape), "{name}");
    }
    let scores = a.nodes.iter().find(|n| n.name == "scores").unwrap();
    // Per sample: 4 heads * 8x8 outputs * 4 MACs.
    assert_eq!(scores.forward_flops_per_sample, 2 * 4 * 8 * 8 * 4);
    let qt = a.nodes.iter().find(|n| n.name == "qt").unwrap();
    assert_eq!(qt.backward_flops_per_sample, 0);
    // Topological order keeps the author's order when it is already valid.
    let order: Vec<usize> = a.nodes.iter().map(|n| n.index).collect();
    assert_eq!(order, (0..g.nodes.len()).collect::<Vec<_>>());
}

#[test]
fn out_of_order_nodes_are_sorted() {
    let mut g = G::new("x", &[1, 4], DType::F32);
    g.node("b", Op::Relu, &["a"]);
    g.node("a", Op::Tanh, &["x"]);
    let a = g.finish("b").analyze().unwrap();
    let names: Vec<&str> = a.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
}

#[test]
fn errors_name_node_and_op() {
    let mut g = G::new("x", &[1, 4], DType::F32);
    g.linear("fc", "x", 5, 3);
    let err = g.finish("fc").analyze().unwrap_err();
    assert!(matches!(&err, GraphError::Shape { node, op, .. } if node == "fc" && op == "Linear"));
    assert!(err.to_string().contains("node `fc` (Linear)"), "{err}");

    let mut g = G::new("x", &[1, 4], DType::F32);
    g.node("r", Op::Relu, &["nope"]);
    let err = g.finish("r").analyze().unwrap_err();
    assert_eq!(err.to_string(), "node `r` (Relu): unknown input `nope`");

    let mut g = G::new("x", &[1, 4], DType::F32);
    g.node("a", Op::Add, &["x", "b"]);
    g.node("b", Op::Relu, &["a"]);
    let err = g.finish("b").analyze().unwrap_err();
    assert_eq!(
        err,
        GraphError::Cycle {
            nodes: vec!["a".into(), "b".into()]
        }
    );

    let mut g = G::new("x", &[1, 4, 3], DType::F32);
    g.node(
        "t",
        Op::Transpose {
            perm: vec![0, 0, 1],
        },
        &["x"],
    );
    let err = g.finish("t").analyze().unwrap_err();
    assert!(err.to_string().contains("node `t` (Transpose)"), "{err}");

    let mut g = G::new("x", &[1, 4], DType::F32);
    g.node("r", Op::Reshape { shape: vec![3, -1] }, &["x"]);
    assert!(matches!(
        g.finish("r").analyze(),
        Err(GraphError::Shape { .. })
    ));

    let mut g = G::new("x", &[1, 4], DType::F32);
    g.node("x", Op::Relu, &["x"]);
    assert_eq!(
        g.finish("x").analyze(),
        Err(GraphError::Duplicate("x".into()))
    );
}

#[test]
fn graph_round_trips_through_json() {
    let g = transformer_block();
    let json = g.to_json().unwrap();
    assert!(json.contains(r#""op":"Gather""#), "{json}");
    let back = Graph::from_json(&json).unwrap();
    assert_eq!(back, g);
    assert_eq!(back.analyze().unwrap(), g.analyze().unwrap());
}

#[test]
fn seeded_initialisation_is_deterministic_and_bounded() {
    let g = from_toml(LENET).unwrap();
    let a = g.initial_values(7);
    let b = g.initial_values(7);
    let c = g.initial_values(8);
    assert_eq!(a, b);
    assert_ne!(a["0.weight"], c["0.weight"]);
    // PyTorch default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = 1*5*5.
    let bound = 1.0 / 25f32.sqrt();
    assert!(a["0.weight"].iter().all(|v| v.abs() <= bound));
    assert!(a["0.weight"].iter().any(|v| v.abs() > bound * 0.9));
    assert_eq!(a["2.running_var"], vec![1.0; 6]);
    assert_eq!(a["2.running_mean"], vec![0.0; 6]);
    // Independent of parameter order: a lone parameter gets the same values.
    let p = g.param("8.weight").unwrap();
    assert_eq!(p.initial_values(7), a["8.weight"]);
    // Normal init has roughly unit variance.
    let n = Init::Normal {
        mean: 0.0,
        std: 1.0,
    }
    .materialize("e", 10_000, 1);
    let var = n.iter().map(|v| v * v).sum::<f32>() / n.len() as f32;
    assert!((var - 1.0).abs() < 0.05, "{var}");
}

#[test]
fn activation_ops_round_trip_through_json_and_default_to_torchs_parameters() {
    let ops = [
        Op::LeakyRelu {
            negative_slope: 0.2,
        },
        Op::Elu { alpha: 0.5 },
        Op::Selu,
        Op::Softplus {
            beta: 2.0,
            threshold: 5.0,
        },
        Op::Softsign,
        Op::Tanhshrink,
        Op::LogSigmoid,
        Op::Hardshrink { lambd: 0.3 },
        Op::Hardtanh {
            min_val: -2.0,
            max_val: 3.0,
        },
        Op::Softmin { axis: 1 },
        Op::Softshrink { lambd: 1.25 },
        Op::Threshold {
            threshold: 0.1,
            value: 20.0,
        },
    ];
    let mut g = G::new("x", &[2, 4], DType::F32);
    let mut prev = "x".to_string();
    for (i, op) in ops.iter().enumerate() {
        let name = format!("a{i}");
        g.node(&name, op.clone(), &[prev.as_str()]);
        prev = name;
    }
    let g = g.finish(&prev);
    let analysis = g.analyze().unwrap();
    assert!(analysis.nodes.iter().all(|n| n.output.shape == [2, 4]));
    let back = Graph::from_json(&g.to_json().unwrap()).unwrap();
    assert_eq!(back, g);
    // Left out, a parameter is torch's default.
    let defaults: Vec<Op> = [
        (r#"{"op":"LeakyRelu"}"#),
        (r#"{"op":"Elu"}"#),
        (r#"{"op":"Softplus"}"#),
        (r#"{"op":"Hardshrink"}"#),
        (r#"{"op":"Hardtanh"}"#),
        (r#"{"op":"Softshrink"}"#),
    ]
    .iter()
    .map(|j| serde_json::from_str(j).unwrap())
    .collect();
    assert_eq!(
        defaults,
        [
            Op::LeakyRelu {
                negative_slope: 0.01
            },
            Op::Elu { alpha: 1.0 },
            Op::Softplus {
                beta: 1.0,
                threshold: 20.0
            },
            Op::Hardshrink { lambd: 0.5 },
            Op::Hardtanh {
                min_val: -1.0,
                max_val: 1.0
            },
            Op::Softshrink { lambd: 0.5 }
        ]
    );
    // threshold has no default in torch, nor here.
    assert!(serde_json::from_str::<Op>(r#"{"op":"Threshold","threshold":0.5}"#).is_err());
}
