//! Single-process training built from the stage executor: [`train_step`] runs
//! the whole graph as one stage with one micro-batch (the oracle the pipeline
//! must match), and [`pipeline_train_step`] drives a chain of stages through the
//! sync schedule in one process (what a cluster does over the network), so the
//! two can be compared step by step. The `_clipped` forms clip gradients by
//! their global norm before stepping, as a cluster does (each stage's sum of
//! squares in f64, summed over the stages in order, one multiplier for all);
//! a learning-rate schedule is the caller's `TorchOptimizer::set_lr` with
//! `LrSchedule::lr` of the step, before the step.

use std::collections::{BTreeMap, HashMap};

use rookery_model::{Graph, Loss, clip_scale};
use tch::{Device, Tensor};

use super::loss::loss_targets;
use super::{ExecError, StageError, TorchExecutor, TorchOptimizer, micro_batch_loss};

/// One training step of the whole model on one batch: forward in training
/// mode with dropout seeded by `step_seed`, the batch's mean loss, backward,
/// one optimizer step. `params` (all parameters and buffers, by name) are
/// updated in place; returns the loss. The graph must have exactly one output,
/// the one the loss reads.
pub fn train_step(
    graph: &Graph,
    params: &mut BTreeMap<String, Tensor>,
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    optimizer: &mut TorchOptimizer,
    step_seed: u64,
) -> Result<f64, ExecError> {
    train_step_clipped(
        graph,
        params,
        batch_inputs,
        labels,
        loss,
        optimizer,
        step_seed,
        None,
    )
}

/// [`train_step`] clipping the gradients to global norm `clip_grad_norm`
/// before the step.
#[allow(clippy::too_many_arguments)]
pub fn train_step_clipped(
    graph: &Graph,
    params: &mut BTreeMap<String, Tensor>,
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    optimizer: &mut TorchOptimizer,
    step_seed: u64,
    clip_grad_norm: Option<f64>,
) -> Result<f64, ExecError> {
    let device = batch_inputs
        .first()
        .map_or(Device::Cpu, |(_, t)| t.device());
    let n = graph.analyze()?.nodes.len();
    let given: Vec<(String, Tensor)> = params
        .iter()
        .map(|(k, v)| (k.clone(), v.shallow_clone()))
        .collect();
    let mut exec = TorchExecutor::new(graph, 0..n, graph.outputs.clone(), given, device)?;
    let value = whole_batch_step_clipped(
        &mut exec,
        batch_inputs,
        labels,
        loss,
        optimizer,
        step_seed,
        clip_grad_norm,
    )?;
    for (name, t) in exec.parameters()? {
        params.insert(name, t);
    }
    Ok(value)
}

/// [`train_step`] on an executor that already holds the whole graph, so the
/// parameters stay on it between steps.
pub fn whole_batch_step(
    exec: &mut TorchExecutor,
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    optimizer: &mut TorchOptimizer,
    step_seed: u64,
) -> Result<f64, ExecError> {
    whole_batch_step_clipped(exec, batch_inputs, labels, loss, optimizer, step_seed, None)
}

/// [`whole_batch_step`] clipping the gradients to global norm
/// `clip_grad_norm` (`clip_grad_norm_`'s `max_norm`) before the step.
pub fn whole_batch_step_clipped(
    exec: &mut TorchExecutor,
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    optimizer: &mut TorchOptimizer,
    step_seed: u64,
    clip_grad_norm: Option<f64>,
) -> Result<f64, ExecError> {
    let [out_name] = exec
        .output_names()
        .try_into()
        .map_err(|names: Vec<String>| {
            ExecError::Loss(format!(
                "the loss needs exactly one model output, got {names:?}"
            ))
        })?;
    batch_size(batch_inputs)?;
    exec.set_step_seed(step_seed);
    let fwd = exec.forward(batch_inputs, true)?;
    let out = single(&fwd.outputs, &out_name)?;
    let l = micro_batch_loss(loss, out, labels, loss_targets(loss, labels)?)?;
    exec.backward(fwd.micro_batch, &[(out_name, l.grad)])?;
    clip(std::slice::from_mut(exec), clip_grad_norm)?;
    exec.step(optimizer)?;
    Ok(l.scaled)
}

/// One step of a cluster in one process, in the sync (GPipe) schedule: the batch
/// is cut into `micro_batches` chunks along dimension 0 (as `torch.chunk`),
/// every chunk goes forward through `stages` in order, the last stage's single
/// output gets the chunk's share of the step's mean loss (its summed loss over
/// the whole batch's targets), gradients go back stage by
/// stage, and each stage steps its own optimizer once all chunks are done.
/// Tensors a stage does not list as inputs stay available to later stages, and
/// gradients arriving for the same tensor from several stages are summed.
/// Returns the batch's mean loss.
pub fn pipeline_train_step(
    stages: &mut [TorchExecutor],
    optimizers: &mut [TorchOptimizer],
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    micro_batches: usize,
    step_seed: u64,
) -> Result<f64, ExecError> {
    pipeline_train_step_clipped(
        stages,
        optimizers,
        batch_inputs,
        labels,
        loss,
        micro_batches,
        step_seed,
        None,
    )
}

