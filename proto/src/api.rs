//! JSON bodies of the REST API, shared by the server and the dashboard.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ProviderKind;

/// The header in which a caller of `GET /api/providers` presents a provider
/// credential the server issued, to see that provider's own rows.
pub const CREDENTIAL_HEADER: &str = "x-rookery-credential";

/// Answer of `GET /api/providers`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProviderList {
    pub summary: ProviderSummary,
    /// For a Requester, every provider the server keeps; for anyone else,
    /// only those whose identity the credential in `X-Rookery-Credential`
    /// proves (a donor's own connections).
    pub providers: Vec<ProviderInfo>,
}

/// A donor on the public leaderboard (`GET /api/leaderboard`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaderboardEntry {
    /// The name the donor chose (`rookery-provider --donor-name`), or
    /// `anonymous`.
    pub name: String,
    /// The team it joined, if any.
    pub team: Option<String>,
    /// Accepted training work, GFLOP: each finished step's planned work
    /// of its stages, once a checkpoint holds it; a ban withdraws the job's.
    pub credit: f64,
}

/// `gflop` in the largest unit that keeps it at 1 or more, as credit is
/// shown to people: "3.20 TFLOP", "12.00 MFLOP".
pub fn flop_text(gflop: f64) -> String {
    const UNITS: [&str; 8] = [
        "FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP",
    ];
    let mut value = gflop * 1e9;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// What anyone may know of the providers: counts, never who.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProviderSummary {
    /// Connected providers by kind (`native`, `browser`; every kind, zero
    /// included).
    pub connected: BTreeMap<String, u64>,
    /// The GFLOP/s the connected providers claim, added up.
    pub connected_gflops: f64,
    /// Provider identities the server has issued: every provider that ever
    /// joined, counted once however often it reconnected.
    pub ever_seen: u64,
}

/// Whether a provider is connected now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ProviderStatus {
    Connected,
    /// Disconnected or stopped heartbeating; kept for the record.
    Gone,
}

/// One row of `GET /api/providers`. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProviderInfo {
    pub id: u64,
    pub name: String,
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub kind: ProviderKind,
    pub device: String,
    pub memory_bytes: u64,
    pub gflops: f64,
    /// Link bandwidth to the server in Mbit/s, measured after joining.
    #[serde(default)]
    pub bandwidth_mbps: Option<f64>,
    pub status: ProviderStatus,
    pub connected_since_ms: u64,
    pub last_heartbeat_ms: u64,
    pub gone_since_ms: Option<u64>,
    /// Why the provider is gone, in words (closed, heartbeat timeout, ...).
    pub gone_reason: Option<String>,
    /// The stage it runs now, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<ProviderWork>,
    /// While connected, the share of the time its donor lets its GPU
    /// compute (0.1 to 1; below 1 the planner counts it at `gflops` times
    /// this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duty_cycle: Option<f64>,
    /// Why its donor paused it, when that is why it is gone (the tab was
    /// hidden, the device went on battery, the GPU was busy, or the
    /// button): [`pause_reason`] of its `gone_reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_reason: Option<String>,
}

/// How a donating tab's close frame begins when its donor (or the tab on
/// the donor's behalf) pauses it; the reason follows.
pub const PAUSED_BY_DONOR: &str = "paused by the donor: ";

/// The donor's reason in a gone provider's reason (`closed: paused by the
/// donor: the tab is hidden` gives `the tab is hidden`), if it paused.
pub fn pause_reason(gone_reason: &str) -> Option<&str> {
    let reason = gone_reason
        .strip_prefix("closed: ")?
        .strip_prefix(PAUSED_BY_DONOR)?
        .trim();
    (!reason.is_empty()).then_some(reason)
}

/// What a connected provider is doing for a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProviderWork {
    pub job_id: u64,
    pub cluster: u32,
    pub stage: u32,
    /// `root`, `stem`, `leaf` or `single`.
    pub role: String,
    /// Micro-batches this provider has carried through its stage (forward
    /// and backward) in this job.
    pub micro_batches_done: u64,
}

