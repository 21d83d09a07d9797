//! Bad stages, bad inputs and misuse come back as `ExecError`s that name what
//! was wrong: a provider must survive anything a peer or the server sends.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;

use exec_common::*;
use rookery_model::{Graph, Loss, Op, from_toml};
use rookery_torch::exec::{
    ExecError, OptimizerConfig, StageError, TorchExecutor, TorchOptimizer, loss, micro_batch_loss,
    stage_boundary,
};
use tch::{Device, Kind, Tensor};

fn mlp() -> Graph {
    from_toml(
        "input_shape = [3]\n[[layers]]\ntype = \"Dense\"\nunits = 4\nactivation = \"relu\"\n[[layers]]\ntype = \"Dense\"\nunits = 2\n",
    )
    .unwrap()
}

fn whole(g: &Graph) -> TorchExecutor {
    let n = g.nodes.len();
    TorchExecutor::new(g, 0..n, g.outputs.clone(), init_params(g, 0), Device::Cpu).unwrap()
}

fn x(rows: i64) -> Tensor {
    t(&pseudo(rows as usize * 3, 1), &[rows, 3])
}

#[test]
fn bad_stage_definitions_are_refused_when_built() {
    let g = mlp();
    let p = || init_params(&g, 0);
    let err = |r: std::ops::Range<usize>, outs: &[&str], params| {
        let outs = outs.iter().map(|s| s.to_string()).collect();
        TorchExecutor::new(&g, r, outs, params, Device::Cpu).unwrap_err()
    };
    assert!(matches!(err(2..2, &["1"], p()), ExecError::Range { .. }));
    assert!(matches!(err(0..9, &["1"], p()), ExecError::Range { .. }));
    let e = err(0..1, &["2"], p());
    assert!(e.to_string().contains("later stage"), "{e}");
    let e = err(0..1, &["0.weight"], p());
    assert!(e.to_string().contains("parameter"), "{e}");
    let e = err(0..1, &["nope"], p());
    assert!(e.to_string().contains("nope"), "{e}");

    let mut missing = p();
    missing.remove("0.bias");
    let e = err(0..1, &["0"], missing);
    assert!(
        matches!(&e, ExecError::Stage(StageError::Param { name, .. }) if name == "0.bias"),
        "{e}"
    );
    let mut wrong = p();
    wrong.insert(
        "0.weight".into(),
        Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)),
    );
    let e = err(0..1, &["0"], wrong);
    assert!(e.to_string().contains("shape"), "{e}");

    let broken = Graph {
        nodes: vec![node("y", Op::Relu, &["ghost"])],
        ..g.clone()
    };
    let e = TorchExecutor::new(&broken, 0..1, vec![], vec![], Device::Cpu).unwrap_err();
    assert!(matches!(e, ExecError::Graph(_)), "{e}");
}

#[test]
fn bad_inputs_are_errors_naming_the_tensor() {
    let g = mlp();
    let mut exec = whole(&g);
    let e = exec.forward(&[], true).unwrap_err();
    assert!(e.to_string().contains("`input`: missing"), "{e}");
    let e = exec.forward(&[("other".into(), x(2))], true).unwrap_err();
    assert!(e.to_string().contains("not an input"), "{e}");
    let e = exec
        .forward(&[("input".into(), x(2)), ("input".into(), x(2))], true)
        .unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    let e = exec
        .forward(&[("input".into(), ti(&[1, 2, 3], &[1, 3]))], true)
        .unwrap_err();
    assert!(e.to_string().contains("dtype"), "{e}");
    let e = exec
        .forward(&[("input".into(), t(&[1., 2., 3.], &[3]))], true)
        .unwrap_err();
    assert!(e.to_string().contains("rank"), "{e}");
    // Right rank, wrong width: libtorch refuses, and the error names the node.
    let wide = Tensor::zeros([2, 5], (Kind::Float, Device::Cpu));
    let e = exec.forward(&[("input".into(), wide)], true).unwrap_err();
    assert!(
        matches!(&e, ExecError::Op { node, op, .. } if node == "0" && op == "Linear"),
        "{e}"
    );
    assert!(
        !e.to_string().contains("Exception raised from"),
        "no C++ backtrace: {e}"
    );
    assert_eq!(exec.in_flight(), 0, "a failed forward keeps nothing");
}

