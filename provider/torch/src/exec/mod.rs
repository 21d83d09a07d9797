//! The libtorch stage executor: runs a contiguous range of a [`Graph`]'s
//! topological order (one pipeline stage) forward and backward, micro-batch by
//! micro-batch, accumulates its parameter gradients and steps its optimizer.
//!
//! One training step on a stage:
//! [`TorchExecutor::set_step_seed`], then for each micro-batch
//! [`TorchExecutor::forward`] (keeps what backward needs under a
//! [`TorchMicroBatch`] handle), later [`TorchExecutor::backward`] with the gradients
//! of the stage's outputs (the Leaf gets them from [`loss::micro_batch_loss`]),
//! and finally [`TorchExecutor::step`]. Gradients w.r.t. the stage inputs go back
//! to the previous stage. [`reference`] holds the single-process oracle and a
//! local pipeline driver built from the same pieces.
//!
//! Inputs from another stage become fresh autograd leaves, so a stage's
//! autograd graph never reaches outside the stage: this is what lets the
//! stages live in different processes.

mod activations;
pub mod loss;
mod ops;
pub mod optim;
pub mod reference;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use rookery_model::layout::{self, LayoutError, LayoutParam, Source, StageLayout};
use rookery_model::{DType, Graph, GraphError, Op, ParamKind};
pub use rookery_stage::StageError;
use tch::{Device, Kind, Tensor};

pub use activations::activation;
pub use loss::{LossOutput, loss_targets, micro_batch_loss};
pub use optim::{OptimizerConfig, TorchOptimizer};

use ops::{OpContext, OpFailure};

/// Everything that can go wrong building or running a stage. Messages name the
/// node, tensor or parameter involved.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("invalid graph: {0}")]
    Graph(#[from] GraphError),
    #[error("stage range {first}..{end} is not a non-empty range of the graph's {nodes} nodes")]
    Range {
        first: usize,
        end: usize,
        nodes: usize,
    },
    /// An op (or op configuration) this backend cannot run yet.
    #[error("node `{node}`: op {op} is not supported by the libtorch backend")]
    Unsupported { node: String, op: String },
    #[error("node `{node}` ({op}): {reason}")]
    Op {
        node: String,
        op: String,
        reason: String,
    },
    /// What every executor can refuse (parameters, inputs, gradients,
    /// micro-batches), worded once in `rookery_stage`.
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error("stage output `{name}`: {reason}")]
    Output { name: String, reason: String },
    #[error("loss: {0}")]
    Loss(String),
    #[error("optimizer: {0}")]
    Optimizer(String),
    #[error("libtorch: {}", short(.0))]
    Torch(#[from] tch::TchError),
}

impl From<LayoutError> for ExecError {
    fn from(error: LayoutError) -> Self {
        match error {
            LayoutError::Range { first, end, nodes } => ExecError::Range { first, end, nodes },
            LayoutError::Input { name, reason } => {
                ExecError::Stage(StageError::Input { name, reason })
            }
            LayoutError::Output { name, reason } => ExecError::Output { name, reason },
        }
    }
}

/// libtorch messages carry a C++ backtrace after the first lines; people need
/// the message, not the frames.
fn short(e: &tch::TchError) -> String {
    let text = e.to_string();
    match text.find("\nException raised from") {
        Some(i) => text[..i].trim_end().to_string(),
        None => text.trim_end().to_string(),
    }
}

/// Handle of one micro-batch between its forward and its backward on a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TorchMicroBatch(u64);

impl TorchMicroBatch {
    pub fn id(self) -> u64 {
        self.0
    }
}

/// What [`TorchExecutor::forward`] returns.
#[derive(Debug)]
pub struct TorchForward {
    /// Pass this to [`TorchExecutor::backward`].
    pub micro_batch: TorchMicroBatch,
    /// The stage's outputs in constructor order, detached (the autograd graph
    /// stays inside the executor), on the stage's device.
    pub outputs: Vec<(String, Tensor)>,
}

#[derive(Debug)]
struct StageNode {
    name: String,
    op: Op,
    inputs: Vec<Source>,
}

#[derive(Debug)]
struct StageInput {
    name: String,
    dtype: DType,
    rank: usize,
    /// Float tensors made by an earlier node: the previous stage needs their gradient.
    /// Graph inputs (the Root's data) never get one.
    requires_grad: bool,
}

