//! The planner (`clusterize`): cuts a graph's topological order into pipeline
//! stages over donated providers, and groups providers into data-parallel
//! clusters.
//!
//! Cost model, per micro-batch of `b` samples and stage = nodes `[i, j)`:
//! - compute: (forward + backward FLOPs + a memory-traffic charge per output
//!   byte, [`MEMORY_FLOPS_PER_OUTPUT_BYTE`], + the CPU cost of the bytes
//!   crossing the stage's cuts, [`WIRE_FLOPS_PER_BYTE`]) * b / provider
//!   FLOP/s (backward is 2x forward unless an op says otherwise, so usually
//!   3x forward);
//! - transfer: the tensors crossing the stage's two cuts, activations forward and
//!   their gradients back (the graph inputs only forward, the outputs stay on the
//!   Leaf for the loss), over the provider's link;
//! - memory: trainable bytes * (1 weights + 1 gradients + optimizer copies) +
//!   buffers + in-flight micro-batches * b * (activations + incoming tensors).
//!
//! Time is the larger of compute and transfer (`cost::stage_time`): a pipeline
//! sends one micro-batch while it computes the next. The objective is the slowest stage's time. For one ordering of
//! providers a dynamic programme over (node prefix, provider prefix) finds the
//! exact optimum among plans whose stages use providers in that order (providers
//! may be skipped); a second pass then minimises the summed stage time under that
//! bottleneck, which drops stages that do not help and leaves more standbys. With
//! up to [`EXACT_PERMUTATIONS_UP_TO`] providers every ordering is tried, so small
//! plans are exact; above that a few orderings (by speed and by memory, each way).
//!
//! Speed (the `bench_plan` example plans a 200-node model over 1,000 providers
//! well within 100 ms) comes from pruning that never changes a result: lower
//! bounds on a stage's time (its last node's compute plus the least it can send)
//! skip providers and stage ends that cannot beat the best plan so far, a plan
//! over an ordering's quickest providers bounds that ordering's DP up front, and
//! the inner loops jump over starts no plan reaches. [`ClusterCount::Auto`]
//! searches cluster counts with a feasibility check that stops at the first plan
//! under the limit, and plans only the count it picks in full.
//!
//! Modules: `types` (what goes in and comes out), `cost` (the cost model and
//! its bounds), `dp` (the dynamic programmes and provider orderings),
//! `clusters` (grouping providers and searching each group), `diagnose` (why
//! nothing fits), `assemble` (stage lists to a [`Plan`]) and `render` (the
//! text table).

mod assemble;
mod clusters;
mod cost;
mod diagnose;
mod dp;
mod error;
mod render;
mod synthetic;
mod types;

use std::collections::BTreeSet;

use rookery_model::{ClusterCount, Graph};

use crate::assemble::assemble;
use crate::clusters::{auto_clusters, fixed_stage_clusters, plan_clusters};
use crate::cost::Costs;
use crate::diagnose::diagnose;
use crate::dp::INF;

pub use crate::cost::{MEMORY_FLOPS_PER_OUTPUT_BYTE, WIRE_FLOPS_PER_BYTE};
pub use crate::dp::EXACT_PERMUTATIONS_UP_TO;
pub use crate::error::PlanError;
pub use crate::render::render;
pub use crate::synthetic::{synthetic_chain, synthetic_providers};
pub use crate::types::{
    BoundaryTensor, Cluster, Plan, PlanOptions, ProviderSpec, Stage, StageRole,
};
pub use rookery_proto::ProviderKind;

/// Cuts `graph` into pipeline stages over `providers`; see the module docs for the cost model.
pub fn clusterize(
    graph: &Graph,
    providers: &[ProviderSpec],
    options: &PlanOptions,
) -> Result<Plan, PlanError> {
    let analysis = graph.analyze()?;
    validate(providers, options)?;
    let c = Costs::new(&analysis, graph, options);
    let k = match options.clusters {
        ClusterCount::Fixed(k) => {
            if k > providers.len() {
                return Err(PlanError::TooManyClusters {
                    requested: k,
                    providers: providers.len(),
                });
            }
            k
        }
        ClusterCount::Auto => 0,
    };
    if let Some(stages) = options.stages_per_cluster {
        let plans = fixed_stage_clusters(&c, &analysis, providers, options, stages)?;
        return Ok(assemble(&c, &analysis, graph, providers, options, plans));
    }
    let plans = if k > 0 {
        plan_clusters(&c, providers, k, INF)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    } else {
        auto_clusters(&c, providers, options.auto_factor)
            .map_err(|(ci, g)| diagnose(&c, &analysis, providers, &g, ci))?
    };
    Ok(assemble(&c, &analysis, graph, providers, options, plans))
}

fn validate(providers: &[ProviderSpec], o: &PlanOptions) -> Result<(), PlanError> {
    if providers.is_empty() {
        return Err(PlanError::NoProviders);
    }
    if o.micro_batch == 0 || o.in_flight_micro_batches == 0 {
        return Err(PlanError::Options(
            "micro_batch and in_flight_micro_batches must be >= 1".into(),
        ));
    }
    if o.clusters == ClusterCount::Fixed(0) {
        return Err(PlanError::Options("cluster count must be >= 1".into()));
    }
    if o.auto_factor.is_nan() || o.auto_factor < 1.0 {
        return Err(PlanError::Options(format!(
            "auto_factor {} must be >= 1",
            o.auto_factor
        )));
    }
    let mut ids = BTreeSet::new();
    for p in providers {
        let reason = if !(p.gflops > 0.0 && p.gflops.is_finite()) {
            "gflops must be a positive number"
        } else if !(p.bandwidth_mbps > 0.0 && p.bandwidth_mbps.is_finite()) {
            "bandwidth_mbps must be a positive number"
        } else if !ids.insert(p.id.as_str()) {
            "duplicate provider id"
        } else {
            continue;
        };
        return Err(PlanError::Provider {
            id: p.id.clone(),
            reason: reason.into(),
        });
    }
    Ok(())
}