#[test]
fn out_of_range_embedding_indices_are_refused_before_libtorch() {
    let g = from_toml(
        "input_shape = [4]\n[[layers]]\ntype = \"Embedding\"\nvocab_size = 5\nembedding_dim = 2\n",
    )
    .unwrap();
    let exec = whole(&g);
    for bad in [[0i64, 1, 5, 2], [0, -6, 1, 1]] {
        let e = exec
            .evaluate(&[("input".into(), ti(&bad, &[1, 4]))])
            .unwrap_err();
        assert!(e.to_string().contains("index out of range"), "{e}");
    }
    let ok = exec
        .evaluate(&[("input".into(), ti(&[0, 4, -5, 2], &[1, 4]))])
        .unwrap();
    assert_eq!(ok[0].1.size(), [1, 4, 2]);
}

#[test]
fn batch_norm_refuses_one_value_per_channel_in_training() {
    let g = from_toml("input_shape = [3]\n[[layers]]\ntype = \"BatchNormalization1D\"\n").unwrap();
    let mut exec = whole(&g);
    let e = exec.forward(&[("input".into(), x(1))], true).unwrap_err();
    assert!(
        e.to_string().contains("more than 1 value per channel"),
        "{e}"
    );
    // Eval mode uses the running statistics and is fine with one sample.
    exec.evaluate(&[("input".into(), x(1))]).unwrap();
}

#[test]
fn backward_and_step_misuse_is_refused() {
    let g = mlp();
    let mut exec = whole(&g);
    let f = exec.forward(&[("input".into(), x(2))], true).unwrap();
    let mut opt = TorchOptimizer::new(OptimizerConfig::sgd(0.1)).unwrap();
    let e = exec.step(&mut opt).unwrap_err();
    assert!(
        matches!(
            e,
            ExecError::Stage(StageError::InFlight { in_flight: 1, .. })
        ),
        "{e}"
    );
    assert!(exec.set_parameters(&[]).is_err());

    let out = f.outputs[0].0.clone();
    let e = exec
        .backward(
            f.micro_batch,
            &[(
                out.clone(),
                Tensor::ones([3, 2], (Kind::Float, Device::Cpu)),
            )],
        )
        .unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
    let e = exec
        .backward(f.micro_batch, &[("0".into(), x(2))])
        .unwrap_err();
    assert!(e.to_string().contains("not an output"), "{e}");
    let e = exec
        .backward(f.micro_batch, &[(out.clone(), ti(&[1, 1, 1, 1], &[2, 2]))])
        .unwrap_err();
    assert!(e.to_string().contains("floating point"), "{e}");
    // The failed calls left the micro-batch in flight; this one succeeds.
    let ones = f.outputs[0].1.ones_like();
    exec.backward(f.micro_batch, &[(out.clone(), ones.shallow_clone())])
        .unwrap();
    let e = exec.backward(f.micro_batch, &[(out, ones)]).unwrap_err();
    assert!(
        matches!(e, ExecError::Stage(StageError::UnknownMicroBatch(_))),
        "{e}"
    );
    exec.step(&mut opt).unwrap();

    let e = exec
        .set_parameters(&[(
            "0.weight".into(),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        )])
        .unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
    let e = exec
        .set_parameters(&[(
            "9.weight".into(),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        )])
        .unwrap_err();
    assert!(e.to_string().contains("not a parameter"), "{e}");
}

#[test]
fn bad_labels_are_loss_errors() {
    let logits = t(&pseudo(6, 2), &[2, 3]);
    let e = micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[0, 3], &[2]), 2).unwrap_err();
    assert!(e.to_string().contains("3 classes"), "{e}");
    let e = micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[0, -1], &[2]), 2).unwrap_err();
    assert!(e.to_string().contains("classes"), "{e}");
    let e = micro_batch_loss(Loss::cross_entropy(), &logits, &t(&[0., 1.], &[2]), 2).unwrap_err();
    assert!(e.to_string().contains("i64"), "{e}");
    let e = micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[0, 1, 2], &[3]), 3).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let e = micro_batch_loss(Loss::Mse, &logits, &t(&[0., 1.], &[2]), 2).unwrap_err();
    assert!(e.to_string().contains("differ"), "{e}");
    let e = micro_batch_loss(Loss::Mse, &logits, &logits, 1).unwrap_err();
    assert!(e.to_string().contains("step of 1 targets"), "{e}");
    // -100 is ignored, not a class; but a step cannot count fewer targets
    // than one of its micro-batches.
    micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[0, -100], &[2]), 1).unwrap();
    let e = micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[0, 1], &[2]), 1).unwrap_err();
    assert!(e.to_string().contains("2 targets"), "{e}");
}

