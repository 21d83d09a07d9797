//! Running a run's spot checks ([`crate::run::Verification`]): an idle
//! trusted provider takes the checked stage as of the checkpoint, gets the
//! same `Forward` (and a Stem the same `Backward`), and its results are
//! compared with the checked provider's, forward first, then the input
//! gradients. A disagreement is a fault of the checked provider (three ban
//! it), unless it is trusted too: two vouched-for providers that disagree
//! are logged, nobody is blamed.
//!
//! Trusted means native and vouched for ([`trusted_for`]): started with the
//! token of the job's Requester, or of the operator (the data dir's first
//! Requester), and never the checked provider's identity, banned from the
//! job or with a fault on it. A stranger's word never convicts another
//! stranger, so without a trusted provider idle, checks are skipped (and
//! the job's log says how to add one). Tapped messages (the checked
//! micro-batch's tensors, which stream through the coordinator) are put
//! together here as well.

use std::time::Instant;

use rookery_proto::api::ProviderWork;
use rookery_proto::stream::{self, Assembler, Incoming, Payload};
use rookery_proto::{ProviderKind, ToProvider, ToServer, WireTensor};

use super::faults::is_banned;
use super::{Actor, Route};
use crate::run::{
    Outcome, TapSide, VERIFY_TOLERANCE, Verification, disagreement, tensors_disagreement,
};
use crate::store::requesters::{self, Requester};

/// A copy of one streamed message being put together.
pub(super) struct Capture {
    assembler: Assembler<ToServer>,
    sink: CaptureFor,
}

/// Who gets a captured message.
pub(super) enum CaptureFor {
    /// The job's run: the checks it tapped the message for.
    Run {
        job_id: u64,
        taps: Vec<(u64, TapSide)>,
    },
    /// The verifier's own answer.
    Verifier(u64),
}

impl Capture {
    /// Starts a copy of `header`, whose tensors follow (`owed` bytes).
    pub(super) fn new(header: ToServer, owed: usize, sink: CaptureFor) -> Option<Self> {
        let mut assembler = Assembler::new(owed);
        match assembler.push(Incoming::Message(header)) {
            Ok(None) => Some(Self { assembler, sink }),
            _ => None,
        }
    }
}

/// Checks a job keeps for its busy verifiers at most; more are skipped.
pub(super) const QUEUED_CHECKS: usize = 8;

/// A verifier at work.
pub(super) struct Verifying {
    job_id: u64,
    check: Box<Verification>,
    started: Instant,
    /// The checked provider is trusted as well: a disagreement blames nobody.
    checked_trusted: bool,
    /// How far the forward results differ, once compared and within the
    /// tolerance: the check goes on to the backward.
    forward: Option<f64>,
}

/// How far a verifier's results are from the checked provider's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Verdict {
    forward: f64,
    /// The input gradients' difference, for a stage whose backward is checked.
    backward: Option<f64>,
}

/// Whether a provider vouched for by `by` may verify a job of `owner`:
/// native providers only carry a vouch ([`crate::http`] refuses it from a
/// browser), and the operator's vouches for every job.
pub fn trusted_for(by: Option<&Requester>, owner: Option<u64>) -> bool {
    by.is_some_and(|r| r.name == requesters::FIRST || Some(r.id) == owner)
}

/// A job's spot checks so far, for its log at the end.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    pub run: u64,
    pub disagreed: u64,
    pub skipped: u64,
    pub verifier_ms: f64,
}

