//! Why no plan could be made.

use rookery_model::GraphError;
use thiserror::Error;

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
        "buffer limit failed: node `{node}` ({op}) has a tensor of {needed} bytes at micro-batch \
         {micro_batch}, but the largest buffer any provider can bind is {limit} bytes (`{provider}`); \
         use smaller micro-batches or add a provider without that limit"
    )]
    BufferTooLarge {
        node: String,
        op: String,
        micro_batch: usize,
        needed: u64,
        provider: String,
        limit: u64,
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
