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
use rookery_plan::{PlanOptions, ProviderSpec};
use rookery_proto::api::{EpochMetric, JobEvent, JobEventBody, LogEntry, ProviderWork};
use rookery_proto::stream::{self, Payload};
use rookery_proto::{Bytes, Hello, ToProvider, ToServer};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::checkpoints::{CheckpointWriter, write_weights};
use crate::db::Db;
use crate::jobs::{self, JobStatus, LogRecord};
use crate::now_ms;
use crate::run::{Effect, JobRun};

/// How often queued jobs are matched against idle providers.
const SCHEDULE_EVERY: Duration = Duration::from_millis(300);
/// Live events a slow subscriber may fall behind by before it is told it
/// lagged (and reloads what it shows).
const EVENT_BUFFER: usize = 4096;
/// A job that syncs every step would rewrite its resume file (parameters and
/// optimizer state, fsynced) every step; it is rewritten at most this often
/// per job. A restarted server then replays at most this long of training;
/// a lost provider's rollback uses the in-memory checkpoint of the last sync.
const RESUME_EVERY_MS: u64 = 5_000;
/// A job that syncs every step would write a log line per step; sync lines
/// are written at most this often per job, counting the syncs in between.
const SYNC_LOG_EVERY_MS: u64 = 2_000;
/// Faults a provider may commit on one job; the last of them bans it from the job.
pub const BAN_AFTER_FAULTS: u32 = 3;

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
    /// The provider broke the protocol (a malformed frame, a bad payload) and
    /// its socket loop is dropping it; sent just before `Disconnected`.
    Fault {
        id: u64,
        reason: String,
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
    /// The provider's link was measured.
    Measured {
        id: u64,
        bandwidth_mbps: f64,
    },
    /// A job just accepted, with its model and data already read and checked.
    Prepared {
        job_id: u64,
        prepared: Box<Prepared>,
    },
    /// Asks for the connected providers and what each is doing.
    Snapshot {
        reply: oneshot::Sender<Vec<LiveProvider>>,
    },
}

/// A connected provider as the coordinator sees it.
#[derive(Debug, Clone)]
pub struct LiveProvider {
    pub id: u64,
    pub hello: Hello,
    pub work: Option<ProviderWork>,
    /// Measured after `Welcome`; `None` until the probe comes back.
    pub bandwidth_mbps: Option<f64>,
}

impl LiveProvider {
    /// What the planner knows of it, if a job may be planned onto it now:
    /// idle and with its link measured. Browser tabs and `--backend wgpu`
    /// providers run our own kernels, so their GPU's buffer limit comes along.
    pub fn candidate(&self) -> Option<ProviderSpec> {
        if self.work.is_some() {
            return None;
        }
        Some(ProviderSpec {
            id: self.id.to_string(),
            kind: self.hello.kind,
            memory_bytes: self.hello.memory_bytes,
            gflops: self.hello.gflops,
            bandwidth_mbps: self.bandwidth_mbps?,
            max_buffer_bytes: self.hello.max_buffer_bytes,
        })
    }
}

/// A cheap handle to the coordinator task.
#[derive(Debug, Clone)]
pub struct Coordinator {
    tx: mpsc::UnboundedSender<Event>,
    events: broadcast::Sender<JobEvent>,
}