/// Body of every error response of the REST API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiError {
    pub error: String,
    /// The job-file field the error is about (dotted, e.g.
    /// `training.optimizer.lr`), so a form can show it next to that field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[cfg(test)]
mod tests {

    #[test]
    fn credit_is_shown_in_the_largest_unit_at_or_above_one() {
        for (gflop, text) in [
            (0.0, "0.00 FLOP"),
            (2e-9, "2.00 FLOP"),
            (0.5, "500.00 MFLOP"),
            (999.0, "999.00 GFLOP"),
            (3_200.0, "3.20 TFLOP"),
            (4.5e6, "4.50 PFLOP"),
            (7e15, "7000.00 ZFLOP"),
        ] {
            assert_eq!(flop_text(gflop), text);
        }
    }

    use super::*;

    #[test]
    fn provider_info_json_uses_plain_words() {
        let info = ProviderInfo {
            id: 1,
            name: "tab".into(),
            kind: ProviderKind::Browser,
            device: "SwiftShader".into(),
            memory_bytes: 1,
            gflops: 2.0,
            bandwidth_mbps: Some(950.0),
            status: ProviderStatus::Gone,
            connected_since_ms: 3,
            last_heartbeat_ms: 4,
            gone_since_ms: Some(5),
            gone_reason: Some("closed".into()),
            work: None,
            duty_cycle: Some(0.5),
            paused_reason: None,
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["kind"], "browser");
        assert_eq!(json["status"], "gone");
        let back: ProviderInfo = serde_json::from_value(json).unwrap();
        assert_eq!(back, info);
    }

    #[test]
    fn a_donors_pause_reads_as_its_reason_and_other_ends_as_none() {
        let paused = format!("closed: {PAUSED_BY_DONOR}the tab is hidden");
        assert_eq!(pause_reason(&paused), Some("the tab is hidden"));
        for other in [
            "closed",
            "closed: going away",
            "heartbeat timeout: no frame for 2000 ms",
            "closed: paused by the donor: ",
        ] {
            assert_eq!(pause_reason(other), None, "{other}");
        }
    }
}

/// One job as listed by `GET /api/jobs` and `GET /api/jobs/{id}`. Times are
/// Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobInfo {
    pub id: u64,
    pub name: String,
    /// `queued`, `planning`, `running`, `completed`, `failed` or `cancelled`.
    pub status: String,
    /// Why a queued job waits, or why a job failed.
    pub detail: Option<String>,
    pub created_ms: u64,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    /// Training steps done, of `total_steps` (0 until planned).
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub last_loss: Option<f64>,
    pub samples_per_s: Option<f64>,
    /// The planner's answer (clusters, stages, providers), once planned.
    pub plan: Option<PlanView>,
}

/// A plan as people read it: each cluster a chain of stages from Root to
/// Leaf. Answer of `POST /api/plan`, and `JobInfo::plan` once a job started.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanView {
    pub clusters: Vec<ClusterView>,
    /// Providers the plan leaves idle, by id.
    pub standbys: Vec<u64>,
    pub param_count: u64,
    pub param_bytes: u64,
    /// Estimated seconds per micro-batch of the slowest stage of all clusters.
    pub bottleneck_s: f64,
    /// Samples per cluster per micro-batch the estimates assume.
    pub micro_batch: u64,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterView {
    pub stages: Vec<StageView>,
    pub bottleneck_s: f64,
}

