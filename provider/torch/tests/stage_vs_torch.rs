//! Our own stage executor (`rookery-stage`: WGSL kernels through wgpu, and
//! their CPU references) against the libtorch executor, stage for stage:
//! the same graph slice, parameters, micro-batches and output gradients must
//! give the same outputs, input gradients and, after several optimizer
//! steps, the same parameters. The GPU runs on whatever adapter wgpu finds
//! (lavapipe, Mesa's software Vulkan, on CI); a machine without one fails
//! here rather than skipping.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use std::collections::BTreeMap;

use exec_common::*;
use rookery_kernels::winograd::Winograd;
use rookery_model::{DType, Graph, Init, LrSchedule, Op, OptimizerConfig, clip_scale, from_toml};
use rookery_stage::{CpuDevice, Device, GpuDevice, HostTensor};
use rookery_test_support::bounds::{
    ErrorBound, WGSL_DIVISION_ULPS, WGSL_INVERSE_SQRT_ULPS, tensor_magnitudes, wgsl_exp_ulps,
};
use rookery_test_support::dense_mlp;
use rookery_torch::exec::{TorchExecutor, TorchOptimizer, stage_boundary, tensors_from_values};
use tch::{Device as TorchDevice, Kind, Tensor};

fn mlp() -> String {
    dense_mlp(
        6,
        &[
            (16, Some("relu")),
            (12, Some("tanh")),
            (8, Some("sigmoid")),
            (4, None),
        ],
    )
}

/// LayerNorm (with weight and bias), Softmax over features, LogSoftmax.
const NORMED_MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 12
[[layers]]
type = "LayerNormalization"
[[layers]]
type = "Activation"
name = "gelu"
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "softmax"
[[layers]]
type = "Dense"
units = 5
[[layers]]
type = "Activation"
name = "log_softmax"
"#;

/// Grouped, strided and dilated convolutions, padded max and average
/// pooling, and a global average pool.
const CNN: &str = r#"
input_shape = [2, 9, 9]
[[layers]]
type = "Conv2D"
filters = 4
kernel_size = 3
padding = 1
activation = "relu"
[[layers]]
type = "MaxPooling2D"
pool_size = 3
stride = 2
padding = 1
[[layers]]
type = "Conv2D"
filters = 6
kernel_size = [2, 3]
stride = [1, 2]
dilation = 2
padding = [1, 2]
groups = 2
[[layers]]
type = "AveragePooling2D"
pool_size = 2
stride = 1
padding = 1
[[layers]]
type = "Conv2D"
filters = 3
kernel_size = 1
bias = false
[[layers]]
type = "GlobalAveragePooling2D"
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 4
"#;

/// Convolutions wide enough to run as Winograd: F(4x4, 3x3) on the 9x9
/// image, F(2x2, 3x3) on the 7x7 one unpadded convolution leaves.
const WIDE_CNN: &str = r#"
input_shape = [32, 9, 9]
[[layers]]
type = "Conv2D"
filters = 32
kernel_size = 3
padding = 1
activation = "relu"
[[layers]]
type = "Conv2D"
filters = 36
kernel_size = 3
[[layers]]
type = "GlobalAveragePooling2D"
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 4
"#;

/// BatchNorm1d (running statistics and batch counter) and Dropout between
/// Dense layers, LayerNorm after them.
const REGULARISED_MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 12
[[layers]]
type = "BatchNormalization1D"
momentum = 0.2
[[layers]]
type = "Activation"
name = "relu"
[[layers]]
type = "Dropout"
rate = 0.3
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "LayerNormalization"
[[layers]]
type = "Dropout"
rate = 0.5
[[layers]]
type = "Dense"
units = 4
"#;

/// The activations added beside ReLU, GELU, sigmoid and tanh, with other
/// parameters than torch's defaults where they have any, softmin included,
/// each after a Dense layer.
const ACTIVATION_MLP: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 8
activation = "selu"
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "leaky_relu"
negative_slope = 0.2
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "elu"
alpha = 0.5
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "softplus"
beta = 2
threshold = 0.5
[[layers]]
type = "Dense"
units = 8
activation = "softsign"
[[layers]]
type = "Dense"
units = 8
activation = "tanhshrink"
[[layers]]
type = "Dense"
units = 8
activation = "logsigmoid"
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "hardshrink"
lambd = 0.1
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "hardtanh"
min_val = -0.2
max_val = 0.3
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "softmin"
dim = 1
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "softshrink"
lambd = 0.05
[[layers]]
type = "Dense"
units = 8
[[layers]]
type = "Activation"
name = "threshold"
threshold = 0.02
value = -0.5
[[layers]]
type = "Dense"
units = 4
"#;