impl Coordinator {
    /// Starts the coordinator on the current tokio runtime.
    pub fn spawn(db: Db, data_dir: PathBuf) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        tokio::spawn(
            Actor {
                db,
                data_dir,
                providers: BTreeMap::new(),
                runs: HashMap::new(),
                waiting: HashMap::new(),
                prepared: HashMap::new(),
                events: events.clone(),
                micro_batches: HashMap::new(),
                sync_log: HashMap::new(),
                faults: HashMap::new(),
                bans: HashMap::new(),
                short: HashMap::new(),
                resume_written: HashMap::new(),
                checkpoints: HashMap::new(),
            }
            .run(rx),
        );
        Self { tx, events }
    }

    /// Best effort: when the coordinator is gone the server is shutting down.
    pub fn send(&self, event: Event) {
        let _ = self.tx.send(event);
    }

    /// Every job event from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<JobEvent> {
        self.events.subscribe()
    }

    /// Tells live subscribers about a change made outside the coordinator
    /// (a submitted or cancelled job).
    pub fn publish(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }

    /// The connected providers; empty if the coordinator is gone.
    pub async fn snapshot(&self) -> Vec<LiveProvider> {
        let (reply, answer) = oneshot::channel();
        self.send(Event::Snapshot { reply });
        answer.await.unwrap_or_default()
    }
}

/// A frame for a provider's socket loop to send.
#[derive(Debug)]
pub enum Outgoing {
    Message(ToProvider),
    /// A payload frame passed on exactly as it arrived.
    Payload(Bytes),
    /// Drop the provider: send it an `Error` with `reason` and close.
    Close {
        reason: String,
    },
}

struct Live {
    hello: Hello,
    tx: mpsc::UnboundedSender<Outgoing>,
    job: Option<u64>,
    /// Where the payload frames this provider still owes go, in order.
    routes: VecDeque<Route>,
    /// Until its link is measured, a provider is not planned onto.
    bandwidth_mbps: Option<f64>,
    /// The stage it runs, for the dashboard.
    work: Option<ProviderWork>,
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
    events: broadcast::Sender<JobEvent>,
    /// Micro-batches per step of each running job.
    micro_batches: HashMap<u64, u64>,
    /// Per job: when the last sync line was written and syncs since.
    sync_log: HashMap<u64, (u64, u64)>,
    /// Faults per (job, provider name): by name, so that reconnecting (which
    /// gives a new id) does not wipe a provider's record on the job.
    faults: HashMap<(u64, String), u32>,
    /// The bans of running and queued jobs as last read from or written to
    /// the database (which is the source of truth, across restarts).
    bans: HashMap<u64, Vec<jobs::Ban>>,
    /// Per running job: the stages it last said it waits for a provider for.
    short: HashMap<u64, Option<String>>,
    /// Per running job: when its resume file was last written.
    resume_written: HashMap<u64, u64>,
    /// Per running job: the task writing its checkpoint file.
    checkpoints: HashMap<u64, CheckpointWriter>,
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

/// Why a job cannot run, with the job file's field or file it is about
/// when there is one (so a form can show it next to that field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PrepareError {
    pub message: String,
    /// A dotted job-file field (`training.batch_size`) or a data or model
    /// file's path.
    pub field: Option<String>,
}

impl From<rookery_job::JobError> for PrepareError {
    fn from(error: rookery_job::JobError) -> Self {
        let field = match &error {
            rookery_job::JobError::Field { field, .. } => Some(field.clone()),
            rookery_job::JobError::File { path, .. } => Some(path.clone()),
            rookery_job::JobError::Model(_) => Some("model".into()),
            _ => None,
        };
        PrepareError {
            message: error.to_string(),
            field,
        }
    }
}

impl From<String> for PrepareError {
    fn from(message: String) -> Self {
        PrepareError {
            message,
            field: None,
        }
    }
}

