//! The job file as it is written: TOML or JSON, every field named as in the
//! README, optional ones `None`. [`JobFile`] is what serde reads before
//! [`JobSpec`] resolves paths, fills defaults and validates, and what a
//! client (the dashboard) fills in and serialises to submit a job, so the
//! form and the server agree on one definition.

use std::fmt;

use rookery_model::{ClassAxis, ClusterCount, Loss, LrSchedule, OptimizerConfig, Precision};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::JobError;
use rookery_proto::{PipelineSchedule, WireDType};
use std::path::Path;

/// How a sync combines the clusters' copies of each parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// The arithmetic mean: exact, and what parity with one process needs.
    #[default]
    Mean,
    /// The coordinate-wise median.
    Median,
    /// CenteredClip: start at the median, then average the clusters'
    /// differences clipped to a radius, a few times.
    CenteredClip,
}

/// How the data files are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// MNIST's IDX files, optionally gzipped.
    Idx,
    /// NumPy `.npy`, optionally gzipped.
    Npy,
    /// NumPy `.npz` (a zip of `.npy` files, stored or deflated).
    Npz,
    Safetensors,
    /// Comma-separated numbers, one sample a row, optional header row.
    Csv,
    /// A language model's token ids: a flat file of u16 or u32 ids (or a
    /// `.npy` of them), cut into `seq_len + 1` windows with next-token labels.
    Tokens,
}

impl DataFormat {
    /// Whether a file holds several named arrays (`file:array` references).
    pub fn has_members(self) -> bool {
        matches!(self, DataFormat::Npz | DataFormat::Safetensors)
    }
}

/// The width of a raw token file's ids (`data.token_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDType {
    U16,
    U32,
}

impl TokenDType {
    pub fn size(self) -> usize {
        match self {
            TokenDType::U16 => 2,
            TokenDType::U32 => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TokenDType::U16 => "u16",
            TokenDType::U32 => "u32",
        }
    }

    /// The width a file's name gives: `*.u16`, `*.u32`, or either then `.gz`.
    pub fn from_file_name(path: &Path) -> Option<TokenDType> {
        let name = path.file_name()?.to_str()?;
        let name = name.strip_suffix(".gz").unwrap_or(name);
        match name.rsplit_once('.')?.1 {
            "u16" => Some(TokenDType::U16),
            "u32" => Some(TokenDType::U32),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// The name donors may see while their tab trains the job; without it
    /// the job is private. In TOML, above the first table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_name: Option<String>,
    pub model: ModelFile,
    pub data: DataFile,
    pub training: TrainingFile,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onnx: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
    pub input_shape: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataFile {
    pub format: DataFormat,
    pub train_inputs: String,
    /// Every format but `tokens`, whose labels are the next tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_labels: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_inputs: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_labels: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<f64>,
    /// `tokens` only: tokens a window feeds the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// `tokens` only: the width of a raw file's ids, when its name does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_dtype: Option<TokenDType>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    pub batch_size: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clusters: Option<Clusters>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_every: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire_dtype: Option<WireDType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregation: Option<Aggregation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<PipelineSchedule>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<LrScheduleFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifyFile>,
    /// Ravnest's `val_freq`.
    #[serde(default, alias = "val_freq", skip_serializing_if = "Option::is_none")]
    pub val_every: Option<u64>,
    /// Ravnest's `average_optim`.
    #[serde(
        default,
        alias = "average_optim",
        skip_serializing_if = "Option::is_none"
    )]
    pub average_optimizer: Option<bool>,
    /// `[training.sync]`: how often clusters sync, and DiLoCo's outer step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncFile>,
}

/// `[training.sync]`: `every` (the same as `sync_every`), the outer
/// optimizer a sync applies to the clusters' combined change, and how
/// that change travels.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_optimizer: Option<OuterOptimizerFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<String>,
}

/// `outer_optimizer = { name = "nesterov", lr = 0.7, momentum = 0.9 }`:
/// `sgd` (momentum default 0) or `nesterov` (SGD with Nesterov momentum,
/// default 0.9), as `torch.optim.SGD` applies them to the pseudo-gradient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OuterOptimizerFile {
    pub name: String,
    pub lr: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
}

