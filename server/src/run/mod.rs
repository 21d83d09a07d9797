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
//!
//! The rooms: [`start`](JobRun::start) builds the run and its `Assign`
//! frames; `step` relays a step's frames between stages and feeds Roots;
//! `sync` runs the barriers, averages parameters and takes checkpoints;
//! `eval` runs the test set after an epoch; `recovery` rebuilds a cluster
//! that lost a provider; `stragglers` spots and replaces slow stages;
//! `metrics` turns finished steps into records; `aggregate` holds the rules
//! that combine the clusters' copies of a parameter, and [`AggregateWork`],
//! a sync's combining moved out of the run ([`Effect::Aggregate`]) for the
//! server to run off its coordinator; its result comes back through
//! [`JobRun::on_aggregated`].
//!
//! Memory: the run keeps one copy of each parameter, as the bytes that
//! travel, shared by every frame, checkpoint and resume point that carries
//! it; during a sync it also keeps the uploads, as they arrived.

mod aggregate;
mod eval;
mod measure;
mod metrics;
mod recovery;
mod start;
mod step;
mod stragglers;
mod sync;
#[cfg(test)]
mod tests;
mod verify;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Instant;

use rookery_job::{Dataset, JobSpec, Schedule};
use rookery_model::{DType, LrSchedule, ParamKind};
use rookery_proto::{Bytes, ParamOptimState, Phase, ToProvider, WireDType, WireTensor};

pub use aggregate::{AggregateWork, Aggregated, OuterWork};

pub use measure::{MIN_MEASURED_GFLOP, MIN_MEASURED_MS};
pub use metrics::{EpochRecord, StageTime, StepRecord};
pub use recovery::Vacancy;
pub use start::StartError;
pub use stragglers::{STRAGGLER_FACTOR, STRAGGLER_MIN_MS, STRAGGLER_STEPS, Straggler};
pub use verify::{
    Outcome, TapSide, VERIFY_TOLERANCE, Verification, disagreement, sampled, tensors_disagreement,
};

/// A finished job's weights: the clusters' combined parameters, and each
/// cluster's own as it finished (Ravnest's `model_fusion(cluster_id)`),
/// which with one cluster are the combined ones (then `clusters` is empty).
#[derive(Debug, Clone, Default)]
pub struct TrainedWeights {
    pub combined: Vec<WireTensor>,
    pub clusters: Vec<Vec<WireTensor>>,
}

/// What the coordinator must do on the job's behalf, in order.
#[derive(Debug)]
pub enum Effect {
    Send(u64, ToProvider),
    Running,
    Step(StepRecord),
    Epoch(EpochRecord),
    /// The latest averaged parameters, to keep as the checkpoint (sharing
    /// the run's buffers: nothing is copied).
    Checkpoint(Vec<WireTensor>),
    /// Every cluster's parameters are in: combine them off the coordinator
    /// ([`AggregateWork::run`]) and hand the result back to
    /// [`JobRun::on_aggregated`].
    Aggregate(Box<AggregateWork>),
    /// Everything a restarted server needs to resume from the checkpoint just
    /// taken (it follows [`Effect::Checkpoint`]).
    ResumePoint(Box<ResumePoint>),
    /// A line for the job's event log (`kind` is a short word).
    Log {
        kind: &'static str,
        message: String,
    },
    /// Training is over; these are the trained weights.
    Completed(TrainedWeights),
    Failed(String),
    /// The provider sent something wrong: counts against it.
    Fault {
        provider: u64,
        reason: String,
        /// Whether a frame the step needs was dropped (rather than outvoted
        /// at a sync), so the provider's stage cannot finish the step.
        frame_dropped: bool,
    },
    /// The server's own measure of a provider's stage this step: its work
    /// ([`MIN_MEASURED_GFLOP`] or more) and busy time ([`MIN_MEASURED_MS`]
    /// or more), for the coordinator to rate.
    Measured {
        provider: u64,
        /// The stage's work this step, GFLOP.
        work_gflop: f64,
        busy_ms: f64,
        /// Tensor bytes to and from it meanwhile.
        bytes: u64,
    },
    /// Keep a copy of the message just received (it streams on) and hand
    /// its tensors back to [`JobRun::on_tapped`] once whole.
    Tap {
        key: u64,
        side: TapSide,
    },
    /// A spot check to run on another provider.
    Verify(Box<Verification>),
    /// A provider's stage finished a step its cluster finished: its planned
    /// work, GFLOP, to credit once a checkpoint holds the step.
    Worked {
        provider: u64,
        gflop: f64,
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
    /// Every parameter and buffer (constants too), averaged: f32 tensors,
    /// and i64 for integer buffers. Shares the run's buffers.
    pub params: Vec<WireTensor>,
    /// Per cluster: the optimizer state of each parameter its stages update.
    pub optimizer: Vec<Vec<ParamOptimState>>,
    /// DiLoCo's outer momentum buffer of each trainable parameter, f32,
    /// named by the parameter (empty without an outer optimizer with
    /// momentum, or before its first step).
    pub outer_momentum: Vec<WireTensor>,
}

/// A parameter's current (averaged) value: the one copy the server keeps.
/// Its bytes are what travels (little-endian f32, or i64 for integer
/// buffers), shared by every frame, checkpoint and resume point that
/// carries it, so handing it out copies nothing.
#[derive(Debug, Clone)]
struct ParamValue {
    shape: Vec<usize>,
    dtype: DType,
    kind: ParamKind,
    data: Bytes,
}

impl ParamValue {
    /// The value as it travels.
    fn tensor(&self, name: &str) -> WireTensor {
        WireTensor {
            name: name.to_string(),
            dtype: on_wire(self.dtype, WireDType::F32),
            shape: self.shape.iter().map(|&d| d as u32).collect(),
            data: self.data.clone(),
        }
    }