#[derive(Debug)]
struct StageParam {
    name: String,
    kind: ParamKind,
    dtype: DType,
    shape: Vec<i64>,
    tensor: Tensor,
}

/// What backward needs of one micro-batch.
#[derive(Debug)]
struct InFlight {
    /// The autograd leaves made from inputs that require grad (None otherwise).
    leaves: Vec<Option<Tensor>>,
    /// Outputs still attached to the stage's graph.
    outputs: Vec<Tensor>,
}

/// One pipeline stage on one device. See the module docs for a step's calls.
#[derive(Debug)]
pub struct TorchExecutor {
    device: Device,
    nodes: Vec<StageNode>,
    /// For each local node output, the last stage node reading it (`usize::MAX`
    /// when it leaves the stage), so intermediate handles are dropped early.
    last_use: Vec<usize>,
    inputs: Vec<StageInput>,
    params: Vec<StageParam>,
    outputs: Vec<(String, Source)>,
    in_flight: BTreeMap<TorchMicroBatch, InFlight>,
    next_micro_batch: u64,
    step_seed: u64,
    next_sample: u64,
}

/// Names of the tensors crossing cut `cut` of the graph's topological order
/// (cut `c` sits before node position `c`; cut `n` is the end): produced at or
/// before the cut and read at or after it, graph outputs counting as read at the
/// end. The same rule as the planner's boundary sets, in the same order (graph
/// inputs, then node outputs in topological order), so `stage_boundary(g, end)`
/// is the `outputs` argument of a stage `[first, end)`.
pub fn stage_boundary(graph: &Graph, cut: usize) -> Result<Vec<String>, ExecError> {
    let analysis = graph.analyze()?;
    Ok(layout::boundary(graph, &analysis, cut))
}

/// Builds CPU tensors for parameters given as flat values (e.g. from
/// [`Graph::initial_values`] or a checkpoint), shaped and typed as the graph
/// declares them. Names the graph does not declare are an error.
pub fn tensors_from_values(
    graph: &Graph,
    values: &BTreeMap<String, Vec<f32>>,
) -> Result<BTreeMap<String, Tensor>, ExecError> {
    let mut out = BTreeMap::new();
    for (name, data) in values {
        let Some(p) = graph.param(name) else {
            return Err(ExecError::Stage(StageError::Param {
                name: name.clone(),
                reason: "not a parameter of this graph".into(),
            }));
        };
        if data.len() != p.numel() {
            return Err(ExecError::Stage(StageError::Param {
                name: name.clone(),
                reason: format!(
                    "{} values for shape {:?} ({} elements)",
                    data.len(),
                    p.shape,
                    p.numel()
                ),
            }));
        }
        let shape: Vec<i64> = p.shape.iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_slice(data)?.f_reshape(shape.as_slice())?;
        let t = match p.dtype {
            DType::F32 => t,
            DType::I64 => t.f_to_kind(Kind::Int64)?,
        };
        out.insert(name.clone(), t);
    }
    Ok(out)
}

/// Whether autograd can track tensors of this kind.
pub(crate) fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

fn dtype_matches(dtype: DType, kind: Kind) -> bool {
    match dtype {
        // Any float kind runs (f64 makes finite-difference checks exact enough);
        // the graph's f32 is what the wire carries.
        DType::F32 => is_float(kind),
        DType::I64 => kind == Kind::Int64,
    }
}