/// `[training.verify]`: spot checks of providers' work.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyFile {
    pub rate: f64,
}

/// `[training.lr_schedule]`, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrScheduleFile {
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
}

impl LrScheduleFile {
    pub(crate) fn into_schedule(self) -> Result<LrSchedule, JobError> {
        let kind = self.kind.to_ascii_lowercase();
        let takes: &[&str] = match kind.as_str() {
            "constant" => &["warmup_steps"],
            "linear" => &["warmup_steps", "total_steps"],
            "cosine" => &["warmup_steps", "total_steps", "min_lr"],
            "step" => &["step_size", "gamma"],
            _ => {
                return Err(JobError::field(
                    "training.lr_schedule.kind",
                    format!(
                        "unknown schedule `{}`; expected one of constant, linear, cosine, step",
                        self.kind
                    ),
                ));
            }
        };
        let given = [
            ("warmup_steps", self.warmup_steps.is_some()),
            ("total_steps", self.total_steps.is_some()),
            ("min_lr", self.min_lr.is_some()),
            ("step_size", self.step_size.is_some()),
            ("gamma", self.gamma.is_some()),
        ];
        if let Some((key, _)) = given.iter().find(|(k, g)| *g && !takes.contains(k)) {
            return Err(JobError::field(
                format!("training.lr_schedule.{key}"),
                format!(
                    "a {kind} schedule has no `{key}` (it takes {})",
                    takes.join(", ")
                ),
            ));
        }
        let warmup_steps = self.warmup_steps.unwrap_or(0);
        Ok(match kind.as_str() {
            "constant" => LrSchedule::Constant { warmup_steps },
            "linear" => LrSchedule::Linear {
                warmup_steps,
                total_steps: self.total_steps,
            },
            "cosine" => LrSchedule::Cosine {
                warmup_steps,
                total_steps: self.total_steps,
                min_lr: self.min_lr.unwrap_or(0.0),
            },
            _ => LrSchedule::Step {
                step_size: self.step_size.ok_or_else(|| {
                    JobError::field(
                        "training.lr_schedule.step_size",
                        "missing: a step schedule needs step_size",
                    )
                })?,
                // StepLR's default.
                gamma: self.gamma.unwrap_or(0.1),
            },
        })
    }
}

impl From<LrSchedule> for LrScheduleFile {
    fn from(s: LrSchedule) -> Self {
        match s {
            LrSchedule::Constant { warmup_steps } => LrScheduleFile {
                kind: "constant".into(),
                warmup_steps: Some(warmup_steps),
                ..LrScheduleFile::default()
            },
            LrSchedule::Linear {
                warmup_steps,
                total_steps,
            } => LrScheduleFile {
                kind: "linear".into(),
                warmup_steps: Some(warmup_steps),
                total_steps,
                ..LrScheduleFile::default()
            },
            LrSchedule::Cosine {
                warmup_steps,
                total_steps,
                min_lr,
            } => LrScheduleFile {
                kind: "cosine".into(),
                warmup_steps: Some(warmup_steps),
                total_steps,
                min_lr: Some(min_lr),
                ..LrScheduleFile::default()
            },
            LrSchedule::Step { step_size, gamma } => LrScheduleFile {
                kind: "step".into(),
                step_size: Some(step_size),
                gamma: Some(gamma),
                ..LrScheduleFile::default()
            },
        }
    }
}

/// `torch.optim` parameter names, tagged by `name`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerFile {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dampening: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amsgrad: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub centered: Option<bool>,
}

const SGD_PARAMS: &[&str] = &["lr", "momentum", "dampening", "nesterov", "weight_decay"];
const ADAM_PARAMS: &[&str] = &["lr", "betas", "eps", "weight_decay", "amsgrad"];
const RMSPROP_PARAMS: &[&str] = &["lr", "alpha", "eps", "weight_decay", "momentum", "centered"];

