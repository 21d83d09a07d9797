//! The Requester's job file: which model, which data, how to train.
//!
//! Written as TOML (or the same structure as JSON, which the HTTP API takes):
//!
//! ```toml
//! public_name = "Handwritten digits for the Lab"   # optional: donors see it; without it the job is private
//! [model]
//! onnx = "cnn.onnx"            # or: spec = "model.toml"  (exactly one of the two)
//! input_shape = [1, 28, 28]    # one sample, without the batch dimension
//! [data]
//! format = "idx"               # idx | npy | npz | safetensors | csv | tokens
//! train_inputs = "train-images-idx3-ubyte.gz"
//! train_labels = "train-labels-idx1-ubyte.gz"
//! test_inputs  = "t10k-images-idx3-ubyte.gz"   # test_* optional (both or neither)
//! test_labels  = "t10k-labels-idx1-ubyte.gz"
//! scale = 0.00392156862745098  # optional: x*scale, then (x-mean)/std
//! mean = 0.1307                # optional (default 0)
//! std = 0.3081                 # optional (default 1)
//! [training]
//! epochs = 2                   # default 1
//! batch_size = 64              # per cluster per step (required)
//! micro_batches = 4            # default 1
//! loss = "cross_entropy"       # cross_entropy (default) | mse, or a table:
//! # loss = { name = "cross_entropy", class_axis = -1, ignore_index = -100 }
//! #   class_axis: 1 (logits [N, C, ..], default) | -1 (logits [N, .., C])
//! optimizer = { name = "adam", lr = 0.001 }   # default: sgd with lr 0.01
//! clusters = "auto"            # default "auto", or a number
//! sync_every = 1               # default 1 (10 with schedule = "async")
//! stages = 3                   # optional: exactly this many pipeline stages per cluster
//! shuffle = true               # default true
//! seed = 42                    # default 0
//! wire_dtype = "f32"           # f32 (default) | f16 | bf16 | int8 (blockwise)
//! aggregation = "mean"         # mean (default) | median | centered_clip
//! schedule = "gpipe"           # gpipe (default) | 1f1b | async (PipeDream-2BW, weight prediction): how micro-batches flow
//! precision = "f32"            # f32 (default) | mixed: matrix products on f16 operands, f32 sums
//! clip_grad_norm = 1.0         # optional: clip_grad_norm_ over the whole model
//! val_every = 100              # optional: also evaluate every 100 steps (needs test data)
//! average_optimizer = false    # default false: true averages optimizer state at syncs too
//! [training.sync]              # optional: DiLoCo-style syncs
//! every = 50                   # the same as sync_every (give one of the two)
//! outer_optimizer = { name = "nesterov", lr = 0.7, momentum = 0.9 }   # default: plain averaging
//! compress = "none"            # none (default) | int8: uploads are each stage's change since the last sync, blockwise int8
//! [training.verify]            # optional: spot checks (default: none)
//! rate = 0.02                  # share of each stage's micro-batches re-run elsewhere
//! [training.lr_schedule]       # optional (default: constant)
//! kind = "cosine"              # constant | linear | cosine | step
//! warmup_steps = 10            # constant, linear, cosine (default 0)
//! total_steps = 1000           # linear, cosine (default: epochs * steps per epoch)
//! min_lr = 1e-5                # cosine (default 0)
//! # step_size = 100, gamma = 0.1   # step (gamma default 0.1, as StepLR)
//! ```
//!
//! `lr_schedule` is `rookery_model::LrSchedule` (its docs give each kind's
//! exact `torch.optim.lr_scheduler.LambdaLR` equivalent); the learning rate
//! of a step depends on that step alone. `clip_grad_norm` clips the
//! gradients of every stage of a cluster together by their global norm, as
//! `torch.nn.utils.clip_grad_norm_` does in one process. A schedule longer
//! than the job (its warm-up, `total_steps` or `step_size` beyond the job's
//! steps) is refused when the job starts and its steps are known.
//!
//! `aggregation` is how a sync combines the clusters' parameters: a plain
//! mean (exactly C clusters' SGD = one process with C times the batch), or,
//! against clusters that may lie, a coordinate-wise median or CenteredClip
//! (Karimireddy et al., 2021), which a single far-off cluster cannot drag
//! far once there are at least 3 clusters.
//!
//! A language model's data is a token file (`format = "tokens"`): one flat
//! sequence of token ids, cut by the server into windows of `seq_len + 1`
//! tokens at a stride of `seq_len` (inputs the first `seq_len`, labels the
//! next token at each position), in the same seeded order as any samples:
//!
//! ```toml
//! [model]
//! onnx = "gpt.onnx"
//! input_shape = [128]          # [seq_len]
//! [data]
//! format = "tokens"
//! train_inputs = "train.u16"   # raw little-endian ids, maybe gzipped, or a .npy
//! test_inputs = "test.u16"     # optional; no *_labels: the labels are the next tokens
//! seq_len = 128
//! token_dtype = "u16"          # u16 | u32; optional when the name ends .u16/.u32 (or .gz after it)
//! ```
//!
//! A `.npy` token file (one dimension of u16, u32, i32 or i64) says its own dtype.
//!
//! Relative paths resolve against a base directory (the job file's folder).
//! For `npz` and `safetensors`, a path may name one array of the file as
//! `data.npz:x_train`; a file holding a single array needs no name.
//!
//! The optimizer table is tagged by `name` (`sgd`, `adam`, `adamw`, `rmsprop`)
//! and takes `torch.optim`'s parameter names and defaults, `lr` included
//! (1e-3, or 1e-2 for RMSprop); Adam's betas are `betas = [b1, b2]`. Only a
//! job with no `optimizer` at all gets SGD with lr 0.01.
//!
//! Unknown fields are errors, and every error names the field (its dotted path,
//! e.g. `training.optimizer.lr`) and, for a file, the resolved path.