impl TorchExecutor {
    /// A stage running nodes `range` (positions in [`Graph::analyze`]'s
    /// topological order), producing `outputs` (tensor names: nodes of the
    /// stage, or inputs it passes through to a later stage), with parameters
    /// taken by name from `params` (names the stage does not use are ignored, so
    /// one map of the whole model can feed every stage). Parameters are copied
    /// onto `device`; trainable ones become autograd leaves.
    pub fn new(
        graph: &Graph,
        range: Range<usize>,
        outputs: Vec<String>,
        params: impl IntoIterator<Item = (String, Tensor)>,
        device: Device,
    ) -> Result<Self, ExecError> {
        let analysis = graph.analyze()?;
        let mut given: HashMap<String, Tensor> = params.into_iter().collect();
        let layout = StageLayout::new(graph, &analysis, range, &outputs)?;
        let mut nodes = Vec::with_capacity(layout.nodes.len());
        for node in layout.nodes {
            if !ops::supported(&node.op) {
                return Err(ExecError::Unsupported {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                });
            }
            nodes.push(StageNode {
                name: node.name,
                op: node.op,
                inputs: node.inputs,
            });
        }
        let inputs = layout
            .inputs
            .into_iter()
            .map(|i| StageInput {
                name: i.name,
                dtype: i.dtype,
                rank: i.shape.len(),
                requires_grad: i.requires_grad,
            })
            .collect();
        let params = layout
            .params
            .into_iter()
            .map(|p| stage_param(p, &mut given, device))
            .collect::<Result<Vec<_>, _>>()?;
        let (outs, last_use) = (layout.outputs, layout.last_use);
        Ok(Self {
            device,
            nodes,
            last_use,
            inputs,
            params,
            outputs: outs,
            in_flight: BTreeMap::new(),
            next_micro_batch: 0,
            step_seed: 0,
            next_sample: 0,
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Names this stage expects in [`forward`](Self::forward), in order.
    pub fn input_names(&self) -> Vec<String> {
        self.inputs.iter().map(|i| i.name.clone()).collect()
    }

    /// Inputs whose gradient [`backward`](Self::backward) returns.
    pub fn grad_input_names(&self) -> Vec<String> {
        self.inputs
            .iter()
            .filter(|i| i.requires_grad)
            .map(|i| i.name.clone())
            .collect()
    }

    pub fn output_names(&self) -> Vec<String> {
        self.outputs.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Every parameter and buffer of the stage, by name.
    pub fn param_names(&self) -> Vec<String> {
        self.params.iter().map(|p| p.name.clone()).collect()
    }

    /// Micro-batches forwarded but not yet backpropagated.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Starts a step: dropout masks of the following training forwards derive
    /// from `seed` and the samples' positions in the step's batch, counted from 0
    /// in forward order (see [`forward_at`](Self::forward_at) to say them
    /// explicitly). Callers derive `seed` from the job seed and the step index,
    /// the same on every stage and in the reference run.
    pub fn set_step_seed(&mut self, seed: u64) {
        self.step_seed = seed;
        self.next_sample = 0;
    }

    /// Runs the stage on one micro-batch, in training (`train`: dropout on,
    /// BatchNorm on batch statistics, updating its running statistics) or eval
    /// mode, and keeps what backward needs. The micro-batch's samples are taken
    /// to follow the previous training forward's in the step's batch, which holds
    /// whenever micro-batches are forwarded in order (GPipe and 1F1B both do).
    pub fn forward(
        &mut self,
        inputs: &[(String, Tensor)],
        train: bool,
    ) -> Result<TorchForward, ExecError> {
        let offset = self.next_sample;
        self.forward_at(inputs, train, offset)
    }

    /// [`forward`](Self::forward) with the micro-batch's first sample index in
    /// the step's batch given explicitly (dimension 0 of the inputs is the batch).
    pub fn forward_at(
        &mut self,
        inputs: &[(String, Tensor)],
        train: bool,
        sample_offset: u64,
    ) -> Result<TorchForward, ExecError> {
        let placed = self.place_inputs(inputs, true)?;
        let batch = placed
            .first()
            .and_then(|t| t.size().first().copied())
            .unwrap_or(1)
            .max(0) as u64;
        // Autograd must record even if the caller sits inside `no_grad`.
        let outputs = tch::with_grad(|| self.run(&placed, train, sample_offset))?;
        if train {
            self.next_sample = sample_offset + batch;
        }
        let detached = self
            .outputs
            .iter()
            .zip(&outputs)
            .map(|((name, _), t)| Ok((name.clone(), t.f_detach()?)))
            .collect::<Result<Vec<_>, ExecError>>()?;
        let leaves = self
            .inputs
            .iter()
            .zip(placed)
            .map(|(i, t)| i.requires_grad.then_some(t))
            .collect();
        let id = TorchMicroBatch(self.next_micro_batch);
        self.next_micro_batch += 1;
        self.in_flight.insert(id, InFlight { leaves, outputs });
        Ok(TorchForward {
            micro_batch: id,
            outputs: detached,
        })
    }

    /// Eval-mode forward without autograd and without keeping anything: for
    /// validation and inference.
    pub fn evaluate(
        &self,
        inputs: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        let placed = self.place_inputs(inputs, false)?;
        let outputs = tch::no_grad(|| self.run(&placed, false, 0))?;
        Ok(self
            .outputs
            .iter()
            .map(|(n, _)| n.clone())
            .zip(outputs)
            .collect())
    }

    /// Drops a micro-batch's saved state without backpropagating it.
    pub fn discard(&mut self, micro_batch: TorchMicroBatch) -> Result<(), ExecError> {
        self.in_flight
            .remove(&micro_batch)
            .map(|_| ())
            .ok_or(ExecError::Stage(StageError::UnknownMicroBatch(
                micro_batch.0,
            )))
    }

    /// Backpropagates one micro-batch given the gradients of the stage's outputs
    /// (by name; an output left out counts as zero, one that does not require
    /// grad, like a passed-through data input, is ignored). Parameter gradients
    /// ACCUMULATE across micro-batches until [`step`](Self::step) or
    /// [`zero_grad`](Self::zero_grad). Returns the gradients w.r.t. the inputs
    /// in [`grad_input_names`](Self::grad_input_names) (zeros where no path
    /// leads from the input to an output).
    pub fn backward(
        &mut self,
        micro_batch: TorchMicroBatch,
        output_grads: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        let saved = self.in_flight.get(&micro_batch).ok_or(ExecError::Stage(
            StageError::UnknownMicroBatch(micro_batch.0),
        ))?;
        let mut seen = vec![false; self.outputs.len()];
        let mut terms = Vec::new();
        for (name, g) in output_grads {
            let grad_err = |reason: String| {
                ExecError::Stage(StageError::Grad {
                    name: name.clone(),
                    reason,
                })
            };
            let Some(k) = self.outputs.iter().position(|(o, _)| o == name) else {
                return Err(grad_err("not an output of this stage".into()));
            };
            if std::mem::replace(&mut seen[k], true) {
                return Err(grad_err("given twice".into()));
            }
            let y = &saved.outputs[k];
            if !y.requires_grad() {
                continue;
            }
            if g.size() != y.size() {
                return Err(grad_err(format!(
                    "shape {:?} differs from the output's {:?}",
                    g.size(),
                    y.size()
                )));
            }
            if !is_float(g.kind()) {
                return Err(grad_err(format!(
                    "must be floating point, got {:?}",
                    g.kind()
                )));
            }
            let g = g
                .f_to_device(self.device)?
                .f_to_kind(y.kind())?
                .f_detach()?;
            // tch has no backward(gradient): d/dy of sum(y * g) is g.
            terms.push(y.f_mul(&g)?.f_sum(None::<Kind>)?);
        }
        let saved = self.in_flight.remove(&micro_batch).ok_or(ExecError::Stage(
            StageError::UnknownMicroBatch(micro_batch.0),
        ))?;
        if let Some((first, rest)) = terms.split_first() {
            let mut total = first.shallow_clone();
            for t in rest {
                total = total.f_add(t)?;
            }
            tch::with_grad(|| total.f_backward())?;
        }
        let mut grads = Vec::new();
        for (input, leaf) in self.inputs.iter().zip(saved.leaves) {
            let Some(leaf) = leaf else { continue };
            let g = leaf.f_grad()?;
            let g = if g.defined() { g } else { leaf.f_zeros_like()? };
            grads.push((input.name.clone(), g));
        }
        Ok(grads)
    }

    /// Applies `optimizer` to every trainable parameter that received a gradient
    /// since the last step (as PyTorch skips parameters whose `.grad` is None),
    /// then clears the gradients.
    pub fn step(&mut self, optimizer: &mut TorchOptimizer) -> Result<(), ExecError> {
        self.idle("stepping")?;
        for p in &self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            let g = p.tensor.f_grad()?;
            if g.defined() {
                optimizer.update(&p.name, &p.tensor, &g)?;
            }
        }
        self.zero_grad()
    }

    /// The sum of the squares of every accumulated gradient element, in f64,
    /// parameter by parameter in the stage's order, read on the host so the
    /// order (and so the sum) is the same on every device and backend.
    pub fn grad_sum_of_squares(&self) -> Result<f64, ExecError> {
        let mut acc = 0.0;
        for p in &self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            let g = p.tensor.f_grad()?;
            if g.defined() {
                let g = g
                    .f_detach()?
                    .f_to_device(tch::Device::Cpu)?
                    .f_to_kind(tch::Kind::Float)?
                    .f_contiguous()?;
                let numel = g.numel();
                let mut values = vec![0f32; numel];
                g.f_copy_data(&mut values, numel)?;
                acc = rookery_model::sum_of_squares(acc, &values);
            }
        }
        Ok(acc)
    }

    /// Multiplies every accumulated gradient by `scale` rounded to f32, as
    /// `clip_grad_norm_`'s `grad.mul_(clip_coef)`; 1 changes nothing.
    pub fn scale_grads(&mut self, scale: f64) -> Result<(), ExecError> {
        let scale = f64::from(scale as f32);
        if scale == 1.0 {
            return Ok(());
        }
        for p in &self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            let mut g = p.tensor.f_grad()?;
            if g.defined() {
                let _ = tch::no_grad(|| g.f_mul_scalar_(scale))?;
            }
        }
        Ok(())
    }

    /// Drops accumulated gradients. A parameter becomes a fresh leaf sharing its
    /// storage, which is PyTorch's `zero_grad(set_to_none=True)`: tch cannot
    /// set `.grad` back to None otherwise, and a zeroed gradient would still
    /// move momentum and weight decay for parameters that got none.
    pub fn zero_grad(&mut self) -> Result<(), ExecError> {
        self.idle("clearing gradients")?;
        for p in &mut self.params {
            if p.kind == ParamKind::Trainable {
                p.tensor = p.tensor.f_detach()?.f_set_requires_grad(true)?;
            }
        }
        Ok(())
    }

    /// Copies of every parameter and buffer, by name (for sync and averaging).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.tensor.f_detach_copy()?)))
            .collect()
    }

