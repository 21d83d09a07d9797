//! One provider's share of a training job, whatever computes it: a
//! [`StageWorker`] turns the server's training messages into calls on a
//! [`Backend`] (our own executor here, on a GPU or the CPU references; the
//! libtorch one in `rookery-provider`) and answers with the messages the
//! server relays on (`rookery_proto::train` describes the exchange).
//!
//! The server relies on these rules:
//! - a stage counts a step's micro-batches as `torch.chunk` (and
//!   `rookery_job::micro_batch_ranges`) does: `chunk = ceil(step_samples /
//!   micro_batches)`, `count = ceil(step_samples / chunk)`, micro-batch `m`
//!   holding samples `m * chunk ..`; dropout masks are seeded by
//!   [`step_seed`] and those sample positions;
//! - once a stage has run backward for all of a step's micro-batches it steps
//!   its optimizer and sends `StepDone`, after the last micro-batch's
//!   `Gradients`; in a job that clips it first sends `GradNorm` and steps
//!   when `GradScale` comes back. The learning rate of step `s` is the
//!   assignment's `lr_schedule` at `s`, on the optimizer's `lr`;
//! - `UploadParams` is answered with the optimizer state, then the
//!   parameters;
//! - under the `1f1b` schedule, stage `s` of `S` (not the Leaf) holds at
//!   most `S - s` micro-batches run forward and not yet backward: a
//!   training `Forward` beyond that waits, in order, until a `Backward`
//!   frees one. Forwards and backwards each still run in the order they
//!   came, so the arithmetic is `gpipe`'s exactly;
//! - under `async` (PipeDream-2BW with weight prediction) a stage may have
//!   two steps open, with no hold-back. Step `k` runs with the weights that
//!   every update up to step `k - 2` made, extrapolated by step `k - 2`'s
//!   own update (`w + (w - w_before)`: the update step `k - 1` has yet to
//!   make, predicted as the last one; the backend keeps that version for
//!   the micro-batch's backward, [`WeightVersion`]). A barrier's step `b`
//!   (after an `Assign`, an `UploadParams`, a `SetParams`) runs with the
//!   barrier's weights, and step `b + 1` waits for its update and runs with
//!   what it made (as `Previous`): there is no update before `b` to
//!   extrapolate, and a step on stale weights unextrapolated cost the
//!   example GPT more than the rest of the delay. Backwards and updates
//!   still come in step order, so one
//!   gradient buffer serves, and the result does not depend on timing;
//! - after `JobFailed` the stage is gone: later messages for that job get
//!   `JobFailed` again, until a new `Assign`.
//!
//! Every failure (a bad assignment, a tensor of the wrong shape, a device
//! error, a message that does not fit the stage's state) becomes
//! `ToServer::JobFailed`; nothing a server sends can panic it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Display;
use std::future::Future;

use rookery_model::{Graph, Loss, LrSchedule, OptimizerConfig};
use rookery_proto::{
    Activations, Assignment, Backward, Forward, GradNorm, GradScale, Gradients, LeafLoss,
    OptimizerState, ParamOptimState, ParamSet, Phase, PipelineSchedule, StepDone, ToProvider,
    ToServer, WireDType, WireTensor,
};

/// The dropout seed of step `step` of a job seeded `job_seed`: every stage of
/// every cluster derives its masks from it (and each sample's position in
/// the step's batch), and so must any single-process reference run that is
/// to reproduce a distributed one.
///
/// It is SplitMix64's output function applied to
/// `job_seed ^ (step * 0x9E37_79B9_7F4A_7C15)` (wrapping): consecutive steps
/// get unrelated seeds, and jobs with nearby seeds do not share steps' masks.
pub fn step_seed(job_seed: u64, step: u64) -> u64 {
    let mut z = job_seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a stage needs to be built, decoded from an `Assign`.
pub struct StageSpec<'a> {
    pub graph: &'a Graph,
    pub range: std::ops::Range<usize>,
    pub outputs: &'a [String],
    pub params: &'a [WireTensor],
    pub optimizer: OptimizerConfig,
    pub optimizer_state: &'a [ParamOptimState],
    /// The `async` schedule: the backend keeps master weights apart from
    /// two forward versions ([`WeightVersion`]), and [`Backend::step`] may
    /// run while micro-batches that ran forward still await their backward.
    pub stash_weights: bool,
    /// How activations and gradients travel (the job's `wire_dtype`, and
    /// whether the stage sends its outputs), for backends that ready them
    /// on their device.
    pub wire: crate::StageWire,
    /// How the stage's matrix products compute (the job's `precision`).
    pub precision: rookery_model::Precision,
}

/// Which of a stage's two forward weight versions a training forward runs
/// with (its backward uses the same). `Current` is the master weights
/// extrapolated by the last [`Backend::step`]'s update (`w + (w -
/// w_before)`, [`crate::extrapolate`]), or the master weights themselves
/// when there was no step since the last [`Backend::merge_versions`];
/// `Previous` is the `Current` before the last step, except after the
/// first step since a merge: then it is the master weights that step made
/// (nothing ran on the merged weights' successor yet). Only the `async`
/// schedule asks for `Previous`; without `StageSpec::stash_weights` both
/// are the one set of weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightVersion {
    Current,
    Previous,
}