    #[cfg(test)]
    fn values(&self) -> Vec<f32> {
        self.tensor("").to_f32().unwrap_or_default()
    }
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
    /// This step's share of the squared gradient norm (jobs that clip).
    grad_sum_of_squares: Option<f64>,
    step_done: bool,
    compute_ms: f64,
    /// The most micro-batches it held at once this step, as it reports.
    peak_held: u32,
    uploaded: bool,
    /// The stage's work per step, GFLOP (the plan's time at its provider's
    /// speed); 0 where the plan did not keep the speed.
    work_gflop: f64,
    /// Its busy time this step, from the server's clock.
    busy: measure::Busy,
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
    /// What the step's mean loss divides by (`Forward::step_targets`).
    targets: u64,
    /// Each stage's times (its idle time is the record's to fill in).
    stages: Vec<StageTime>,
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
    /// Targets (counted labels, or samples for MSE) in each of those micro-batches.
    micro_targets: HashMap<(Phase, u32), u64>,
    /// Micro-batches whose loss the Leaf has reported.
    reported: HashSet<(Phase, u32)>,
    /// Relays passed on, by (phase, micro-batch, sending stage, whether
    /// gradients): a second copy is a replay, dropped and counted against its
    /// sender, never forwarded for the next stage to refuse in its name.
    relayed: HashSet<(Phase, u32, usize, bool)>,
    /// What the Leaf reported of the current step or evaluation.
    totals: Totals,
    /// Under `async`: the step after the one in `state`, fed before that
    /// one is done.
    ahead: Option<Ahead>,
}

/// What the step after a cluster's current one (fed early, under `async`)
/// has reported so far.
#[derive(Debug, Default)]
struct Ahead {
    totals: Totals,
    /// Each stage's `StepDone` of it: (compute ms, micro-batches held).
    done: Vec<Option<(f64, u32)>>,
}

/// The Leaf's loss reports of one step or evaluation, added up.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    loss_sum: f64,
    correct: u64,
    samples: u64,
    targets: u64,
}

impl Totals {
    /// Adds a micro-batch's report, of `targets` targets.
    fn add(&mut self, l: &rookery_proto::LeafLoss, targets: u64) {
        self.loss_sum += l.loss_sum;
        self.correct += l.correct;
        self.samples += u64::from(l.samples);
        self.targets += targets;
    }
}

impl ClusterRun {
    /// Forgets the previous step's or evaluation's micro-batches and totals.
    fn reset(&mut self) {
        self.labels.clear();
        self.micro_samples.clear();
        self.micro_targets.clear();
        self.reported.clear();
        self.relayed.clear();
        self.totals = Totals::default();
        self.ahead = None;
    }

    /// Counts a relayed micro-batch's compute toward stage `s`'s current
    /// step, as a partial total until its `StepDone` brings the
    /// authoritative one. A relay of the step fed ahead (under `async`), or
    /// one after the stage's `StepDone`, is that later step's: its own
    /// `StepDone` counts it.
    fn count_relayed(&mut self, s: usize, phase: Phase, compute_ms: f64) {
        if let (ClusterState::Training { step }, Phase::Train { step: got }) = (self.state, phase)
            && (got != step || self.stages[s].step_done)
        {
            return;
        }
        self.stages[s].compute_ms += compute_ms.max(0.0);
    }

