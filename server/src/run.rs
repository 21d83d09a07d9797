//! One running job as a state machine: it turns provider messages into
//! [`Effect`]s (frames to send, metrics to store, checkpoints to write) and
//! holds no sockets, database or files, so every rule is unit-testable.
//!
//! The server owns the data: [`JobRun`] picks each cluster's batch from the
//! seeded permutation, cuts it into micro-batches, sends inputs to the Root
//! and keeps the labels until the Leaf's forward, so inputs and labels always
//! match. Between syncs each cluster runs its own steps at its own pace (its
//! batches are its own shard); every `sync_every` steps (and at each epoch's
//! end) every cluster waits at the barrier and parameters are averaged by
//! name, which is what makes C clusters with SGD equal one process with C
//! times the batch. A single cluster has nothing to average, so its syncs
//! (checkpoints only) run beside its next step instead of draining the
//! pipeline, except at epoch ends and the last step. A step's metrics are
//! recorded once every cluster has done it.
//!
//! Recovery: each sync is a checkpoint holding the averaged parameters and,
//! per cluster, every stage's optimizer state as it stood (not averaged: in
//! an undisturbed run each cluster keeps its own moments across syncs, so
//! keeping them per cluster is what makes a rebuilt cluster continue exactly
//! as if nothing had happened). When a stage loses its provider
//! ([`JobRun::stage_lost`]), its cluster is rebuilt from that checkpoint on
//! the survivors plus a replacement ([`JobRun::fill`]) and replays the steps
//! since, with the same batches (data order is a function of the seed and
//! the step); the other clusters train on up to the next barrier and wait
//! there. Replayed steps were already recorded, so they are not recorded
//! again: step records stay one per step.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use rookery_job::weights::WeightTensor;
use rookery_job::{
    Aggregation, Dataset, JobSpec, Labels, Schedule, epoch_permutation, micro_batch_ranges,
};
use rookery_model::{Analysis, DType, Graph, Init, ParamKind};
use rookery_plan::Plan;
use rookery_proto::{
    Activations, Assignment, Backward, Forward, Gradients, LeafLoss, OptimizerState,
    ParamOptimState, ParamSet, Phase, StepDone, ToProvider, ToServer, WireDType, WireTensor,
    train::OPTIMIZER_SLOTS,
};

use crate::aggregate;
use crate::jobs::{EpochRecord, StageTime, StepRecord};

/// A stage is a straggler once its compute time per step has been more than
/// this many times the job's typical ratio of measured to planned time ...
pub const STRAGGLER_FACTOR: f64 = 3.0;
/// ... for this many consecutive steps ...
pub const STRAGGLER_STEPS: u32 = 3;
/// ... computing at least this long per step: below it, fixed per-message
/// costs swamp the plan's estimate, and the stage cannot stall much anyway.
pub const STRAGGLER_MIN_MS: f64 = 20.0;

/// What the coordinator must do on the job's behalf, in order.
#[derive(Debug)]
pub enum Effect {
    Send(u64, ToProvider),
    Running,
    Step(StepRecord),
    Epoch(EpochRecord),
    /// The latest averaged parameters, to keep as the checkpoint.
    Checkpoint(Vec<WeightTensor>),
    /// Everything a restarted server needs to resume from the checkpoint just
    /// taken (it follows [`Effect::Checkpoint`]).
    ResumePoint(Box<ResumePoint>),
    /// A line for the job's event log (`kind` is a short word).
    Log {
        kind: &'static str,
        message: String,
    },
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

/// A sync point's whole state: enough to rebuild every stage of every
/// cluster, on any providers, exactly as it stood.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumePoint {
    /// Steps done.
    pub step: u64,
    /// Every parameter and buffer (constants too), averaged.
    pub params: Vec<WeightTensor>,
    /// Per cluster: the optimizer state of each parameter its stages update.
    pub optimizer: Vec<Vec<ParamOptimState>>,
}

/// A stage without a provider, and what a replacement must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vacancy {
    pub cluster: usize,
    pub stage: usize,
    /// The planner's memory estimate for the stage.
    pub memory_bytes: u64,
}

/// A stage whose provider has been far slower than planned, compared with
/// the job's other stages, for [`STRAGGLER_STEPS`] steps in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggler {
    pub cluster: usize,
    pub stage: usize,
    pub provider: u64,
    /// How many times slower than the job's typical stage, against plan.
    pub slowness: f64,
    pub memory_bytes: u64,
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
    /// The provider left and no other has taken the stage yet.
    vacant: bool,
    /// Node range and boundary outputs, as the `Assign` carries them.
    first: usize,
    end: usize,
    output_names: Vec<String>,
    /// Boundary tensors in and out: (name, per-sample shape, dtype).
    inputs: Vec<(String, Vec<usize>, DType)>,
    outputs: Vec<(String, Vec<usize>, DType)>,
    params: Vec<String>,
    memory_bytes: u64,
    /// The plan's compute estimate for one step (all its micro-batches), ms.
    planned_ms: f64,
    /// The last step's measured compute over `planned_ms`.
    slowness: Option<f64>,
    /// Consecutive steps this stage was a straggler.
    slow_steps: u32,
    ready: bool,
    step_done: bool,
    compute_ms: f64,
    uploaded: bool,
}

/// Where one cluster stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ClusterState {
    /// `Assign` sent to every stage; waiting for each `Ready`.
    Assigning,
    /// A stage has no provider.
    Waiting,
    Training {
        step: u64,
    },
    /// Ready and idle: at the sync barrier, syncing or evaluating.
    Idle,
}

/// What one cluster measured in one training step.
#[derive(Debug, Clone)]
struct ClusterStep {
    loss_sum: f64,
    samples: u64,
    /// (provider, compute ms) per stage.
    stages: Vec<(u64, f64)>,
}

#[derive(Debug)]
struct ClusterRun {
    stages: Vec<StageSlot>,
    state: ClusterState,
    /// Steps done but not yet recorded (other clusters have not done them).
    finished: BTreeMap<u64, ClusterStep>,
    /// Optimizer state of the cluster's stages at the last sync, by parameter.
    optimizer: BTreeMap<String, ParamOptimState>,
    /// Optimizer state uploaded during the sync in progress.
    pending_optimizer: BTreeMap<String, ParamOptimState>,
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
    /// Before the first step (or the first after a resume): every cluster's
    /// stages are being assigned.
    Assigning,
    /// Clusters run steps, each at its own pace, up to the next barrier.
    Training,
    Syncing {
        step_done: u64,
    },
    Evaluating {
        epoch: u64,
        expected: u64,
    },
    Over,
}

pub struct JobRun {
    pub job_id: u64,
    spec: JobSpec,
    graph_input: (String, DType),
    /// The model graph as providers get it (values travel as tensors).
    graph_json: String,
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
    /// Steps done at the last sync: the checkpoint every rebuild starts from.
    synced: u64,
    /// A sync whose uploads are still coming in while its only cluster trains
    /// on (see [`JobRun::syncs_in_background`]): the steps it was taken at.
    background_sync: Option<u64>,
    /// Steps whose record went out (every cluster did them).
    recorded: u64,
    /// When the current step's clock started: the previous record (so syncs
    /// and gaps between steps count), or the start of an epoch's first step
    /// (evaluation does not count).
    step_started: Instant,
    bytes_relayed: u64,
}

