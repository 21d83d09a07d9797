//! Compute kernels: WGSL generated from Rust, each with a plain-Rust CPU
//! reference that serves as the oracle in tests and as the fallback where no
//! GPU is available. The wgpu runtime that executes them (`GpuContext`) lives
//! behind the `gpu` feature, so CPU-only users do not compile wgpu.
//!
//! One file per family: [`spec`] (what a generated kernel is, shared
//! helpers), [`elementwise`] (activations, broadcast binary ops, dropout),
//! [`gemm`] (the tiled GEMM template: MatMul, Linear), [`loss`]
//! (cross-entropy, MSE), [`optimizer`] (the one optimizer settings type,
//! [`OptimizerConfig`], as data), [`optim`] (its steps: SGD, Adam/AdamW,
//! RMSprop), [`schedule`] (learning-rate schedules and the gradient
//! clipping multiplier, pure functions of the step), [`reduce`]
//! (softmax, log-softmax), [`norm`] (LayerNorm, BatchNorm), [`shape`]
//! (transpose, concat, gather), [`conv`] (Conv2d as implicit GEMM), [`pool`]
//! (max, average, global average), [`winograd`] (3x3 convolutions as
//! Winograd F(2x2, 3x3)), [`int8`] (the wire's blockwise int8,
//! quantized and dequantized on the device), `matmul`
//! (the original uniform-shaped tiled matmul), and [`checks`] (the GPU-vs-reference cases
//! every harness runs).

// Shape code walks several per-dimension arrays (shape, strides, output
// strides) by the same index; iterator zips of four would read worse.
#![allow(clippy::needless_range_loop)]

pub mod accuracy;
pub mod checks;
pub mod conv;
pub mod dropout;
pub mod elementwise;
pub mod gemm;
pub mod int8;
pub mod loss;
mod matmul;
pub mod norm;
pub mod norm_bounds;
pub mod optim;
pub mod optimizer;
pub mod pool;
pub mod reduce;
pub mod schedule;
pub mod shape;
pub mod spec;
pub mod winograd;

#[cfg(feature = "gpu")]
mod gpu;
#[cfg(feature = "gpu")]
pub mod speed;

pub use matmul::{
    MATMUL_CHECK_SHAPES, MATMUL_REL_TOLERANCE, MatmulKernel, check_matmul, matmul_flops,
    matmul_reference, sample_matrix, try_matmul_reference,
};
pub use optimizer::OptimizerConfig;
pub use schedule::{LrSchedule, ScheduleError, clip_scale, sum_of_squares};
pub use spec::{Binding, KernelSpec, Tol};

#[cfg(feature = "gpu")]
pub(crate) use gpu::Clock;
#[cfg(feature = "gpu")]
pub use gpu::{GpuBuffer, GpuContext, GpuError};

/// Everything that can be wrong with a kernel's parameters, its operands, or
/// its result, independently of the device that runs it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("tile size {tile} is outside 1..={max}")]
    InvalidTile { tile: u32, max: u32 },
    #[error("operand {operand} has {actual} elements but the shape needs {expected}")]
    ShapeMismatch {
        operand: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("a {m}x{k} by {k}x{n} matmul has more elements than this machine can address")]
    TooLarge { m: usize, k: usize, n: usize },
    #[error(
        "element ({row}, {col}) is {got} but the reference says {want} (allowed error {tolerance})"
    )]
    Mismatch {
        row: usize,
        col: usize,
        got: f32,
        want: f32,
        tolerance: f64,
    },
}
