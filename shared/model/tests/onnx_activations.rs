//! ONNX import of the activations beyond ReLU, GELU, sigmoid and tanh: the
//! MLPs of tests/fixtures/activations (all twelve, as PyTorch's two
//! exporters write them, torch's defaults and other parameters) import as
//! the ops `make.py` says, one per activation; each ONNX op that names an
//! activation maps with its attributes, and what Rookery cannot honour is
//! refused naming the node and the reason, never imported as something
//! else.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rookery_model::onnx::{self, pb};

mod common;

use common::onnx_proto::{
    attr_int, attr_tensor, dim_param, dim_value, model_bytes, no_external, node,
};
use rookery_model::{OnnxError, Op};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/activations")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn pytorch_exports_of_all_twelve_import_as_the_ops_make_py_names() {
    let e = expected();
    let files = e["files"].as_object().unwrap();
    assert_eq!(files.len(), 4);
    for (file, want) in files {
        // Imported at another batch than the exporter traced (2).
        let imp = onnx::import_file(fixtures().join(file), &[5, 6])
            .unwrap_or_else(|err| panic!("{file}: {err}"));
        assert!(imp.warnings.is_empty(), "{file}: {:?}", imp.warnings);
        let ops: Vec<&Op> = imp
            .graph
            .nodes
            .iter()
            .map(|n| &n.op)
            .filter(|op| **op != Op::Linear)
            .collect();
        let want: Vec<Op> = serde_json::from_value(want["ops"].clone()).unwrap();
        assert_eq!(ops, want.iter().collect::<Vec<_>>(), "{file}");
        // Thirteen Linear layers, and nothing the fused spellings left
        // behind: the only constants are what the legacy softplus's
        // `Mul(x, beta)` and `/ beta` read.
        let linear = imp
            .graph
            .nodes
            .iter()
            .filter(|n| n.op == Op::Linear)
            .count();
        assert_eq!(linear, 13, "{file}");
        let constants: Vec<&str> = imp
            .graph
            .params
            .iter()
            .filter(|p| p.kind == rookery_model::ParamKind::Constant)
            .map(|p| p.name.as_str())
            .collect();
        let arithmetic = want
            .iter()
            .filter(|op| matches!(op, Op::Mul | Op::Div))
            .count();
        assert_eq!(constants.len(), arithmetic, "{file}: {constants:?}");
        // And it runs at any batch.
        let mut g = imp.graph.clone();
        g.inputs[0].shape[0] = 17;
        g.analyze()
            .unwrap_or_else(|err| panic!("{file} at batch 17: {err}"));
    }
}

// ---- Hand-built graphs ------------------------------------------------------

fn attr_float(name: &str, v: f32) -> pb::AttributeProto {
    pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Float as i32),
        f: Some(v),
        ..Default::default()
    }
}

fn scalar(v: f32) -> pb::TensorProto {
    pb::TensorProto {
        dims: vec![],
        data_type: Some(pb::tensor_proto::DataType::Float as i32),
        raw_data: Some(v.to_le_bytes().to_vec()),
        ..Default::default()
    }
}

fn constant(out: &str, v: f32) -> pb::NodeProto {
    node("Constant", &[], out, vec![attr_tensor("value", scalar(v))])
}

/// A model of `nodes` reading `x` [batch, 4] and writing `y`, at `opset`,
/// imported at [3, 4].
fn import(opset: i64, nodes: Vec<pb::NodeProto>) -> Result<onnx::Imported, OnnxError> {
    onnx::import_named(
        "act.onnx",
        &model_bytes(
            opset,
            vec![dim_param("batch"), dim_value(4)],
            nodes,
            vec![],
            "y",
        ),
        &no_external,
        &[3, 4],
    )
}

/// The ops of the import, with the tensor each reads first.
fn ops(opset: i64, nodes: Vec<pb::NodeProto>) -> Vec<(Op, String)> {
    let imp = import(opset, nodes).unwrap_or_else(|e| panic!("{e}"));
    imp.graph
        .nodes
        .iter()
        .map(|n| (n.op.clone(), n.inputs[0].clone()))
        .collect()
}

fn one_op(opset: i64, nodes: Vec<pb::NodeProto>) -> Op {
    let ops = ops(opset, nodes);
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert_eq!(ops[0].1, "x");
    ops[0].0.clone()
}