/// The loss of one micro-batch on the Leaf.
pub struct LeafLossValue<T> {
    /// The micro-batch's summed per-target loss, as `LeafLoss::loss_sum`.
    pub sum: f64,
    /// The gradient of its share of the step's mean loss (`sum /
    /// step_targets`) w.r.t. the output.
    pub grad: T,
}

/// One stage's computation, as the worker drives it: tensors in the
/// backend's own form (`Tensor`), converted from and to the wire by the
/// backend, so nothing is lost on the way (i64 buffers stay i64). Futures
/// are awaited one at a time; a synchronous backend returns ready ones.
pub trait Backend {
    type MicroBatch: Copy + std::fmt::Debug;
    type Tensor;
    type Error: Display;

    fn param_names(&self) -> Vec<String>;
    fn set_step_seed(&mut self, seed: u64);
    /// A wire tensor as the backend's own, refusing non-finite floats.
    fn decode(&self, t: &WireTensor) -> Result<Self::Tensor, Self::Error>;
    /// Floats as `dtype`; integer tensors as i64.
    fn encode(
        &self,
        name: &str,
        t: &Self::Tensor,
        dtype: WireDType,
    ) -> Result<WireTensor, Self::Error>;
    /// Dimension 0 (the batch), if the tensor has one.
    fn samples(&self, t: &Self::Tensor) -> Option<usize>;
    /// A training forward of a micro-batch whose first sample is `offset` in
    /// the step's batch, with the weights of `version`; keeps what backward
    /// needs (those weights included).
    #[allow(clippy::type_complexity)]
    fn forward(
        &mut self,
        inputs: &[(String, Self::Tensor)],
        offset: u64,
        version: WeightVersion,
    ) -> impl Future<Output = Result<(Self::MicroBatch, Vec<(String, Self::Tensor)>), Self::Error>>;
    fn evaluate(
        &mut self,
        inputs: &[(String, Self::Tensor)],
    ) -> impl Future<Output = Result<Vec<(String, Self::Tensor)>, Self::Error>>;
    fn backward(
        &mut self,
        micro_batch: Self::MicroBatch,
        grads: &[(String, Self::Tensor)],
    ) -> impl Future<Output = Result<Vec<(String, Self::Tensor)>, Self::Error>>;
    /// The sum of the squares of every element of the parameter gradients
    /// accumulated since the last step, in f64, parameter by parameter in
    /// the stage's order ([`rookery_model::sum_of_squares`]).
    fn grad_sum_of_squares(&mut self) -> impl Future<Output = Result<f64, Self::Error>>;
    /// Multiplies the accumulated gradients by `grad_scale` (as f32; 1 leaves
    /// them alone), then steps the optimizer with learning rate `lr`.
    ///
    /// With `StageSpec::stash_weights` the gradients (from backwards of
    /// either version) update the master weights, the new `Current` is
    /// their extrapolation by this update, the old `Current` becomes
    /// `Previous` and the old `Previous` is dropped. Micro-batches in flight
    /// (all of the old `Current`) keep the weights their forward used. The
    /// first step after a merge runs with nothing in flight, and makes
    /// `Previous` the master weights it made.
    fn step(&mut self, lr: f64, grad_scale: f64) -> impl Future<Output = Result<(), Self::Error>>;
    /// Makes both forward versions the master weights (a barrier: a sync
    /// or new parameters); nothing is in flight. A no-op without
    /// `StageSpec::stash_weights`.
    fn merge_versions(&mut self) -> Result<(), Self::Error>;
    /// Every parameter and buffer (the master weights), floats as f32.
    fn parameters(&mut self) -> impl Future<Output = Result<Vec<WireTensor>, Self::Error>>;
    fn set_parameters(&mut self, values: &[WireTensor]) -> Result<(), Self::Error>;
    fn optimizer_state(
        &mut self,
    ) -> impl Future<Output = Result<Vec<ParamOptimState>, Self::Error>>;
    /// Replaces the optimizer state of the parameters named (what
    /// [`Backend::optimizer_state`] gave, averaged over clusters at a sync);
    /// the others keep theirs.
    fn set_optimizer_state(&mut self, states: &[ParamOptimState]) -> Result<(), Self::Error>;
    /// The Leaf's loss of output `y` against `labels` in a step whose mean
    /// divides by `step_targets` (`Forward::step_targets`).
    fn leaf_loss(
        &self,
        loss: Loss,
        y: &Self::Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> Result<LeafLossValue<Self::Tensor>, Self::Error>;
    /// The Leaf's training micro-batch after its forward: the loss of its
    /// output `output` (`y`) against `labels`, as [`Backend::leaf_loss`],
    /// backpropagated through the stage, as [`Backend::backward`] with that
    /// loss's gradient; returns the summed loss and the inputs' gradients.
    /// A backend that can run both in one autograd pass overrides it.
    #[allow(clippy::type_complexity)]
    fn leaf_backward(
        &mut self,
        micro_batch: Self::MicroBatch,
        loss: Loss,
        output: &str,
        y: &Self::Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> impl Future<Output = Result<(f64, Vec<(String, Self::Tensor)>), Self::Error>> {
        async move {
            let value = self.leaf_loss(loss, y, labels, step_targets)?;
            let grads = self
                .backward(micro_batch, &[(output.to_string(), value.grad)])
                .await?;
            Ok((value.sum, grads))
        }
    }
    /// The summed per-target loss of an evaluation micro-batch.
    fn loss_sum(
        &self,
        loss: Loss,
        y: &Self::Tensor,
        labels: &WireTensor,
    ) -> Result<f64, Self::Error>;
    /// Counted labels (cross-entropy's, `ignore_index` aside) whose first
    /// highest logit is the label.
    fn correct(
        &self,
        loss: Loss,
        y: &Self::Tensor,
        labels: &WireTensor,
    ) -> Result<u64, Self::Error>;
}

/// Builds backends for assignments.
pub trait BackendFactory {
    type Backend: Backend;

    fn build(&mut self, spec: StageSpec<'_>) -> Result<Self::Backend, String>;
}

/// Runs at most one stage of one job at a time.
pub struct StageWorker<F: BackendFactory> {
    factory: F,
    stage: Option<Stage<F::Backend>>,
    /// The job whose stage was dropped after a failure, and why.
    failed: Option<(u64, String)>,
}

impl<F: BackendFactory> StageWorker<F> {
    pub fn new(factory: F) -> Self {
        Self {
            factory,
            stage: None,
            failed: None,
        }
    }

    pub fn factory(&self) -> &F {
        &self.factory
    }

    /// The job whose stage this worker holds, if any.
    pub fn job_id(&self) -> Option<u64> {
        self.stage.as_ref().map(|s| s.job_id)
    }

    /// `(stage index, stages, micro-batches done)` of the stage held now.
    pub fn progress(&self) -> Option<(u32, u32, u64)> {
        self.stage
            .as_ref()
            .map(|s| (s.index, s.stages, s.micro_batches_done))
    }

    /// Handles one training message; see the module docs for the replies.
    /// Session messages (`Welcome`, `Heartbeat`, `Error`, `Probe`) get none.
    pub async fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        let Some(job_id) = job_of(&message) else {
            return Vec::new();
        };
        let what = describe(&message);
        match message {
            ToProvider::Assign(a) => self.assign(*a),
            ToProvider::Release { job_id } => {
                if self.job_id() == Some(job_id) {
                    self.stage = None;
                }
                if matches!(&self.failed, Some((id, _)) if *id == job_id) {
                    self.failed = None;
                }
                Vec::new()
            }
            message => {
                let stage = match &mut self.stage {
                    Some(stage) if stage.job_id == job_id => stage,
                    Some(stage) => {
                        return failed(
                            job_id,
                            format!(
                                "{what} is for job {job_id}, but this provider holds a stage of job {}",
                                stage.job_id
                            ),
                        );
                    }
                    None => {
                        let message = match &self.failed {
                            Some((id, reason)) if *id == job_id => format!(
                                "{what}: the stage of job {job_id} was dropped after an earlier failure: {reason}"
                            ),
                            _ => format!(
                                "{what} for job {job_id} arrived, but no stage is assigned to this provider (no Assign yet, or the stage was released)"
                            ),
                        };
                        return failed(job_id, message);
                    }
                };
                let mut out = Vec::new();
                if let Err(error) = stage.handle(message, &mut out).await {
                    let reason = format!("{}: {what}: {error}", stage.describe());
                    // A half-done step cannot be trusted, so the stage goes.
                    self.stage = None;
                    self.failed = Some((job_id, reason.clone()));
                    out.push(ToServer::JobFailed {
                        job_id,
                        message: reason,
                    });
                }
                out
            }
        }
    }

    fn assign(&mut self, a: Assignment) -> Vec<ToServer> {
        // The server is the source of truth: a new assignment replaces
        // whatever this worker held.
        self.stage = None;
        self.failed = None;
        let job_id = a.job_id;
        let title = format!(
            "cannot build stage {} of {} (nodes {}..{}) of job {job_id}, cluster {}",
            a.stage, a.stages, a.first, a.end, a.cluster
        );
        match Stage::build(a, &mut self.factory) {
            Ok(stage) => {
                self.stage = Some(stage);
                vec![ToServer::Ready { job_id }]
            }
            Err(error) => {
                let reason = format!("{title}: {error}");
                self.failed = Some((job_id, reason.clone()));
                failed(job_id, reason)
            }
        }
    }
}

/// The job a training message belongs to (`None` for session messages).
pub fn job_of(message: &ToProvider) -> Option<u64> {
    match message {
        ToProvider::Assign(a) => Some(a.job_id),
        ToProvider::Forward(f) => Some(f.job_id),
        ToProvider::Backward(b) => Some(b.job_id),
        ToProvider::UploadParams { job_id, .. } | ToProvider::Release { job_id } => Some(*job_id),
        ToProvider::SetParams(p) => Some(p.job_id),
        ToProvider::SetOptimizerState(o) => Some(o.job_id),
        ToProvider::GradScale(g) => Some(g.job_id),
        ToProvider::Welcome { .. }
        | ToProvider::Heartbeat { .. }
        | ToProvider::Error(_)
        | ToProvider::Probe { .. }
        | ToProvider::Credit { .. } => None,
    }
}

fn failed(job_id: u64, message: String) -> Vec<ToServer> {
    vec![ToServer::JobFailed { job_id, message }]
}

/// Names a message for error texts.
fn describe(message: &ToProvider) -> String {
    match message {
        ToProvider::Forward(f) => match f.phase {
            Phase::Train { step } => format!("Forward of micro-batch {} of step {step}", f.micro),
            Phase::Eval { epoch } => {
                format!(
                    "eval Forward of micro-batch {} after epoch {epoch}",
                    f.micro
                )
            }
        },
        ToProvider::Backward(b) => {
            format!("Backward of micro-batch {} of step {}", b.micro, b.step)
        }
        ToProvider::UploadParams { step, .. } => format!("UploadParams at step {step}"),
        ToProvider::SetParams(p) => format!("SetParams at step {}", p.step),
        ToProvider::SetOptimizerState(o) => format!("SetOptimizerState at step {}", o.step),
        ToProvider::GradScale(g) => format!("GradScale of step {}", g.step),
        ToProvider::Assign(_) => "Assign".into(),
        ToProvider::Release { .. } => "Release".into(),
        ToProvider::Welcome { .. } => "Welcome".into(),
        ToProvider::Heartbeat { .. } => "Heartbeat".into(),
        ToProvider::Error(_) => "Error".into(),
        ToProvider::Probe { .. } => "Probe".into(),
        ToProvider::Credit { .. } => "Credit".into(),
    }
}

/// Why a message could not be carried out; its text goes into `JobFailed`.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerError(pub(crate) String);

impl Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn protocol(message: impl Into<String>) -> WorkerError {
    WorkerError(message.into())
}

fn backend<E: Display>(error: E) -> WorkerError {
    WorkerError(error.to_string())
}

/// Refuses parameters or optimizer state sent quantized: int8 is lossy, for
/// activations and gradients only.
fn refuse_quantized<'a>(
    tensors: impl IntoIterator<Item = &'a WireTensor>,
) -> Result<(), WorkerError> {
    match tensors.into_iter().find(|t| t.dtype.is_quantized()) {
        Some(t) => Err(protocol(format!(
            "`{}` is {}, which carries only activations and gradients",
            t.name,
            t.dtype.as_str()
        ))),
        None => Ok(()),
    }
}

/// The stage of one assignment and where it stands in the current step.
struct Stage<B: Backend> {
    job_id: u64,
    cluster: u32,
    index: u32,
    stages: u32,
    first: u32,
    end: u32,
    exec: B,
    loss: Loss,
    wire_dtype: WireDType,
    seed: u64,
    micro_batches: u32,
    /// The Leaf's single output, which the loss reads.
    leaf_output: Option<String>,
    /// The lowest step not done yet.
    next_step: u64,
    /// Steps begun and not done, oldest first: at most one, or two under
    /// `async`.
    steps: Vec<StepState<B::MicroBatch>>,
    /// Training forwards waiting for the schedule to let the stage hold
    /// another, in the order they came (with their steps).
    deferred: VecDeque<(u64, Forward)>,
    schedule: PipelineSchedule,
    /// The first step since the last barrier (assignment, sync or new
    /// parameters): under `async` it and the step after it run with the
    /// barrier's weights, so a resumed run replays exactly.
    barrier_step: u64,
    /// The step whose dropout seed the backend holds.
    seeded: Option<u64>,
    micro_batches_done: u64,
    /// The optimizer's `lr`, which the schedule scales.
    base_lr: f64,
    lr_schedule: LrSchedule,
    clip_grad_norm: Option<f64>,
    /// The most micro-batches the schedule lets it hold (`None`: all).
    hold_limit: Option<usize>,
    /// With int8 syncs (`Assignment::sync_int8`): the f32 parameters as
    /// the server last gave them, which uploads are changes from.
    sync_base: Option<BTreeMap<String, WireTensor>>,
}

struct StepState<M> {
    step: u64,
    samples: u32,
    chunk: u32,
    count: u32,
    forwarded: BTreeSet<u32>,
    /// Micro-batches run forward and awaiting Backward (never on the Leaf,
    /// which backpropagates at once).
    in_flight: BTreeMap<u32, M>,
    /// The most micro-batches held at once (of any step).
    peak_held: u32,
    finished: u32,
    compute_ms: f64,
    /// Every micro-batch is done and the `GradNorm` went out: the step waits
    /// for `GradScale`.
    awaiting_scale: bool,
}

impl<B: Backend> Stage<B> {
    fn build<F: BackendFactory<Backend = B>>(
        a: Assignment,
        factory: &mut F,
    ) -> Result<Self, WorkerError> {
        if a.stages == 0 || a.stage >= a.stages {
            return Err(protocol(format!(
                "stage index {} is not in a chain of {} stages",
                a.stage, a.stages
            )));
        }
        if !a.wire_dtype.is_float() {
            return Err(protocol(format!(
                "wire dtype {} cannot carry activations and gradients (use f32, f16, bf16 or int8)",
                a.wire_dtype.as_str()
            )));
        }
        refuse_quantized(
            a.params
                .iter()
                .chain(a.optimizer_state.iter().flat_map(|p| &p.slots)),
        )?;
        let graph = Graph::from_json(&a.graph_json)
            .map_err(|e| protocol(format!("the model graph JSON does not parse: {e}")))?;
        let leaf = a.stage + 1 == a.stages;
        if leaf && a.outputs.len() != 1 {
            return Err(protocol(format!(
                "the Leaf needs exactly one output for the loss, got {:?}",
                a.outputs
            )));
        }
        let leaf_output = leaf.then(|| a.outputs[0].clone());
        if !a.lr_schedule.is_resolved() {
            return Err(protocol(format!(
                "the learning-rate schedule {:?} has no total_steps",
                a.lr_schedule
            )));
        }
        if let Some(n) = a.clip_grad_norm
            && !(n > 0.0 && n.is_finite())
        {
            return Err(protocol(format!(
                "clip_grad_norm {n} is not a positive number"
            )));
        }
        if a.schedule.is_async() && a.clip_grad_norm.is_some() {
            return Err(protocol(
                "the async schedule cannot clip gradients: a step's update would wait for the whole cluster's norm while the next step's backwards arrive",
            ));
        }
        let exec = factory
            .build(StageSpec {
                graph: &graph,
                range: a.first as usize..a.end as usize,
                outputs: &a.outputs,
                params: &a.params,
                optimizer: a.optimizer,
                optimizer_state: &a.optimizer_state,
                stash_weights: a.schedule.is_async(),
                precision: a.precision,
                wire: crate::StageWire {
                    dtype: a.wire_dtype,
                    sends_outputs: !leaf,
                },
            })
            .map_err(WorkerError)?;
        Ok(Self {
            job_id: a.job_id,
            cluster: a.cluster,
            index: a.stage,
            stages: a.stages,
            first: a.first,
            end: a.end,
            exec,
            loss: a.loss,
            wire_dtype: a.wire_dtype,
            seed: a.seed,
            // As the server's `micro_batch_ranges`: 0 means the batch is not split.
            micro_batches: a.micro_batches.max(1),
            leaf_output,
            next_step: a.start_step,
            steps: Vec::new(),
            deferred: VecDeque::new(),
            schedule: a.schedule,
            barrier_step: a.start_step,
            seeded: None,
            micro_batches_done: 0,
            base_lr: a.optimizer.lr(),
            lr_schedule: a.lr_schedule,
            clip_grad_norm: a.clip_grad_norm,
            sync_base: a.sync_int8.then(|| float_params(&a.params)),
            hold_limit: (a.schedule.holds_back() && !leaf).then_some((a.stages - a.stage) as usize),
        })
    }