use std::fmt;
use std::path::{Path, PathBuf};

use rookery_model::load::{LoadedModel, load_model_file};
use rookery_model::{ClusterCount, Loss, LrSchedule, OptimizerConfig, Precision};
use serde::Serialize;

pub use rookery_proto::WireDType;

use crate::error::JobError;
pub use crate::file::{Aggregation, DataFormat, TokenDType};
use crate::file::{Clusters, DataFile, JobFile, ModelFile, SyncFile, TrainingFile, VerifyFile};
pub use rookery_proto::PipelineSchedule;

/// `sync_every` when an `async` job gives none.
pub const ASYNC_SYNC_EVERY: u64 = 10;

/// Most epochs a job may ask for: a million, so that epochs times steps
/// per epoch (each at most the samples) never overflows a counter.
pub const MAX_EPOCHS: u64 = 1_000_000;

/// The most elements one step's batch of inputs may have (2^36: 256 GiB of
/// f32), so that every size computed from the job file's numbers (a
/// sample's elements, a batch's, a token window) fits a counter with room
/// to spare, on 32-bit browsers' sizes too once divided into micro-batches.
pub const MAX_BATCH_ELEMENTS: u64 = 1 << 36;

/// A data file, or one named array inside an `.npz`/safetensors file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DataRef {
    pub path: PathBuf,
    pub member: Option<String>,
}

impl DataRef {
    pub fn file(path: impl Into<PathBuf>) -> Self {
        DataRef {
            path: path.into(),
            member: None,
        }
    }

    pub fn member(path: impl Into<PathBuf>, member: impl Into<String>) -> Self {
        DataRef {
            path: path.into(),
            member: Some(member.into()),
        }
    }
}

/// `path` or `path:member`, as written in job files.
impl fmt::Display for DataRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.member {
            Some(m) => write!(f, "{}:{m}", self.path.display()),
            None => write!(f, "{}", self.path.display()),
        }
    }
}

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// An ONNX export from PyTorch.
    Onnx(PathBuf),
    /// A layer-spec TOML file.
    Spec(PathBuf),
}

