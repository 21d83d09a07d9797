//! StageWorkers driven by messages exactly as the server drives them train like
//! one process: one cluster
//! matches single-process training on its batch, and two clusters whose
//! parameters are averaged after every step match single-process training on
//! both batches at once.
#![cfg(feature = "torch")]
#![allow(clippy::unwrap_used)]
// A chain of one stage is a list of one node range.
#![allow(clippy::single_range_in_vec_init)]

mod exec_common;
mod worker_common;

use std::collections::BTreeMap;
use std::ops::Range;

use exec_common::*;
use rookery_model::{Graph, Init, Loss, LrSchedule, Op, from_toml};
use rookery_proto::{Forward, Phase, ToProvider, ToServer, WireDType, WireTensor};
use rookery_stage::{CpuDevice, GpuDevice};
use rookery_test_support::dense_mlp;
use rookery_torch::exec::loss::loss_sum;
use rookery_torch::exec::reference::{train_step, train_step_clipped};
use rookery_torch::exec::{OptimizerConfig, TorchExecutor, TorchOptimizer};
use rookery_torch::{TorchWorker, step_seed, tensor_to_wire};
use tch::{Device, Kind, Tensor};
use worker_common::*;

const STEPS: u64 = 30;

/// The MLP without Dropout: two clusters number their samples from 0 each, so
/// their dropout masks cannot be those of one run over the doubled batch.
const MLP_NO_DROPOUT: &str = r#"
input_shape = [6]
[[layers]]
type = "Dense"
units = 16
activation = "relu"
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

/// `b` samples of 6 features with learnable labels (the argmax of a fixed
/// linear map of the input).
fn mlp_batch(b: usize, seed: u64) -> (Tensor, Tensor) {
    let x = t(&pseudo(b * 6, seed), &[b as i64, 6]);
    let y = x.matmul(&t(&pseudo(24, 6), &[6, 4])).argmax(1, false);
    (x, y)
}

fn cnn_batch(b: usize) -> (Tensor, Tensor) {
    let x = t(&pseudo(b * 2 * 8 * 8, 9), &[b as i64, 2, 8, 8]);
    let y = x
        .mean_dim([2i64, 3].as_slice(), false, Kind::Float)
        .matmul(&t(&pseudo(6, 10), &[2, 3]))
        .argmax(1, false);
    (x, y)
}

fn sgd() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 1e-3,
    }
}

struct Losses {
    reference: Vec<f64>,
    workers: Vec<f64>,
    max_param_diff: f64,
    /// Steps whose gradients the server's multiplier scaled down.
    clipped: usize,
}

/// Trains one chain of workers and the single-process reference side by side.
fn train_both(
    g: &Graph,
    cuts: &[Range<usize>],
    job: JobConfig,
    data: (Tensor, Tensor),
    steps: u64,
) -> Losses {
    train_both_with(g, cuts, job, data, steps, &torch_worker)
}

/// [`train_both`] with stage `k` run by `make(k)`.
fn train_both_with(
    g: &Graph,
    cuts: &[Range<usize>],
    job: JobConfig,
    (x, y): (Tensor, Tensor),
    steps: u64,
    make: MakeWorker<'_>,
) -> Losses {
    let init = init_params(g, 17);
    let mut whole: BTreeMap<String, Tensor> =
        init.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
    let mut ref_opt = TorchOptimizer::new(job.optimizer).unwrap();
    let base_lr = job.optimizer.lr();
    let mut job = job;
    job.lr_schedule = job.lr_schedule.resolve(base_lr, steps).unwrap();
    let mut chain = Chain::with_workers(g, cuts, 0, &init, job, make);
    let mut losses = Losses {
        reference: Vec::new(),
        workers: Vec::new(),
        max_param_diff: 0.0,
        clipped: 0,
    };
    for step in 0..steps {
        let (xs, ys) = (rolled(&x, step), rolled(&y, step));
        let inputs = [(chain.input.clone(), xs.shallow_clone())];
        ref_opt.set_lr(job.lr_schedule.lr(base_lr, step)).unwrap();
        losses.reference.push(
            train_step_clipped(
                g,
                &mut whole,
                &inputs,
                &ys,
                job.loss,
                &mut ref_opt,
                step_seed(job.seed, step),
                job.clip_grad_norm,
            )
            .unwrap(),
        );
        let report = chain.train_step(step, &xs, &ys);
        if job.clip_grad_norm.is_some() {
            losses.clipped += usize::from(report.grad_scale.is_some_and(|s| s < 1.0));
        }
        losses.workers.push(report.loss_sum / report.targets as f64);
    }
    let whole: BTreeMap<String, Tensor> = whole
        .into_iter()
        .map(|(k, v)| (k, v.to_kind(Kind::Double)))
        .collect();
    losses.max_param_diff = max_param_diff(&by_name(&chain.upload(steps)), &whole);
    losses
}

