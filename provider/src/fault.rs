//! A deliberately faulty provider, for tests of the server's defences only
//! (feature `fault-injection`, hidden flag `--fault KIND`): the provider runs
//! its stage honestly, then misbehaves in exactly one way in what it sends.
//!
//! Faults touch the messages that carry tensors (activations, gradients,
//! parameters at a sync), every time, so a faulty provider keeps faulting
//! after it reconnects, as a broken or malicious one would.

use std::sync::OnceLock;

use rookery_model::Loss;
use rookery_proto::{Bytes, ParamOptimState, Phase, ToServer, WireDType, WireTensor};
use rookery_stage::worker::{Backend, BackendFactory, LeafLossValue, StageSpec, WeightVersion};

/// The one way a faulty provider misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Sends bytes that are no frame of the protocol instead of its tensors.
    Malformed,
    /// Tags its tensors with another job's id.
    OtherJob,
    /// Names its tensors for a stage it does not run.
    OtherStage,
    /// Sends its first tensor flattened: the right values, the wrong shape.
    WrongShape,
    /// Puts a NaN into its first tensor.
    Nan,
    /// Uploads parameters shifted far from every other cluster's at a sync.
    FarParams,
    /// Sends only honest data, but computes every training forward
    /// [`SLOW_MS`] slower than it could: a throttled or overloaded machine,
    /// a straggler.
    Slow,
    /// Computes and sends honestly, but claims [`CLAIM_FACTOR`] times the
    /// GFLOP/s it measured, to be given the biggest stages.
    Claim,
    /// Scales its training activations (and, as a Leaf, its losses) by
    /// [`SUBTLE_SCALE`]: finite, well shaped, plausible, wrong.
    Subtle,
    /// Computes its forwards honestly but scales the gradients it sends
    /// back (as a Stem or a Leaf) by [`SUBTLE_SCALE`].
    SubtleGradients,
}

/// What a [`Fault::Subtle`] provider multiplies its results by.
pub const SUBTLE_SCALE: f32 = 1.01;

/// How much a [`Fault::Claim`] provider overstates its speed.
pub const CLAIM_FACTOR: f64 = 1000.0;

/// What [`Fault::Slow`] adds to each training forward.
pub const SLOW_MS: u64 = 150;

/// Sleeps [`SLOW_MS`] when this process plays a straggler; the worker's own
/// clock then counts it as compute time, as real slowness would be.
pub fn slow_down() {
    if current() == Some(Fault::Slow) {
        std::thread::sleep(std::time::Duration::from_millis(SLOW_MS));
    }
}

/// The stages `F` builds, each training forward [`slow_down`]: inside the
/// backend, so that the worker's compute clock sees the delay.
#[derive(Debug, Clone)]
pub struct SlowedStages<F>(pub F);

impl<F: BackendFactory> BackendFactory for SlowedStages<F> {
    type Backend = SlowedStage<F::Backend>;

    fn build(&mut self, spec: StageSpec<'_>) -> Result<Self::Backend, String> {
        self.0.build(spec).map(SlowedStage)
    }
}

/// A stage of a [`SlowedStages`]: `B`, with its training forwards slowed down.
#[derive(Debug)]
pub struct SlowedStage<B>(B);

impl<B: Backend> Backend for SlowedStage<B> {
    type MicroBatch = B::MicroBatch;
    type Tensor = B::Tensor;
    type Error = B::Error;

    fn param_names(&self) -> Vec<String> {
        self.0.param_names()
    }

    fn set_step_seed(&mut self, seed: u64) {
        self.0.set_step_seed(seed);
    }

    fn decode(&self, t: &WireTensor) -> Result<B::Tensor, B::Error> {
        self.0.decode(t)
    }

    fn encode(&self, name: &str, t: &B::Tensor, dtype: WireDType) -> Result<WireTensor, B::Error> {
        self.0.encode(name, t, dtype)
    }

    fn samples(&self, t: &B::Tensor) -> Option<usize> {
        self.0.samples(t)
    }

    async fn forward(
        &mut self,
        inputs: &[(String, B::Tensor)],
        offset: u64,
        version: WeightVersion,
    ) -> Result<(B::MicroBatch, Vec<(String, B::Tensor)>), B::Error> {
        slow_down();
        self.0.forward(inputs, offset, version).await
    }

    async fn evaluate(
        &mut self,
        inputs: &[(String, B::Tensor)],
    ) -> Result<Vec<(String, B::Tensor)>, B::Error> {
        self.0.evaluate(inputs).await
    }

    async fn backward(
        &mut self,
        micro_batch: B::MicroBatch,
        grads: &[(String, B::Tensor)],
    ) -> Result<Vec<(String, B::Tensor)>, B::Error> {
        self.0.backward(micro_batch, grads).await
    }

