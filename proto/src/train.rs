//! Training messages of the provider protocol (ARCHITECTURE.md, "Bird's-eye
//! view", tells the same flow).
//!
//! The server drives every step. It sends each micro-batch's inputs to the Root
//! as [`Forward`]; every stage answers a forward with [`Activations`] (its
//! boundary tensors), which the server validates and relays as the next
//! stage's `Forward`, attaching the labels when that stage is the Leaf. The
//! Leaf reports [`LeafLoss`] and, in training, runs backward at once and sends
//! [`Gradients`] for its inputs, which the server relays backwards as
//! [`Backward`]. A stage that has run backward for all of a step's
//! micro-batches steps its optimizer and reports [`StepDone`]. At sync points
//! the server asks for [`Params`](crate::ToServer::Params), averages them by
//! name across clusters, and sends the average back as `SetParams`; each
//! stage sends its [`OptimizerState`] along, which the server keeps per
//! cluster (not averaged) with the checkpoint, so a stage can be rebuilt on
//! another provider exactly as it stood at the last sync.
//!
//! The model graph travels as its JSON form (`rookery_model::Graph::to_json`):
//! a data-only description from a fixed op set, never code.

use serde::{Deserialize, Serialize};

use rookery_model::{Loss, LrSchedule, OptimizerConfig, Precision};

use crate::tensor::{WireDType, WireTensor};

/// Which pass a micro-batch belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// Training step `step` (counted from 0 over the whole job).
    Train { step: u64 },
    /// Forward-only evaluation on the test set after epoch `epoch`.
    Eval { epoch: u32 },
}

/// How a cluster's pipeline orders a step's micro-batches
/// (a job file's `training.schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// Every micro-batch of a step is released at once: a stage may hold
    /// the activations of all of them before their backwards come.
    #[default]
    #[serde(rename = "gpipe")]
    Gpipe,
    /// One forward, one backward: stage `s` of `S` is given a micro-batch's
    /// forward only while it holds fewer than `S - s`, so it never holds
    /// more. The same arithmetic as `Gpipe`, in the same order.
    #[serde(rename = "1f1b")]
    OneForwardOneBackward,
    /// PipeDream-2BW with weight prediction: no flush between steps, and no
    /// hold-back (a stage may hold two steps' micro-batches: over slow
    /// links, what is in flight is what keeps stages busy). Step `k` runs
    /// with the weights every update up to step `k - 2` made, extrapolated
    /// by step `k - 2`'s update (`w + (w - w_before)`, a prediction of the
    /// update step `k - 1` has yet to make; each stage stashes the version
    /// a micro-batch's forward used for its backward), so the server may
    /// feed step `k` once every stage has done step `k - 2`. After a barrier
    /// (a sync, a resume) step `b` runs with the barrier's weights and step
    /// `b + 1`, fed once `b` is done, with what `b`'s update made.
    #[serde(rename = "async")]
    Async,
}

impl PipelineSchedule {
    pub fn as_str(self) -> &'static str {
        match self {
            PipelineSchedule::Gpipe => "gpipe",
            PipelineSchedule::OneForwardOneBackward => "1f1b",
            PipelineSchedule::Async => "async",
        }
    }

    /// Whether a stage holds back forwards beyond `S - s` in flight.
    pub fn holds_back(self) -> bool {
        self == PipelineSchedule::OneForwardOneBackward
    }

    /// Whether steps overlap (with stashed weights).
    pub fn is_async(self) -> bool {
        self == PipelineSchedule::Async
    }

    /// Steps a cluster may have in flight at once: two under `async`, so a
    /// stage may hold two steps' micro-batches.
    pub fn steps_in_flight(self) -> u32 {
        if self.is_async() { 2 } else { 1 }
    }

    /// Copies of a stage's trainable weights kept beyond the one: under
    /// `async` the two forward versions beside the master weights.
    pub fn extra_weight_copies(self) -> u32 {
        if self.is_async() { 2 } else { 0 }
    }
}

/// What a provider runs for a job: one stage of one cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: u64,
    pub cluster: u32,
    /// Position in the cluster's chain: 0 is the Root, `stages - 1` the Leaf.
    pub stage: u32,
    pub stages: u32,
    /// The whole model graph as JSON; the stage runs nodes `first..end` of its
    /// topological order.
    pub graph_json: String,
    pub first: u32,
    pub end: u32,
    /// Tensors the stage sends on (for the Leaf: the model output the loss reads).
    pub outputs: Vec<String>,
    /// Current values of the stage's parameters and buffers.
    pub params: Vec<WireTensor>,
    pub optimizer: OptimizerConfig,
    /// The Leaf's loss function.
    pub loss: Loss,
    /// Samples per cluster per step, and how many micro-batches they split into.
    pub batch_size: u32,
    pub micro_batches: u32,
    /// Element type of activations and gradients the stage sends.
    pub wire_dtype: WireDType,
    /// The job seed; dropout masks derive from it and the step.
    pub seed: u64,
    /// Number of training steps already done (non-zero when resuming).
    pub start_step: u64,
    /// The optimizer state to start from (empty for a fresh stage): a stage
    /// rebuilt after its provider left, or resumed after a server restart,
    /// carries on exactly where the checkpoint it restarts from stood.
    pub optimizer_state: Vec<ParamOptimState>,
    /// The learning rate of each step, with its lengths resolved for the
    /// job: the optimizer's `lr` is its base.
    pub lr_schedule: LrSchedule,
    /// `clip_grad_norm_`'s `max_norm`: when set, the stage reports
    /// [`GradNorm`] after a step's last backward and steps only once the
    /// server answers [`GradScale`].
    pub clip_grad_norm: Option<f64>,
    /// The job's name as its Requester lets donors see it (the job file's
    /// `public_name`); `None` keeps the job private, and a donating tab
    /// says only that it trains a private job.
    pub public_name: Option<String>,
    /// How the stage orders a step's forwards and backwards.
    pub schedule: PipelineSchedule,
    /// At a sync, send each f32 parameter as its change since the values
    /// this stage was last given (this `Assign`'s, or the last `SetParams`'),
    /// in blockwise int8 ([`WireDType::I8Block`]); the server adds it back
    /// to the same values. Other tensors, and optimizer state, go as they are.
    pub sync_int8: bool,
    /// How the stage's matrix products compute (the job's `precision`):
    /// under `mixed`, operands rounded to f16 and sums in f32, alike on
    /// every backend.
    pub precision: Precision,
}

