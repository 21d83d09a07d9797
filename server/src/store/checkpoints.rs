//! Checkpoint files written off the coordinator's path. A job that syncs
//! every step takes a checkpoint every step; writing it (and fsyncing it)
//! inside the coordinator would hold up every relay behind the disk. Each
//! job gets a writer task instead that always writes the newest checkpoint
//! handed to it, at most every [`WRITE_EVERY`]: checkpoints are written in
//! order, and one superseded before its turn is skipped, so a slow disk costs
//! freshness, never the training. (Recovery does not read this file: a lost
//! provider's cluster restarts from the checkpoint in memory, a restarted
//! server from the resume file.)
//!
//! What a writer is handed shares the run's buffers, so keeping the newest
//! checkpoint costs no memory beyond the run's own parameters, and files are
//! written tensor by tensor from those buffers. The resume file has a writer
//! of its own ([`ResumeWriter`]), at most every [`RESUME_EVERY`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rookery_job::weights::write_wire_safetensors;
use rookery_proto::WireTensor;
use tokio::sync::watch;

use crate::run::{ResumePoint, TrainedWeights};

/// The least time between the starts of two writes of one job's file: a
/// job that syncs every few milliseconds would otherwise keep a core busy
/// serialising and fsyncing copies nobody reads.
pub const WRITE_EVERY: std::time::Duration = std::time::Duration::from_millis(1000);
/// The least time between the starts of two writes of one job's resume
/// file (parameters and every cluster's optimizer state, fsynced). A
/// restarted server replays at most about this long of training; a lost
/// provider's rollback uses the in-memory checkpoint of the last sync.
pub const RESUME_EVERY: std::time::Duration = std::time::Duration::from_millis(5000);

/// How often a writer tries a value again after its write failed, unless a
/// newer one comes first; the pause doubles from the writer's interval up
/// to [`MAX_RETRY_PAUSE`].
pub const RETRIES: u32 = 8;
pub const MAX_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_secs(60);

/// Where a job's latest checkpoint lives (the weights at its last sync).
pub fn checkpoint_path(data_dir: &Path, job_id: u64) -> PathBuf {
    super::job_dir(data_dir, job_id).join("checkpoint.safetensors")
}

/// Where a completed job's trained weights live.
pub fn weights_path(data_dir: &Path, job_id: u64) -> PathBuf {
    super::job_dir(data_dir, job_id).join("weights.safetensors")
}

/// Where cluster `cluster`'s own weights of a completed job that trained
/// several clusters live (before the last sync combined them).
pub fn cluster_weights_path(data_dir: &Path, job_id: u64, cluster: usize) -> PathBuf {
    super::job_dir(data_dir, job_id).join(format!("weights-cluster-{cluster}.safetensors"))
}

/// Writes a completed job's weights: each cluster's own first, the
/// combined last, so that the combined file's presence (what marks a job
/// complete) means the whole set is on disk.
pub fn write_trained(
    data_dir: &Path,
    job_id: u64,
    weights: &TrainedWeights,
) -> std::io::Result<()> {
    for (c, cluster) in weights.clusters.iter().enumerate() {
        write_file(&cluster_weights_path(data_dir, job_id, c), cluster)?;
    }
    write_file(&weights_path(data_dir, job_id), &weights.combined)
}

/// Writes the newest value it is handed to one file, in its own task, at
/// most every `every`: values superseded before their turn are skipped,
/// and one whose write fails is tried again ([`RETRIES`]). Dropping it
/// lets the task write what it was last given and end.
pub struct LatestWriter<T> {
    latest: watch::Sender<Option<Arc<T>>>,
}

