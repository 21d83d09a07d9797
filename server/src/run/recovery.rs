//! Recovery: a stage whose provider left puts its cluster back to the last
//! checkpoint, where it waits for a replacement; once every stage has a
//! provider again the cluster is rebuilt and replays the steps since.

use super::{Effect, JobRun, State};

/// A stage without a provider, and what a replacement must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vacancy {
    pub cluster: usize,
    pub stage: usize,
    /// The planner's memory estimate for the stage.
    pub memory_bytes: u64,
}

impl JobRun {
    /// The provider of a stage is gone (its socket closed, it stopped
    /// heartbeating, or it was dropped for misbehaving): its cluster rolls
    /// back to the last checkpoint and waits for [`JobRun::fill`]; the other
    /// clusters train on to the next barrier. Returns `None` if the provider
    /// runs no stage of this job.
    pub fn stage_lost(&mut self, provider: u64, reason: &str) -> Option<Vec<Effect>> {
        let (c, s) = self.locate(provider)?;
        if self.state == State::Over {
            return Some(Vec::new());
        }
        self.clusters[c].stages[s].vacant = true;
        let mut effects = vec![Effect::Log {
            kind: "stage_lost",
            message: format!(
                "cluster {c}, stage {s}: provider {provider} left ({reason}); the cluster rolls back to step {} (the last checkpoint)",
                self.synced
            ),
        }];
        if matches!(self.state, State::Syncing { .. }) || self.background_sync.is_some() {
            // The sync needs this cluster's values at the barrier, which it must
            // replay to reach again; every cluster uploads afresh then.
            self.abandon_sync();
        }
        effects.extend(self.rebuild(c));
        Some(effects)
    }

    /// Stages in cluster `c`.
    pub fn stage_count(&self, c: usize) -> usize {
        self.clusters.get(c).map_or(0, |r| r.stages.len())
    }

    /// Stages waiting for a provider.
    pub fn vacancies(&self) -> Vec<Vacancy> {
        self.clusters
            .iter()
            .enumerate()
            .flat_map(|(c, run)| {
                run.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.vacant)
                    .map(move |(s, stage)| Vacancy {
                        cluster: c,
                        stage: s,
                        memory_bytes: stage.memory_bytes,
                    })
            })
            .collect()
    }

    /// `provider` takes the vacant stage `s` of cluster `c`. Once the cluster
    /// has no vacancy left it is rebuilt from the last checkpoint.
    pub fn fill(&mut self, c: usize, s: usize, provider: u64) -> Vec<Effect> {
        let Some(stage) = self.clusters.get_mut(c).and_then(|r| r.stages.get_mut(s)) else {
            return Vec::new();
        };
        if !stage.vacant || self.state == State::Over {
            return Vec::new();
        }
        stage.vacant = false;
        stage.provider = provider;
        stage.slowness = None;
        let replayed = self.recorded.saturating_sub(self.synced);
        let mut effects = Vec::new();
        if self.clusters[c].stages.iter().all(|s| !s.vacant) {
            effects.push(Effect::Log {
                kind: "stage_reassigned",
                message: format!(
                    "cluster {c}, stage {s} reassigned to provider {provider}; the cluster restarts from the checkpoint at step {} ({replayed} recorded steps to replay)",
                    self.synced
                ),
            });
            effects.extend(self.rebuild(c));
        }
        effects
    }
}

impl JobRun {
    pub(super) fn abandon_sync(&mut self) {
        self.state = State::Training;
        self.background_sync = None;
        self.uploads.clear();
        // An aggregation under way belongs to this sync: its result is dropped.
        self.aggregating = None;
        for run in &mut self.clusters {
            run.pending_optimizer.clear();
            for stage in &mut run.stages {
                stage.uploaded = false;
            }
        }
    }
}