/// Reads and checks a job's model and data against each other (blocking
/// work): the upload handler runs it before accepting a job, the scheduler
/// before planning one.
pub fn prepare(spec: JobSpec) -> Result<Prepared, PrepareError> {
    let loaded = spec.load_model()?;
    let loss = spec.training.loss;
    let mut train = rookery_job::load_split(&spec.data, rookery_job::Split::Train, loss)?
        .ok_or_else(|| "the job has no training data".to_string())?;
    let mut test = rookery_job::load_split(&spec.data, rookery_job::Split::Test, loss)?;
    rookery_job::validate_against_model(&loaded.graph, &spec.model.input_shape, &mut train, loss)?;
    if let Some(test) = test.as_mut() {
        rookery_job::validate_against_model(&loaded.graph, &spec.model.input_shape, test, loss)
            .map_err(|e| PrepareError {
                message: format!("test set: {e}"),
                ..PrepareError::from(e)
            })?;
    }
    let analysis = loaded
        .graph
        .analyze()
        .map_err(|e| PrepareError::from(e.to_string()))?;
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

    fn snapshot(&self) -> Vec<LiveProvider> {
        self.providers
            .iter()
            .map(|(id, p)| LiveProvider {
                id: *id,
                hello: p.hello.clone(),
                work: p.work.clone(),
                bandwidth_mbps: p.bandwidth_mbps,
            })
            .collect()
    }

    async fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected { id, hello, tx } => {
                let message = format!(
                    "provider {id} ({}, {} {}) connected",
                    hello.display_name,
                    hello.kind.as_str(),
                    hello.device
                );
                self.providers.insert(
                    id,
                    Live {
                        hello,
                        tx,
                        job: None,
                        routes: VecDeque::new(),
                        bandwidth_mbps: None,
                        work: None,
                    },
                );
                let waiting: Vec<u64> = self.waiting.keys().copied().collect();
                for job_id in waiting {
                    self.log(job_id, "provider_joined", message.clone()).await;
                }
            }
            Event::Disconnected { id, reason } => {
                let Some(live) = self.providers.remove(&id) else {
                    return;
                };
                if let Some(job_id) = live.job {
                    self.log(
                        job_id,
                        "provider_left",
                        format!(
                            "provider {id} ({}) disconnected: {reason}",
                            live.hello.display_name
                        ),
                    )
                    .await;
                    self.stage_lost(job_id, id, &reason).await;
                }
            }
            Event::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
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
                let synced = effects.iter().any(|e| matches!(e, Effect::ResumePoint(_)));
                self.apply(job_id, effects).await;
                if synced {
                    self.replace_stragglers(job_id).await;
                }
            }
            Event::Payload { id, payload } => self.relay_payload(id, payload),
            Event::Fault { id, reason } => {
                if let Some(job_id) = self.providers.get(&id).and_then(|p| p.job) {
                    // Its socket loop is already dropping it.
                    self.on_fault(job_id, id, reason, false).await;
                }
            }
            Event::Measured { id, bandwidth_mbps } => {
                if let Some(live) = self.providers.get_mut(&id) {
                    live.bandwidth_mbps = Some(bandwidth_mbps);
                }
            }
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
        let short: Vec<u64> = self
            .runs
            .iter()
            .filter(|(_, run)| !run.vacancies().is_empty())
            .map(|(id, _)| *id)
            .collect();
        for job_id in short {
            self.fill_vacancies(job_id).await;
        }
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
            let live = self.without_banned(job.id, self.snapshot()).await;
            let specs: Vec<ProviderSpec> =
                live.iter().filter_map(LiveProvider::candidate).collect();
            if specs.is_empty() {
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
                        prepare(JobSpec::from_json(&spec_json, &dir)?)
                    })
                    .await
                    .unwrap_or_else(|error| {
                        Err(format!("preparing the job crashed: {error}").into())
                    });
                    match read {
                        Ok(prepared) => prepared,
                        Err(reason) => {
                            self.set_status(job.id, JobStatus::Failed, Some(reason.to_string()))
                                .await;
                            continue;
                        }
                    }
                }
            };
            let dir = job_dir(&self.data_dir, job.id);
            let resume = tokio::task::spawn_blocking(move || crate::resume::read(&dir))
                .await
                .unwrap_or_else(|error| Err(format!("reading the resume point crashed: {error}")));
            let resume = match resume {
                Ok(resume) => resume,
                Err(reason) => {
                    self.set_status(
                        job.id,
                        JobStatus::Failed,
                        Some(format!("cannot resume from the checkpoint: {reason}")),
                    )
                    .await;
                    continue;
                }
            };
            let mut options = plan_options(&prepared.spec);
            if let Some(resume) = &resume {
                // The data's sharding depends on the cluster count, so a resumed
                // job keeps it; the stages may be cut differently.
                options.clusters = rookery_model::ClusterCount::Fixed(resume.optimizer.len());
            }
            let plan = match rookery_plan::clusterize(&prepared.graph, &specs, &options) {
                Ok(plan) => plan,
                Err(error) => {
                    self.wait(job.id, format!("waiting for providers: {error}"))
                        .await;
                    self.prepared.insert(job.id, prepared);
                    continue;
                }
            };
            let who = by_plan_id(live);
            let ids: HashMap<String, u64> = who
                .iter()
                .map(|(key, (id, _))| (key.clone(), *id))
                .collect();
            let view = crate::plan_view::plan_view(&plan, &prepared.graph, &who);
            // Each stage carries its cluster's micro-batches every step.
            let step_micro_batches = prepared.spec.training.micro_batches.max(1) as u64;
            let Prepared {
                spec,
                graph,
                analysis,
                train,
                test,
                ..
            } = prepared;
            let resumed_at = resume.as_ref().map(|r| r.step);
            let started = JobRun::start(
                job.id, spec, &graph, &analysis, &plan, &ids, train, test, resume,
            );
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
            for (c, cluster) in view.clusters.iter().enumerate() {
                for (s, stage) in cluster.stages.iter().enumerate() {
                    if let Some(live) = self.providers.get_mut(&stage.provider) {
                        live.work = Some(ProviderWork {
                            job_id: job.id,
                            cluster: c as u32,
                            stage: s as u32,
                            role: stage.role.clone(),
                            micro_batches_done: 0,
                        });
                    }
                }
            }
            self.micro_batches.insert(job.id, step_micro_batches);
            let plan_json = serde_json::to_string(&view).unwrap_or_default();
            if let Err(error) = jobs::set_plan(&self.db, job.id, plan_json, run.total_steps()).await
            {
                tracing::error!(job = job.id, %error, "cannot store the plan");
            }
            for (c, cluster) in view.clusters.iter().enumerate() {
                for stage in &cluster.stages {
                    let message = format!(
                        "cluster {c}: {} stage ({} nodes, {} parameters) on provider {} ({}, {})",
                        stage.role,
                        stage.nodes,
                        stage.param_count,
                        stage.provider,
                        stage.provider_name,
                        stage.device
                    );
                    self.log(job.id, "stage_assigned", message).await;
                }
            }
            self.waiting.remove(&job.id);
            let detail = match resumed_at {
                Some(step) => format!(
                    "handing stages to providers; resuming from the checkpoint at step {step}"
                ),
                None => "handing stages to providers".into(),
            };
            self.set_status(job.id, JobStatus::Planning, Some(detail))
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
        match jobs::set_status(&self.db, job_id, JobStatus::Queued, Some(reason), now_ms()).await {
            Ok(_) => self.publish_job(job_id).await,
            Err(error) => tracing::error!(job = job_id, %error, "cannot record why a job waits"),
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
        // Providers get their work before the coordinator awaits its own
        // bookkeeping (database rows, checkpoint files): a step's first
        // micro-batches must not wait for the previous step's record. Sends
        // keep their order among themselves, which is all the protocol needs.
        let (sends, rest): (Vec<Effect>, Vec<Effect>) = effects
            .into_iter()
            .partition(|e| matches!(e, Effect::Send(..)));
        self.apply_sends(sends);
        for effect in rest {
            match effect {
                Effect::Send(provider, message) => self.send(provider, message),
                Effect::Running => self.set_status(job_id, JobStatus::Running, None).await,
                Effect::Step(record) => {
                    let per_step = self.micro_batches.get(&job_id).copied().unwrap_or(1);
                    for stage in &record.stages {
                        if let Some(work) = self
                            .providers
                            .get_mut(&stage.provider)
                            .and_then(|live| live.work.as_mut())
                        {
                            work.micro_batches_done += per_step;
                        }
                    }
                    let metric = crate::job_api::step_metric(record.clone());
                    if let Err(error) = jobs::record_step(&self.db, job_id, record).await {
                        tracing::error!(job = job_id, %error, "cannot record a step");
                    }
                    self.publish(job_id, JobEventBody::Step { step: metric });
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
                    let message = format!(
                        "epoch {} evaluated on {} test samples: loss {:.4}, accuracy {:.2}%",
                        record.epoch,
                        record.samples,
                        record.test_loss,
                        record.test_accuracy * 100.0
                    );
                    self.publish(
                        job_id,
                        JobEventBody::Epoch {
                            epoch: EpochMetric {
                                epoch: record.epoch,
                                test_loss: record.test_loss,
                                test_accuracy: record.test_accuracy,
                                samples: record.samples,
                            },
                        },
                    );
                    self.log(job_id, "epoch", message).await;
                }
                Effect::Checkpoint(weights) => {
                    let data_dir = &self.data_dir;
                    self.checkpoints
                        .entry(job_id)
                        .or_insert_with(|| {
                            CheckpointWriter::spawn(job_id, checkpoint_path(data_dir, job_id))
                        })
                        .save(weights);
                    self.log_sync(job_id).await;
                }
                Effect::ResumePoint(point) => {
                    let now = now_ms();
                    let last = self.resume_written.entry(job_id).or_insert(0);
                    if now.saturating_sub(*last) < RESUME_EVERY_MS {
                        continue;
                    }
                    *last = now;
                    let dir = job_dir(&self.data_dir, job_id);
                    let written =
                        tokio::task::spawn_blocking(move || crate::resume::write(&dir, &point))
                            .await
                            .map_err(std::io::Error::other)
                            .and_then(|r| r);
                    if let Err(error) = written {
                        tracing::error!(job = job_id, %error, "cannot write the resume point");
                    }
                }
                Effect::Log { kind, message } => self.log(job_id, kind, message).await,
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
                Effect::Fault {
                    provider,
                    reason,
                    frame_dropped,
                } => self.on_fault(job_id, provider, reason, frame_dropped).await,
            }
        }
    }

    /// Counts a fault against `provider` on `job_id`. The last allowed fault
    /// bans it from the job: recorded, logged, dropped, never planned onto the
    /// job again. Before that, a fault whose frame was dropped also drops the
    /// provider (`drop_now`): its stage cannot finish the step without the
    /// frame, so the stage is lost; a fault the job absorbed (far-off
    /// parameters that robust aggregation outvoted) only counts.
    async fn on_fault(&mut self, job_id: u64, provider: u64, reason: String, drop_now: bool) {
        let Some(live) = self.providers.get(&provider) else {
            return;
        };
        let name = live.hello.display_name.clone();
        let count = self.faults.entry((job_id, name.clone())).or_insert(0);
        *count += 1;
        let count = *count;
        tracing::warn!(job = job_id, provider, %name, count, %reason, "provider fault");
        self.log(
            job_id,
            "provider_fault",
            format!("provider {provider} ({name}) fault {count} of {BAN_AFTER_FAULTS}: {reason}"),
        )
        .await;
        let close = match fault_action(count, drop_now) {
            FaultAction::Count => return,
            FaultAction::Drop => format!("dropped from job {job_id}: {reason}"),
            FaultAction::Ban => {
                let ban = jobs::Ban {
                    provider_id: provider,
                    provider_name: name,
                    at_ms: now_ms(),
                    reason: reason.clone(),
                };
                self.bans.entry(job_id).or_default().push(ban.clone());
                if let Err(error) = jobs::ban(&self.db, job_id, ban).await {
                    tracing::error!(job = job_id, provider, %error, "cannot record a ban");
                }
                self.log(
                    job_id,
                    "provider_banned",
                    format!("provider {provider} banned: {reason}"),
                )
                .await;
                format!("banned from job {job_id} after {count} faults: {reason}")
            }
        };
        // Gone from the coordinator at once, so that nothing more it sends
        // counts and it is nobody's standby; its socket loop closes the
        // connection (and its `Disconnected` finds nothing left to do).
        if let Some(live) = self.providers.remove(&provider) {
            let _ = live.tx.send(Outgoing::Close { reason: close });
        }
        // Boxed: losing a stage applies effects, which may hold faults.
        Box::pin(self.stage_lost(job_id, provider, &reason)).await;
    }

    /// `live` less the providers banned from `job_id` (by id or by name).
    async fn without_banned(&mut self, job_id: u64, live: Vec<LiveProvider>) -> Vec<LiveProvider> {
        let bans = match jobs::bans(&self.db, job_id).await {
            Ok(bans) => bans,
            Err(error) => {
                tracing::error!(job = job_id, %error, "cannot read a job's bans");
                return Vec::new();
            }
        };
        let live = live.into_iter().filter(|p| !is_banned(&bans, p)).collect();
        self.bans.insert(job_id, bans);
        live
    }

    /// A provider of a running job is gone: its cluster rolls back to the
    /// last checkpoint and its stage goes to a standby, or waits for one.
    /// The one entry point for every way a provider leaves a job.
    async fn stage_lost(&mut self, job_id: u64, provider: u64, reason: &str) {
        let Some(run) = self.runs.get_mut(&job_id) else {
            return;
        };
        let Some(effects) = run.stage_lost(provider, reason) else {
            return;
        };
        if let Some(live) = self.providers.get_mut(&provider) {
            live.job = None;
            live.work = None;
        }
        self.apply(job_id, effects).await;
        self.fill_vacancies(job_id).await;
    }

    /// Gives each stage of `job_id` that has no provider the fastest idle
    /// provider with the memory for it; says what the job waits for otherwise.
    async fn fill_vacancies(&mut self, job_id: u64) {
        let Some(vacancies) = self.runs.get(&job_id).map(JobRun::vacancies) else {
            return;
        };
        let mut waiting = Vec::new();
        for vacancy in vacancies {
            let Some(id) = self.standby(job_id, vacancy.memory_bytes) else {
                waiting.push(format!(
                    "cluster {}, stage {}",
                    vacancy.cluster, vacancy.stage
                ));
                continue;
            };
            self.take(job_id, id, vacancy.cluster, vacancy.stage);
            let effects = match self.runs.get_mut(&job_id) {
                Some(run) => run.fill(vacancy.cluster, vacancy.stage, id),
                None => return,
            };
            self.apply(job_id, effects).await;
        }
        let detail = (!waiting.is_empty())
            .then(|| format!("waiting for a provider for {}", waiting.join("; ")));
        if self.short.get(&job_id).cloned().flatten() != detail {
            if let Some(detail) = &detail {
                self.log(job_id, "waiting", detail.clone()).await;
            }
            self.short.insert(job_id, detail.clone());
            self.set_status(job_id, JobStatus::Running, detail).await;
        }
    }

    /// The idle provider with the most GFLOP/s and at least `memory_bytes`.
    fn standby(&self, job_id: u64, memory_bytes: u64) -> Option<u64> {
        let bans = self.bans.get(&job_id).map_or(&[][..], Vec::as_slice);
        self.snapshot()
            .iter()
            .filter(|p| !is_banned(bans, p))
            .filter_map(|p| p.candidate().map(|spec| (p.id, spec)))
            .filter(|(_, spec)| spec.memory_bytes >= memory_bytes)
            .max_by(|a, b| a.1.gflops.total_cmp(&b.1.gflops))
            .map(|(id, _)| id)
    }

    /// Marks `provider` as running stage `stage` of cluster `cluster`.
    fn take(&mut self, job_id: u64, provider: u64, cluster: usize, stage: usize) {
        let stages = self
            .runs
            .get(&job_id)
            .map_or(1, |run| run.stage_count(cluster));
        let role = match (stage, stages) {
            (_, 1) => "single",
            (0, _) => "root",
            (s, n) if s + 1 == n => "leaf",
            _ => "stem",
        };
        if let Some(live) = self.providers.get_mut(&provider) {
            live.job = Some(job_id);
            live.work = Some(ProviderWork {
                job_id,
                cluster: cluster as u32,
                stage: stage as u32,
                role: role.into(),
                micro_batches_done: 0,
            });
        }
    }

    /// At a sync, moves stages whose providers straggle onto faster idle
    /// providers (the checkpoint just taken is the cluster's state, so
    /// nothing is replayed but the step just begun).
    async fn replace_stragglers(&mut self, job_id: u64) {
        let Some(stragglers) = self.runs.get(&job_id).map(JobRun::stragglers) else {
            return;
        };
        for straggler in stragglers {
            let slow_gflops = self
                .providers
                .get(&straggler.provider)
                .map_or(0.0, |p| p.hello.gflops);
            let Some(id) = self.standby(job_id, straggler.memory_bytes) else {
                continue;
            };
            // A standby has only its claim to show: at the job's typical
            // ratio of measured to planned time, its claimed GFLOP/s must
            // promise at least twice the straggler's measured speed.
            let faster = self.providers.get(&id).is_some_and(|p| {
                straggler.slowness * p.hello.gflops >= 2.0 * slow_gflops.max(f64::MIN_POSITIVE)
            });
            if !faster {
                continue;
            }
            let why = format!(
                "{:.1} times slower than the job's typical stage for {} steps",
                straggler.slowness,
                crate::run::STRAGGLER_STEPS
            );
            if let Some(live) = self.providers.get_mut(&straggler.provider) {
                live.job = None;
                live.work = None;
            }
            self.take(job_id, id, straggler.cluster, straggler.stage);
            let effects = match self.runs.get_mut(&job_id) {
                Some(run) => run.replace(straggler.cluster, straggler.stage, id, &why),
                None => return,
            };
            self.apply(job_id, effects).await;
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
                live.work = None;
            }
        }
        self.micro_batches.remove(&job_id);
        self.sync_log.remove(&job_id);
        self.faults.retain(|(job, _), _| *job != job_id);
        self.bans.remove(&job_id);
        self.short.remove(&job_id);
        self.resume_written.remove(&job_id);
        self.checkpoints.remove(&job_id);
    }

    async fn set_status(&self, job_id: u64, status: JobStatus, detail: Option<String>) {
        match jobs::set_status(&self.db, job_id, status, detail.clone(), now_ms()).await {
            Ok(true) => {
                if status != JobStatus::Queued {
                    let message = match &detail {
                        Some(detail) => format!("{}: {detail}", status.as_str()),
                        None => status.as_str().to_string(),
                    };
                    self.log(job_id, status.as_str(), message).await;
                }
                self.publish_job(job_id).await;
            }
            Ok(false) => {}
            Err(error) => tracing::error!(job = job_id, %error, "cannot record a job's status"),
        }
    }

    fn publish(&self, job_id: u64, body: JobEventBody) {
        // No subscriber is no error: nobody has the dashboard open.
        let _ = self.events.send(JobEvent { job_id, body });
    }

    /// Sends the job's whole row to live subscribers.
    async fn publish_job(&self, job_id: u64) {
        match jobs::get(&self.db, job_id).await {
            Ok(Some(record)) => self.publish(
                job_id,
                JobEventBody::Job {
                    job: crate::job_api::job_info(record),
                },
            ),
            Ok(None) => {}
            Err(error) => tracing::error!(job = job_id, %error, "cannot read a job to publish it"),
        }
    }

    /// Writes a line to the job's log and sends it to live subscribers.
    async fn log(&self, job_id: u64, kind: &str, message: String) {
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
        if let Err(error) = jobs::append_log(&self.db, job_id, record).await {
            tracing::error!(job = job_id, %error, "cannot write to a job's log");
        }
        self.publish(job_id, JobEventBody::Log { entry });
    }

    /// A sync averaged the clusters' parameters and wrote the checkpoint.
    async fn log_sync(&mut self, job_id: u64) {
        let now = now_ms();
        let (last, count) = self.sync_log.entry(job_id).or_insert((0, 0));
        *count += 1;
        if now.saturating_sub(*last) < SYNC_LOG_EVERY_MS {
            return;
        }
        let message = match *count {
            1 => "parameters averaged across clusters; checkpoint taken".to_string(),
            n => format!("{n} syncs averaged parameters across clusters; checkpoint taken"),
        };
        *last = now;
        *count = 0;
        self.log(job_id, "checkpoint", message).await;
    }
}