    fn describe(&self) -> String {
        format!(
            "job {}, cluster {}, stage {} of {} (nodes {}..{})",
            self.job_id, self.cluster, self.index, self.stages, self.first, self.end
        )
    }

    fn is_root(&self) -> bool {
        self.index == 0
    }

    async fn handle(
        &mut self,
        message: ToProvider,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        match message {
            ToProvider::Forward(f) => match f.phase {
                Phase::Train { step } => match self.defer(step, f)? {
                    Some(f) => self.train_forward(step, f, out).await,
                    None => Ok(()),
                },
                Phase::Eval { .. } => self.eval_forward(f, out).await,
            },
            ToProvider::Backward(b) => self.backward(b, out).await,
            ToProvider::UploadParams { job_id, step } => {
                self.barrier("UploadParams")?;
                // The optimizer state goes first: the server's sync is over
                // once every stage's parameters are in, and its checkpoint
                // needs both.
                let params = self.exec.optimizer_state().await.map_err(backend)?;
                out.push(ToServer::OptimizerState(OptimizerState {
                    job_id,
                    step,
                    params,
                }));
                let params = self.exec.parameters().await.map_err(backend)?;
                out.push(ToServer::Params(ParamSet {
                    job_id,
                    step,
                    params: self.sync_changes(params)?,
                }));
                Ok(())
            }
            ToProvider::SetParams(p) => {
                self.set_params(&p)?;
                self.barrier("SetParams")
            }
            ToProvider::SetOptimizerState(o) => {
                refuse_quantized(o.params.iter().flat_map(|p| &p.slots))?;
                self.exec.set_optimizer_state(&o.params).map_err(backend)
            }
            ToProvider::GradScale(g) => self.grad_scale(g, out).await,
            other => Err(protocol(format!(
                "{} is not a stage message",
                describe(&other)
            ))),
        }
    }