/// Why a job cannot start on the plan it was given.
pub type StartError = String;

impl JobRun {
    /// Builds the run and the `Assign` frames for every stage of `plan`.
    /// `graph` is the model as imported (with its initial values), `analysis`
    /// its analysis at the micro-batch size. With `resume`, the run starts
    /// from that sync point instead of step 0 (it must have as many clusters
    /// as the plan: the data's sharding depends on the count).
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
        resume: Option<ResumePoint>,
    ) -> Result<(Self, Vec<Effect>), StartError> {
        let t = &spec.training;
        let schedule = Schedule::new(train.len(), plan.clusters.len(), t.batch_size)
            .map_err(|e| e.to_string())?;
        let total_steps = schedule.steps_per_epoch as u64 * t.epochs;
        let input = graph
            .inputs
            .first()
            .ok_or_else(|| "the model has no input".to_string())?;
        let mut initial = graph.initial_values(t.seed);
        if let Some(resume) = &resume {
            if resume.optimizer.len() != plan.clusters.len() {
                return Err(format!(
                    "the checkpoint has {} clusters, the plan {}",
                    resume.optimizer.len(),
                    plan.clusters.len()
                ));
            }
            if resume.step > total_steps {
                return Err(format!(
                    "the checkpoint is at step {}, past the job's {total_steps} steps",
                    resume.step
                ));
            }
            for w in &resume.params {
                let Some(p) = graph.params.iter().find(|p| p.name == w.name) else {
                    return Err(format!(
                        "the checkpoint holds unknown parameter `{}`",
                        w.name
                    ));
                };
                if p.shape != w.shape {
                    return Err(format!(
                        "the checkpoint's `{}` has shape {:?}, the model's {:?}",
                        w.name, w.shape, p.shape
                    ));
                }
                initial.insert(w.name.clone(), w.values.clone());
            }
        }
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
        let micro_batches = t.micro_batches.max(1) as f64;
        let mut optimizer = resume.as_ref().map(|r| r.optimizer.clone());
        let mut clusters = Vec::with_capacity(plan.clusters.len());
        for (ci, cluster) in plan.clusters.iter().enumerate() {
            let mut stages = Vec::with_capacity(cluster.stages.len());
            for stage in &cluster.stages {
                let provider = *provider_ids
                    .get(&stage.provider)
                    .ok_or_else(|| format!("the plan names unknown provider {}", stage.provider))?;
                let mut names: Vec<String> = analysis.nodes[stage.first..stage.end]
                    .iter()
                    .flat_map(|n| n.params.iter().cloned())
                    .collect();
                names.sort();
                names.dedup();
                let outputs: Vec<String> = stage.outputs.iter().map(|b| b.name.clone()).collect();
                stages.push(StageSlot {
                    provider,
                    vacant: false,
                    first: stage.first,
                    end: stage.end,
                    inputs: stage.inputs.iter().map(|b| per_sample(&b.name)).collect(),
                    outputs: outputs.iter().map(|n| per_sample(n)).collect(),
                    output_names: outputs,
                    params: names,
                    memory_bytes: stage.memory_bytes,
                    planned_ms: stage.compute_s * 1e3 * micro_batches,
                    slowness: None,
                    slow_steps: 0,
                    ready: false,
                    step_done: false,
                    compute_ms: 0.0,
                    uploaded: false,
                });
            }
            let state = optimizer
                .as_mut()
                .map(|o| std::mem::take(&mut o[ci]))
                .unwrap_or_default();
            clusters.push(ClusterRun {
                stages,
                state: ClusterState::Assigning,
                finished: BTreeMap::new(),
                optimizer: state.into_iter().map(|s| (s.name.clone(), s)).collect(),
                pending_optimizer: BTreeMap::new(),
                labels: HashMap::new(),
                micro_samples: HashMap::new(),
                reported: Default::default(),
                loss_sum: 0.0,
                correct: 0,
                samples: 0,
            });
        }
        let synced = resume.as_ref().map_or(0, |r| r.step);
        let mut run = JobRun {
            job_id,
            graph_input: (input.name.clone(), input.dtype),
            graph_json,
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
            synced,
            background_sync: None,
            recorded: synced,
            step_started: Instant::now(),
            bytes_relayed: 0,
        };
        let effects = (0..run.clusters.len())
            .flat_map(|c| run.rebuild(c))
            .collect();
        Ok((run, effects))
    }

    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Steps done at the last sync (the checkpoint a rebuild starts from).
    pub fn synced_step(&self) -> u64 {
        self.synced
    }

    /// Every provider the job uses.
    pub fn providers(&self) -> Vec<u64> {
        self.clusters
            .iter()
            .flat_map(|c| c.stages.iter().filter(|s| !s.vacant).map(|s| s.provider))
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
            .map(|(name, v)| weight(name, v))
            .collect()
    }

    fn locate(&self, provider: u64) -> Option<(usize, usize)> {
        self.clusters.iter().enumerate().find_map(|(c, run)| {
            run.stages
                .iter()
                .position(|s| s.provider == provider && !s.vacant)
                .map(|s| (c, s))
        })
    }

    /// The `Assign` of stage `s` of cluster `c`, from the last checkpoint.
    fn assignment(&self, c: usize, s: usize) -> Assignment {
        let t = &self.spec.training;
        let run = &self.clusters[c];
        let stage = &run.stages[s];
        Assignment {
            job_id: self.job_id,
            cluster: c as u32,
            stage: s as u32,
            stages: run.stages.len() as u32,
            graph_json: self.graph_json.clone(),
            first: stage.first as u32,
            end: stage.end as u32,
            outputs: stage.output_names.clone(),
            params: stage
                .params
                .iter()
                .filter_map(|n| self.params.get(n).map(|v| param_tensor(n, v)))
                .collect(),
            optimizer: t.optimizer,
            loss: t.loss,
            batch_size: t.batch_size as u32,
            micro_batches: t.micro_batches as u32,
            wire_dtype: t.wire_dtype,
            seed: t.seed,
            start_step: self.synced,
            optimizer_state: stage
                .params
                .iter()
                .filter_map(|n| run.optimizer.get(n).cloned())
                .collect(),
        }
    }

    /// Puts cluster `c` back to the last checkpoint: every stage is assigned
    /// afresh (the survivors too, which drops whatever they were doing), or,
    /// while a stage has no provider, the cluster waits for one.
    fn rebuild(&mut self, c: usize) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        run.reset();
        run.finished.clear();
        for stage in &mut run.stages {
            stage.ready = false;
            stage.step_done = false;
            stage.uploaded = false;
            stage.compute_ms = 0.0;
            stage.slow_steps = 0;
        }
        if run.stages.iter().any(|s| s.vacant) {
            run.state = ClusterState::Waiting;
            return Vec::new();
        }
        run.state = ClusterState::Assigning;
        (0..self.clusters[c].stages.len())
            .map(|s| {
                Effect::Send(
                    self.clusters[c].stages[s].provider,
                    ToProvider::Assign(Box::new(self.assignment(c, s))),
                )
            })
            .collect()
    }

    /// The provider of a stage is gone (its socket closed, it stopped
    /// heartbeating, or it was dropped for misbehaving): its cluster rolls
    /// back to the last checkpoint and waits for [`JobRun::fill`]; the other
    /// clusters train on to the next barrier. Returns `None` if the provider
    /// runs no stage of this job.
    pub fn stage_lost(&mut self, provider: u64, reason: &str) -> Option<Vec<Effect>> {
        let (c, s) = self.locate(provider)?;
        if self.state == State::Over {
            return Some(Vec::new());
        }
        self.clusters[c].stages[s].vacant = true;
        let mut effects = vec![Effect::Log {
            kind: "stage_lost",
            message: format!(
                "cluster {c}, stage {s}: provider {provider} left ({reason}); the cluster rolls back to step {} (the last checkpoint)",
                self.synced
            ),
        }];
        if matches!(self.state, State::Syncing { .. }) || self.background_sync.is_some() {
            // The sync needs this cluster's values at the barrier, which it must
            // replay to reach again; every cluster uploads afresh then.
            self.abandon_sync();
        }
        effects.extend(self.rebuild(c));
        Some(effects)
    }

    fn abandon_sync(&mut self) {
        self.state = State::Training;
        self.background_sync = None;
        self.uploads.clear();
        for run in &mut self.clusters {
            run.pending_optimizer.clear();
            for stage in &mut run.stages {
                stage.uploaded = false;
            }
        }
    }

    /// Stages in cluster `c`.
    pub fn stage_count(&self, c: usize) -> usize {
        self.clusters.get(c).map_or(0, |r| r.stages.len())
    }

    /// Stages waiting for a provider.
    pub fn vacancies(&self) -> Vec<Vacancy> {
        self.clusters
            .iter()
            .enumerate()
            .flat_map(|(c, run)| {
                run.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.vacant)
                    .map(move |(s, stage)| Vacancy {
                        cluster: c,
                        stage: s,
                        memory_bytes: stage.memory_bytes,
                    })
            })
            .collect()
    }

    /// `provider` takes the vacant stage `s` of cluster `c`. Once the cluster
    /// has no vacancy left it is rebuilt from the last checkpoint.
    pub fn fill(&mut self, c: usize, s: usize, provider: u64) -> Vec<Effect> {
        let Some(stage) = self.clusters.get_mut(c).and_then(|r| r.stages.get_mut(s)) else {
            return Vec::new();
        };
        if !stage.vacant || self.state == State::Over {
            return Vec::new();
        }
        stage.vacant = false;
        stage.provider = provider;
        stage.slowness = None;
        let replayed = self.recorded.saturating_sub(self.synced);
        let mut effects = Vec::new();
        if self.clusters[c].stages.iter().all(|s| !s.vacant) {
            effects.push(Effect::Log {
                kind: "stage_reassigned",
                message: format!(
                    "cluster {c}, stage {s} reassigned to provider {provider}; the cluster restarts from the checkpoint at step {} ({replayed} recorded steps to replay)",
                    self.synced
                ),
            });
            effects.extend(self.rebuild(c));
        }
        effects
    }

    /// Moves stage `s` of cluster `c` onto `provider` (a straggler's stage
    /// going to a faster standby): the old provider is released and the
    /// cluster rebuilt from the last checkpoint. Meant for a sync boundary,
    /// where the checkpoint is the cluster's current state.
    pub fn replace(&mut self, c: usize, s: usize, provider: u64, why: &str) -> Vec<Effect> {
        let Some(old) = self.clusters.get(c).and_then(|r| r.stages.get(s)) else {
            return Vec::new();
        };
        if old.vacant || self.state == State::Over {
            return Vec::new();
        }
        let old = old.provider;
        let mut effects = vec![Effect::Send(
            old,
            ToProvider::Release {
                job_id: self.job_id,
            },
        )];
        effects.extend(self.stage_lost(old, why).unwrap_or_default());
        effects.extend(self.fill(c, s, provider));
        effects
    }

    /// Stages that have been [`STRAGGLER_FACTOR`] times slower than the
    /// job's typical stage (each against its plan) for [`STRAGGLER_STEPS`]
    /// steps in a row, computing at least [`STRAGGLER_MIN_MS`] a step.
    pub fn stragglers(&self) -> Vec<Straggler> {
        let typical = self.typical_slowness();
        self.clusters
            .iter()
            .enumerate()
            .flat_map(|(c, run)| {
                run.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !s.vacant && s.slow_steps >= STRAGGLER_STEPS)
                    .map(move |(s, stage)| Straggler {
                        cluster: c,
                        stage: s,
                        provider: stage.provider,
                        slowness: stage.slowness.unwrap_or(0.0) / typical,
                        memory_bytes: stage.memory_bytes,
                    })
            })
            .collect()
    }

    /// The median of every stage's measured over planned time: plans can be
    /// off by a constant factor for every stage alike, which is no straggling.
    fn typical_slowness(&self) -> f64 {
        let mut all: Vec<f64> = self
            .clusters
            .iter()
            .flat_map(|r| r.stages.iter().filter_map(|s| s.slowness))
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        if all.is_empty() {
            return 1.0;
        }
        all.sort_by(f64::total_cmp);
        all[(all.len() - 1) / 2]
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
        let rebuilding = matches!(
            self.clusters[c].state,
            ClusterState::Assigning | ClusterState::Waiting
        );
        let result = match message {
            ToServer::Ready { job_id } => self.check_job(job_id).map(|()| self.on_ready(c, s)),
            // Until its cluster is rebuilt, a stage's frames are left over from
            // the steps being rolled back.
            ToServer::Activations(_)
            | ToServer::Gradients(_)
            | ToServer::LeafLoss(_)
            | ToServer::StepDone(_)
            | ToServer::Params(_)
            | ToServer::OptimizerState(_)
                if rebuilding =>
            {
                Ok(Vec::new())
            }
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
            ToServer::OptimizerState(o) => self
                .check_job(o.job_id)
                .and_then(|()| self.on_optimizer_state(c, s, o)),
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
        let run = &mut self.clusters[c];
        if run.state != ClusterState::Assigning {
            return Vec::new();
        }
        run.stages[s].ready = true;
        if !run.stages.iter().all(|s| s.ready) {
            return Vec::new();
        }
        run.state = ClusterState::Idle;
        match self.state {
            State::Assigning => {
                if !self.clusters.iter().all(|r| r.state == ClusterState::Idle) {
                    return Vec::new();
                }
                let mut effects = vec![Effect::Running];
                effects.extend(self.begin());
                effects
            }
            // A rebuilt cluster replays from the checkpoint.
            State::Training => {
                let step = self.synced;
                if step == self.barrier() {
                    self.at_barrier()
                } else {
                    self.start_cluster_step(c, step)
                }
            }
            // Its share of the test set again, from the start.
            State::Evaluating { epoch, .. } => self.feed_eval(c, epoch),
            State::Syncing { .. } | State::Over => Vec::new(),
        }
    }

    /// The first step once every stage is ready, or after a resume: a
    /// checkpoint taken at an epoch's end may still owe that epoch's
    /// evaluation (running it again records the same figures).
    fn begin(&mut self) -> Vec<Effect> {
        let spe = self.schedule.steps_per_epoch as u64;
        if self.synced > 0
            && self.synced.is_multiple_of(spe)
            && let Some(eval) = self.start_eval(self.synced / spe - 1)
        {
            return eval;
        }
        self.next_or_finish(self.synced)
    }

    /// The steps done at the next sync: a multiple of `sync_every`, an
    /// epoch's end or the last step, whichever comes first.
    fn barrier(&self) -> u64 {
        let spe = self.schedule.steps_per_epoch as u64;
        let every = self.spec.training.sync_every.max(1);
        let last = self.background_sync.unwrap_or(self.synced);
        let next = |m: u64| (last / m + 1) * m;
        next(every)
            .min(next(spe))
            .min(self.total_steps.max(last + 1))
    }

    /// Starts the sync once every cluster waits at the barrier (and the one
    /// before it is complete).
    fn at_barrier(&mut self) -> Vec<Effect> {
        if self.state != State::Training
            || self.background_sync.is_some()
            || !self.clusters.iter().all(|r| r.state == ClusterState::Idle)
        {
            return Vec::new();
        }
        let step_done = self.barrier();
        if self.syncs_in_background(step_done) {
            self.background_sync = Some(step_done);
            let mut effects = self.request_uploads(step_done);
            effects.extend(self.start_step(step_done));
            effects
        } else {
            self.state = State::Syncing { step_done };
            self.request_uploads(step_done)
        }
    }

    /// Whether the sync at `step_done` may run while training goes on. With
    /// one cluster there is nothing to average, so the next step needs no
    /// new parameters: the sync only takes the checkpoint. Each stage
    /// handles its messages in order, so `UploadParams` sent before the next
    /// step's micro-batches uploads exactly the values after `step_done`
    /// steps, and the pipeline does not drain and wait for a round trip of
    /// uploads every step. Not at an epoch's end (the evaluation must see
    /// the checkpoint) nor at the last step (the job's weights are the
    /// checkpoint's).
    fn syncs_in_background(&self, step_done: u64) -> bool {
        let spe = self.schedule.steps_per_epoch as u64;
        self.clusters.len() == 1 && !step_done.is_multiple_of(spe) && step_done < self.total_steps
    }

    fn current_phase_ok(&self, c: usize, phase: Phase) -> Result<(), String> {
        let cluster = self.clusters[c].state;
        match (self.state, cluster, phase) {
            (State::Training, ClusterState::Training { step }, Phase::Train { step: got })
                if step == got =>
            {
                Ok(())
            }
            (State::Evaluating { epoch, .. }, ClusterState::Idle, Phase::Eval { epoch: got })
                if epoch == u64::from(got) =>
            {
                Ok(())
            }
            (state, cluster, phase) => Err(format!(
                "{phase:?} does not match the job's state {state:?} (cluster {c}: {cluster:?})"
            )),
        }
    }

    /// Every cluster starts `step` (after a sync or an evaluation).
    fn start_step(&mut self, step: u64) -> Vec<Effect> {
        self.state = State::Training;
        let spe = self.schedule.steps_per_epoch as u64;
        if step.is_multiple_of(spe) {
            self.step_started = Instant::now();
        }
        let mut effects = Vec::new();
        for c in 0..self.clusters.len() {
            if self.clusters[c].state == ClusterState::Idle {
                effects.extend(self.start_cluster_step(c, step));
            }
        }
        effects
    }

    fn start_cluster_step(&mut self, c: usize, step: u64) -> Vec<Effect> {
        let spe = self.schedule.steps_per_epoch as u64;
        let epoch = step / spe;
        if self.perm_epoch != Some(epoch) {
            let t = &self.spec.training;
            self.perm = epoch_permutation(self.train.len(), t.seed, epoch, t.shuffle);
            self.perm_epoch = Some(epoch);
        }
        let phase = Phase::Train { step };
        let batch = self.spec.training.batch_size;
        let ranges = micro_batch_ranges(batch, self.spec.training.micro_batches);
        let idx = self
            .schedule
            .batch(&self.perm, (step % spe) as usize, c)
            .to_vec();
        let run = &mut self.clusters[c];
        run.state = ClusterState::Training { step };
        for stage in &mut run.stages {
            stage.step_done = false;
            stage.compute_ms = 0.0;
        }
        run.reset();
        let mut effects = Vec::new();
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
        effects
    }

    fn on_activations(
        &mut self,
        c: usize,
        s: usize,
        a: Activations,
    ) -> Result<Vec<Effect>, Rejected> {
        self.current_phase_ok(c, a.phase)?;
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
            self.spec.training.wire_dtype,
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
        self.current_phase_ok(c, Phase::Train { step: g.step })?;
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
        check_tensors(&g.grads, &expected, samples, self.spec.training.wire_dtype)
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
        self.current_phase_ok(c, l.phase)?;
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
        self.current_phase_ok(c, Phase::Train { step: d.step })?;
        let stage = &mut self.clusters[c].stages[s];
        if stage.step_done {
            return Err(format!("step {} was already reported done", d.step).into());
        }
        stage.step_done = true;
        // The provider's total is authoritative; what the relays counted was partial.
        stage.compute_ms = d.compute_ms.max(0.0);
        if !self.clusters[c].stages.iter().all(|s| s.step_done) {
            return Ok(Vec::new());
        }
        Ok(self.finish_cluster_step(c, d.step))
    }

    /// Cluster `c` has done `step`: its totals wait for the other clusters'
    /// (unless the step was recorded before a rollback), and it goes on to
    /// the next step or waits at the barrier.
    fn finish_cluster_step(&mut self, c: usize, step: u64) -> Vec<Effect> {
        let run = &mut self.clusters[c];
        if step >= self.recorded {
            let totals = ClusterStep {
                loss_sum: run.loss_sum,
                samples: run.samples,
                stages: run
                    .stages
                    .iter()
                    .map(|s| (s.provider, s.compute_ms))
                    .collect(),
            };
            run.finished.insert(step, totals);
        }
        for stage in &mut run.stages {
            if stage.planned_ms > 0.0 {
                stage.slowness = Some(stage.compute_ms / stage.planned_ms);
            }
        }
        self.count_slow_steps(c);
        let mut effects = self.record_steps();
        let done = step + 1;
        if done == self.barrier() {
            self.clusters[c].state = ClusterState::Idle;
            effects.extend(self.at_barrier());
        } else {
            effects.extend(self.start_cluster_step(c, done));
        }
        effects
    }

    fn count_slow_steps(&mut self, c: usize) {
        let typical = self.typical_slowness();
        for stage in &mut self.clusters[c].stages {
            match stage.slowness {
                Some(v)
                    if v > STRAGGLER_FACTOR * typical && stage.compute_ms >= STRAGGLER_MIN_MS =>
                {
                    stage.slow_steps += 1
                }
                _ => stage.slow_steps = 0,
            }
        }
    }

    /// Records every step all clusters have done, in order.
    fn record_steps(&mut self) -> Vec<Effect> {
        let mut effects = Vec::new();
        while self
            .clusters
            .iter()
            .all(|r| r.finished.contains_key(&self.recorded))
        {
            let step = self.recorded;
            let parts: Vec<ClusterStep> = self
                .clusters
                .iter_mut()
                .filter_map(|r| r.finished.remove(&step))
                .collect();
            effects.push(Effect::Step(self.step_record(step, &parts)));
            self.recorded += 1;
        }
        effects
    }

    fn step_record(&mut self, step: u64, parts: &[ClusterStep]) -> StepRecord {
        let elapsed_ms = self.step_started.elapsed().as_secs_f64() * 1e3;
        self.step_started = Instant::now();
        let samples: u64 = parts.iter().map(|p| p.samples).sum();
        let loss = parts.iter().map(|p| p.loss_sum).sum::<f64>() / samples.max(1) as f64;
        let spe = self.schedule.steps_per_epoch as u64;
        let stages = parts
            .iter()
            .enumerate()
            .flat_map(|(c, part)| {
                part.stages
                    .iter()
                    .enumerate()
                    .map(move |(s, &(provider, compute_ms))| StageTime {
                        cluster: c as u32,
                        stage: s as u32,
                        provider,
                        compute_ms,
                        idle_ms: (elapsed_ms - compute_ms).max(0.0),
                    })
            })
            .collect();
        StepRecord {
            step,
            epoch: step / spe,
            loss,
            samples_per_s: samples as f64 / (elapsed_ms / 1e3).max(1e-9),
            elapsed_ms,
            bytes_relayed: std::mem::take(&mut self.bytes_relayed),
            stages,
        }
    }

    /// Asks every stage for its parameters (and optimizer state) after
    /// `step_done` steps.
    fn request_uploads(&mut self, step_done: u64) -> Vec<Effect> {
        self.uploads.clear();
        let mut effects = Vec::new();
        for run in &mut self.clusters {
            run.pending_optimizer.clear();
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

    /// The sync in progress, if an upload of `what` stamped `step` belongs
    /// to it.
    fn sync_step_of(&self, what: &str, step: u64) -> Result<u64, Rejected> {
        let step_done = match (self.state, self.background_sync) {
            (State::Syncing { step_done }, _) | (State::Training, Some(step_done)) => step_done,
            _ => return Err(format!("{what} arrived outside a sync").into()),
        };
        if step != step_done {
            return Err(
                format!("{what} of step {step} during the sync of step {step_done}").into(),
            );
        }
        Ok(step_done)
    }

    /// A stage's optimizer state, which it sends just before its parameters
    /// at a sync; kept per cluster for the checkpoint.
    fn on_optimizer_state(
        &mut self,
        c: usize,
        s: usize,
        o: OptimizerState,
    ) -> Result<Vec<Effect>, Rejected> {
        self.sync_step_of("optimizer state", o.step)?;
        let stage = &self.clusters[c].stages[s];
        if stage.uploaded {
            return Err("optimizer state after the stage's parameters".into());
        }
        for p in &o.params {
            if !stage.params.contains(&p.name) {
                return Err(Rejected::Fault(format!(
                    "parameter `{}` is not one of the stage's",
                    p.name
                )));
            }
            let shape = self
                .params
                .get(&p.name)
                .map(|v| v.shape.clone())
                .unwrap_or_default();
            for t in &p.slots {
                if !OPTIMIZER_SLOTS.contains(&t.name.as_str()) {
                    return Err(Rejected::Fault(format!(
                        "`{}` is not an optimizer state slot",
                        t.name
                    )));
                }
                if t.shape_usize() != shape || t.dtype != WireDType::F32 {
                    return Err(Rejected::Fault(format!(
                        "optimizer state `{}` of `{}` is {:?} {}, expected {shape:?} f32",
                        t.name,
                        p.name,
                        t.shape,
                        t.dtype.as_str()
                    )));
                }
                t.check().map_err(|e| Rejected::Fault(e.to_string()))?;
            }
        }
        let pending = &mut self.clusters[c].pending_optimizer;
        for p in o.params {
            pending.insert(p.name.clone(), p);
        }
        Ok(Vec::new())
    }

    /// The sync of `step_done` is complete: its optimizer state becomes the
    /// checkpoint's, and a restarted server can resume from here.
    fn commit_sync(&mut self, step_done: u64) -> Effect {
        self.synced = step_done;
        for run in &mut self.clusters {
            run.optimizer = std::mem::take(&mut run.pending_optimizer);
        }
        Effect::ResumePoint(Box::new(ResumePoint {
            step: step_done,
            params: self.params.iter().map(|(n, v)| weight(n, v)).collect(),
            optimizer: self
                .clusters
                .iter()
                .map(|r| r.optimizer.values().cloned().collect())
                .collect(),
        }))
    }

    fn on_params(&mut self, c: usize, s: usize, p: ParamSet) -> Result<Vec<Effect>, Rejected> {
        let step_done = self.sync_step_of("parameters", p.step)?;
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
        // Counted after the sync's own effects: the sync completes either way.
        let mut faults = Vec::new();
        if rule != Aggregation::Mean {
            for c in aggregate::far_off(&squared_distances, squared_norm) {
                let typical = squared_distances
                    .iter()
                    .map(|d| d.sqrt())
                    .fold(f64::INFINITY, f64::min);
                for stage in &self.clusters[c].stages {
                    faults.push(Effect::Fault {
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
        effects.push(self.commit_sync(step_done));
        if self.background_sync.take().is_some() {
            // Training went on; the cluster may already wait at the next barrier.
            effects.extend(self.at_barrier());
            effects.extend(faults);
            return effects;
        }
        let spe = self.schedule.steps_per_epoch as u64;
        if step_done.is_multiple_of(spe)
            && let Some(eval) = self.start_eval(step_done / spe - 1)
        {
            effects.extend(eval);
            effects.extend(faults);
            return effects;
        }
        effects.extend(self.next_or_finish(step_done));
        effects.extend(faults);
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
        self.state = State::Evaluating {
            epoch,
            expected: test.len() as u64,
        };
        let effects = (0..self.clusters.len())
            .flat_map(|c| self.feed_eval(c, epoch))
            .collect();
        Some(effects)
    }

    /// Cluster `c`'s share of the test set, from its first micro-batch.
    fn feed_eval(&mut self, c: usize, epoch: u64) -> Vec<Effect> {
        let Some(test) = self.test.as_ref() else {
            return Vec::new();
        };
        let n = test.len();
        let clusters = self.clusters.len();
        let phase = Phase::Eval {
            epoch: epoch as u32,
        };
        let micro = self.spec.micro_batch_size().max(1);
        let run = &mut self.clusters[c];
        run.reset();
        let idx: Vec<usize> = ((c * n / clusters)..((c + 1) * n / clusters)).collect();
        idx.chunks(micro)
            .enumerate()
            .map(|(m, chunk)| {
                feed(
                    &self.graph_input,
                    test,
                    run,
                    self.job_id,
                    phase,
                    m as u32,
                    chunk.len(),
                    chunk,
                )
            })
            .collect()
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

fn weight(name: &str, v: &ParamValue) -> WeightTensor {
    match v.dtype {
        DType::F32 => WeightTensor::f32(name, v.shape.clone(), v.values.clone()),
        DType::I64 => WeightTensor::i64(name, v.shape.clone(), v.values.clone()),
    }
}

fn param_tensor(name: &str, v: &ParamValue) -> WireTensor {
    WireTensor::from_f32(name, &v.shape, &v.values, on_wire(v.dtype, WireDType::F32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_job::{DataFormat, DataRef, DataSpec, ModelSection, ModelSource, TrainingSpec};
    use rookery_model::{ClusterCount, Loss, OptimizerConfig};
    use rookery_plan::{PlanOptions, ProviderKind, ProviderSpec};

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
                wire_dtype: WireDType::F32,
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
                max_buffer_bytes: None,
            })
            .collect();
        let options = PlanOptions {
            micro_batch: 2,
            clusters: ClusterCount::Fixed(clusters),
            stages_per_cluster: Some(2),
            ..PlanOptions::default()
        };
        let plan = rookery_plan::clusterize(&graph, &providers, &options).unwrap();
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
            None,
        )
        .unwrap()
    }

    /// Puts `run` at the sync of step 1, every cluster at the barrier.
    fn syncing(run: &mut JobRun) {
        run.state = State::Syncing { step_done: 1 };
        for cluster in &mut run.clusters {
            cluster.state = ClusterState::Idle;
        }
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
            (8, 10),
            "4 SetParams, 4 forwards, a checkpoint and its resume point"
        );
        assert!(
            last.iter()
                .any(|e| matches!(e, Effect::ResumePoint(r) if r.step == 1))
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
            syncing(&mut run);
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
            syncing(&mut run);
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

    /// A stand-in for the providers: each answers the server's frames as a
    /// stage would, with values that depend on the data it is fed (the loss
    /// of a micro-batch is the sum of its inputs' first features) and on the
    /// steps trained since its `Assign` (each step adds 1 to every parameter,
    /// and the optimizer's `momentum_buffer` counts updates), so a replay on
    /// other batches or from other values would show.
    #[derive(Default)]
    struct Sim {
        /// Provider id -> its stage; providers not in it are gone.
        stages: BTreeMap<u64, FakeStage>,
        alive: std::collections::BTreeSet<u64>,
        queue: std::collections::VecDeque<(u64, ToProvider)>,
        /// Every effect that is not a frame, in order.
        out: Vec<Effect>,
        /// Every Assign sent, to whom.
        assigns: Vec<(u64, Assignment)>,
        /// Each stage's compute per step, times its `slow`.
        step_ms: f64,
    }

    struct FakeStage {
        stage: u32,
        stages: u32,
        params: Vec<(String, Vec<usize>, Vec<f32>)>,
        optimizer: BTreeMap<String, u64>,
        outputs: Vec<String>,
        micro_batches: u32,
        /// Backward passes done in the current step.
        done: u32,
        slow: f64,
    }

    impl Sim {
        fn new(providers: impl IntoIterator<Item = u64>) -> Self {
            Sim {
                alive: providers.into_iter().collect(),
                step_ms: 10.0,
                ..Sim::default()
            }
        }

        fn push(&mut self, effects: Vec<Effect>) {
            for e in effects {
                match e {
                    Effect::Send(p, m) => self.queue.push_back((p, m)),
                    other => self.out.push(other),
                }
            }
        }

        /// Delivers frames until `stop` holds or nothing is left to deliver.
        fn run_until(&mut self, run: &mut JobRun, stop: impl Fn(&JobRun) -> bool) {
            while !stop(run) {
                let Some((p, m)) = self.queue.pop_front() else {
                    return;
                };
                if !self.alive.contains(&p) {
                    continue;
                }
                for reply in self.answer(p, m) {
                    let effects = run.on_message(p, reply);
                    self.push(effects);
                }
            }
        }

        fn kill(&mut self, run: &mut JobRun, p: u64) {
            self.alive.remove(&p);
            self.stages.remove(&p);
            let effects = run.stage_lost(p, "killed").expect("a provider of the job");
            self.push(effects);
        }

        fn steps(&self) -> Vec<(u64, f64)> {
            self.out
                .iter()
                .filter_map(|e| match e {
                    Effect::Step(r) => Some((r.step, r.loss)),
                    _ => None,
                })
                .collect()
        }

        fn completed(&self) -> Option<&Vec<WeightTensor>> {
            self.out.iter().find_map(|e| match e {
                Effect::Completed(w) => Some(w),
                _ => None,
            })
        }

        fn answer(&mut self, p: u64, m: ToProvider) -> Vec<ToServer> {
            let job_id = 1;
            if let ToProvider::Assign(a) = m {
                self.assigns.push((p, (*a).clone()));
                let params = a
                    .params
                    .iter()
                    .map(|t| (t.name.clone(), t.shape_usize(), t.to_f32().unwrap()))
                    .collect();
                let optimizer = a
                    .optimizer_state
                    .iter()
                    .map(|o| (o.name.clone(), o.steps))
                    .collect();
                let slow = self.stages.get(&p).map_or(1.0, |s| s.slow);
                self.stages.insert(
                    p,
                    FakeStage {
                        stage: a.stage,
                        stages: a.stages,
                        params,
                        optimizer,
                        outputs: a.outputs.clone(),
                        micro_batches: a.micro_batches,
                        done: 0,
                        slow,
                    },
                );
                return vec![ToServer::Ready { job_id }];
            }
            let Some(st) = self.stages.get_mut(&p) else {
                return Vec::new();
            };
            let leaf = st.stage + 1 == st.stages;
            let step_ms = self.step_ms;
            let mut out = Vec::new();
            let step_over = |st: &mut FakeStage, step: u64, out: &mut Vec<ToServer>| {
                st.done += 1;
                if st.done == st.micro_batches {
                    st.done = 0;
                    for (name, _, values) in &mut st.params {
                        values.iter_mut().for_each(|v| *v += 1.0);
                        *st.optimizer.entry(name.clone()).or_default() += 1;
                    }
                    out.push(ToServer::StepDone(StepDone {
                        job_id,
                        step,
                        compute_ms: step_ms * st.slow,
                    }));
                }
            };
            match m {
                ToProvider::Forward(f) => {
                    let x = f.inputs[0].to_f32().unwrap();
                    let n = f.inputs[0].shape[0] as usize;
                    let width = x.len() / n.max(1);
                    let first: Vec<f32> = (0..n).map(|i| x[i * width]).collect();
                    if !leaf {
                        let values: Vec<f32> = first
                            .iter()
                            .flat_map(|v| std::iter::repeat_n(*v, 8))
                            .collect();
                        out.push(ToServer::Activations(Activations {
                            job_id,
                            phase: f.phase,
                            micro: f.micro,
                            outputs: vec![WireTensor::from_f32(
                                st.outputs[0].clone(),
                                &[n, 8],
                                &values,
                                WireDType::F32,
                            )],
                            compute_ms: 1.0,
                        }));
                        return out;
                    }
                    out.push(ToServer::LeafLoss(LeafLoss {
                        job_id,
                        phase: f.phase,
                        micro: f.micro,
                        loss_sum: first.iter().map(|v| f64::from(*v)).sum(),
                        correct: 0,
                        samples: n as u32,
                    }));
                    if let Phase::Train { step } = f.phase {
                        if st.stage > 0 {
                            out.push(ToServer::Gradients(Gradients {
                                job_id,
                                step,
                                micro: f.micro,
                                grads: vec![WireTensor::from_f32(
                                    f.inputs[0].name.clone(),
                                    &[n, 8],
                                    &vec![0.0; n * 8],
                                    WireDType::F32,
                                )],
                                compute_ms: 1.0,
                            }));
                        }
                        step_over(st, step, &mut out);
                    }
                }
                ToProvider::Backward(b) => step_over(st, b.step, &mut out),
                ToProvider::UploadParams { step, .. } => {
                    out.push(ToServer::OptimizerState(OptimizerState {
                        job_id,
                        step,
                        params: st
                            .optimizer
                            .iter()
                            .map(|(name, &steps)| {
                                let shape = &st.params.iter().find(|p| &p.0 == name).unwrap().1;
                                let len = shape.iter().product();
                                ParamOptimState {
                                    name: name.clone(),
                                    steps,
                                    slots: vec![WireTensor::from_f32(
                                        "momentum_buffer",
                                        shape,
                                        &vec![steps as f32; len],
                                        WireDType::F32,
                                    )],
                                }
                            })
                            .collect(),
                    }));
                    out.push(ToServer::Params(ParamSet {
                        job_id,
                        step,
                        params: st
                            .params
                            .iter()
                            .map(|(n, shape, v)| WireTensor::from_f32(n, shape, v, WireDType::F32))
                            .collect(),
                    }));
                }
                ToProvider::SetParams(set) => {
                    for t in set.params {
                        if let Some(p) = st.params.iter_mut().find(|p| p.0 == t.name) {
                            p.2 = t.to_f32().unwrap();
                        }
                    }
                }
                _ => {}
            }
            out
        }
    }

    /// 2 clusters of Root -> Leaf on providers 10..14, 32 samples in batches
    /// of 4: 4 steps per epoch, 2 epochs, a sync every 2 steps, and a test set.
    fn recovery_run(resume: Option<ResumePoint>) -> (JobRun, Vec<Effect>) {
        recovery_run_with(2, resume)
    }

    /// As [`recovery_run`], with `clusters` clusters on providers 10.. (one
    /// cluster: 8 steps per epoch).
    fn recovery_run_with(clusters: usize, resume: Option<ResumePoint>) -> (JobRun, Vec<Effect>) {
        let providers_end = 10 + 2 * clusters as u64;
        let graph = rookery_model::from_toml(MLP).unwrap();
        let mut spec = spec();
        spec.training.epochs = 2;
        spec.training.sync_every = 2;
        spec.training.optimizer = OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let providers: Vec<ProviderSpec> = (10..providers_end)
            .map(|i| ProviderSpec {
                id: i.to_string(),
                kind: ProviderKind::Native,
                memory_bytes: 1 << 30,
                gflops: 10.0,
                bandwidth_mbps: 1000.0,
                max_buffer_bytes: None,
            })
            .collect();
        let options = PlanOptions {
            micro_batch: 2,
            clusters: ClusterCount::Fixed(clusters),
            stages_per_cluster: Some(2),
            ..PlanOptions::default()
        };
        let plan = rookery_plan::clusterize(&graph, &providers, &options).unwrap();
        let ids = (10..providers_end).map(|i| (i.to_string(), i)).collect();
        let analysis = graph.analyze().unwrap();
        let test = Some(data(6));
        JobRun::start(
            1,
            spec,
            &graph,
            &analysis,
            &plan,
            &ids,
            data(32),
            test,
            resume,
        )
        .unwrap()
    }

    fn undisturbed() -> Sim {
        let (mut run, effects) = recovery_run(None);
        let mut sim = Sim::new(10..14);
        sim.push(effects);
        sim.run_until(&mut run, JobRun::is_over);
        sim
    }

    fn cluster_step(run: &JobRun, c: usize) -> Option<u64> {
        match run.clusters[c].state {
            ClusterState::Training { step } => Some(step),
            _ => None,
        }
    }

    #[test]
    fn an_undisturbed_run_records_every_step_once_and_syncs_at_each_barrier() {
        let sim = undisturbed();
        let steps: Vec<u64> = sim.steps().iter().map(|s| s.0).collect();
        assert_eq!(steps, (0..8).collect::<Vec<_>>());
        let resumes: Vec<u64> = sim
            .out
            .iter()
            .filter_map(|e| match e {
                Effect::ResumePoint(r) => Some(r.step),
                _ => None,
            })
            .collect();
        assert_eq!(resumes, [2, 4, 6, 8]);
        let epochs = sim
            .out
            .iter()
            .filter(|e| matches!(e, Effect::Epoch(_)))
            .count();
        assert_eq!(epochs, 2);
        assert!(sim.completed().is_some());
    }

    #[test]
    fn a_single_cluster_trains_on_during_its_syncs_and_a_stage_lost_mid_sync_replays_from_the_one_before()
     {
        let single = |kill_during: Option<u64>| {
            let (mut run, effects) = recovery_run_with(1, None);
            let initial: BTreeMap<String, Vec<f32>> = run
                .params
                .iter()
                .map(|(n, v)| (n.clone(), v.values.clone()))
                .collect();
            let mut sim = Sim::new(10..13);
            sim.push(effects);
            let mut overlapped = Vec::new();
            while !run.is_over() {
                sim.run_until(&mut run, |r| {
                    r.background_sync.is_some_and(|s| !overlapped.contains(&s)) || r.is_over()
                });
                let Some(step) = run.background_sync else {
                    break;
                };
                // The next step is under way while the sync's uploads are out.
                assert_eq!(cluster_step(&run, 0), Some(step));
                overlapped.push(step);
                if kill_during == Some(step) {
                    let leaf = run.clusters[0].stages[1].provider;
                    sim.kill(&mut run, leaf);
                    assert_eq!(run.background_sync, None, "the sync is abandoned");
                    assert_eq!(run.synced, step - 2, "back to the sync before");
                    sim.push(run.fill(0, 1, 12));
                }
            }
            sim.run_until(&mut run, JobRun::is_over);
            (sim, initial, overlapped)
        };
        let (reference, initial, overlapped) = single(None);
        // 8 steps an epoch, a sync every 2: those at epoch ends block (the
        // evaluation needs them), the others run beside the next step.
        assert_eq!(overlapped, [2, 4, 6, 10, 12, 14]);
        let steps: Vec<u64> = reference.steps().iter().map(|s| s.0).collect();
        assert_eq!(steps, (0..16).collect::<Vec<_>>());
        let resumes: Vec<&ResumePoint> = reference
            .out
            .iter()
            .filter_map(|e| match e {
                Effect::ResumePoint(r) => Some(&**r),
                _ => None,
            })
            .collect();
        assert_eq!(
            resumes.iter().map(|r| r.step).collect::<Vec<_>>(),
            [2, 4, 6, 8, 10, 12, 14, 16]
        );
        // Each checkpoint holds the values after exactly its steps (the fake
        // stages add 1 per step), not some of the next step's.
        for point in &resumes {
            for w in &point.params {
                let expected: Vec<f32> = initial[&w.name]
                    .iter()
                    .map(|&v| (0..point.step).fold(v, |x, _| x + 1.0))
                    .collect();
                assert_eq!(w.values, expected, "`{}` at step {}", w.name, point.step);
            }
        }

        let (disturbed, _, _) = single(Some(4));
        assert_eq!(disturbed.steps(), reference.steps());
        assert_eq!(disturbed.completed(), reference.completed());
    }

    #[test]
    fn providers_killed_mid_step_and_mid_sync_cost_only_a_replay_from_the_last_checkpoint() {
        let reference = undisturbed();
        let (mut run, effects) = recovery_run(None);
        let mut sim = Sim::new(10..16);
        sim.push(effects);
        let [[_, _], [root1, leaf1]] = roles(&run);

        // Cluster 1's Leaf dies in the middle of step 3 (the last sync was at 2).
        sim.run_until(&mut run, |r| {
            cluster_step(r, 1) == Some(3) && r.clusters[1].reported.len() == 1
        });
        assert_eq!(run.synced, 2);
        sim.kill(&mut run, leaf1);
        assert_eq!(
            run.vacancies(),
            [Vacancy {
                cluster: 1,
                stage: 1,
                memory_bytes: run.clusters[1].stages[1].memory_bytes
            }]
        );
        assert!(run.providers().iter().all(|&p| p != leaf1));
        // Cluster 0 trains on to the barrier at step 4 and waits there.
        sim.run_until(&mut run, |_| false);
        assert_eq!(run.clusters[0].state, ClusterState::Idle);
        assert_eq!(run.clusters[1].state, ClusterState::Waiting);
        assert_eq!(run.state, State::Training);
        assert!(
            sim.steps().iter().all(|s| s.0 < 3),
            "step 3 waits for cluster 1"
        );

        // A standby takes the stage: the whole cluster restarts from step 2.
        let effects = run.fill(1, 1, 14);
        assert!(effects.iter().any(|e| matches!(
            e,
            Effect::Log {
                kind: "stage_reassigned",
                ..
            }
        )));
        let rebuilt: Vec<(u64, &Assignment)> = sends(&effects)
            .into_iter()
            .filter_map(|(p, m)| match m {
                ToProvider::Assign(a) => Some((p, &**a)),
                _ => None,
            })
            .collect();
        assert_eq!(rebuilt.len(), 2);
        for (p, a) in &rebuilt {
            assert!([root1, 14].contains(p));
            assert_eq!((a.cluster, a.start_step), (1, 2));
            // The checkpoint's momentum, taken after 2 updates.
            assert!(!a.optimizer_state.is_empty());
            assert!(a.optimizer_state.iter().all(|o| o.steps == 2));
        }
        sim.push(effects);

        // Then cluster 0's Root dies during the sync at step 4.
        sim.run_until(&mut run, |r| matches!(r.state, State::Syncing { .. }));
        assert_eq!(run.synced, 2);
        let root0 = run.clusters[0].stages[0].provider;
        sim.kill(&mut run, root0);
        assert_eq!(run.state, State::Training, "the sync is abandoned");
        sim.push(run.fill(0, 0, 15));
        sim.run_until(&mut run, JobRun::is_over);

        // Every step recorded once, in order, with the undisturbed run's losses
        // (so the same batches), and the same final weights.
        assert_eq!(sim.steps(), reference.steps());
        let epochs = |s: &Sim| {
            s.out
                .iter()
                .filter_map(|e| match e {
                    Effect::Epoch(r) => Some((r.epoch, r.test_loss, r.samples)),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(epochs(&sim), epochs(&reference));
        assert_eq!(sim.completed(), reference.completed());
        let logs: Vec<&str> = sim
            .out
            .iter()
            .filter_map(|e| match e {
                Effect::Log { kind, .. } => Some(*kind),
                _ => None,
            })
            .collect();
        assert_eq!(
            logs,
            [
                "stage_lost",
                "stage_reassigned",
                "stage_lost",
                "stage_reassigned"
            ]
        );
    }

    #[test]
    fn a_stage_lost_during_evaluation_is_rebuilt_and_its_share_evaluated_again() {
        let reference = undisturbed();
        let (mut run, effects) = recovery_run(None);
        let mut sim = Sim::new(10..15);
        sim.push(effects);
        sim.run_until(&mut run, |r| {
            matches!(r.state, State::Evaluating { .. }) && r.clusters[0].reported.len() == 1
        });
        let leaf0 = run.clusters[0].stages[1].provider;
        sim.kill(&mut run, leaf0);
        sim.push(run.fill(0, 1, 14));
        sim.run_until(&mut run, JobRun::is_over);
        assert_eq!(sim.steps(), reference.steps());
        assert_eq!(sim.completed(), reference.completed());
    }

    #[test]
    fn a_run_resumed_from_a_resume_point_finishes_as_the_undisturbed_one() {
        let reference = undisturbed();
        let point = reference
            .out
            .iter()
            .find_map(|e| match e {
                Effect::ResumePoint(r) if r.step == 4 => Some((**r).clone()),
                _ => None,
            })
            .unwrap();
        let (mut run, effects) = recovery_run(Some(point));
        let mut sim = Sim::new(10..14);
        sim.push(effects);
        assert!(sim.assigns.is_empty());
        sim.run_until(&mut run, JobRun::is_over);
        assert!(sim.assigns.iter().all(|(_, a)| a.start_step == 4));
        // Step 4 ended epoch 0: its evaluation runs again, then steps 4.. follow.
        assert_eq!(sim.steps(), reference.steps()[4..]);
        assert_eq!(sim.completed(), reference.completed());
    }

    #[test]
    fn a_stage_slower_only_by_a_few_milliseconds_is_no_straggler() {
        let (mut run, effects) = recovery_run(None);
        let mut sim = Sim::new(10..14);
        sim.step_ms = 1.0;
        sim.push(effects);
        let slow = run.clusters[1].stages[0].provider;
        sim.stages.insert(
            slow,
            FakeStage {
                stage: 0,
                stages: 2,
                params: Vec::new(),
                optimizer: BTreeMap::new(),
                outputs: Vec::new(),
                micro_batches: 2,
                done: 0,
                slow: 10.0,
            },
        );
        let mut flagged = false;
        while !run.is_over() && !sim.queue.is_empty() {
            let steps = sim.steps().len();
            sim.run_until(&mut run, |r| r.recorded > steps as u64 || r.is_over());
            flagged |= !run.stragglers().is_empty();
        }
        assert!(run.is_over());
        assert!(!flagged, "10 ms a step stalls nothing");
    }

    #[test]
    fn a_stage_far_slower_than_the_others_is_flagged_and_replaced_from_the_checkpoint() {
        let (mut run, effects) = recovery_run(None);
        let mut sim = Sim::new(10..15);
        sim.push(effects);
        let slow = run.clusters[1].stages[0].provider;
        sim.run_until(&mut run, |r| r.synced == 2);
        // From now on cluster 1's Root takes 10 times as long per step.
        sim.stages.get_mut(&slow).unwrap().slow = 10.0;
        sim.run_until(&mut run, |r| !r.stragglers().is_empty());
        let [straggler] = run.stragglers()[..] else {
            panic!("{:?}", run.stragglers())
        };
        assert_eq!(
            (straggler.cluster, straggler.stage, straggler.provider),
            (1, 0, slow)
        );
        assert!(straggler.slowness > STRAGGLER_FACTOR, "{straggler:?}");
        let effects = run.replace(1, 0, 14, "too slow");
        assert!(matches!(&effects[0], Effect::Send(p, ToProvider::Release { .. }) if *p == slow));
        sim.push(effects);
        sim.run_until(&mut run, JobRun::is_over);
        assert!(run.stragglers().is_empty());
        let steps: Vec<u64> = sim.steps().iter().map(|s| s.0).collect();
        assert_eq!(steps, (0..8).collect::<Vec<_>>());
        assert_eq!(sim.completed(), undisturbed().completed());
    }
}