impl ModelSource {
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Onnx(p) | ModelSource::Spec(p) => p,
        }
    }
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSection {
    pub source: ModelSource,
    /// One sample's shape, without the batch dimension.
    pub input_shape: Vec<usize>,
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSpec {
    pub format: DataFormat,
    pub train_inputs: DataRef,
    /// `None` only for `tokens`, whose labels are the next tokens.
    pub train_labels: Option<DataRef>,
    pub test_inputs: Option<DataRef>,
    pub test_labels: Option<DataRef>,
    /// Inputs become `(x * scale - mean) / std` (in f32), each part optional.
    pub scale: Option<f64>,
    pub mean: Option<f64>,
    pub std: Option<f64>,
    /// `tokens`: tokens a window feeds the model (required there, refused elsewhere).
    pub seq_len: Option<usize>,
    /// `tokens`: the width of a raw file's ids, when its name does not say.
    pub token_dtype: Option<TokenDType>,
}

impl DataSpec {
    /// `(scale, mean, std)` with the defaults (1, 0, 1) filled in.
    pub fn normalisation(&self) -> (f32, f32, f32) {
        (
            self.scale.unwrap_or(1.0) as f32,
            self.mean.unwrap_or(0.0) as f32,
            self.std.unwrap_or(1.0) as f32,
        )
    }
}

/// `[training]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingSpec {
    pub epochs: u64,
    /// Samples per cluster per step.
    pub batch_size: usize,
    /// Micro-batches a step's batch is cut into for pipelining (`torch.chunk`).
    pub micro_batches: usize,
    pub loss: Loss,
    pub optimizer: OptimizerConfig,
    pub clusters: ClusterCount,
    /// Steps between parameter averages across clusters.
    pub sync_every: u64,
    /// Pipeline stages per cluster; `None` lets the planner choose.
    pub stages: Option<usize>,
    pub shuffle: bool,
    pub seed: u64,
    pub wire_dtype: WireDType,
    pub aggregation: Aggregation,
    /// The learning rate over the job (lengths not yet resolved).
    pub lr_schedule: LrSchedule,
    /// `clip_grad_norm_`'s `max_norm` across all stages, if clipping.
    pub clip_grad_norm: Option<f64>,
    /// The share of stages' micro-batches the server re-runs on another
    /// provider to check them (0: none).
    pub verify_rate: f64,
    /// Steps between evaluations on the test set, besides each epoch's end
    /// (Ravnest's `val_freq`); each is taken at a sync, so all clusters
    /// agree on the parameters evaluated.
    pub val_every: Option<u64>,
    /// Whether a sync also averages the clusters' optimizer state (Ravnest's
    /// `average_optim`); otherwise each cluster keeps its own.
    pub average_optimizer: bool,
    /// How each cluster's pipeline orders a step's micro-batches.
    pub schedule: PipelineSchedule,
    /// DiLoCo's outer step at each sync; `None` takes the clusters'
    /// combined parameters as they are (plain averaging).
    pub outer_optimizer: Option<OuterOptimizer>,
    /// `[training.sync] compress = "int8"`: with several clusters, each
    /// stage uploads its float parameters at a sync as their change since
    /// the parameters it was last given, in blockwise int8.
    pub sync_int8: bool,
    /// How every matrix product of the model computes: `mixed` rounds its
    /// operands to f16 and sums in f32 (tensor cores where a GPU has them).
    pub precision: Precision,
}

/// The outer optimizer of a DiLoCo-style sync (Douillard et al., 2023): the
/// pseudo-gradient is the parameters at the last sync less the clusters'
/// combined parameters now, and `torch.optim.SGD(lr, momentum, nesterov)`
/// steps the synced parameters with it. SGD at lr 1 without momentum is
/// plain averaging, and is taken as such.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterOptimizer {
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
}

impl OuterOptimizer {
    /// Whether the step leaves the clusters' combined parameters as they are.
    pub fn is_plain_average(&self) -> bool {
        self.lr == 1.0 && self.momentum == 0.0
    }