impl Actor {
    /// Hands `check` to the best idle verifier; or queues it while one of
    /// the job's verifiers is busy (a step's checks come together), up to
    /// [`QUEUED_CHECKS`]; or skips it (logged once).
    pub(super) async fn start_verification(&mut self, job_id: u64, check: Box<Verification>) {
        let checked = self.providers.get(&check.provider);
        let checked_identity = checked.map(|p| p.identity);
        let job = self.jobs.entry(job_id).or_default();
        let (bans, faults, owner) = (job.bans.clone(), job.faults.clone(), job.owner);
        let checked_trusted = checked.is_some_and(|p| trusted_for(p.vouched_by.as_ref(), owner));
        let verifier = self
            .snapshot()
            .into_iter()
            .filter(|p| {
                p.hello.kind == ProviderKind::Native && Some(p.identity) != checked_identity
            })
            .filter(|p| trusted_for(p.vouched_by.as_ref(), owner))
            .filter(|p| !is_banned(&bans, p) && faults.get(&p.identity).is_none_or(|n| *n == 0))
            .filter_map(|p| p.candidate().map(|spec| (p.id, spec)))
            .filter(|(_, spec)| spec.memory_bytes >= check.memory_bytes)
            .max_by(|a, b| a.1.gflops.total_cmp(&b.1.gflops))
            .map(|(id, _)| id);
        let Some(verifier) = verifier else {
            let busy = self.verifying.values().any(|v| v.job_id == job_id);
            let job = self.jobs.entry(job_id).or_default();
            if busy && job.queued_checks.len() < QUEUED_CHECKS {
                job.queued_checks.push_back(check);
                return;
            }
            let tally = &mut job.spot_checks;
            tally.skipped += 1;
            if tally.skipped == 1 {
                self.log(
                    job_id,
                    "spot_check",
                    "a spot check was skipped: no trusted provider is idle to re-run it (start a \
                     native one with `rookery-provider --requester-token` and this job's Requester's \
                     or the operator's token); later ones are counted"
                        .into(),
                )
                .await;
            }
            return;
        };
        if let Some(live) = self.providers.get_mut(&verifier) {
            live.job = Some(job_id);
            live.work = Some(ProviderWork {
                job_id,
                cluster: check.cluster as u32,
                stage: check.stage as u32,
                role: "verifier".into(),
                micro_batches_done: 0,
            });
        }
        let assign = ToProvider::Assign(Box::new(check.assignment.clone()));
        self.verifying.insert(
            verifier,
            Verifying {
                job_id,
                check,
                started: Instant::now(),
                checked_trusted,
                forward: None,
            },
        );
        self.send(verifier, assign);
    }

    /// A message from a provider re-running a check.
    pub(super) async fn on_verifier_message(&mut self, id: u64, message: ToServer) {
        let owed: usize = stream::following(&message).iter().sum();
        match message {
            ToServer::Ready { .. } => {
                if let Some(v) = self.verifying.get(&id) {
                    let forward = ToProvider::Forward(v.check.forward.clone());
                    self.send(id, forward);
                }
            }
            header @ ToServer::Activations(_) if owed > 0 => {
                let capture = Capture::new(header, owed, CaptureFor::Verifier(id));
                self.route(id, owed, capture);
            }
            header @ ToServer::Gradients(_) if owed > 0 => {
                let capture = Capture::new(header, owed, CaptureFor::Verifier(id));
                self.route(id, owed, capture);
            }
            ToServer::Activations(a) => {
                self.verifier_result(id, Outcome::Activations(a.outputs))
                    .await
            }
            ToServer::LeafLoss(l) => self.verifier_result(id, Outcome::Loss(l.loss_sum)).await,
            ToServer::Gradients(g) => self.verifier_gradients(id, g.grads).await,
            ToServer::JobFailed { message, .. } => self.finish_verification(id, Err(message)).await,
            _ => self.route(id, owed, None),
        }
    }

    /// Sends the payload frames `owed` after a message from `id` nowhere,
    /// copying them into `capture` if there is one.
    pub(super) fn route(&mut self, id: u64, owed: usize, capture: Option<Capture>) {
        if owed > 0
            && let Some(live) = self.providers.get_mut(&id)
        {
            live.routes.push_back(Route {
                to: None,
                left: owed,
                capture,
            });
        }
    }

