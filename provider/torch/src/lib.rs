//! Rookery on libtorch: the stage executor ([`exec`]), its backend of the
//! generic stage worker ([`stage`]) that the native provider runs, and the
//! single-process reference trainer ([`exec::reference`]) that tests and
//! benchmarks compare distributed training against.
//!
//! Everything here needs libtorch and sits behind the `torch` feature, so a
//! plain `cargo check --workspace` builds this crate empty.

/// Runs model stages with libtorch: forward, backward, losses, optimizers.
#[cfg(feature = "torch")]
pub mod exec;
/// The libtorch backend of the generic stage worker.
#[cfg(feature = "torch")]
pub mod stage;
/// Tensors between libtorch and the wire.
#[cfg(feature = "torch")]
pub mod wire;

#[cfg(feature = "torch")]
pub use exec::{
    ExecError, TorchExecutor, TorchForward, TorchMicroBatch, TorchOptimizer, stage_boundary,
    tensors_from_values,
};
/// The dropout seed of a step, which a reference run needs to reproduce a
/// distributed one.
pub use rookery_stage::step_seed;
#[cfg(feature = "torch")]
pub use stage::{TorchStage, TorchStageFactory, TorchWorker, TorchWorkerError};
#[cfg(feature = "torch")]
pub use wire::{tensor_from_wire, tensor_to_wire};
