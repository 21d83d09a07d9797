//! Helpers shared by the `exec_*` tests: tiny graphs, tensors from literals,
//! and comparisons.
#![allow(dead_code)]

use std::collections::BTreeMap;

use rookery_model::{DType, Graph, Init, Input, Node, Op, Param, ParamKind};
use rookery_torch::exec::{TorchExecutor, tensors_from_values};
use tch::{Device, Kind, Tensor};

pub fn t(data: &[f32], shape: &[i64]) -> Tensor {
    Tensor::from_slice(data).reshape(shape)
}

pub fn t64(data: &[f64], shape: &[i64]) -> Tensor {
    Tensor::from_slice(data).reshape(shape)
}

pub fn ti(data: &[i64], shape: &[i64]) -> Tensor {
    Tensor::from_slice(data).reshape(shape)
}

/// Flat values as f64.
pub fn vals(x: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(x.to_kind(Kind::Double).flatten(0, -1).contiguous()).unwrap()
}

pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}[{i}]: got {g}, want {w} (error {err:e} > {tol:e})\n got {got:?}\nwant {want:?}"
        );
    }
}

pub fn dims(x: &Tensor) -> Vec<usize> {
    x.size().iter().map(|&d| d as usize).collect()
}

pub fn input(name: &str, x: &Tensor) -> Input {
    Input {
        name: name.into(),
        shape: dims(x),
        dtype: if x.kind() == Kind::Int64 {
            DType::I64
        } else {
            DType::F32
        },
    }
}

pub fn param(name: &str, shape: &[usize], data: Vec<f32>) -> Param {
    Param {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: DType::F32,
        kind: ParamKind::Trainable,
        init: Init::Values { data },
    }
}

pub fn buffer(name: &str, shape: &[usize], dtype: DType, data: Vec<f32>) -> Param {
    Param {
        name: name.into(),
        shape: shape.to_vec(),
        dtype,
        kind: ParamKind::Buffer,
        init: Init::Values { data },
    }
}

pub fn node(name: &str, op: Op, inputs: &[&str]) -> Node {
    Node {
        name: name.into(),
        op,
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
    }
}

/// Parameters of `g` as CPU tensors, from the graph's initialisers.
pub fn init_params(g: &Graph, seed: u64) -> BTreeMap<String, Tensor> {
    tensors_from_values(g, &g.initial_values(seed)).unwrap()
}

pub fn owned(params: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    params
        .iter()
        .map(|(k, v)| (k.clone(), v.shallow_clone()))
        .collect()
}

/// One node `y` applying `op` to the graph inputs and parameters listed, in
/// that order, as a whole-graph executor.
pub fn single_op(op: Op, inputs: &[(&str, &Tensor)], params: Vec<Param>) -> (Graph, TorchExecutor) {
    let mut names: Vec<&str> = inputs.iter().map(|(n, _)| *n).collect();
    let pnames: Vec<String> = params.iter().map(|p| p.name.clone()).collect();
    names.extend(pnames.iter().map(String::as_str));
    let g = Graph {
        inputs: inputs.iter().map(|(n, x)| input(n, x)).collect(),
        params,
        nodes: vec![node("y", op, &names)],
        outputs: vec!["y".into()],
    };
    let p = init_params(&g, 0);
    let exec = TorchExecutor::new(&g, 0..1, vec!["y".into()], p, Device::Cpu).unwrap();
    (g, exec)
}

/// Evaluates `op` once (eval mode) and returns its output.
pub fn eval_op(op: Op, inputs: &[(&str, &Tensor)], params: Vec<Param>) -> Tensor {
    let (_, exec) = single_op(op, inputs, params);
    let feed: Vec<(String, Tensor)> = inputs
        .iter()
        .map(|(n, x)| (n.to_string(), x.shallow_clone()))
        .collect();
    let mut out = exec.evaluate(&feed).unwrap();
    out.remove(0).1
}

/// Deterministic pseudo-random values in [-1, 1) (no libtorch RNG involved).
pub use rookery_test_support::pseudo;

/// The pipeline tests' MLP (with dropout), shared by the executor's and the
/// worker's parity tests so both prove the same model.
pub const MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 16
activation = "relu"
[[layers]]
type = "Dropout"
rate = 0.2
[[layers]]
type = "Dense"
units = 12
activation = "tanh"
[[layers]]
type = "LayerNormalization"
[[layers]]
type = "Dense"
units = 4
"#;

/// The pipeline tests' CNN (no BatchNorm).
pub const CNN: &str = r#"
input_shape = [2, 8, 8]
[[layers]]
type = "Conv2D"
filters = 4
kernel_size = 3
padding = "same"
activation = "relu"
[[layers]]
type = "MaxPooling2D"
pool_size = 2
[[layers]]
type = "Conv2D"
filters = 6
kernel_size = 3
stride = 1
activation = "gelu"
[[layers]]
type = "AveragePooling2D"
pool_size = 2
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 3
"#;
