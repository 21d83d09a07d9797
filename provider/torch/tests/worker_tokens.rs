//! Language-model losses across workers: per-token labels `[N, T]` against
//! logits `[N, T, V]` (`class_axis = -1`) and `[N, V, T]` (torch's layout),
//! with `ignore_index` targets spread unevenly over the micro-batches. A
//! chain of three workers, on libtorch and on our own executor, trains
//! exactly like the single-process reference, and the reference's loss is
//! torch's own `F.cross_entropy(.., ignore_index=..)`.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]

mod exec_common;
mod worker_common;

use std::collections::BTreeMap;

use exec_common::*;
use rookery_model::{ClassAxis, Graph, Loss, Op, from_toml};
use rookery_stage::CpuDevice;
use rookery_torch::exec::reference::train_step;
use rookery_torch::exec::{OptimizerConfig, TorchExecutor, TorchOptimizer};
use rookery_torch::step_seed;
use tch::{Device, Kind, Reduction, Tensor};
use worker_common::*;

const STEPS: u64 = 12;
/// Tokens a sequence, features a token, classes (the vocabulary).
const T: usize = 5;
const F: usize = 6;
const V: usize = 7;

/// Tokens of `F` features through a hidden layer to `V` logits each:
/// `[N, T, V]`; with `ClassAxis::Second` a final transpose makes it `[N, V, T]`.
fn lm(axis: ClassAxis) -> Graph {
    let mut g = from_toml(&format!(
        "input_shape = [{T}, {F}]\n[[layers]]\ntype = \"Dense\"\nunits = 16\nactivation = \"tanh\"\n\
         [[layers]]\ntype = \"Dense\"\nunits = {V}\n"
    ))
    .unwrap();
    if axis == ClassAxis::Second {
        let last = g.outputs[0].clone();
        g.nodes.push(node(
            "to_ncl",
            Op::Transpose {
                perm: vec![0, 2, 1],
            },
            &[&last],
        ));
        g.outputs = vec!["to_ncl".into()];
    }
    g.analyze().unwrap();
    g
}

/// `b` sequences with learnable next-token labels `[b, T]` (the argmax of a
/// fixed map of each token); the first half of the batch has a third of its
/// tokens ignored, the second half none, so micro-batches count different
/// numbers of targets.
fn lm_batch(b: usize) -> (Tensor, Tensor) {
    let x = t(&pseudo(b * T * F, 3), &[b as i64, T as i64, F as i64]);
    let y = x
        .matmul(&t(&pseudo(F * V, 4), &[F as i64, V as i64]))
        .argmax(2, false);
    let ignored: Vec<bool> = (0..b * T).map(|i| i < b * T / 2 && i % 3 == 0).collect();
    let mask = Tensor::from_slice(&ignored).reshape([b as i64, T as i64]);
    (x, y.masked_fill(&mask, -100))
}

fn loss(axis: ClassAxis) -> Loss {
    Loss::CrossEntropy {
        class_axis: axis,
        ignore_index: -100,
    }
}

/// The worst relative loss difference over the steps and the largest
/// parameter difference at the end, chain against reference.
fn train_both(axis: ClassAxis, make: MakeWorker<'_>) -> (f64, f64, Vec<f64>) {
    let g = lm(axis);
    let cuts = [0..1, 1..2, 2..g.nodes.len()];
    let job = JobConfig::new(OptimizerConfig::adam(0.02), loss(axis));
    let (x, y) = lm_batch(job.batch_size as usize);
    let init = init_params(&g, 17);
    let mut whole: BTreeMap<String, Tensor> =
        init.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
    let mut ref_opt = TorchOptimizer::new(job.optimizer).unwrap();
    let mut chain = Chain::with_workers(&g, &cuts, 0, &init, job, make);
    let (mut worst, mut reference) = (0.0f64, Vec::new());
    for step in 0..STEPS {
        let (xs, ys) = (rolled(&x, step), rolled(&y, step));
        let inputs = [(chain.input.clone(), xs.shallow_clone())];
        let want = train_step(
            &g,
            &mut whole,
            &inputs,
            &ys,
            job.loss,
            &mut ref_opt,
            step_seed(job.seed, step),
        )
        .unwrap();
        let report = chain.train_step(step, &xs, &ys);
        let counted = ys.ne(-100).sum(Kind::Int64).int64_value(&[]) as u64;
        assert_eq!(
            report.targets, counted,
            "the step's mean divides by its counted tokens"
        );
        worst = worst.max(relative(report.loss_sum / report.targets as f64, want));
        reference.push(want);
    }
    let whole: BTreeMap<String, Tensor> = whole
        .into_iter()
        .map(|(k, v)| (k, v.to_kind(Kind::Double)))
        .collect();
    let params = max_param_diff(&by_name(&chain.upload(STEPS)), &whole);
    (worst, params, reference)
}

