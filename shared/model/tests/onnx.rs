//! ONNX import of the fixtures `scripts/export_fixtures.py` exported from PyTorch
//! (four models, each with the dynamo and the legacy exporter): shapes and
//! weights against what PyTorch reported in `NAME.expected.json`, the warning for
//! an inference-mode export, the errors for broken files, and import-time folding
//! of shape arithmetic on hand-built graphs.
// Helpers outside #[test] fns panic on purpose too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message;
use rookery_model::onnx::{self, pb};

mod common;

use common::onnx_proto::{attr_int, attr_tensor, dim_param, model_bytes, no_external, node};
use rookery_model::{DType, Graph, Init, OnnxError, Op, ParamKind};
use serde_json::Value;

const MODELS: [&str; 4] = ["mlp", "cnn", "resnet", "transformer"];
const EXPORTERS: [&str; 2] = ["dynamo", "legacy"];

/// Every export of a model the fixtures hold: both exporters, and for the
/// transformer also both with symbolic batch and sequence axes.
fn exports(model: &str) -> Vec<String> {
    expected(model)["exports"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn expected(model: &str) -> Value {
    let text = std::fs::read_to_string(fixture(&format!("{model}.expected.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn dims(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect()
}

fn import_fixture(model: &str, exporter: &str) -> onnx::Imported {
    let shape = dims(&expected(model)["input_shape"]);
    let path = fixture(&format!("{model}.{exporter}.onnx"));
    onnx::import_file(&path, &shape).unwrap_or_else(|e| panic!("{model}.{exporter}: {e}"))
}

/// The checksum the export script writes: sum and index-weighted sum in f64.
fn checksum(values: &[f32]) -> [f64; 2] {
    let mut s = [0.0, 0.0];
    for (i, &v) in values.iter().enumerate() {
        s[0] += f64::from(v);
        s[1] += f64::from(v) * (1 + i % 7) as f64;
    }
    s
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn every_fixture_imports_without_warnings() {
    for model in MODELS {
        let exports = exports(model);
        assert!(exports.len() >= 2, "{model}: {exports:?}");
        for exporter in &exports {
            let imp = import_fixture(model, exporter);
            assert!(
                imp.warnings.is_empty(),
                "{model}.{exporter}: {:?}",
                imp.warnings
            );
            assert_eq!(imp.graph.outputs.len(), 1, "{model}.{exporter}");
            let expected_input = dims(&expected(model)["input_shape"]);
            assert_eq!(imp.graph.inputs.len(), 1);
            assert_eq!(imp.graph.inputs[0].shape, expected_input);
            let dtype = if model == "transformer" {
                DType::I64
            } else {
                DType::F32
            };
            assert_eq!(imp.graph.inputs[0].dtype, dtype);
        }
    }
}

#[test]
fn inferred_shapes_equal_pytorch() {
    for model in MODELS {
        let e = expected(model);
        let module_shapes = e["module_shapes"].as_object().unwrap();
        for exporter in &exports(model) {
            let exporter = exporter.as_str();
            let imp = import_fixture(model, exporter);
            let a = imp.graph.analyze().unwrap();
            let out = a.shape(&imp.graph.outputs[0]).unwrap();
            assert_eq!(out, dims(&e["output_shape"]), "{model}.{exporter} output");
            // Each module's output: the last tensor from its scope the graph kept.
            let outputs = e["exports"][exporter]["module_outputs"]
                .as_object()
                .unwrap();
            for (module, shape) in module_shapes {
                let candidates = outputs[module].as_array().unwrap();
                let tensor = candidates
                    .iter()
                    .rev()
                    .filter_map(Value::as_str)
                    .find(|t| a.tensors.contains_key(*t))
                    .unwrap_or_else(|| panic!("{model}.{exporter}: no tensor for `{module}`"));
                assert_eq!(
                    a.shape(tensor).unwrap(),
                    dims(shape),
                    "{model}.{exporter}: module `{module}` (tensor `{tensor}`)"
                );
            }
        }
    }
}

#[test]
fn parameters_are_the_state_dict_with_the_files_weights() {
    for model in MODELS {
        let e = expected(model);
        for exporter in &exports(model) {
            let exporter = exporter.as_str();
            let imp = import_fixture(model, exporter);
            let params: BTreeMap<&str, _> = imp
                .graph
                .params
                .iter()
                .filter(|p| p.kind != ParamKind::Constant)
                .map(|p| (p.name.as_str(), p))
                .collect();
            let entries = e["exports"][exporter]["state_dict"].as_array().unwrap();
            let names: Vec<&str> = entries
                .iter()
                .map(|s| s["name"].as_str().unwrap())
                .collect();
            assert_eq!(
                params.keys().copied().collect::<Vec<_>>(),
                {
                    let mut n = names.clone();
                    n.sort_unstable();
                    n
                },
                "{model}.{exporter}: parameter names"
            );
            for s in entries {
                let name = s["name"].as_str().unwrap();
                let p = params[name];
                let ctx = format!("{model}.{exporter}: `{name}`");
                assert_eq!(p.shape, dims(&s["shape"]), "{ctx}");
                let trainable = s["trainable"].as_bool().unwrap();
                let kind = if trainable {
                    ParamKind::Trainable
                } else {
                    ParamKind::Buffer
                };
                assert_eq!(p.kind, kind, "{ctx}");
                if name.ends_with("num_batches_tracked") {
                    // Exporters drop the counter; the importer restores a fresh one.
                    assert_eq!((p.dtype, &p.init), (DType::I64, &Init::Zeros), "{ctx}");
                    continue;
                }
                let Init::Values { data } = &p.init else {
                    panic!("{ctx}: initial values are not the file's: {:?}", p.init);
                };
                let want = s["checksum"].as_array().unwrap();
                let got = checksum(data);
                for k in 0..2 {
                    let w = want[k].as_f64().unwrap();
                    assert!(close(got[k], w), "{ctx}: checksum {got:?} vs {want:?}");
                }
            }
        }
    }
}

#[test]
fn batchnorm_statistics_are_buffers_and_momentum_is_pytorchs() {
    for exporter in EXPORTERS {
        let imp = import_fixture("cnn", exporter);
        let g = &imp.graph;
        assert_eq!(g.param("bn1.running_mean").unwrap().kind, ParamKind::Buffer);
        assert_eq!(g.param("bn1.running_var").unwrap().kind, ParamKind::Buffer);
        assert_eq!(g.param("bn1.weight").unwrap().kind, ParamKind::Trainable);
        let bn: Vec<&Op> = g
            .nodes
            .iter()
            .map(|n| &n.op)
            .filter(|op| matches!(op, Op::BatchNorm { .. }))
            .collect();
        assert_eq!(bn.len(), 2, "{exporter}");
        for op in bn {
            assert_eq!(
                *op,
                Op::BatchNorm {
                    eps: 1e-5,
                    momentum: 0.1
                }
            );
        }
        let dropout = g.nodes.iter().find(|n| matches!(n.op, Op::Dropout { .. }));
        assert_eq!(dropout.unwrap().op, Op::Dropout { p: 0.25 }, "{exporter}");
    }
}

#[test]
fn linear_layers_import_as_linear_ops() {
    // The transformer's nn.Linear on 3-D inputs exports as Transpose/MatMul/Add.
    for exporter in EXPORTERS {
        let imp = import_fixture("transformer", exporter);
        let linear = imp
            .graph
            .nodes
            .iter()
            .filter(|n| n.op == Op::Linear)
            .count();
        assert_eq!(linear, 5, "{exporter}: qkv, proj, ff1, ff2, head");
        assert!(
            !imp.graph
                .nodes
                .iter()
                .any(|n| n.op == Op::MatMul && n.inputs.iter().any(|i| i.ends_with(".weight"))),
            "{exporter}"
        );
        // The bias-less convolutions of the dynamo ResNet keep no zero bias.
        let resnet = import_fixture("resnet", exporter);
        assert!(
            resnet
                .graph
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::Conv2d { .. }))
                .all(|n| n.inputs.len() == 2),
            "{exporter}"
        );
    }
}

#[test]
fn reshapes_keep_the_batch_dimension_free() {
    let imp = import_fixture("transformer", "dynamo");
    let a = imp.graph.analyze().unwrap();
    assert_eq!(a.batch, 2);
    let reshapes: Vec<&Vec<i64>> = imp
        .graph
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Reshape { shape } => Some(shape),
            _ => None,
        })
        .collect();
    assert!(!reshapes.is_empty());
    // The batch is copied (0) or inferred (-1), never written out.
    assert!(
        reshapes.iter().all(|s| s[0] == 0 || s[0] == -1),
        "{reshapes:?}"
    );
    // And the graph still analyses at another batch size.
    let mut g: Graph = imp.graph.clone();
    g.inputs[0].shape[0] = 5;
    let a = g.analyze().unwrap();
    assert_eq!(a.shape(&g.outputs[0]).unwrap(), [5, 8, 64]);
}

#[test]
fn dynamic_axes_exports_fold_their_shape_arithmetic_at_any_shape() {
    for exporter in EXPORTERS {
        let path = fixture(&format!("transformer.dynamic.{exporter}.onnx"));
        // The file really computes shapes at run time...
        let m = pb::ModelProto::decode(std::fs::read(&path).unwrap().as_slice()).unwrap();
        let g = m.graph.unwrap();
        assert!(g.node.iter().any(|n| n.op_type() == "Shape"), "{exporter}");
        // ...and imports for shapes other than the example's.
        for (b, t) in [(3, 5), (1, 16), (2, 8)] {
            let imp = onnx::import_file(&path, &[b, t]).unwrap();
            assert!(imp.warnings.is_empty(), "{exporter}: {:?}", imp.warnings);
            let a = imp.graph.analyze().unwrap();
            assert_eq!(
                a.shape(&imp.graph.outputs[0]).unwrap(),
                [b, t, 64],
                "{exporter}"
            );
            // pos(torch.arange(t)): the first t rows of the position table,
            // a slice (our kernels take no integer constants).
            let rows = imp.graph.nodes.iter().find(|n| {
                n.op == Op::Slice {
                    axis: 0,
                    start: 0,
                    end: t,
                }
            });
            assert_eq!(
                rows.map(|n| n.inputs.as_slice()),
                Some(["pos.weight".to_string()].as_slice()),
                "{exporter}"
            );
        }
    }
}

#[test]
fn inference_export_with_folded_batchnorm_warns() {
    let path = fixture("cnn.folded.onnx");
    let imp = onnx::import_file(&path, &[2, 3, 16, 16]).unwrap();
    assert_eq!(imp.warnings.len(), 1, "{:?}", imp.warnings);
    let w = &imp.warnings[0];
    for needle in [
        "cnn.folded.onnx",
        "inference",
        "onnx::Conv_",
        "dynamo=True, optimize=False",
        "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False",
    ] {
        assert!(w.contains(needle), "`{needle}` missing from: {w}");
    }
    assert!(
        !imp.graph
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::BatchNorm { .. }))
    );

    // The dynamo exporter without optimize=False folds BatchNorm as well.
    let path = fixture("cnn.folded.dynamo.onnx");
    let imp = onnx::import_file(&path, &[2, 3, 16, 16]).unwrap();
    assert_eq!(imp.warnings.len(), 1, "{:?}", imp.warnings);
    let w = &imp.warnings[0];
    assert!(
        w.contains("optimize=True") && w.contains("dynamo=True, optimize=False"),
        "{w}"
    );
}

