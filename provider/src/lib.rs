//! Rookery's native provider: measures this machine, joins a server over the
//! provider WebSocket, and (in later protocol versions) runs model stages with
//! libtorch. Every provider runs this same program; its role comes from the
//! server's assignment.

pub mod backend;
pub mod connection;
/// Runs model stages with libtorch: forward, backward, losses, optimizers.
#[cfg(feature = "torch")]
pub mod exec;
