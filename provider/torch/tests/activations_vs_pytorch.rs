//! The activations added beside ReLU, GELU, sigmoid and tanh on the libtorch
//! backend against what PyTorch itself computed (tests/fixtures/activations,
//! made by its `make.py`):
//!
//! - `rookery_torch::exec::activation`, for every parameter set of
//!   `ACTIVATIONS`, gives torch.nn.functional's values and input gradients
//!   at the kinks (where torch's `>` against `>=` decides) and across the
//!   range: the ATen ops tch binds only with torch's defaults, and torch's
//!   arithmetic in ATen ops otherwise, both as torch computes them;
//! - the MLPs using all twelve, as PyTorch's two exporters wrote them
//!   (torch's defaults and other parameters), imported and run whole on
//!   the libtorch executor, give PyTorch's output and every parameter's
//!   gradient for the same input and output gradient.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rookery_kernels::elementwise::{ACTIVATIONS, Activation};
use rookery_torch::exec::{TorchExecutor, activation, stage_boundary, tensors_from_values};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/activations")
        .join(name)
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

fn t(data: &[f32], shape: &[i64]) -> Tensor {
    Tensor::from_slice(data).reshape(shape)
}

fn vals(x: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(x.to_kind(Kind::Double).flatten(0, -1).contiguous()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// `got` against PyTorch's `want`, each within `tol` of `max(1, |want|)`.
fn assert_near(got: &[f64], want: &[f32], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let w = f64::from(w);
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}[{i}]: {g}, PyTorch {w} (error {err:e} > {tol:e})"
        );
    }
}

/// The entry of `ACTIVATIONS` a case of kinks.json is for.
fn activation_of(case: &Value) -> Activation {
    let name = case["name"].as_str().unwrap();
    let params = floats(&case["params"]);
    ACTIVATIONS
        .into_iter()
        .find(|a| a.name() == name && a.params() == params)
        .unwrap_or_else(|| panic!("no activation {name}{params:?}"))
}

/// One f32 rounding of a few operations: PyTorch's own kernels against the
/// same ATen kernels, or torch's arithmetic recomposed in ATen ops.
const TOL: f64 = 2e-6;

#[test]
fn the_libtorch_activations_give_pytorchs_values_and_gradients_at_the_kinks_and_beyond() {
    let cases = json("kinks.json")["cases"].as_array().unwrap().clone();
    assert_eq!(cases.len(), ACTIVATIONS.len());
    for (case, want) in cases.iter().zip(ACTIVATIONS) {
        let a = activation_of(case);
        assert_eq!(a, want, "kinks.json follows ACTIVATIONS' order");
        let (x, dy) = (floats(&case["x"]), floats(&case["dy"]));
        let n = x.len() as i64;
        let xt = t(&x, &[n]).set_requires_grad(true);
        let y = activation(&xt, a).unwrap();
        (&y * t(&dy, &[n])).sum(Kind::Float).backward();
        let label = a.label();
        assert_near(&vals(&y), &floats(&case["y"]), TOL, &format!("{label} y"));
        assert_near(
            &vals(&xt.grad()),
            &floats(&case["dx"]),
            TOL,
            &format!("{label} dx"),
        );
        // Where a branch is cut off (hardtanh's ends, a shrink's band,
        // threshold's replaced values) the gradient is exactly 0, as torch's.
        for (i, &w) in floats(&case["dx"]).iter().enumerate() {
            if w == 0.0 {
                assert_eq!(vals(&xt.grad())[i], 0.0, "{label} dx[{i}] at {}", x[i]);
            }
        }
    }
}

#[test]
fn imported_mlps_of_all_twelve_give_pytorchs_output_and_gradients_on_libtorch() {
    let e = json("expected.json");
    let x = floats(&e["x"]);
    let dy = floats(&e["dy"]);
    let batch = e["x_shape"][0].as_u64().unwrap() as usize;
    let files = e["files"].as_object().unwrap();
    assert_eq!(files.len(), 4);
    for (file, want) in files {
        let graph = rookery_model::onnx::import_file(fixture(file), &[3, 6])
            .unwrap_or_else(|err| panic!("{file}: {err}"))
            .graph;
        let n = graph.nodes.len();
        let params = tensors_from_values(&graph, &graph.initial_values(0)).unwrap();
        let outputs = stage_boundary(&graph, n).unwrap();
        let mut exec = TorchExecutor::new(&graph, 0..n, outputs, params, Device::Cpu).unwrap();
        let input = graph.inputs[0].name.clone();
        let f = exec
            .forward(&[(input, t(&x, &[batch as i64, 6]))], true)
            .unwrap();
        assert_eq!(f.outputs.len(), 1, "{file}");
        let (name, y) = &f.outputs[0];
        assert_near(
            &vals(y),
            &floats(&want["y"]),
            TOL,
            &format!("{file} output"),
        );
        let grad: Tensor = t(&dy, &[batch as i64, 3]);
        exec.backward(f.micro_batch, &[(name.clone(), grad)])
            .unwrap();
        let grads = exec.gradients().unwrap();
        let expected = want["grads"].as_object().unwrap();
        assert_eq!(grads.len(), expected.len(), "{file}: 13 weights and biases");
        for (param, g) in &grads {
            let w = floats(&expected[param.as_str()]);
            // The first layers' gradients come back through every activation.
            assert_near(&vals(g), &w, 1e-5, &format!("{file} gradient of {param}"));
        }
    }
}
