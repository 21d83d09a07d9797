//! What the server keeps: the SQLite database (jobs with their metrics and
//! logs, providers, Requesters and their token digests) and the files of
//! the data dir (each job's uploaded files, checkpoint, resume point and
//! weights under `jobs/<id>/`, the API token file, server datasets).
//!
//! The coordinator writes job state; HTTP handlers read it. Nothing here
//! knows about HTTP or sockets.

pub mod checkpoints;
pub mod datasets;
pub mod db;
pub mod identities;
pub mod jobs;
pub mod providers;
pub mod requesters;
pub mod resume;
pub mod tokens;

use std::path::{Path, PathBuf};

pub use db::{Db, DbError};

/// A job's folder in the data dir: its uploaded files, checkpoint, resume
/// point and weights.
pub fn job_dir(data_dir: &Path, job_id: u64) -> PathBuf {
    data_dir.join("jobs").join(job_id.to_string())
}

/// Where a job's uploaded files live: a folder of their own inside its job
/// folder, apart from the files the server writes there.
pub fn upload_dir(job_dir: &Path) -> PathBuf {
    job_dir.join("upload")
}
