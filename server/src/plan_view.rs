//! The edge where the planner's [`Plan`] becomes the dashboard's
//! [`PlanView`]: provider ids, names and devices instead of planner keys,
//! parameter counts per stage, and the roles spelled as words.

use std::collections::HashMap;

use rookery_model::{Graph, ParamKind};
use rookery_plan::{Plan, StageRole};
use rookery_proto::Hello;
use rookery_proto::api::{ClusterView, PlanView, StageView};

pub fn role_word(role: StageRole) -> &'static str {
    match role {
        StageRole::Root => "root",
        StageRole::Stem => "stem",
        StageRole::Leaf => "leaf",
        StageRole::Single => "single",
    }
}

/// `who` maps the planner's provider keys (ids as text) to the provider.
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
