//! One running job as a state machine: it turns provider messages into
//! [`Effect`]s (frames to send, metrics to store, checkpoints to write) and
//! holds no sockets, database or files, so every rule is unit-testable.
//!
//! The server owns the data: [`JobRun`] picks each cluster's batch from the
//! seeded permutation, cuts it into micro-batches, sends inputs to the Root
//! and keeps the labels until the Leaf's forward, so inputs and labels always
//! match. Steps run in lockstep across clusters; every `sync_every` steps (and
//! at each epoch's end) parameters are averaged by name, which is what makes
//! C clusters with SGD equal one process with C times the batch.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use rookery_job::weights::WeightTensor;
use rookery_job::{
    Aggregation, Dataset, JobSpec, Labels, Schedule, epoch_permutation, micro_batch_ranges,
};
use rookery_model::{Analysis, DType, Graph, Init, ParamKind, Plan};
use rookery_proto::{
    Activations, Assignment, Backward, Forward, Gradients, LeafLoss, ParamSet, Phase, StepDone,
    ToProvider, ToServer, WireDType, WireTensor,
};

use crate::aggregate;
use crate::jobs::{EpochRecord, StageTime, StepRecord};

/// What the coordinator must do on the job's behalf, in order.
#[derive(Debug)]
pub enum Effect {
    Send(u64, ToProvider),
    Running,
    Step(StepRecord),
    Epoch(EpochRecord),
    /// The latest averaged parameters, to keep as the checkpoint.
    Checkpoint(Vec<WeightTensor>),
    /// Training is over; these are the trained weights.
    Completed(Vec<WeightTensor>),
    Failed(String),
    /// The provider sent something wrong: counts against it.
    Fault {
        provider: u64,
        reason: String,
        /// Whether a frame the step needs was dropped (rather than outvoted
        /// at a sync), so the provider's stage cannot finish the step.
        frame_dropped: bool,
    },
}

/// Why a frame was turned down.
#[derive(Debug)]
enum Rejected {
    /// Out of order or late (as around a rollback): dropped, nobody's fault.
    Stale(String),
    /// Wrong data: another job's, another stage's, misshapen, non-finite.
    Fault(String),
}

impl From<String> for Rejected {
    fn from(reason: String) -> Self {
        Rejected::Stale(reason)
    }
}

impl From<&str> for Rejected {
    fn from(reason: &str) -> Self {
        Rejected::Stale(reason.to_string())
    }
}

/// A parameter's current (averaged) value.
#[derive(Debug, Clone)]
struct ParamValue {
    shape: Vec<usize>,
    dtype: DType,
    kind: ParamKind,
    values: Vec<f32>,
}

#[derive(Debug)]
struct StageSlot {
    provider: u64,
    /// Boundary tensors in and out: (name, per-sample shape, dtype).
    inputs: Vec<(String, Vec<usize>, DType)>,
    outputs: Vec<(String, Vec<usize>, DType)>,
    params: Vec<String>,
    ready: bool,
    step_done: bool,
    compute_ms: f64,
    uploaded: bool,
}

#[derive(Debug, Default)]
struct ClusterRun {
    stages: Vec<StageSlot>,
    /// Labels waiting for the Leaf's forward, by (phase, micro-batch).
    labels: HashMap<(Phase, u32), WireTensor>,
    /// Samples in each micro-batch of the current step or evaluation, for shape checks.
    micro_samples: HashMap<(Phase, u32), usize>,
    /// Micro-batches whose loss the Leaf has reported.
    reported: std::collections::HashSet<(Phase, u32)>,
    loss_sum: f64,
    correct: u64,
    samples: u64,
}