impl<T: Send + Sync + 'static> LatestWriter<T> {
    /// Starts the writer task on the current tokio runtime; `write` runs on
    /// a blocking thread.
    fn spawn(
        job_id: u64,
        what: &'static str,
        every: std::time::Duration,
        write: impl Fn(&T) -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Self {
        let (latest, mut newest) = watch::channel(None::<Arc<T>>);
        let write = Arc::new(write);
        tokio::spawn(async move {
            // A value whose write failed, and how often it has.
            let mut failed: Option<(Arc<T>, u32)> = None;
            loop {
                let (value, failures) = match failed.take() {
                    // A newer value supersedes the one that failed.
                    Some((value, failures)) => match newest.borrow_and_update().clone() {
                        Some(latest) if !Arc::ptr_eq(&latest, &value) => (latest, 0),
                        _ => (value, failures),
                    },
                    // `changed` sees a value sent just before the sender
                    // was dropped before it reports the channel closed.
                    None => match newest.changed().await {
                        Ok(()) => match newest.borrow_and_update().clone() {
                            Some(value) => (value, 0),
                            None => continue,
                        },
                        Err(_) => return,
                    },
                };
                let started = tokio::time::Instant::now();
                let write = write.clone();
                let to_write = value.clone();
                let written = tokio::task::spawn_blocking(move || write.as_ref()(&to_write))
                    .await
                    .map_err(std::io::Error::other)
                    .and_then(|r| r);
                let mut pause = every;
                if let Err(error) = written {
                    // A full disk may free up: the newest value is written
                    // again, less and less often, even after its job ended
                    // (a resume file is what a requeued job resumes from).
                    let failures = failures + 1;
                    if failures <= RETRIES {
                        pause = every
                            .saturating_mul(1 << (failures - 1).min(16))
                            .min(MAX_RETRY_PAUSE);
                        tracing::error!(
                            job = job_id,
                            %error,
                            "cannot write the {what}; trying again in {pause:?}"
                        );
                        failed = Some((value, failures));
                    } else {
                        tracing::error!(job = job_id, %error, "cannot write the {what}; giving up on it");
                    }
                }
                tokio::time::sleep_until(started + pause).await;
            }
        });
        Self { latest }
    }

    /// Hands over the newest value; returns at once.
    pub fn save(&self, value: T) {
        self.latest.send_replace(Some(Arc::new(value)));
    }
}

/// The writer of one job's checkpoint file.
pub type CheckpointWriter = LatestWriter<Vec<WireTensor>>;

/// The writer of one job's resume file.
pub type ResumeWriter = LatestWriter<ResumePoint>;

impl LatestWriter<Vec<WireTensor>> {
    /// The writer of the checkpoint at `path`.
    pub fn checkpoint(job_id: u64, path: PathBuf) -> Self {
        Self::spawn(job_id, "checkpoint", WRITE_EVERY, move |weights| {
            write_file(&path, weights)
        })
    }
}

impl LatestWriter<ResumePoint> {
    /// The writer of the resume file in `job_dir`.
    pub fn resume(job_id: u64, job_dir: PathBuf) -> Self {
        Self::spawn(job_id, "resume point", RESUME_EVERY, move |point| {
            super::resume::write(&job_dir, point)
        })
    }
}

/// Writes `weights` as a safetensors file at `path` (atomically, creating
/// its folder); blocking.
pub fn write_file(path: &Path, weights: &[WireTensor]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    write_wire_safetensors(path, weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_job::weights::read_wire_safetensors;
    use rookery_proto::WireDType;

    fn weights(value: f32) -> Vec<WireTensor> {
        vec![WireTensor::from_f32(
            "w",
            &[2],
            &[value, value],
            WireDType::F32,
        )]
    }

    #[tokio::test]
    async fn the_file_ends_up_holding_the_newest_checkpoint_even_when_the_writer_is_dropped_at_once()
     {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-1").join("checkpoint.safetensors");
        let writer = CheckpointWriter::checkpoint(1, path.clone());
        for step in 0..50 {
            writer.save(weights(step as f32));
        }
        drop(writer);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Ok(read) = read_wire_safetensors(&path)
                && read == weights(49.0)
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the newest checkpoint was never written"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_checkpoint_that_fails_to_write_is_written_once_the_disk_lets_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-1").join("checkpoint.safetensors");
        // A folder where the file goes: writing fails as on a full disk.
        std::fs::create_dir_all(path.join("in-the-way")).unwrap();
        let writer = CheckpointWriter::checkpoint(1, path.clone());
        writer.save(weights(7.0));
        drop(writer);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        std::fs::remove_dir_all(&path).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while read_wire_safetensors(&path).ok() != Some(weights(7.0)) {
            assert!(
                std::time::Instant::now() < deadline,
                "the failed checkpoint was never written again"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}