    /// Forgets the micro-batches of `phase` only (a step done while the
    /// next one runs).
    fn forget(&mut self, phase: Phase) {
        self.labels.retain(|(p, _), _| *p != phase);
        self.micro_samples.retain(|(p, _), _| *p != phase);
        self.micro_targets.retain(|(p, _), _| *p != phase);
        self.reported.retain(|(p, _)| *p != phase);
        self.relayed.retain(|(p, ..)| *p != phase);
    }

    /// What the Leaf's mean loss for micro-batch `micro` of `phase` divides
    /// by: the whole step's targets in training, its own in evaluation.
    fn step_targets(&self, phase: Phase, micro: u32) -> u64 {
        match phase {
            Phase::Train { .. } => self
                .micro_targets
                .iter()
                .filter(|((p, _), _)| *p == phase)
                .map(|(_, t)| t)
                .sum(),
            Phase::Eval { .. } => self
                .micro_targets
                .get(&(phase, micro))
                .copied()
                .unwrap_or(0),
        }
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
    /// The test set goes forward after `step` steps, in `epoch`.
    Evaluating {
        epoch: u64,
        step: u64,
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
    /// The job's learning-rate schedule, its lengths resolved.
    lr_schedule: LrSchedule,
    perm: Vec<usize>,
    perm_epoch: Option<u64>,
    clusters: Vec<ClusterRun>,
    params: BTreeMap<String, ParamValue>,
    /// Params uploaded at the current sync: name -> (cluster, value) per
    /// cluster, as they arrived (views into the received frames).
    uploads: BTreeMap<String, Vec<(usize, WireTensor)>>,
    /// Counts the syncs that asked for uploads, so that an aggregation
    /// finishing after its sync was abandoned is recognised and dropped.
    sync_round: u64,
    /// The round whose aggregation runs off the coordinator now.
    aggregating: Option<u64>,
    /// Each cluster's weights as it finished (the last sync's uploads,
    /// before they were combined); empty with one cluster.
    cluster_weights: Vec<Vec<WireTensor>>,
    /// DiLoCo's outer momentum buffer of each trainable parameter (f32),
    /// shared with the resume points that carry it.
    outer_momentum: BTreeMap<String, WireTensor>,
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
    bytes_synced: u64,
    /// Spot checks waiting for their halves or their checkpoint.
    checks: verify::Checks,
    next_check: u64,
    /// The identities whose stage failed, by (cluster, stage, cause): a job
    /// fails only when one stage fails the same way on
    /// [`FAIL_AFTER_PROVIDERS`] of them.
    stage_failures: HashMap<(usize, usize, String), BTreeSet<u64>>,
}

/// Distinct providers on which a stage must fail with the same cause before
/// its job fails: one provider's failure (or claim of one) is a lost stage
/// and a fault of its own, and the stage is reassigned.
pub const FAIL_AFTER_PROVIDERS: usize = 3;

impl std::fmt::Debug for JobRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobRun")
            .field("job_id", &self.job_id)
            .field("state", &self.state)
            .field("synced", &self.synced)
            .finish_non_exhaustive()
    }
}

impl JobRun {
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

    /// The current parameters as `state_dict` entries (constants left out),
    /// sharing the run's buffers.
    pub fn weights(&self) -> Vec<WireTensor> {
        self.params
            .iter()
            .filter(|(_, v)| v.kind != ParamKind::Constant)
            .map(|(name, v)| v.tensor(name))
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
}

/// How a tensor of the graph's `dtype` travels: floats as `floats`
/// (the job's wire dtype, or f32 for data and parameters), integers as i64.
pub(crate) fn on_wire(dtype: DType, floats: WireDType) -> WireDType {
    match dtype {
        DType::F32 => floats,
        DType::I64 => WireDType::I64,
    }
}

/// `values` as little-endian f32 bytes, without copying them where the
/// machine is little-endian (the buffer becomes the bytes' owner).
fn f32_bytes(values: Vec<f32>) -> Bytes {
    struct F32Buffer(Vec<f32>);
    impl AsRef<[u8]> for F32Buffer {
        fn as_ref(&self) -> &[u8] {
            bytemuck::cast_slice(&self.0)
        }
    }
    if cfg!(target_endian = "little") {
        Bytes::from_owner(F32Buffer(values))
    } else {
        WireTensor::from_f32("", &[values.len()], &values, WireDType::F32).data
    }
}

/// A parameter's value of `dtype` from f32 values, as it travels.
fn param_bytes(dtype: DType, values: Vec<f32>) -> Bytes {
    match dtype {
        DType::F32 => f32_bytes(values),
        DType::I64 => WireTensor::from_f32("", &[values.len()], &values, WireDType::I64).data,
    }
}
