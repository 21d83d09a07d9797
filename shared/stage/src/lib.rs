//! Rookery's own stage executor: one pipeline stage of a model graph run
//! forward and backward, with gradient accumulation and optimizer steps, on
//! the kernels of `rookery_kernels`. The same executor runs on a GPU
//! through wgpu ([`GpuDevice`], feature `gpu`: WebGPU in a browser tab,
//! Vulkan/Metal/DX12 natively) and on the kernels' CPU references
//! ([`CpuDevice`]: browsers without WebGPU, and tests).
//!
//! Pieces: [`kernel`](crate::kernel) (a kernel call as data, lowered to WGSL
//! or to its CPU reference), `program` (a stage at one batch size lowered to
//! the kernel calls of its forward and backward passes), [`device`] (where
//! kernels run), [`executor`] (micro-batches, buffers, optimizer) and
//! `packed` (activations and gradients as the wire's int8, packed and
//! unpacked on the device: [`StageWire`]). The
//! generic stage worker ([`worker`]) turns the server's training messages
//! into calls on any backend (ours here, libtorch in `rookery-torch`), and
//! [`session`] is the socket-free provider session both providers drive. It
//! knows nothing of sockets or of libtorch, and compiles to wasm32.

pub mod device;
pub mod duty;
pub mod executor;
mod kernel;
mod kernel_backend;
mod packed;
pub mod predict;
mod program;
pub mod session;
#[cfg(not(target_arch = "wasm32"))]
pub mod speed;
pub mod worker;

#[cfg(feature = "gpu")]
pub use device::GpuDevice;
pub use device::{CpuBuffer, CpuDevice, Device};
pub use executor::{MicroBatch, ParamOptimizerState, StageExecutor};
pub use kernel::{Kernel, extrapolate};
pub use kernel_backend::OwnFactory;
pub use packed::{StageWire, Transfers};
pub use predict::{PredictError, Predictor};
pub use worker::{Backend, BackendFactory, StageWorker, WeightVersion, step_seed};

/// A tensor in host memory: row-major f32 values and their shape.
///
/// With an int8 wire ([`StageWire`]) our executor keeps boundary tensors
/// packed: what it reads back, and what its backend decodes, is then a
/// stand-in, the shape with no values ([`HostTensor::is_packed`]), whose
/// payload the executor holds until its next forward, evaluation or
/// backward (see `packed`).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    /// Whether this is a stand-in for a packed int8 tensor: a shape with
    /// elements and no values.
    pub fn is_packed(&self) -> bool {
        self.data.is_empty() && self.shape.iter().product::<usize>() > 0
    }
}

/// Everything that can go wrong building or running a stage. Messages name
/// the node, tensor or parameter involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StageError {
    #[error("invalid graph: {0}")]
    Graph(String),
    #[error(transparent)]
    Layout(#[from] rookery_model::LayoutError),
    #[error("node `{node}`: op {op} cannot run on this backend: {reason}")]
    Unsupported {
        node: String,
        op: String,
        reason: String,
    },
    #[error("parameter `{name}`: {reason}")]
    Param { name: String, reason: String },
    #[error("stage input `{name}`: {reason}")]
    Input { name: String, reason: String },
    #[error("gradient for `{name}`: {reason}")]
    Grad { name: String, reason: String },
    #[error("micro-batch {0} is not in flight on this stage (already backpropagated or never run)")]
    UnknownMicroBatch(u64),
    #[error("{in_flight} micro-batch(es) still await backward; {action} would corrupt them")]
    InFlight { in_flight: usize, action: String },
    #[error("device: {0}")]
    Device(String),
    #[error("internal error: {0}")]
    Internal(String),
}
