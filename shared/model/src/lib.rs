//! Rookery's model description and planner, compiled natively and to wasm32.
//!
//! A [`Graph`] is data only: named tensors, ops from a fixed set, and parameter
//! initialisers; nothing in it can execute code, so a graph received from a job
//! submitter is safe to inspect and forward to providers. [`spec`] builds graphs
//! from RavDL-style layer lists, [`onnx`] imports models exported from PyTorch,
//! and [`plan`] cuts a graph into pipeline stages over donated providers. This
//! crate knows nothing of the network, tch or wgpu.

pub mod error;
pub mod graph;
pub mod init;
pub mod layout;
#[cfg(not(target_arch = "wasm32"))]
pub mod load;
pub mod onnx;
pub mod ops;
pub mod optim;
pub mod plan;
pub mod spec;
pub mod synthetic;

pub use error::{GraphError, OnnxError, PlanError, SpecError};
pub use graph::{Analysis, DType, Graph, Input, Loss, Node, NodeInfo, Param, ParamKind};
pub use init::Init;
pub use layout::{LayoutError, Source, StageLayout};
pub use onnx::Imported;
pub use ops::Op;
pub use optim::OptimizerConfig;
pub use plan::{
    BoundaryTensor, Cluster, ClusterCount, Plan, PlanOptions, ProviderKind, ProviderSpec, Stage,
    StageRole, clusterize, render,
};

pub use spec::{LayerSpec, ModelSpec, from_toml};
pub use synthetic::{synthetic_chain, synthetic_providers};