/// [`pipeline_train_step`] clipping the gradients of all stages together
/// to global norm `clip_grad_norm` before the stages step.
#[allow(clippy::too_many_arguments)]
pub fn pipeline_train_step_clipped(
    stages: &mut [TorchExecutor],
    optimizers: &mut [TorchOptimizer],
    batch_inputs: &[(String, Tensor)],
    labels: &Tensor,
    loss: Loss,
    micro_batches: usize,
    step_seed: u64,
    clip_grad_norm: Option<f64>,
) -> Result<f64, ExecError> {
    if stages.is_empty() || stages.len() != optimizers.len() {
        return Err(ExecError::Optimizer(format!(
            "{} stages need as many optimizers, got {}",
            stages.len(),
            optimizers.len()
        )));
    }
    let leaf_output = match stages.last().map(TorchExecutor::output_names) {
        Some(names) if names.len() == 1 => names[0].clone(),
        other => {
            return Err(ExecError::Loss(format!(
                "the last stage must have exactly one output for the loss, got {other:?}"
            )));
        }
    };
    let batch = batch_size(batch_inputs)?;
    let step_targets = loss_targets(loss, labels)?;
    let chunk = batch.div_ceil(micro_batches.max(1));
    for s in stages.iter_mut() {
        s.set_step_seed(step_seed);
    }

    let mut handles = Vec::new();
    let mut total = 0.0;
    let mut start = 0;
    while start < batch {
        let len = chunk.min(batch - start);
        let narrow = |t: &Tensor| t.f_narrow(0, start as i64, len as i64);
        let mut avail: HashMap<String, Tensor> = batch_inputs
            .iter()
            .map(|(n, t)| Ok((n.clone(), narrow(t)?)))
            .collect::<Result<_, ExecError>>()?;
        let mut per_stage = Vec::with_capacity(stages.len());
        for s in stages.iter_mut() {
            let feed = s
                .input_names()
                .into_iter()
                .map(|n| {
                    let t = avail.get(&n).ok_or_else(|| {
                        ExecError::Stage(StageError::Input {
                            name: n.clone(),
                            reason: "no earlier stage produced it".into(),
                        })
                    })?;
                    Ok((n, t.shallow_clone()))
                })
                .collect::<Result<Vec<_>, ExecError>>()?;
            let fwd = s.forward(&feed, true)?;
            per_stage.push(fwd.micro_batch);
            avail.extend(fwd.outputs);
        }
        let out = avail.get(&leaf_output).ok_or_else(|| ExecError::Output {
            name: leaf_output.clone(),
            reason: "not produced".into(),
        })?;
        let l = micro_batch_loss(loss, out, &narrow(labels)?, step_targets)?;
        total += l.scaled;
        handles.push((per_stage, l.grad));
        start += len;
    }

    for (per_stage, grad) in handles {
        let mut grads: HashMap<String, Tensor> = HashMap::from([(leaf_output.clone(), grad)]);
        for (s, mb) in stages.iter_mut().zip(per_stage).rev() {
            // This stage's outputs consume their gradients; what it returns for
            // its inputs already includes anything it passed through.
            let outs: Vec<(String, Tensor)> = s
                .output_names()
                .into_iter()
                .filter_map(|n| grads.remove(&n).map(|g| (n, g)))
                .collect();
            for (name, g) in s.backward(mb, &outs)? {
                let g = match grads.remove(&name) {
                    Some(prev) => prev.f_add(&g)?,
                    None => g,
                };
                grads.insert(name, g);
            }
        }
    }
    clip(stages, clip_grad_norm)?;
    for (s, opt) in stages.iter_mut().zip(optimizers.iter_mut()) {
        s.step(opt)?;
    }
    Ok(total)
}

/// Clips the accumulated gradients of `stages` together, as the server
/// does for a cluster: each stage's sum of squares, summed in stage order,
/// gives one multiplier ([`clip_scale`]) for every gradient. Returns the
/// multiplier (1 without clipping).
pub fn clip(stages: &mut [TorchExecutor], clip_grad_norm: Option<f64>) -> Result<f64, ExecError> {
    let Some(max_norm) = clip_grad_norm else {
        return Ok(1.0);
    };
    let mut total = 0.0;
    for s in stages.iter() {
        total += s.grad_sum_of_squares()?;
    }
    let scale = clip_scale(total, max_norm);
    for s in stages.iter_mut() {
        s.scale_grads(scale)?;
    }
    Ok(scale)
}

fn batch_size(inputs: &[(String, Tensor)]) -> Result<usize, ExecError> {
    let (name, first) = inputs
        .first()
        .ok_or_else(|| ExecError::Loss("no batch inputs".into()))?;
    match first.size().first() {
        Some(&b) if b > 0 => Ok(b as usize),
        _ => Err(ExecError::Stage(StageError::Input {
            name: name.clone(),
            reason: format!("shape {:?} has no batch dimension", first.size()),
        })),
    }
}

fn single<'a>(outputs: &'a [(String, Tensor)], name: &str) -> Result<&'a Tensor, ExecError> {
    outputs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| ExecError::Output {
            name: name.to_string(),
            reason: "not produced".into(),
        })
}
