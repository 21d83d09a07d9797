//! The `rookery` command line: each subcommand's arguments and what it does
//! (`main.rs` only parses and dispatches), and the Requester's REST client
//! the subcommands and the end-to-end tests use.
//!
//! - [`serve`]: the server on a data dir; [`train`]: an embedded server and
//!   local providers for one job;
//! - [`remote`]: `submit`, `jobs`, `watch`, `download`, `cancel` against a
//!   running server, through [`client`];
//! - [`plan`]: the planner on a model file and a providers file;
//! - [`tokens`]: Requesters' API tokens in a data dir;
//! - [`generate`]: samples text from a trained language model, forward only;
//! - [`predict`]: one forward pass of any model on `.npy` inputs.

pub mod client;
pub mod generate;
pub mod plan;
pub mod predict;
pub mod remote;
pub mod serve;
pub mod tokens;
pub mod train;
