//! Scheduling: queued jobs onto idle providers (the planner cuts each
//! model over them), a running job's vacant stages onto standbys, and
//! stragglers' stages onto faster providers at a sync.

use std::collections::HashMap;
use std::path::PathBuf;

use rookery_job::JobSpec;
use rookery_model::{ClusterCount, OptimizerConfig};
use rookery_plan::{Plan, PlanOptions, ProviderSpec};
use rookery_proto::Hello;
use rookery_proto::api::ProviderWork;

use super::faults::is_banned;
use super::work::RunRecipe;
use super::{Actor, LiveProvider};
use super::{Live, capped_claim, planning_gflops};
use crate::run::{Effect, JobRun, STRAGGLER_STEPS};
use crate::store::job_dir;
use crate::store::jobs::{self, JobRecord, JobStatus};
use crate::{dto, now_ms};

impl Actor {
    /// Fills running jobs' vacant stages, then starts the queued jobs that fit
    /// on the idle providers, oldest first.
    pub(super) async fn schedule(&mut self) {
        let short: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, job)| {
                job.run
                    .as_ref()
                    .is_some_and(|run| !run.vacancies().is_empty())
            })
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
            if self.run_of(job.id).is_none() {
                self.try_start(job).await;
            }
        }
    }

    /// Plans the queued `job` onto the idle providers it is not banned from
    /// and starts it; or says what it waits for. Its model is read off the
    /// task the first time (and its run is built off the task), so a large
    /// job never holds up the coordinator.
    async fn try_start(&mut self, job: JobRecord) {
        let entry = self.jobs.entry(job.id).or_default();
        if entry.loading || entry.starting.is_some() {
            return;
        }
        let live = self.without_banned(job.id, self.snapshot()).await;
        let specs: Vec<ProviderSpec> = live.iter().filter_map(LiveProvider::candidate).collect();
        if specs.is_empty() {
            self.wait(job.id, "waiting for providers to connect".into())
                .await;
            return;
        }
        let Some(model) = self.jobs.get(&job.id).and_then(|j| j.model.as_ref()) else {
            self.read_model(job.id, job.spec_json, PathBuf::from(&job.dir));
            return;
        };
        let mut options = plan_options(&model.spec);
        if let Some(clusters) = model.resume_clusters {
            // The data's sharding depends on the cluster count, so a resumed
            // job keeps it; the stages may be cut differently.
            options.clusters = ClusterCount::Fixed(clusters);
        }
        let plan = match rookery_plan::clusterize(&model.graph, &specs, &options) {
            Ok(plan) => plan,
            Err(error) => {
                self.wait(job.id, format!("waiting for providers: {error}"))
                    .await;
                return;
            }
        };
        self.start(job, plan, live);
    }

    /// Starts `job` on `plan`: its providers are taken at once (no other job
    /// is planned onto them), and its run is built off the task; the rest
    /// happens in [`Actor::started`].
    fn start(&mut self, job: JobRecord, plan: Plan, live: Vec<LiveProvider>) {
        let job_id = job.id;
        let Some(model) = self.jobs.get_mut(&job_id).and_then(|j| j.model.take()) else {
            return;
        };
        let who = by_plan_id(live);
        let ids: HashMap<String, u64> = who
            .iter()
            .map(|(key, (id, _))| (key.clone(), *id))
            .collect();
        let view = dto::plan_view(&plan, &model.graph, &who);
        for (c, cluster) in view.clusters.iter().enumerate() {
            for (s, stage) in cluster.stages.iter().enumerate() {
                if let Some(live) = self.providers.get_mut(&stage.provider) {
                    live.job = Some(job_id);
                    live.work = Some(ProviderWork {
                        job_id,
                        cluster: c as u32,
                        stage: s as u32,
                        role: stage.role.clone(),
                        micro_batches_done: 0,
                    });
                }
            }
        }
        let entry = self.jobs.entry(job_id).or_default();
        entry.owner = job.owner;
        // Each stage carries its cluster's micro-batches every step.
        entry.micro_batches = model.spec.training.micro_batches.max(1) as u64;
        entry.starting = Some(view);
        entry.waiting = None;
        tracing::info!(
            job = job_id,
            clusters = plan.clusters.len(),
            "job planned; reading its data and initialising its parameters"
        );
        drop(model);
        self.build_run(RunRecipe {
            job_id,
            spec_json: job.spec_json,
            dir: PathBuf::from(&job.dir),
            job_dir: job_dir(&self.data_dir, job_id),
            plan,
            ids,
        });
    }

    /// The run of a job started by [`Actor::start`] is built (or cannot be):
    /// the plan and the assignments are recorded and the run's first frames
    /// go out. A job cancelled meanwhile is dropped; a provider that left
    /// meanwhile leaves its stage vacant, as if it had left just now.
    pub(super) async fn started(
        &mut self,
        job_id: u64,
        started: Result<Box<(JobRun, Vec<Effect>)>, String>,
    ) {
        let Some(view) = self.jobs.get_mut(&job_id).and_then(|j| j.starting.take()) else {
            return;
        };
        let (run, effects) = match started {
            Ok(started) => *started,
            Err(reason) => return self.fail(job_id, reason).await,
        };
        let plan_json = serde_json::to_string(&view).unwrap_or_default();
        if let Err(error) = jobs::set_plan(&self.db, job_id, plan_json, run.total_steps()).await {
            tracing::error!(job = job_id, %error, "cannot store the plan");
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
                self.log(job_id, "stage_assigned", message).await;
            }
        }
        let detail = match run.synced_step() {
            0 => "handing stages to providers".into(),
            step => {
                format!("handing stages to providers; resuming from the checkpoint at step {step}")
            }
        };
        self.set_status(job_id, JobStatus::Planning, Some(detail))
            .await;
        tracing::info!(
            job = job_id,
            clusters = view.clusters.len(),
            steps = run.total_steps(),
            "job starts"
        );
        let gone: Vec<u64> = run
            .providers()
            .into_iter()
            .filter(|p| {
                self.providers
                    .get(p)
                    .is_none_or(|live| live.job != Some(job_id))
            })
            .collect();
        self.jobs.entry(job_id).or_default().run = Some(run);
        self.apply(job_id, effects).await;
        for provider in gone {
            self.stage_lost(job_id, provider, "it left while the job started")
                .await;
        }
    }

    pub(super) async fn wait(&mut self, job_id: u64, reason: String) {
        let job = self.jobs.entry(job_id).or_default();
        if job.waiting.as_ref() == Some(&reason) {
            return;
        }
        job.waiting = Some(reason.clone());
        match jobs::set_status(&self.db, job_id, JobStatus::Queued, Some(reason), now_ms()).await {
            Ok(_) => self.publish_job(job_id).await,
            Err(error) => tracing::error!(job = job_id, %error, "cannot record why a job waits"),
        }
    }

    /// A provider of a running job is gone: its cluster rolls back to the
    /// last checkpoint and its stage goes to a standby, or waits for one.
    /// The one entry point for every way a provider leaves a job.
    pub(super) async fn stage_lost(&mut self, job_id: u64, provider: u64, reason: &str) {
        let Some(effects) = self
            .run_mut(job_id)
            .and_then(|run| run.stage_lost(provider, reason))
        else {
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
    pub(super) async fn fill_vacancies(&mut self, job_id: u64) {
        let Some(vacancies) = self.run_of(job_id).map(JobRun::vacancies) else {
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
            let effects = match self.run_mut(job_id) {
                Some(run) => run.fill(vacancy.cluster, vacancy.stage, id),
                None => return,
            };
            self.apply(job_id, effects).await;
        }
        let detail = (!waiting.is_empty())
            .then(|| format!("waiting for a provider for {}", waiting.join("; ")));
        // A job that failed while its stages were handed out is gone.
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return;
        };
        if job.short != detail {
            job.short = detail.clone();
            if let Some(detail) = &detail {
                self.log(job_id, "waiting", detail.clone()).await;
            }
            self.set_status(job_id, JobStatus::Running, detail).await;
        }
    }

    /// The idle provider with the most GFLOP/s and at least `memory_bytes`.
    pub(super) fn standby(&self, job_id: u64, memory_bytes: u64) -> Option<u64> {
        let bans = self
            .jobs
            .get(&job_id)
            .map_or(&[][..], |job| job.bans.as_slice());
        self.snapshot()
            .iter()
            .filter(|p| !is_banned(bans, p))
            .filter_map(|p| p.candidate().map(|spec| (p.id, spec)))
            .filter(|(_, spec)| spec.memory_bytes >= memory_bytes)
            .max_by(|a, b| a.1.gflops.total_cmp(&b.1.gflops))
            .map(|(id, _)| id)
    }

    /// Marks `provider` as running stage `stage` of cluster `cluster`.
    pub(super) fn take(&mut self, job_id: u64, provider: u64, cluster: usize, stage: usize) {
        let stages = self
            .run_of(job_id)
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
    pub(super) async fn replace_stragglers(&mut self, job_id: u64) {
        let Some(stragglers) = self.run_of(job_id).map(JobRun::stragglers) else {
            return;
        };
        for straggler in stragglers {
            let speed =
                |p: &Live| planning_gflops(capped_claim(&p.hello), self.measured(p.identity));
            let slow_gflops: f64 = self.providers.get(&straggler.provider).map_or(0.0, speed);
            let Some(id) = self.standby(job_id, straggler.memory_bytes) else {
                continue;
            };
            // A standby may have only its claim to show: at the job's typical
            // ratio of measured to planned time, its claimed GFLOP/s must
            // promise at least twice the straggler's measured speed.
            let faster = self.providers.get(&id).is_some_and(|p| {
                straggler.slowness * speed(p) >= 2.0 * slow_gflops.max(f64::MIN_POSITIVE)
            });
            if !faster {
                continue;
            }
            let why = format!(
                "{:.1} times slower than the job's typical stage for {} steps",
                straggler.slowness, STRAGGLER_STEPS
            );
            if let Some(live) = self.providers.get_mut(&straggler.provider) {
                live.job = None;
                live.work = None;
            }
            self.take(job_id, id, straggler.cluster, straggler.stage);
            let effects = match self.run_mut(job_id) {
                Some(run) => run.replace(straggler.cluster, straggler.stage, id, &why),
                None => return,
            };
            self.apply(job_id, effects).await;
        }
    }
}

/// Connected providers by the ids plans name them with.
pub fn by_plan_id(live: Vec<LiveProvider>) -> HashMap<String, (u64, Hello)> {
    live.into_iter()
        .map(|p| (p.id.to_string(), (p.id, p.hello)))
        .collect()
}

/// The planner's knobs for a job: its micro-batch, cluster count, optimizer
/// memory and the schedule's in-flight micro-batches (`async` keeps two
/// forward copies of the weights beside the master ones and may hold two
/// steps' micro-batches).
pub fn plan_options(spec: &JobSpec) -> PlanOptions {
    let t = &spec.training;
    PlanOptions {
        micro_batch: spec.micro_batch_size().max(1),
        clusters: t.clusters,
        optimizer_copies: match t.optimizer {
            OptimizerConfig::Sgd { momentum: 0.0, .. } => 0,
            OptimizerConfig::Sgd { .. } | OptimizerConfig::RmsProp { .. } => 1,
            _ => 2,
        } + t.schedule.extra_weight_copies(),
        in_flight_micro_batches: t.schedule.steps_in_flight() * t.micro_batches.max(1) as u32,
        stages_per_cluster: t.stages,
        ..PlanOptions::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A job of 2 micro-batches a step with plain SGD (no optimizer state)
    /// and `training` added.
    fn spec(training: &str) -> JobSpec {
        let dir = tempfile::tempdir().unwrap();
        for file in ["model.toml", "x.npy", "y.npy"] {
            std::fs::write(dir.path().join(file), b"").unwrap();
        }
        let text = format!(
            "[model]\nspec = \"model.toml\"\ninput_shape = [4]\n\
             [data]\nformat = \"npy\"\ntrain_inputs = \"x.npy\"\ntrain_labels = \"y.npy\"\n\
             [training]\nepochs = 1\nbatch_size = 8\nmicro_batches = 2\n\
             optimizer = {{ name = \"sgd\", lr = 0.1 }}\n{training}\n"
        );
        JobSpec::from_toml(&text, dir.path()).unwrap()
    }

    #[test]
    fn async_plans_room_for_two_more_copies_of_the_weights_and_two_steps_of_micro_batches() {
        let gpipe = plan_options(&spec(""));
        let overlapped = plan_options(&spec("schedule = \"async\""));
        assert_eq!(
            (gpipe.optimizer_copies, gpipe.in_flight_micro_batches),
            (0, 2)
        );
        assert_eq!(
            (
                overlapped.optimizer_copies,
                overlapped.in_flight_micro_batches
            ),
            (2, 4)
        );
    }
}
