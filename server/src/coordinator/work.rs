//! Work the coordinator hands to blocking threads, and what each piece of
//! it needs: reading a queued job's model, building a run (its data read,
//! its parameters initialised or resumed), combining a sync's uploads and
//! writing a completed job's weights. Each reports back as an [`Event`];
//! the task never waits for one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rookery_job::{JobSpec, Prepared, prepare};
use rookery_model::{Analysis, Graph, Init, ParamKind};
use rookery_plan::Plan;
use rookery_proto::api::{JobEvent, JobEventBody, LogEntry};
use tokio::sync::broadcast;

use super::{Actor, Event};
use crate::now_ms;
use crate::run::{AggregateWork, Effect, JobRun, TrainedWeights};
use crate::store::Db;
use crate::store::checkpoints::write_trained;
use crate::store::jobs::{self, LogRecord};
use crate::store::resume;

/// What a queued job keeps while it waits for providers: enough to plan it,
/// no parameter values and no data (those are read again when it starts).
#[derive(Debug)]
pub struct QueuedModel {
    pub spec: JobSpec,
    /// The model's structure; imported values are left out.
    pub graph: Graph,
    pub analysis: Analysis,
    /// The cluster count of the job's resume point, when it has one: the
    /// data's sharding depends on it, so a resumed job keeps it.
    pub resume_clusters: Option<usize>,
}

impl QueuedModel {
    /// Keeps what planning needs of a job read in full (its data is dropped).
    pub fn new(prepared: Prepared) -> Self {
        let Prepared {
            spec,
            graph,
            analysis,
            ..
        } = prepared;
        Self::from_parts(spec, graph, analysis)
    }

    fn from_parts(spec: JobSpec, mut graph: Graph, analysis: Analysis) -> Self {
        for p in &mut graph.params {
            // Constants stay: they are small, and shape arithmetic may read them.
            if p.kind != ParamKind::Constant && matches!(p.init, Init::Values { .. }) {
                p.init = Init::Zeros;
            }
        }
        QueuedModel {
            spec,
            graph,
            analysis,
            resume_clusters: None,
        }
    }

    /// Reads a queued job's model and its resume point's cluster count
    /// (blocking).
    pub fn read(spec_json: &str, dir: &Path, job_dir: &Path) -> Result<Self, String> {
        let spec = JobSpec::from_json(spec_json, dir).map_err(|e| e.to_string())?;
        let loaded = spec.load_model().map_err(|e| e.to_string())?;
        let analysis = loaded.graph.analyze().map_err(|e| e.to_string())?;
        let resume_clusters = resume::clusters(job_dir)
            .map_err(|reason| format!("cannot resume from the checkpoint: {reason}"))?;
        let mut model = QueuedModel::from_parts(spec, loaded.graph, analysis);
        model.resume_clusters = resume_clusters;
        Ok(model)
    }
}

/// Everything building a run on a plan needs, moved to a blocking thread.
pub(super) struct RunRecipe {
    pub job_id: u64,
    pub spec_json: String,
    /// The folder the job file's paths are relative to.
    pub dir: PathBuf,
    /// The job's own folder (resume file).
    pub job_dir: PathBuf,
    pub plan: Plan,
    pub ids: HashMap<String, u64>,
}

impl RunRecipe {
    /// Reads the job's model and data, and its resume point if it has one,
    /// and builds the run with its first frames (blocking: seconds for a
    /// large model).
    pub fn build(self) -> Result<(JobRun, Vec<Effect>), String> {
        let spec = JobSpec::from_json(&self.spec_json, &self.dir).map_err(|e| e.to_string())?;
        let Prepared {
            spec,
            graph,
            analysis,
            train,
            test,
            ..
        } = prepare(spec).map_err(|e| e.to_string())?;
        let resume = resume::read(&self.job_dir)
            .map_err(|reason| format!("cannot resume from the checkpoint: {reason}"))?;
        JobRun::start(
            self.job_id,
            spec,
            graph,
            &analysis,
            &self.plan,
            &self.ids,
            train,
            test,
            resume,
        )
        .map_err(|e| e.to_string())
    }
}

