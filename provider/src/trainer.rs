//! What the connection hands training messages to. The session only knows the
//! [`Trainer`] trait, so it compiles without libtorch: a [`StageTrainer`]
//! drives the generic stage worker over any backend (libtorch from
//! `rookery-torch` with feature `torch`, or our own kernels), and a build
//! without libtorch answers every libtorch job with [`NoTorch`].

use rookery_proto::{ToProvider, ToServer};
use rookery_stage::StageWorker;
use rookery_stage::worker::BackendFactory;

/// A synchronous state machine over the training messages (`Assign`, `Forward`,
/// `Backward`, `UploadParams`, `SetParams`, `Release`). It may block for as
/// long as the computation takes; the session runs it on its own thread.
pub trait Trainer: Send {
    /// Handles one message and returns the replies to send, in order. Failures
    /// are replies too (`ToServer::JobFailed`), never panics.
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer>;

    /// How long to rest once the last message's replies are sent (the
    /// donor's cap, [`Paced`]); the next message waits that long.
    fn rest_after(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

/// A trainer that keeps the donor's cap on the device: after each message it
/// rests long enough that the time it works is `duty_cycle` of the whole
/// (`rookery-provider --gpu-cap`, as a donating tab does). The replies go out
/// before the rest, so the next stage is never kept waiting for it.
pub struct Paced {
    inner: Box<dyn Trainer>,
    duty_cycle: f64,
    rest: std::time::Duration,
}

impl Paced {
    pub fn new(inner: Box<dyn Trainer>, duty_cycle: f64) -> Self {
        Self {
            inner,
            duty_cycle,
            rest: std::time::Duration::ZERO,
        }
    }
}

impl Trainer for Paced {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        let started = std::time::Instant::now();
        let out = self.inner.handle(message);
        let busy_ms = started.elapsed().as_secs_f64() * 1e3;
        let idle = rookery_stage::duty::idle_ms(busy_ms, self.duty_cycle);
        self.rest = std::time::Duration::from_secs_f64(idle / 1e3);
        out
    }

    fn rest_after(&self) -> std::time::Duration {
        self.rest
    }
}

/// The generic stage worker over the stages `F` builds, its futures driven to
/// completion on the trainer thread.
pub struct StageTrainer<F: BackendFactory> {
    worker: StageWorker<F>,
}

impl<F: BackendFactory> StageTrainer<F> {
    pub fn new(factory: F) -> Self {
        Self {
            worker: StageWorker::new(factory),
        }
    }
}

impl<F> Trainer for StageTrainer<F>
where
    F: BackendFactory,
    StageWorker<F>: Send,
{
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        pollster::block_on(self.worker.handle(message))
    }
}

/// The trainer of a build without libtorch: it cannot run stages, so every
/// job it is given fails at once with a reason a person can act on.
#[derive(Debug, Default)]
pub struct NoTorch;

impl Trainer for NoTorch {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        match job_of(&message) {
            // Nothing was built, so there is nothing to drop or report.
            _ if matches!(message, ToProvider::Release { .. }) => Vec::new(),
            Some(job_id) => vec![ToServer::JobFailed {
                job_id,
                message: "this provider was built without libtorch and cannot run stages \
                          (rebuild rookery-provider with `--features torch`)"
                    .into(),
            }],
            None => Vec::new(),
        }
    }
}

pub use rookery_stage::worker::job_of;

/// Whether the session passes `message` to the [`Trainer`].
pub fn is_training_message(message: &ToProvider) -> bool {
    job_of(message).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_libtorch_an_assignment_fails_with_the_reason() {
        let mut t = NoTorch;
        let replies = t.handle(ToProvider::UploadParams { job_id: 3, step: 0 });
        assert!(
            matches!(&replies[..], [ToServer::JobFailed { job_id: 3, message }] if message.contains("without libtorch")),
            "{replies:?}"
        );
        assert!(t.handle(ToProvider::Release { job_id: 3 }).is_empty());
        assert!(t.handle(ToProvider::Heartbeat { seq: 1 }).is_empty());
    }
}
