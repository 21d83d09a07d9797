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
//!
//! # Weight stashing (PipeDream-2BW) with weight prediction
//!
//! An executor made [`with_stash_weights`](TorchExecutor::with_stash_weights)
//! keeps the master weights of its trainable parameters (what the optimizer
//! updates and [`parameters`](TorchExecutor::parameters) gives) and two
//! forward versions: `Current`, the master weights extrapolated by the last
//! [`step`](TorchExecutor::step)'s update (`w + (w - w_before)`, the
//! `async` schedule's prediction of the update still to come), and
//! `Previous`, the `Current` before that step. All three are the same
//! tensors until a step, and again after
//! [`merge_versions`](TorchExecutor::merge_versions). A training forward
//! runs with the version asked for ([`forward_version`](TorchExecutor::forward_version))
//! and its backward accumulates into that version's autograd leaves, so a
//! micro-batch's backward always uses the weights its forward used. A step
//! may run while micro-batches on `Current` await backward: it sums the
//! pending gradients of both versions, applies them to a fresh copy of the
//! master weights (never in place, since in-flight graphs may have saved
//! those tensors), and the old `Current` becomes `Previous`; the first step
//! after a merge runs with nothing in flight and makes `Previous` the
//! master weights it made (the step after a barrier's runs with them). Buffers
//! (BatchNorm statistics) are one copy shared by every version.

mod activations;
pub mod loss;
mod ops;
pub mod optim;
pub mod reference;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use rookery_kernels::gemm::Precision;
use rookery_model::layout::{self, LayoutError, LayoutParam, Source, StageLayout};
use rookery_model::{DType, Graph, GraphError, Op, ParamKind};
pub use rookery_stage::{StageError, WeightVersion};
use tch::{Device, Kind, Tensor};

pub use activations::activation;
pub use loss::{LossOutput, loss_targets, micro_batch_loss, scaled_loss};
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
    /// The `Current` weights (for a trainable parameter, an autograd leaf).
    tensor: Tensor,
    /// The master weights of a trainable parameter under weight stashing
    /// when they differ from `Current` (after a step); None while they are
    /// `tensor` itself.
    master: Option<Tensor>,
    /// The `Previous` weights of a trainable parameter under weight
    /// stashing; None while they are `tensor` itself (always for buffers and
    /// without stashing).
    previous: Option<Tensor>,
    /// The gradient of `previous` that a step already applied and then
    /// zeroed in place (micro-batches in flight had recorded that leaf, so it
    /// could not be replaced), with its version counter after the zeroing:
    /// while both still match, no backward has added to it since, and it
    /// counts as no gradient at all.
    spent: Option<(Tensor, i64)>,
}

