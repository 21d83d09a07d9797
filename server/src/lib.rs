//! Rookery's intermediary server: the axum application (REST API, provider
//! WebSocket, static dashboard) over an embedded SQLite database.
//!
//! Entry points: [`app`] builds the router (tests drive it with
//! `tower::ServiceExt::oneshot`), [`serve`] runs it on a listener, and the
//! `rookery` binary in `main.rs` parses the command line. Nothing here links
//! libtorch or a GPU API: the server only coordinates and relays.
//!
//! The rooms, each depending only on those listed before it:
//! - [`run`]: one job's training as a socket-free state machine that turns
//!   provider messages into effects;
//! - [`store`]: the SQLite database and the data dir's files;
//! - [`dto`]: records as the API shows them;
//! - [`coordinator`]: the one task that owns live providers and running jobs,
//!   schedules queued jobs and carries out the runs' effects;
//! - [`admission`]: who may connect (connection caps, the join token);
//! - [`state`]: what handlers share;
//! - [`http`]: routes, handlers, the provider WebSocket, the accept loop;
//! - [`cli`]: the `rookery` subcommands and the Requester's REST client.

pub mod admission;
pub mod cli;
pub mod coordinator;
pub mod dto;
pub mod http;
pub mod run;
pub mod state;
pub mod store;

use std::time::{SystemTime, UNIX_EPOCH};

pub use http::{app, serve};
pub use state::{AppState, Limits, OpenError};

/// Wall-clock Unix milliseconds, the unit of every stored time.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}