fn assert_same(losses: &Losses, what: &str) {
    assert_same_within(losses, what, 1e-5, 1e-4);
}

/// Losses within `tolerance` (relative) of the reference every step, and
/// parameters within `param_tolerance` at the end.
fn assert_same_within(losses: &Losses, what: &str, tolerance: f64, param_tolerance: f64) {
    let worst = losses
        .reference
        .iter()
        .zip(&losses.workers)
        .map(|(r, w)| relative(*w, *r))
        .fold(0.0, f64::max);
    println!(
        "{what}: worst relative loss difference {worst:.2e} over {} steps, parameters within {:.2e}; losses {:?}",
        losses.reference.len(),
        losses.max_param_diff,
        losses.workers
    );
    assert!(
        worst < tolerance,
        "{what}: {worst:e}\nreference {:?}\nworkers   {:?}",
        losses.reference,
        losses.workers
    );
    assert!(
        losses.max_param_diff < param_tolerance,
        "{what}: parameters drifted by {}",
        losses.max_param_diff
    );
    let (first, last) = (
        losses.reference[0],
        losses.reference[losses.reference.len() - 1],
    );
    assert!(
        last < first,
        "{what}: loss did not fall ({first} -> {last})"
    );
}

#[test]
fn mlp_with_dropout_on_three_workers_trains_exactly_like_one_process_sgd() {
    let g = from_toml(MLP).unwrap();
    let job = JobConfig::new(sgd(), Loss::cross_entropy());
    let losses = train_both(&g, &[0..2, 2..5, 5..7], job, mlp_batch(16, 5), STEPS);
    assert_same(&losses, "MLP, SGD");
}

/// Warm-up then cosine decay, and gradients clipped by their global norm
/// across the three workers (each reports its sum of squares, one
/// multiplier comes back), train as one process clipping the whole model.
#[test]
fn three_workers_with_a_cosine_schedule_and_clipping_train_exactly_like_one_process() {
    let g = from_toml(MLP).unwrap();
    for optimizer in [sgd(), OptimizerConfig::adamw(0.01)] {
        let job = JobConfig {
            lr_schedule: LrSchedule::Cosine {
                warmup_steps: 5,
                total_steps: None,
                min_lr: 1e-4,
            },
            clip_grad_norm: Some(0.5),
            ..JobConfig::new(optimizer, Loss::cross_entropy())
        };
        let losses = train_both(&g, &[0..2, 2..5, 5..7], job, mlp_batch(16, 5), STEPS);
        assert_same(&losses, &format!("MLP, cosine + clipping, {optimizer:?}"));
        assert!(
            losses.clipped > STEPS as usize / 2,
            "only {} steps clipped",
            losses.clipped
        );
    }
}

#[test]
fn mlp_with_dropout_on_three_workers_trains_exactly_like_one_process_adam() {
    let g = from_toml(MLP).unwrap();
    let job = JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy());
    let losses = train_both(&g, &[0..3, 3..4, 4..7], job, mlp_batch(16, 5), STEPS);
    assert_same(&losses, "MLP, Adam");
}

#[test]
fn cnn_on_three_workers_trains_exactly_like_one_process_sgd() {
    let g = from_toml(CNN).unwrap();
    let job = JobConfig {
        batch_size: 8,
        ..JobConfig::new(
            OptimizerConfig::Sgd {
                lr: 0.05,
                momentum: 0.5,
                dampening: 0.0,
                nesterov: true,
                weight_decay: 0.0,
            },
            Loss::cross_entropy(),
        )
    };
    let losses = train_both(&g, &[0..2, 2..5, 5..8], job, cnn_batch(8), STEPS);
    assert_same(&losses, "CNN, SGD");
}