impl Actor {
    /// Runs `work` on a blocking thread and hands its event to the task; a
    /// crash fails `job_id` with `what` in the reason.
    pub(super) fn off_task(
        &self,
        job_id: u64,
        what: &'static str,
        work: impl FnOnce() -> Event + Send + 'static,
    ) {
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let event = tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|error| Event::WorkFailed {
                    job_id,
                    reason: format!("{what} crashed: {error}"),
                });
            if let Some(tx) = tx.upgrade() {
                let _ = tx.send(event).await;
            }
        });
    }

    /// Reads a queued job's model off the task ([`Event::Prepared`]).
    pub(super) fn read_model(&mut self, job_id: u64, spec_json: String, dir: PathBuf) {
        self.jobs.entry(job_id).or_default().loading = true;
        let job_dir = crate::store::job_dir(&self.data_dir, job_id);
        self.off_task(job_id, "reading the job", move || {
            match QueuedModel::read(&spec_json, &dir, &job_dir) {
                Ok(model) => Event::Prepared {
                    job_id,
                    model: Box::new(model),
                },
                Err(reason) => Event::WorkFailed { job_id, reason },
            }
        });
    }

    /// Builds a run off the task ([`Event::Started`]).
    pub(super) fn build_run(&self, recipe: RunRecipe) {
        let job_id = recipe.job_id;
        self.off_task(job_id, "starting the job", move || Event::Started {
            job_id,
            started: recipe.build().map(Box::new),
        });
    }

    /// Combines a sync's uploads off the task ([`Event::Aggregated`]).
    pub(super) fn aggregate(&self, job_id: u64, work: Box<AggregateWork>) {
        self.off_task(job_id, "aggregating a sync", move || Event::Aggregated {
            job_id,
            done: Box::new(work.run()),
        });
    }

    /// Writes a completed job's weights off the task ([`Event::WeightsWritten`]).
    ///
    /// A failed write (a full disk, say) is no reason to lose the training:
    /// the weights stay in memory and the write is tried again after each
    /// of [`WEIGHTS_RETRY_DELAYS`], every failure in the job's log. Only
    /// when all fail does the job report `Err`, and goes back to the queue
    /// to resume from its resume file (which holds the last step, or an
    /// earlier sync that replays exactly): no human is needed either way.
    pub(super) fn write_weights(&self, job_id: u64, weights: TrainedWeights) {
        let data_dir = self.data_dir.clone();
        let (tx, db, events) = (self.tx.clone(), self.db.clone(), self.events.clone());
        tokio::spawn(async move {
            let weights = Arc::new(weights);
            let mut delays = WEIGHTS_RETRY_DELAYS.iter();
            let written = loop {
                let (dir, weights) = (data_dir.clone(), weights.clone());
                let write = move || write_trained(&dir, job_id, &weights);
                let error = match tokio::task::spawn_blocking(write).await {
                    Ok(Ok(())) => break Ok(()),
                    Ok(Err(error)) => error.to_string(),
                    Err(crashed) => format!("the writer crashed: {crashed}"),
                };
                let Some(delay) = delays.next() else {
                    break Err(error);
                };
                let message = format!(
                    "cannot write the weights ({error}); trying again in {} s",
                    delay.as_secs()
                );
                tracing::warn!(job = job_id, %message);
                log_to(&db, &events, job_id, "weights", message).await;
                tokio::time::sleep(*delay).await;
            };
            if let Some(tx) = tx.upgrade() {
                let _ = tx.send(Event::WeightsWritten { job_id, written }).await;
            }
        });
    }
}

/// The pauses before each new try at writing a job's weights: about four
/// minutes in all, so a disk freed meanwhile completes the job as it is.
pub(super) const WEIGHTS_RETRY_DELAYS: [Duration; 8] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(16),
    Duration::from_secs(32),
    Duration::from_secs(64),
    Duration::from_secs(128),
];