/// One stage of a cluster and the provider that runs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StageView {
    /// `root`, `stem`, `leaf` or `single` (Root and Leaf at once).
    pub role: String,
    pub provider: u64,
    pub provider_name: String,
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub provider_kind: ProviderKind,
    pub device: String,
    pub provider_memory_bytes: u64,
    /// Graph nodes the stage runs, and the first and last of them.
    pub nodes: u64,
    pub first_node: String,
    pub last_node: String,
    pub param_count: u64,
    /// Estimated peak memory of the stage (parameters, optimizer state,
    /// activations in flight).
    pub memory_bytes: u64,
    /// Estimated seconds per micro-batch: compute, transfer and their sum.
    pub compute_s: f64,
    pub transfer_s: f64,
    pub time_s: f64,
}

/// A dataset kept on the server (`GET /api/datasets`): a folder of files a
/// job upload can name in its `dataset` part instead of carrying them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DatasetInfo {
    pub name: String,
    pub files: Vec<DatasetFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DatasetFile {
    pub name: String,
    pub bytes: u64,
}

/// Answer to `POST /api/plan`: what the scheduler would do with the upload
/// and the providers connected now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PlanPreview {
    pub plan: PlanView,
    /// Things the Requester should know (e.g. an inference-mode ONNX export).
    pub warnings: Vec<String>,
    pub train_samples: u64,
    pub test_samples: u64,
}

/// One line of a job's event log (`GET /api/jobs/{id}/log`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogEntry {
    pub at_ms: u64,
    /// `submitted`, `planned`, `provider_joined`, `provider_left`,
    /// `provider_fault`, `provider_banned`, `stage_assigned`, `running`,
    /// `sync`, `checkpoint`, `epoch`, `completed`, `failed` or `cancelled`.
    pub kind: String,
    pub message: String,
}

/// One message of the live stream `GET /api/events` (server-sent events,
/// the SSE event name is `job`). Every change the dashboard shows arrives
/// this way, so pages never reload to see progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobEvent {
    pub job_id: u64,
    #[serde(flatten)]
    pub body: JobEventBody,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum JobEventBody {
    /// The job's row changed (status, progress, plan): here is all of it.
    Job {
        job: JobInfo,
    },
    Step {
        step: StepMetric,
    },
    Epoch {
        epoch: EpochMetric,
    },
    Log {
        entry: LogEntry,
    },
}

/// Answer to `POST /api/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobCreated {
    pub id: u64,
    /// Things the Requester should know (e.g. an inference-mode ONNX export).
    pub warnings: Vec<String>,
}

/// Time one stage spent on a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StageMetric {
    pub cluster: u32,
    pub stage: u32,
    pub provider: u64,
    pub compute_ms: f64,
    pub idle_ms: f64,
    /// The plan's estimate of `compute_ms`: its compute time for the
    /// stage's micro-batches at the provider's claimed speed (0 where the
    /// plan had none).
    #[serde(default)]
    pub planned_ms: f64,
    /// The most micro-batches whose activations the stage held at once
    /// (what the job's schedule bounds; 0 in records from before it was kept).
    #[serde(default)]
    pub peak_held: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StepMetric {
    pub step: u64,
    pub epoch: u64,
    /// Mean training loss over every cluster's batch.
    pub loss: f64,
    pub samples_per_s: f64,
    pub elapsed_ms: f64,
    /// Activation and gradient bytes the server relayed during the step.
    pub bytes_relayed: u64,
    /// Parameter and optimizer-state bytes that syncs moved since the
    /// previous step (uploads and what went back): the traffic between
    /// clusters and the server.
    #[serde(default)]
    pub bytes_synced: u64,
    pub stages: Vec<StageMetric>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EpochMetric {
    /// The epoch evaluated (0-based): the one that just ended, or the one
    /// under way for an evaluation every `val_every` steps.
    pub epoch: u64,
    /// Steps done when the evaluation was taken.
    #[serde(default)]
    pub step: u64,
    pub test_loss: f64,
    pub test_accuracy: f64,
    pub samples: u64,
}

/// `GET /api/jobs/{id}/metrics`, also written as `metrics.json` by `rookery train`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobMetrics {
    pub steps: Vec<StepMetric>,
    pub epochs: Vec<EpochMetric>,
}
