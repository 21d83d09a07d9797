//! Error types. Every graph error names the node and its op, every spec error the
//! layer index, and every planner error the constraint that failed, because the
//! person reading them is usually a job submitter without the source at hand.

use thiserror::Error;

/// A graph that cannot be validated or analysed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GraphError {
    #[error("tensor name `{0}` is defined more than once")]
    Duplicate(String),
    #[error("node `{node}` ({op}): unknown input `{input}`")]
    UnknownInput {
        node: String,
        op: String,
        input: String,
    },
    #[error("node `{node}` ({op}): shape mismatch: {reason}")]
    Shape {
        node: String,
        op: String,
        reason: String,
    },
    #[error("node `{node}` ({op}): {reason}")]
    Invalid {
        node: String,
        op: String,
        reason: String,
    },
    #[error("cycle among nodes {nodes:?}")]
    Cycle { nodes: Vec<String> },
    #[error("graph output `{0}` is not an input, parameter or node output")]
    UnknownOutput(String),
    #[error("parameter `{name}`: {reason}")]
    Param { name: String, reason: String },
    #[error("graph input `{name}`: {reason}")]
    Input { name: String, reason: String },
    #[error("graph has no nodes")]
    Empty,
}

/// A layer-spec file that cannot be turned into a graph.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SpecError {
    #[error("layer spec is not valid TOML: {0}")]
    Toml(String),
    #[error("layer spec: field `{field}`: {reason}")]
    Top { field: String, reason: String },
    #[error("layer {index}: {reason}")]
    Layer { index: usize, reason: String },
    #[error("layer {index} ({layer}): field `{field}`: {reason}")]
    Field {
        index: usize,
        layer: String,
        field: String,
        reason: String,
    },
    #[error("layer {index} ({layer}): {source}")]
    Graph {
        index: usize,
        layer: String,
        source: GraphError,
    },
}

/// No plan could be made.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("no providers to plan over")]
    NoProviders,
    #[error("invalid plan options: {0}")]
    Options(String),
    #[error("provider `{id}`: {reason}")]
    Provider { id: String, reason: String },
    #[error("asked for {requested} clusters but only {providers} providers are available")]
    TooManyClusters { requested: usize, providers: usize },
    #[error(
        "memory constraint failed: node `{node}` ({op}) alone needs {needed} bytes at micro-batch \
         {micro_batch}, but the largest provider `{provider}` has {available} bytes; missing {missing} bytes"
    )]
    NodeTooLarge {
        node: String,
        op: String,
        micro_batch: usize,
        needed: u64,
        provider: String,
        available: u64,
        missing: u64,
    },
    #[error(
        "memory constraint failed for cluster {cluster}: the model needs {needed} bytes in total \
         (parameters, gradients, optimizer state, activations) at micro-batch {micro_batch}, its \
         {providers} providers offer {available} bytes; missing {missing} bytes: one more provider \
         with {missing} bytes would make a plan fit"
    )]
    NoFit {
        cluster: usize,
        micro_batch: usize,
        needed: u64,
        providers: usize,
        available: u64,
        missing: u64,
    },
}
