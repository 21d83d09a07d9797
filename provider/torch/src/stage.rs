//! One provider's share of a training job on libtorch: the generic
//! [`rookery_stage::StageWorker`] (the protocol state machine every provider
//! shares, see its docs for the rules the server relies on) over
//! [`TorchStage`], a libtorch [`TorchExecutor`] and its [`TorchOptimizer`].
//!
//! The worker is a synchronous state machine with no socket: the provider's
//! connection feeds it on its own thread (libtorch calls block), and tests
//! relay messages between several workers in one process exactly as the
//! server would. Every failure, whether a bad assignment, a tensor of the
//! wrong shape, a libtorch error or a message that does not fit the stage's
//! state, becomes [`ToServer::JobFailed`]; nothing a server sends can panic it.

use std::collections::BTreeMap;

use rookery_model::Loss;
use rookery_proto::{ParamOptimState, ToProvider, ToServer, WireDType, WireTensor};
use rookery_stage::WeightVersion;
use rookery_stage::worker::{Backend, BackendFactory, LeafLossValue, StageSpec};
use tch::{Device, Tensor};

use crate::exec::loss::{correct, loss_sum, micro_batch_loss, scaled_loss};
use crate::exec::{TorchExecutor, TorchMicroBatch, TorchOptimizer};
pub use crate::wire::TorchWorkerError;
use crate::wire::{protocol, tensor_from_wire, tensor_to_wire};

/// The generic stage worker on libtorch, driven synchronously: runs at most
/// one stage of one job at a time on one device.
pub struct TorchWorker {
    device: Device,
    inner: rookery_stage::StageWorker<TorchStageFactory>,
}

impl std::fmt::Debug for TorchWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchWorker")
            .field("device", &self.device)
            .field("job_id", &self.job_id())
            .finish()
    }
}

impl TorchWorker {
    /// A worker with no stage yet; stages it builds live on `device`.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            inner: rookery_stage::StageWorker::new(TorchStageFactory::new(device)),
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The job whose stage this worker holds, if any.
    pub fn job_id(&self) -> Option<u64> {
        self.inner.job_id()
    }

    /// Handles one training message; session messages get no reply.
    pub fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        // libtorch computes synchronously: the future is ready when polled.
        pollster::block_on(self.inner.handle(message))
    }
}

/// Builds libtorch stages on one device.
#[derive(Debug, Clone, Copy)]
pub struct TorchStageFactory {
    device: Device,
}

impl TorchStageFactory {
    pub fn new(device: Device) -> Self {
        Self { device }
    }

    /// Stages on the CPU (for callers that do not link `tch` themselves).
    pub fn cpu() -> Self {
        Self::new(Device::Cpu)
    }
}

impl BackendFactory for TorchStageFactory {
    type Backend = TorchStage;

    fn build(&mut self, spec: StageSpec<'_>) -> Result<TorchStage, String> {
        let build = || -> Result<TorchStage, TorchWorkerError> {
            let params = spec
                .params
                .iter()
                .map(|p| Ok((p.name.clone(), tensor_from_wire(p)?)))
                .collect::<Result<Vec<_>, TorchWorkerError>>()?;
            let exec = TorchExecutor::new(
                spec.graph,
                spec.range.clone(),
                spec.outputs.to_vec(),
                params,
                self.device,
            )?
            .with_stash_weights(spec.stash_weights)
            .with_precision(spec.precision);
            let mut optimizer = TorchOptimizer::new(spec.optimizer)?;
            restore_optimizer(&mut optimizer, &exec, spec.optimizer_state, self.device)?;
            Ok(TorchStage { exec, optimizer })
        };
        build().map_err(|e| e.to_string())
    }
}

/// A libtorch stage and its optimizer. With `StageSpec::stash_weights` its
/// executor keeps two weight versions (see [`crate::exec`]'s module docs);
/// without, a forward with [`WeightVersion::Previous`] runs with the one
/// version there is, and stepping still needs every backward done.
#[derive(Debug)]
pub struct TorchStage {
    exec: TorchExecutor,
    optimizer: TorchOptimizer,
}

impl Backend for TorchStage {
    type MicroBatch = TorchMicroBatch;
    type Tensor = Tensor;
    type Error = TorchWorkerError;

    fn param_names(&self) -> Vec<String> {
        self.exec.param_names()
    }

    fn set_step_seed(&mut self, seed: u64) {
        self.exec.set_step_seed(seed);
    }

    fn decode(&self, t: &WireTensor) -> Result<Tensor, TorchWorkerError> {
        tensor_from_wire(t)
    }

    fn encode(
        &self,
        name: &str,
        t: &Tensor,
        dtype: WireDType,
    ) -> Result<WireTensor, TorchWorkerError> {
        tensor_to_wire(name, t, dtype)
    }

    fn samples(&self, t: &Tensor) -> Option<usize> {
        (t.dim() > 0).then(|| t.size()[0].max(0) as usize)
    }

    async fn forward(
        &mut self,
        inputs: &[(String, Tensor)],
        offset: u64,
        version: WeightVersion,
    ) -> Result<(TorchMicroBatch, Vec<(String, Tensor)>), TorchWorkerError> {
        let forward = self.exec.forward_version(inputs, true, offset, version)?;
        Ok((forward.micro_batch, forward.outputs))
    }