#[test]
fn cnn_on_three_workers_trains_exactly_like_one_process_adam() {
    let g = from_toml(CNN).unwrap();
    let job = JobConfig {
        batch_size: 8,
        ..JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy())
    };
    let losses = train_both(&g, &[0..3, 3..6, 6..8], job, cnn_batch(8), STEPS);
    assert_same(&losses, "CNN, Adam");
}

#[test]
fn one_worker_that_is_root_and_leaf_trains_like_one_process() {
    let g = from_toml(MLP).unwrap();
    let job = JobConfig::new(OptimizerConfig::adamw(0.01), Loss::cross_entropy());
    let losses = train_both(&g, &[0..7], job, mlp_batch(16, 5), 10);
    assert_same(&losses, "MLP on one worker, AdamW");
}

/// x -> a = Linear -> r = Relu -> b = Linear -> s = Add(b, a) -> out = Linear:
/// `a` crosses two cuts when the stages are [0, 2), [2, 3), [3, 5).
fn residual() -> Graph {
    let x = Tensor::zeros([1, 5], (Kind::Float, Device::Cpu));
    let w = |n: &str, o: usize, i: usize| param(n, &[o, i], vec![0.0; o * i]);
    let mut params = vec![w("a.w", 8, 5), w("b.w", 8, 8), w("out.w", 2, 8)];
    for p in &mut params {
        p.init = Init::torch_weight(p.shape[1]);
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
fn nine_samples_in_four_micro_batches_make_three_as_torch_chunk_does_and_match_mse() {
    // ceil(9 / 4) = 3 samples a chunk, so 3 micro-batches: the step must end
    // after the third (Chain checks every stage's StepDone and the Leaf's count).
    let g = residual();
    let x = t(&pseudo(9 * 5, 21), &[9, 5]);
    let y = t(&pseudo(9 * 2, 22), &[9, 2]);
    let job = JobConfig {
        batch_size: 9,
        ..JobConfig::new(OptimizerConfig::rmsprop(0.01), Loss::Mse)
    };
    let losses = train_both(&g, &[0..2, 2..3, 3..5], job, (x, y), 10);
    assert_same(
        &losses,
        "residual with a tensor crossing two cuts, RMSprop, MSE",
    );
}

#[test]
fn two_clusters_averaged_after_every_step_train_like_one_process_on_the_doubled_batch() {
    let g = from_toml(MLP_NO_DROPOUT).unwrap();
    let init = init_params(&g, 17);
    let job = JobConfig::new(sgd(), Loss::cross_entropy());
    // Averaging goes by name, so the clusters may cut the model differently.
    let mut clusters = [
        Chain::new(&g, &[0..2, 2..4, 4..6], 0, &init, job),
        Chain::new(&g, &[0..1, 1..3, 3..6], 1, &init, job),
    ];
    let batches = [mlp_batch(16, 5), mlp_batch(16, 50)];
    let mut whole: BTreeMap<String, Tensor> =
        init.iter().map(|(k, v)| (k.clone(), v.copy())).collect();
    let mut ref_opt = TorchOptimizer::new(job.optimizer).unwrap();
    let mut worst = 0.0f64;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let parts: Vec<(Tensor, Tensor)> = batches
            .iter()
            .map(|(x, y)| (rolled(x, step), rolled(y, step)))
            .collect();
        let mut loss_sum = 0.0;
        for (chain, (x, y)) in clusters.iter_mut().zip(&parts) {
            loss_sum += chain.train_step(step, x, y).loss_sum;
        }
        let loss = loss_sum / 32.0;

        // The server's sync: upload, average by name, send each stage its own.
        let uploads: Vec<Vec<Vec<WireTensor>>> =
            clusters.iter_mut().map(|c| c.upload(step + 1)).collect();
        let mut sums: BTreeMap<String, (Tensor, f64)> = BTreeMap::new();
        for t in uploads.iter().flatten().flatten() {
            let v = rookery_torch::tensor_from_wire(t)
                .unwrap()
                .to_kind(Kind::Double);
            let entry = sums
                .entry(t.name.clone())
                .or_insert_with(|| (v.zeros_like(), 0.0));
            entry.0 = &entry.0 + v;
            entry.1 += 1.0;
        }
        let average: BTreeMap<String, WireTensor> = sums
            .into_iter()
            .map(|(name, (sum, n))| {
                assert_eq!(n, 2.0, "`{name}` comes from both clusters");
                let mean = (sum / n).to_kind(Kind::Float);
                let wire = tensor_to_wire(&name, &mean, WireDType::F32).unwrap();
                (name, wire)
            })
            .collect();
        for (chain, upload) in clusters.iter_mut().zip(&uploads) {
            let own: Vec<Vec<String>> = upload
                .iter()
                .map(|stage| stage.iter().map(|t| t.name.clone()).collect())
                .collect();
            chain.set(step + 1, &average, &own);
        }

        let x = Tensor::cat(&[&parts[0].0, &parts[1].0], 0);
        let y = Tensor::cat(&[&parts[0].1, &parts[1].1], 0);
        let reference = train_step(
            &g,
            &mut whole,
            &[("input".to_string(), x)],
            &y,
            job.loss,
            &mut ref_opt,
            step_seed(job.seed, step),
        )
        .unwrap();
        worst = worst.max(relative(loss, reference));
        losses.push((loss, reference));
    }
    let whole: BTreeMap<String, Tensor> = whole
        .into_iter()
        .map(|(k, v)| (k, v.to_kind(Kind::Double)))
        .collect();
    let params_diff = clusters
        .iter_mut()
        .map(|c| max_param_diff(&by_name(&c.upload(STEPS)), &whole))
        .fold(0.0, f64::max);
    println!(
        "two clusters: worst relative loss difference {worst:.2e}, parameters within {params_diff:.2e}; (clusters, reference) {losses:?}"
    );
    assert!(worst < 1e-5, "{worst:e}: {losses:?}");
    assert!(params_diff < 1e-4, "parameters drifted by {params_diff}");
    assert!(losses[losses.len() - 1].1 < losses[0].1, "the loss fell");
}

#[test]
fn narrow_wire_dtypes_still_train_and_shrink_activation_bytes() {
    let g = from_toml(MLP).unwrap();
    let cuts = [0..2, 2..5, 5..7];
    let init = init_params(&g, 17);
    let (x, y) = mlp_batch(16, 5);
    let run = |wire_dtype: WireDType| {
        let job = JobConfig {
            wire_dtype,
            ..JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy())
        };
        let mut chain = Chain::new(&g, &cuts, 0, &init, job);
        let mut losses = Vec::new();
        let mut frames = Vec::new();
        let mut payload = Vec::new();
        for step in 0..STEPS {
            let report = chain.train_step(step, &rolled(&x, step), &rolled(&y, step));
            losses.push(report.loss_sum / 16.0);
            frames.extend(report.activation_frames);
            payload.extend(report.activation_bytes);
        }
        (losses, frames, payload)
    };
    let (f32_losses, f32_frames, f32_payload) = run(WireDType::F32);
    // The half-precision tolerance is for bf16's rounding, within 2^-9 of
    // each element (f16's is finer); int8 rounds within 1/254 of its
    // block's absmax, so its tolerance is scaled by the ratio of the bounds.
    let half = 0.05;
    let int8 = half * (1.0 / 254.0) / 2f64.powi(-9);
    for (dtype, tolerance) in [
        (WireDType::F16, half),
        (WireDType::Bf16, half),
        (WireDType::I8Block, int8),
    ] {
        let name = dtype.as_str();
        let (losses, frames, payload) = run(dtype);
        let worst = losses
            .iter()
            .zip(&f32_losses)
            .map(|(h, f)| relative(*h, *f))
            .fold(0.0, f64::max);
        println!("{name}: worst relative loss difference to f32 {worst:.2e}; losses {losses:?}");
        assert!(worst < tolerance, "{name}: {worst} off f32");
        assert!(
            losses[losses.len() - 1] < 0.7 * losses[0],
            "{name} still trains: {losses:?}"
        );
        assert_eq!(frames.len(), f32_frames.len());
        for ((h, f), (hp, fp)) in frames
            .iter()
            .zip(&f32_frames)
            .zip(payload.iter().zip(&f32_payload))
        {
            if dtype == WireDType::I8Block {
                // One tensor per message: its values and a scale per block.
                assert_eq!(Some(*hp), dtype.bytes_for(fp / 4), "int8 tensor bytes");
                // The frame saves all of that (its length prefix may shrink too).
                assert!(
                    f - h >= fp - hp,
                    "int8: frame of {h} bytes against {f} for f32"
                );
            } else {
                assert_eq!(2 * hp, *fp, "tensor bytes halve exactly");
                assert!(
                    (*h as f64) < 0.55 * *f as f64,
                    "{name}: frame of {h} bytes against {f} for f32"
                );
            }
        }
        let (sent, full) = (
            payload.iter().sum::<usize>(),
            f32_payload.iter().sum::<usize>(),
        );
        println!("{name}: {sent} activation bytes against {full} for f32");
        if dtype == WireDType::I8Block {
            // Blocks of 64 and 48 values here: within 0.27 of f32 overall.
            assert!(sent as f64 <= 0.27 * full as f64, "{sent} against {full}");
        }
    }
}

