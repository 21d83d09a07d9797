//! `precision = "mixed"` on every backend: our stage executor (WGSL kernels
//! on the GPU wgpu finds, and their CPU references) and the libtorch one
//! round every matrix product's operands and output gradient the same way,
//! so a mixed step agrees across backends far more closely than either
//! agrees with f32: rounding is the same, only f32 sums differ, and those
//! flip an f16 rounding only now and then.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use exec_common::*;
use rookery_model::{Graph, OptimizerConfig, Precision, from_toml};
use rookery_stage::{CpuDevice, Device, GpuDevice, HostTensor, StageExecutor};
use rookery_test_support::dense_mlp;
use rookery_torch::exec::{TorchExecutor, TorchOptimizer, stage_boundary, tensors_from_values};
use tch::{Device as TorchDevice, Tensor};

const MNIST_CNN: &str = include_str!("../../../examples/mnist-cnn.toml");
const BATCH: usize = 8;
const LR: f64 = 0.5;

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: LR,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    }
}

/// What one training step of the whole graph gives: its outputs, then its
/// parameters after an SGD step (`lr` large, so the gradients show).
struct Step {
    outputs: Vec<f64>,
    params: Vec<f64>,
}

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// The micro-batch's inputs and its outputs' gradients.
fn inputs(graph: &Graph) -> (Named, Named) {
    let analysis = graph.analyze().unwrap();
    // `name` at the micro-batch's size, pseudo-random values times `scale`.
    let sample = |name: &str, seed: u64, scale: f32| {
        let mut shape: Vec<i64> = analysis.tensors[name]
            .shape
            .iter()
            .map(|&d| d as i64)
            .collect();
        shape[0] = BATCH as i64;
        let n = shape.iter().product::<i64>() as usize;
        let values: Vec<f32> = pseudo(n, seed).iter().map(|v| v * scale).collect();
        (name.to_string(), t(&values, &shape))
    };
    let x: Named = (graph.inputs.iter().enumerate())
        .map(|(i, input)| sample(&input.name, 11 + i as u64, 1.0))
        .collect();
    // A mean loss's gradient: small, as f16 alone could not hold.
    let dy: Named = (graph.outputs.iter().enumerate())
        .map(|(i, name)| sample(name, 50 + i as u64, 1e-4))
        .collect();
    (x, dy)
}

fn flat(tensors: impl IntoIterator<Item = Vec<f64>>) -> Vec<f64> {
    tensors.into_iter().flatten().collect()
}

fn host(x: &Tensor) -> HostTensor {
    HostTensor {
        shape: dims(x),
        data: vals(x).into_iter().map(|v| v as f32).collect(),
    }
}

fn torch_step(graph: &Graph, precision: Precision) -> Step {
    let n = graph.analyze().unwrap().nodes.len();
    let outputs = stage_boundary(graph, n).unwrap();
    let params = tensors_from_values(graph, &graph.initial_values(7)).unwrap();
    let mut exec = TorchExecutor::new(graph, 0..n, outputs, params, TorchDevice::Cpu)
        .unwrap()
        .with_precision(precision);
    let mut optimizer = TorchOptimizer::new(sgd()).unwrap();
    exec.set_step_seed(3);
    let (x, dy) = inputs(graph);
    let forward = exec.forward_at(&x, true, 0).unwrap();
    let out = flat(forward.outputs.iter().map(|(_, y)| vals(y)));
    exec.backward(forward.micro_batch, &dy).unwrap();
    exec.step(&mut optimizer).unwrap();
    Step {
        outputs: out,
        params: flat(exec.parameters().unwrap().iter().map(|(_, p)| vals(p))),
    }
}

fn our_step<D: Device>(device: D, graph: &Graph, precision: Precision) -> Step {
    let n = graph.analyze().unwrap().nodes.len();
    let outputs = stage_boundary(graph, n).unwrap();
    let mut exec = StageExecutor::new(
        device,
        graph,
        0..n,
        &outputs,
        &graph.initial_values(7),
        sgd(),
    )
    .unwrap();
    exec.set_precision(precision).unwrap();
    exec.set_step_seed(3);
    let (x, dy) = inputs(graph);
    let x: Vec<_> = x.iter().map(|(n, v)| (n.clone(), host(v))).collect();
    let dy: Vec<_> = dy.iter().map(|(n, v)| (n.clone(), host(v))).collect();
    let (micro_batch, got) = pollster::block_on(exec.forward_at(&x, 0)).unwrap();
    let out = flat(
        got.iter()
            .map(|(_, y)| y.data.iter().map(|&v| f64::from(v)).collect()),
    );
    pollster::block_on(exec.backward(micro_batch, &dy)).unwrap();
    pollster::block_on(exec.step_at_lr(LR)).unwrap();
    let params = pollster::block_on(exec.parameters()).unwrap();
    Step {
        outputs: out,
        params: flat(
            params
                .iter()
                .map(|(_, p)| p.data.iter().map(|&v| f64::from(v)).collect()),
        ),
    }
}

fn rms_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / a.len().max(1) as f64).sqrt()
}

/// Our mixed step and libtorch's are at least 20 times closer than
/// libtorch's mixed and f32 steps, outputs and updated parameters alike.
fn agrees_with_libtorch<D: Device>(device: D, graph: &Graph, what: &str) {
    let theirs = torch_step(graph, Precision::Mixed);
    let f32_step = torch_step(graph, Precision::F32);
    let ours = our_step(device, graph, Precision::Mixed);
    for (part, ours, theirs, f32_values) in [
        ("outputs", &ours.outputs, &theirs.outputs, &f32_step.outputs),
        ("parameters", &ours.params, &theirs.params, &f32_step.params),
    ] {
        let between = rms_difference(ours, theirs);
        let precision_effect = rms_difference(theirs, f32_values);
        assert!(
            precision_effect > 0.0 && between < precision_effect / 20.0,
            "{what} {part}: ours and libtorch's mixed differ by {between:e} (rms), \
             mixed and f32 by {precision_effect:e}"
        );
    }
}

fn graphs() -> Vec<(&'static str, Graph)> {
    let mlp = dense_mlp(24, &[(32, Some("relu")), (16, Some("tanh")), (4, None)]);
    vec![
        ("mlp", from_toml(&mlp).unwrap()),
        ("demo cnn", from_toml(MNIST_CNN).unwrap()),
    ]
}

#[test]
fn mixed_precision_steps_on_the_cpu_references_agree_with_libtorch() {
    for (what, graph) in graphs() {
        agrees_with_libtorch(CpuDevice, &graph, what);
    }
}

#[test]
fn mixed_precision_steps_on_the_gpu_agree_with_libtorch() {
    let gpu = pollster::block_on(GpuDevice::open()).unwrap_or_else(|e| {
        panic!("no usable GPU adapter ({e}); install mesa-vulkan-drivers (lavapipe)")
    });
    let gpu = std::sync::Arc::new(gpu);
    for (what, graph) in graphs() {
        agrees_with_libtorch(gpu.clone(), &graph, what);
    }
}
