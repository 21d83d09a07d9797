//! Credit for accepted work ([`crate::store::credit`]). A stage's work on a
//! step is counted when its cluster finishes the step, accepted when a
//! checkpoint holds that step (work after the last one may be rolled back
//! and redone), and written to the database at most every
//! [`CREDIT_WRITE_EVERY_MS`] and when the job completes; each identity's
//! connected providers are then told their new total. A ban takes back
//! everything the identity earned on the job, written or not.

use std::collections::HashMap;

use rookery_proto::ToProvider;

use super::Actor;
use crate::now_ms;
use crate::store::credit;

/// Credit is written at most this often per job.
pub(super) const CREDIT_WRITE_EVERY_MS: u64 = 2_000;

/// A job's credit not yet in the database, GFLOP by identity.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// Counted since the last checkpoint.
    counted: HashMap<u64, f64>,
    /// Accepted by a checkpoint, to be written.
    accepted: HashMap<u64, f64>,
    written_ms: u64,
}

impl Actor {
    /// `provider`'s stage of `job_id` finished a step worth `gflop`.
    pub(super) fn worked(&mut self, job_id: u64, provider: u64, gflop: f64) {
        let Some(identity) = self.providers.get(&provider).map(|p| p.identity) else {
            return;
        };
        if let Some(job) = self.jobs.get_mut(&job_id) {
            *job.credit.counted.entry(identity).or_default() += gflop;
        }
    }

    /// A checkpoint (or the job's completion, `done`) holds the work
    /// counted so far: it is accepted, and written if it is time.
    pub(super) async fn accept_work(&mut self, job_id: u64, done: bool) {
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return;
        };
        let pending = &mut job.credit;
        for (identity, gflop) in pending.counted.drain() {
            *pending.accepted.entry(identity).or_default() += gflop;
        }
        let now = now_ms();
        if pending.accepted.is_empty()
            || (!done && now < pending.written_ms + CREDIT_WRITE_EVERY_MS)
        {
            return;
        }
        pending.written_ms = now;
        let work: Vec<(u64, f64)> = pending.accepted.drain().collect();
        let identities: Vec<u64> = work.iter().map(|(identity, _)| *identity).collect();
        if let Err(error) = credit::add(&self.db, job_id, work).await {
            tracing::error!(job = job_id, %error, "cannot record credit");
            return;
        }
        for identity in identities {
            let gflop = match credit::total(&self.db, identity).await {
                Ok(gflop) => gflop,
                Err(error) => {
                    tracing::error!(identity, %error, "cannot read credit");
                    continue;
                }
            };
            let ids: Vec<u64> = self
                .providers
                .iter()
                .filter(|(_, p)| p.identity == identity)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                self.send(id, ToProvider::Credit { gflop });
            }
        }
    }

    /// `identity` is banned from `job_id`: its credit for the job is taken
    /// back, written or not.
    pub(super) async fn withdraw_credit(&mut self, job_id: u64, identity: u64) {
        let mut gflop = 0.0;
        if let Some(job) = self.jobs.get_mut(&job_id) {
            gflop += job.credit.counted.remove(&identity).unwrap_or(0.0);
            gflop += job.credit.accepted.remove(&identity).unwrap_or(0.0);
        }
        match credit::withdraw(&self.db, job_id, identity).await {
            Ok(written) => gflop += written,
            Err(error) => tracing::error!(job = job_id, identity, %error, "cannot withdraw credit"),
        }
        if gflop > 0.0 {
            let message = format!(
                "identity {identity}'s credit for this job ({gflop:.1} GFLOP) is withdrawn"
            );
            self.log(job_id, "credit_withdrawn", message).await;
        }
    }
}