    /// Accumulated gradients of the trainable parameters that have one.
    pub fn gradients(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        let mut out = Vec::new();
        for p in &self.params {
            let g = p.tensor.f_grad()?;
            if g.defined() {
                out.push((p.name.clone(), g.f_detach_copy()?));
            }
        }
        Ok(out)
    }

    /// Loads values (e.g. the server's average) into some or all of the stage's
    /// parameters and buffers, in place, keeping gradients and optimizer state.
    pub fn set_parameters(&mut self, values: &[(String, Tensor)]) -> Result<(), ExecError> {
        self.idle("loading parameters")?;
        for (name, v) in values {
            let err = |reason: String| {
                ExecError::Stage(StageError::Param {
                    name: name.clone(),
                    reason,
                })
            };
            let Some(p) = self.params.iter_mut().find(|p| p.name == *name) else {
                return Err(err("not a parameter of this stage".into()));
            };
            if v.size() != p.shape {
                return Err(err(format!(
                    "shape {:?} differs from the parameter's {:?}",
                    v.size(),
                    p.shape
                )));
            }
            if !dtype_matches(p.dtype, v.kind()) {
                return Err(err(format!(
                    "dtype {:?} for a {:?} parameter",
                    v.kind(),
                    p.dtype
                )));
            }
            let v = v.f_to_device(self.device)?.f_to_kind(p.tensor.kind())?;
            tch::no_grad(|| p.tensor.shallow_clone().f_copy_(&v))?;
        }
        Ok(())
    }