/// Writes a line to a job's log and sends it to live subscribers (the
/// coordinator's `log`, and work off its task).
pub(super) async fn log_to(
    db: &Db,
    events: &broadcast::Sender<JobEvent>,
    job_id: u64,
    kind: &str,
    message: String,
) {
    let entry = LogEntry {
        at_ms: now_ms(),
        kind: kind.to_string(),
        message,
    };
    let record = LogRecord {
        at_ms: entry.at_ms,
        kind: entry.kind.clone(),
        message: entry.message.clone(),
    };
    if let Err(error) = jobs::append_log(db, job_id, record).await {
        tracing::error!(job = job_id, %error, "cannot write to a job's log");
    }
    let _ = events.send(JobEvent {
        job_id,
        body: JobEventBody::Log { entry },
    });
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rookery_job::weights::read_wire_safetensors;
    use rookery_proto::{WireDType, WireTensor};
    use tokio::sync::mpsc;

    use super::*;
    use crate::store::checkpoints::weights_path;
    use crate::store::jobs::JobStatus;
    use crate::store::requesters;

    fn weights() -> Vec<WireTensor> {
        cluster_weights(1.5)
    }

    fn cluster_weights(value: f32) -> Vec<WireTensor> {
        vec![WireTensor::from_f32(
            "w",
            &[2],
            &[value, -2.0],
            WireDType::F32,
        )]
    }

    /// Two clusters' own weights and their combination.
    fn trained() -> TrainedWeights {
        TrainedWeights {
            combined: weights(),
            clusters: vec![cluster_weights(1.0), cluster_weights(2.0)],
        }
    }

    /// A coordinator with one running job whose weights go nowhere yet: a
    /// folder stands where the file must go, so writing fails as on a
    /// full disk. The job has no folder of its own, so the scheduler
    /// leaves it be once it is queued.
    async fn coordinator_with_a_blocked_weights_file() -> (mpsc::Sender<Event>, Db, u64, PathBuf) {
        let db = Db::open_in_memory().unwrap();
        let data_dir = tempfile::tempdir().unwrap().keep();
        let (requester, _) = requesters::create(&db, "r", 1).await.unwrap();
        let job_id = jobs::insert(
            &db,
            requester.id,
            "job".into(),
            "{}".into(),
            String::new(),
            1,
        )
        .await
        .unwrap();
        jobs::set_status(&db, job_id, JobStatus::Running, None, 2)
            .await
            .unwrap();
        let path = weights_path(&data_dir, job_id);
        std::fs::create_dir_all(path.join("in-the-way")).unwrap();
        let (tx, rx) = mpsc::channel(16);
        let actor = Actor {
            tx: tx.downgrade(),
            db: db.clone(),
            data_dir,
            providers: Default::default(),
            jobs: Default::default(),
            events: broadcast::channel(16).0,
            rates: super::super::rates::Rates::new(),
            verifying: Default::default(),
        };
        actor.write_weights(job_id, trained());
        tokio::spawn(actor.run(rx));
        (tx, db, job_id, path)
    }

    async fn wait_for_status(db: &Db, job_id: u64, status: JobStatus) -> jobs::JobRecord {
        loop {
            let job = jobs::get(db, job_id).await.unwrap().unwrap();
            if job.status == status {
                return job;
            }
            assert!(!job.status.is_finished(), "the job {:?}", job.status);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn retries_logged(db: &Db, job_id: u64) -> usize {
        jobs::log(db, job_id, 100)
            .await
            .unwrap()
            .iter()
            .filter(|line| {
                line.message.contains("cannot write the weights") && line.kind == "weights"
            })
            .count()
    }

    #[tokio::test]
    async fn weights_that_fail_to_write_are_written_again_and_the_job_completes_with_every_clusters_too()
     {
        let (_tx, db, job_id, path) = coordinator_with_a_blocked_weights_file().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while retries_logged(&db, job_id).await == 0 {
            assert!(Instant::now() < deadline, "no failed write was logged");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::remove_dir_all(&path).unwrap();
        wait_for_status(&db, job_id, JobStatus::Completed).await;
        assert_eq!(read_wire_safetensors(&path).unwrap(), weights());
        let dir = path.parent().unwrap();
        for (c, want) in trained().clusters.iter().enumerate() {
            let file = dir.join(format!("weights-cluster-{c}.safetensors"));
            assert_eq!(&read_wire_safetensors(&file).unwrap(), want, "cluster {c}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn weights_that_never_write_send_the_job_back_to_the_queue_to_resume_not_to_fail() {
        let (_tx, db, job_id, _path) = coordinator_with_a_blocked_weights_file().await;
        let job = wait_for_status(&db, job_id, JobStatus::Queued).await;
        assert!(
            job.detail
                .as_deref()
                .is_some_and(|d| d.contains("resumes from its last checkpoint")),
            "{:?}",
            job.detail
        );
        assert_eq!(
            retries_logged(&db, job_id).await,
            WEIGHTS_RETRY_DELAYS.len()
        );
    }
}