    /// A captured message is whole.
    pub(super) async fn captured(&mut self, sink: CaptureFor, message: ToServer) {
        let (tensors, gradients) = match message {
            ToServer::Activations(a) => (a.outputs, false),
            ToServer::Gradients(g) => (g.grads, true),
            _ => return,
        };
        match sink {
            CaptureFor::Run { job_id, taps } => {
                let mut effects = Vec::new();
                if let Some(run) = self.run_mut(job_id) {
                    for (key, side) in taps {
                        effects.extend(run.on_tapped(key, side, tensors.clone()));
                    }
                }
                Box::pin(self.apply(job_id, effects)).await;
            }
            CaptureFor::Verifier(id) if gradients => self.verifier_gradients(id, tensors).await,
            CaptureFor::Verifier(id) => {
                self.verifier_result(id, Outcome::Activations(tensors))
                    .await;
            }
        }
    }

    /// The verifier `id`'s forward result: compared, and if it agrees the
    /// check goes on to the backward (a Stem is sent the same `Backward`; a
    /// Leaf's gradients follow its loss by themselves), or ends.
    async fn verifier_result(&mut self, id: u64, got: Outcome) {
        let Some(v) = self.verifying.get_mut(&id) else {
            return;
        };
        let forward = match disagreement(&v.check.expected, &got) {
            Ok(d) => d,
            Err(problem) => return self.finish_verification(id, Err(problem)).await,
        };
        if forward > VERIFY_TOLERANCE || v.check.expected_grads.is_none() {
            let verdict = Verdict {
                forward,
                backward: None,
            };
            return self.finish_verification(id, Ok(verdict)).await;
        }
        v.forward = Some(forward);
        if let Some(backward) = v.check.backward.clone() {
            self.send(id, ToProvider::Backward(backward));
        }
    }

    /// The verifier `id`'s input gradients.
    async fn verifier_gradients(&mut self, id: u64, got: Vec<WireTensor>) {
        let Some(v) = self.verifying.get(&id) else {
            return;
        };
        let (Some(forward), Some(expected)) = (v.forward, v.check.expected_grads.as_ref()) else {
            let early = Err("it sent gradients before its forward result".to_string());
            return self.finish_verification(id, early).await;
        };
        let verdict = tensors_disagreement(expected, &got).map(|backward| Verdict {
            forward,
            backward: Some(backward),
        });
        self.finish_verification(id, verdict).await;
    }

    /// The verifier `id` answered (or could not): it is released, and the
    /// checked provider's results compared with its.
    pub(super) async fn finish_verification(&mut self, id: u64, got: Result<Verdict, String>) {
        let Some(v) = self.verifying.remove(&id) else {
            return;
        };
        let job_id = v.job_id;
        self.send(id, ToProvider::Release { job_id });
        if let Some(live) = self.providers.get_mut(&id) {
            live.job = None;
            live.work = None;
        }
        self.judge(id, v, got).await;
        // The next queued check whose provider still works on the job (one
        // dropped meanwhile, banned perhaps, is past checking).
        while let Some(next) = self
            .jobs
            .get_mut(&job_id)
            .filter(|job| job.run.is_some())
            .and_then(|job| job.queued_checks.pop_front())
        {
            if self.providers.get(&next.provider).and_then(|p| p.job) == Some(job_id) {
                Box::pin(self.start_verification(job_id, next)).await;
                break;
            }
        }
    }