impl ClusterRun {
    /// Forgets the previous step's or evaluation's micro-batches and totals.
    fn reset(&mut self) {
        self.labels.clear();
        self.micro_samples.clear();
        self.reported.clear();
        self.loss_sum = 0.0;
        self.correct = 0;
        self.samples = 0;
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Assigning,
    Training { step: u64 },
    Syncing { step_done: u64 },
    Evaluating { epoch: u64, expected: u64 },
    Over,
}

pub struct JobRun {
    pub job_id: u64,
    spec: JobSpec,
    graph_input: (String, DType),
    train: Dataset,
    test: Option<Dataset>,
    schedule: Schedule,
    total_steps: u64,
    perm: Vec<usize>,
    perm_epoch: Option<u64>,
    clusters: Vec<ClusterRun>,
    params: BTreeMap<String, ParamValue>,
    /// Params uploaded at the current sync: name -> (cluster, value) per cluster.
    uploads: BTreeMap<String, Vec<(usize, Vec<f32>)>>,
    state: State,
    /// When the current step's clock started: the end of the previous step
    /// (so its sync and the gap between steps count), or the step's own start
    /// when it opens an epoch (evaluation does not count).
    step_started: Instant,
    bytes_relayed: u64,
}

/// Why a job cannot start on the plan it was given.
pub type StartError = String;

impl JobRun {
    /// Builds the run and the `Assign` frames for every stage of `plan`.
    /// `graph` is the model as imported (with its initial values), `analysis`
    /// its analysis at the micro-batch size.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        job_id: u64,
        spec: JobSpec,
        graph: &Graph,
        analysis: &Analysis,
        plan: &Plan,
        provider_ids: &HashMap<String, u64>,
        train: Dataset,
        test: Option<Dataset>,
    ) -> Result<(Self, Vec<Effect>), StartError> {
        let t = &spec.training;
        let schedule = Schedule::new(train.len(), plan.clusters.len(), t.batch_size)
            .map_err(|e| e.to_string())?;
        let total_steps = schedule.steps_per_epoch as u64 * t.epochs;
        let input = graph
            .inputs
            .first()
            .ok_or_else(|| "the model has no input".to_string())?;
        let initial = graph.initial_values(t.seed);
        let params: BTreeMap<String, ParamValue> = graph
            .params
            .iter()
            .map(|p| {
                let values = initial.get(&p.name).cloned().unwrap_or_default();
                (
                    p.name.clone(),
                    ParamValue {
                        shape: p.shape.clone(),
                        dtype: p.dtype,
                        kind: p.kind,
                        values,
                    },
                )
            })
            .collect();
        // Providers get the graph without its values: the values travel as tensors.
        let mut bare = graph.clone();
        for p in &mut bare.params {
            p.init = Init::Zeros;
        }
        let graph_json = bare.to_json().map_err(|e| e.to_string())?;
        let per_sample = |name: &str| -> (String, Vec<usize>, DType) {
            let info = analysis.tensors.get(name);
            let shape = info.map(|i| i.shape[1.min(i.shape.len())..].to_vec());
            (
                name.to_string(),
                shape.unwrap_or_default(),
                info.map_or(DType::F32, |i| i.dtype),
            )
        };
        let mut clusters = Vec::with_capacity(plan.clusters.len());
        let mut effects = Vec::new();
        for (ci, cluster) in plan.clusters.iter().enumerate() {
            let mut run = ClusterRun::default();
            let stages = cluster.stages.len();
            for (si, stage) in cluster.stages.iter().enumerate() {
                let provider = *provider_ids
                    .get(&stage.provider)
                    .ok_or_else(|| format!("the plan names unknown provider {}", stage.provider))?;
                let mut names: Vec<String> = analysis.nodes[stage.first..stage.end]
                    .iter()
                    .flat_map(|n| n.params.iter().cloned())
                    .collect();
                names.sort();
                names.dedup();
                let wire_params = names
                    .iter()
                    .filter_map(|n| params.get(n).map(|v| (n, v)))
                    .map(|(n, v)| param_tensor(n, v))
                    .collect();
                let outputs: Vec<String> = stage.outputs.iter().map(|b| b.name.clone()).collect();
                effects.push(Effect::Send(
                    provider,
                    ToProvider::Assign(Box::new(Assignment {
                        job_id,
                        cluster: ci as u32,
                        stage: si as u32,
                        stages: stages as u32,
                        graph_json: graph_json.clone(),
                        first: stage.first as u32,
                        end: stage.end as u32,
                        outputs: outputs.clone(),
                        params: wire_params,
                        optimizer: rookery_proto::train::wire_optimizer(t.optimizer),
                        loss: rookery_proto::train::wire_loss(t.loss),
                        batch_size: t.batch_size as u32,
                        micro_batches: t.micro_batches as u32,
                        wire_dtype: wire_dtype(t.wire_dtype),
                        seed: t.seed,
                        start_step: 0,
                    })),
                ));
                run.stages.push(StageSlot {
                    provider,
                    inputs: stage.inputs.iter().map(|b| per_sample(&b.name)).collect(),
                    outputs: outputs.iter().map(|n| per_sample(n)).collect(),
                    params: names,
                    ready: false,
                    step_done: false,
                    compute_ms: 0.0,
                    uploaded: false,
                });
            }
            clusters.push(run);
        }
        let run = JobRun {
            job_id,
            graph_input: (input.name.clone(), input.dtype),
            spec,
            train,
            test,
            schedule,
            total_steps,
            perm: Vec::new(),
            perm_epoch: None,
            clusters,
            params,
            uploads: BTreeMap::new(),
            state: State::Assigning,
            step_started: Instant::now(),
            bytes_relayed: 0,
        };
        Ok((run, effects))
    }

    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Every provider the job uses.
    pub fn providers(&self) -> Vec<u64> {
        self.clusters
            .iter()
            .flat_map(|c| c.stages.iter().map(|s| s.provider))
            .collect()
    }

    pub fn is_over(&self) -> bool {
        self.state == State::Over
    }

    /// Frames telling every provider the job is over for it.
    pub fn release(&mut self) -> Vec<Effect> {
        self.state = State::Over;
        self.providers()
            .into_iter()
            .map(|p| {
                Effect::Send(
                    p,
                    ToProvider::Release {
                        job_id: self.job_id,
                    },
                )
            })
            .collect()
    }

    /// The current parameters as `state_dict` entries (constants left out).
    pub fn weights(&self) -> Vec<WeightTensor> {
        self.params
            .iter()
            .filter(|(_, v)| v.kind != ParamKind::Constant)
            .map(|(name, v)| match v.dtype {
                DType::F32 => WeightTensor::f32(name.clone(), v.shape.clone(), v.values.clone()),
                DType::I64 => WeightTensor::i64(name.clone(), v.shape.clone(), v.values.clone()),
            })
            .collect()
    }

    fn locate(&self, provider: u64) -> Option<(usize, usize)> {
        self.clusters.iter().enumerate().find_map(|(c, run)| {
            run.stages
                .iter()
                .position(|s| s.provider == provider)
                .map(|s| (c, s))
        })
    }

    /// A provider of this job sent `message`. Frames that break the protocol
    /// are dropped with a logged reason (and an [`Effect::Fault`] when the
    /// data was wrong rather than late); a provider's own failure fails the job.
    pub fn on_message(&mut self, provider: u64, message: ToServer) -> Vec<Effect> {
        let Some((c, s)) = self.locate(provider) else {
            tracing::warn!(
                job = self.job_id,
                provider,
                "dropped a frame from a provider outside the job"
            );
            return Vec::new();
        };
        let result = match message {
            ToServer::Ready { job_id } => self.check_job(job_id).map(|()| self.on_ready(c, s)),
            ToServer::Activations(a) => self
                .check_job(a.job_id)
                .and_then(|()| self.on_activations(c, s, a)),
            ToServer::Gradients(g) => self
                .check_job(g.job_id)
                .and_then(|()| self.on_gradients(c, s, g)),
            ToServer::LeafLoss(l) => self
                .check_job(l.job_id)
                .and_then(|()| self.on_leaf_loss(c, s, l)),
            ToServer::StepDone(d) => self
                .check_job(d.job_id)
                .and_then(|()| self.on_step_done(c, s, d)),
            ToServer::Params(p) => self
                .check_job(p.job_id)
                .and_then(|()| self.on_params(c, s, p)),
            ToServer::JobFailed { job_id, message } => self.check_job(job_id).map(|()| {
                self.state = State::Over;
                vec![Effect::Failed(format!(
                    "provider {provider} (cluster {c}, stage {s}) failed: {message}"
                ))]
            }),
            ToServer::Hello(_)
            | ToServer::Heartbeat { .. }
            | ToServer::Error(_)
            | ToServer::ProbeAck { .. } => Ok(Vec::new()),
        };
        match result {
            Ok(effects) => effects,
            Err(Rejected::Stale(reason)) => {
                tracing::warn!(job = self.job_id, provider, cluster = c, stage = s, %reason, "dropped a frame");
                Vec::new()
            }
            Err(Rejected::Fault(reason)) => {
                tracing::warn!(job = self.job_id, provider, cluster = c, stage = s, %reason, "dropped a faulty frame");
                vec![Effect::Fault {
                    provider,
                    reason: format!("cluster {c}, stage {s}: {reason}"),
                    frame_dropped: true,
                }]
            }
        }
    }

