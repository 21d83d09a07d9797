//! Rookery's native provider: measures this machine, joins a server over the
//! provider WebSocket and runs the model stages the server assigns with
//! libtorch. Every provider runs this same program; its role comes from the
//! server's assignment.

pub mod backend;
pub mod connection;
/// Runs model stages with libtorch: forward, backward, losses, optimizers.
#[cfg(feature = "torch")]
pub mod exec;
/// Test-only misbehaviour for the server's fault tests.
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod own;
pub mod trainer;
/// Runs the stage the server assigns: training messages in, replies out.
#[cfg(feature = "torch")]
pub mod worker;
