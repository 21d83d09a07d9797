//! JSON bodies of the REST API, shared by the server and the dashboard.

use serde::{Deserialize, Serialize};

use crate::ProviderKind;

/// Whether a provider is connected now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderStatus {
    Connected,
    /// Disconnected or stopped heartbeating; kept for the record.
    Gone,
}

/// One row of `GET /api/providers`. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderInfo {
    pub id: u64,
    pub name: String,
    #[serde(with = "kind_as_str")]
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
}

/// Body of every error response of the REST API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

mod kind_as_str {
    use super::ProviderKind;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(kind: &ProviderKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(kind.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ProviderKind, D::Error> {
        let text = String::deserialize(d)?;
        ProviderKind::parse(&text)
            .ok_or_else(|| D::Error::custom(format!("unknown provider kind {text:?}")))
    }
}

#[cfg(test)]
mod tests {
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
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["kind"], "browser");
        assert_eq!(json["status"], "gone");
        let back: ProviderInfo = serde_json::from_value(json).unwrap();
        assert_eq!(back, info);
    }
}

/// One job as listed by `GET /api/jobs` and `GET /api/jobs/{id}`. Times are
/// Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pub plan: Option<serde_json::Value>,
}

/// Answer to `POST /api/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobCreated {
    pub id: u64,
    /// Things the Requester should know (e.g. an inference-mode ONNX export).
    pub warnings: Vec<String>,
}

/// Time one stage spent on a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageMetric {
    pub cluster: u32,
    pub stage: u32,
    pub provider: u64,
    pub compute_ms: f64,
    pub idle_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetric {
    pub step: u64,
    pub epoch: u64,
    /// Mean training loss over every cluster's batch.
    pub loss: f64,
    pub samples_per_s: f64,
    pub elapsed_ms: f64,
    /// Activation and gradient bytes the server relayed during the step.
    pub bytes_relayed: u64,
    pub stages: Vec<StageMetric>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochMetric {
    pub epoch: u64,
    pub test_loss: f64,
    pub test_accuracy: f64,
    pub samples: u64,
}

/// `GET /api/jobs/{id}/metrics`, also written as `metrics.json` by `rookery train`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct JobMetrics {
    pub steps: Vec<StepMetric>,
    pub epochs: Vec<EpochMetric>,
}
