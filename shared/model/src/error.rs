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

/// An ONNX file that cannot be imported. Every variant names the file, and those
/// about one node name the node and its ONNX op, so the message alone says what
/// to change in the model or the export call.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum OnnxError {
    #[error("{file}: not a readable ONNX model (corrupt or truncated file): {reason}")]
    Decode { file: String, reason: String },
    #[error("{file}: {reason}")]
    Model { file: String, reason: String },
    #[error("{file}: tensor `{tensor}`: cannot read external data file `{location}`: {reason}")]
    ExternalData {
        file: String,
        tensor: String,
        location: String,
        reason: String,
    },
    #[error("{file}: tensor `{tensor}`: {reason}")]
    Tensor {
        file: String,
        tensor: String,
        reason: String,
    },
    #[error("{file}: graph input `{name}`: {reason}")]
    Input {
        file: String,
        name: String,
        reason: String,
    },
    #[error(
        "{file}: node `{node}` ({op}): unsupported op `{domain}{op}`: Rookery's op set has no \
         equivalent (supported: {supported})"
    )]
    UnsupportedOp {
        file: String,
        node: String,
        op: String,
        /// `""` for the default ONNX domain, else `"domain::"`.
        domain: String,
        supported: String,
    },
    #[error("{file}: node `{node}` ({op}): not supported: {reason}")]
    Unsupported {
        file: String,
        node: String,
        op: String,
        reason: String,
    },
    #[error("{file}: node `{node}` ({op}): dynamic shape cannot be resolved: {reason}")]
    DynamicShape {
        file: String,
        node: String,
        op: String,
        reason: String,
    },
    #[error("{file}: node `{node}` ({op}): {reason}")]
    Node {
        file: String,
        node: String,
        op: String,
        reason: String,
    },
    #[error("{file}: the imported graph is invalid: {source}")]
    Graph { file: String, source: GraphError },
}