/// The names of optimizer state slots, as `torch.optim` names them in a
/// `state_dict`; a [`ParamOptimState`] holds any subset.
pub const OPTIMIZER_SLOTS: [&str; 6] = [
    "momentum_buffer",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "square_avg",
    "grad_avg",
];

/// One parameter's optimizer state, as `torch.optim` keeps it: the number of
/// updates taken and its state tensors (`momentum_buffer`, `exp_avg`,
/// `exp_avg_sq`, `max_exp_avg_sq`, `square_avg`, `grad_avg`; each the
/// parameter's shape, named by its slot).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamOptimState {
    pub name: String,
    pub steps: u64,
    pub slots: Vec<WireTensor>,
}

/// Provider to server: a stage's optimizer state, sent just before its
/// [`ParamSet`] in answer to `UploadParams`, so the server's checkpoint holds
/// everything needed to rebuild the stage on another provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    pub job_id: u64,
    /// Steps done when the state was taken.
    pub step: u64,
    pub params: Vec<ParamOptimState>,
}

/// Server to provider: run one micro-batch forward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Forward {
    pub job_id: u64,
    pub phase: Phase,
    pub micro: u32,
    /// Samples in the whole step (how it splits into micro-batches).
    pub step_samples: u32,
    /// What the step's mean loss divides by (the Leaf's gradient of a
    /// micro-batch is its summed loss over this): the step's class labels
    /// other than `ignore_index` for cross-entropy, its samples for MSE.
    /// Evaluation micro-batches carry their own count.
    pub step_targets: u64,
    /// The Root's data, or the previous stage's activations.
    pub inputs: Vec<WireTensor>,
    /// For the Leaf only.
    pub labels: Option<WireTensor>,
}

/// Server to provider: gradients of the stage's outputs for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Backward {
    pub job_id: u64,
    pub step: u64,
    pub micro: u32,
    pub grads: Vec<WireTensor>,
}

/// Provider to server: a stage's outputs for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Activations {
    pub job_id: u64,
    pub phase: Phase,
    pub micro: u32,
    pub outputs: Vec<WireTensor>,
    /// Milliseconds the forward took on the provider.
    pub compute_ms: f64,
}

/// Provider to server: gradients w.r.t. a stage's inputs for one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gradients {
    pub job_id: u64,
    pub step: u64,
    pub micro: u32,
    pub grads: Vec<WireTensor>,
    pub compute_ms: f64,
}

/// Leaf to server: the loss of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LeafLoss {
    pub job_id: u64,
    pub phase: Phase,
    pub micro: u32,
    /// Sum of the micro-batch's per-target losses (over its counted class
    /// labels for cross-entropy; its mean times its samples for MSE): the
    /// server divides the step's sum by its `step_targets`.
    pub loss_sum: f64,
    /// Counted class labels the logits predict (first highest logit),
    /// cross-entropy only.
    pub correct: u64,
    pub samples: u32,
}

/// Provider to server: the stage stepped its optimizer after step `step`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepDone {
    pub job_id: u64,
    pub step: u64,
    /// Milliseconds spent computing (forward, backward, optimizer) this step.
    pub compute_ms: f64,
    /// The most micro-batches whose activations the stage held at once this
    /// step (run forward, not yet backward): what its schedule bounds.
    pub peak_held: u32,
}

/// Parameter values of a stage, either way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamSet {
    pub job_id: u64,
    /// Steps done when the values were taken.
    pub step: u64,
    pub params: Vec<WireTensor>,
}

/// Provider to server, when the job clips gradients: the sum of the squares
/// of every element of the stage's parameter gradients for step `step`,
/// taken in f64 in parameter order (`rookery_model::sum_of_squares`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradNorm {
    pub job_id: u64,
    pub step: u64,
    pub sum_of_squares: f64,
}

/// Server to provider: multiply the step's parameter gradients by `scale`
/// (`rookery_model::clip_scale` of the cluster's summed [`GradNorm`]s, at
/// most 1), then step the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScale {
    pub job_id: u64,
    pub step: u64,
    pub scale: f64,
}