/// The demo CNN: Conv2d, BatchNorm2d, max pooling, Dropout, Dense.
const MNIST_CNN: &str = include_str!("../../../examples/mnist-cnn.toml");

/// Uneven micro-batches, as `torch.chunk` makes of 18 samples in 4.
const MICRO_BATCHES: [usize; 4] = [5, 5, 5, 3];
const STEPS: u64 = 6;

fn host(x: &Tensor) -> HostTensor {
    HostTensor {
        shape: dims(x),
        data: vals(x).into_iter().map(|v| v as f32).collect(),
    }
}

fn tensor(h: &HostTensor) -> Tensor {
    let shape: Vec<i64> = h.shape.iter().map(|&d| d as i64).collect();
    t(&h.data, &shape)
}

/// `got` against libtorch's `want`, each element within `bound` of the
/// tensor's largest value: every element of a stage's tensor comes out of
/// reductions (and normalisations) over terms about as large as the
/// tensor's largest, so that is the magnitude its rounding scales with.
fn compare(got: &HostTensor, want: &Tensor, bound: ErrorBound, what: &str) {
    assert_eq!(got.shape, dims(want), "{what}: shapes differ");
    let got: Vec<f64> = got.data.iter().map(|&v| f64::from(v)).collect();
    let want = vals(want);
    bound.check(&got, &want, &tensor_magnitudes(&want), what);
}

/// How far our stage and libtorch's may drift apart in one step, forward
/// and backward: both round every reduction of the stage, each within
/// `gamma(terms)` of the exact value ([`rookery_test_support::bounds`]),
/// plus WGSL's ULPs for divisions, `inverseSqrt` and `exp`.
#[derive(Debug, Clone, Copy)]
struct StageBounds {
    forward: ErrorBound,
    backward: ErrorBound,
}

/// Arguments of `exp` beyond this size leave the functions built on it
/// (sigmoid, tanh, GELU, softmax) within an ULP of their limits, so WGSL's
/// `3 + 2|x|` ULPs need not count larger ones.
const EXP_ARGUMENT: f64 = 9.0;

