//! The core equivalence: a model
//! cut into stages, each batch split into micro-batches whose gradients
//! accumulate before every stage steps its own optimizer, trains exactly like
//! one process taking the whole batch at once.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use exec_common::*;
use rookery_model::{ClusterCount, Graph, Loss, Op, from_toml};
use rookery_plan::{PlanOptions, ProviderKind, ProviderSpec, clusterize};
use rookery_torch::exec::reference::{pipeline_train_step, train_step};
use rookery_torch::exec::{
    OptimizerConfig, TorchExecutor, TorchForward, TorchOptimizer, micro_batch_loss, scaled_loss,
    stage_boundary,
};
use tch::{Device, Kind, Tensor};

/// Every stage of `cuts` (consecutive node ranges), outputs from the boundary sets.
fn stages(
    g: &Graph,
    cuts: &[Range<usize>],
    params: &BTreeMap<String, Tensor>,
) -> Vec<TorchExecutor> {
    cuts.iter()
        .map(|r| {
            let outputs = stage_boundary(g, r.end).unwrap();
            TorchExecutor::new(g, r.clone(), outputs, owned(params), Device::Cpu).unwrap()
        })
        .collect()
}

struct Run {
    reference: Vec<f64>,
    pipeline: Vec<f64>,
    max_param_diff: f64,
}

/// Trains the same initial model both ways for `steps` steps on fixed batches.
#[allow(clippy::too_many_arguments)]
fn compare(
    g: &Graph,
    cuts: &[Range<usize>],
    config: OptimizerConfig,
    loss: Loss,
    batch: (Tensor, Tensor),
    micro_batches: usize,
    steps: usize,
) -> Run {
    let init = init_params(g, 17);
    let mut whole = init.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
    let mut ref_opt = TorchOptimizer::new(config).unwrap();
    let mut pipe = stages(g, cuts, &init);
    let mut opts: Vec<TorchOptimizer> = cuts
        .iter()
        .map(|_| TorchOptimizer::new(config).unwrap())
        .collect();
    let (x, y) = batch;
    let b = x.size()[0];
    let mut run = Run {
        reference: Vec::new(),
        pipeline: Vec::new(),
        max_param_diff: 0.0,
    };
    for step in 0..steps {
        // A different slice of the data each step, as a real loader would give.
        let rows = Tensor::arange(b, (Kind::Int64, Device::Cpu)).roll([step as i64], [0]);
        let inputs = vec![("input".to_string(), x.index_select(0, &rows))];
        let labels = y.index_select(0, &rows);
        let seed = 1000 + step as u64;
        run.reference
            .push(train_step(g, &mut whole, &inputs, &labels, loss, &mut ref_opt, seed).unwrap());
        run.pipeline.push(
            pipeline_train_step(
                &mut pipe,
                &mut opts,
                &inputs,
                &labels,
                loss,
                micro_batches,
                seed,
            )
            .unwrap(),
        );
    }
    for s in &pipe {
        for (name, v) in s.parameters().unwrap() {
            let w = &whole[&name];
            let d = (v.to_kind(Kind::Double) - w.to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[]);
            run.max_param_diff = run.max_param_diff.max(d);
        }
    }
    run
}

fn assert_same_losses(run: &Run, what: &str) {
    let worst = run
        .reference
        .iter()
        .zip(&run.pipeline)
        .map(|(r, p)| (r - p).abs() / r.abs().max(1e-12))
        .fold(0.0, f64::max);
    println!(
        "{what}: worst relative loss difference {worst:.2e} over {} steps, max parameter difference {:.2e}; losses {:?}",
        run.reference.len(),
        run.max_param_diff,
        run.reference
    );
    assert!(
        worst < 1e-5,
        "{what}: {worst:e}\nreference {:?}\npipeline  {:?}",
        run.reference,
        run.pipeline
    );
    assert!(
        run.max_param_diff < 1e-4,
        "{what}: parameters drifted by {}",
        run.max_param_diff
    );
    // Training must actually make progress, or equality would prove little.
    let (first, last) = (run.reference[0], run.reference[run.reference.len() - 1]);
    assert!(
        last < first,
        "{what}: loss did not fall ({first} -> {last})"
    );
}

