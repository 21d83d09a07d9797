//! The coordinator: one task that owns the live provider connections and the
//! running jobs. Socket loops and HTTP handlers talk to it through
//! [`Coordinator`]'s channel; it plans queued jobs onto idle providers, feeds
//! provider frames to each job's [`JobRun`] and carries out the effects
//! (frames, metrics, checkpoints, weights). One task means no locks around
//! job state, and the order of events is the order they happened.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rookery_job::JobSpec;
use rookery_job::weights::{WeightTensor, write_safetensors};
use rookery_model::{PlanOptions, ProviderKind, ProviderSpec};
use rookery_proto::stream::{self, Payload};
use rookery_proto::{Bytes, Hello, ToProvider, ToServer};
use tokio::sync::mpsc;

use crate::db::Db;
use crate::jobs::{self, JobStatus};
use crate::now_ms;
use crate::run::{Effect, JobRun};

/// Link speed assumed for providers until they measure it.
const DEFAULT_BANDWIDTH_MBPS: f64 = 1000.0;
/// How often queued jobs are matched against idle providers.
const SCHEDULE_EVERY: Duration = Duration::from_millis(300);

/// What the coordinator hears about.
#[derive(Debug)]
pub enum Event {
    Connected {
        id: u64,
        hello: Hello,
        tx: mpsc::UnboundedSender<Outgoing>,
    },
    Disconnected {
        id: u64,
        /// Why the connection ended, for the job it leaves.
        reason: String,
    },
    Message {
        id: u64,
        message: ToServer,
    },
    /// Tensor bytes that follow a streamed message, already checked against
    /// what that message announced (the socket loop does that).
    Payload {
        id: u64,
        payload: Payload,
    },
    Cancel {
        job_id: u64,
    },
    /// A job just accepted, with its model and data already read and checked.
    Prepared {
        job_id: u64,
        prepared: Box<Prepared>,
    },
}

/// A cheap handle to the coordinator task.
#[derive(Debug, Clone)]
pub struct Coordinator {
    tx: mpsc::UnboundedSender<Event>,
}

impl Coordinator {
    /// Starts the coordinator on the current tokio runtime.
    pub fn spawn(db: Db, data_dir: PathBuf) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(
            Actor {
                db,
                data_dir,
                providers: BTreeMap::new(),
                runs: HashMap::new(),
                waiting: HashMap::new(),
                prepared: HashMap::new(),
            }
            .run(rx),
        );
        Self { tx }
    }

    /// Best effort: when the coordinator is gone the server is shutting down.
    pub fn send(&self, event: Event) {
        let _ = self.tx.send(event);
    }
}

/// A frame for a provider's socket loop to send.
#[derive(Debug)]
pub enum Outgoing {
    Message(ToProvider),
    /// A payload frame passed on exactly as it arrived.
    Payload(Bytes),
}

struct Live {
    hello: Hello,
    tx: mpsc::UnboundedSender<Outgoing>,
    job: Option<u64>,
    /// Where the payload frames this provider still owes go, in order.
    routes: VecDeque<Route>,
}

/// The destination of the bytes that follow one streamed message: the
/// provider its relayed message went to, or nowhere when the job dropped it.
struct Route {
    to: Option<u64>,
    left: usize,
}

struct Actor {
    db: Db,
    data_dir: PathBuf,
    providers: BTreeMap<u64, Live>,
    runs: HashMap<u64, JobRun>,
    /// The last reason each queued job gave for waiting, to write it only when it changes.
    waiting: HashMap<u64, String>,
    /// Queued jobs already read and checked, so waiting for providers does
    /// not reload their data on every scheduling tick.
    prepared: HashMap<u64, Prepared>,
}

/// Everything a job needs before any provider is touched.
#[derive(Debug)]
pub struct Prepared {
    pub spec: JobSpec,
    pub graph: rookery_model::Graph,
    pub analysis: rookery_model::Analysis,
    /// What the model's importer wants the Requester to know.
    pub warnings: Vec<String>,
    pub train: rookery_job::Dataset,
    pub test: Option<rookery_job::Dataset>,
}