/// The bounds of stage `range` of `graph` at micro-batches of up to `batch`
/// samples: the reductions each node chains (dot products over its inputs,
/// means and variances over what it normalises, sums over pooling windows)
/// forward, and backward the transposed ones plus the sums over the batch
/// that give parameter gradients.
fn stage_bounds(graph: &Graph, range: std::ops::Range<usize>, batch: usize) -> StageBounds {
    let analysis = graph.analyze().unwrap();
    let shape = |name: &str| analysis.tensors[name].shape.clone();
    let (mut forward, mut backward, mut ulps) = (0usize, 0usize, 0.0f64);
    for info in &analysis.nodes[range] {
        let node = &graph.nodes[info.index];
        let out = &info.output.shape;
        // Rows of one sample's output, times the samples of a micro-batch.
        let rows = |dims: &[usize]| {
            batch
                * dims[1..dims.len().saturating_sub(1)]
                    .iter()
                    .product::<usize>()
        };
        let (fwd, bwd) = match &node.op {
            Op::Linear => {
                let w = shape(&node.inputs[1]);
                (w[1] + 1, w[0] + rows(out))
            }
            Op::MatMul => {
                let a = shape(&node.inputs[0]);
                let k = a[a.len() - 1];
                (k, out[out.len() - 1] + k + rows(out))
            }
            Op::Conv2d { .. } => {
                let w = shape(&node.inputs[1]);
                let mut x = shape(&node.inputs[0]);
                x[0] = batch;
                let window = w[2] * w[3];
                let conv = node
                    .op
                    .conv_geometry(&x, &w, node.inputs.len() > 2)
                    .unwrap();
                // Winograd's coefficients magnify its roundings.
                let winograd = |w: Option<Winograd>, direct: usize| {
                    w.map_or(direct, |w| {
                        (w.magnification() * w.rounding_levels() as f64).ceil() as usize
                    })
                };
                let weight_grad =
                    Winograd::weight_grad_of(&conv).map_or(batch * out[2] * out[3], |w| {
                        (w.weight_grad_magnification() * w.weight_grad_rounding_levels() as f64)
                            .ceil() as usize
                    });
                (
                    winograd(Winograd::forward_of(&conv), w[1] * window + 1),
                    winograd(Winograd::backward_input(&conv), w[0] * window) + weight_grad,
                )
            }
            Op::AvgPool2d { kernel, .. } => (kernel[0] * kernel[1], kernel[0] * kernel[1]),
            Op::GlobalAveragePool => {
                let x = shape(&node.inputs[0]);
                (x[2] * x[3], 1)
            }
            Op::BatchNorm { .. } => {
                let x = shape(&node.inputs[0]);
                let n = batch * x[2..].iter().product::<usize>();
                ulps += WGSL_INVERSE_SQRT_ULPS + WGSL_DIVISION_ULPS;
                (3 * n, 3 * n)
            }
            Op::LayerNorm { axis, .. } => {
                let x = shape(&node.inputs[0]);
                let from = if *axis < 0 {
                    x.len() - axis.unsigned_abs() as usize
                } else {
                    *axis as usize
                };
                let n: usize = x[from..].iter().product();
                ulps += WGSL_INVERSE_SQRT_ULPS + WGSL_DIVISION_ULPS;
                (3 * n, 3 * n)
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Softmin { axis } => {
                let from = if *axis < 0 {
                    out.len() - axis.unsigned_abs() as usize
                } else {
                    *axis as usize
                };
                ulps += wgsl_exp_ulps(EXP_ARGUMENT) + WGSL_DIVISION_ULPS;
                (2 * out[from], 2 * out[from])
            }
            Op::Sigmoid | Op::Tanh | Op::Gelu | Op::Elu { .. } | Op::Selu | Op::Tanhshrink => {
                ulps += wgsl_exp_ulps(EXP_ARGUMENT) + WGSL_DIVISION_ULPS;
                (1, 1)
            }
            // WGSL's `log` near 1 is within an absolute 2^-21, 4 ULPs there.
            Op::Softplus { .. } | Op::LogSigmoid => {
                ulps += wgsl_exp_ulps(EXP_ARGUMENT) + 2.0 * WGSL_DIVISION_ULPS + 4.0;
                (1, 1)
            }
            Op::Div | Op::Softsign => {
                ulps += WGSL_DIVISION_ULPS;
                (1, 1)
            }
            _ => (1, 1),
        };
        forward += fwd;
        backward += bwd;
    }
    StageBounds {
        forward: ErrorBound::of(forward, ulps),
        // Backward reruns the forward's arithmetic, then its own.
        backward: ErrorBound::of(forward + backward, 2.0 * ulps),
    }
}

/// Runs stage `range` of `graph` on `device` next to libtorch for
/// [`STEPS`] steps with `config`, comparing everything each step.
fn same_as_torch<D: Device>(
    device: D,
    graph: &Graph,
    range: std::ops::Range<usize>,
    config: OptimizerConfig,
) {
    same_as_torch_scheduled(device, graph, range, config, LrSchedule::default(), None);
}

/// [`same_as_torch`] with the learning rate of `schedule` each step and,
/// with `clip`, both sides' gradients scaled by one `clip_grad_norm_`
/// multiplier (libtorch's, as the server sends one multiplier to all)
/// after checking the two sums of squares agree.
fn same_as_torch_scheduled<D: Device>(
    device: D,
    graph: &Graph,
    range: std::ops::Range<usize>,
    config: OptimizerConfig,
    schedule: LrSchedule,
    clip: Option<f64>,
) {
    let what = format!("{} nodes {range:?}", device.describe());
    let bounds = stage_bounds(graph, range.clone(), MICRO_BATCHES[0]);
    // Each step's rounding carries into the next (parameters, running
    // statistics, optimizer state): after `s` steps the two may be `s + 1`
    // steps' rounding apart.
    let after = |steps: u64, bound: ErrorBound| bound.between_two().times((steps + 1) as f64);
    let values: BTreeMap<String, Vec<f32>> = graph.initial_values(7);
    let outputs = stage_boundary(graph, range.end).unwrap();
    let params = tensors_from_values(graph, &values).unwrap();
    let mut torch = TorchExecutor::new(
        graph,
        range.clone(),
        outputs.clone(),
        params,
        TorchDevice::Cpu,
    )
    .unwrap();
    let mut torch_opt = TorchOptimizer::new(config).unwrap();
    let mut ours =
        rookery_stage::StageExecutor::new(device, graph, range.clone(), &outputs, &values, config)
            .unwrap();
    assert_eq!(ours.input_names(), torch.input_names(), "{what}");
    assert_eq!(ours.grad_input_names(), torch.grad_input_names(), "{what}");
    let analysis = graph.analyze().unwrap();
    let mut seed = 100;
    for step in 0..STEPS {
        let step_seed = rookery_stage::step_seed(3, step);
        torch.set_step_seed(step_seed);
        ours.set_step_seed(step_seed);
        let mut offset = 0;
        let mut pending = Vec::new();
        for &b in &MICRO_BATCHES {
            let inputs: Vec<(String, Tensor)> = torch
                .input_names()
                .into_iter()
                .map(|name| {
                    let mut shape = analysis.tensors[&name].shape.clone();
                    shape[0] = b;
                    seed += 1;
                    let integer = analysis.tensors[&name].dtype == DType::I64;
                    (name, sample(&shape, seed, integer))
                })
                .collect();
            let forward = torch.forward_at(&inputs, true, offset).unwrap();
            let host_inputs: Vec<_> = inputs.iter().map(|(n, x)| (n.clone(), host(x))).collect();
            let (micro_batch, got) =
                pollster::block_on(ours.forward_at(&host_inputs, offset)).unwrap();
            offset += b as u64;
            for ((name, g), (_, w)) in got.iter().zip(&forward.outputs) {
                compare(
                    g,
                    w,
                    after(step, bounds.forward),
                    &format!("{what}: step {step} output {name}"),
                );
            }
            pending.push((forward, micro_batch));
        }
        // Backward in reverse order, as a pipeline drains.
        for (forward, micro_batch) in pending.into_iter().rev() {
            let grads: Vec<(String, Tensor)> = forward
                .outputs
                .iter()
                .map(|(name, y)| {
                    seed += 1;
                    (name.clone(), t(&pseudo(y.numel(), seed), &y.size()))
                })
                .collect();
            let want = torch.backward(forward.micro_batch, &grads).unwrap();
            let host_grads: Vec<_> = grads.iter().map(|(n, g)| (n.clone(), host(g))).collect();
            let got = pollster::block_on(ours.backward(micro_batch, &host_grads)).unwrap();
            assert_eq!(got.len(), want.len(), "{what}");
            for ((name, g), (_, w)) in got.iter().zip(&want) {
                compare(
                    g,
                    w,
                    after(step, bounds.backward),
                    &format!("{what}: step {step} gradient of {name}"),
                );
            }
        }
        if let Some(max_norm) = clip {
            let want = torch.grad_sum_of_squares().unwrap();
            let got = pollster::block_on(ours.grad_sum_of_squares()).unwrap();
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "{what}: step {step}: gradient sum of squares {got}, libtorch {want}"
            );
            let scale = clip_scale(want, max_norm);
            assert!(
                scale < 1.0,
                "{what}: step {step} should clip (norm {})",
                want.sqrt()
            );
            torch.scale_grads(scale).unwrap();
            pollster::block_on(ours.scale_grads(scale as f32)).unwrap();
        }
        let lr = schedule.lr(config.lr(), step);
        torch_opt.set_lr(lr).unwrap();
        torch.step(&mut torch_opt).unwrap();
        pollster::block_on(ours.step_at_lr(lr)).unwrap();
        let want = torch.parameters().unwrap();
        let got = pollster::block_on(ours.parameters()).unwrap();
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            compare(
                g,
                w,
                after(step, bounds.backward),
                &format!("{what}: after step {step}, parameter {name}"),
            );
        }
    }
    // Evaluation mode (no dropout, BatchNorm on running statistics) after
    // training.
    let inputs: Vec<(String, Tensor)> = torch
        .input_names()
        .into_iter()
        .map(|name| {
            let mut shape = analysis.tensors[&name].shape.clone();
            shape[0] = 7;
            let integer = analysis.tensors[&name].dtype == DType::I64;
            (name, sample(&shape, 999, integer))
        })
        .collect();
    let want = torch.evaluate(&inputs).unwrap();
    let host_inputs: Vec<_> = inputs.iter().map(|(n, x)| (n.clone(), host(x))).collect();
    let got = pollster::block_on(ours.evaluate(&host_inputs)).unwrap();
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        compare(
            g,
            w,
            after(STEPS, bounds.forward),
            &format!("{what}: evaluation output {name}"),
        );
    }
    // Parameters loaded from elsewhere (a sync) replace the values exactly.
    let loaded: Vec<(String, HostTensor)> = torch
        .parameters()
        .unwrap()
        .iter()
        .map(|(n, x)| (n.clone(), host(&(x * 0.5))))
        .collect();
    ours.set_parameters(&loaded).unwrap();
    let got = pollster::block_on(ours.parameters()).unwrap();
    for ((name, g), (_, w)) in got.iter().zip(&loaded) {
        compare(
            g,
            &tensor(w),
            ErrorBound::EXACT,
            &format!("{what}: loaded {name}"),
        );
    }
}