fn mlp_batch() -> (Tensor, Tensor) {
    let b = 16;
    let x = t(&pseudo(b * 6, 5), &[b as i64, 6]);
    // Learnable labels: the argmax of a fixed linear map of the input.
    let y = x.matmul(&t(&pseudo(24, 6), &[6, 4])).argmax(1, false);
    (x, y)
}

#[test]
fn mlp_in_three_stages_with_four_micro_batches_matches_one_process_sgd() {
    let g = from_toml(MLP).unwrap();
    assert_eq!(g.nodes.len(), 7);
    let config = OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 1e-3,
    };
    let run = compare(
        &g,
        &[0..2, 2..5, 5..7],
        config,
        Loss::cross_entropy(),
        mlp_batch(),
        4,
        12,
    );
    assert_same_losses(&run, "MLP, SGD");
}

#[test]
fn mlp_in_three_stages_with_four_micro_batches_matches_one_process_adam() {
    let g = from_toml(MLP).unwrap();
    let run = compare(
        &g,
        &[0..3, 3..4, 4..7],
        OptimizerConfig::adam(0.01),
        Loss::cross_entropy(),
        mlp_batch(),
        4,
        12,
    );
    assert_same_losses(&run, "MLP, Adam");
}

fn cnn_batch() -> (Tensor, Tensor) {
    let b = 8;
    let x = t(&pseudo(b * 2 * 8 * 8, 9), &[b as i64, 2, 8, 8]);
    let y = x
        .mean_dim([2i64, 3].as_slice(), false, Kind::Float)
        .matmul(&t(&pseudo(6, 10), &[2, 3]))
        .argmax(1, false);
    (x, y)
}

#[test]
fn cnn_in_three_stages_with_four_micro_batches_matches_one_process_sgd() {
    let g = from_toml(CNN).unwrap();
    assert_eq!(g.nodes.len(), 8);
    let run = compare(
        &g,
        &[0..2, 2..5, 5..8],
        OptimizerConfig::Sgd {
            lr: 0.05,
            momentum: 0.5,
            dampening: 0.0,
            nesterov: true,
            weight_decay: 0.0,
        },
        Loss::cross_entropy(),
        cnn_batch(),
        4,
        12,
    );
    assert_same_losses(&run, "CNN, SGD");
}

#[test]
fn cnn_in_three_stages_with_four_micro_batches_matches_one_process_adam() {
    let g = from_toml(CNN).unwrap();
    let run = compare(
        &g,
        &[0..3, 3..6, 6..8],
        OptimizerConfig::adam(0.01),
        Loss::cross_entropy(),
        cnn_batch(),
        4,
        12,
    );
    assert_same_losses(&run, "CNN, Adam");
}

/// x -> a = Linear -> r = Relu -> b = Linear -> s = Add(b, a) -> out = Linear:
/// `a` crosses two cuts when the stages are [0, 2), [2, 3), [3, 5).
fn residual() -> Graph {
    let x = Tensor::zeros([1, 5], (Kind::Float, Device::Cpu));
    let w = |n: &str, o: usize, i: usize| param(n, &[o, i], vec![0.0; o * i]);
    let mut params = vec![w("a.w", 8, 5), w("b.w", 8, 8), w("out.w", 2, 8)];
    for p in &mut params {
        p.init = rookery_model::Init::torch_weight(p.shape[1]);
    }
    Graph {
        inputs: vec![input("input", &x)],
        params,
        nodes: vec![
            node("a", Op::Linear, &["input", "a.w"]),
            node("r", Op::Relu, &["a"]),
            node("b", Op::Linear, &["r", "b.w"]),
            node("s", Op::Add, &["b", "a"]),
            node("out", Op::Linear, &["s", "out.w"]),
        ],
        outputs: vec!["out".into()],
    }
}