    fn check_job(&self, job_id: u64) -> Result<(), Rejected> {
        if job_id == self.job_id {
            Ok(())
        } else {
            Err(Rejected::Fault(format!(
                "a frame for job {job_id}, not {}",
                self.job_id
            )))
        }
    }

    fn on_ready(&mut self, c: usize, s: usize) -> Vec<Effect> {
        self.clusters[c].stages[s].ready = true;
        let all = self
            .clusters
            .iter()
            .all(|r| r.stages.iter().all(|s| s.ready));
        if self.state == State::Assigning && all {
            let mut effects = vec![Effect::Running];
            effects.extend(self.start_step(0));
            effects
        } else {
            Vec::new()
        }
    }

    fn current_phase_ok(&self, phase: Phase) -> Result<(), String> {
        match (self.state, phase) {
            (State::Training { step }, Phase::Train { step: got }) if step == got => Ok(()),
            (State::Evaluating { epoch, .. }, Phase::Eval { epoch: got })
                if epoch == u64::from(got) =>
            {
                Ok(())
            }
            (state, phase) => Err(format!(
                "{phase:?} does not match the job's state {state:?}"
            )),
        }
    }

    fn start_step(&mut self, step: u64) -> Vec<Effect> {
        let spe = self.schedule.steps_per_epoch as u64;
        let epoch = step / spe;
        if self.perm_epoch != Some(epoch) {
            let t = &self.spec.training;
            self.perm = epoch_permutation(self.train.len(), t.seed, epoch, t.shuffle);
            self.perm_epoch = Some(epoch);
        }
        self.state = State::Training { step };
        if step.is_multiple_of(spe) {
            self.step_started = Instant::now();
        }
        let phase = Phase::Train { step };
        let batch = self.spec.training.batch_size;
        let ranges = micro_batch_ranges(batch, self.spec.training.micro_batches);
        let mut effects = Vec::new();
        for c in 0..self.clusters.len() {
            let idx = self
                .schedule
                .batch(&self.perm, (step % spe) as usize, c)
                .to_vec();
            for stage in &mut self.clusters[c].stages {
                stage.step_done = false;
                stage.compute_ms = 0.0;
            }
            let run = &mut self.clusters[c];
            run.reset();
            for (m, r) in ranges.iter().enumerate() {
                let chunk = &idx[r.clone()];
                effects.push(feed(
                    &self.graph_input,
                    &self.train,
                    run,
                    self.job_id,
                    phase,
                    m as u32,
                    batch,
                    chunk,
                ));
            }
        }
        effects
    }