    /// The step's state, opening the step on its first micro-batch.
    fn begin_step(
        &mut self,
        step: u64,
        samples: u32,
    ) -> Result<&mut StepState<B::MicroBatch>, WorkerError> {
        if let Some(i) = self.steps.iter().position(|s| s.step == step) {
            let s = &mut self.steps[i];
            if s.samples != samples {
                return Err(protocol(format!(
                    "step_samples changed within step {step} from {} to {samples}",
                    s.samples
                )));
            }
            return Ok(s);
        }
        match self.steps.last() {
            Some(s) if self.steps.len() >= self.schedule.steps_in_flight() as usize => {
                return Err(protocol(format!(
                    "step {step} cannot start while step {} is unfinished ({} of {} micro-batches backpropagated)",
                    s.step, s.finished, s.count
                )));
            }
            Some(s) if step != s.step + 1 => {
                return Err(protocol(format!(
                    "step {step} cannot start while step {} is unfinished: under async only the step after it can",
                    s.step
                )));
            }
            Some(_) => {}
            None if step < self.next_step => {
                return Err(protocol(format!(
                    "step {step} is already done on this stage (the next step is {})",
                    self.next_step
                )));
            }
            None => {}
        }
        if samples == 0 {
            return Err(protocol("a training step of 0 samples"));
        }
        let chunk = samples.div_ceil(self.micro_batches);
        self.steps.push(StepState {
            step,
            samples,
            chunk,
            count: samples.div_ceil(chunk),
            forwarded: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            peak_held: 0,
            finished: 0,
            compute_ms: 0.0,
            awaiting_scale: false,
        });
        self.steps
            .last_mut()
            .ok_or_else(|| protocol("the step state vanished"))
    }

