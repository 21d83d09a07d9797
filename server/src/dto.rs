//! The edge where the server's records become the API's DTOs
//! (`rookery_proto::api`): jobs, steps, epochs, log lines, providers and
//! plans as the dashboard and the CLI see them, and the metrics as CSV. One
//! place, used by the HTTP handlers and by the coordinator's live events.

use std::collections::HashMap;
use std::fmt::Write as _;

use rookery_model::{Graph, ParamKind};
use rookery_plan::{Plan, StageRole};
use rookery_proto::Hello;
use rookery_proto::api::{
    ClusterView, EpochMetric, JobInfo, LogEntry, PlanView, ProviderInfo, ProviderStatus,
    StageMetric, StageView, StepMetric,
};

use crate::run::{EpochRecord, StepRecord};
use crate::store::jobs::{JobRecord, LogRecord};
use crate::store::providers::ProviderRecord;

/// The edge where the stored record becomes the API's DTO.
pub fn job_info(record: JobRecord) -> JobInfo {
    JobInfo {
        id: record.id,
        name: record.name,
        status: record.status.as_str().to_string(),
        detail: record.detail,
        created_ms: record.created_ms,
        started_ms: record.started_ms,
        finished_ms: record.finished_ms,
        step: record.step,
        total_steps: record.total_steps,
        epoch: record.epoch,
        last_loss: record.last_loss,
        samples_per_s: record.samples_per_s,
        // Rows planned before plans were stored as views have none.
        plan: record
            .plan_json
            .as_deref()
            .and_then(|p| serde_json::from_str(p).ok()),
    }
}

/// The edge where a stored step becomes the API's DTO.
pub fn step_metric(s: StepRecord) -> StepMetric {
    StepMetric {
        step: s.step,
        epoch: s.epoch,
        loss: s.loss,
        samples_per_s: s.samples_per_s,
        elapsed_ms: s.elapsed_ms,
        bytes_relayed: s.bytes_relayed,
        bytes_synced: s.bytes_synced,
        stages: s
            .stages
            .into_iter()
            .map(|t| StageMetric {
                cluster: t.cluster,
                stage: t.stage,
                provider: t.provider,
                compute_ms: t.compute_ms,
                planned_ms: t.planned_ms,
                peak_held: t.peak_held,
                idle_ms: t.idle_ms,
            })
            .collect(),
    }
}

/// The edge where an evaluated epoch becomes the API's DTO.
pub fn epoch_metric(e: &EpochRecord) -> EpochMetric {
    EpochMetric {
        epoch: e.epoch,
        step: e.step,
        test_loss: e.test_loss,
        test_accuracy: e.test_accuracy,
        samples: e.samples,
    }
}

/// The edge where a stored log line becomes the API's DTO.
pub fn log_entry(l: LogRecord) -> LogEntry {
    LogEntry {
        at_ms: l.at_ms,
        kind: l.kind,
        message: l.message,
    }
}

/// The edge where the server's record becomes the dashboard's DTO.
pub fn provider_info(record: ProviderRecord) -> ProviderInfo {
    ProviderInfo {
        id: record.id,
        name: record.name,
        kind: record.kind,
        device: record.device,
        memory_bytes: record.memory_bytes,
        gflops: record.gflops,
        bandwidth_mbps: record.bandwidth_mbps,
        status: if record.gone.is_some() {
            ProviderStatus::Gone
        } else {
            ProviderStatus::Connected
        },
        connected_since_ms: record.connected_ms,
        last_heartbeat_ms: record.last_heartbeat_ms,
        gone_since_ms: record.gone.as_ref().map(|gone| gone.at_ms),
        paused_reason: record
            .gone
            .as_ref()
            .and_then(|gone| rookery_proto::api::pause_reason(&gone.reason))
            .map(str::to_owned),
        gone_reason: record.gone.map(|gone| gone.reason),
        work: None,
        duty_cycle: None,
    }
}

/// A stage's role as the dashboard spells it.
pub fn role_word(role: StageRole) -> &'static str {
    match role {
        StageRole::Root => "root",
        StageRole::Stem => "stem",
        StageRole::Leaf => "leaf",
        StageRole::Single => "single",
    }
}