#[test]
fn corrupt_and_truncated_files_give_one_clear_error() {
    let bytes = std::fs::read(fixture("cnn.legacy.onnx")).unwrap();
    let half = &bytes[..bytes.len() / 2];
    let err = onnx::import_named("cut.onnx", half, &no_external, &[2, 3, 16, 16]).unwrap_err();
    assert!(matches!(err, OnnxError::Decode { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("cut.onnx: ") && msg.contains("corrupt or truncated"),
        "{msg}"
    );

    let garbage = b"this is not an ONNX file\xff\xff\xff".to_vec();
    let err = onnx::import(&garbage, &no_external, &[1]).unwrap_err();
    assert!(matches!(err, OnnxError::Decode { .. }), "{err}");

    // Damage anywhere gives an error or a graph, never a panic.
    for i in (0..bytes.len()).step_by(331) {
        let mut b = bytes.clone();
        b[i] ^= 0xa5;
        let _ = onnx::import(&b, &no_external, &[2, 3, 16, 16]);
        let _ = onnx::import(&bytes[..i], &no_external, &[2, 3, 16, 16]);
    }
}

#[test]
fn nasty_attribute_and_constant_values_never_panic() {
    // Every integer attribute and every int64 Constant, set in turn to values
    // that break naive index arithmetic; the dynamic-axes transformer has the
    // most shape arithmetic, the CNNs the window ops.
    let cases: [(&str, &[usize]); 3] = [
        ("transformer.dynamic.legacy.onnx", &[2, 8]),
        ("cnn.legacy.onnx", &[2, 3, 16, 16]),
        ("resnet.dynamo.onnx", &[2, 3, 16, 16]),
    ];
    for (file, shape) in cases {
        let bytes = std::fs::read(fixture(file)).unwrap();
        let data = std::fs::read(fixture(&format!("{file}.data"))).unwrap_or_default();
        let read = |_: &str| Ok(data.clone());
        let m = pb::ModelProto::decode(bytes.as_slice()).unwrap();
        let nodes = m.graph.as_ref().unwrap().node.len();
        let mut imports = 0;
        for ni in 0..nodes {
            let attrs = m.graph.as_ref().unwrap().node[ni].attribute.len();
            for (ai, value) in
                (0..attrs).flat_map(|a| [-1, 0, 3, i64::MAX, i64::MIN, 1 << 40].map(|v| (a, v)))
            {
                let mut m = m.clone();
                let node = &mut m.graph.as_mut().unwrap().node[ni];
                let mut touched = false;
                if let Some(a) = node.attribute.get_mut(ai) {
                    if a.i.is_some() {
                        a.i = Some(value);
                        touched = true;
                    }
                    for v in &mut a.ints {
                        *v = value;
                        touched = true;
                    }
                    if let Some(t) = &mut a.t
                        && t.data_type() == pb::tensor_proto::DataType::Int64 as i32
                    {
                        let n = t.raw_data.as_ref().map_or(0, |r| r.len() / 8);
                        t.raw_data = Some(value.to_le_bytes().repeat(n));
                        t.int64_data.iter_mut().for_each(|v| *v = value);
                        touched = true;
                    }
                }
                if touched {
                    let _ = onnx::import(&m.encode_to_vec(), &read, shape);
                    imports += 1;
                }
            }
        }
        assert!(imports > 20, "{file}: {imports}");
    }
}

#[test]
fn missing_or_short_external_data_names_the_file() {
    let bytes = std::fs::read(fixture("mlp.dynamo.onnx")).unwrap();
    let err = onnx::import_named("mlp.dynamo.onnx", &bytes, &no_external, &[2, 16]).unwrap_err();
    let OnnxError::ExternalData {
        file,
        tensor,
        location,
        reason,
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(
        (file.as_str(), tensor.as_str(), location.as_str()),
        ("mlp.dynamo.onnx", "fc1.weight", "mlp.dynamo.onnx.data")
    );
    assert!(reason.contains("no such file"), "{err}");

    let data = std::fs::read(fixture("mlp.dynamo.onnx.data")).unwrap();
    let short = |_: &str| Ok(data[..100].to_vec());
    let err = onnx::import(&bytes, &short, &[2, 16]).unwrap_err();
    assert!(
        matches!(&err, OnnxError::ExternalData { reason, .. } if reason.contains("past the end")),
        "{err}"
    );

    // import_file looks beside the model; a copy without its .data fails alike.
    let dir = std::env::temp_dir().join(format!("rookery-onnx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("mlp.dynamo.onnx");
    std::fs::write(&copy, &bytes).unwrap();
    let err = onnx::import_file(&copy, &[2, 16]).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(err, OnnxError::ExternalData { .. }), "{err}");
    assert!(err.to_string().contains("mlp.dynamo.onnx.data"), "{err}");
}

#[test]
fn external_data_may_not_leave_the_model_folder() {
    let bytes = std::fs::read(fixture("mlp.dynamo.onnx")).unwrap();
    let mut m = pb::ModelProto::decode(bytes.as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    for kv in &mut g.initializer[0].external_data {
        if kv.key() == "location" {
            kv.value = Some("../../etc/passwd".into());
        }
    }
    let asked = std::cell::Cell::new(false);
    let read = |_: &str| {
        asked.set(true);
        Ok(vec![])
    };
    let err = onnx::import(&m.encode_to_vec(), &read, &[2, 16]).unwrap_err();
    assert!(matches!(err, OnnxError::ExternalData { .. }), "{err}");
    assert!(!asked.get());
}

/// The legacy CNN with one node's op replaced, re-encoded with the generated types.
fn edited_cnn(edit: impl FnOnce(&mut pb::GraphProto)) -> Vec<u8> {
    let bytes = std::fs::read(fixture("cnn.legacy.onnx")).unwrap();
    let mut m = pb::ModelProto::decode(bytes.as_slice()).unwrap();
    edit(m.graph.as_mut().unwrap());
    m.encode_to_vec()
}

#[test]
fn unsupported_op_names_node_op_and_file() {
    let bytes = edited_cnn(|g| {
        let relu = g.node.iter_mut().find(|n| n.op_type() == "Relu").unwrap();
        relu.op_type = Some("HardSwish".into());
    });
    let err = onnx::import_named("edited.onnx", &bytes, &no_external, &[2, 3, 16, 16]).unwrap_err();
    let OnnxError::UnsupportedOp { file, node, op, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(
        (file.as_str(), node.as_str(), op.as_str()),
        ("edited.onnx", "/relu1/Relu", "HardSwish")
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("edited.onnx: node `/relu1/Relu` (HardSwish): unsupported op `HardSwish`"),
        "{msg}"
    );

    // Ops from other domains (custom ops, unexpanded functions) likewise.
    let bytes = edited_cnn(|g| {
        let relu = g.node.iter_mut().find(|n| n.op_type() == "Relu").unwrap();
        relu.domain = Some("com.example".into());
    });
    let err = onnx::import(&bytes, &no_external, &[2, 3, 16, 16]).unwrap_err();
    assert!(
        err.to_string()
            .contains("unsupported op `com.example::Relu`"),
        "{err}"
    );
}

#[test]
fn shape_from_runtime_values_is_a_dynamic_shape_error() {
    // Feed the transformer's reshape a target computed from the token ids.
    let bytes = std::fs::read(fixture("transformer.legacy.onnx")).unwrap();
    let mut m = pb::ModelProto::decode(bytes.as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    let input = g.input[0].name().to_string();
    let reshape = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "Reshape")
        .unwrap();
    reshape.input[1] = input;
    let err = onnx::import(&m.encode_to_vec(), &no_external, &[2, 8]).unwrap_err();
    let OnnxError::DynamicShape { node, op, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!((node.as_str(), op.as_str()), ("/attn/Reshape", "Reshape"));
}

#[test]
fn wrong_input_rank_is_an_input_error() {
    let err = onnx::import_file(fixture("mlp.legacy.onnx"), &[2, 4, 4]).unwrap_err();
    assert!(matches!(err, OnnxError::Input { .. }), "{err}");
    // Another batch size imports, with a warning that the exporter saw batch 2.
    let imp = onnx::import_file(fixture("mlp.legacy.onnx"), &[7, 16]).unwrap();
    assert_eq!(imp.warnings.len(), 1, "{:?}", imp.warnings);
    let a = imp.graph.analyze().unwrap();
    assert_eq!(a.shape(&imp.graph.outputs[0]).unwrap(), [7, 4]);
}

// ---- Hand-built graphs for the folder -------------------------------------

fn attr_ints(name: &str, v: &[i64]) -> pb::AttributeProto {
    pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    }
}

fn ints_tensor(dims: &[i64], v: &[i64]) -> pb::TensorProto {
    pb::TensorProto {
        dims: dims.to_vec(),
        data_type: Some(pb::tensor_proto::DataType::Int64 as i32),
        int64_data: v.to_vec(),
        ..Default::default()
    }
}

fn float_tensor(name: &str, dims: &[i64], v: &[f32]) -> pb::TensorProto {
    pb::TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(pb::tensor_proto::DataType::Float as i32),
        raw_data: Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ..Default::default()
    }
}

fn constant(out: &str, t: pb::TensorProto) -> pb::NodeProto {
    node("Constant", &[], out, vec![attr_tensor("value", t)])
}

fn model(nodes: Vec<pb::NodeProto>, inits: Vec<pb::TensorProto>, output: &str) -> Vec<u8> {
    model_at(18, nodes, inits, output)
}

fn model_at(
    opset: i64,
    nodes: Vec<pb::NodeProto>,
    inits: Vec<pb::TensorProto>,
    output: &str,
) -> Vec<u8> {
    let dims = vec![dim_param("batch"), dim_param("seq"), dim_param("d")];
    model_bytes(opset, dims, nodes, inits, output)
}

#[test]
fn shape_arithmetic_folds_from_the_example_shape() {
    // What exporters write for dynamic axes: split heads with a reshape whose
    // target is computed from Shape, and scale by 1/sqrt(head_dim) computed from
    // the shape too.
    let nodes = vec![
        node("Shape", &["x"], "shape", vec![]),
        constant("i0", ints_tensor(&[], &[0])),
        node("Gather", &["shape", "i0"], "b", vec![attr_int("axis", 0)]),
        constant("ax0", ints_tensor(&[1], &[0])),
        node("Unsqueeze", &["b", "ax0"], "b1", vec![]),
        constant("s1", ints_tensor(&[1], &[1])),
        constant("s2", ints_tensor(&[1], &[2])),
        node("Slice", &["shape", "s1", "s2"], "t1", vec![]),
        node("Shape", &["x"], "d1", vec![attr_int("start", -1)]),
        constant("heads", ints_tensor(&[1], &[4])),
        node("Div", &["d1", "heads"], "hd", vec![]),
        constant("big", ints_tensor(&[1], &[1000])),
        node("Mod", &["hd", "big"], "hd2", vec![]),
        node("Identity", &["hd2"], "hd3", vec![]),
        node(
            "Concat",
            &["b1", "t1", "heads", "hd3"],
            "target",
            vec![attr_int("axis", 0)],
        ),
        node("Reshape", &["x", "target"], "split", vec![]),
        // scale = 1 / sqrt(float(head_dim)), as a float constant.
        node("Squeeze", &["hd3", "ax0"], "hd_s", vec![]),
        node("Cast", &["hd_s"], "hd_f", vec![attr_int("to", 1)]),
        node("Sqrt", &["hd_f"], "sq", vec![]),
        node("CastLike", &["sq", "x"], "sq2", vec![]),
        node("Div", &["split", "sq2"], "scaled", vec![]),
        // A zero tensor of the scaled shape plus an arange, added on: folds too.
        node("Shape", &["scaled"], "sshape", vec![]),
        node(
            "ConstantOfShape",
            &["sshape"],
            "zeros",
            vec![attr_tensor("value", float_tensor("", &[1], &[0.0]))],
        ),
        constant("r0", ints_tensor(&[], &[0])),
        constant("r1", ints_tensor(&[], &[8])),
        constant("r2", ints_tensor(&[], &[1])),
        node("Range", &["r0", "r1", "r2"], "ar", vec![]),
        node("Cast", &["ar"], "arf", vec![attr_int("to", 1)]),
        node("Add", &["zeros", "arf"], "bias", vec![]),
        node("Add", &["scaled", "bias"], "y", vec![]),
    ];
    let bytes = model(nodes, vec![], "y");
    let imp = onnx::import_named("fold.onnx", &bytes, &no_external, &[3, 5, 32]).unwrap();
    // `bias` is as large as the batch: the graph runs only at the batch it
    // was imported for, and says so.
    assert_eq!(imp.warnings.len(), 1, "{:?}", imp.warnings);
    assert!(
        imp.warnings[0].contains("runs only at batch size 3")
            && imp.warnings[0].contains("constant `bias`"),
        "{:?}",
        imp.warnings
    );
    let g = &imp.graph;
    let ops: Vec<(&str, &Op)> = g.nodes.iter().map(|n| (n.name.as_str(), &n.op)).collect();
    assert_eq!(
        ops,
        [
            (
                "split",
                &Op::Reshape {
                    shape: vec![0, 5, 4, 8]
                }
            ),
            ("scaled", &Op::Div),
            ("y", &Op::Add),
        ]
    );
    let a = g.analyze().unwrap();
    assert_eq!(a.shape("y").unwrap(), [3, 5, 4, 8]);
    let sq = g.param("sq2").unwrap();
    assert_eq!(sq.kind, ParamKind::Constant);
    assert_eq!(
        sq.init,
        Init::Values {
            data: vec![8f32.sqrt()]
        }
    );
    let bias = g.param("bias").unwrap();
    assert_eq!(bias.shape, [3, 5, 4, 8]);
    let Init::Values { data } = &bias.init else {
        panic!()
    };
    assert_eq!(&data[..9], &[0., 1., 2., 3., 4., 5., 6., 7., 0.]);
}

#[test]
fn unresolvable_dynamic_input_is_an_error() {
    let nodes = vec![node("Relu", &["x"], "y", vec![])];
    let mut m = pb::ModelProto::decode(model(nodes, vec![], "y").as_slice()).unwrap();
    // A second input with a symbolic dimension: nothing says how large it is.
    let g = m.graph.as_mut().unwrap();
    let mut second = g.input[0].clone();
    second.name = Some("mask".into());
    g.input.push(second);
    let err = onnx::import(&m.encode_to_vec(), &no_external, &[1, 2, 3]).unwrap_err();
    assert!(
        matches!(&err, OnnxError::Input { name, reason, .. } if name == "mask" && reason.contains("dynamic")),
        "{err}"
    );
}

#[test]
fn gemm_without_transposed_weight_and_inline_weights() {
    let w = float_tensor("w", &[3, 2], &[1., 2., 3., 4., 5., 6.]);
    let b = float_tensor("b", &[2], &[0.5, -0.5]);
    let nodes = vec![
        constant("flat", ints_tensor(&[2], &[0, -1])),
        node("Reshape", &["x", "flat"], "x2", vec![]),
        node("Gemm", &["x2", "w", "b"], "y", vec![]),
    ];
    let bytes = model(nodes, vec![w, b], "y");
    let imp = onnx::import(&bytes, &no_external, &[4, 1, 3]).unwrap();
    let g = &imp.graph;
    assert_eq!(g.analyze().unwrap().shape("y").unwrap(), [4, 2]);
    assert_eq!(g.param("w").unwrap().kind, ParamKind::Trainable);
    assert_eq!(
        g.param("w").unwrap().init,
        Init::Values {
            data: vec![1., 2., 3., 4., 5., 6.]
        }
    );
}

#[test]
fn older_opsets_take_axes_as_attributes() {
    // Opset 9: Unsqueeze/Squeeze axes and Slice bounds are attributes, and
    // Softmax's default axis is 1 (fine here: the input is 2-D by then).
    let nodes = vec![
        node("Shape", &["x"], "s", vec![]),
        node(
            "Slice",
            &["s"],
            "last",
            vec![attr_ints("starts", &[-1]), attr_ints("ends", &[i64::MAX])],
        ),
        node("Unsqueeze", &["x"], "u", vec![attr_ints("axes", &[1])]),
        node("Squeeze", &["u"], "q", vec![attr_ints("axes", &[1])]),
        constant("m1", ints_tensor(&[1], &[-1])),
        node("Concat", &["m1", "last"], "flat", vec![attr_int("axis", 0)]),
        node("Reshape", &["q", "flat"], "r", vec![]),
        node("Softmax", &["r"], "y", vec![]),
    ];
    let bytes = model_at(9, nodes, vec![], "y");
    let imp = onnx::import(&bytes, &no_external, &[2, 3, 4]).unwrap();
    let g = &imp.graph;
    let a = g.analyze().unwrap();
    assert_eq!(a.shape("u").unwrap(), [2, 1, 3, 4]);
    assert_eq!(a.shape("y").unwrap(), [6, 4]);
    assert_eq!(g.nodes.last().unwrap().op, Op::Softmax { axis: 1 });

    // At opset 11 a Softmax over a non-last axis flattened the input: refused.
    let nodes = vec![node("Softmax", &["x"], "y", vec![])];
    let err =
        onnx::import(&model_at(11, nodes, vec![], "y"), &no_external, &[2, 3, 4]).unwrap_err();
    assert!(matches!(err, OnnxError::Unsupported { .. }), "{err}");
}

// ---- Imports to run once (`rookery predict`) -----------------------------

fn two_input_model(dir: &std::path::Path) -> PathBuf {
    use pb::tensor_shape_proto::{Dimension, dimension};
    let input = |name: &str, dims: &[i64]| pb::ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: Some(pb::tensor_proto::DataType::Float as i32),
                shape: Some(pb::TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(dimension::Value::DimValue(d)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let output = |name: &str| pb::ValueInfoProto {
        name: Some(name.into()),
        ..Default::default()
    };
    let bytes = pb::ModelProto {
        ir_version: Some(9),
        opset_import: vec![pb::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(18),
        }],
        graph: Some(pb::GraphProto {
            node: vec![
                node("Add", &["x", "bias"], "y", vec![]),
                node("Shape", &["x"], "shape", vec![]),
            ],
            input: vec![input("x", &[2, 3]), input("bias", &[3])],
            output: vec![output("y"), output("shape")],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let path = dir.join("add.onnx");
    std::fs::write(&path, bytes).unwrap();
    path
}

fn fed(name: &str, shape: &[usize], values: Vec<f32>) -> onnx::BoundInput {
    onnx::BoundInput {
        name: name.into(),
        shape: shape.to_vec(),
        values: onnx::BoundValues::F32(values),
    }
}

#[test]
fn a_run_once_import_fixes_inputs_past_the_first_and_keeps_constant_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_input_model(dir.path());
    let feeds = [
        fed("x", &[2, 3], vec![0.0; 6]),
        // No batch dimension shared with `x`: fixed to its values.
        fed("bias", &[3], vec![1.0, 2.0, 3.0]),
    ];
    let g = onnx::import_file_fed(&path, &feeds).unwrap().graph;
    assert_eq!(g.inputs.len(), 1);
    assert_eq!(g.inputs[0].name, "x");
    assert_eq!(
        g.param("bias").unwrap().init,
        Init::Values {
            data: vec![1.0, 2.0, 3.0]
        }
    );
    // `Shape(x)` folds at import; it stays an output, as a constant.
    assert_eq!(g.outputs, ["y", "shape"]);
    let shape = g.nodes.iter().find(|n| n.name == "shape").unwrap();
    assert_eq!(shape.op, Op::Identity);
    let constant = g.param(&shape.inputs[0]).unwrap();
    assert_eq!(constant.kind, ParamKind::Constant);
    assert_eq!(
        constant.init,
        Init::Values {
            data: vec![2.0, 3.0]
        }
    );
}

#[test]
fn a_run_once_import_names_inputs_missing_unknown_or_mis_sized() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_input_model(dir.path());
    let x = fed("x", &[2, 3], vec![0.0; 6]);
    let cases = [
        (vec![x.clone()], "bias", "no value is given for it"),
        (
            vec![
                x.clone(),
                fed("bias", &[3], vec![0.0; 3]),
                fed("z", &[1], vec![0.0]),
            ],
            "z",
            "is not an input of the graph",
        ),
        (
            vec![x, fed("bias", &[3], vec![0.0; 2])],
            "bias",
            "2 values given for shape [3]",
        ),
    ];
    for (feeds, input, says) in cases {
        let err = onnx::import_file_fed(&path, &feeds).unwrap_err();
        assert!(
            matches!(&err, OnnxError::Input { name, reason, .. } if name == input && reason.contains(says)),
            "{err}"
        );
    }
}