    async fn evaluate(
        &mut self,
        inputs: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, TorchWorkerError> {
        Ok(self.exec.evaluate(inputs)?)
    }

    async fn backward(
        &mut self,
        micro_batch: TorchMicroBatch,
        grads: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, TorchWorkerError> {
        Ok(self.exec.backward(micro_batch, grads)?)
    }

    async fn grad_sum_of_squares(&mut self) -> Result<f64, TorchWorkerError> {
        Ok(self.exec.grad_sum_of_squares()?)
    }

    async fn step(&mut self, lr: f64, grad_scale: f64) -> Result<(), TorchWorkerError> {
        self.exec.scale_grads(grad_scale)?;
        self.optimizer.set_lr(lr)?;
        Ok(self.exec.step(&mut self.optimizer)?)
    }

    fn merge_versions(&mut self) -> Result<(), TorchWorkerError> {
        Ok(self.exec.merge_versions()?)
    }

    async fn parameters(&mut self) -> Result<Vec<WireTensor>, TorchWorkerError> {
        self.exec
            .parameters()?
            .iter()
            .map(|(name, t)| tensor_to_wire(name, t, WireDType::F32))
            .collect()
    }

    fn set_parameters(&mut self, values: &[WireTensor]) -> Result<(), TorchWorkerError> {
        let values = values
            .iter()
            .map(|t| Ok((t.name.clone(), tensor_from_wire(t)?)))
            .collect::<Result<Vec<_>, TorchWorkerError>>()?;
        Ok(self.exec.set_parameters(&values)?)
    }

    fn set_optimizer_state(&mut self, states: &[ParamOptimState]) -> Result<(), TorchWorkerError> {
        let device = self.exec.device();
        restore_optimizer(&mut self.optimizer, &self.exec, states, device)
    }

    async fn optimizer_state(&mut self) -> Result<Vec<ParamOptimState>, TorchWorkerError> {
        self.optimizer
            .export()
            .into_iter()
            .map(|(name, steps, slots)| {
                let slots = slots
                    .into_iter()
                    .map(|(slot, t)| tensor_to_wire(slot, t, WireDType::F32))
                    .collect::<Result<_, _>>()?;
                Ok(ParamOptimState { name, steps, slots })
            })
            .collect()
    }

    fn leaf_loss(
        &self,
        loss: Loss,
        y: &Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> Result<LeafLossValue<Tensor>, TorchWorkerError> {
        let labels = tensor_from_wire(labels)?;
        let out = micro_batch_loss(loss, y, &labels, step_targets)?;
        Ok(LeafLossValue {
            sum: out.sum,
            grad: out.grad,
        })
    }

    async fn leaf_backward(
        &mut self,
        micro_batch: TorchMicroBatch,
        loss: Loss,
        output: &str,
        _y: &Tensor,
        labels: &WireTensor,
        step_targets: u64,
    ) -> Result<(f64, Vec<(String, Tensor)>), TorchWorkerError> {
        let labels = tensor_from_wire(labels)?;
        Ok(self.exec.backward_from_loss(micro_batch, output, |y| {
            let (sum, scaled) = scaled_loss(loss, y, &labels, step_targets)?;
            Ok((scaled, sum.f_double_value(&[])?))
        })?)
    }

    fn loss_sum(
        &self,
        loss: Loss,
        y: &Tensor,
        labels: &WireTensor,
    ) -> Result<f64, TorchWorkerError> {
        Ok(loss_sum(loss, y, &tensor_from_wire(labels)?)?)
    }

    fn correct(
        &self,
        loss: Loss,
        y: &Tensor,
        labels: &WireTensor,
    ) -> Result<u64, TorchWorkerError> {
        Ok(correct(loss, y, &tensor_from_wire(labels)?)?)
    }
}

/// Loads the optimizer state an assignment carries, checked against the
/// stage's parameters (name and shape) before the optimizer sees it.
fn restore_optimizer(
    optimizer: &mut TorchOptimizer,
    exec: &TorchExecutor,
    state: &[ParamOptimState],
    device: Device,
) -> Result<(), TorchWorkerError> {
    if state.is_empty() {
        return Ok(());
    }
    let params: BTreeMap<String, Vec<i64>> = exec
        .parameters()?
        .into_iter()
        .map(|(name, t)| (name, t.size()))
        .collect();
    for p in state {
        let shape = params.get(&p.name).ok_or_else(|| {
            protocol(format!(
                "optimizer state for `{}`, which is not a parameter of this stage",
                p.name
            ))
        })?;
        let mut slots = Vec::with_capacity(p.slots.len());
        for t in &p.slots {
            let value = tensor_from_wire(t)?;
            if &value.size() != shape {
                return Err(protocol(format!(
                    "optimizer state `{}` of `{}` has shape {:?}, the parameter {shape:?}",
                    t.name,
                    p.name,
                    value.size()
                )));
            }
            slots.push((t.name.clone(), value.f_to_device(device)?));
        }
        optimizer.import(&p.name, p.steps, slots)?;
    }
    Ok(())
}