    fn open_step(&mut self, step: u64) -> Result<&mut StepState<B::MicroBatch>, WorkerError> {
        self.steps
            .iter_mut()
            .find(|s| s.step == step)
            .ok_or_else(|| protocol(format!("step {step} is not in progress on this stage")))
    }

    /// Micro-batches run forward and awaiting their backward, of any step.
    fn held(&self) -> usize {
        self.steps.iter().map(|s| s.in_flight.len()).sum()
    }

    /// The weights step `step` runs with: under `async`, those every update
    /// up to step `step - 2` made, extrapolated (a barrier's step: the
    /// barrier's; the step after it: those the barrier's step's update made,
    /// as it waits for that update); otherwise the current ones.
    fn version(&self, step: u64) -> Result<WeightVersion, WorkerError> {
        if !self.schedule.is_async() {
            return Ok(WeightVersion::Current);
        }
        if step == self.barrier_step + 1 && self.next_step == self.barrier_step {
            return Err(protocol(format!(
                "step {step} runs with step {}'s update, which this stage has not made yet (async feeds the step after a barrier's once that step is done)",
                self.barrier_step
            )));
        }
        // Versions are named by the steps done when they were current.
        let wanted = step.saturating_sub(1).max(self.barrier_step);
        if wanted == self.next_step {
            Ok(WeightVersion::Current)
        } else if wanted + 1 == self.next_step && wanted >= self.barrier_step {
            Ok(WeightVersion::Previous)
        } else {
            Err(protocol(format!(
                "step {step} runs with the weights after step {}, but this stage has done the steps before {} (async feeds a step only once its step - 2 is done on every stage)",
                wanted as i64 - 1,
                self.next_step
            )))
        }
    }