    /// Logs what check `v`, run by verifier `id`, found, and faults the
    /// checked provider if it disagrees with a trusted one.
    async fn judge(&mut self, id: u64, v: Verifying, got: Result<Verdict, String>) {
        let job_id = v.job_id;
        let c = &v.check;
        let what = format!(
            "cluster {}, stage {}, step {}, micro-batch {} (provider {})",
            c.cluster, c.stage, c.step, c.micro, c.provider
        );
        let tally = &mut self.jobs.entry(job_id).or_default().spot_checks;
        tally.verifier_ms += v.started.elapsed().as_secs_f64() * 1e3;
        let worst = |v: &Verdict| v.forward.max(v.backward.unwrap_or(0.0));
        match got {
            Ok(verdict) if worst(&verdict) <= VERIFY_TOLERANCE => {
                tally.run += 1;
                let backward = verdict
                    .backward
                    .map_or(String::new(), |b| format!(", input gradients {b:.1e}"));
                let message = format!(
                    "spot check of {what}: provider {id}'s re-run agrees (relative difference {:.1e}{backward})",
                    verdict.forward
                );
                self.log(job_id, "spot_check", message).await;
            }
            Ok(verdict) => {
                tally.run += 1;
                tally.disagreed += 1;
                let (which, d) = match verdict.backward {
                    Some(b) if verdict.forward <= VERIFY_TOLERANCE => {
                        ("its input gradients differ", b)
                    }
                    _ => ("its result differs", verdict.forward),
                };
                let reason = format!(
                    "spot check of {what}: {which} from provider {id}'s re-run by {d:.2e} (tolerance {VERIFY_TOLERANCE:.0e})"
                );
                if v.checked_trusted {
                    let message =
                        format!("{reason}; both providers are vouched for, so neither is blamed");
                    self.log(job_id, "spot_check", message).await;
                } else {
                    self.log(job_id, "spot_check", reason.clone()).await;
                    self.on_fault(job_id, c.provider, reason, false).await;
                }
            }
            Err(problem) => {
                let message =
                    format!("spot check of {what} not completed: provider {id}: {problem}");
                self.log(job_id, "spot_check", message).await;
            }
        }
    }

    /// What a finished job's spot checks cost and found.
    pub(super) async fn log_spot_checks(&mut self, job_id: u64) {
        let tally = self
            .jobs
            .get(&job_id)
            .map(|j| j.spot_checks)
            .unwrap_or_default();
        if tally.run + tally.skipped == 0 {
            return;
        }
        let message = format!(
            "spot checks: {} micro-batches re-run on verifiers ({:.1} s of verifier time), {} disagreed, {} skipped",
            tally.run,
            tally.verifier_ms / 1e3,
            tally.disagreed,
            tally.skipped
        );
        self.log(job_id, "spot_checks", message).await;
    }

    /// The verifiers of `job_id`, which ended, are released.
    pub(super) fn release_verifiers(&mut self, job_id: u64) {
        let ids: Vec<u64> = self
            .verifying
            .iter()
            .filter(|(_, v)| v.job_id == job_id)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.verifying.remove(&id);
            self.send(id, ToProvider::Release { job_id });
        }
    }

    /// A payload frame for a capture on `id`'s current route: the whole
    /// message once it is complete.
    pub(super) fn capture_payload(
        capture: &mut Option<Capture>,
        payload: &Payload,
    ) -> Option<(CaptureFor, ToServer)> {
        let c = capture.as_mut()?;
        match c.assembler.push(Incoming::Payload(payload.clone())) {
            Ok(None) => None,
            Ok(Some(message)) => capture.take().map(|c| (c.sink, message)),
            Err(error) => {
                tracing::warn!(%error, "a tapped message did not fit together");
                *capture = None;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_jobs_requester_or_the_operator_vouches_for_a_verifier() {
        let requester = |id, name: &str| Requester {
            id,
            name: name.into(),
        };
        let operator = requester(1, requesters::FIRST);
        let alice = requester(2, "alice");
        // (vouched by, the job's owner, trusted)
        let cases = [
            (None, Some(2), false),
            (Some(&alice), Some(2), true),
            (Some(&alice), Some(3), false),
            (Some(&alice), None, false),
            (Some(&operator), Some(3), true),
            (Some(&operator), None, true),
        ];
        for (by, owner, trusted) in cases {
            assert_eq!(trusted_for(by, owner), trusted, "{by:?} for {owner:?}");
        }
    }
}
