//! Rookery's shared core, compiled both natively and to wasm32: the compute
//! kernels (WGSL generated from Rust, with a plain-Rust CPU reference) and,
//! later, the model graph and the planner. Knows nothing of tch or the network.

pub mod kernels;