#[test]
fn eval_forward_reports_the_loss_and_accuracy_and_leaves_training_untouched() {
    let g = from_toml(MLP).unwrap();
    let init = init_params(&g, 17);
    let job = JobConfig::new(sgd(), Loss::cross_entropy());
    let cuts = [0..2, 2..5, 5..7];
    let mut chain = Chain::new(&g, &cuts, 0, &init, job);
    let mut twin = Chain::new(&g, &cuts, 0, &init, job);
    let (x, y) = mlp_batch(16, 5);
    let (ex, ey) = mlp_batch(10, 77);

    // Evaluation between steps must neither step the optimizer nor open a step.
    for step in 0..3 {
        let report = chain.eval(step as u32, &ex, &ey);
        let whole_params: Vec<(String, Tensor)> = by_name(&chain.upload(step))
            .into_iter()
            .map(|(k, v)| {
                let v = if k.ends_with("num_batches_tracked") {
                    v.to_kind(Kind::Int64)
                } else {
                    v.to_kind(Kind::Float)
                };
                (k, v)
            })
            .collect();
        let exec =
            TorchExecutor::new(&g, 0..7, g.outputs.clone(), whole_params, Device::Cpu).unwrap();
        let out = exec
            .evaluate(&[("input".into(), ex.shallow_clone())])
            .unwrap();
        let mean = loss_sum(Loss::cross_entropy(), &out[0].1, &ey).unwrap() / 10.0;
        let correct = out[0]
            .1
            .argmax(1, false)
            .eq_tensor(&ey)
            .sum(Kind::Int64)
            .int64_value(&[]) as u64;
        assert!(
            relative(report.loss_sum / 10.0, mean) < 1e-6,
            "{} vs {mean}",
            report.loss_sum / 10.0
        );
        assert_eq!(report.correct, correct);
        assert_eq!(report.samples, 10);

        let a = chain.train_step(step, &rolled(&x, step), &rolled(&y, step));
        let b = twin.train_step(step, &rolled(&x, step), &rolled(&y, step));
        assert_eq!(
            a.loss_sum, b.loss_sum,
            "eval changed training at step {step}"
        );
    }
}