    fn idle(&self, action: &str) -> Result<(), ExecError> {
        if self.in_flight.is_empty() {
            Ok(())
        } else {
            // An optimizer step in place would break their saved tensors, and
            // their later backward would add to gradients already spent.
            Err(ExecError::Stage(StageError::InFlight {
                in_flight: self.in_flight.len(),
                action: action.into(),
            }))
        }
    }

    /// Matches named inputs to the stage's slots, checks them and moves them to
    /// the device; inputs needing a gradient become fresh leaves (`leaves`).
    fn place_inputs(
        &self,
        given: &[(String, Tensor)],
        leaves: bool,
    ) -> Result<Vec<Tensor>, ExecError> {
        let mut slots: Vec<Option<Tensor>> = (0..self.inputs.len()).map(|_| None).collect();
        for (name, t) in given {
            let err = |reason: String| {
                ExecError::Stage(StageError::Input {
                    name: name.clone(),
                    reason,
                })
            };
            let Some(k) = self.inputs.iter().position(|i| i.name == *name) else {
                return Err(err(format!(
                    "not an input of this stage (expects {:?})",
                    self.input_names()
                )));
            };
            let spec = &self.inputs[k];
            if slots[k].is_some() {
                return Err(err("given twice".into()));
            }
            if !dtype_matches(spec.dtype, t.kind()) {
                return Err(err(format!(
                    "dtype {:?} where {:?} is expected",
                    t.kind(),
                    spec.dtype
                )));
            }
            if t.dim() != spec.rank {
                return Err(err(format!(
                    "rank {} (shape {:?}) where rank {} is expected",
                    t.dim(),
                    t.size(),
                    spec.rank
                )));
            }
            let mut t = t.f_to_device(self.device)?;
            if leaves && spec.requires_grad {
                t = t.f_detach()?.f_set_requires_grad(true)?;
            }
            slots[k] = Some(t);
        }
        slots
            .into_iter()
            .zip(&self.inputs)
            .map(|(t, i)| {
                t.ok_or_else(|| {
                    ExecError::Stage(StageError::Input {
                        name: i.name.clone(),
                        reason: "missing".into(),
                    })
                })
            })
            .collect()
    }

