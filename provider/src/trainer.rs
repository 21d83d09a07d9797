//! What the connection hands training messages to. The session only knows this
//! trait, so it compiles without libtorch; the libtorch implementation is
//! [`crate::worker::StageWorker`] (feature `torch`), and a build without
//! libtorch answers every job with [`NoTorch`].

use rookery_proto::{ToProvider, ToServer};

/// A synchronous state machine over the training messages (`Assign`, `Forward`,
/// `Backward`, `UploadParams`, `SetParams`, `Release`). It may block for as
/// long as the computation takes; the session runs it on its own thread.
pub trait Trainer: Send {
    /// Handles one message and returns the replies to send, in order. Failures
    /// are replies too (`ToServer::JobFailed`), never panics.
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer>;
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

/// The job a training message belongs to (`None` for session messages).
pub fn job_of(message: &ToProvider) -> Option<u64> {
    match message {
        ToProvider::Assign(a) => Some(a.job_id),
        ToProvider::Forward(f) => Some(f.job_id),
        ToProvider::Backward(b) => Some(b.job_id),
        ToProvider::UploadParams { job_id, .. } | ToProvider::Release { job_id } => Some(*job_id),
        ToProvider::SetParams(p) => Some(p.job_id),
        ToProvider::Welcome { .. }
        | ToProvider::Heartbeat { .. }
        | ToProvider::Error(_)
        | ToProvider::Probe { .. } => None,
    }
}

/// Whether the session passes `message` to the [`Trainer`].
pub fn is_training_message(message: &ToProvider) -> bool {
    job_of(message).is_some()
}

/// The seed of training step `step` of a job seeded `job_seed`: every stage
/// seeds its dropout masks with it (the masks then depend only on this seed
/// and each sample's position in the step's batch), and so must any
/// single-process reference run that is to reproduce a distributed one.
///
/// It is SplitMix64's output function applied to
/// `job_seed ^ (step * 0x9E37_79B9_7F4A_7C15)` (wrapping): consecutive steps
/// get unrelated seeds, and jobs with nearby seeds do not share steps' masks.
pub fn step_seed(job_seed: u64, step: u64) -> u64 {
    let mut z = job_seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_are_fixed_values_and_differ_between_steps_and_jobs() {
        // Pinned: a reference trainer elsewhere must reproduce these exactly.
        assert_eq!(step_seed(0, 0), 0);
        assert_eq!(step_seed(0, 1), 0xE220_A839_7B1D_CDAF);
        let seeds: std::collections::BTreeSet<u64> = (0..4)
            .flat_map(|job| (0..100).map(move |step| step_seed(job, step)))
            .collect();
        assert_eq!(seeds.len(), 400);
    }

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