#[test]
fn uploaded_parameters_are_f32_with_i64_buffers_and_set_params_keeps_optimizer_state() {
    let g = from_toml(
        "input_shape = [3]\n[[layers]]\ntype = \"Dense\"\nunits = 4\n[[layers]]\ntype = \"BatchNormalization1D\"\n[[layers]]\ntype = \"Dense\"\nunits = 2\n",
    )
    .unwrap();
    let init = init_params(&g, 1);
    let job = JobConfig {
        batch_size: 8,
        ..JobConfig::new(OptimizerConfig::adam(0.05), Loss::cross_entropy())
    };
    let cuts = [0..2, 2..3];
    let mut chain = Chain::new(&g, &cuts, 0, &init, job);
    let mut twin = Chain::new(&g, &cuts, 0, &init, job);
    let x = t(&pseudo(8 * 3, 4), &[8, 3]);
    let y = x
        .sum_dim_intlist([1i64].as_slice(), false, Kind::Float)
        .gt(0.0)
        .to_kind(Kind::Int64);
    for step in 0..5 {
        let a = chain.train_step(step, &x, &y);
        let b = twin.train_step(step, &x, &y);
        assert_eq!(a.loss_sum, b.loss_sum, "step {step}");
        let uploaded = chain.upload(step + 1);
        let dtypes: BTreeMap<&str, WireDType> = uploaded
            .iter()
            .flatten()
            .map(|t| (t.name.as_str(), t.dtype))
            .collect();
        assert_eq!(dtypes["1.num_batches_tracked"], WireDType::I64);
        assert_eq!(dtypes["1.running_mean"], WireDType::F32);
        assert_eq!(dtypes["0.weight"], WireDType::F32);
        assert_eq!(dtypes.len(), 9, "{dtypes:?}");
        let num_batches = rookery_torch::tensor_from_wire(
            uploaded
                .iter()
                .flatten()
                .find(|t| t.name == "1.num_batches_tracked")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            num_batches.int64_value(&[]),
            4 * (step as i64 + 1),
            "one per micro-batch"
        );
        // Loading the same values back changes nothing: Adam's moments stay,
        // so the next step still equals the twin that never synced.
        let values: BTreeMap<String, WireTensor> = uploaded
            .iter()
            .flatten()
            .map(|t| (t.name.clone(), t.clone()))
            .collect();
        let own: Vec<Vec<String>> = uploaded
            .iter()
            .map(|s| s.iter().map(|t| t.name.clone()).collect())
            .collect();
        chain.set(step + 1, &values, &own);
    }
}