/// What a provider's fault on a job costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Counted only: the job absorbed it.
    Count,
    /// Dropped from the job (its connection closed): the step needs the
    /// frame that was turned down.
    Drop,
    /// Banned from the job: dropped and never planned onto it again.
    Ban,
}

/// The policy: the [`BAN_AFTER_FAULTS`]th fault on a job bans; before that, a
/// dropped frame drops the provider and an absorbed fault only counts.
pub fn fault_action(count: u32, frame_dropped: bool) -> FaultAction {
    if count >= BAN_AFTER_FAULTS {
        FaultAction::Ban
    } else if frame_dropped {
        FaultAction::Drop
    } else {
        FaultAction::Count
    }
}

/// Whether `provider` is one of `bans` (the same connection, or the same
/// name: a reconnection gets a new id).
pub fn is_banned(bans: &[jobs::Ban], provider: &LiveProvider) -> bool {
    bans.iter()
        .any(|b| b.provider_id == provider.id || b.provider_name == provider.hello.display_name)
}

/// Connected providers by the ids plans name them with.
pub fn by_plan_id(live: Vec<LiveProvider>) -> HashMap<String, (u64, Hello)> {
    live.into_iter()
        .map(|p| (p.id.to_string(), (p.id, p.hello)))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_third_fault_on_a_job_bans_and_earlier_dropped_frames_drop() {
        // (faults so far, was a frame dropped, action)
        let cases = [
            (1, false, FaultAction::Count),
            (2, false, FaultAction::Count),
            (1, true, FaultAction::Drop),
            (2, true, FaultAction::Drop),
            (3, false, FaultAction::Ban),
            (3, true, FaultAction::Ban),
            (4, true, FaultAction::Ban),
        ];
        for (count, dropped, want) in cases {
            assert_eq!(fault_action(count, dropped), want, "{count} {dropped}");
        }
    }

    #[test]
    fn a_ban_covers_the_same_connection_and_a_reconnection_under_the_same_name() {
        let hello = |name: &str| Hello {
            protocol_version: rookery_proto::PROTOCOL_VERSION,
            kind: rookery_proto::ProviderKind::Native,
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            gflops: 1.0,
            display_name: name.into(),
            max_buffer_bytes: None,
        };
        let live = |id, name| LiveProvider {
            id,
            hello: hello(name),
            work: None,
            bandwidth_mbps: Some(100.0),
        };
        let bans = [jobs::Ban {
            provider_id: 4,
            provider_name: "liar".into(),
            at_ms: 0,
            reason: "NaN".into(),
        }];
        // (provider, banned)
        let cases = [
            (live(4, "renamed"), true),
            (live(9, "liar"), true),
            (live(5, "honest"), false),
        ];
        for (p, want) in cases {
            assert_eq!(is_banned(&bans, &p), want, "{p:?}");
        }
    }
}