/// What backward needs of one micro-batch.
#[derive(Debug)]
struct InFlight {
    /// The autograd leaves made from inputs that require grad (None otherwise).
    leaves: Vec<Option<Tensor>>,
    /// Outputs still attached to the stage's graph.
    outputs: Vec<Tensor>,
    /// The generation of the weights the forward ran with (see
    /// `TorchExecutor::generation`).
    generation: u64,
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
    /// Weight stashing (PipeDream-2BW), see the module docs.
    stash_weights: bool,
    /// How matrix products compute (the job's `precision`).
    precision: Precision,
    /// A step with stashing ran since the last merge: `Previous` weights
    /// (of generation `generation - 1`) are distinct from `Current` ones.
    has_previous: bool,
    /// Counts the steps taken with stashing: the `Current` weights are of
    /// this generation, `Previous` ones (when distinct) of the one before.
    generation: u64,
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
            stash_weights: false,
            precision: Precision::F32,
            has_previous: false,
            generation: 0,
        })
    }

    /// Turns weight stashing (PipeDream-2BW, see the module docs) on or off
    /// for a new executor.
    pub fn with_stash_weights(mut self, stash_weights: bool) -> Self {
        self.stash_weights = stash_weights;
        self
    }

    /// The same executor computing its matrix products in `precision`:
    /// under [`Precision::Mixed`] exactly what our kernels do (operands and
    /// output gradients rounded to f16), so stages agree across backends.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    pub fn stash_weights(&self) -> bool {
        self.stash_weights
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
        self.forward_version(inputs, train, sample_offset, WeightVersion::Current)
    }

    /// [`forward_at`](Self::forward_at) with the weights of `version`; the
    /// micro-batch's backward uses the same. `Previous` is `Current` when no
    /// step ran since the last [`merge_versions`](Self::merge_versions), and
    /// always without weight stashing (such an executor has one version).
    pub fn forward_version(
        &mut self,
        inputs: &[(String, Tensor)],
        train: bool,
        sample_offset: u64,
        version: WeightVersion,
    ) -> Result<TorchForward, ExecError> {
        let previous = version == WeightVersion::Previous && self.has_previous;
        let generation = self.generation - u64::from(previous);
        let placed = self.place_inputs(inputs, true)?;
        let batch = placed
            .first()
            .and_then(|t| t.size().first().copied())
            .unwrap_or(1)
            .max(0) as u64;
        // Autograd must record even if the caller sits inside `no_grad`.
        let outputs = tch::with_grad(|| self.run(&placed, train, sample_offset, previous))?;
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
        self.in_flight.insert(
            id,
            InFlight {
                leaves,
                outputs,
                generation,
            },
        );
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
        let outputs = tch::no_grad(|| self.run(&placed, false, 0, false))?;
        Ok(self
            .outputs
            .iter()
            .map(|(n, _)| n.clone())
            .zip(outputs)
            .collect())
    }

    /// Drops a micro-batch's saved state without backpropagating it.
    pub fn discard(&mut self, micro_batch: TorchMicroBatch) -> Result<(), ExecError> {
        self.take_in_flight(micro_batch).map(|_| ())
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
        let saved = self.saved(micro_batch)?;
        let mut seen = vec![false; self.outputs.len()];
        let mut terms = Vec::new();
        for (name, g) in output_grads {
            let grad_err = |reason: String| {
                ExecError::Stage(StageError::Grad {
                    name: name.clone(),
                    reason,
                })
            };
            let k = self.output_index(name)?;
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
        let saved = self.take_in_flight(micro_batch)?;
        let total = match terms.split_first() {
            Some((first, rest)) => {
                let mut total = first.shallow_clone();
                for t in rest {
                    total = total.f_add(t)?;
                }
                Some(total)
            }
            None => None,
        };
        self.backpropagate(saved, total)
    }

    /// The Leaf's [`backward`](Self::backward) in one autograd pass: `loss`
    /// computes a scalar from the micro-batch's output `output` as the
    /// forward recorded it (still attached to the stage's graph), and that
    /// scalar is backpropagated through the stage, rather than its gradient
    /// for the output computed in a pass of its own and then fed to
    /// `backward`. The gradients are the same to the bit (the output's
    /// gradient reaches the stage's graph unchanged either way); a small
    /// micro-batch saves an autograd pass and the ops that seed it. Returns
    /// what `loss` returned beside its scalar, and the inputs' gradients.
    pub fn backward_from_loss<T>(
        &mut self,
        micro_batch: TorchMicroBatch,
        output: &str,
        loss: impl FnOnce(&Tensor) -> Result<(Tensor, T), ExecError>,
    ) -> Result<(T, Vec<(String, Tensor)>), ExecError> {
        let saved = self.saved(micro_batch)?;
        let k = self.output_index(output)?;
        let (scalar, value) = loss(&saved.outputs[k])?;
        let saved = self.take_in_flight(micro_batch)?;
        let grads = self.backpropagate(saved, scalar.requires_grad().then_some(scalar))?;
        Ok((value, grads))
    }

    /// Where output `name` is in the stage's outputs, for a gradient or a
    /// loss that names it.
    fn output_index(&self, name: &str) -> Result<usize, ExecError> {
        self.outputs
            .iter()
            .position(|(o, _)| o == name)
            .ok_or_else(|| {
                ExecError::Stage(StageError::Grad {
                    name: name.to_string(),
                    reason: "not an output of this stage".into(),
                })
            })
    }

    fn saved(&self, micro_batch: TorchMicroBatch) -> Result<&InFlight, ExecError> {
        self.in_flight
            .get(&micro_batch)
            .ok_or(ExecError::Stage(StageError::UnknownMicroBatch(
                micro_batch.0,
            )))
    }

    fn take_in_flight(&mut self, micro_batch: TorchMicroBatch) -> Result<InFlight, ExecError> {
        self.in_flight
            .remove(&micro_batch)
            .ok_or(ExecError::Stage(StageError::UnknownMicroBatch(
                micro_batch.0,
            )))
    }

    /// Backpropagates `total` (none: nothing depends on the inputs) and
    /// returns the gradients of `saved`'s inputs, zeros where none arrived.
    fn backpropagate(
        &self,
        saved: InFlight,
        total: Option<Tensor>,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        if let Some(total) = total {
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
    ///
    /// With weight stashing the gradients of both versions' backwards are
    /// summed and update a fresh copy of the `Current` weights, which becomes
    /// `Current`; the old `Current` becomes `Previous` and the old `Previous`
    /// is dropped. Micro-batches in flight on the old `Current` keep it (their
    /// backward lands in the new `Previous` and counts toward the next step);
    /// one in flight on the old `Previous` is refused, as its weights would go.
    /// Where micro-batches are in flight the old `Current` leaves keep their
    /// identity, so their gradients are zeroed in place rather than dropped;
    /// a zeroed gradient nothing adds to before the next step still counts as
    /// none (told by its version counter), as PyTorch's would be None.
    pub fn step(&mut self, optimizer: &mut TorchOptimizer) -> Result<(), ExecError> {
        if self.stash_weights {
            return self.step_stashed(optimizer);
        }
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

    fn step_stashed(&mut self, optimizer: &mut TorchOptimizer) -> Result<(), ExecError> {
        // The first step after a merge: the next step runs with its update.
        let first = !self.has_previous;
        if first {
            self.idle("the first step after a barrier (the next step runs with its update)")?;
        }
        self.none_on_previous("stepping, which drops the weights they ran with,")?;
        let recorded = !self.in_flight.is_empty();
        for p in &mut self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            // Detached first: a copy of a leaf would be a non-leaf result.
            let base = p.master().f_detach()?;
            let next = base.f_detach_copy()?;
            if let Some(g) = p.pending_grad()? {
                optimizer.update(&p.name, &next, &g)?;
            }
            // `rookery_stage::extrapolate`'s arithmetic, element by element.
            let predicted = next.f_add(&next.f_sub(&base)?)?;
            p.master = Some(next);
            let old = std::mem::replace(&mut p.tensor, predicted.f_set_requires_grad(true)?);
            p.spent = None;
            p.previous = Some(if first {
                // A copy: `master` alone may change in place (parameters
                // loaded).
                p.master().f_detach_copy()?.f_set_requires_grad(true)?
            } else if recorded {
                // In-flight graphs recorded these leaves: their gradients,
                // just applied, are cleared without replacing them.
                let mut g = old.f_grad()?;
                if g.defined() {
                    let _ = tch::no_grad(|| g.f_zero_())?;
                    let version = g.f_internal_version()?;
                    p.spent = Some((g, version));
                }
                old
            } else {
                old.f_detach()?.f_set_requires_grad(true)?
            });
        }
        self.generation += 1;
        self.has_previous = true;
        Ok(())
    }

    /// Makes both forward versions the master weights (a barrier: the next
    /// step runs with them, unextrapolated). Gradients that backwards
    /// accumulated since the last step move to the new `Current`'s, for the
    /// next step. Refused while a micro-batch awaits backward on weights
    /// this replaces; a no-op without stashing.
    pub fn merge_versions(&mut self) -> Result<(), ExecError> {
        let action = "merging the weight versions, which drops the weights they ran with,";
        if self.params.iter().any(|p| p.master.is_some()) {
            self.idle(action)?;
        } else {
            self.none_on_previous(action)?;
        }
        for p in &mut self.params {
            let Some(previous) = p.previous.take() else {
                continue;
            };
            let spent = p.spent.take();
            let g = previous.f_grad()?;
            if g.defined() && !is_spent(spent.as_ref(), &g)? {
                add_grad(&p.tensor, &g)?;
            }
            if let Some(master) = p.master.take() {
                let pending = p.tensor.f_grad()?;
                p.tensor = master.f_set_requires_grad(true)?;
                if pending.defined() {
                    add_grad(&p.tensor, &pending)?;
                }
            }
        }
        self.has_previous = false;
        Ok(())
    }

    /// The sum of the squares of every accumulated gradient element, in f64,
    /// parameter by parameter in the stage's order, read on the host so the
    /// order (and so the sum) is the same on every device and backend. With
    /// weight stashing, of the gradient a step would apply (both versions').
    pub fn grad_sum_of_squares(&self) -> Result<f64, ExecError> {
        let mut acc = 0.0;
        for p in &self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            if let Some(g) = p.pending_grad()? {
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

    /// Multiplies every accumulated gradient (of both versions, with weight
    /// stashing) by `scale` rounded to f32, as `clip_grad_norm_`'s
    /// `grad.mul_(clip_coef)`; 1 changes nothing.
    pub fn scale_grads(&mut self, scale: f64) -> Result<(), ExecError> {
        let scale = f64::from(scale as f32);
        if scale == 1.0 {
            return Ok(());
        }
        for p in &self.params {
            if p.kind != ParamKind::Trainable {
                continue;
            }
            for mut g in p.pending_grads()? {
                let _ = tch::no_grad(|| g.f_mul_scalar_(scale))?;
            }
        }
        Ok(())
    }

    /// Drops accumulated gradients (of both versions). A parameter becomes a
    /// fresh leaf sharing its storage, which is PyTorch's
    /// `zero_grad(set_to_none=True)`: tch cannot set `.grad` back to None
    /// otherwise, and a zeroed gradient would still move momentum and weight
    /// decay for parameters that got none.
    pub fn zero_grad(&mut self) -> Result<(), ExecError> {
        self.idle("clearing gradients")?;
        for p in &mut self.params {
            if p.kind == ParamKind::Trainable {
                p.tensor = p.tensor.f_detach()?.f_set_requires_grad(true)?;
                if let Some(previous) = &p.previous {
                    p.previous = Some(previous.f_detach()?.f_set_requires_grad(true)?);
                }
                p.spent = None;
            }
        }
        Ok(())
    }

    /// Copies of every parameter and buffer (the master weights), by name
    /// (for sync and averaging).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.master().f_detach_copy()?)))
            .collect()
    }

    /// Accumulated gradients of the trainable parameters that have one (with
    /// weight stashing, the sum of both versions', as a step applies them).
    pub fn gradients(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        let mut out = Vec::new();
        for p in &self.params {
            if let Some(g) = p.pending_grad()? {
                out.push((p.name.clone(), g.f_detach_copy()?));
            }
        }
        Ok(out)
    }

    /// Loads values (e.g. the server's average) into some or all of the stage's
    /// parameters and buffers, in place, keeping gradients and optimizer state.
    /// With weight stashing these are the master and the `Current` weights,
    /// and `Previous` too while they are the same (after
    /// [`merge_versions`](Self::merge_versions)).
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
            if let Some(master) = &p.master {
                tch::no_grad(|| master.shallow_clone().f_copy_(&v))?;
            }
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

    /// Refuses `action` while micro-batches that ran on distinct `Previous`
    /// weights await backward (it would drop those weights, and the
    /// gradients their backward would bring).
    fn none_on_previous(&self, action: &str) -> Result<(), ExecError> {
        let on_previous = self
            .in_flight
            .values()
            .filter(|f| f.generation != self.generation)
            .count();
        if on_previous == 0 {
            Ok(())
        } else {
            Err(ExecError::Stage(StageError::InFlight {
                in_flight: on_previous,
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

    /// Runs the nodes in order with the `Current` weights, or the `Previous`
    /// ones (`previous`); returns the (still attached) outputs.
    fn run(
        &self,
        inputs: &[Tensor],
        train: bool,
        sample_offset: u64,
        previous: bool,
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
                    Source::Param(i) => {
                        let p = &self.params[i];
                        Ok(match &p.previous {
                            Some(t) if previous => t,
                            _ => &p.tensor,
                        })
                    }
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
                precision: self.precision,
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

/// Adds `g` to leaf `w`'s gradient: tch cannot assign `.grad`, and d/dw of
/// sum(w * g) is g, exactly (added to a defined gradient as `add_` would).
fn add_grad(w: &Tensor, g: &Tensor) -> Result<(), ExecError> {
    let mut current = w.f_grad()?;
    if current.defined() {
        let _ = tch::no_grad(|| current.f_add_(g))?;
    } else {
        let g = g.f_detach()?;
        tch::with_grad(|| w.f_mul(&g)?.f_sum(None::<Kind>)?.f_backward())?;
    }
    Ok(())
}

impl StageParam {
    /// The master weights: what the optimizer updates and syncs read.
    fn master(&self) -> &Tensor {
        self.master.as_ref().unwrap_or(&self.tensor)
    }

    /// The gradients accumulated since the last step: `Current`'s, and
    /// `Previous`'s where that is a distinct leaf whose gradient is not one a
    /// step already applied.
    fn pending_grads(&self) -> Result<Vec<Tensor>, ExecError> {
        let mut out = Vec::new();
        let g = self.tensor.f_grad()?;
        if g.defined() {
            out.push(g);
        }
        if let Some(previous) = &self.previous {
            let g = previous.f_grad()?;
            if g.defined() && !is_spent(self.spent.as_ref(), &g)? {
                out.push(g);
            }
        }
        Ok(out)
    }

    /// The gradient a step applies: the sum of the pending ones (one of them
    /// as it is), None where there is none.
    fn pending_grad(&self) -> Result<Option<Tensor>, ExecError> {
        let mut grads = self.pending_grads()?.into_iter();
        let Some(mut sum) = grads.next() else {
            return Ok(None);
        };
        for g in grads {
            sum = sum.f_add(&g)?;
        }
        Ok(Some(sum))
    }
}

/// Whether gradient `g` is still the `spent` one: the same tensor (its
/// storage kept alive by `spent`, so no other can take its address) at the
/// same version, so no backward has added to it since it was zeroed.
fn is_spent(spent: Option<&(Tensor, i64)>, g: &Tensor) -> Result<bool, ExecError> {
    Ok(match spent {
        Some((t, version)) => t.data_ptr() == g.data_ptr() && g.f_internal_version()? == *version,
        None => false,
    })
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
        previous: None,
        master: None,
        spent: None,
    })
}
