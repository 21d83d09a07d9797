//! The coordinator task: its loop, and what each event does to the live
//! providers and the jobs.

use std::collections::VecDeque;

use rookery_proto::stream::{self, Payload};
use tokio::sync::mpsc;

use super::verify::{Capture, CaptureFor};
use super::{Actor, Event, JobEntry, Live, LiveProvider, Outgoing, Route, SCHEDULE_EVERY};
use crate::run::{Effect, JobRun, TapSide};
use crate::store::jobs::JobStatus;

impl Actor {
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Event>) {
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

    pub(super) fn snapshot(&self) -> Vec<LiveProvider> {
        self.providers
            .iter()
            .map(|(id, p)| LiveProvider {
                id: *id,
                identity: p.identity,
                vouched_by: p.vouched_by.clone(),
                hello: p.hello.clone(),
                measured_gflops: self.measured(p.identity),
                work: p.work.clone(),
                bandwidth_mbps: p.bandwidth_mbps,
            })
            .collect()
    }

    /// The run of `job_id`, if it has started.
    pub(super) fn run_mut(&mut self, job_id: u64) -> Option<&mut JobRun> {
        self.jobs.get_mut(&job_id).and_then(|job| job.run.as_mut())
    }

    pub(super) fn run_of(&self, job_id: u64) -> Option<&JobRun> {
        self.jobs.get(&job_id).and_then(|job| job.run.as_ref())
    }

    async fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected {
                id,
                identity,
                vouched_by,
                hello,
                tx,
            } => {
                let message = format!(
                    "provider {id} (identity {identity}, {}, {} {}) connected",
                    hello.display_name,
                    hello.kind.as_str(),
                    hello.device
                );
                self.providers.insert(
                    id,
                    Live {
                        identity,
                        vouched_by,
                        hello,
                        tx,
                        job: None,
                        routes: VecDeque::new(),
                        bandwidth_mbps: None,
                        work: None,
                    },
                );
                let waiting: Vec<u64> = self
                    .jobs
                    .iter()
                    .filter(|(_, job)| job.waiting.is_some())
                    .map(|(id, _)| *id)
                    .collect();
                for job_id in waiting {
                    self.log(job_id, "provider_joined", message.clone()).await;
                }
            }
            Event::Disconnected { id, reason } => {
                if self.verifying.contains_key(&id) {
                    let gone = Err(format!("the verifier left ({reason})"));
                    self.finish_verification(id, gone).await;
                }
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
                if self.verifying.contains_key(&id) {
                    return self.on_verifier_message(id, message).await;
                }
                let owed: usize = stream::following(&message).iter().sum();
                let Some(job_id) = self.providers.get(&id).and_then(|p| p.job) else {
                    tracing::warn!(
                        provider = id,
                        "dropped a training frame from a provider without a job"
                    );
                    // Its tensors go nowhere, quietly.
                    self.route(id, owed, None);
                    return;
                };
                let identity = self.providers.get(&id).map_or(id, |p| p.identity);
                // A spot check may want a copy of what streams on.
                let header = (owed > 0 && self.run_of(job_id).is_some_and(JobRun::verifies))
                    .then(|| message.clone());
                let effects = match self.run_mut(job_id) {
                    Some(run) => run.on_message_from(id, identity, message),
                    None => Vec::new(),
                };
                let (taps, effects): (Vec<Effect>, Vec<Effect>) = effects
                    .into_iter()
                    .partition(|e| matches!(e, Effect::Tap { .. }));
                if owed > 0 {
                    // The relayed message is the one whose tensors still follow.
                    let to = effects.iter().find_map(|effect| match effect {
                        Effect::Send(to, m) if !stream::following(m).is_empty() => Some(*to),
                        _ => None,
                    });
                    let taps: Vec<(u64, TapSide)> = taps
                        .into_iter()
                        .filter_map(|e| match e {
                            Effect::Tap { key, side } => Some((key, side)),
                            _ => None,
                        })
                        .collect();
                    let capture = header.filter(|_| !taps.is_empty()).and_then(|header| {
                        Capture::new(header, owed, CaptureFor::Run { job_id, taps })
                    });
                    if let Some(live) = self.providers.get_mut(&id) {
                        live.routes.push_back(Route {
                            to,
                            left: owed,
                            capture,
                        });
                    }
                }
                let synced = effects.iter().any(|e| matches!(e, Effect::ResumePoint(_)));
                self.apply(job_id, effects).await;
                if synced {
                    self.replace_stragglers(job_id).await;
                }
            }
            Event::Payload { id, payload } => self.relay_payload(id, payload).await,
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
            // Plans from now on count the new cap; a stage it runs stays.
            Event::DutyCycle { id, duty_cycle } => {
                if let Some(live) = self.providers.get_mut(&id) {
                    live.hello.duty_cycle = duty_cycle;
                }
            }
            Event::Prepared { job_id, model } => {
                let job = self.jobs.entry(job_id).or_default();
                job.loading = false;
                if job.run.is_none() && job.starting.is_none() {
                    job.model = Some(*model);
                }
            }
            Event::WorkFailed { job_id, reason } => self.fail(job_id, reason).await,
            Event::Started { job_id, started } => self.started(job_id, started).await,
            Event::Aggregated { job_id, done } => {
                let effects = match self.run_mut(job_id) {
                    Some(run) => run.on_aggregated(*done),
                    None => return,
                };
                let synced = effects.iter().any(|e| matches!(e, Effect::ResumePoint(_)));
                self.apply(job_id, effects).await;
                if synced {
                    self.replace_stragglers(job_id).await;
                }
            }
            Event::WeightsWritten { job_id, written } => match written {
                Ok(()) => self.set_status(job_id, JobStatus::Completed, None).await,
                // Every retry failed: the training is not lost, the job
                // resumes from its resume file when planned again.
                Err(error) => {
                    let reason = format!(
                        "cannot write the weights ({error}); the job resumes from its last checkpoint"
                    );
                    self.log(job_id, "queued", reason.clone()).await;
                    self.set_status(job_id, JobStatus::Queued, Some(reason))
                        .await
                }
            },
            Event::Cancel { job_id } => {
                if let Some(mut run) = self.free(job_id).and_then(|job| job.run) {
                    let effects = run.release();
                    self.apply_sends(effects);
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

    /// Passes a payload frame on along its message's route.
    pub(super) async fn relay_payload(&mut self, id: u64, payload: Payload) {
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
        let captured = Self::capture_payload(&mut route.capture, &payload);
        route.left = route.left.saturating_sub(payload.data().len());
        if route.left == 0 {
            live.routes.pop_front();
        }
        if let Some(to) = to {
            self.send_frame(to, Outgoing::Payload(payload.frame()));
        }
        if let Some((sink, message)) = captured {
            self.captured(sink, message).await;
        }
    }

    /// Forgets a job that left (completed, failed or cancelled): its entry
    /// goes and its providers are idle again. Returns what was kept of it.
    pub(super) fn free(&mut self, job_id: u64) -> Option<JobEntry> {
        self.release_verifiers(job_id);
        for live in self.providers.values_mut() {
            if live.job == Some(job_id) {
                live.job = None;
                live.work = None;
            }
        }
        self.jobs.remove(&job_id)
    }
}