    /// A sync or new parameters: both weight versions become the current
    /// one, and the next two steps run with it.
    fn barrier(&mut self, what: &str) -> Result<(), WorkerError> {
        if let Some(s) = self.steps.first() {
            return Err(protocol(format!(
                "{what} while step {} is in progress ({} of {} micro-batches backpropagated)",
                s.step, s.finished, s.count
            )));
        }
        self.exec.merge_versions().map_err(backend)?;
        self.barrier_step = self.next_step;
        Ok(())
    }

    /// The forward to run now, or `None` when the schedule makes it wait.
    fn defer(&mut self, step: u64, f: Forward) -> Result<Option<Forward>, WorkerError> {
        let Some(limit) = self.hold_limit else {
            return Ok(Some(f));
        };
        if self.deferred.is_empty() && self.held() < limit {
            return Ok(Some(f));
        }
        let window = self.schedule.steps_in_flight();
        if self.deferred.len() >= (window * self.micro_batches) as usize {
            return Err(protocol(format!(
                "more training forwards wait than {window} step(s) of {} micro-batches hold",
                self.micro_batches
            )));
        }
        self.deferred.push_back((step, f));
        Ok(None)
    }

    /// The oldest waiting forward, once the schedule lets it run.
    fn undefer(&mut self) -> Option<(u64, Forward)> {
        let limit = self.hold_limit?;
        if self.held() < limit {
            self.deferred.pop_front()
        } else {
            None
        }
    }

    async fn train_forward(
        &mut self,
        step: u64,
        f: Forward,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        let started = Clock::now();
        let inputs = self.decode_all(&f.inputs)?;
        let version = self.version(step)?;
        let state = self.begin_step(step, f.step_samples)?;
        let micro = f.micro;
        if micro >= state.count {
            return Err(protocol(format!(
                "step {step} has {} micro-batches ({} samples in chunks of {}), so there is no micro-batch {micro}",
                state.count, state.samples, state.chunk
            )));
        }
        if !state.forwarded.insert(micro) {
            return Err(protocol(format!(
                "micro-batch {micro} of step {step} was already run forward"
            )));
        }
        let offset = micro * state.chunk;
        let expected = state.chunk.min(state.samples - offset);
        let (samples, chunk) = (state.samples, state.chunk);
        if let Some((name, t)) = inputs.first()
            && let Some(held) = self.exec.samples(t)
            && held != expected as usize
        {
            return Err(protocol(format!(
                "input `{name}` holds {held} samples, but micro-batch {micro} of a step of {samples} samples in chunks of {chunk} holds {expected}"
            )));
        }
        if self.seeded != Some(step) {
            self.exec.set_step_seed(step_seed(self.seed, step));
            self.seeded = Some(step);
        }
        let (micro_batch, outputs) = self
            .exec
            .forward(&inputs, u64::from(offset), version)
            .await
            .map_err(backend)?;
        let Some(output) = self.leaf_output.clone() else {
            let outputs = self.encode_all(&outputs)?;
            let compute_ms = started.elapsed_ms();
            let held = self.held() as u32 + 1;
            let state = self.open_step(step)?;
            state.in_flight.insert(micro, micro_batch);
            state.peak_held = state.peak_held.max(held);
            state.compute_ms += compute_ms;
            out.push(ToServer::Activations(Activations {
                job_id: self.job_id,
                phase: f.phase,
                micro,
                outputs,
                compute_ms,
            }));
            return Ok(());
        };
        let labels = f
            .labels
            .as_ref()
            .ok_or_else(|| protocol("the Leaf got a Forward without labels"))?;
        let y = single_output(&outputs, &output)?;
        self.open_step(step)?.peak_held = 1;
        let (loss_sum, grads) = self
            .exec
            .leaf_backward(micro_batch, self.loss, &output, y, labels, f.step_targets)
            .await
            .map_err(backend)?;
        let samples = self.exec.samples(y).unwrap_or(0);
        out.push(ToServer::LeafLoss(LeafLoss {
            job_id: self.job_id,
            phase: f.phase,
            micro,
            loss_sum,
            correct: self.correct(y, labels)?,
            samples: samples as u32,
        }));
        self.finish_micro(step, micro, grads, started, out).await
    }

