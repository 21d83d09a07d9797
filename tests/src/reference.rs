//! Single-process references the end-to-end runs are held to.
#![allow(clippy::unwrap_used)] // Test helpers fail loudly by design.

use std::path::Path;
use std::time::Instant;

use rookery_model::Graph;
use rookery_test_support::JobBatches;
use rookery_test_support::StepBatch;
use rookery_torch::exec::reference::whole_batch_step_clipped;
use rookery_torch::exec::{loss_targets, micro_batch_loss};
use rookery_torch::{TorchExecutor, TorchOptimizer, step_seed, tensors_from_values};
use tch::{Device, Tensor};

/// The per-step losses of `job_file` trained in one process by
/// PipeDream-2BW's rule with weight prediction, as `training.schedule =
/// "async"` defines it: step `k`'s gradient (of its whole batch) is taken
/// at the weights after steps `..k - 1` extrapolated by step `k - 2`'s
/// update (`w + (w - w_before)`); a barrier's step (every `sync_every`
/// steps and each epoch's start) at the barrier's weights, and the step
/// after it at the weights after the barrier's step. The job's optimizer
/// applies each gradient to the latest weights. (Models without buffers:
/// they would not go back with the weights. Token models too: their ids
/// go in as i64.)
pub fn two_bw_losses(job_file: &Path) -> Vec<f64> {
    let batches = JobBatches::open(job_file).unwrap();
    let t = batches.spec.training.clone();
    let steps_per_epoch = batches.total_steps() / t.epochs;
    let graph = batches.graph.clone();
    let params = tensors_from_values(&graph, &graph.initial_values(t.seed)).unwrap();
    let nodes = graph.analyze().unwrap().nodes.len();
    let given: Vec<(String, Tensor)> = params.into_iter().collect();
    let mut exec =
        TorchExecutor::new(&graph, 0..nodes, graph.outputs.clone(), given, Device::Cpu).unwrap();
    let mut optimizer = TorchOptimizer::new(t.optimizer).unwrap();
    // Every version: `versions[k]` is the weights after `k` steps.
    let mut versions = vec![exec.parameters().unwrap()];
    let mut barrier = 0;
    let output = graph.outputs[0].clone();
    batches
        .map(|batch| {
            let k = batch.step;
            if k.is_multiple_of(t.sync_every) || k.is_multiple_of(steps_per_epoch) {
                barrier = k;
            }
            // A barrier's step runs with the barrier's weights, the step
            // after it with what that step's update made, later ones with
            // the weights before the previous update extrapolated.
            let (k, from) = (k as usize, barrier as usize);
            if k >= from + 2 {
                let predicted: Vec<(String, Tensor)> = versions[k - 1]
                    .iter()
                    .zip(&versions[k - 2])
                    .map(|((n, w), (_, before))| (n.clone(), w + (w - before)))
                    .collect();
                exec.set_parameters(&predicted).unwrap();
            } else {
                exec.set_parameters(&versions[k]).unwrap();
            }
            let (x, y) = step_tensors(&graph, &batch);
            exec.set_step_seed(step_seed(t.seed, k as u64));
            let forward = exec
                .forward(&[(graph.inputs[0].name.clone(), x)], true)
                .unwrap();
            let targets = loss_targets(t.loss, &y).unwrap();
            let loss = micro_batch_loss(t.loss, &forward.outputs[0].1, &y, targets).unwrap();
            exec.backward(forward.micro_batch, &[(output.clone(), loss.grad)])
                .unwrap();
            // Loading the latest weights keeps the stale ones' gradients.
            exec.set_parameters(&versions[k]).unwrap();
            exec.step(&mut optimizer).unwrap();
            versions.push(exec.parameters().unwrap());
            loss.scaled
        })
        .collect()
}

/// The job trained in one process with its whole step batch (every
/// cluster's samples) at once, its learning-rate schedule, its gradient
/// clipping and its precision: each step's loss, step by step as the
/// iterator is driven (so the caller can time it).
pub fn whole_batch_losses(
    job_file: &Path,
) -> anyhow::Result<impl Iterator<Item = anyhow::Result<(u64, f64)>>> {
    let batches = JobBatches::open(job_file)?;
    let t = batches.spec.training.clone();
    let graph = batches.graph.clone();
    let params = tensors_from_values(&graph, &graph.initial_values(t.seed))?;
    let nodes = graph.analyze()?.nodes.len();
    let mut exec =
        TorchExecutor::new(&graph, 0..nodes, graph.outputs.clone(), params, Device::Cpu)?
            .with_precision(t.precision);
    let mut optimizer = TorchOptimizer::new(t.optimizer)?;
    let base_lr = t.optimizer.lr();
    let lr_schedule = t.lr_schedule.resolve(base_lr, batches.total_steps())?;
    Ok(batches.map(move |batch| {
        optimizer.set_lr(lr_schedule.lr(base_lr, batch.step))?;
        let (x, y) = step_tensors(&graph, &batch);
        let inputs = [(graph.inputs[0].name.clone(), x)];
        let loss = whole_batch_step_clipped(
            &mut exec,
            &inputs,
            &y,
            t.loss,
            &mut optimizer,
            step_seed(t.seed, batch.step),
            t.clip_grad_norm,
        )?;
        Ok((batch.step, loss))
    }))
}

/// Steps a second of `job_file` trained in one process
/// ([`whole_batch_losses`]: one libtorch executor over the whole graph on
/// the job's batches, read as the providers read them), timed after
/// `warmup` steps.
pub fn steps_per_s(job_file: &Path, warmup: u64) -> anyhow::Result<f64> {
    let mut started = Instant::now();
    let mut timed = 0;
    for step in whole_batch_losses(job_file)? {
        let (step, _) = step?;
        if step + 1 == warmup {
            (started, timed) = (Instant::now(), 0);
        } else {
            timed += 1;
        }
    }
    anyhow::ensure!(
        timed > 0,
        "the job has no steps past the {warmup} warm-up ones"
    );
    Ok(f64::from(timed) / started.elapsed().as_secs_f64())
}

/// A step's batch as the graph takes it: the inputs shaped (token ids,
/// which the batches carry as f32, as i64) and the labels shaped.
pub fn step_tensors(graph: &Graph, batch: &StepBatch) -> (Tensor, Tensor) {
    let shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
    let mut x = Tensor::from_slice(&batch.x).reshape(shape.as_slice());
    if graph.inputs[0].dtype == rookery_model::DType::I64 {
        x = x.to_kind(tch::Kind::Int64);
    }
    let y_shape: Vec<i64> = batch.y_shape.iter().map(|&d| d as i64).collect();
    (x, Tensor::from_slice(&batch.y).reshape(y_shape.as_slice()))
}