#[test]
fn residual_crossing_two_cuts_with_uneven_micro_batches_matches_one_process_mse() {
    let g = residual();
    assert_eq!(stage_boundary(&g, 2).unwrap(), ["a", "r"]);
    assert_eq!(stage_boundary(&g, 3).unwrap(), ["a", "b"]);
    let x = t(&pseudo(7 * 5, 21), &[7, 5]);
    let y = t(&pseudo(7 * 2, 22), &[7, 2]);
    // 7 samples in 3 micro-batches: 3, 3 and 1, each weighted by its share.
    let run = compare(
        &g,
        &[0..2, 2..3, 3..5],
        OptimizerConfig::rmsprop(0.01),
        Loss::Mse,
        (x, y),
        3,
        10,
    );
    assert_same_losses(&run, "residual, RMSprop, MSE");
}

#[test]
fn accumulated_micro_batch_gradients_equal_the_whole_batch_gradient() {
    let g = from_toml(MLP).unwrap();
    let params = init_params(&g, 3);
    let (x, y) = mlp_batch();
    let grads = |micro: i64| -> BTreeMap<String, Vec<f64>> {
        let mut s =
            TorchExecutor::new(&g, 0..7, g.outputs.clone(), owned(&params), Device::Cpu).unwrap();
        s.set_step_seed(9);
        let b = x.size()[0];
        let chunk = b / micro;
        for k in 0..micro {
            let part = [("input".to_string(), x.narrow(0, k * chunk, chunk))];
            let f = s.forward(&part, true).unwrap();
            let (name, out) = &f.outputs[0];
            let labels = y.narrow(0, k * chunk, chunk);
            let l = micro_batch_loss(Loss::cross_entropy(), out, &labels, b as u64).unwrap();
            s.backward(f.micro_batch, &[(name.clone(), l.grad)])
                .unwrap();
        }
        s.gradients()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, vals(&t)))
            .collect()
    };
    let whole = grads(1);
    let split = grads(4);
    assert_eq!(
        whole.len(),
        8,
        "three Linear layers and a LayerNorm, weights and biases"
    );
    for (name, w) in &whole {
        assert_close(&split[name], w, 1e-6, name);
    }
}

/// The Leaf's one-pass backward (`backward_from_loss`: its loss
/// backpropagated through the stage) equals the two-pass one (the loss's
/// gradient for the output first, then `backward`) to the bit: the same
/// losses, input gradients and accumulated parameter gradients.
#[test]
fn the_leafs_one_pass_backward_from_its_loss_equals_the_two_pass_one_to_the_bit() {
    let g = from_toml(CNN).unwrap();
    let params = init_params(&g, 5);
    let (x, y) = cnn_batch();
    let b = x.size()[0];
    let loss = Loss::cross_entropy();
    type Outcome = (Vec<f64>, Vec<Vec<f64>>, BTreeMap<String, Vec<f64>>);
    let run = |one_pass: bool| -> Outcome {
        let mut s = stages(&g, &[0..3, 3..8], &params);
        let (root, leaf) = s.split_at_mut(1);
        let (root, leaf) = (&mut root[0], &mut leaf[0]);
        let (mut losses, mut input_grads) = (Vec::new(), Vec::new());
        for k in 0..4 {
            let part = [("input".to_string(), x.narrow(0, k * b / 4, b / 4))];
            let act = root.forward(&part, true).unwrap();
            root.discard(act.micro_batch).unwrap();
            let f = leaf.forward(&act.outputs, true).unwrap();
            let labels = y.narrow(0, k * b / 4, b / 4);
            let (name, out) = &f.outputs[0];
            let (sum, grads) = if one_pass {
                leaf.backward_from_loss(f.micro_batch, name, |y| {
                    let (sum, scaled) = scaled_loss(loss, y, &labels, b as u64)?;
                    Ok((scaled, sum.double_value(&[])))
                })
                .unwrap()
            } else {
                let l = micro_batch_loss(loss, out, &labels, b as u64).unwrap();
                let grads = leaf.backward(f.micro_batch, &[(name.clone(), l.grad)]);
                (l.sum, grads.unwrap())
            };
            assert_eq!(grads.len(), 1, "the Leaf's one input");
            losses.push(sum);
            input_grads.push(vals(&grads[0].1));
        }
        let param_grads = leaf
            .gradients()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, vals(&t)))
            .collect();
        (losses, input_grads, param_grads)
    };
    let (one, two) = (run(true), run(false));
    assert_eq!(
        one.2.len(),
        2 * 2,
        "a convolution's and a Dense layer's weights and biases"
    );
    assert!(one.1.iter().flatten().any(|&g| g != 0.0));
    assert_eq!(one, two);
}

