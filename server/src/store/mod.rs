//! What the server keeps: the SQLite database (jobs with their metrics and
//! logs, providers, Requesters and their token digests) and the files of
//! the data dir (each job's uploaded files, checkpoint, resume point and
//! weights under `jobs/<id>/`, the API token file, server datasets).
//!
//! The coordinator writes job state; HTTP handlers read it. Nothing here
//! knows about HTTP or sockets.

pub mod checkpoints;
pub mod credit;
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

/// Makes everything under `dir` durable: every file's data and every
/// folder's entries (the folder itself included), so a power cut cannot
/// leave a job whose row names files that never reached the disk.
/// Blocking; run it off the async threads.
/// Bytes of the regular files under `dir` (links to server datasets are
/// not the Requester's); 0 when it is gone.
pub fn tree_bytes(dir: &Path) -> std::io::Result<u64> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(error) => return Err(error),
    };
    let mut total = 0u64;
    for entry in entries {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            total = total.saturating_add(tree_bytes(&entry.path())?);
        } else if kind.is_file() {
            total = total.saturating_add(entry.metadata()?.len());
        }
    }
    Ok(total)
}

pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            sync_tree(&entry.path())?;
        } else if kind.is_file() {
            sync_file(&entry.path())?;
        }
    }
    sync_dir(dir)
}

fn sync_file(path: &Path) -> std::io::Result<()> {
    // Read-only is enough for fsync on Unix, and a dataset file linked into
    // an upload may not be writable by us.
    #[cfg(unix)]
    std::fs::File::open(path)?.sync_all()?;
    // Windows flushes only through a handle that may write; a file it will
    // not open so is left to the system, as `rookery_job::weights` does.
    #[cfg(not(unix))]
    if let Ok(file) = std::fs::OpenOptions::new().write(true).open(path) {
        file.sync_all()?;
    }
    Ok(())
}

/// Makes `dir`'s entries durable (a file created, renamed or linked in it).
/// Only Unix can open a folder to sync it; elsewhere the file system's own
/// ordering is what there is.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir)?.sync_all()?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server dataset linked into an upload may be read-only to us; the
    /// sync before the job's row must not refuse the upload for that.
    #[test]
    fn an_uploads_tree_syncs_with_read_only_files_and_fails_when_missing() {
        let dir = tempfile::tempdir().unwrap();
        let upload = dir.path().join("upload");
        std::fs::create_dir_all(upload.join("data/train")).unwrap();
        std::fs::write(upload.join("model.onnx"), b"model").unwrap();
        let linked = upload.join("data/train/images.idx");
        std::fs::write(&linked, b"data").unwrap();
        let mut read_only = std::fs::metadata(&linked).unwrap().permissions();
        read_only.set_readonly(true);
        std::fs::set_permissions(&linked, read_only).unwrap();
        sync_tree(&upload).unwrap();
        sync_dir(dir.path()).unwrap();
        assert!(sync_tree(&dir.path().join("gone")).is_err());
    }
}