    fn on_activations(
        &mut self,
        c: usize,
        s: usize,
        a: Activations,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(a.phase)?;
        let run = &mut self.clusters[c];
        let last = run.stages.len() - 1;
        if s == last {
            return Err(Rejected::Fault(
                "the Leaf sends losses, not activations".into(),
            ));
        }
        let samples = *run
            .micro_samples
            .get(&(a.phase, a.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", a.micro))?;
        check_tensors(
            &a.outputs,
            &run.stages[s].outputs,
            samples,
            wire_dtype(self.spec.training.wire_dtype),
        )
        .map_err(Rejected::Fault)?;
        run.stages[s].compute_ms += a.compute_ms.max(0.0);
        self.bytes_relayed += a.outputs.iter().map(|t| t.wire_len() as u64).sum::<u64>();
        let labels = if s + 1 == last {
            run.labels.remove(&(a.phase, a.micro))
        } else {
            None
        };
        let step_samples = match a.phase {
            Phase::Train { .. } => self.spec.training.batch_size,
            Phase::Eval { .. } => samples,
        };
        let next = run.stages[s + 1].provider;
        Ok(vec![Effect::Send(
            next,
            ToProvider::Forward(Forward {
                job_id: self.job_id,
                phase: a.phase,
                micro: a.micro,
                step_samples: step_samples as u32,
                inputs: a.outputs,
                labels,
            }),
        )])
    }

    fn on_gradients(&mut self, c: usize, s: usize, g: Gradients) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(Phase::Train { step: g.step })?;
        if s == 0 {
            return Err(Rejected::Fault(
                "the Root has no one to send gradients to".into(),
            ));
        }
        let run = &mut self.clusters[c];
        let samples = *run
            .micro_samples
            .get(&(Phase::Train { step: g.step }, g.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", g.micro))?;
        // Gradients come for the stage's float inputs, in any subset.
        let expected: Vec<_> = run.stages[s]
            .inputs
            .iter()
            .filter(|(name, _, dtype)| {
                *dtype == DType::F32 && g.grads.iter().any(|t| &t.name == name)
            })
            .cloned()
            .collect();
        check_tensors(
            &g.grads,
            &expected,
            samples,
            wire_dtype(self.spec.training.wire_dtype),
        )
        .map_err(Rejected::Fault)?;
        run.stages[s].compute_ms += g.compute_ms.max(0.0);
        self.bytes_relayed += g.grads.iter().map(|t| t.wire_len() as u64).sum::<u64>();
        let prev = run.stages[s - 1].provider;
        Ok(vec![Effect::Send(
            prev,
            ToProvider::Backward(Backward {
                job_id: self.job_id,
                step: g.step,
                micro: g.micro,
                grads: g.grads,
            }),
        )])
    }

    fn on_leaf_loss(&mut self, c: usize, s: usize, l: LeafLoss) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(l.phase)?;
        let run = &mut self.clusters[c];
        if s + 1 != run.stages.len() {
            return Err(Rejected::Fault("only the Leaf reports losses".into()));
        }
        let samples = *run
            .micro_samples
            .get(&(l.phase, l.micro))
            .ok_or_else(|| format!("micro-batch {} is not in flight", l.micro))?;
        if !run.reported.insert((l.phase, l.micro)) {
            return Err(format!("micro-batch {}'s loss was already reported", l.micro).into());
        }
        if samples != l.samples as usize
            || !l.loss_sum.is_finite()
            || l.correct > u64::from(l.samples)
        {
            return Err(Rejected::Fault(format!(
                "implausible loss report: {} samples (expected {samples}), loss {}, {} correct",
                l.samples, l.loss_sum, l.correct
            )));
        }
        run.loss_sum += l.loss_sum;
        run.correct += l.correct;
        run.samples += u64::from(l.samples);
        if let State::Evaluating { epoch, expected } = self.state {
            let got: u64 = self.clusters.iter().map(|r| r.samples).sum();
            if got == expected {
                return Ok(self.finish_eval(epoch));
            }
        }
        Ok(Vec::new())
    }

    fn on_step_done(&mut self, c: usize, s: usize, d: StepDone) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(Phase::Train { step: d.step })?;
        let stage = &mut self.clusters[c].stages[s];
        if stage.step_done {
            return Err(format!("step {} was already reported done", d.step).into());
        }
        stage.step_done = true;
        // The provider's total is authoritative; what the relays counted was partial.
        stage.compute_ms = d.compute_ms.max(0.0);
        let all = self
            .clusters
            .iter()
            .all(|r| r.stages.iter().all(|s| s.step_done));
        if !all {
            return Ok(Vec::new());
        }
        Ok(self.finish_step(d.step))
    }

    fn finish_step(&mut self, step: u64) -> Vec<Effect> {
        let elapsed_ms = self.step_started.elapsed().as_secs_f64() * 1e3;
        self.step_started = Instant::now();
        let samples: u64 = self.clusters.iter().map(|r| r.samples).sum();
        let loss = self.clusters.iter().map(|r| r.loss_sum).sum::<f64>() / samples.max(1) as f64;
        let spe = self.schedule.steps_per_epoch as u64;
        let stages = self
            .clusters
            .iter()
            .enumerate()
            .flat_map(|(c, r)| {
                r.stages.iter().enumerate().map(move |(s, st)| StageTime {
                    cluster: c as u32,
                    stage: s as u32,
                    provider: st.provider,
                    compute_ms: st.compute_ms,
                    idle_ms: (elapsed_ms - st.compute_ms).max(0.0),
                })
            })
            .collect();
        let record = StepRecord {
            step,
            epoch: step / spe,
            loss,
            samples_per_s: samples as f64 / (elapsed_ms / 1e3).max(1e-9),
            elapsed_ms,
            bytes_relayed: std::mem::take(&mut self.bytes_relayed),
            stages,
        };
        let mut effects = vec![Effect::Step(record)];
        let done = step + 1;
        let sync = done.is_multiple_of(self.spec.training.sync_every)
            || done.is_multiple_of(spe)
            || done == self.total_steps;
        if sync {
            effects.extend(self.start_sync(done));
        } else {
            effects.extend(self.start_step(done));
        }
        effects
    }

    fn start_sync(&mut self, step_done: u64) -> Vec<Effect> {
        self.state = State::Syncing { step_done };
        self.uploads.clear();
        let mut effects = Vec::new();
        for run in &mut self.clusters {
            for stage in &mut run.stages {
                stage.uploaded = false;
                effects.push(Effect::Send(
                    stage.provider,
                    ToProvider::UploadParams {
                        job_id: self.job_id,
                        step: step_done,
                    },
                ));
            }
        }
        effects
    }

    fn on_params(&mut self, c: usize, s: usize, p: ParamSet) -> Result<Vec<Effect>, Rejected> {
        let State::Syncing { step_done } = self.state else {
            return Err("parameters arrived outside a sync".into());
        };
        if p.step != step_done {
            return Err(format!(
                "parameters of step {} during the sync of step {step_done}",
                p.step
            )
            .into());
        }
        let stage = &self.clusters[c].stages[s];
        if stage.uploaded {
            return Err("parameters were already uploaded for this sync".into());
        }
        let mut values = Vec::with_capacity(p.params.len());
        for t in &p.params {
            let fault = |reason: String| Rejected::Fault(reason);
            if !stage.params.contains(&t.name) {
                return Err(fault(format!(
                    "parameter `{}` is not one of the stage's",
                    t.name
                )));
            }
            let Some(current) = self.params.get(&t.name) else {
                return Err(fault(format!("unknown parameter `{}`", t.name)));
            };
            if t.shape_usize() != current.shape {
                return Err(fault(format!(
                    "parameter `{}` has shape {:?}, expected {:?}",
                    t.name, t.shape, current.shape
                )));
            }
            t.check().map_err(|e| fault(e.to_string()))?;
            values.push((
                t.name.clone(),
                t.to_f32().map_err(|e| fault(e.to_string()))?,
            ));
        }
        let clusters = self.clusters.len();
        for (name, v) in values {
            self.uploads
                .entry(name)
                .or_insert_with(|| Vec::with_capacity(clusters))
                .push((c, v));
        }
        self.clusters[c].stages[s].uploaded = true;
        let all = self
            .clusters
            .iter()
            .all(|r| r.stages.iter().all(|s| s.uploaded));
        if !all {
            return Ok(Vec::new());
        }
        Ok(self.finish_sync(step_done))
    }

    fn finish_sync(&mut self, step_done: u64) -> Vec<Effect> {
        let rule = self.spec.training.aggregation;
        // Each cluster's squared distance to the aggregate, and the aggregate's
        // squared norm, over every float parameter: to spot a far-off cluster.
        let mut squared_distances = vec![0.0f64; self.clusters.len()];
        let mut squared_norm = 0.0f64;
        for (name, copies) in std::mem::take(&mut self.uploads) {
            let Some(target) = self.params.get_mut(&name) else {
                continue;
            };
            target.values = match target.dtype {
                // Counters (BatchNorm's num_batches_tracked) agree across clusters.
                DType::I64 => copies
                    .into_iter()
                    .next()
                    .map(|(_, v)| v)
                    .unwrap_or_default(),
                DType::F32 => {
                    let slices: Vec<&[f32]> = copies.iter().map(|(_, v)| v.as_slice()).collect();
                    let value = aggregate::aggregate(rule, &slices);
                    if rule != Aggregation::Mean {
                        for (c, copy) in &copies {
                            squared_distances[*c] += aggregate::distance(copy, &value).powi(2);
                        }
                        squared_norm += value.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>();
                    }
                    value
                }
            };
        }
        let mut effects = Vec::new();
        if rule != Aggregation::Mean {
            for c in aggregate::far_off(&squared_distances, squared_norm) {
                let typical = squared_distances
                    .iter()
                    .map(|d| d.sqrt())
                    .fold(f64::INFINITY, f64::min);
                for stage in &self.clusters[c].stages {
                    effects.push(Effect::Fault {
                        provider: stage.provider,
                        reason: format!(
                            "cluster {c}'s parameters at the sync of step {step_done} are {:.3e} away from the {} of the clusters' (the closest cluster: {typical:.3e})",
                            squared_distances[c].sqrt(),
                            match rule {
                                Aggregation::Median => "median",
                                _ => "centered clip",
                            },
                        ),
                        frame_dropped: false,
                    });
                }
            }
        }
        if self.clusters.len() > 1 {
            for run in &self.clusters {
                for stage in &run.stages {
                    let params = stage
                        .params
                        .iter()
                        .filter_map(|n| self.params.get(n).map(|v| param_tensor(n, v)))
                        .collect();
                    effects.push(Effect::Send(
                        stage.provider,
                        ToProvider::SetParams(ParamSet {
                            job_id: self.job_id,
                            step: step_done,
                            params,
                        }),
                    ));
                }
            }
        }
        effects.push(Effect::Checkpoint(self.weights()));
        let spe = self.schedule.steps_per_epoch as u64;
        if step_done.is_multiple_of(spe)
            && let Some(eval) = self.start_eval(step_done / spe - 1)
        {
            effects.extend(eval);
            return effects;
        }
        effects.extend(self.next_or_finish(step_done));
        effects
    }

    fn next_or_finish(&mut self, step_done: u64) -> Vec<Effect> {
        if step_done >= self.total_steps {
            let mut effects = self.release();
            effects.push(Effect::Completed(self.weights()));
            effects
        } else {
            self.start_step(step_done)
        }
    }

    /// Sends the test set forward through every cluster, each its own share.
    fn start_eval(&mut self, epoch: u64) -> Option<Vec<Effect>> {
        let test = self.test.as_ref()?;
        if test.is_empty() {
            return None;
        }
        let n = test.len();
        let clusters = self.clusters.len();
        self.state = State::Evaluating {
            epoch,
            expected: n as u64,
        };
        let phase = Phase::Eval {
            epoch: epoch as u32,
        };
        let micro = self.spec.micro_batch_size().max(1);
        let mut effects = Vec::new();
        for (c, run) in self.clusters.iter_mut().enumerate() {
            run.reset();
            let share = (c * n / clusters)..((c + 1) * n / clusters);
            let idx: Vec<usize> = share.collect();
            for (m, chunk) in idx.chunks(micro).enumerate() {
                effects.push(feed(
                    &self.graph_input,
                    test,
                    run,
                    self.job_id,
                    phase,
                    m as u32,
                    chunk.len(),
                    chunk,
                ));
            }
        }
        Some(effects)
    }

    fn finish_eval(&mut self, epoch: u64) -> Vec<Effect> {
        let samples: u64 = self.clusters.iter().map(|r| r.samples).sum();
        let loss = self.clusters.iter().map(|r| r.loss_sum).sum::<f64>() / samples.max(1) as f64;
        let correct: u64 = self.clusters.iter().map(|r| r.correct).sum();
        let mut effects = vec![Effect::Epoch(EpochRecord {
            epoch,
            test_loss: loss,
            test_accuracy: correct as f64 / samples.max(1) as f64,
            samples,
        })];
        let spe = self.schedule.steps_per_epoch as u64;
        effects.extend(self.next_or_finish((epoch + 1) * spe));
        effects
    }
}

/// Sends one micro-batch of `data` to the cluster's Root and keeps its labels
/// for the Leaf (or sends them along when the Root is the Leaf).
#[allow(clippy::too_many_arguments)]
fn feed(
    input: &(String, DType),
    data: &Dataset,
    run: &mut ClusterRun,
    job_id: u64,
    phase: Phase,
    micro: u32,
    step_samples: usize,
    idx: &[usize],
) -> Effect {
    let mut shape = vec![idx.len()];
    shape.extend_from_slice(&data.sample_shape);
    let inputs = vec![WireTensor::from_f32(
        input.0.clone(),
        &shape,
        &data.gather_inputs(idx),
        on_wire(input.1, WireDType::F32),
    )];
    let labels = match data.gather_labels(idx) {
        Labels::Classes(classes) => WireTensor::from_i64("labels", &[idx.len()], &classes),
        Labels::Targets { shape: per, values } => {
            let mut shape = vec![idx.len()];
            shape.extend(per);
            WireTensor::from_f32("labels", &shape, &values, WireDType::F32)
        }
    };
    run.micro_samples.insert((phase, micro), idx.len());
    let single = run.stages.len() == 1;
    let labels = if single {
        Some(labels)
    } else {
        run.labels.insert((phase, micro), labels);
        None
    };
    let root = run.stages[0].provider;
    Effect::Send(
        root,
        ToProvider::Forward(Forward {
            job_id,
            phase,
            micro,
            step_samples: step_samples as u32,
            inputs,
            labels,
        }),
    )
}

/// Checks that `tensors` are exactly `expected` (same names, in order), each
/// `[samples, per-sample shape...]`, floats in the job's wire dtype and finite.
fn check_tensors(
    tensors: &[WireTensor],
    expected: &[(String, Vec<usize>, DType)],
    samples: usize,
    wire: WireDType,
) -> Result<(), String> {
    if tensors.len() != expected.len() {
        return Err(format!(
            "{} tensors, expected {} ({:?})",
            tensors.len(),
            expected.len(),
            expected.iter().map(|e| &e.0).collect::<Vec<_>>()
        ));
    }
    for (t, (name, per, dtype)) in tensors.iter().zip(expected) {
        if &t.name != name {
            return Err(format!("tensor `{}` where `{name}` was expected", t.name));
        }
        let mut shape = vec![samples];
        shape.extend_from_slice(per);
        if t.shape_usize() != shape {
            return Err(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                t.shape
            ));
        }
        let want = on_wire(*dtype, wire);
        if t.dtype != want {
            return Err(format!(
                "tensor `{name}` is {}, expected {}",
                t.dtype.as_str(),
                want.as_str()
            ));
        }
        // Bytes that follow the message are checked as they arrive.
        if !t.follows() {
            t.check().map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// How a tensor of the graph's `dtype` travels: floats as `floats`
/// (the job's wire dtype, or f32 for data and parameters), integers as i64.
fn on_wire(dtype: DType, floats: WireDType) -> WireDType {
    match dtype {
        DType::F32 => floats,
        DType::I64 => WireDType::I64,
    }
}

fn param_tensor(name: &str, v: &ParamValue) -> WireTensor {
    WireTensor::from_f32(name, &v.shape, &v.values, on_wire(v.dtype, WireDType::F32))
}

fn wire_dtype(d: rookery_job::WireDType) -> WireDType {
    match d {
        rookery_job::WireDType::F32 => WireDType::F32,
        rookery_job::WireDType::F16 => WireDType::F16,
        rookery_job::WireDType::Bf16 => WireDType::Bf16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_job::{DataFormat, DataRef, DataSpec, ModelSection, ModelSource, TrainingSpec};
    use rookery_model::{
        ClusterCount, Loss, OptimizerConfig, PlanOptions, ProviderKind, ProviderSpec,
    };

    const MLP: &str = r#"
input_shape = [4]
[[layers]]
type = "Dense"
units = 8
activation = "relu"
[[layers]]
type = "Dense"
units = 3
"#;

    fn spec() -> JobSpec {
        JobSpec {
            model: ModelSection {
                source: ModelSource::Spec("mlp.toml".into()),
                input_shape: vec![4],
            },
            data: DataSpec {
                format: DataFormat::Npy,
                train_inputs: DataRef::file("x.npy"),
                train_labels: DataRef::file("y.npy"),
                test_inputs: None,
                test_labels: None,
                scale: None,
                mean: None,
                std: None,
            },
            training: TrainingSpec {
                epochs: 1,
                batch_size: 4,
                micro_batches: 2,
                loss: Loss::CrossEntropy,
                optimizer: OptimizerConfig::sgd(0.1),
                clusters: ClusterCount::Fixed(2),
                sync_every: 1,
                stages: Some(2),
                shuffle: true,
                seed: 7,
                wire_dtype: rookery_job::WireDType::F32,
                aggregation: Aggregation::Mean,
            },
        }
    }

    fn data(n: usize) -> Dataset {
        Dataset {
            sample_shape: vec![4],
            inputs: (0..n * 4).map(|i| i as f32 / 10.0).collect(),
            labels: Labels::Classes((0..n as i64).map(|i| i % 3).collect()),
        }
    }

    /// A run over 4 providers (ids 10..14): 2 clusters of Root -> Leaf, 16
    /// samples, so 2 steps; and the `Assign` frames it starts with.
    fn started() -> (JobRun, Vec<Effect>) {
        started_with(2, Aggregation::Mean)
    }

    /// `clusters` clusters of Root -> Leaf (providers 10, 11, ...) that sync
    /// with `aggregation`.
    fn started_with(clusters: usize, aggregation: Aggregation) -> (JobRun, Vec<Effect>) {
        let graph = rookery_model::from_toml(MLP).unwrap();
        let mut spec = spec();
        spec.training.clusters = ClusterCount::Fixed(clusters);
        spec.training.aggregation = aggregation;
        let ids = 10..10 + 2 * clusters as u64;
        let providers: Vec<ProviderSpec> = ids
            .clone()
            .map(|i| ProviderSpec {
                id: i.to_string(),
                kind: ProviderKind::Native,
                memory_bytes: 1 << 30,
                gflops: 10.0,
                bandwidth_mbps: 1000.0,
            })
            .collect();
        let options = PlanOptions {
            micro_batch: 2,
            clusters: ClusterCount::Fixed(clusters),
            stages_per_cluster: Some(2),
            ..PlanOptions::default()
        };
        let plan = rookery_model::clusterize(&graph, &providers, &options).unwrap();
        let ids = ids.map(|i| (i.to_string(), i)).collect();
        let analysis = graph.analyze().unwrap();
        JobRun::start(
            1,
            spec,
            &graph,
            &analysis,
            &plan,
            &ids,
            data(8 * clusters),
            None,
        )
        .unwrap()
    }

    fn faults(effects: &[Effect]) -> Vec<(u64, &str, bool)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Fault {
                    provider,
                    reason,
                    frame_dropped,
                } => Some((*provider, reason.as_str(), *frame_dropped)),
                _ => None,
            })
            .collect()
    }

    /// Every stage of `run` uploads its parameters for the sync of step 1,
    /// cluster `c`'s all equal to `value(c)`; the effects of the last upload.
    fn upload_all(run: &mut JobRun, value: impl Fn(usize) -> f32) -> Vec<Effect> {
        let mut last = Vec::new();
        for c in 0..run.clusters.len() {
            for stage in 0..run.clusters[c].stages.len() {
                let params = run.clusters[c].stages[stage]
                    .params
                    .iter()
                    .map(|n| {
                        let shape = run.params[n].shape.clone();
                        let len = shape.iter().product();
                        WireTensor::from_f32(
                            n.clone(),
                            &shape,
                            &vec![value(c); len],
                            WireDType::F32,
                        )
                    })
                    .collect();
                let provider = run.clusters[c].stages[stage].provider;
                last = run.on_message(
                    provider,
                    ToServer::Params(ParamSet {
                        job_id: 1,
                        step: 1,
                        params,
                    }),
                );
            }
        }
        last
    }

    fn sends(effects: &[Effect]) -> Vec<(u64, &ToProvider)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(p, m) => Some((*p, m)),
                _ => None,
            })
            .collect()
    }

    fn roles(run: &JobRun) -> [[u64; 2]; 2] {
        let p = |c: usize, s: usize| run.clusters[c].stages[s].provider;
        [[p(0, 0), p(0, 1)], [p(1, 0), p(1, 1)]]
    }

    fn activations(step: u64, micro: u32, shape: &[usize], name: &str) -> ToServer {
        let n: usize = shape.iter().product();
        ToServer::Activations(Activations {
            job_id: 1,
            phase: Phase::Train { step },
            micro,
            outputs: vec![WireTensor::from_f32(
                name,
                shape,
                &vec![0.5; n],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        })
    }

    #[test]
    fn the_server_feeds_roots_relays_both_ways_and_averages_at_sync() {
        let (mut run, effects) = started();
        let assigns = sends(&effects);
        assert_eq!(assigns.len(), 4);
        assert!(
            assigns
                .iter()
                .all(|(_, m)| matches!(m, ToProvider::Assign(_)))
        );
        let [[root0, leaf0], [root1, leaf1]] = roles(&run);
        let boundary = run.clusters[0].stages[0].outputs[0].0.clone();

        // Nothing starts until every stage is ready; then each Root gets its micro-batches.
        for p in [root0, leaf0, root1] {
            assert!(run.on_message(p, ToServer::Ready { job_id: 1 }).is_empty());
        }
        let effects = run.on_message(leaf1, ToServer::Ready { job_id: 1 });
        assert!(matches!(effects[0], Effect::Running));
        let feeds = sends(&effects);
        assert_eq!(feeds.len(), 4);
        for (p, m) in &feeds {
            let ToProvider::Forward(f) = m else {
                panic!("{m:?}")
            };
            assert!([root0, root1].contains(p));
            assert_eq!((f.step_samples, f.inputs[0].shape.clone()), (4, vec![2, 4]));
            assert!(f.labels.is_none(), "labels wait for the Leaf");
        }

        // A wrongly shaped activation is dropped (a fault); a good one reaches
        // the Leaf with its labels.
        let dropped = run.on_message(root0, activations(0, 0, &[3, 8], &boundary));
        assert!(sends(&dropped).is_empty());
        assert_eq!(faults(&dropped).len(), 1);
        assert!(
            run.on_message(root0, activations(1, 0, &[2, 8], &boundary))
                .is_empty()
        );
        let relayed = run.on_message(root0, activations(0, 0, &[2, 8], &boundary));
        let [(to, ToProvider::Forward(f))] = sends(&relayed)[..] else {
            panic!("{relayed:?}")
        };
        assert_eq!(to, leaf0);
        assert_eq!(f.labels.as_ref().map(|l| l.shape.clone()), Some(vec![2]));

        // Gradients go back to the Root.
        let grads = ToServer::Gradients(Gradients {
            job_id: 1,
            step: 0,
            micro: 0,
            grads: vec![WireTensor::from_f32(
                &boundary,
                &[2, 8],
                &[0.1; 16],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        });
        let back = run.on_message(leaf0, grads);
        assert!(matches!(sends(&back)[..], [(p, ToProvider::Backward(_))] if p == root0));

        // Losses from every micro-batch of both clusters, then StepDone: a step
        // record and a sync.
        for (c, leaf) in [(0, leaf0), (1, leaf1)] {
            for micro in 0..2 {
                if c == 1 || micro == 1 {
                    let root = if c == 0 { root0 } else { root1 };
                    run.on_message(root, activations(0, micro, &[2, 8], &boundary));
                }
                let loss = ToServer::LeafLoss(LeafLoss {
                    job_id: 1,
                    phase: Phase::Train { step: 0 },
                    micro,
                    loss_sum: 2.0,
                    correct: 1,
                    samples: 2,
                });
                assert!(run.on_message(leaf, loss).is_empty());
            }
        }
        let done = |step| {
            ToServer::StepDone(StepDone {
                job_id: 1,
                step,
                compute_ms: 3.0,
            })
        };
        for p in [root0, leaf0, root1] {
            assert!(run.on_message(p, done(0)).is_empty());
        }
        let effects = run.on_message(leaf1, done(0));
        let Effect::Step(record) = &effects[0] else {
            panic!("{effects:?}")
        };
        assert!((record.loss - 1.0).abs() < 1e-12, "8 samples, loss sum 8");
        assert_eq!(record.stages.len(), 4);
        let uploads = sends(&effects);
        assert_eq!(uploads.len(), 4);
        assert!(
            uploads
                .iter()
                .all(|(_, m)| matches!(m, ToProvider::UploadParams { step: 1, .. }))
        );

        // Each cluster uploads its own values; everyone gets the average back.
        let mut last = Vec::new();
        for (c, stage, p) in [(0, 0, root0), (0, 1, leaf0), (1, 0, root1), (1, 1, leaf1)] {
            let value = if c == 0 { 1.0 } else { 3.0 };
            let params = run.clusters[c].stages[stage]
                .params
                .iter()
                .map(|n| {
                    let shape = run.params[n].shape.clone();
                    let len = shape.iter().product();
                    WireTensor::from_f32(n.clone(), &shape, &vec![value; len], WireDType::F32)
                })
                .collect();
            last = run.on_message(
                p,
                ToServer::Params(ParamSet {
                    job_id: 1,
                    step: 1,
                    params,
                }),
            );
        }
        let sets = sends(&last);
        assert_eq!(
            (sets.len(), last.len()),
            (8, 9),
            "4 SetParams, 4 forwards, a checkpoint"
        );
        for (_, m) in sets.iter().take(4) {
            let ToProvider::SetParams(set) = m else {
                panic!("{m:?}")
            };
            for t in &set.params {
                assert!(t.to_f32().unwrap().iter().all(|&v| v == 2.0), "{}", t.name);
            }
        }
        assert!(
            last.iter()
                .any(|e| matches!(e, Effect::Checkpoint(w) if w.len() == 4))
        );
        // And step 1 starts.
        assert!(sends(&last)[4..].iter().all(
            |(_, m)| matches!(m, ToProvider::Forward(f) if f.phase == Phase::Train { step: 1 })
        ));
    }

    #[test]
    fn wrong_data_is_dropped_as_a_fault_of_its_sender_and_late_frames_are_not() {
        let (mut run, _) = started();
        let [[root0, leaf0], _] = roles(&run);
        for p in run.providers() {
            run.on_message(p, ToServer::Ready { job_id: 1 });
        }
        let boundary = run.clusters[0].stages[0].outputs[0].0.clone();
        let input = run.graph_input.0.clone();
        let nan = ToServer::Activations(Activations {
            job_id: 1,
            phase: Phase::Train { step: 0 },
            micro: 0,
            outputs: vec![WireTensor::from_f32(
                &boundary,
                &[2, 8],
                &[f32::NAN; 16],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        });
        let mut other_job = activations(0, 0, &[2, 8], &boundary);
        if let ToServer::Activations(a) = &mut other_job {
            a.job_id = 2;
        }
        // (what, sender, frame, the reason names)
        let faulty: [(&str, u64, ToServer, &str); 6] = [
            ("another job's frame", root0, other_job, "job 2"),
            (
                "another job's Ready",
                root0,
                ToServer::Ready { job_id: 2 },
                "job 2",
            ),
            (
                "a wrong shape",
                root0,
                activations(0, 0, &[2, 9], &boundary),
                "shape",
            ),
            (
                "another stage's tensor",
                root0,
                activations(0, 0, &[2, 4], &input),
                "expected",
            ),
            (
                "the Leaf's activations",
                leaf0,
                activations(0, 0, &[2, 8], &boundary),
                "Leaf",
            ),
            ("a NaN", root0, nan, "finite"),
        ];
        for (what, sender, frame, names) in faulty {
            let effects = run.on_message(sender, frame);
            let found = faults(&effects);
            assert_eq!(found.len(), 1, "{what}: {effects:?}");
            let (provider, reason, dropped) = found[0];
            assert_eq!((provider, dropped), (sender, true), "{what}");
            assert!(reason.contains(names), "{what}: {reason}");
            assert_eq!(effects.len(), 1, "{what}: nothing is relayed");
        }
        // A late frame (a step that is not running) is dropped but no fault,
        // and the good frame still goes through.
        assert!(
            run.on_message(root0, activations(1, 0, &[2, 8], &boundary))
                .is_empty()
        );
        let relayed = run.on_message(root0, activations(0, 0, &[2, 8], &boundary));
        assert!(matches!(sends(&relayed)[..], [(p, ToProvider::Forward(_))] if p == leaf0));
    }

    #[test]
    fn robust_aggregation_outvotes_a_far_off_cluster_and_counts_it_against_its_providers() {
        // (rule, expected aggregate, far-off cluster's providers faulted)
        let cases = [
            (Aggregation::Mean, (1.0 + 1.2 + 1.1 + 1e4) / 4.0, false),
            (Aggregation::Median, 1.15, true),
            (Aggregation::CenteredClip, 1.15, true),
        ];
        for (rule, want, counted) in cases {
            let (mut run, _) = started_with(4, rule);
            run.state = State::Syncing { step_done: 1 };
            let values = [1.0, 1.2, 1.1, 1e4];
            let effects = upload_all(&mut run, |c| values[c]);
            for (name, p) in &run.params {
                let worst = p
                    .values
                    .iter()
                    .map(|v| ((v - want) / want).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst < 0.05, "{rule:?}: {name} is {:?}", &p.values[..2]);
            }
            let found = faults(&effects);
            if counted {
                let outlier: Vec<u64> = run.clusters[3].stages.iter().map(|s| s.provider).collect();
                let blamed: Vec<u64> = found.iter().map(|f| f.0).collect();
                assert_eq!(blamed, outlier, "{rule:?}");
                assert!(found.iter().all(|f| !f.2 && f.1.contains("cluster 3")));
            } else {
                assert!(found.is_empty(), "{rule:?}: {found:?}");
            }
            // The sync finishes either way: everyone gets the aggregate.
            assert_eq!(
                sends(&effects)
                    .iter()
                    .filter(|(_, m)| matches!(m, ToProvider::SetParams(_)))
                    .count(),
                8,
                "{rule:?}"
            );
        }
    }

    #[test]
    fn honest_clusters_under_robust_aggregation_are_not_counted() {
        for rule in [Aggregation::Median, Aggregation::CenteredClip] {
            let (mut run, _) = started_with(3, rule);
            run.state = State::Syncing { step_done: 1 };
            let effects = upload_all(&mut run, |c| 1.0 + 0.01 * c as f32);
            assert!(faults(&effects).is_empty(), "{rule:?}");
        }
    }

    #[test]
    fn frames_for_another_job_or_from_strangers_are_dropped() {
        let (mut run, _) = started();
        assert!(run.on_message(99, ToServer::Ready { job_id: 1 }).is_empty());
        let [[root0, ..], _] = roles(&run);
        let dropped = run.on_message(root0, ToServer::Ready { job_id: 2 });
        assert!(matches!(&dropped[..], [Effect::Fault { .. }]));
        assert!(!run.clusters[0].stages[0].ready);
        // A provider's own failure ends the job.
        let failed = run.on_message(
            root0,
            ToServer::JobFailed {
                job_id: 1,
                message: "out of memory".into(),
            },
        );
        assert!(matches!(&failed[..], [Effect::Failed(m)] if m.contains("out of memory")));
        assert!(run.is_over());
    }
}