    async fn grad_sum_of_squares(&mut self) -> Result<f64, B::Error> {
        self.0.grad_sum_of_squares().await
    }

    async fn step(&mut self, lr: f64, grad_scale: f64) -> Result<(), B::Error> {
        self.0.step(lr, grad_scale).await
    }

    fn merge_versions(&mut self) -> Result<(), B::Error> {
        self.0.merge_versions()
    }

    async fn parameters(&mut self) -> Result<Vec<WireTensor>, B::Error> {
        self.0.parameters().await
    }

    fn set_parameters(&mut self, values: &[WireTensor]) -> Result<(), B::Error> {
        self.0.set_parameters(values)
    }

    fn set_optimizer_state(&mut self, states: &[ParamOptimState]) -> Result<(), B::Error> {
        self.0.set_optimizer_state(states)
    }

    async fn optimizer_state(&mut self) -> Result<Vec<ParamOptimState>, B::Error> {
        self.0.optimizer_state().await
    }

    fn leaf_loss(
        &self,
        loss: Loss,
        y: &B::Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> Result<LeafLossValue<B::Tensor>, B::Error> {
        self.0.leaf_loss(loss, y, labels, step_targets)
    }

    async fn leaf_backward(
        &mut self,
        micro_batch: B::MicroBatch,
        loss: Loss,
        output: &str,
        y: &B::Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> Result<(f64, Vec<(String, B::Tensor)>), B::Error> {
        self.0
            .leaf_backward(micro_batch, loss, output, y, labels, step_targets)
            .await
    }

    fn loss_sum(&self, loss: Loss, y: &B::Tensor, labels: &WireTensor) -> Result<f64, B::Error> {
        self.0.loss_sum(loss, y, labels)
    }

    fn correct(&self, loss: Loss, y: &B::Tensor, labels: &WireTensor) -> Result<u64, B::Error> {
        self.0.correct(loss, y, labels)
    }
}

static FAULT: OnceLock<Fault> = OnceLock::new();

/// Makes this process misbehave with `fault` from now on.
pub fn set(fault: Fault) {
    let _ = FAULT.set(fault);
}

/// The fault this process injects, if any.
pub fn current() -> Option<Fault> {
    FAULT.get().copied()
}

/// `message` as the faulty provider sends it (`None`: unchanged).
pub fn tamper(message: &ToServer) -> Option<ToServer> {
    tamper_with(current()?, message)
}

/// The frames of `message` as the faulty provider sends them.
pub fn tamper_frames(message: &ToServer, frames: Vec<Bytes>) -> Vec<Bytes> {
    if current() == Some(Fault::Malformed) && carries_data(message) {
        // Not a message (the tag byte is no variant) nor a payload frame.
        vec![Bytes::from(vec![0xff; 64])]
    } else {
        frames
    }
}

fn carries_data(message: &ToServer) -> bool {
    matches!(
        message,
        ToServer::Activations(_) | ToServer::Gradients(_) | ToServer::Params(_)
    )
}

pub fn tamper_with(fault: Fault, message: &ToServer) -> Option<ToServer> {
    let mut message = message.clone();
    match (&mut message, fault) {
        (ToServer::Activations(a), Fault::OtherJob) => a.job_id += 1000,
        (ToServer::Gradients(g), Fault::OtherJob) => g.job_id += 1000,
        (ToServer::Params(p), Fault::OtherJob) => p.job_id += 1000,
        (ToServer::Activations(a), Fault::OtherStage) => rename(&mut a.outputs),
        (ToServer::Gradients(g), Fault::OtherStage) => rename(&mut g.grads),
        (ToServer::Params(p), Fault::OtherStage) => rename(&mut p.params),
        (ToServer::Activations(a), Fault::WrongShape) => flatten(a.outputs.first_mut()?),
        (ToServer::Gradients(g), Fault::WrongShape) => flatten(g.grads.first_mut()?),
        (ToServer::Activations(a), Fault::Nan) => poison(a.outputs.first_mut()?)?,
        (ToServer::Gradients(g), Fault::Nan) => poison(g.grads.first_mut()?)?,
        (ToServer::Params(p), Fault::FarParams) => {
            for t in p.params.iter_mut().filter(|t| t.dtype.is_float()) {
                let values: Vec<f32> = t.to_f32().ok()?.iter().map(|v| v + 1000.0).collect();
                *t = WireTensor::from_f32(t.name.clone(), &t.shape_usize(), &values, t.dtype);
            }
        }
        (ToServer::Activations(a), Fault::Subtle) if matches!(a.phase, Phase::Train { .. }) => {
            scale(&mut a.outputs)?;
        }
        (ToServer::LeafLoss(l), Fault::Subtle) if matches!(l.phase, Phase::Train { .. }) => {
            l.loss_sum *= f64::from(SUBTLE_SCALE);
        }
        (ToServer::Gradients(g), Fault::SubtleGradients) => scale(&mut g.grads)?,
        _ => return None,
    }
    Some(message)
}

/// Multiplies every float tensor by [`SUBTLE_SCALE`].
fn scale(tensors: &mut [WireTensor]) -> Option<()> {
    for t in tensors.iter_mut().filter(|t| t.dtype.is_float()) {
        let values: Vec<f32> = t.to_f32().ok()?.iter().map(|v| v * SUBTLE_SCALE).collect();
        *t = WireTensor::from_f32(t.name.clone(), &t.shape_usize(), &values, t.dtype);
    }
    Some(())
}

fn rename(tensors: &mut [WireTensor]) {
    for t in tensors {
        t.name = format!("another-stage/{}", t.name);
    }
}

fn flatten(t: &mut WireTensor) {
    let numel = u32::try_from(t.numel()).unwrap_or(u32::MAX);
    t.shape = if t.shape.len() == 1 {
        vec![1, numel]
    } else {
        vec![numel]
    };
}

fn poison(t: &mut WireTensor) -> Option<()> {
    let mut values = t.to_f32().ok()?;
    *values.first_mut()? = f32::NAN;
    *t = WireTensor::from_f32(t.name.clone(), &t.shape_usize(), &values, t.dtype);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rookery_proto::{Activations, Gradients, ParamSet, WireDType};

    fn activations() -> ToServer {
        ToServer::Activations(Activations {
            job_id: 7,
            phase: Phase::Train { step: 0 },
            micro: 0,
            outputs: vec![WireTensor::from_f32(
                "h",
                &[2, 3],
                &[1.0; 6],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        })
    }

    #[test]
    fn each_fault_changes_exactly_what_it_names() {
        let ToServer::Activations(honest) = activations() else {
            unreachable!()
        };
        let faulty = |fault| match tamper_with(fault, &activations()) {
            Some(ToServer::Activations(a)) => a,
            other => panic!("{fault:?}: {other:?}"),
        };
        assert_eq!(faulty(Fault::OtherJob).job_id, 1007);
        assert_eq!(faulty(Fault::OtherStage).outputs[0].name, "another-stage/h");
        let flat = faulty(Fault::WrongShape);
        assert_eq!(
            (flat.outputs[0].shape.clone(), flat.outputs[0].data.clone()),
            (vec![6], honest.outputs[0].data.clone())
        );
        let nan = faulty(Fault::Nan);
        assert!(nan.outputs[0].check().is_err());
        assert_eq!(nan.outputs[0].to_f32().unwrap()[1..], [1.0; 5]);
        // Parameters move only with FarParams; activations never do.
        assert!(tamper_with(Fault::FarParams, &activations()).is_none());
        // A straggler's data is honest.
        assert!(tamper_with(Fault::Slow, &activations()).is_none());
        assert_eq!(
            faulty(Fault::Subtle).outputs[0].to_f32().unwrap(),
            [1.01; 6]
        );
        let params = ToServer::Params(ParamSet {
            job_id: 7,
            step: 1,
            params: vec![WireTensor::from_f32(
                "w",
                &[2],
                &[0.5, -0.5],
                WireDType::F32,
            )],
        });
        let Some(ToServer::Params(far)) = tamper_with(Fault::FarParams, &params) else {
            panic!()
        };
        assert_eq!(far.params[0].to_f32().unwrap(), vec![1000.5, 999.5]);
        // Gradients move only with SubtleGradients, which leaves activations be.
        assert!(tamper_with(Fault::SubtleGradients, &activations()).is_none());
        let grads = ToServer::Gradients(Gradients {
            job_id: 7,
            step: 1,
            micro: 0,
            grads: vec![WireTensor::from_f32(
                "h",
                &[2],
                &[2.0, -1.0],
                WireDType::F32,
            )],
            compute_ms: 1.0,
        });
        let Some(ToServer::Gradients(scaled)) = tamper_with(Fault::SubtleGradients, &grads) else {
            panic!()
        };
        assert_eq!(scaled.grads[0].to_f32().unwrap(), vec![2.02, -1.01]);
        assert!(tamper_with(Fault::Subtle, &grads).is_none());
    }

    #[test]
    fn a_malformed_frame_is_no_frame_of_the_protocol() {
        let garbage = Bytes::from(vec![0xff; 64]);
        let read = rookery_proto::stream::read_frame::<ToServer>(&garbage, 1 << 20);
        assert!(read.is_err(), "{read:?}");
    }
}