    async fn backward(&mut self, b: Backward, out: &mut Vec<ToServer>) -> Result<(), WorkerError> {
        let started = Clock::now();
        if self.leaf_output.is_some() {
            return Err(protocol(
                "the Leaf runs backward right after its forward; it takes no Backward",
            ));
        }
        // A stage's steps finish in order: the next step's backwards come
        // after this one's update, so one gradient buffer serves both.
        let state = match self.steps.first_mut() {
            Some(s) if s.step == b.step => s,
            Some(s) => {
                return Err(protocol(format!(
                    "this stage is in step {}, not step {}",
                    s.step, b.step
                )));
            }
            None => return Err(protocol("no training step is in progress on this stage")),
        };
        let micro_batch = state.in_flight.remove(&b.micro).ok_or_else(|| {
            protocol(format!(
                "micro-batch {} of step {} is not awaiting backward here (never run forward, or already backpropagated; awaiting: {:?})",
                b.micro,
                b.step,
                state.in_flight.keys().collect::<Vec<_>>()
            ))
        })?;
        let grads = self.decode_all(&b.grads)?;
        let grads = self
            .exec
            .backward(micro_batch, &grads)
            .await
            .map_err(backend)?;
        self.finish_micro(b.step, b.micro, grads, started, out)
            .await?;
        while let Some((step, f)) = self.undefer() {
            self.train_forward(step, f, out).await?;
        }
        Ok(())
    }

    /// After a micro-batch's backward: its input gradients go back (unless
    /// this is the Root), and the step ends after its last micro-batch.
    async fn finish_micro(
        &mut self,
        step: u64,
        micro: u32,
        grads: Vec<(String, B::Tensor)>,
        started: Clock,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        self.micro_batches_done += 1;
        if !self.is_root() {
            out.push(ToServer::Gradients(Gradients {
                job_id: self.job_id,
                step,
                micro,
                grads: self.encode_all(&grads)?,
                compute_ms: started.elapsed_ms(),
            }));
        }
        let state = self.open_step(step)?;
        state.finished += 1;
        if state.finished < state.count {
            state.compute_ms += started.elapsed_ms();
            return Ok(());
        }
        let so_far = state.compute_ms;
        if self.clip_grad_norm.is_some() {
            let sum_of_squares = self.exec.grad_sum_of_squares().await.map_err(backend)?;
            let state = self.open_step(step)?;
            state.awaiting_scale = true;
            state.compute_ms += started.elapsed_ms();
            out.push(ToServer::GradNorm(GradNorm {
                job_id: self.job_id,
                step,
                sum_of_squares,
            }));
            return Ok(());
        }
        self.finish_step(step, 1.0, so_far, started, out).await
    }

    /// The server's clipping multiplier for the step awaiting it.
    async fn grad_scale(
        &mut self,
        g: GradScale,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        let started = Clock::now();
        let so_far = match self.steps.first() {
            Some(s) if s.step == g.step && s.awaiting_scale => s.compute_ms,
            Some(s) => {
                return Err(protocol(format!(
                    "no gradient norm of step {} awaits a scale (the stage is in step {}, {} of {} micro-batches backpropagated)",
                    g.step, s.step, s.finished, s.count
                )));
            }
            None => return Err(protocol("no training step is in progress on this stage")),
        };
        if !(g.scale > 0.0 && g.scale <= 1.0) {
            return Err(protocol(format!(
                "a gradient scale of {} (clipping scales by a number in (0, 1])",
                g.scale
            )));
        }
        self.finish_step(g.step, g.scale, so_far, started, out)
            .await
    }

    /// Steps the optimizer with the step's scheduled learning rate.
    async fn finish_step(
        &mut self,
        step: u64,
        grad_scale: f64,
        so_far: f64,
        started: Clock,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        let lr = self.lr_schedule.lr(self.base_lr, step);
        self.exec.step(lr, grad_scale).await.map_err(backend)?;
        let peak_held = match self.steps.iter().position(|s| s.step == step) {
            Some(i) => self.steps.remove(i).peak_held,
            None => 0,
        };
        self.next_step = step + 1;
        out.push(ToServer::StepDone(StepDone {
            job_id: self.job_id,
            step,
            compute_ms: so_far + started.elapsed_ms(),
            peak_held,
        }));
        Ok(())
    }

