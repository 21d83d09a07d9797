//! What the planner is given (providers, options) and what it answers (a
//! plan of clusters of stages).

use serde::{Deserialize, Serialize};

use rookery_model::{ClusterCount, DType};
use rookery_proto::ProviderKind;

#[cfg(doc)]
use rookery_model::Analysis;

/// What a provider reported about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderSpec {
    pub id: String,
    pub kind: ProviderKind,
    pub memory_bytes: u64,
    /// Sustained GFLOP/s from the provider's benchmark.
    pub gflops: f64,
    /// Link bandwidth to the server, Mbit/s.
    pub bandwidth_mbps: f64,
    /// Largest single buffer the provider's device can bind (a WebGPU
    /// adapter's `maxStorageBufferBindingSize`, capped by `maxBufferSize`):
    /// every parameter and every activation of a stage placed on it must fit.
    /// `None` for libtorch providers, whose tensors are bounded by memory only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_buffer_bytes: Option<u64>,
}

/// Planner knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    pub micro_batch: usize,
    pub clusters: ClusterCount,
    /// Extra parameter-sized copies the optimizer keeps (Adam: 2, SGD momentum: 1).
    pub optimizer_copies: u32,
    /// Micro-batches whose activations a stage holds at once (the sync schedule
    /// holds all M of a step; 1F1B far fewer).
    pub in_flight_micro_batches: u32,
    /// For [`ClusterCount::Auto`].
    pub auto_factor: f64,
    /// When set, every cluster is a chain of exactly this many stages, each on
    /// its own provider (the cuts still minimise the slowest stage). For
    /// Requesters who want a deep pipeline even where the cost model would
    /// keep a model on fewer providers, e.g. to spread memory or to test.
    #[serde(default)]
    pub stages_per_cluster: Option<usize>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            micro_batch: 8,
            clusters: ClusterCount::Fixed(1),
            optimizer_copies: 2,
            in_flight_micro_batches: 1,
            auto_factor: 2.0,
            stages_per_cluster: None,
        }
    }
}

/// A stage's position in its cluster's chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StageRole {
    /// Receives the inputs.
    Root,
    Stem,
    /// Computes the loss.
    Leaf,
    /// Both Root and Leaf: the whole model on one provider.
    Single,
}

/// A tensor crossing a cut between stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundaryTensor {
    pub name: String,
    /// Shape for one micro-batch (the batch dimension set to the micro-batch size).
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub bytes_per_micro_batch: u64,
}

/// A contiguous range of the topological order run by one provider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub role: StageRole,
    pub provider: String,
    pub provider_kind: ProviderKind,
    pub provider_memory_bytes: u64,
    /// The GFLOP/s the plan assumed of its provider: with `compute_s`, the
    /// stage's work (0 in plans stored before this was kept).
    #[serde(default)]
    pub provider_gflops: f64,
    /// Positions `first..end` in [`Analysis::nodes`].
    pub first: usize,
    pub end: usize,
    pub nodes: Vec<String>,
    /// Parameters and buffers the stage owns (its optimizer steps them).
    pub params: Vec<String>,
    /// Tensors crossing the cut before the stage (for the Root: the graph inputs).
    pub inputs: Vec<BoundaryTensor>,
    /// Tensors crossing the cut after the stage (for the Leaf: the graph outputs, kept for the loss).
    pub outputs: Vec<BoundaryTensor>,
    pub memory_bytes: u64,
    pub compute_s: f64,
    pub transfer_s: f64,
    pub time_s: f64,
}

/// One pipeline: Root, Stem..., Leaf.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub stages: Vec<Stage>,
    /// The slowest stage's time per micro-batch, seconds.
    pub bottleneck_s: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub options: PlanOptions,
    pub clusters: Vec<Cluster>,
    /// Providers in no stage, ready to replace one that leaves.
    pub standbys: Vec<String>,
    pub node_count: usize,
    pub param_bytes: u64,
}

impl Plan {
    pub fn bottleneck_s(&self) -> f64 {
        self.clusters
            .iter()
            .map(|c| c.bottleneck_s)
            .fold(0.0, f64::max)
    }

    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }
}
