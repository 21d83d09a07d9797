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
use rookery_proto::{ToProvider, WireTensor};

/// The bytes `tensors` put on the wire.
pub(super) fn wire_bytes<'a>(tensors: impl IntoIterator<Item = &'a WireTensor>) -> u64 {
    tensors.into_iter().map(|t| t.wire_len() as u64).sum()
}

/// A stage's busy time within a step, from the server's clock.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Busy {
    last_in: Option<Instant>,
    last_out: Option<Instant>,
    busy: Duration,
    /// Tensor bytes to and from the stage meanwhile: their transfer is
    /// busy time the device did not compute.
    bytes: u64,
}

impl Busy {
    /// The server sent the stage `bytes` of tensors to compute at `at`.
    pub(super) fn input(&mut self, at: Instant, bytes: u64) {
        self.last_in = Some(at);
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// An answer of `bytes` of tensors from the stage arrived at `at`.
    pub(super) fn output(&mut self, at: Instant, bytes: u64) {
        if let Some(since) = self.last_in.max(self.last_out) {
            self.busy += at.saturating_duration_since(since);
        }
        self.last_out = Some(at);
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// The busy time (milliseconds) and the bytes moved since the last call.
    pub(super) fn take(&mut self) -> (f64, u64) {
        let busy = std::mem::take(&mut self.busy).as_secs_f64() * 1e3;
        (busy, std::mem::take(&mut self.bytes))
    }
}

/// A stage's step busier than this gives a measured rate; below it, fixed
/// costs per message swamp the computing.
pub const MIN_MEASURED_MS: f64 = 100.0;

/// ... and so does a stage with less work than this a step (GFLOP): tiny
/// stages are all overhead, however fast their device.
pub const MIN_MEASURED_GFLOP: f64 = 5.0;

impl JobRun {
    /// Notes the time of every input `effects` send to a stage of the job.
    pub(super) fn note_inputs(&mut self, effects: &[Effect], at: Instant) {
        for effect in effects {
            let (to, bytes) = match effect {
                Effect::Send(to, ToProvider::Forward(f)) => (*to, wire_bytes(&f.inputs)),
                Effect::Send(to, ToProvider::Backward(b)) => (*to, wire_bytes(&b.grads)),
                Effect::Send(to, ToProvider::GradScale(_)) => (*to, 0),
                _ => continue,
            };
            if let Some((c, s)) = self.locate(to) {
                self.clusters[c].stages[s].busy.input(at, bytes);
            }
        }
    }

    /// Each stage of cluster `c` with work enough and busy long enough this
    /// step (`busy`: milliseconds and bytes moved, by stage), for the
    /// coordinator to rate.
    pub(super) fn measured(&self, c: usize, busy: &[(f64, u64)]) -> Vec<Effect> {
        self.clusters[c]
            .stages
            .iter()
            .zip(busy)
            .filter(|(stage, (busy_ms, _))| {
                !stage.vacant
                    && stage.work_gflop >= MIN_MEASURED_GFLOP
                    && *busy_ms >= MIN_MEASURED_MS
            })
            .map(|(stage, &(busy_ms, bytes))| Effect::Measured {
                provider: stage.provider,
                work_gflop: stage.work_gflop,
                busy_ms,
                bytes,
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
        busy.output(at(5), 0);
        assert_eq!(busy.take(), (0.0, 0));
        // Four micro-batches at once, answered every 10 ms: 40 ms.
        busy.input(at(100), 400);
        for k in 1..=4 {
            busy.output(at(100 + 10 * k), 50);
        }
        assert_eq!(busy.take(), (40.0, 600));
        // Idle between steps: the wait for the next input is not counted.
        busy.input(at(500), 0);
        busy.output(at(530), 0);
        // An input arriving while it computes shortens what is counted:
        // busy time errs towards the provider.
        busy.input(at(535), 0);
        busy.output(at(540), 0);
        assert_eq!(busy.take(), (35.0, 0));
    }
}
