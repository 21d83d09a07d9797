//! What a run measures: a step's record once every cluster has done it
//! (loss, throughput, each stage's compute and idle time) and an epoch's
//! evaluation.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{ClusterStep, Effect, JobRun};

/// Time one stage spent on a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    pub cluster: u32,
    pub stage: u32,
    pub provider: u64,
    pub compute_ms: f64,
    pub idle_ms: f64,
    /// The plan's estimate of `compute_ms` (0 where the plan had none).
    #[serde(default)]
    pub planned_ms: f64,
    /// The most micro-batches whose activations it held at once (its own
    /// report; 0 from records stored before it was kept).
    #[serde(default)]
    pub peak_held: u32,
}

/// What one training step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    /// Mean loss over every cluster's batch.
    pub loss: f64,
    pub samples_per_s: f64,
    pub elapsed_ms: f64,
    pub bytes_relayed: u64,
    /// Parameter and optimizer-state bytes of syncs (uploads and what went
    /// back) since the previous record: the traffic between clusters (a
    /// job's last sync comes after its last record).
    pub bytes_synced: u64,
    pub stages: Vec<StageTime>,
}

/// Evaluation on the test set after an epoch, or every `val_every` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochRecord {
    /// The epoch evaluated (0-based): the one that just ended, or the one
    /// under way for an evaluation within an epoch.
    pub epoch: u64,
    /// Steps done when it was taken.
    pub step: u64,
    pub test_loss: f64,
    pub test_accuracy: f64,
    pub samples: u64,
}

impl JobRun {
    /// Records every step all clusters have done, in order.
    pub(super) fn record_steps(&mut self) -> Vec<Effect> {
        let mut effects = Vec::new();
        while self
            .clusters
            .iter()
            .all(|r| r.finished.contains_key(&self.recorded))
        {
            let step = self.recorded;
            let parts: Vec<ClusterStep> = self
                .clusters
                .iter_mut()
                .filter_map(|r| r.finished.remove(&step))
                .collect();
            effects.push(Effect::Step(self.step_record(step, &parts)));
            self.recorded += 1;
        }
        effects
    }

    pub(super) fn step_record(&mut self, step: u64, parts: &[ClusterStep]) -> StepRecord {
        let elapsed_ms = self.step_started.elapsed().as_secs_f64() * 1e3;
        self.step_started = Instant::now();
        let samples: u64 = parts.iter().map(|p| p.samples).sum();
        let targets: u64 = parts.iter().map(|p| p.targets).sum();
        let loss = parts.iter().map(|p| p.loss_sum).sum::<f64>() / targets.max(1) as f64;
        let spe = self.schedule.steps_per_epoch as u64;
        let stages = parts
            .iter()
            .flat_map(|part| &part.stages)
            .map(|t| StageTime {
                idle_ms: (elapsed_ms - t.compute_ms).max(0.0),
                ..t.clone()
            })
            .collect();
        StepRecord {
            step,
            epoch: step / spe,
            loss,
            samples_per_s: samples as f64 / (elapsed_ms / 1e3).max(1e-9),
            elapsed_ms,
            bytes_relayed: std::mem::take(&mut self.bytes_relayed),
            bytes_synced: std::mem::take(&mut self.bytes_synced),
            stages,
        }
    }
}