/// Reads and checks a job's model and data against each other (blocking
/// work): the upload handler runs it before accepting a job, the scheduler
/// before planning one.
pub fn prepare(spec: JobSpec) -> Result<Prepared, String> {
    let loaded = spec.load_model().map_err(|e| e.to_string())?;
    let loss = spec.training.loss;
    let mut train = rookery_job::load_split(&spec.data, rookery_job::Split::Train, loss)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "the job has no training data".to_string())?;
    let mut test = rookery_job::load_split(&spec.data, rookery_job::Split::Test, loss)
        .map_err(|e| e.to_string())?;
    rookery_job::validate_against_model(&loaded.graph, &spec.model.input_shape, &mut train, loss)
        .map_err(|e| e.to_string())?;
    if let Some(test) = test.as_mut() {
        rookery_job::validate_against_model(&loaded.graph, &spec.model.input_shape, test, loss)
            .map_err(|e| format!("test set: {e}"))?;
    }
    let analysis = loaded.graph.analyze().map_err(|e| e.to_string())?;
    Ok(Prepared {
        spec,
        graph: loaded.graph,
        analysis,
        warnings: loaded.warnings,
        train,
        test,
    })
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Event>) {
        let mut ticker = tokio::time::interval(SCHEDULE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = rx.recv() => match event {
                    Some(event) => self.on_event(event).await,
                    None => return,
                },
                _ = ticker.tick() => self.schedule().await,
            }
        }
    }

    async fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected { id, hello, tx } => {
                self.providers.insert(
                    id,
                    Live {
                        hello,
                        tx,
                        job: None,
                        routes: VecDeque::new(),
                    },
                );
            }
            Event::Disconnected { id, reason } => {
                let Some(live) = self.providers.remove(&id) else {
                    return;
                };
                if let Some(job_id) = live.job {
                    let reason = format!(
                        "provider {id} ({}) left while running a stage ({reason}); the job cannot go on without it",
                        live.hello.display_name
                    );
                    self.fail(job_id, reason).await;
                }
            }
            Event::Message { id, message } => {
                let Some(job_id) = self.providers.get(&id).and_then(|p| p.job) else {
                    tracing::warn!(
                        provider = id,
                        "dropped a training frame from a provider without a job"
                    );
                    return;
                };
                let owed: usize = stream::following(&message).iter().sum();
                let effects = match self.runs.get_mut(&job_id) {
                    Some(run) => run.on_message(id, message),
                    None => Vec::new(),
                };
                if owed > 0 {
                    // The relayed message is the one whose tensors still follow.
                    let to = effects.iter().find_map(|effect| match effect {
                        Effect::Send(to, m) if !stream::following(m).is_empty() => Some(*to),
                        _ => None,
                    });
                    if let Some(live) = self.providers.get_mut(&id) {
                        live.routes.push_back(Route { to, left: owed });
                    }
                }
                self.apply(job_id, effects).await;
            }
            Event::Payload { id, payload } => self.relay_payload(id, payload),
            Event::Prepared { job_id, prepared } => {
                if !self.runs.contains_key(&job_id) {
                    self.prepared.insert(job_id, *prepared);
                }
            }
            Event::Cancel { job_id } => {
                self.prepared.remove(&job_id);
                if let Some(mut run) = self.runs.remove(&job_id) {
                    let effects = run.release();
                    self.apply_sends(effects);
                    self.free(job_id);
                }
                self.set_status(
                    job_id,
                    JobStatus::Cancelled,
                    Some("cancelled by the Requester".into()),
                )
                .await;
            }
        }
    }

    /// Starts the oldest queued job that fits on the idle providers.
    async fn schedule(&mut self) {
        let queued = match jobs::queued(&self.db).await {
            Ok(queued) => queued,
            Err(error) => {
                tracing::error!(%error, "cannot read the job queue");
                return;
            }
        };
        for job in queued {
            if self.runs.contains_key(&job.id) {
                continue;
            }
            // Browser tabs join and benchmark, but run no stages until the
            // WebGPU executor lands (issue 5), so plans use native providers.
            let idle: Vec<(u64, Hello)> = self
                .providers
                .iter()
                .filter(|(_, p)| {
                    p.job.is_none() && p.hello.kind == rookery_proto::ProviderKind::Native
                })
                .map(|(id, p)| (*id, p.hello.clone()))
                .collect();
            if idle.is_empty() {
                self.wait(job.id, "waiting for providers to connect".into())
                    .await;
                continue;
            }
            let prepared = match self.prepared.remove(&job.id) {
                Some(prepared) => prepared,
                None => {
                    let dir = PathBuf::from(&job.dir);
                    let spec_json = job.spec_json.clone();
                    let read = tokio::task::spawn_blocking(move || {
                        prepare(JobSpec::from_json(&spec_json, &dir).map_err(|e| e.to_string())?)
                    })
                    .await
                    .unwrap_or_else(|error| Err(format!("preparing the job crashed: {error}")));
                    match read {
                        Ok(prepared) => prepared,
                        Err(reason) => {
                            self.set_status(job.id, JobStatus::Failed, Some(reason))
                                .await;
                            continue;
                        }
                    }
                }
            };
            let specs: Vec<ProviderSpec> = idle
                .iter()
                .map(|(id, hello)| ProviderSpec {
                    id: id.to_string(),
                    kind: match hello.kind {
                        rookery_proto::ProviderKind::Native => ProviderKind::Native,
                        rookery_proto::ProviderKind::Browser => ProviderKind::Browser,
                    },
                    memory_bytes: hello.memory_bytes,
                    gflops: hello.gflops,
                    bandwidth_mbps: DEFAULT_BANDWIDTH_MBPS,
                })
                .collect();
            let options = plan_options(&prepared.spec);
            let plan = match rookery_model::clusterize(&prepared.graph, &specs, &options) {
                Ok(plan) => plan,
                Err(error) => {
                    self.wait(job.id, format!("waiting for providers: {error}"))
                        .await;
                    self.prepared.insert(job.id, prepared);
                    continue;
                }
            };
            let ids: HashMap<String, u64> =
                idle.iter().map(|(id, _)| (id.to_string(), *id)).collect();
            let Prepared {
                spec,
                graph,
                analysis,
                train,
                test,
                ..
            } = prepared;
            let started = JobRun::start(job.id, spec, &graph, &analysis, &plan, &ids, train, test);
            let (run, effects) = match started {
                Ok(started) => started,
                Err(reason) => {
                    self.set_status(job.id, JobStatus::Failed, Some(reason))
                        .await;
                    continue;
                }
            };
            for p in run.providers() {
                if let Some(live) = self.providers.get_mut(&p) {
                    live.job = Some(job.id);
                }
            }
            let plan_json = plan.to_json().unwrap_or_default();
            if let Err(error) = jobs::set_plan(&self.db, job.id, plan_json, run.total_steps()).await
            {
                tracing::error!(job = job.id, %error, "cannot store the plan");
            }
            self.waiting.remove(&job.id);
            self.set_status(
                job.id,
                JobStatus::Planning,
                Some("handing stages to providers".into()),
            )
            .await;
            tracing::info!(
                job = job.id,
                clusters = plan.clusters.len(),
                steps = run.total_steps(),
                "job starts"
            );
            self.runs.insert(job.id, run);
            self.apply(job.id, effects).await;
        }
    }

    async fn wait(&mut self, job_id: u64, reason: String) {
        if self.waiting.get(&job_id) == Some(&reason) {
            return;
        }
        self.waiting.insert(job_id, reason.clone());
        if let Err(error) =
            jobs::set_status(&self.db, job_id, JobStatus::Queued, Some(reason), now_ms()).await
        {
            tracing::error!(job = job_id, %error, "cannot record why a job waits");
        }
    }

    fn apply_sends(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            if let Effect::Send(provider, message) = effect {
                self.send(provider, message);
            }
        }
    }

    fn send(&self, provider: u64, message: ToProvider) {
        self.send_frame(provider, Outgoing::Message(message));
    }

    fn send_frame(&self, provider: u64, frame: Outgoing) {
        match self.providers.get(&provider) {
            Some(live) => {
                let _ = live.tx.send(frame);
            }
            None => tracing::warn!(provider, "no connection to send a frame to"),
        }
    }

    /// Passes a payload frame on along its message's route.
    fn relay_payload(&mut self, id: u64, payload: Payload) {
        let Some(live) = self.providers.get_mut(&id) else {
            return;
        };
        let Some(route) = live.routes.front_mut() else {
            tracing::warn!(
                provider = id,
                "dropped a payload frame that no message announced"
            );
            return;
        };
        let to = route.to;
        route.left = route.left.saturating_sub(payload.data().len());
        if route.left == 0 {
            live.routes.pop_front();
        }
        if let Some(to) = to {
            self.send_frame(to, Outgoing::Payload(payload.frame()));
        }
    }

    async fn apply(&mut self, job_id: u64, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Send(provider, message) => self.send(provider, message),
                Effect::Running => self.set_status(job_id, JobStatus::Running, None).await,
                Effect::Step(record) => {
                    if let Err(error) = jobs::record_step(&self.db, job_id, record).await {
                        tracing::error!(job = job_id, %error, "cannot record a step");
                    }
                }
                Effect::Epoch(record) => {
                    tracing::info!(
                        job = job_id,
                        epoch = record.epoch,
                        test_loss = record.test_loss,
                        test_accuracy = record.test_accuracy,
                        "epoch evaluated"
                    );
                    if let Err(error) = jobs::record_epoch(&self.db, job_id, record).await {
                        tracing::error!(job = job_id, %error, "cannot record an epoch");
                    }
                }
                Effect::Checkpoint(weights) => {
                    let path = checkpoint_path(&self.data_dir, job_id);
                    if let Err(error) = write_weights(path, weights).await {
                        tracing::error!(job = job_id, %error, "cannot write the checkpoint");
                    }
                }
                Effect::Completed(weights) => {
                    let path = weights_path(&self.data_dir, job_id);
                    match write_weights(path, weights).await {
                        Ok(()) => self.set_status(job_id, JobStatus::Completed, None).await,
                        Err(error) => {
                            self.set_status(
                                job_id,
                                JobStatus::Failed,
                                Some(format!("cannot write the weights: {error}")),
                            )
                            .await
                        }
                    }
                    self.runs.remove(&job_id);
                    self.free(job_id);
                }
                Effect::Failed(reason) => {
                    self.fail(job_id, reason).await;
                    return;
                }
            }
        }
    }

    async fn fail(&mut self, job_id: u64, reason: String) {
        tracing::warn!(job = job_id, %reason, "job failed");
        if let Some(mut run) = self.runs.remove(&job_id) {
            let effects = run.release();
            self.apply_sends(effects);
        }
        self.free(job_id);
        self.set_status(job_id, JobStatus::Failed, Some(reason))
            .await;
    }

    fn free(&mut self, job_id: u64) {
        for live in self.providers.values_mut() {
            if live.job == Some(job_id) {
                live.job = None;
            }
        }
    }

    async fn set_status(&self, job_id: u64, status: JobStatus, detail: Option<String>) {
        if let Err(error) = jobs::set_status(&self.db, job_id, status, detail, now_ms()).await {
            tracing::error!(job = job_id, %error, "cannot record a job's status");
        }
    }
}