#[test]
fn batch_norm_micro_batches_in_flight_backpropagate_in_any_order() {
    let g = from_toml(
        "input_shape = [3]\n[[layers]]\ntype = \"Dense\"\nunits = 4\n[[layers]]\ntype = \"BatchNormalization1D\"\n[[layers]]\ntype = \"Dense\"\nunits = 2\n",
    )
    .unwrap();
    let params = init_params(&g, 1);
    let mut s =
        [TorchExecutor::new(&g, 0..3, g.outputs.clone(), owned(&params), Device::Cpu).unwrap()];
    let x = t(&pseudo(12, 4), &[4, 3]);
    let f1 = s[0]
        .forward(&[("input".into(), x.narrow(0, 0, 2))], true)
        .unwrap();
    let f2 = s[0]
        .forward(&[("input".into(), x.narrow(0, 2, 2))], true)
        .unwrap();
    assert_eq!(s[0].in_flight(), 2);
    let ones = |f: &TorchForward| vec![(f.outputs[0].0.clone(), f.outputs[0].1.ones_like())];
    s[0].backward(f2.micro_batch, &ones(&f2)).unwrap();
    s[0].backward(f1.micro_batch, &ones(&f1)).unwrap();
    assert_eq!(s[0].in_flight(), 0);
    let p: BTreeMap<String, Tensor> = s[0].parameters().unwrap().into_iter().collect();
    assert_eq!(
        vals(&p["1.num_batches_tracked"]),
        [2.0],
        "each micro-batch counts, as in PyTorch"
    );
    assert!(
        s[0].gradients()
            .unwrap()
            .iter()
            .any(|(n, _)| n == "1.weight")
    );
}

#[test]
fn planner_boundary_sets_drive_the_executors() {
    let g = residual();
    let provs: Vec<ProviderSpec> = (0..3)
        .map(|i| ProviderSpec {
            id: format!("p{i}"),
            kind: ProviderKind::Native,
            memory_bytes: 1 << 30,
            gflops: 1e-6,
            bandwidth_mbps: 1e6,
            max_buffer_bytes: None,
        })
        .collect();
    // Three stages asked for: the cuts, not whether cutting pays, are under test.
    let opts = PlanOptions {
        micro_batch: 4,
        clusters: ClusterCount::Fixed(1),
        stages_per_cluster: Some(3),
        ..PlanOptions::default()
    };
    let plan = clusterize(&g, &provs, &opts).unwrap();
    let stages = &plan.clusters[0].stages;
    assert_eq!(stages.len(), 3, "{stages:?}");
    let params = init_params(&g, 0);
    for s in stages {
        let outs: Vec<String> = s.outputs.iter().map(|b| b.name.clone()).collect();
        assert_eq!(outs, stage_boundary(&g, s.end).unwrap());
        let exec =
            TorchExecutor::new(&g, s.first..s.end, outs, owned(&params), Device::Cpu).unwrap();
        let want: BTreeSet<String> = s.inputs.iter().map(|b| b.name.clone()).collect();
        assert_eq!(
            exec.input_names().into_iter().collect::<BTreeSet<_>>(),
            want
        );
        let names: BTreeSet<String> = exec.param_names().into_iter().collect();
        assert_eq!(names, s.params.iter().cloned().collect());
    }
}