fn assert_trains_like_one_process(axis: ClassAxis, make: MakeWorker<'_>, what: &str) {
    let (worst, params, reference) = train_both(axis, make);
    println!(
        "{what}: worst relative loss difference {worst:.2e}, parameters within {params:.2e}; {reference:?}"
    );
    assert!(worst < 1e-5, "{what}: losses differ by {worst:e}");
    assert!(params < 1e-4, "{what}: parameters drifted by {params:e}");
    assert!(
        reference[STEPS as usize - 1] < reference[0],
        "{what}: loss did not fall"
    );
}

#[test]
fn classes_last_on_three_torch_workers_trains_like_one_process() {
    assert_trains_like_one_process(ClassAxis::Last, &torch_worker, "[N, T, V], libtorch");
}

#[test]
fn classes_second_on_three_torch_workers_trains_like_one_process() {
    assert_trains_like_one_process(ClassAxis::Second, &torch_worker, "[N, V, T], libtorch");
}

#[test]
fn classes_last_on_three_own_cpu_workers_trains_like_one_process() {
    let own = |_: usize| -> Box<dyn Worker> { Box::new(OwnWorker::new(CpuDevice)) };
    assert_trains_like_one_process(ClassAxis::Last, &own, "[N, T, V], own CPU");
}

#[test]
fn classes_second_on_three_own_cpu_workers_trains_like_one_process() {
    let own = |_: usize| -> Box<dyn Worker> { Box::new(OwnWorker::new(CpuDevice)) };
    assert_trains_like_one_process(ClassAxis::Second, &own, "[N, V, T], own CPU");
}

/// The reference is what a PyTorch user writes: `F.cross_entropy(logits,
/// y, ignore_index=-100)` on `[N, V, T]`, or on `logits.view(-1, V)` and
/// `y.view(-1)` for `[N, T, V]`; the mean over the counted tokens.
#[test]
fn the_reference_loss_is_torch_cross_entropy_with_ignore_index_in_both_layouts() {
    let (x, y) = lm_batch(16);
    for axis in [ClassAxis::Last, ClassAxis::Second] {
        let g = lm(axis);
        let init = init_params(&g, 17);
        let exec = TorchExecutor::new(
            &g,
            0..g.nodes.len(),
            g.outputs.clone(),
            owned(&init),
            Device::Cpu,
        )
        .unwrap();
        let logits = exec
            .evaluate(&[("input".into(), x.shallow_clone())])
            .unwrap();
        let logits = &logits[0].1;
        let torch = match axis {
            ClassAxis::Last => logits.reshape([-1, V as i64]).cross_entropy_loss::<Tensor>(
                &y.reshape([-1]),
                None,
                Reduction::Mean,
                -100,
                0.0,
            ),
            ClassAxis::Second => {
                logits.cross_entropy_loss::<Tensor>(&y, None, Reduction::Mean, -100, 0.0)
            }
        }
        .double_value(&[]);
        let mut params = init_params(&g, 17);
        // A learning rate of 0 leaves the loss of the step's own parameters.
        let mut opt = TorchOptimizer::new(OptimizerConfig::sgd(0.0)).unwrap();
        let inputs = [("input".to_string(), x.shallow_clone())];
        let ours = train_step(&g, &mut params, &inputs, &y, loss(axis), &mut opt, 1).unwrap();
        assert!(
            relative(ours, torch) < 1e-6,
            "{axis:?}: reference {ours} vs torch {torch}"
        );
        let counted = y.ne(-100).sum(Kind::Int64).int64_value(&[]);
        assert!(
            counted < 16 * T as i64 && counted > 0,
            "some tokens are ignored"
        );
    }
}
