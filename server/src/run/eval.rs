//! Evaluation after an epoch (and every `val_every` steps): the test set
//! goes forward through every cluster, each its own share, and the Leaves'
//! losses make the evaluation's record.

use rookery_proto::Phase;

use super::step::feed;
use super::{Effect, EpochRecord, JobRun, State};

impl JobRun {
    /// Whether the sync after `step_done` steps is followed by an
    /// evaluation: at each epoch's end, and every `val_every` steps.
    pub(super) fn evaluates_at(&self, step_done: u64) -> bool {
        let spe = self.schedule.steps_per_epoch as u64;
        step_done > 0
            && (step_done.is_multiple_of(spe)
                || self
                    .spec
                    .training
                    .val_every
                    .is_some_and(|every| step_done.is_multiple_of(every.max(1))))
    }

    /// Sends the test set forward through every cluster, each its own
    /// share, if `step_done` is a step to evaluate at and there is a test set.
    pub(super) fn start_eval(&mut self, step_done: u64) -> Option<Vec<Effect>> {
        if !self.evaluates_at(step_done) {
            return None;
        }
        let test = self.test.as_ref()?;
        if test.is_empty() {
            return None;
        }
        let spe = self.schedule.steps_per_epoch as u64;
        // An epoch's end evaluates the epoch that ended.
        let epoch = (step_done - 1) / spe;
        self.state = State::Evaluating {
            epoch,
            step: step_done,
            expected: test.len() as u64,
        };
        let effects = (0..self.clusters.len())
            .flat_map(|c| self.feed_eval(c, epoch))
            .collect();
        Some(effects)
    }

    /// Cluster `c`'s share of the test set, from its first micro-batch.
    pub(super) fn feed_eval(&mut self, c: usize, epoch: u64) -> Vec<Effect> {
        let Some(test) = self.test.as_ref() else {
            return Vec::new();
        };
        let n = test.len();
        let clusters = self.clusters.len();
        let phase = Phase::Eval {
            epoch: epoch as u32,
        };
        let micro = self.spec.micro_batch_size().max(1);
        let run = &mut self.clusters[c];
        run.reset();
        let idx: Vec<usize> = ((c * n / clusters)..((c + 1) * n / clusters)).collect();
        idx.chunks(micro)
            .enumerate()
            .map(|(m, chunk)| {
                feed(
                    &self.graph_input,
                    test,
                    run,
                    (self.job_id, self.spec.training.loss),
                    phase,
                    m as u32,
                    (chunk.len(), None),
                    chunk,
                )
            })
            .collect()
    }

    pub(super) fn finish_eval(&mut self, epoch: u64, step: u64) -> Vec<Effect> {
        let samples: u64 = self.clusters.iter().map(|r| r.totals.samples).sum();
        // Per target: per sample for one class a sample, per token for a
        // language model, the ignored labels counting nowhere.
        let targets: u64 = self.clusters.iter().map(|r| r.totals.targets).sum();
        let loss =
            self.clusters.iter().map(|r| r.totals.loss_sum).sum::<f64>() / targets.max(1) as f64;
        let correct: u64 = self.clusters.iter().map(|r| r.totals.correct).sum();
        let mut effects = vec![Effect::Epoch(EpochRecord {
            epoch,
            step,
            test_loss: loss,
            test_accuracy: correct as f64 / targets.max(1) as f64,
            samples,
        })];
        effects.extend(self.next_or_finish(step));
        effects
    }
}
