//! Test set-up shared by the libtorch tests (`rookery-torch`) and the
//! end-to-end tests and benchmarks (`rookery-e2e`): seeded synthetic data,
//! job folders on disk, small model specs, the batches a single-process
//! reference run trains on, and bounds on the rounding error of f32
//! computations for comparing two implementations of one.
//!
//! Nothing here needs libtorch, a server or a browser, so either side can
//! depend on it without pulling in the other.

pub mod bounds;
pub mod data;
pub mod job;
pub mod models;

pub use bounds::ErrorBound;
pub use data::{Classes, lcg_values, pseudo};
pub use job::{JobBatches, NpyData, StepBatch, workspace_root, write_job, write_npy};
pub use models::dense_mlp;
