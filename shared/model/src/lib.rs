//! Rookery's model description, compiled natively and to wasm32.
//!
//! A [`Graph`] is data only: named tensors, ops from a fixed set, and parameter
//! initialisers; nothing in it can execute code, so a graph received from a job
//! submitter is safe to inspect and forward to providers. [`spec`] builds graphs
//! from RavDL-style layer lists and [`onnx`] imports models exported from
//! PyTorch. The planner that cuts a graph into stages is `rookery-plan`
//! (server-side only). This crate knows nothing of the network, tch or wgpu.

pub mod clusters;
pub mod error;
pub mod graph;
pub mod init;
pub mod layout;
pub mod load;
pub mod loss;
pub mod onnx;
pub mod ops;
pub mod spec;
pub mod tensor;

pub use clusters::ClusterCount;
pub use error::{GraphError, OnnxError, SpecError};
pub use graph::{Analysis, Graph, Input, Node, NodeInfo, Param, ParamKind};
pub use init::Init;
pub use layout::{LayoutError, Source, StageLayout};
pub use loss::{ClassAxis, Loss};
pub use onnx::Imported;
pub use ops::Op;
/// The optimizer settings of a job: defined beside the kernels that step
/// them, so every crate names the same type.
pub use rookery_kernels::OptimizerConfig;
pub use rookery_kernels::gemm::Precision;
/// Learning-rate schedules and the clipping multiplier, beside the optimizer.
pub use rookery_kernels::{LrSchedule, ScheduleError, clip_scale, sum_of_squares};

pub use spec::{LayerSpec, ModelSpec, from_toml};
pub use tensor::{DType, TensorInfo};
