//! The server's own measure of how fast each stage computes, so that no
//! provider is believed about its speed: not its `Hello`'s GFLOP/s, not the
//! compute times it reports.
//!
//! A stage is a queue served by one worker: the server times what it sends
//! the stage and what comes back. An answer that arrives at `out` was
//! computed after the stage's previous answer and after the input the
//! server last sent before it, so `out - max(previous answer, last input)`
//! is at most what it took (the stage may have started sooner, on an
//! earlier input); summed over a step it is the stage's busy time, seen
//! from the server. Work it does without answering (the Root's backward)
//! counts only through the answer that follows (`StepDone`), so busy time
//! is never more than the computing and the transfers took: a rate from it
//! errs towards the provider, and a claim many times that rate is a lie.

use std::time::{Duration, Instant};

use super::{Effect, JobRun};
use rookery_proto::ToProvider;

/// A stage's busy time within a step, from the server's clock.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Busy {
    last_in: Option<Instant>,
    last_out: Option<Instant>,
    busy: Duration,
}

impl Busy {
    /// The server sent the stage something to compute at `at`.
    pub(super) fn input(&mut self, at: Instant) {
        self.last_in = Some(at);
    }

    /// An answer from the stage arrived at `at`.
    pub(super) fn output(&mut self, at: Instant) {
        if let Some(since) = self.last_in.max(self.last_out) {
            self.busy += at.saturating_duration_since(since);
        }
        self.last_out = Some(at);
    }

    /// The busy time since the last call, in milliseconds.
    pub(super) fn take_ms(&mut self) -> f64 {
        std::mem::take(&mut self.busy).as_secs_f64() * 1e3
    }
}

/// A stage's step busier than this gives a measured rate; below it, fixed
/// costs per message swamp the computing.
pub const MIN_MEASURED_MS: f64 = 100.0;

impl JobRun {
    /// Notes the time of every input `effects` send to a stage of the job.
    pub(super) fn note_inputs(&mut self, effects: &[Effect], at: Instant) {
        for effect in effects {
            if let Effect::Send(
                to,
                ToProvider::Forward(_) | ToProvider::Backward(_) | ToProvider::GradScale(_),
            ) = effect
                && let Some((c, s)) = self.locate(*to)
            {
                self.clusters[c].stages[s].busy.input(at);
            }
        }
    }

    /// Each stage of cluster `c` that was busy long enough this step
    /// (`busy_ms`, by stage), as the rate its work was done at.
    pub(super) fn measured(&self, c: usize, busy_ms: &[f64]) -> Vec<Effect> {
        self.clusters[c]
            .stages
            .iter()
            .zip(busy_ms)
            .filter(|(stage, busy_ms)| {
                !stage.vacant && stage.work_gflop > 0.0 && **busy_ms >= MIN_MEASURED_MS
            })
            .map(|(stage, &busy_ms)| Effect::Measured {
                provider: stage.provider,
                gflops: stage.work_gflop / (busy_ms / 1e3),
                busy_ms,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_counts_from_the_later_of_the_last_input_and_the_last_answer() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut busy = Busy::default();
        // Nothing sent yet: an answer out of nowhere counts nothing.
        busy.output(at(5));
        assert_eq!(busy.take_ms(), 0.0);
        // Four micro-batches at once, answered every 10 ms: 40 ms.
        busy.input(at(100));
        for k in 1..=4 {
            busy.output(at(100 + 10 * k));
        }
        assert_eq!(busy.take_ms(), 40.0);
        // Idle between steps: the wait for the next input is not counted.
        busy.input(at(500));
        busy.output(at(530));
        // An input arriving while it computes shortens what is counted:
        // busy time errs towards the provider.
        busy.input(at(535));
        busy.output(at(540));
        assert_eq!(busy.take_ms(), 35.0);
    }
}