    fn from_file(f: crate::file::OuterOptimizerFile) -> Result<Self, JobError> {
        let field = |name: &str| format!("training.sync.outer_optimizer.{name}");
        let (nesterov, default_momentum) = match f.name.to_ascii_lowercase().as_str() {
            "sgd" => (false, 0.0),
            "nesterov" => (true, 0.9),
            other => {
                return Err(JobError::field(
                    field("name"),
                    format!("`{other}` is not an outer optimizer: sgd or nesterov"),
                ));
            }
        };
        if !(f.lr > 0.0 && f.lr.is_finite()) {
            return Err(JobError::field(
                field("lr"),
                format!("must be greater than 0 (got {})", f.lr),
            ));
        }
        let momentum = f.momentum.unwrap_or(default_momentum);
        if !(0.0..1.0).contains(&momentum) || (nesterov && momentum == 0.0) {
            return Err(JobError::field(
                field("momentum"),
                format!(
                    "must be at least 0 and below 1{} (got {momentum})",
                    if nesterov {
                        ", and above 0 for nesterov"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(OuterOptimizer {
            lr: f.lr,
            momentum,
            nesterov,
        })
    }

    fn to_file(self) -> crate::file::OuterOptimizerFile {
        crate::file::OuterOptimizerFile {
            name: if self.nesterov { "nesterov" } else { "sgd" }.into(),
            lr: self.lr,
            momentum: Some(self.momentum),
        }
    }
}

/// A whole job. Serializes as the JSON form of the job file (paths absolute
/// when the base directory was), which [`JobSpec::from_json`] reads back.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(into = "JobFile")]
pub struct JobSpec {
    pub model: ModelSection,
    pub data: DataSpec,
    pub training: TrainingSpec,
    /// What donating tabs may show of the job: 1 to
    /// [`MAX_PUBLIC_NAME_CHARS`] characters, no control characters. `None`:
    /// private, and a tab says only that it trains a private job.
    pub public_name: Option<String>,
}

/// The longest `public_name` a job may have, in characters.
pub const MAX_PUBLIC_NAME_CHARS: usize = 80;

/// What is wrong with a job's `public_name`, if anything.
fn public_name_problem(name: &str) -> Option<String> {
    let chars = name.chars().count();
    if name.trim().is_empty() {
        Some("is blank: give a name, or leave public_name out to keep the job private".into())
    } else if chars > MAX_PUBLIC_NAME_CHARS {
        Some(format!(
            "has {chars} characters; at most {MAX_PUBLIC_NAME_CHARS} are shown"
        ))
    } else if name.chars().any(char::is_control) {
        Some("must not contain control characters (line breaks, tabs, ...)".into())
    } else {
        None
    }
}

impl JobSpec {
    /// Parses and validates a TOML job file; relative paths resolve against `base_dir`.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Self, JobError> {
        Self::from_toml_with(text, base_dir, Paths::Any)
    }

    /// Parses and validates the JSON form; relative paths resolve against `base_dir`.
    pub fn from_json(text: &str, base_dir: &Path) -> Result<Self, JobError> {
        Self::from_json_with(text, base_dir, Paths::Any)
    }

    /// Parses a job file someone uploaded along with its files into
    /// `upload_dir`: JSON when it looks like JSON, TOML otherwise, and every
    /// path it names must be a relative path inside `upload_dir` (no absolute
    /// paths, no `..`), so an upload can never make the server read its own files.
    pub fn from_upload(text: &str, upload_dir: &Path) -> Result<Self, JobError> {
        if text.trim_start().starts_with('{') {
            Self::from_json_with(text, upload_dir, Paths::Inside)
        } else {
            Self::from_toml_with(text, upload_dir, Paths::Inside)
        }
    }

    fn from_toml_with(text: &str, base_dir: &Path, paths: Paths) -> Result<Self, JobError> {
        let de = toml::de::Deserializer::parse(text).map_err(|e| JobError::Syntax {
            format: "TOML",
            reason: toml_reason(&e, text),
        })?;
        let file: JobFile = serde_path_to_error::deserialize(de)
            .map_err(|e| path_error(e, |e| toml_reason(e, text)))?;
        Self::from_file_form(file, base_dir, paths)
    }

    fn from_json_with(text: &str, base_dir: &Path, paths: Paths) -> Result<Self, JobError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let file: JobFile = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            if e.inner().is_syntax() || e.inner().is_eof() {
                JobError::Syntax {
                    format: "JSON",
                    reason: e.into_inner().to_string(),
                }
            } else {
                path_error(e, |e| e.to_string())
            }
        })?;
        de.end().map_err(|e| JobError::Syntax {
            format: "JSON",
            reason: e.to_string(),
        })?;
        Self::from_file_form(file, base_dir, paths)
    }

    /// Reads a `.toml` or `.json` job file; paths resolve against its folder
    /// (made absolute).
    pub fn from_file(path: &Path) -> Result<Self, JobError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            JobError::file(path.display(), format!("cannot read the job file: {e}"))
        })?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let base = std::path::absolute(parent).map_err(|e| {
            JobError::file(path.display(), format!("cannot resolve its folder: {e}"))
        })?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("toml") => Self::from_toml(&text, &base),
            Some("json") => Self::from_json(&text, &base),
            _ => Err(JobError::file(
                path.display(),
                "unknown job file type: expected .toml or .json",
            )),
        }
    }

    /// The JSON form; [`JobSpec::from_json`] reads it back to an equal spec
    /// (paths are written as given, so resolve them against an absolute base
    /// first). Non-UTF-8 paths are written lossily.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Samples in one micro-batch: `ceil(batch_size / micro_batches)`, the
    /// size of `torch.chunk`'s chunks (the last may be smaller).
    pub fn micro_batch_size(&self) -> usize {
        self.training
            .batch_size
            .div_ceil(self.training.micro_batches.max(1))
    }

    /// Loads the model at one sample's `input_shape`. An ONNX model is imported
    /// at the micro-batch size; a layer spec keeps its own example batch (1).
    pub fn load_model(&self) -> Result<LoadedModel, JobError> {
        Ok(load_model_file(
            self.model.source.path(),
            Some(&self.model.input_shape),
            self.micro_batch_size(),
        )?)
    }

    /// The checks made before anything runs: ranges of every number, the
    /// optimizer's own checks (`torch.optim`'s wording) and that every file exists.
    /// The parsers call it; call it again after editing a spec.
    pub fn validate(&self) -> Result<(), JobError> {
        if let Some(problem) = self.public_name.as_deref().and_then(public_name_problem) {
            return Err(JobError::field("public_name", problem));
        }
        let m = &self.model;
        if m.input_shape.is_empty() || m.input_shape.contains(&0) {
            return Err(JobError::field(
                "model.input_shape",
                format!(
                    "must list one sample's dimensions, each at least 1 (got {:?})",
                    m.input_shape
                ),
            ));
        }
        let model_field = match m.source {
            ModelSource::Onnx(_) => "model.onnx",
            ModelSource::Spec(_) => "model.spec",
        };
        check_file(model_field, m.source.path(), false)?;

        let d = &self.data;
        let has_members = d.format.has_members();
        check_ref("data.train_inputs", &d.train_inputs, has_members)?;
        if d.format == DataFormat::Tokens {
            self.validate_tokens()?;
        } else {
            match &d.train_labels {
                Some(l) => check_ref("data.train_labels", l, has_members)?,
                None => return Err(JobError::field("data.train_labels", "missing")),
            }
            for (field, given) in [
                ("data.seq_len", d.seq_len.is_some()),
                ("data.token_dtype", d.token_dtype.is_some()),
            ] {
                if given {
                    return Err(JobError::field(
                        field,
                        format!(
                            "is for format = \"tokens\" only (this job's format is {:?})",
                            d.format
                        ),
                    ));
                }
            }
        }
        match (&d.test_inputs, &d.test_labels) {
            (Some(i), Some(l)) => {
                check_ref("data.test_inputs", i, has_members)?;
                check_ref("data.test_labels", l, has_members)?;
            }
            (None, None) => {}
            (Some(i), None) if d.format == DataFormat::Tokens => {
                check_ref("data.test_inputs", i, has_members)?;
            }
            (Some(_), None) => {
                return Err(JobError::field(
                    "data.test_labels",
                    "missing: data.test_inputs is given, so give its labels too",
                ));
            }
            (None, Some(_)) => {
                return Err(JobError::field(
                    "data.test_inputs",
                    "missing: data.test_labels is given, so give the inputs too",
                ));
            }
        }
        for (field, v) in [("data.scale", d.scale), ("data.mean", d.mean)] {
            if let Some(v) = v
                && !v.is_finite()
            {
                return Err(JobError::field(
                    field,
                    format!("must be a finite number (got {v})"),
                ));
            }
        }
        if let Some(s) = d.std
            && !(s > 0.0 && s.is_finite())
        {
            return Err(JobError::field(
                "data.std",
                format!("must be greater than 0 (got {s})"),
            ));
        }

        let t = &self.training;
        if t.epochs < 1 {
            return Err(JobError::field(
                "training.epochs",
                "must be at least 1 (got 0)",
            ));
        }
        // Epochs times steps must stay far from overflowing a counter.
        if t.epochs > MAX_EPOCHS {
            return Err(JobError::field(
                "training.epochs",
                format!("must be at most {MAX_EPOCHS} (got {})", t.epochs),
            ));
        }
        if t.batch_size < 1 {
            return Err(JobError::field(
                "training.batch_size",
                "must be at least 1 (got 0)",
            ));
        }
        let sample = m
            .input_shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .filter(|&n| n <= MAX_BATCH_ELEMENTS);
        let batch = sample.and_then(|n| n.checked_mul(t.batch_size as u64));
        match (sample, batch) {
            (None, _) => {
                return Err(JobError::field(
                    "model.input_shape",
                    format!(
                        "{:?} is more than {MAX_BATCH_ELEMENTS} elements a sample",
                        m.input_shape
                    ),
                ));
            }
            (Some(sample), batch) if batch.is_none_or(|b| b > MAX_BATCH_ELEMENTS) => {
                return Err(JobError::field(
                    "training.batch_size",
                    format!(
                        "{} samples of {sample} elements are more than {MAX_BATCH_ELEMENTS} elements a step",
                        t.batch_size
                    ),
                ));
            }
            _ => {}
        }
        if !(1..=t.batch_size).contains(&t.micro_batches) {
            return Err(JobError::field(
                "training.micro_batches",
                format!(
                    "must be between 1 and training.batch_size ({}) (got {})",
                    t.batch_size, t.micro_batches
                ),
            ));
        }
        if t.sync_every < 1 {
            return Err(JobError::field(
                "training.sync_every",
                "must be at least 1 (got 0)",
            ));
        }
        if t.stages == Some(0) {
            return Err(JobError::field(
                "training.stages",
                "must be at least 1 (got 0)",
            ));
        }
        if t.clusters == ClusterCount::Fixed(0) {
            return Err(JobError::field(
                "training.clusters",
                "must be \"auto\" or at least 1 (got 0)",
            ));
        }
        t.optimizer.validate().map_err(|m| {
            JobError::field(format!("training.optimizer.{}", optimizer_field(&m)), m)
        })?;
        t.lr_schedule
            .validate(t.optimizer.lr())
            .map_err(|e| JobError::field(format!("training.lr_schedule.{}", e.field), e.message))?;
        if let Some(n) = t.clip_grad_norm
            && !(n > 0.0 && n.is_finite())
        {
            return Err(JobError::field(
                "training.clip_grad_norm",
                format!("must be greater than 0 (got {n})"),
            ));
        }
        if t.schedule == PipelineSchedule::Async {
            if t.clip_grad_norm.is_some() {
                return Err(JobError::field(
                    "training.clip_grad_norm",
                    "cannot be used with schedule = \"async\": clipping needs the whole cluster's gradient norm before each update, which async does not wait for (use gpipe or 1f1b)",
                ));
            }
            if t.verify_rate > 0.0 {
                return Err(JobError::field(
                    "training.verify",
                    "spot checks cannot be used with schedule = \"async\" yet: a checker would need the stashed weights the micro-batch ran with (use gpipe or 1f1b)",
                ));
            }
        }
        match t.val_every {
            Some(0) => {
                return Err(JobError::field(
                    "training.val_every",
                    "must be at least 1 (got 0)",
                ));
            }
            Some(_) if self.data.test_inputs.is_none() => {
                return Err(JobError::field(
                    "training.val_every",
                    "evaluates on the test set, and this job has none: give data.test_inputs or leave val_every out",
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// `format = "tokens"`: a window length that is the model's input, and no labels files.
    fn validate_tokens(&self) -> Result<(), JobError> {
        let d = &self.data;
        for (field, given) in [
            ("data.train_labels", d.train_labels.is_some()),
            ("data.test_labels", d.test_labels.is_some()),
        ] {
            if given {
                return Err(JobError::field(
                    field,
                    "not used with format = \"tokens\": each position's label is the next token of the inputs file; leave it out",
                ));
            }
        }
        let seq_len = match d.seq_len {
            None => {
                return Err(JobError::field(
                    "data.seq_len",
                    "missing: format = \"tokens\" needs the number of tokens a sample feeds the model",
                ));
            }
            Some(0) => {
                return Err(JobError::field(
                    "data.seq_len",
                    "must be at least 1 (got 0)",
                ));
            }
            Some(n) => n,
        };
        if self.model.input_shape != [seq_len] {
            return Err(JobError::field(
                "model.input_shape",
                format!(
                    "must be [data.seq_len] = [{seq_len}] for format = \"tokens\" (got {:?})",
                    self.model.input_shape
                ),
            ));
        }
        Ok(())
    }

    fn from_file_form(f: JobFile, base: &Path, paths: Paths) -> Result<Self, JobError> {
        let source = match (f.model.onnx, f.model.spec) {
            (Some(p), None) => ModelSource::Onnx(resolve("model.onnx", &p, base, paths)?),
            (None, Some(p)) => ModelSource::Spec(resolve("model.spec", &p, base, paths)?),
            (Some(_), Some(_)) => {
                return Err(JobError::field(
                    "model",
                    "give either `onnx` or `spec`, not both",
                ));
            }
            (None, None) => {
                return Err(JobError::field(
                    "model",
                    "missing the model file: give `onnx = \"model.onnx\"` (an ONNX export) \
                     or `spec = \"model.toml\"` (a layer spec)",
                ));
            }
        };
        let d = f.data;
        let fmt = d.format;
        let data_ref = |field: &str, s: &str| parse_ref(field, s, base, fmt, paths);
        let data = DataSpec {
            format: fmt,
            train_inputs: data_ref("data.train_inputs", &d.train_inputs)?,
            train_labels: d
                .train_labels
                .as_deref()
                .map(|s| data_ref("data.train_labels", s))
                .transpose()?,
            test_inputs: d
                .test_inputs
                .as_deref()
                .map(|s| data_ref("data.test_inputs", s))
                .transpose()?,
            test_labels: d
                .test_labels
                .as_deref()
                .map(|s| data_ref("data.test_labels", s))
                .transpose()?,
            scale: d.scale,
            mean: d.mean,
            std: d.std,
            seq_len: d.seq_len,
            token_dtype: d.token_dtype,
        };
        let t = f.training;
        let sync = t.sync.clone().unwrap_or_default();
        let sync_every = match (t.sync_every, sync.every) {
            (Some(_), Some(_)) => {
                return Err(JobError::field(
                    "training.sync.every",
                    "is training.sync_every too: give one of the two",
                ));
            }
            (a, b) => a.or(b),
        };
        let sync_int8 = match sync.compress.as_deref() {
            None | Some("none") => false,
            Some("int8") => true,
            Some(other) => {
                return Err(JobError::field(
                    "training.sync.compress",
                    format!(
                        "`{other}` is not supported: \"none\" (parameters travel as f32) or \"int8\" (their change since the last sync, blockwise int8)"
                    ),
                ));
            }
        };
        let training = TrainingSpec {
            epochs: t.epochs.unwrap_or(1),
            batch_size: t.batch_size,
            micro_batches: t.micro_batches.unwrap_or(1),
            loss: match t.loss {
                Some(l) => l.into_loss()?,
                None => Loss::cross_entropy(),
            },
            optimizer: match t.optimizer {
                Some(o) => o.into_config()?,
                None => OptimizerConfig::sgd(0.01),
            },
            clusters: t.clusters.map_or(ClusterCount::Auto, |c| c.0),
            // A sync drains an `async` pipeline: every step would leave
            // it nothing to overlap.
            sync_every: sync_every.unwrap_or(match t.schedule {
                Some(PipelineSchedule::Async) => ASYNC_SYNC_EVERY,
                _ => 1,
            }),
            stages: t.stages,
            shuffle: t.shuffle.unwrap_or(true),
            seed: t.seed.unwrap_or(0),
            wire_dtype: match t.wire_dtype.unwrap_or(WireDType::F32) {
                d if d.is_float() => d,
                d => {
                    return Err(JobError::field(
                        "training.wire_dtype",
                        format!(
                            "activations and gradients travel as f32, f16, bf16 or int8, not {}",
                            d.as_str()
                        ),
                    ));
                }
            },
            aggregation: t.aggregation.unwrap_or_default(),
            lr_schedule: match t.lr_schedule {
                Some(s) => s.into_schedule()?,
                None => LrSchedule::default(),
            },
            clip_grad_norm: t.clip_grad_norm,
            verify_rate: match t.verify.map_or(0.0, |v| v.rate) {
                rate if (0.0..=1.0).contains(&rate) => rate,
                rate => {
                    return Err(JobError::field(
                        "training.verify.rate",
                        format!("the share of micro-batches to check is 0 to 1, not {rate}"),
                    ));
                }
            },
            val_every: t.val_every,
            average_optimizer: t.average_optimizer.unwrap_or(false),
            schedule: t.schedule.unwrap_or_default(),
            sync_int8,
            precision: t.precision.unwrap_or_default(),
            outer_optimizer: match sync.outer_optimizer {
                Some(o) => Some(OuterOptimizer::from_file(o)?),
                None => None,
            },
        };
        let spec = JobSpec {
            model: ModelSection {
                source,
                input_shape: f.model.input_shape,
            },
            data,
            training,
            public_name: f.public_name,
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// Which paths a job file may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paths {
    /// Any path (a job file on the Requester's own machine).
    Any,
    /// Only relative paths inside the base directory (an upload).
    Inside,
}

fn resolve(field: &str, s: &str, base: &Path, paths: Paths) -> Result<PathBuf, JobError> {
    if s.is_empty() {
        return Err(JobError::field(field, "is empty: expected a file path"));
    }
    let path = Path::new(s);
    if paths == Paths::Inside
        && !path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
    {
        return Err(JobError::field(
            field,
            format!("`{s}` must name an uploaded file: a relative path without `..`"),
        ));
    }
    Ok(base.join(s))
}

/// `file:array` for formats with members, unless the whole string names a file.
fn parse_ref(
    field: &str,
    s: &str,
    base: &Path,
    format: DataFormat,
    paths: Paths,
) -> Result<DataRef, JobError> {
    let whole = resolve(field, s, base, paths)?;
    if format.has_members()
        && !whole.is_file()
        && let Some((file, member)) = s.rsplit_once(':')
        && !file.is_empty()
        && !member.is_empty()
        && !member.contains(['/', '\\'])
    {
        return Ok(DataRef::member(resolve(field, file, base, paths)?, member));
    }
    Ok(DataRef::file(whole))
}

fn check_ref(field: &str, r: &DataRef, has_members: bool) -> Result<(), JobError> {
    if r.member.is_some() && !has_members {
        return Err(JobError::field(
            field,
            format!("`{r}`: only npz and safetensors files hold named arrays"),
        ));
    }
    check_file(field, &r.path, !has_members)
}

fn check_file(field: &str, path: &Path, hint_colon: bool) -> Result<(), JobError> {
    if path.is_file() {
        return Ok(());
    }
    let hint = if hint_colon && path.to_string_lossy().contains(':') {
        " (`file:array` references are for npz and safetensors data)"
    } else {
        ""
    };
    Err(JobError::field(
        field,
        format!("no such file: {}{hint}", path.display()),
    ))
}

/// Which optimizer field a `torch.optim`-worded validation message is about.
fn optimizer_field(message: &str) -> &'static str {
    const KEYS: [(&str, &str); 8] = [
        ("Nesterov", "nesterov"),
        ("learning rate", "lr"),
        ("momentum", "momentum"),
        ("beta", "betas"),
        ("epsilon", "eps"),
        ("weight_decay", "weight_decay"),
        ("alpha", "alpha"),
        ("dampening", "dampening"),
    ];
    KEYS.iter()
        .find(|(k, _)| message.contains(k))
        .map_or("name", |(_, f)| f)
}

/// One line: toml's message and the line it is on.
fn toml_reason(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim();
    match e.span() {
        Some(span) => {
            let line = text
                .get(..span.start)
                .map_or(0, |s| s.matches('\n').count())
                + 1;
            format!("{message} (line {line})")
        }
        None => message.to_string(),
    }
}

/// A typed-deserialization error with the dotted path of the field it is in.
fn path_error<E>(e: serde_path_to_error::Error<E>, reason: impl Fn(&E) -> String) -> JobError {
    let path = e.path().to_string();
    let reason = reason(e.inner());
    // serde names a missing or unknown field in the message; put it in the path.
    let named = ["missing field `", "unknown field `"]
        .iter()
        .find_map(|p| reason.split_once(p).and_then(|(_, r)| r.split_once('`')))
        .map(|(name, _)| name.to_string());
    let field = match (path.as_str(), named) {
        (".", Some(n)) => n,
        (".", None) => "job".to_string(),
        (p, Some(n)) if reason.contains("missing field") => format!("{p}.{n}"),
        (p, _) => p.to_string(),
    };
    JobError::Field { field, reason }
}

fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl From<JobSpec> for JobFile {
    fn from(j: JobSpec) -> Self {
        let (onnx, spec) = match &j.model.source {
            ModelSource::Onnx(p) => (Some(path_string(p)), None),
            ModelSource::Spec(p) => (None, Some(path_string(p))),
        };
        let d = j.data;
        let t = j.training;
        JobFile {
            public_name: j.public_name,
            model: ModelFile {
                onnx,
                spec,
                input_shape: j.model.input_shape,
            },
            data: DataFile {
                format: d.format,
                train_inputs: d.train_inputs.to_string(),
                train_labels: d.train_labels.map(|r| r.to_string()),
                test_inputs: d.test_inputs.map(|r| r.to_string()),
                test_labels: d.test_labels.map(|r| r.to_string()),
                scale: d.scale,
                mean: d.mean,
                std: d.std,
                seq_len: d.seq_len,
                token_dtype: d.token_dtype,
            },
            training: TrainingFile {
                epochs: Some(t.epochs),
                batch_size: t.batch_size,
                micro_batches: Some(t.micro_batches),
                loss: Some(t.loss.into()),
                optimizer: Some(t.optimizer.into()),
                clusters: Some(Clusters(t.clusters)),
                sync_every: Some(t.sync_every),
                stages: t.stages,
                shuffle: Some(t.shuffle),
                seed: Some(t.seed),
                wire_dtype: Some(t.wire_dtype),
                aggregation: Some(t.aggregation),
                lr_schedule: Some(t.lr_schedule.into()),
                clip_grad_norm: t.clip_grad_norm,
                verify: (t.verify_rate > 0.0).then_some(VerifyFile {
                    rate: t.verify_rate,
                }),
                val_every: t.val_every,
                average_optimizer: Some(t.average_optimizer),
                schedule: Some(t.schedule),
                precision: Some(t.precision),
                sync: (t.outer_optimizer.is_some() || t.sync_int8).then(|| SyncFile {
                    every: None,
                    outer_optimizer: t.outer_optimizer.map(|o| o.to_file()),
                    compress: t.sync_int8.then(|| "int8".to_string()),
                }),
            },
        }
    }
}
