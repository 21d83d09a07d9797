//! Rookery's native provider: measures this machine, joins a server over the
//! provider WebSocket and runs the model stages the server assigns, with
//! libtorch (`rookery-torch`, feature `torch`) or our own kernels through
//! wgpu (feature `wgpu`). Every provider runs this same program; its role
//! comes from the server's assignment.

pub mod compute;
pub mod connection;
/// Test-only misbehaviour for the server's fault tests.
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod identity;
pub mod trainer;
