//! Work the coordinator hands to blocking threads, and what each piece of
//! it needs: reading a queued job's model, building a run (its data read,
//! its parameters initialised or resumed), combining a sync's uploads and
//! writing a completed job's weights. Each reports back as an [`Event`];
//! the task never waits for one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rookery_job::{JobSpec, Prepared, prepare};
use rookery_model::{Analysis, Graph, Init, ParamKind};
use rookery_plan::Plan;
use rookery_proto::WireTensor;

use super::{Actor, Event};
use crate::run::{AggregateWork, Effect, JobRun};
use crate::store::checkpoints::write_file;
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
    pub(super) fn write_weights(&self, job_id: u64, weights: Vec<WireTensor>) {
        let path = crate::store::checkpoints::weights_path(&self.data_dir, job_id);
        self.off_task(job_id, "writing the weights", move || {
            Event::WeightsWritten {
                job_id,
                written: write_file(&path, &weights).map_err(|e| e.to_string()),
            }
        });
    }
}