/// `correct` and `loss_targets` count on the host: the first highest logit
/// against the label, with classes second or last, ignored targets never
/// counted, and a label for every prediction or an error.
#[test]
fn correct_counts_the_first_highest_logit_and_never_an_ignored_target() {
    use rookery_model::ClassAxis;
    // Rows: a tie between classes 0 and 2 (first wins), class 1, class 2.
    let logits = t(&[1., 0., 1., 0., 5., 1., 0., 1., 2.], &[3, 3]);
    let ce = Loss::cross_entropy();
    let count = |labels: &[i64]| loss::correct(ce, &logits, &ti(labels, &[3])).unwrap();
    assert_eq!(count(&[0, 1, 2]), 3);
    assert_eq!(count(&[2, 1, 0]), 1);
    assert_eq!(count(&[-100, 1, 2]), 2);
    assert_eq!(
        loss::loss_targets(ce, &ti(&[-100, 1, -100], &[3])).unwrap(),
        1
    );
    // [1, 3, 3] logits against [1, 3] labels: classes second, argmax over
    // dimension 1 per position: 0, 1, 0; classes last, over dimension 2: 2, 1, 2.
    let cube = t(&[0., 0., 9., 0., 5., 1., 0., 1., 2.], &[1, 3, 3]);
    let labels = ti(&[0, 1, 0], &[1, 3]);
    let on = |class_axis| Loss::CrossEntropy {
        class_axis,
        ignore_index: -100,
    };
    assert_eq!(
        loss::correct(on(ClassAxis::Second), &cube, &labels).unwrap(),
        3
    );
    assert_eq!(
        loss::correct(on(ClassAxis::Last), &cube, &labels).unwrap(),
        1
    );
    let e = loss::correct(ce, &logits, &ti(&[0, 1], &[2])).unwrap_err();
    assert!(e.to_string().contains("2 labels for 3 predictions"), "{e}");
}

#[test]
fn losses_match_their_definitions_and_scale_by_the_micro_batch_share() {
    // Cross-entropy of logits [0, ln 3] for class 1: -log(3 / 4).
    let logits = t(&[0.0, 3f32.ln(), 1.0, 1.0], &[2, 2]);
    let l = micro_batch_loss(Loss::cross_entropy(), &logits, &ti(&[1, 0], &[2]), 8).unwrap();
    let want = (-(0.75f64).ln() + 2f64.ln()) / 2.0;
    assert!(
        (l.sum / 2.0 - want).abs() < 1e-6,
        "{} vs {want}",
        l.sum / 2.0
    );
    assert!((l.scaled - want * 2.0 / 8.0).abs() < 1e-7);
    // d/dlogits of share * mean CE = share / n * (softmax - onehot).
    let g = vals(&l.grad);
    let s = 0.25 / 2.0;
    assert_close(
        &g,
        &[s * 0.25, -s * 0.25, -s * 0.5, s * 0.5],
        1e-6,
        "CE gradient",
    );

    let out = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let target = t(&[0.0, 2.0, 1.0, 4.0], &[2, 2]);
    let l = micro_batch_loss(Loss::Mse, &out, &target, 2).unwrap();
    assert!(
        (l.sum - 2.0 * 5.0 / 4.0).abs() < 1e-6,
        "MSE's mean, once per sample"
    );
    assert_close(&vals(&l.grad), &[0.5, 0.0, 1.0, 0.0], 1e-6, "MSE gradient");
    assert!((loss::loss_sum(Loss::Mse, &out, &target).unwrap() - 2.5).abs() < 1e-6);
}

#[test]
fn every_model_op_of_a_real_graph_runs_or_is_reported_unsupported() {
    // The whole spec vocabulary in one model, so an op the backend lost would show.
    let g = from_toml(
        r#"
input_shape = [1, 6, 6]
[[layers]]
type = "Conv2D"
filters = 2
kernel_size = 3
activation = "sigmoid"
[[layers]]
type = "BatchNormalization2D"
[[layers]]
type = "GlobalAveragePooling2D"
[[layers]]
type = "Flatten"
[[layers]]
type = "Dense"
units = 3
activation = "softmax"
[[layers]]
type = "Activation"
name = "log_softmax"
"#,
    )
    .unwrap();
    let outs = stage_boundary(&g, g.nodes.len()).unwrap();
    let mut exec =
        TorchExecutor::new(&g, 0..g.nodes.len(), outs, init_params(&g, 0), Device::Cpu).unwrap();
    let input = t(&pseudo(2 * 36, 3), &[2, 1, 6, 6]);
    let f = exec.forward(&[("input".into(), input)], true).unwrap();
    assert_eq!(f.outputs[0].1.size(), [2, 3]);
    let err = ExecError::Unsupported {
        node: "n".into(),
        op: "Foo".into(),
    };
    assert_eq!(
        err.to_string(),
        "node `n`: op Foo is not supported by the libtorch backend"
    );
}