/// The planner's knobs for a job: its micro-batch, cluster count, optimizer
/// memory and the sync schedule's in-flight micro-batches.
pub fn plan_options(spec: &JobSpec) -> PlanOptions {
    let t = &spec.training;
    PlanOptions {
        micro_batch: spec.micro_batch_size().max(1),
        clusters: t.clusters,
        optimizer_copies: match t.optimizer {
            rookery_model::OptimizerConfig::Sgd { momentum: 0.0, .. } => 0,
            rookery_model::OptimizerConfig::Sgd { .. }
            | rookery_model::OptimizerConfig::RmsProp { .. } => 1,
            _ => 2,
        },
        in_flight_micro_batches: t.micro_batches.max(1) as u32,
        stages_per_cluster: t.stages,
        ..PlanOptions::default()
    }
}

pub fn job_dir(data_dir: &Path, job_id: u64) -> PathBuf {
    data_dir.join("jobs").join(job_id.to_string())
}

pub fn checkpoint_path(data_dir: &Path, job_id: u64) -> PathBuf {
    job_dir(data_dir, job_id).join("checkpoint.safetensors")
}

pub fn weights_path(data_dir: &Path, job_id: u64) -> PathBuf {
    job_dir(data_dir, job_id).join("weights.safetensors")
}

async fn write_weights(path: PathBuf, weights: Vec<WeightTensor>) -> std::io::Result<()> {
    tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        write_safetensors(&path, &weights)
    })
    .await
    .map_err(std::io::Error::other)?
}