/// Trains a chain `split` steps, rebuilds it on fresh workers from what the
/// stages uploaded (with or without their optimizer state), and trains both
/// the original and the rebuilt chain on to `steps`; returns both losses.
fn continue_after_rebuild(
    optimizer: OptimizerConfig,
    with_state: bool,
    split: u64,
    steps: u64,
) -> (Vec<f64>, Vec<f64>) {
    let g = from_toml(MLP_NO_DROPOUT).unwrap();
    let init = init_params(&g, 5);
    let job = JobConfig::new(optimizer, Loss::cross_entropy());
    let cuts = [0..2, 2..5, 5..g.nodes.len()];
    let (x, y) = mlp_batch(16, 3);
    let mut chain = Chain::new(&g, &cuts, 0, &init, job);
    for step in 0..split {
        chain.train_step(step, &rolled(&x, step), &rolled(&y, step));
    }
    let mut uploaded = chain.upload_with_state(split);
    if !with_state {
        uploaded.iter_mut().for_each(|(state, _)| state.clear());
    }
    let mut rebuilt = Chain::rebuilt(&g, &cuts, job, &uploaded, split);
    let (mut kept, mut again) = (Vec::new(), Vec::new());
    for step in split..steps {
        let (xs, ys) = (rolled(&x, step), rolled(&y, step));
        kept.push(chain.train_step(step, &xs, &ys).loss_sum);
        again.push(rebuilt.train_step(step, &xs, &ys).loss_sum);
    }
    (kept, again)
}

#[test]
fn a_chain_rebuilt_from_uploaded_parameters_and_optimizer_state_trains_on_bit_for_bit() {
    for optimizer in [
        sgd(),
        OptimizerConfig::adam(0.01),
        OptimizerConfig::rmsprop(0.01),
    ] {
        let (kept, again) = continue_after_rebuild(optimizer, true, 4, 9);
        assert_eq!(kept, again, "{optimizer:?}");
        // Without the state the rebuilt chain is a different optimizer: the
        // state is what makes the rebuild exact.
        let (kept, again) = continue_after_rebuild(optimizer, false, 4, 9);
        assert_ne!(kept, again, "{optimizer:?} without its state");
    }
}

