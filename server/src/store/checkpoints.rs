//! Checkpoint files written off the coordinator's path. A job that syncs
//! every step takes a checkpoint every step; writing it (and fsyncing it)
//! inside the coordinator would hold up every relay behind the disk. Each
//! job gets a writer task instead that always writes the newest checkpoint
//! handed to it, at most every [`WRITE_EVERY`]: checkpoints are written in
//! order, and one superseded before its turn is skipped, so a slow disk costs
//! freshness, never the training. (Recovery does not read this file: a lost
//! provider's cluster restarts from the checkpoint in memory, a restarted
//! server from the resume file.)

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rookery_job::weights::{WeightTensor, write_safetensors};
use tokio::sync::watch;

/// The least time between the starts of two writes of one job's file: a
/// job that syncs every few milliseconds would otherwise keep a core busy
/// serialising and fsyncing copies nobody reads.
pub const WRITE_EVERY: std::time::Duration = std::time::Duration::from_millis(1000);

/// Where a job's latest checkpoint lives (the weights at its last sync).
pub fn checkpoint_path(data_dir: &Path, job_id: u64) -> PathBuf {
    super::job_dir(data_dir, job_id).join("checkpoint.safetensors")
}

/// Where a completed job's trained weights live.
pub fn weights_path(data_dir: &Path, job_id: u64) -> PathBuf {
    super::job_dir(data_dir, job_id).join("weights.safetensors")
}

/// The writer of one job's checkpoint file. Dropping it lets the task write
/// what it was last given and end.
pub struct CheckpointWriter {
    latest: watch::Sender<Option<Arc<[WeightTensor]>>>,
}

impl CheckpointWriter {
    /// Starts the writer task of the checkpoint at `path` on the current
    /// tokio runtime.
    pub fn spawn(job_id: u64, path: PathBuf) -> Self {
        let (latest, mut newest) = watch::channel(None::<Arc<[WeightTensor]>>);
        tokio::spawn(async move {
            // `changed` sees a value sent just before the sender was dropped
            // before it reports the channel closed.
            while newest.changed().await.is_ok() {
                let Some(weights) = newest.borrow_and_update().clone() else {
                    continue;
                };
                let started = tokio::time::Instant::now();
                if let Err(error) = write_weights(path.clone(), weights).await {
                    tracing::error!(job = job_id, %error, "cannot write the checkpoint");
                }
                tokio::time::sleep_until(started + WRITE_EVERY).await;
            }
        });
        Self { latest }
    }

    /// Hands over the newest checkpoint; returns at once.
    pub fn save(&self, weights: Vec<WeightTensor>) {
        self.latest.send_replace(Some(Arc::from(weights)));
    }
}

/// Writes `weights` as a safetensors file at `path` (atomically, creating
/// its folder) on a blocking thread.
pub async fn write_weights(
    path: PathBuf,
    weights: impl AsRef<[WeightTensor]> + Send + 'static,
) -> std::io::Result<()> {
    tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        write_safetensors(&path, weights.as_ref())
    })
    .await
    .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_job::weights::read_safetensors;

    fn weights(value: f32) -> Vec<WeightTensor> {
        vec![WeightTensor::f32("w", vec![2], vec![value, value])]
    }

    #[tokio::test]
    async fn the_file_ends_up_holding_the_newest_checkpoint_even_when_the_writer_is_dropped_at_once()
     {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-1").join("checkpoint.safetensors");
        let writer = CheckpointWriter::spawn(1, path.clone());
        for step in 0..50 {
            writer.save(weights(step as f32));
        }
        drop(writer);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Ok(read) = read_safetensors(&path)
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
}