impl OptimizerFile {
    fn given(&self) -> [(&'static str, bool); 10] {
        [
            ("lr", self.lr.is_some()),
            ("momentum", self.momentum.is_some()),
            ("dampening", self.dampening.is_some()),
            ("nesterov", self.nesterov.is_some()),
            ("weight_decay", self.weight_decay.is_some()),
            ("betas", self.betas.is_some()),
            ("eps", self.eps.is_some()),
            ("amsgrad", self.amsgrad.is_some()),
            ("alpha", self.alpha.is_some()),
            ("centered", self.centered.is_some()),
        ]
    }

    pub(crate) fn into_config(self) -> Result<OptimizerConfig, JobError> {
        let name = self.name.to_ascii_lowercase();
        // torch.optim's default learning rates.
        let (params, mut config) = match name.as_str() {
            "sgd" => (SGD_PARAMS, OptimizerConfig::sgd(self.lr.unwrap_or(1e-3))),
            "adam" => (ADAM_PARAMS, OptimizerConfig::adam(self.lr.unwrap_or(1e-3))),
            "adamw" => (ADAM_PARAMS, OptimizerConfig::adamw(self.lr.unwrap_or(1e-3))),
            "rmsprop" => (
                RMSPROP_PARAMS,
                OptimizerConfig::rmsprop(self.lr.unwrap_or(1e-2)),
            ),
            _ => {
                return Err(JobError::field(
                    "training.optimizer.name",
                    format!(
                        "unknown optimizer `{}`; expected one of sgd, adam, adamw, rmsprop",
                        self.name
                    ),
                ));
            }
        };
        if let Some((key, _)) = self
            .given()
            .into_iter()
            .find(|(k, given)| *given && !params.contains(k))
        {
            return Err(JobError::field(
                format!("training.optimizer.{key}"),
                format!(
                    "{name} has no parameter `{key}` (it takes {})",
                    params.join(", ")
                ),
            ));
        }
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        match &mut config {
            OptimizerConfig::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
                ..
            } => {
                set(momentum, self.momentum);
                set(dampening, self.dampening);
                set(weight_decay, self.weight_decay);
                *nesterov = self.nesterov.unwrap_or(*nesterov);
            }
            OptimizerConfig::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
                ..
            }
            | OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
                ..
            } => {
                match self.betas.as_deref() {
                    None => {}
                    Some(&[b1, b2]) => {
                        *beta1 = b1;
                        *beta2 = b2;
                    }
                    Some(other) => {
                        return Err(JobError::field(
                            "training.optimizer.betas",
                            format!("expected two values [beta1, beta2], got {other:?}"),
                        ));
                    }
                }
                set(eps, self.eps);
                set(weight_decay, self.weight_decay);
                *amsgrad = self.amsgrad.unwrap_or(*amsgrad);
            }
            OptimizerConfig::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
                ..
            } => {
                set(alpha, self.alpha);
                set(eps, self.eps);
                set(weight_decay, self.weight_decay);
                set(momentum, self.momentum);
                *centered = self.centered.unwrap_or(*centered);
            }
        }
        Ok(config)
    }
}

impl From<OptimizerConfig> for OptimizerFile {
    fn from(c: OptimizerConfig) -> Self {
        match c {
            OptimizerConfig::Sgd {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => OptimizerFile {
                name: "sgd".into(),
                lr: Some(lr),
                momentum: Some(momentum),
                dampening: Some(dampening),
                nesterov: Some(nesterov),
                weight_decay: Some(weight_decay),
                ..OptimizerFile::default()
            },
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            }
            | OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
            } => OptimizerFile {
                name: if matches!(c, OptimizerConfig::Adam { .. }) {
                    "adam".into()
                } else {
                    "adamw".into()
                },
                lr: Some(lr),
                betas: Some(vec![beta1, beta2]),
                eps: Some(eps),
                weight_decay: Some(weight_decay),
                amsgrad: Some(amsgrad),
                ..OptimizerFile::default()
            },
            OptimizerConfig::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => OptimizerFile {
                name: "rmsprop".into(),
                lr: Some(lr),
                alpha: Some(alpha),
                eps: Some(eps),
                weight_decay: Some(weight_decay),
                momentum: Some(momentum),
                centered: Some(centered),
                ..OptimizerFile::default()
            },
        }
    }
}