    /// Runs the nodes in order; returns the (still attached) outputs.
    fn run(
        &self,
        inputs: &[Tensor],
        train: bool,
        sample_offset: u64,
    ) -> Result<Vec<Tensor>, ExecError> {
        let mut local: Vec<Option<Tensor>> = (0..self.nodes.len()).map(|_| None).collect();
        for (k, node) in self.nodes.iter().enumerate() {
            let fail = |reason: String| ExecError::Op {
                node: node.name.clone(),
                op: node.op.name().to_string(),
                reason,
            };
            let args = node
                .inputs
                .iter()
                .map(|s| match *s {
                    Source::Input(i) => Ok(&inputs[i]),
                    Source::Param(i) => Ok(&self.params[i].tensor),
                    Source::Local(j) => local[j]
                        .as_ref()
                        .ok_or_else(|| fail("input released before use".into())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let ctx = OpContext {
                train,
                seed: self.step_seed,
                sample_offset,
                node: &node.name,
            };
            let out = ops::apply(&node.op, &args, &ctx).map_err(|e| match e {
                OpFailure::Torch(e) => fail(short(&e)),
                OpFailure::Invalid(reason) => fail(reason),
                OpFailure::Unsupported => ExecError::Unsupported {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                },
            })?;
            drop(args);
            local[k] = Some(out);
            for s in &node.inputs {
                if let Source::Local(j) = *s
                    && self.last_use[j] == k
                {
                    local[j] = None;
                }
            }
        }
        self.outputs
            .iter()
            .map(|(name, s)| match *s {
                Source::Input(i) => Ok(inputs[i].shallow_clone()),
                Source::Local(j) => {
                    local[j]
                        .as_ref()
                        .map(Tensor::shallow_clone)
                        .ok_or_else(|| ExecError::Output {
                            name: name.clone(),
                            reason: "not computed".into(),
                        })
                }
                Source::Param(_) => Err(ExecError::Output {
                    name: name.clone(),
                    reason: "parameters do not leave a stage".into(),
                }),
            })
            .collect()
    }
}

/// The stage's copy of parameter `p`, taken from the values `given`, on `device`.
fn stage_param(
    p: LayoutParam,
    given: &mut HashMap<String, Tensor>,
    device: Device,
) -> Result<StageParam, ExecError> {
    let err = |reason: String| {
        ExecError::Stage(StageError::Param {
            name: p.name.clone(),
            reason,
        })
    };
    let t = given
        .remove(&p.name)
        .ok_or_else(|| err("missing from the values given to the stage".into()))?;
    let shape: Vec<i64> = p.shape.iter().map(|&d| d as i64).collect();
    if t.size() != shape {
        return Err(err(format!(
            "shape {:?} differs from the graph's {:?}",
            t.size(),
            p.shape
        )));
    }
    if !dtype_matches(p.dtype, t.kind()) {
        return Err(err(format!(
            "dtype {:?} for a {:?} parameter",
            t.kind(),
            p.dtype
        )));
    }
    // A private copy: the optimizer and BatchNorm update it in place.
    let mut t = t.f_detach()?.f_to_device(device)?.f_detach_copy()?;
    if p.kind == ParamKind::Trainable {
        t = t.f_set_requires_grad(true)?;
    }
    Ok(StageParam {
        name: p.name,
        kind: p.kind,
        dtype: p.dtype,
        shape,
        tensor: t,
    })
}
