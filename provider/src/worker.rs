//! One provider's share of a training job: a [`StageWorker`] turns the server's
//! training messages into calls on a libtorch [`StageExecutor`] and answers
//! with the messages the server relays on (DESIGN.md, "Data flow of one
//! training step"; `rookery_proto::train` describes the exchange).
//!
//! The worker is a synchronous state machine with no socket: the connection
//! feeds it on its own thread (libtorch calls block), and tests relay messages
//! between several workers in one process exactly as the server would. Every
//! failure, whether a bad assignment, a tensor of the wrong shape, a libtorch
//! error or a message that does not fit the stage's state, becomes
//! [`ToServer::JobFailed`]; nothing a server sends can panic it.
//!
//! The server relies on these rules:
//! - a stage counts a step's micro-batches as `torch.chunk` (and
//!   `rookery_job::micro_batch_ranges`) does:
//!   `chunk = ceil(step_samples / micro_batches)`, `count = ceil(step_samples /
//!   chunk)`, micro-batch `m` holding samples `m * chunk ..`; dropout masks are
//!   seeded by [`step_seed`] and those sample positions, so a run in stages
//!   reproduces a single-process run whatever order micro-batches arrive in;
//! - once a stage has run backward for all of a step's micro-batches it steps
//!   its optimizer and sends `StepDone`, after the last micro-batch's
//!   `Gradients`;
//! - after `JobFailed` the stage is gone: later messages for that job get
//!   `JobFailed` again, until a new `Assign`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use rookery_model::{Graph, Loss};
use rookery_proto::{
    Activations, Assignment, Backward, Forward, Gradients, LeafLoss, OptimizerState,
    ParamOptimState, ParamSet, Phase, StepDone, TensorError, ToProvider, ToServer, WireDType,
    WireTensor,
};
use tch::{Device, Kind, Tensor};

use crate::exec::loss::{loss_value, micro_batch_loss};
use crate::exec::{ExecError, MicroBatch, Optimizer, StageExecutor, is_float};
use crate::trainer::{Trainer, job_of};

pub use crate::trainer::step_seed;
pub use rookery_proto::train::{loss_from_wire, optimizer_config, wire_loss, wire_optimizer};

/// Why a message could not be carried out; its text goes into `JobFailed`.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The message does not fit the assignment or the stage's state.
    #[error("{0}")]
    Protocol(String),
}

impl From<tch::TchError> for WorkerError {
    fn from(error: tch::TchError) -> Self {
        // Through ExecError, which trims libtorch's C++ backtrace.
        WorkerError::Exec(ExecError::from(error))
    }
}

fn protocol(message: impl Into<String>) -> WorkerError {
    WorkerError::Protocol(message.into())
}

/// Runs at most one stage of one job at a time on one device.
#[derive(Debug)]
pub struct StageWorker {
    device: Device,
    stage: Option<Stage>,
    /// The job whose stage was dropped after a failure, and why.
    failed: Option<(u64, String)>,
}

impl StageWorker {
    /// A worker with no stage yet; stages it builds live on `device`.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            stage: None,
            failed: None,
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The job whose stage this worker holds, if any.
    pub fn job_id(&self) -> Option<u64> {
        self.stage.as_ref().map(|s| s.job_id)
    }