#[test]
fn optimizer_state_for_a_parameter_the_stage_lacks_or_of_the_wrong_shape_is_refused() {
    let g = from_toml(MLP_NO_DROPOUT).unwrap();
    let init = init_params(&g, 5);
    let job = JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy());
    let cuts = [0..2, 2..g.nodes.len()];
    let (x, y) = mlp_batch(16, 3);
    let mut chain = Chain::new(&g, &cuts, 0, &init, job);
    chain.train_step(0, &x, &y);
    let uploaded = chain.upload_with_state(1);
    let (state, params) = uploaded[0].clone();
    let mut stranger = state.clone();
    stranger[0].name = "no.such.weight".into();
    let mut misshapen = state.clone();
    misshapen[0].slots[0] = WireTensor::from_f32("exp_avg", &[1], &[0.0], WireDType::F32);
    let mut unknown_slot = state;
    unknown_slot[0].slots[0].name = "velocity".into();
    for (bad, words) in [
        (stranger, "not a parameter of this stage"),
        (misshapen, "has shape"),
        (unknown_slot, "not an optimizer state slot"),
    ] {
        let mut w = TorchWorker::new(Device::Cpu);
        let a = rookery_proto::Assignment {
            params: params.clone(),
            optimizer_state: bad,
            start_step: 1,
            ..assignment(&g, &cuts, 0, 0, &BTreeMap::new(), &job)
        };
        match &w.handle(ToProvider::Assign(Box::new(a)))[..] {
            [ToServer::JobFailed { message, .. }] => assert!(message.contains(words), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn micro_batches_may_arrive_out_of_order_and_still_match() {
    // Dropout masks follow each sample's position in the batch, not arrival order.
    let g = from_toml(MLP).unwrap();
    let init = init_params(&g, 17);
    let job = JobConfig::new(sgd(), Loss::cross_entropy());
    let mut in_order = Chain::new(&g, &[0..7], 0, &init, job);
    let mut worker = TorchWorker::new(Device::Cpu);
    let a = assignment(&g, &[0..7], 0, 0, &init, &job);
    assert_eq!(
        worker.handle(ToProvider::Assign(Box::new(a))),
        [ToServer::Ready { job_id: 7 }]
    );
    let (x, y) = mlp_batch(16, 5);
    for step in 0..3 {
        let want = in_order.train_step(step, &x, &y).loss_sum;
        let mut got = 0.0;
        for micro in [3u32, 1, 0, 2] {
            let part = |t: &Tensor| t.narrow(0, i64::from(micro) * 4, 4);
            let replies = worker.handle(ToProvider::Forward(Forward {
                job_id: 7,
                phase: Phase::Train { step },
                micro,
                step_samples: 16,
                step_targets: 16,
                inputs: vec![tensor_to_wire("input", &part(&x), WireDType::F32).unwrap()],
                labels: Some(labels_wire(&part(&y))),
            }));
            let ToServer::LeafLoss(l) = &replies[0] else {
                panic!("{replies:?}")
            };
            got += l.loss_sum;
            assert_eq!(replies.len(), if micro == 2 { 2 } else { 1 }, "{replies:?}");
        }
        assert!(relative(got, want) < 1e-6, "step {step}: {got} vs {want}");
    }
}

/// A plain MLP, for the first mixed chains.
fn mlp_own_ops() -> String {
    dense_mlp(6, &[(16, Some("relu")), (12, Some("tanh")), (4, None)])
}

fn wgpu_worker() -> Box<dyn Worker> {
    let device = pollster::block_on(GpuDevice::open()).unwrap_or_else(|e| {
        panic!("no usable GPU adapter ({e}); install mesa-vulkan-drivers (lavapipe)")
    });
    Box::new(OwnWorker::new(device))
}

#[test]
fn mlp_with_a_wgpu_stem_between_libtorch_stages_trains_like_one_process() {
    let g = from_toml(&mlp_own_ops()).unwrap();
    for (optimizer, name) in [(sgd(), "SGD"), (OptimizerConfig::adam(0.01), "Adam")] {
        let job = JobConfig::new(optimizer, Loss::cross_entropy());
        let make = |k: usize| {
            if k == 1 {
                wgpu_worker()
            } else {
                torch_worker(k)
            }
        };
        let losses = train_both_with(&g, &[0..2, 2..4, 4..5], job, mlp_batch(16, 5), 20, &make);
        // Our kernels sum in another order than libtorch's: 1e-4, as the issue asks.
        assert_same_within(&losses, &format!("MLP, wgpu Stem, {name}"), 1e-4, 1e-3);
    }
}

#[test]
fn our_kernels_with_a_step_schedule_and_clipping_train_like_one_process() {
    let g = from_toml(&mlp_own_ops()).unwrap();
    let job = JobConfig {
        lr_schedule: LrSchedule::Step {
            step_size: 5,
            gamma: 0.5,
        },
        // This model's gradients are small: most steps clip at 0.02.
        clip_grad_norm: Some(0.02),
        ..JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy())
    };
    let make = |k: usize| -> Box<dyn Worker> {
        match k {
            0 => torch_worker(k),
            1 => wgpu_worker(),
            _ => Box::new(OwnWorker::new(CpuDevice)),
        }
    };
    let losses = train_both_with(&g, &[0..2, 2..4, 4..5], job, mlp_batch(16, 5), 20, &make);
    assert_same_within(&losses, "MLP, step schedule + clipping, mixed", 1e-4, 1e-3);
    assert!(losses.clipped > 10, "only {} steps clipped", losses.clipped);
}

#[test]
fn mlp_entirely_on_our_kernels_gpu_root_and_cpu_leaf_trains_like_one_process() {
    let g = from_toml(&mlp_own_ops()).unwrap();
    let job = JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy());
    let make = |k: usize| -> Box<dyn Worker> {
        if k == 0 {
            wgpu_worker()
        } else {
            Box::new(OwnWorker::new(CpuDevice))
        }
    };
    let losses = train_both_with(&g, &[0..3, 3..5], job, mlp_batch(16, 5), 20, &make);
    assert_same_within(&losses, "MLP, wgpu Root, CPU-reference Leaf", 1e-4, 1e-3);
}

/// The dropout mask is drawn from the sample's position in the step, so a
/// wgpu Stem's Dropout and LayerNorm match libtorch's exactly.
#[test]
fn mlp_with_dropout_and_layer_norm_on_a_wgpu_stem_trains_like_one_process() {
    let g = from_toml(MLP).unwrap();
    for (optimizer, name) in [(sgd(), "SGD"), (OptimizerConfig::adam(0.01), "Adam")] {
        let job = JobConfig::new(optimizer, Loss::cross_entropy());
        let make = |k: usize| {
            if k == 1 {
                wgpu_worker()
            } else {
                torch_worker(k)
            }
        };
        let losses = train_both_with(&g, &[0..2, 2..6, 6..7], job, mlp_batch(16, 5), 20, &make);
        assert_same_within(
            &losses,
            &format!("MLP with Dropout and LayerNorm, wgpu Stem, {name}"),
            1e-4,
            1e-3,
        );
    }
}

#[test]
fn cnn_with_a_wgpu_stem_between_libtorch_stages_trains_like_one_process() {
    let g = from_toml(CNN).unwrap();
    let job = JobConfig {
        batch_size: 8,
        ..JobConfig::new(OptimizerConfig::adam(0.01), Loss::cross_entropy())
    };
    let make = |k: usize| {
        if k == 1 {
            wgpu_worker()
        } else {
            torch_worker(k)
        }
    };
    let losses = train_both_with(&g, &[0..2, 2..6, 6..8], job, cnn_batch(8), 20, &make);
    assert_same_within(&losses, "CNN, wgpu Stem, Adam", 1e-4, 1e-3);
}

/// The demo CNN's layers (Conv2d, BatchNorm2d with its running statistics
/// and batch counter, max pooling, Dropout) at the pipeline tests' size.
const BN_CNN: &str = r#"
input_shape = [2, 8, 8]
[[layers]]
type = "Conv2D"
filters = 4
kernel_size = 3
padding = 1
[[layers]]
type = "BatchNormalization2D"
[[layers]]
type = "Activation"
name = "relu"
[[layers]]
type = "MaxPooling2D"
pool_size = 2
[[layers]]
type = "Flatten"
[[layers]]
type = "Dropout"
rate = 0.25
[[layers]]
type = "Dense"
units = 3
"#;

#[test]
fn batch_norm_cnn_with_a_wgpu_stem_trains_like_one_process() {
    let g = from_toml(BN_CNN).unwrap();
    // SGD: the conv bias before BatchNorm has a gradient of zero up to
    // rounding, which Adam would turn into steps of noise. One micro-batch:
    // the one-process reference takes batch statistics over the whole batch.
    let job = JobConfig {
        batch_size: 8,
        micro_batches: 1,
        ..JobConfig::new(sgd(), Loss::cross_entropy())
    };
    let make = |k: usize| {
        if k == 1 {
            wgpu_worker()
        } else {
            torch_worker(k)
        }
    };
    let n = g.nodes.len();
    let losses = train_both_with(&g, &[0..1, 1..6, 6..n], job, cnn_batch(8), 20, &make);
    assert_same_within(&losses, "BatchNorm CNN, wgpu Stem, SGD", 1e-4, 1e-3);
}
