//! Carrying out a run's effects: frames to providers first, then the
//! bookkeeping (database rows, checkpoint and resume files, the job's log and
//! status) and the live events that tell the dashboard.

use rookery_proto::ToProvider;
use rookery_proto::api::{JobEvent, JobEventBody};

use super::{Actor, Outgoing, SYNC_LOG_EVERY_MS};
use crate::run::Effect;
use crate::store::checkpoints::{CheckpointWriter, ResumeWriter, checkpoint_path};
use crate::store::job_dir;
use crate::store::jobs::{self, JobStatus};
use crate::{dto, now_ms};

impl Actor {
    pub(super) async fn apply(&mut self, job_id: u64, effects: Vec<Effect>) {
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
                    let per_step = self
                        .jobs
                        .get(&job_id)
                        .map_or(1, |job| job.micro_batches.max(1));
                    for stage in &record.stages {
                        if let Some(work) = self
                            .providers
                            .get_mut(&stage.provider)
                            .and_then(|live| live.work.as_mut())
                        {
                            work.micro_batches_done += per_step;
                        }
                    }
                    let metric = dto::step_metric(record.clone());
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
                        "epoch {} evaluated after step {} on {} test samples: loss {:.4}, accuracy {:.2}%",
                        record.epoch,
                        record.step,
                        record.samples,
                        record.test_loss,
                        record.test_accuracy * 100.0
                    );
                    self.publish(
                        job_id,
                        JobEventBody::Epoch {
                            epoch: dto::epoch_metric(&record),
                        },
                    );
                    self.log(job_id, "epoch", message).await;
                }
                Effect::Checkpoint(weights) => {
                    let path = checkpoint_path(&self.data_dir, job_id);
                    self.jobs
                        .entry(job_id)
                        .or_default()
                        .checkpoint
                        .get_or_insert_with(|| CheckpointWriter::checkpoint(job_id, path))
                        .save(weights);
                    self.log_sync(job_id).await;
                }
                Effect::ResumePoint(point) => {
                    self.accept_work(job_id, false).await;
                    // Shares the run's buffers; the writer writes the newest
                    // it holds, at most every few seconds.
                    let dir = job_dir(&self.data_dir, job_id);
                    self.jobs
                        .entry(job_id)
                        .or_default()
                        .resume
                        .get_or_insert_with(|| ResumeWriter::resume(job_id, dir))
                        .save(*point);
                }
                Effect::Aggregate(work) => self.aggregate(job_id, work),
                Effect::Log { kind, message } => self.log(job_id, kind, message).await,
                Effect::Completed(weights) => {
                    self.log_spot_checks(job_id).await;
                    self.accept_work(job_id, true).await;
                    // The run and its data go now; the job is complete once
                    // its weights are on disk.
                    self.free(job_id);
                    self.write_weights(job_id, weights);
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
                Effect::Measured {
                    provider,
                    work_gflop,
                    busy_ms,
                    bytes,
                } => {
                    self.on_measured(job_id, provider, work_gflop, busy_ms, bytes)
                        .await
                }
                // Taken with the message they tap, before effects apply.
                Effect::Tap { .. } => {}
                Effect::Verify(check) => self.start_verification(job_id, check).await,
                Effect::Worked { provider, gflop } => self.worked(job_id, provider, gflop),
            }
        }
    }

    pub(super) fn apply_sends(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            if let Effect::Send(provider, message) = effect {
                self.send(provider, message);
            }
        }
    }

    pub(super) fn send(&self, provider: u64, message: ToProvider) {
        self.send_frame(provider, Outgoing::Message(message));
    }

    pub(super) fn send_frame(&self, provider: u64, frame: Outgoing) {
        match self.providers.get(&provider) {
            Some(live) => {
                // An overflowing outbox ends its connection; the stage is
                // lost when the connection's end is reported.
                if let Err(overflow) = live.tx.send(frame) {
                    tracing::warn!(provider, %overflow, "a provider's outbox overflowed");
                }
            }
            None => tracing::warn!(provider, "no connection to send a frame to"),
        }
    }

    pub(super) async fn fail(&mut self, job_id: u64, reason: String) {
        tracing::warn!(job = job_id, %reason, "job failed");
        if let Some(mut run) = self.free(job_id).and_then(|job| job.run) {
            let effects = run.release();
            self.apply_sends(effects);
        }
        self.set_status(job_id, JobStatus::Failed, Some(reason))
            .await;
    }

    pub(super) async fn set_status(&self, job_id: u64, status: JobStatus, detail: Option<String>) {
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

    pub(super) fn publish(&self, job_id: u64, body: JobEventBody) {
        // No subscriber is no error: nobody has the dashboard open.
        let _ = self.events.send(JobEvent { job_id, body });
    }

    /// Sends the job's whole row to live subscribers.
    pub(super) async fn publish_job(&self, job_id: u64) {
        match jobs::get(&self.db, job_id).await {
            Ok(Some(record)) => self.publish(
                job_id,
                JobEventBody::Job {
                    job: dto::job_info(record),
                },
            ),
            Ok(None) => {}
            Err(error) => tracing::error!(job = job_id, %error, "cannot read a job to publish it"),
        }
    }

    /// Writes a line to the job's log and sends it to live subscribers.
    pub(super) async fn log(&self, job_id: u64, kind: &str, message: String) {
        super::work::log_to(&self.db, &self.events, job_id, kind, message).await;
    }

    /// A sync averaged the clusters' parameters and wrote the checkpoint.
    pub(super) async fn log_sync(&mut self, job_id: u64) {
        let now = now_ms();
        let (last, count) = &mut self.jobs.entry(job_id).or_default().sync_log;
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