/// Pseudo-random floats, or for an integer input indices in `[-VOCAB,
/// VOCAB)`: negative ones count from the end, as ONNX Gather allows.
fn sample(shape: &[usize], seed: u64, integer: bool) -> Tensor {
    let n: usize = shape.iter().product();
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    if integer {
        let v: Vec<i64> = (0..n as i64)
            .map(|j| (j * 7 + seed as i64 * 3) % (2 * VOCAB as i64) - VOCAB as i64)
            .collect();
        ti(&v, &dims)
    } else {
        t(&pseudo(n, seed), &dims)
    }
}

/// Rows of the embedding tables below.
const VOCAB: usize = 10;

fn gpu() -> GpuDevice {
    pollster::block_on(GpuDevice::open()).unwrap_or_else(|e| {
        panic!("no usable GPU adapter ({e}); install mesa-vulkan-drivers (lavapipe)")
    })
}

fn adam() -> OptimizerConfig {
    OptimizerConfig::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        amsgrad: false,
    }
}

/// For the CNNs, whose larger gradients would make a bigger step diverge.
fn sgd_gentle() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: 0.005,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    }
}

fn sgd_momentum() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: 0.05,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 0.001,
    }
}

#[test]
fn mlp_stages_on_the_gpu_match_libtorch_step_for_step() {
    let graph = from_toml(&mlp()).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    // A Root (data in, no input gradient), a Stem, a Leaf and the whole model.
    for (range, config) in [
        (0..3, adam()),
        (2..5, sgd_momentum()),
        (4..n, adam()),
        (0..n, sgd_momentum()),
    ] {
        same_as_torch(gpu(), &graph, range, config);
    }
}