/// The edge where the planner's [`Plan`] becomes the dashboard's
/// [`PlanView`]: provider ids, names and devices instead of planner keys,
/// parameter counts per stage, and the roles spelled as words. `who` maps
/// the planner's provider keys (ids as text) to the provider.
pub fn plan_view(plan: &Plan, graph: &Graph, who: &HashMap<String, (u64, Hello)>) -> PlanView {
    let numel: HashMap<&str, u64> = graph
        .params
        .iter()
        .filter(|p| p.kind == ParamKind::Trainable)
        .map(|p| (p.name.as_str(), p.numel() as u64))
        .collect();
    let provider_id = |key: &str| who.get(key).map(|(id, _)| *id).unwrap_or(0);
    let clusters = plan
        .clusters
        .iter()
        .map(|cluster| ClusterView {
            bottleneck_s: cluster.bottleneck_s,
            stages: cluster
                .stages
                .iter()
                .map(|stage| {
                    let hello = who.get(&stage.provider).map(|(_, hello)| hello);
                    StageView {
                        role: role_word(stage.role).into(),
                        provider: provider_id(&stage.provider),
                        provider_name: hello
                            .map(|h| h.display_name.clone())
                            .unwrap_or_else(|| stage.provider.clone()),
                        provider_kind: stage.provider_kind,
                        device: hello.map(|h| h.device.clone()).unwrap_or_default(),
                        provider_memory_bytes: stage.provider_memory_bytes,
                        nodes: stage.nodes.len() as u64,
                        first_node: stage.nodes.first().cloned().unwrap_or_default(),
                        last_node: stage.nodes.last().cloned().unwrap_or_default(),
                        param_count: stage
                            .params
                            .iter()
                            .filter_map(|name| numel.get(name.as_str()))
                            .sum(),
                        memory_bytes: stage.memory_bytes,
                        compute_s: stage.compute_s,
                        transfer_s: stage.transfer_s,
                        time_s: stage.time_s,
                    }
                })
                .collect(),
        })
        .collect();
    PlanView {
        clusters,
        standbys: plan.standbys.iter().map(|key| provider_id(key)).collect(),
        param_count: numel.values().sum(),
        param_bytes: plan.param_bytes,
        bottleneck_s: plan.bottleneck_s(),
        micro_batch: plan.options.micro_batch as u64,
    }
}

/// The header of `GET /api/jobs/{id}/metrics.csv`: one row per step
/// (`kind` = `step`) then one per evaluation (`kind` = `epoch`, at the
/// epoch's end or every `val_every` steps); the columns a row's kind does
/// not have are empty.
pub const METRICS_CSV_HEADER: &str = "kind,step,epoch,loss,samples_per_s,elapsed_ms,bytes_relayed,bytes_synced,test_loss,test_accuracy,test_samples";

pub fn metrics_csv(steps: &[StepRecord], epochs: &[EpochRecord]) -> String {
    let mut csv = String::with_capacity(64 * (steps.len() + epochs.len() + 1));
    csv.push_str(METRICS_CSV_HEADER);
    csv.push('\n');
    for s in steps {
        let _ = writeln!(
            csv,
            "step,{},{},{},{},{},{},{},,,",
            s.step, s.epoch, s.loss, s.samples_per_s, s.elapsed_ms, s.bytes_relayed, s.bytes_synced
        );
    }
    for e in epochs {
        let _ = writeln!(
            csv,
            "epoch,{},{},,,,,,{},{},{}",
            e.step, e.epoch, e.test_loss, e.test_accuracy, e.samples
        );
    }
    csv
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::StageTime;

    #[test]
    fn metrics_csv_has_one_row_per_step_then_per_epoch_with_empty_foreign_columns() {
        let step = |step, loss| StepRecord {
            step,
            epoch: 0,
            loss,
            samples_per_s: 100.0,
            elapsed_ms: 12.5,
            bytes_relayed: 4096,
            bytes_synced: 512,
            stages: vec![StageTime {
                cluster: 0,
                stage: 0,
                provider: 1,
                compute_ms: 1.0,
                planned_ms: 0.5,
                idle_ms: 2.0,
                peak_held: 2,
            }],
        };
        let epochs = [EpochRecord {
            epoch: 0,
            step: 2,
            test_loss: 0.25,
            test_accuracy: 0.9,
            samples: 2000,
        }];
        let csv = metrics_csv(&[step(0, 2.5), step(1, 1.5)], &epochs);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            [
                METRICS_CSV_HEADER,
                "step,0,0,2.5,100,12.5,4096,512,,,",
                "step,1,0,1.5,100,12.5,4096,512,,,",
                "epoch,2,0,,,,,,0.25,0.9,2000",
            ]
        );
        let columns = METRICS_CSV_HEADER.split(',').count();
        assert!(lines.iter().all(|l| l.split(',').count() == columns));
    }
}