    async fn eval_forward(
        &mut self,
        f: Forward,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        let started = Clock::now();
        let inputs = self.decode_all(&f.inputs)?;
        let outputs = self.exec.evaluate(&inputs).await.map_err(backend)?;
        let Some(output) = &self.leaf_output else {
            out.push(ToServer::Activations(Activations {
                job_id: self.job_id,
                phase: f.phase,
                micro: f.micro,
                outputs: self.encode_all(&outputs)?,
                compute_ms: started.elapsed_ms(),
            }));
            return Ok(());
        };
        let labels = f
            .labels
            .as_ref()
            .ok_or_else(|| protocol("the Leaf got a Forward without labels"))?;
        let y = single_output(&outputs, output)?;
        let loss_sum = self.exec.loss_sum(self.loss, y, labels).map_err(backend)?;
        let samples = self.exec.samples(y).unwrap_or(0);
        out.push(ToServer::LeafLoss(LeafLoss {
            job_id: self.job_id,
            phase: f.phase,
            micro: f.micro,
            loss_sum,
            correct: self.correct(y, labels)?,
            samples: samples as u32,
        }));
        Ok(())
    }

    /// Counted labels the logits predict; 0 for regression.
    fn correct(&self, y: &B::Tensor, labels: &WireTensor) -> Result<u64, WorkerError> {
        if !self.loss.is_cross_entropy() {
            return Ok(0);
        }
        self.exec.correct(self.loss, y, labels).map_err(backend)
    }

    fn decode_all(&self, tensors: &[WireTensor]) -> Result<Vec<(String, B::Tensor)>, WorkerError> {
        tensors
            .iter()
            .map(|t| Ok((t.name.clone(), self.exec.decode(t).map_err(backend)?)))
            .collect()
    }

    fn encode_all(&self, tensors: &[(String, B::Tensor)]) -> Result<Vec<WireTensor>, WorkerError> {
        tensors
            .iter()
            .map(|(name, t)| self.exec.encode(name, t, self.wire_dtype).map_err(backend))
            .collect()
    }

    fn set_params(&mut self, p: &ParamSet) -> Result<(), WorkerError> {
        let known: BTreeSet<String> = self.exec.param_names().into_iter().collect();
        let unknown: Vec<&str> = p
            .params
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !known.contains(*n))
            .collect();
        // Checked before anything changes, so a refused set leaves no
        // half-loaded stage.
        if !unknown.is_empty() {
            return Err(protocol(format!(
                "{unknown:?} are not parameters of this stage (it has {known:?})"
            )));
        }
        refuse_quantized(&p.params)?;
        self.exec.set_parameters(&p.params).map_err(backend)?;
        if let Some(base) = &mut self.sync_base {
            base.extend(float_params(&p.params));
        }
        Ok(())
    }

    /// The parameters to upload at a sync: with int8 syncs, each f32 one as
    /// its change since the values the server last gave, blockwise int8
    /// (the server adds it back to those same values).
    fn sync_changes(&self, params: Vec<WireTensor>) -> Result<Vec<WireTensor>, WorkerError> {
        let Some(base) = &self.sync_base else {
            return Ok(params);
        };
        params
            .into_iter()
            .map(|t| match base.get(&t.name) {
                Some(was) if t.dtype == WireDType::F32 && was.shape == t.shape => {
                    let now = t.to_f32().map_err(backend)?;
                    let was = was.to_f32().map_err(backend)?;
                    let change: Vec<f32> = now.iter().zip(&was).map(|(n, w)| n - w).collect();
                    Ok(WireTensor::from_f32(
                        &t.name,
                        &t.shape_usize(),
                        &change,
                        WireDType::I8Block,
                    ))
                }
                _ => Ok(t),
            })
            .collect()
    }
}

/// The f32 tensors of `params` by name (sharing their bytes).
fn float_params(params: &[WireTensor]) -> BTreeMap<String, WireTensor> {
    params
        .iter()
        .filter(|t| t.dtype == WireDType::F32)
        .map(|t| (t.name.clone(), t.clone()))
        .collect()
}

fn single_output<'a, T>(outputs: &'a [(String, T)], name: &str) -> Result<&'a T, WorkerError> {
    outputs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| protocol(format!("the stage did not produce its output `{name}`")))
}

/// Milliseconds of compute, natively and in a browser (where
/// `std::time::Instant` panics).
#[derive(Clone, Copy)]
struct Clock(f64);

impl Clock {
    fn now() -> Self {
        Self(now_ms())
    }

    fn elapsed_ms(self) -> f64 {
        (now_ms() - self.0).max(0.0)
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn now_ms() -> f64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3
}

#[cfg(target_arch = "wasm32")]
fn now_ms() -> f64 {
    js_sys::Date::now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_are_fixed_values_and_differ_between_steps_and_jobs() {
        // Pinned: a reference trainer elsewhere must reproduce these exactly.
        assert_eq!(step_seed(0, 0), 0);
        assert_eq!(step_seed(0, 1), 0xE220_A839_7B1D_CDAF);
        let seeds: std::collections::BTreeSet<u64> = (0..4)
            .flat_map(|job| (0..100).map(move |step| step_seed(job, step)))
            .collect();
        assert_eq!(seeds.len(), 400);
    }
}