#[test]
fn mlp_stages_on_the_cpu_references_match_libtorch_step_for_step() {
    let graph = from_toml(&mlp()).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [(2..5, adam()), (0..n, sgd_momentum())] {
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn stages_with_a_cosine_schedule_and_clipping_match_libtorch_on_the_gpu_and_the_cpu_references() {
    let graph = from_toml(&mlp()).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    let cosine = LrSchedule::Cosine {
        warmup_steps: 2,
        total_steps: Some(STEPS),
        min_lr: 1e-3,
    };
    let step = LrSchedule::Step {
        step_size: 2,
        gamma: 0.5,
    };
    for (range, config, schedule) in [(2..5, adam(), cosine), (0..n, sgd_momentum(), step)] {
        // A tiny max_norm, so every step clips.
        same_as_torch_scheduled(gpu(), &graph, range.clone(), config, schedule, Some(1e-3));
        same_as_torch_scheduled(CpuDevice, &graph, range, config, schedule, Some(1e-3));
    }
}

#[test]
fn layer_norm_and_softmax_stages_match_libtorch_on_the_gpu_and_the_cpu_references() {
    let graph = from_toml(NORMED_MLP).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [(0..3, adam()), (1..5, sgd_momentum()), (0..n, adam())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn activation_stages_match_libtorch_on_the_gpu_and_the_cpu_references() {
    let graph = from_toml(ACTIVATION_MLP).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [
        (0..n, adam()),
        (0..n / 2, sgd_momentum()),
        (n / 2..n, adam()),
    ] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

/// The MLPs of tests/fixtures/activations, all twelve activations as
/// PyTorch's two exporters write them, imported at a batch of 2.
#[test]
fn imported_activation_mlps_match_libtorch_on_the_gpu_and_the_cpu_references() {
    for name in [
        "custom-dynamo.onnx",
        "custom-legacy.onnx",
        "defaults-dynamo.onnx",
        "defaults-legacy.onnx",
    ] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/activations")
            .join(name);
        let graph = rookery_model::onnx::import_file(&path, &[2, 6])
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .graph;
        let n = graph.nodes.len();
        same_as_torch(gpu(), &graph, 0..n, sgd_gentle());
        same_as_torch(CpuDevice, &graph, 0..n, sgd_gentle());
    }
}

/// x [B, 4, 6] -> t = Transpose(0, 2, 1) -> a = Linear(t) -> c = Concat(t,
/// a; axis 1) -> n = LayerNorm(c) without weight or bias -> s =
/// Softmax(n; axis 1) -> out = Linear(s): `t` gets two gradient
/// contributions, one through the concatenation.
fn shuffled() -> Graph {
    let x = Tensor::zeros([1, 4, 6], (Kind::Float, TorchDevice::Cpu));
    let w = |name: &str, o: usize, i: usize| {
        let mut p = param(name, &[o, i], vec![0.0; o * i]);
        p.init = Init::torch_weight(i);
        p
    };
    Graph {
        inputs: vec![input("x", &x)],
        params: vec![w("a.w", 4, 4), w("out.w", 3, 4)],
        nodes: vec![
            node(
                "t",
                Op::Transpose {
                    perm: vec![0, 2, 1],
                },
                &["x"],
            ),
            node("a", Op::Linear, &["t", "a.w"]),
            node("c", Op::Concat { axis: 1 }, &["t", "a"]),
            node(
                "n",
                Op::LayerNorm {
                    axis: -1,
                    eps: 1e-5,
                },
                &["c"],
            ),
            node("s", Op::Softmax { axis: 1 }, &["n"]),
            node("out", Op::Linear, &["s", "out.w"]),
        ],
        outputs: vec!["out".into()],
    }
}

#[test]
fn transpose_concat_and_bare_layer_norm_stages_match_libtorch() {
    let graph = shuffled();
    for (range, config) in [(0..6, adam()), (2..5, sgd_momentum()), (1..4, adam())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn conv_and_pooling_stages_match_libtorch_on_the_gpu_and_the_cpu_references() {
    let graph = from_toml(CNN).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [(0..4, adam()), (3..7, sgd_momentum()), (0..n, adam())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn winograd_convolution_stages_match_libtorch_on_the_gpu_and_the_cpu_references() {
    let graph = from_toml(WIDE_CNN).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [(0..n, adam()), (1..n, sgd_momentum())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

/// A bias right before a BatchNorm has a gradient of zero up to rounding,
/// which Adam would normalise into steps of noise; stages holding one train
/// with SGD, where rounding stays rounding.
#[test]
fn batch_norm_and_dropout_stages_match_libtorch_in_training_and_evaluation() {
    let graph = from_toml(REGULARISED_MLP).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    for (range, config) in [
        (0..4, sgd_momentum()),
        (1..7, adam()),
        (0..n, sgd_momentum()),
    ] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn the_demo_cnn_matches_libtorch_stage_for_stage() {
    let graph = from_toml(MNIST_CNN).unwrap();
    let n = graph.analyze().unwrap().nodes.len();
    // SGD where a stage holds the conv bias before the BatchNorm (see above).
    for (range, config) in [(0..4, sgd_gentle()), (3..8, adam()), (0..n, sgd_gentle())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
    }
    same_as_torch(CpuDevice, &graph, 0..4, sgd_gentle());
}

/// ids [B, 3] (i64) -> e = Gather(table, ids) -> f = Flatten -> out = Linear,
/// plus u = Gather(table, ids) again: the table gets two contributions.
fn embedded() -> Graph {
    let ids = Tensor::zeros([1, 3], (Kind::Int64, TorchDevice::Cpu));
    let mut table = param("table", &[VOCAB, 4], vec![0.0; VOCAB * 4]);
    table.init = Init::torch_weight(4);
    let mut w = param("out.w", &[5, 12], vec![0.0; 60]);
    w.init = Init::torch_weight(12);
    Graph {
        inputs: vec![input("ids", &ids)],
        params: vec![table, w],
        nodes: vec![
            node("e", Op::Gather { axis: 0 }, &["table", "ids"]),
            node("u", Op::Gather { axis: 0 }, &["table", "ids"]),
            node("s", Op::Mul, &["e", "u"]),
            node("f", Op::Flatten { axis: 1 }, &["s"]),
            node("out", Op::Linear, &["f", "out.w"]),
        ],
        outputs: vec!["out".into()],
    }
}

#[test]
fn embedding_gathers_with_negative_indices_match_libtorch() {
    let graph = embedded();
    for (range, config) in [(0..5, adam()), (0..3, sgd_momentum())] {
        same_as_torch(gpu(), &graph, range.clone(), config);
        same_as_torch(CpuDevice, &graph, range, config);
    }
}

#[test]
fn out_of_range_and_fractional_indices_are_refused_before_any_kernel_runs() {
    let graph = embedded();
    let values = graph.initial_values(7);
    let mut ours = rookery_stage::StageExecutor::new(
        CpuDevice,
        &graph,
        0..5,
        &["out".to_string()],
        &values,
        adam(),
    )
    .unwrap();
    for (bad, words) in [
        (10.0, "out of range"),
        (-11.0, "out of range"),
        (1.5, "not an integer"),
    ] {
        let ids = HostTensor {
            shape: vec![1, 3],
            data: vec![0.0, bad, 1.0],
        };
        let e = pollster::block_on(ours.forward(&[("ids".into(), ids)])).unwrap_err();
        assert!(e.to_string().contains(words), "{e}");
        assert_eq!(ours.in_flight(), 0);
    }
}

/// examples/gpt's GPT at toy size as PyTorch exported it
/// (tests/fixtures/gpt-tiny), imported at a batch of 2; the stages run
/// micro-batches of 5 and 3.
fn gpt(name: &str) -> Graph {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gpt-tiny")
        .join(name);
    rookery_model::onnx::import_file(&path, &[2, 16])
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .graph
}

/// SGD, not Adam: the key projection's bias has an exactly zero gradient
/// (it adds the same q . b to every score of a softmax row), so each backend
/// is left with its own rounding noise there, which Adam's first step scales
/// up to a full learning rate of either sign. And a small rate: the output
/// gradients here are pseudo-random in [-1, 1] per logit, hundreds of times
/// a mean cross-entropy's, and a step that large throws the model into
/// chaos, where any two roundings part.
fn sgd_gpt() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: 1e-4,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 0.001,
    }
}

/// Each exporter, attention spelling and logit layout at least once (the
/// CPU references are slow in a debug build), and one model cut in two.
#[test]
fn imported_gpts_match_libtorch_whole_and_in_two_stages_on_the_cpu_references() {
    for name in [
        "dynamo-hand-ntv.onnx",
        "dynamo-mha-nvt.onnx",
        "legacy-hand-nvt.onnx",
        "legacy-mha-ntv.onnx",
    ] {
        let graph = gpt(name);
        let n = graph.nodes.len();
        same_as_torch(CpuDevice, &graph, 0..n, sgd_gpt());
        if name.starts_with("legacy-mha") {
            same_as_torch(CpuDevice, &graph, 0..n / 2, sgd_gpt());
            same_as_torch(CpuDevice, &graph, n / 2..n, sgd_gpt());
        }
    }
}

#[test]
fn imported_gpts_match_libtorch_on_the_gpu() {
    for name in ["dynamo-mha-nvt.onnx", "legacy-hand-ntv.onnx"] {
        let graph = gpt(name);
        let n = graph.nodes.len();
        same_as_torch(gpu(), &graph, 0..n, sgd_gpt());
    }
}