/// `loss = "cross_entropy"` (or `"mse"`), or a table with the name and
/// cross-entropy's options: `loss = { name = "cross_entropy", class_axis =
/// -1, ignore_index = -100 }` (`class_axis`: 1, torch's layout and the
/// default, or -1 for classes last; `ignore_index`: default -100).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossFile {
    pub name: String,
    pub class_axis: Option<i64>,
    pub ignore_index: Option<i64>,
}

impl LossFile {
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    pub(crate) fn into_loss(self) -> Result<Loss, JobError> {
        match self.name.to_ascii_lowercase().as_str() {
            "cross_entropy" => {
                let class_axis = match self.class_axis {
                    None => ClassAxis::Second,
                    Some(i) => ClassAxis::from_index(i).ok_or_else(|| {
                        JobError::field(
                            "training.loss.class_axis",
                            format!(
                                "must be 1 (logits [N, C, ..], torch's layout) or -1 (logits [N, .., C]); got {i}"
                            ),
                        )
                    })?,
                };
                Ok(Loss::CrossEntropy {
                    class_axis,
                    ignore_index: self
                        .ignore_index
                        .unwrap_or(rookery_model::loss::TORCH_IGNORE_INDEX),
                })
            }
            "mse" => {
                for (key, given) in [
                    ("class_axis", self.class_axis.is_some()),
                    ("ignore_index", self.ignore_index.is_some()),
                ] {
                    if given {
                        return Err(JobError::field(
                            format!("training.loss.{key}"),
                            "mse has no such option (only cross_entropy takes class_axis and ignore_index)",
                        ));
                    }
                }
                Ok(Loss::Mse)
            }
            _ => Err(JobError::field(
                "training.loss",
                format!(
                    "unknown loss `{}`; expected cross_entropy or mse",
                    self.name
                ),
            )),
        }
    }
}

impl From<Loss> for LossFile {
    fn from(loss: Loss) -> Self {
        match loss {
            Loss::CrossEntropy { .. } if loss == Loss::cross_entropy() => {
                Self::named("cross_entropy")
            }
            Loss::CrossEntropy {
                class_axis,
                ignore_index,
            } => Self {
                name: "cross_entropy".into(),
                class_axis: Some(class_axis.index()),
                ignore_index: Some(ignore_index),
            },
            Loss::Mse => Self::named("mse"),
        }
    }
}

/// The table form of [`LossFile`].
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LossTable {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    class_axis: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ignore_index: Option<i64>,
}

impl Serialize for LossFile {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.class_axis.is_none() && self.ignore_index.is_none() {
            return s.serialize_str(&self.name);
        }
        LossTable {
            name: self.name.clone(),
            class_axis: self.class_axis,
            ignore_index: self.ignore_index,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for LossFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LossFile;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a loss name or a table { name = .., class_axis = .., ignore_index = .. }",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LossFile, E> {
                Ok(LossFile::named(v))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<LossFile, A::Error> {
                let t = LossTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(LossFile {
                    name: t.name,
                    class_axis: t.class_axis,
                    ignore_index: t.ignore_index,
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// `clusters = "auto"` or `clusters = 3`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clusters(pub ClusterCount);

impl Serialize for Clusters {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            ClusterCount::Auto => s.serialize_str("auto"),
            ClusterCount::Fixed(n) => s.serialize_u64(n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Clusters {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Clusters;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or a number of clusters")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Clusters, E> {
                if v == "auto" {
                    Ok(Clusters(ClusterCount::Auto))
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Clusters, E> {
                usize::try_from(v)
                    .map(|n| Clusters(ClusterCount::Fixed(n)))
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Clusters, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
        }
        d.deserialize_any(V)
    }
}