    /// Handles one training message; see the module docs for the replies.
    /// Session messages (`Welcome`, `Heartbeat`, `Error`) get no reply.
    pub fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        let Some(job_id) = job_of(&message) else {
            return Vec::new();
        };
        let what = describe(&message);
        match message {
            ToProvider::Assign(a) => self.assign(*a),
            ToProvider::Release { job_id } => {
                // A Release for a job this worker does not hold asks for a
                // state that already holds, so it is not worth a failure.
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
                if let Err(error) = stage.handle(message, &mut out) {
                    let reason = format!("{}: {what}: {error}", stage.describe());
                    // A half-done step cannot be trusted (gradients partly
                    // accumulated, micro-batches in flight), so the stage goes.
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
        // The server is the source of truth: a new assignment replaces whatever
        // this worker held.
        self.stage = None;
        self.failed = None;
        let job_id = a.job_id;
        let title = format!(
            "cannot build stage {} of {} (nodes {}..{}) of job {job_id}, cluster {}",
            a.stage, a.stages, a.first, a.end, a.cluster
        );
        match Stage::build(a, self.device) {
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

impl Trainer for StageWorker {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        StageWorker::handle(self, message)
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
        ToProvider::Assign(_) => "Assign".into(),
        ToProvider::Release { .. } => "Release".into(),
        ToProvider::Welcome { .. } => "Welcome".into(),
        ToProvider::Heartbeat { .. } => "Heartbeat".into(),
        ToProvider::Error(_) => "Error".into(),
        ToProvider::Probe { .. } => "Probe".into(),
    }
}

/// The stage of one assignment and where it stands in the current step.
#[derive(Debug)]
struct Stage {
    job_id: u64,
    cluster: u32,
    index: u32,
    stages: u32,
    first: u32,
    end: u32,
    exec: StageExecutor,
    optimizer: Optimizer,
    loss: Loss,
    wire_dtype: WireDType,
    seed: u64,
    micro_batches: u32,
    /// The Leaf's single output, which the loss reads.
    leaf_output: Option<String>,
    /// The lowest step not done yet.
    next_step: u64,
    step: Option<StepState>,
}

#[derive(Debug)]
struct StepState {
    step: u64,
    samples: u32,
    chunk: u32,
    count: u32,
    forwarded: BTreeSet<u32>,
    /// Micro-batches run forward and awaiting Backward (never on the Leaf,
    /// which backpropagates at once).
    in_flight: BTreeMap<u32, MicroBatch>,
    finished: u32,
    compute_ms: f64,
}

fn elapsed_ms(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}

impl Stage {
    fn build(a: Assignment, device: Device) -> Result<Self, WorkerError> {
        if a.stages == 0 || a.stage >= a.stages {
            return Err(protocol(format!(
                "stage index {} is not in a chain of {} stages",
                a.stage, a.stages
            )));
        }
        if !a.wire_dtype.is_float() {
            return Err(protocol(format!(
                "wire dtype {} cannot carry activations and gradients (use f32, f16 or bf16)",
                a.wire_dtype.as_str()
            )));
        }
        let graph = Graph::from_json(&a.graph_json)
            .map_err(|e| protocol(format!("the model graph JSON does not parse: {e}")))?;
        let params = a
            .params
            .iter()
            .map(|p| Ok((p.name.clone(), tensor_from_wire(p)?)))
            .collect::<Result<Vec<_>, WorkerError>>()?;
        let leaf = a.stage + 1 == a.stages;
        if leaf && a.outputs.len() != 1 {
            return Err(protocol(format!(
                "the Leaf needs exactly one output for the loss, got {:?}",
                a.outputs
            )));
        }
        let leaf_output = leaf.then(|| a.outputs[0].clone());
        let exec = StageExecutor::new(
            &graph,
            a.first as usize..a.end as usize,
            a.outputs,
            params,
            device,
        )?;
        let mut optimizer = Optimizer::new(optimizer_config(a.optimizer))?;
        restore_optimizer(&mut optimizer, &exec, &a.optimizer_state, device)?;
        Ok(Self {
            job_id: a.job_id,
            cluster: a.cluster,
            index: a.stage,
            stages: a.stages,
            first: a.first,
            end: a.end,
            exec,
            optimizer,
            loss: loss_from_wire(a.loss),
            wire_dtype: a.wire_dtype,
            seed: a.seed,
            // As the server's `micro_batch_ranges`: 0 means the batch is not split.
            micro_batches: a.micro_batches.max(1),
            leaf_output,
            next_step: a.start_step,
            step: None,
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

    fn handle(&mut self, message: ToProvider, out: &mut Vec<ToServer>) -> Result<(), WorkerError> {
        match message {
            ToProvider::Forward(f) => match f.phase {
                Phase::Train { step } => self.train_forward(step, f, out),
                Phase::Eval { .. } => self.eval_forward(f, out),
            },
            ToProvider::Backward(b) => self.backward(b, out),
            ToProvider::UploadParams { job_id, step } => {
                // The optimizer state goes first: the server's sync is over once
                // every stage's parameters are in, and its checkpoint needs both.
                let optimizer = self
                    .optimizer
                    .export()
                    .into_iter()
                    .map(|(name, steps, slots)| {
                        let slots = slots
                            .into_iter()
                            .map(|(slot, t)| tensor_to_wire(slot, t, WireDType::F32))
                            .collect::<Result<_, _>>()?;
                        Ok(ParamOptimState { name, steps, slots })
                    })
                    .collect::<Result<_, WorkerError>>()?;
                out.push(ToServer::OptimizerState(OptimizerState {
                    job_id,
                    step,
                    params: optimizer,
                }));
                let params = self
                    .exec
                    .parameters()?
                    .iter()
                    .map(|(name, t)| tensor_to_wire(name, t, WireDType::F32))
                    .collect::<Result<_, _>>()?;
                out.push(ToServer::Params(ParamSet {
                    job_id,
                    step,
                    params,
                }));
                Ok(())
            }
            ToProvider::SetParams(p) => self.set_params(&p),
            other => Err(protocol(format!(
                "{} is not a stage message",
                describe(&other)
            ))),
        }
    }

    /// The step's state, opening the step (and seeding its dropout) on its
    /// first micro-batch.
    fn begin_step(&mut self, step: u64, samples: u32) -> Result<&mut StepState, WorkerError> {
        match &self.step {
            Some(s) if s.step == step => {
                if s.samples != samples {
                    return Err(protocol(format!(
                        "step_samples changed within step {step} from {} to {samples}",
                        s.samples
                    )));
                }
            }
            Some(s) => {
                return Err(protocol(format!(
                    "step {step} cannot start while step {} is unfinished ({} of {} micro-batches backpropagated)",
                    s.step, s.finished, s.count
                )));
            }
            None => {
                if step < self.next_step {
                    return Err(protocol(format!(
                        "step {step} is already done on this stage (the next step is {})",
                        self.next_step
                    )));
                }
                if samples == 0 {
                    return Err(protocol("a training step of 0 samples"));
                }
                let chunk = samples.div_ceil(self.micro_batches);
                self.exec.set_step_seed(step_seed(self.seed, step));
                self.step = Some(StepState {
                    step,
                    samples,
                    chunk,
                    count: samples.div_ceil(chunk),
                    forwarded: BTreeSet::new(),
                    in_flight: BTreeMap::new(),
                    finished: 0,
                    compute_ms: 0.0,
                });
            }
        }
        self.step
            .as_mut()
            .ok_or_else(|| protocol("the step state vanished"))
    }

    fn train_forward(
        &mut self,
        step: u64,
        f: Forward,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        let started = Instant::now();
        let inputs = named_tensors(&f.inputs)?;
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
        if let Some((name, t)) = inputs.first()
            && t.dim() > 0
            && t.size()[0] != i64::from(expected)
        {
            return Err(protocol(format!(
                "input `{name}` holds {} samples, but micro-batch {micro} of a step of {} samples in chunks of {} holds {expected}",
                t.size()[0],
                state.samples,
                state.chunk
            )));
        }
        let forward = self.exec.forward_at(&inputs, true, u64::from(offset))?;
        let Some(output) = self.leaf_output.clone() else {
            let outputs = encode_all(&forward.outputs, self.wire_dtype)?;
            let compute_ms = elapsed_ms(started);
            if let Some(state) = self.step.as_mut() {
                state.in_flight.insert(micro, forward.micro_batch);
                state.compute_ms += compute_ms;
            }
            out.push(ToServer::Activations(Activations {
                job_id: self.job_id,
                phase: f.phase,
                micro,
                outputs,
                compute_ms,
            }));
            return Ok(());
        };
        let labels = labels(&f)?;
        let y = single_output(&forward.outputs, &output)?;
        let loss = micro_batch_loss(self.loss, y, &labels, f.step_samples as usize)?;
        let samples = y.size().first().copied().unwrap_or(0);
        out.push(ToServer::LeafLoss(LeafLoss {
            job_id: self.job_id,
            phase: f.phase,
            micro,
            loss_sum: loss.mean * samples as f64,
            correct: self.correct(y, &labels)?,
            samples: samples as u32,
        }));
        let grads = self
            .exec
            .backward(forward.micro_batch, &[(output, loss.grad)])?;
        self.finish_micro(step, micro, grads, started, out)
    }

    fn backward(&mut self, b: Backward, out: &mut Vec<ToServer>) -> Result<(), WorkerError> {
        let started = Instant::now();
        if self.leaf_output.is_some() {
            return Err(protocol(
                "the Leaf runs backward right after its forward; it takes no Backward",
            ));
        }
        let state = match self.step.as_mut() {
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
        let grads = named_tensors(&b.grads)?;
        let grads = self.exec.backward(micro_batch, &grads)?;
        self.finish_micro(b.step, b.micro, grads, started, out)
    }

    /// After a micro-batch's backward: its input gradients go back (unless
    /// this is the Root), and the step ends after its last micro-batch.
    fn finish_micro(
        &mut self,
        step: u64,
        micro: u32,
        grads: Vec<(String, Tensor)>,
        started: Instant,
        out: &mut Vec<ToServer>,
    ) -> Result<(), WorkerError> {
        if !self.is_root() {
            let grads = encode_all(&grads, self.wire_dtype)?;
            out.push(ToServer::Gradients(Gradients {
                job_id: self.job_id,
                step,
                micro,
                grads,
                compute_ms: elapsed_ms(started),
            }));
        }
        let state = self
            .step
            .as_mut()
            .ok_or_else(|| protocol("the step state vanished"))?;
        state.finished += 1;
        if state.finished < state.count {
            state.compute_ms += elapsed_ms(started);
            return Ok(());
        }
        self.exec.step(&mut self.optimizer)?;
        let compute_ms = state.compute_ms + elapsed_ms(started);
        self.step = None;
        self.next_step = step + 1;
        out.push(ToServer::StepDone(StepDone {
            job_id: self.job_id,
            step,
            compute_ms,
        }));
        Ok(())
    }

    fn eval_forward(&mut self, f: Forward, out: &mut Vec<ToServer>) -> Result<(), WorkerError> {
        let started = Instant::now();
        let inputs = named_tensors(&f.inputs)?;
        let outputs = self.exec.evaluate(&inputs)?;
        let Some(output) = &self.leaf_output else {
            let outputs = encode_all(&outputs, self.wire_dtype)?;
            out.push(ToServer::Activations(Activations {
                job_id: self.job_id,
                phase: f.phase,
                micro: f.micro,
                outputs,
                compute_ms: elapsed_ms(started),
            }));
            return Ok(());
        };
        let labels = labels(&f)?;
        let y = single_output(&outputs, output)?;
        let mean = loss_value(self.loss, y, &labels)?;
        let samples = y.size().first().copied().unwrap_or(0);
        out.push(ToServer::LeafLoss(LeafLoss {
            job_id: self.job_id,
            phase: f.phase,
            micro: f.micro,
            loss_sum: mean * samples as f64,
            correct: self.correct(y, &labels)?,
            samples: samples as u32,
        }));
        Ok(())
    }

    /// Samples whose highest logit is their label; 0 for regression.
    fn correct(&self, y: &Tensor, labels: &Tensor) -> Result<u64, WorkerError> {
        if self.loss != Loss::CrossEntropy {
            return Ok(0);
        }
        let hits = y
            .f_argmax(1, false)?
            .f_eq_tensor(&labels.f_to_device(y.device())?)?
            .f_sum(Kind::Int64)?
            .f_int64_value(&[])?;
        Ok(hits.max(0) as u64)
    }

    fn set_params(&mut self, p: &ParamSet) -> Result<(), WorkerError> {
        let known: BTreeSet<String> = self.exec.param_names().into_iter().collect();
        let unknown: Vec<&str> = p
            .params
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !known.contains(*n))
            .collect();
        // Checked before anything changes, so a refused set leaves no half-loaded stage.
        if !unknown.is_empty() {
            return Err(protocol(format!(
                "{unknown:?} are not parameters of this stage (it has {known:?})"
            )));
        }
        let values = named_tensors(&p.params)?;
        self.exec.set_parameters(&values)?;
        Ok(())
    }
}

/// Loads the optimizer state an assignment carries, checked against the
/// stage's parameters (name and shape) before the optimizer sees it.
fn restore_optimizer(
    optimizer: &mut Optimizer,
    exec: &StageExecutor,
    state: &[ParamOptimState],
    device: Device,
) -> Result<(), WorkerError> {
    if state.is_empty() {
        return Ok(());
    }
    let params: BTreeMap<String, Vec<i64>> = exec
        .parameters()?
        .into_iter()
        .map(|(name, t)| (name, t.size()))
        .collect();
    for p in state {
        let shape = params.get(&p.name).ok_or_else(|| {
            protocol(format!(
                "optimizer state for `{}`, which is not a parameter of this stage",
                p.name
            ))
        })?;
        let mut slots = Vec::with_capacity(p.slots.len());
        for t in &p.slots {
            let value = tensor_from_wire(t)?;
            if &value.size() != shape {
                return Err(protocol(format!(
                    "optimizer state `{}` of `{}` has shape {:?}, the parameter {shape:?}",
                    t.name,
                    p.name,
                    value.size()
                )));
            }
            slots.push((t.name.clone(), value.f_to_device(device)?));
        }
        optimizer.import(&p.name, p.steps, slots)?;
    }
    Ok(())
}

fn labels(f: &Forward) -> Result<Tensor, WorkerError> {
    let labels = f
        .labels
        .as_ref()
        .ok_or_else(|| protocol("the Leaf got a Forward without labels"))?;
    tensor_from_wire(labels)
}

fn single_output<'a>(
    outputs: &'a [(String, Tensor)],
    name: &str,
) -> Result<&'a Tensor, WorkerError> {
    outputs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| protocol(format!("the stage did not produce its output `{name}`")))
}

fn named_tensors(tensors: &[WireTensor]) -> Result<Vec<(String, Tensor)>, WorkerError> {
    tensors
        .iter()
        .map(|t| Ok((t.name.clone(), tensor_from_wire(t)?)))
        .collect()
}

fn encode_all(
    tensors: &[(String, Tensor)],
    dtype: WireDType,
) -> Result<Vec<WireTensor>, WorkerError> {
    tensors
        .iter()
        .map(|(name, t)| tensor_to_wire(name, t, dtype))
        .collect()
}

/// A CPU tensor from wire bytes: f32, f16 and bf16 become f32 (`Kind::Float`),
/// i64 stays i64; shaped as declared. Byte counts that do not match the shape
/// and non-finite floats are refused.
pub fn tensor_from_wire(t: &WireTensor) -> Result<Tensor, WorkerError> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| i64::from(d)).collect();
    let flat = match t.dtype {
        WireDType::I64 => Tensor::f_from_slice(&t.to_i64()?)?,
        WireDType::F32 | WireDType::F16 | WireDType::Bf16 => {
            let values = t.to_f32()?;
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(TensorError::NotFinite {
                    name: t.name.clone(),
                    index,
                }
                .into());
            }
            Tensor::f_from_slice(&values)?
        }
    };
    Ok(flat.f_reshape(shape.as_slice())?)
}

/// Wire bytes of a tensor on any device: floating-point tensors as `dtype`
/// (f32, f16 or bf16), integer tensors as i64 whatever `dtype` says.
pub fn tensor_to_wire(name: &str, t: &Tensor, dtype: WireDType) -> Result<WireTensor, WorkerError> {
    let t = t.f_detach()?.f_to_device(Device::Cpu)?;
    let shape: Vec<usize> = t.size().iter().map(|&d| d.max(0) as usize).collect();
    let numel = shape.iter().product::<usize>();
    if is_float(t.kind()) {
        if !dtype.is_float() {
            return Err(protocol(format!(
                "tensor `{name}` is floating point and cannot travel as {}",
                dtype.as_str()
            )));
        }
        let t = t.f_to_kind(Kind::Float)?.f_contiguous()?;
        let mut values = vec![0f32; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_f32(name, &shape, &values, dtype))
    } else {
        let t = t.f_to_kind(Kind::Int64)?.f_contiguous()?;
        let mut values = vec![0i64; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_i64(name, &shape, &values))
    }
}