fn refusal(opset: i64, nodes: Vec<pb::NodeProto>) -> String {
    let err = import(opset, nodes).unwrap_err();
    assert!(
        matches!(err, OnnxError::Unsupported { .. }),
        "not an unsupported-op error: {err}"
    );
    err.to_string()
}

#[test]
fn onnx_activation_ops_import_with_their_attributes_and_onnx_defaults() {
    let single =
        |op: &str, attrs: Vec<pb::AttributeProto>| one_op(18, vec![node(op, &["x"], "y", attrs)]);
    let cases = [
        (
            single("LeakyRelu", vec![attr_float("alpha", 0.3)]),
            Op::LeakyRelu {
                negative_slope: 0.3,
            },
        ),
        (
            single("LeakyRelu", vec![]),
            Op::LeakyRelu {
                negative_slope: 0.01,
            },
        ),
        (
            single("Elu", vec![attr_float("alpha", 0.7)]),
            Op::Elu { alpha: 0.7 },
        ),
        (single("Elu", vec![]), Op::Elu { alpha: 1.0 }),
        (single("Selu", vec![]), Op::Selu),
        (
            single(
                "Selu",
                vec![
                    attr_float("alpha", 1.673_263_2),
                    attr_float("gamma", 1.050_701),
                ],
            ),
            Op::Selu,
        ),
        (
            single("Softplus", vec![]),
            Op::Softplus {
                beta: 1.0,
                threshold: 20.0,
            },
        ),
        (single("Softsign", vec![]), Op::Softsign),
        (
            single("Shrink", vec![attr_float("lambd", 0.7)]),
            Op::Hardshrink { lambd: 0.7 },
        ),
        (single("Shrink", vec![]), Op::Hardshrink { lambd: 0.5 }),
        (
            single(
                "Shrink",
                vec![attr_float("lambd", 0.7), attr_float("bias", 0.7)],
            ),
            Op::Softshrink { lambd: 0.7 },
        ),
        (
            single("ThresholdedRelu", vec![attr_float("alpha", 0.4)]),
            Op::Threshold {
                threshold: 0.4,
                value: 0.0,
            },
        ),
        (
            single("ThresholdedRelu", vec![]),
            Op::Threshold {
                threshold: 1.0,
                value: 0.0,
            },
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
    }
}

#[test]
fn clip_with_constant_bounds_is_hardtanh_at_every_opset() {
    let inputs = |min: Option<f32>, max: Option<f32>| {
        let mut nodes = Vec::new();
        let mut ins = vec!["x"];
        for (name, v) in [("lo", min), ("hi", max)] {
            match v {
                Some(v) => {
                    nodes.push(constant(name, v));
                    ins.push(name);
                }
                None => ins.push(""),
            }
        }
        nodes.push(node("Clip", &ins, "y", vec![]));
        one_op(18, nodes)
    };
    let hardtanh = |min_val, max_val| Op::Hardtanh { min_val, max_val };
    assert_eq!(inputs(Some(-2.0), Some(3.0)), hardtanh(-2.0, 3.0));
    assert_eq!(inputs(Some(0.0), Some(6.0)), hardtanh(0.0, 6.0));
    // A missing bound is the largest finite f32.
    assert_eq!(inputs(None, Some(3.0)), hardtanh(-f32::MAX, 3.0));
    assert_eq!(inputs(Some(0.0), None), hardtanh(0.0, f32::MAX));
    // Before opset 11 the bounds are attributes.
    let op = one_op(
        6,
        vec![node(
            "Clip",
            &["x"],
            "y",
            vec![attr_float("min", -0.5), attr_float("max", 0.25)],
        )],
    );
    assert_eq!(op, hardtanh(-0.5, 0.25));
}

#[test]
fn what_rookery_cannot_honour_is_refused_naming_the_node_and_why() {
    // (nodes, words the message must hold)
    let cases: Vec<(Vec<pb::NodeProto>, &str)> = vec![
        (
            vec![node("Selu", &["x"], "y", vec![attr_float("alpha", 2.0)])],
            "alpha = 2",
        ),
        (
            vec![node(
                "Shrink",
                &["x"],
                "y",
                vec![attr_float("lambd", 0.7), attr_float("bias", 0.2)],
            )],
            "bias = 0.2",
        ),
        // A bound read from the model's input.
        (
            vec![
                node("Relu", &["x"], "m", vec![]),
                node("Clip", &["x", "", "m"], "y", vec![]),
            ],
            "max bound is computed at run time",
        ),
        (
            vec![
                constant("lo", 3.0),
                constant("hi", -3.0),
                node("Clip", &["x", "lo", "hi"], "y", vec![]),
            ],
            "min at most max",
        ),
        // A hand-written leaky ReLU: no spelling of an activation Rookery
        // knows; the Where is the graph's output.
        (
            vec![
                constant("zero", 0.0),
                constant("slope", 0.1),
                node("Greater", &["x", "zero"], "pos", vec![]),
                node("Mul", &["x", "slope"], "neg", vec![]),
                node("Where", &["pos", "x", "neg"], "y", vec![]),
            ],
            "graph output `y` is computed by Greater of run-time tensors",
        ),
        // A comparison read by an op that is not part of any spelling.
        (
            vec![
                constant("zero", 0.0),
                node("Greater", &["x", "zero"], "pos", vec![]),
                node("Cast", &["pos"], "posf", vec![attr_int("to", 1)]),
                node("Relu", &["posf"], "y", vec![]),
            ],
            "reads `posf`, computed by Greater of run-time tensors (node `n_pos`)",
        ),
    ];
    for (nodes, words) in cases {
        let e = refusal(18, nodes);
        assert!(e.contains(words), "{e}");
        assert!(e.contains("act.onnx"), "{e}");
    }
}

/// torch's dynamo softshrink, `Where(|x| > l, x - sign(x) l2, x * 0)`.
fn dynamo_softshrink(l: f32, l2: f32) -> Vec<pb::NodeProto> {
    vec![
        node("Abs", &["x"], "abs", vec![]),
        constant("l", l),
        constant("l2", l2),
        node("Greater", &["abs", "l"], "gt", vec![]),
        node("Sign", &["x"], "sign", vec![]),
        node("Mul", &["sign", "l2"], "shift", vec![]),
        node("Sub", &["x", "shift"], "moved", vec![]),
        constant("zero", 0.0),
        node("Mul", &["x", "zero"], "zeros", vec![]),
        node("Where", &["gt", "moved", "zeros"], "y", vec![]),
    ]
}

/// torch's dynamo threshold, `Where(a <= t, v, b)`.
fn dynamo_threshold(a: &str, b: &str) -> Vec<pb::NodeProto> {
    vec![
        node("Neg", &["x"], "negx", vec![]),
        constant("t", 0.25),
        constant("v", 7.0),
        node("LessOrEqual", &[a, "t"], "le", vec![]),
        node("Where", &["le", "v", b], "y", vec![]),
    ]
}

#[test]
fn pytorchs_spellings_fuse_only_when_every_part_agrees() {
    assert_eq!(
        one_op(18, dynamo_softshrink(0.3, 0.3)),
        Op::Softshrink { lambd: 0.3 }
    );
    assert_eq!(
        one_op(18, dynamo_threshold("x", "x")),
        Op::Threshold {
            threshold: 0.25,
            value: 7.0
        }
    );
    // A shift other than the band's half-width is no softshrink.
    let e = refusal(18, dynamo_softshrink(0.3, 0.4));
    assert!(e.contains("graph output `y`"), "{e}");
    // The comparison on one tensor, the kept values from another.
    let e = refusal(18, dynamo_threshold("x", "negx"));
    assert!(e.contains("graph output `y`"), "{e}");
    // Plain arithmetic that spells an activation becomes it.
    let tanhshrink = vec![
        node("Tanh", &["x"], "t", vec![]),
        node("Sub", &["x", "t"], "y", vec![]),
    ];
    assert_eq!(one_op(18, tanhshrink), Op::Tanhshrink);
    let logsigmoid = vec![
        node("Sigmoid", &["x"], "s", vec![]),
        node("Log", &["s"], "y", vec![]),
    ];
    assert_eq!(one_op(18, logsigmoid), Op::LogSigmoid);
    // `x - tanh(-x)` is not tanhshrink: both ops stay.
    let other = vec![
        node("Neg", &["x"], "n", vec![]),
        node("Tanh", &["n"], "t", vec![]),
        node("Sub", &["x", "t"], "y", vec![]),
    ];
    let got: Vec<Op> = ops(18, other).into_iter().map(|(op, _)| op).collect();
    assert_eq!(got, [Op::Neg, Op::Tanh, Op::Sub]);
}
