//! Stragglers: stages whose providers stay far slower than planned, next to
//! the job's other stages, are found at each step and moved to a faster
//! standby at a sync.

use rookery_proto::ToProvider;

use super::{Effect, JobRun, State};

/// A stage is a straggler once its compute time per step has been more than
/// this many times the job's typical ratio of measured to planned time ...
pub const STRAGGLER_FACTOR: f64 = 3.0;

/// ... for this many consecutive steps ...
pub const STRAGGLER_STEPS: u32 = 3;

/// ... computing at least this long per step: below it, fixed per-message
/// costs swamp the plan's estimate, and the stage cannot stall much anyway.
pub const STRAGGLER_MIN_MS: f64 = 20.0;

/// A stage whose provider has been far slower than planned, compared with
/// the job's other stages, for [`STRAGGLER_STEPS`] steps in a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggler {
    pub cluster: usize,
    pub stage: usize,
    pub provider: u64,
    /// How many times slower than the job's typical stage, against plan.
    pub slowness: f64,
    pub memory_bytes: u64,
}

impl JobRun {
    /// Moves stage `s` of cluster `c` onto `provider` (a straggler's stage
    /// going to a faster standby): the old provider is released and the
    /// cluster rebuilt from the last checkpoint. Meant for a sync boundary,
    /// where the checkpoint is the cluster's current state.
    pub fn replace(&mut self, c: usize, s: usize, provider: u64, why: &str) -> Vec<Effect> {
        let Some(old) = self.clusters.get(c).and_then(|r| r.stages.get(s)) else {
            return Vec::new();
        };
        if old.vacant || self.state == State::Over {
            return Vec::new();
        }
        let old = old.provider;
        let mut effects = vec![Effect::Send(
            old,
            ToProvider::Release {
                job_id: self.job_id,
            },
        )];
        effects.extend(self.stage_lost(old, why).unwrap_or_default());
        effects.extend(self.fill(c, s, provider));
        effects
    }

    /// Stages that have been [`STRAGGLER_FACTOR`] times slower than the
    /// job's typical stage (each against its plan) for [`STRAGGLER_STEPS`]
    /// steps in a row, computing at least [`STRAGGLER_MIN_MS`] a step.
    pub fn stragglers(&self) -> Vec<Straggler> {
        let typical = self.typical_slowness();
        self.clusters
            .iter()
            .enumerate()
            .flat_map(|(c, run)| {
                run.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !s.vacant && s.slow_steps >= STRAGGLER_STEPS)
                    .map(move |(s, stage)| Straggler {
                        cluster: c,
                        stage: s,
                        provider: stage.provider,
                        slowness: stage.slowness.unwrap_or(0.0) / typical,
                        memory_bytes: stage.memory_bytes,
                    })
            })
            .collect()
    }
}

impl JobRun {
    /// The median of every stage's measured over planned time: plans can be
    /// off by a constant factor for every stage alike, which is no straggling.
    pub(super) fn typical_slowness(&self) -> f64 {
        let mut all: Vec<f64> = self
            .clusters
            .iter()
            .flat_map(|r| r.stages.iter().filter_map(|s| s.slowness))
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        if all.is_empty() {
            return 1.0;
        }
        all.sort_by(f64::total_cmp);
        all[(all.len() - 1) / 2]
    }

    pub(super) fn count_slow_steps(&mut self, c: usize) {
        let typical = self.typical_slowness();
        for stage in &mut self.clusters[c].stages {
            match stage.slowness {
                Some(v)
                    if v > STRAGGLER_FACTOR * typical && stage.compute_ms >= STRAGGLER_MIN_MS =>
                {
                    stage.slow_steps += 1
                }
                _ => stage.slow_steps = 0,
            }
        }
    }
}
