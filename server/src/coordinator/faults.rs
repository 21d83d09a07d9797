//! Fault and ban policy: wrong data from a provider counts against it on
//! that job; a dropped frame also drops it from the job, and the
//! [`BAN_AFTER_FAULTS`]th fault bans it from the job for good.

use super::{Actor, LiveProvider, Outgoing};
use crate::now_ms;
use crate::store::identities;
use crate::store::jobs::{self, Ban};

/// Faults a provider may commit on one job; the last of them bans it from the job.
pub const BAN_AFTER_FAULTS: u32 = 3;

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

/// Whether `provider` is one of `bans`: the same identity (whatever its
/// connection or name), or for a ban from before identities, the same
/// connection. Names are chosen by providers and decide nothing.
pub fn is_banned(bans: &[Ban], provider: &LiveProvider) -> bool {
    bans.iter().any(|b| match b.identity {
        Some(identity) => identity == provider.identity,
        None => b.provider_id == provider.id,
    })
}

impl Actor {
    /// Counts a fault against `provider` on `job_id`. The last allowed fault
    /// bans it from the job: recorded, logged, dropped, never planned onto the
    /// job again. Before that, a fault whose frame was dropped also drops the
    /// provider (`drop_now`): its stage cannot finish the step without the
    /// frame, so the stage is lost; a fault the job absorbed (far-off
    /// parameters that robust aggregation outvoted) only counts.
    pub(super) async fn on_fault(
        &mut self,
        job_id: u64,
        provider: u64,
        reason: String,
        drop_now: bool,
    ) {
        let Some(live) = self.providers.get(&provider) else {
            return;
        };
        let (identity, name) = (live.identity, live.hello.display_name.clone());
        let count = self
            .jobs
            .entry(job_id)
            .or_default()
            .faults
            .entry(identity)
            .or_insert(0);
        *count += 1;
        let count = *count;
        tracing::warn!(job = job_id, provider, identity, %name, count, %reason, "provider fault");
        if let Err(error) = identities::record_fault(&self.db, identity).await {
            tracing::error!(identity, %error, "cannot count a fault against an identity");
        }
        self.log(
            job_id,
            "provider_fault",
            format!(
                "provider {provider} (identity {identity}, {name}) fault {count} of \
                 {BAN_AFTER_FAULTS}: {reason}"
            ),
        )
        .await;
        let close = match fault_action(count, drop_now) {
            FaultAction::Count => return,
            FaultAction::Drop => format!("dropped from job {job_id}: {reason}"),
            FaultAction::Ban => {
                let ban = Ban {
                    provider_id: provider,
                    identity: Some(identity),
                    provider_name: name,
                    at_ms: now_ms(),
                    reason: reason.clone(),
                };
                self.jobs.entry(job_id).or_default().bans.push(ban.clone());
                self.withdraw_credit(job_id, identity).await;
                if let Err(error) = jobs::ban(&self.db, job_id, ban).await {
                    tracing::error!(job = job_id, provider, %error, "cannot record a ban");
                }
                self.log(
                    job_id,
                    "provider_banned",
                    format!("provider {provider} (identity {identity}) banned: {reason}"),
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
    pub(super) async fn without_banned(
        &mut self,
        job_id: u64,
        live: Vec<LiveProvider>,
    ) -> Vec<LiveProvider> {
        let bans = match jobs::bans(&self.db, job_id).await {
            Ok(bans) => bans,
            Err(error) => {
                tracing::error!(job = job_id, %error, "cannot read a job's bans");
                return Vec::new();
            }
        };
        let live = live.into_iter().filter(|p| !is_banned(&bans, p)).collect();
        self.jobs.entry(job_id).or_default().bans = bans;
        live
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::Hello;

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
    fn a_ban_follows_the_identity_whatever_its_name_or_connection() {
        let hello = |name: &str| Hello {
            protocol_version: rookery_proto::PROTOCOL_VERSION,
            kind: rookery_proto::ProviderKind::Native,
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            gflops: 1.0,
            display_name: name.into(),
            max_buffer_bytes: None,
            credential: None,
            requester_token: None,
            donor: None,
            duty_cycle: 1.0,
        };
        let live = |id, identity, name| LiveProvider {
            id,
            identity,
            vouched_by: None,
            hello: hello(name),
            measured_gflops: None,
            work: None,
            bandwidth_mbps: Some(100.0),
        };
        let bans = [
            Ban {
                provider_id: 4,
                identity: Some(40),
                provider_name: "liar".into(),
                at_ms: 0,
                reason: "NaN".into(),
            },
            // From before identities: only that connection.
            Ban {
                provider_id: 6,
                identity: None,
                provider_name: "old".into(),
                at_ms: 0,
                reason: "NaN".into(),
            },
        ];
        // (provider, banned)
        let cases = [
            // The banned identity reconnecting under another name.
            (live(9, 40, "renamed"), true),
            // Another identity taking the banned one's name is not banned.
            (live(5, 50, "liar"), false),
            (live(4, 51, "honest"), false),
            (live(6, 60, "new"), true),
            (live(7, 70, "old"), false),
        ];
        for (p, want) in cases {
            assert_eq!(is_banned(&bans, &p), want, "{p:?}");
        }
    }
}
