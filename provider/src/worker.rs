//! One provider's share of a training job on libtorch: the generic
//! [`rookery_stage::StageWorker`] (the protocol state machine every provider
//! shares, see its docs for the rules the server relies on) over
//! [`TorchStage`], a libtorch [`StageExecutor`] and its [`Optimizer`].
//!
//! The worker is a synchronous state machine with no socket: the connection
//! feeds it on its own thread (libtorch calls block), and tests relay messages
//! between several workers in one process exactly as the server would. Every
//! failure, whether a bad assignment, a tensor of the wrong shape, a libtorch
//! error or a message that does not fit the stage's state, becomes
//! [`ToServer::JobFailed`]; nothing a server sends can panic it.

use std::collections::BTreeMap;

use rookery_model::Loss;
use rookery_proto::{ParamOptimState, TensorError, ToProvider, ToServer, WireDType, WireTensor};
use rookery_stage::worker::{Backend, BackendFactory, LeafLossValue, StageSpec};
use tch::{Device, Kind, Tensor};

use crate::exec::loss::{loss_value, micro_batch_loss};
use crate::exec::{ExecError, MicroBatch, Optimizer, StageExecutor, is_float};
use crate::trainer::Trainer;

pub use crate::trainer::step_seed;

/// Why a message could not be carried out; its text goes into `JobFailed`.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The message does not fit the assignment or the stage's state.
    #[error("{0}")]
    Protocol(String),
}

impl From<tch::TchError> for WorkerError {
    fn from(error: tch::TchError) -> Self {
        // Through ExecError, which trims libtorch's C++ backtrace.
        WorkerError::Exec(ExecError::from(error))
    }
}

fn protocol(message: impl Into<String>) -> WorkerError {
    WorkerError::Protocol(message.into())
}

/// Runs at most one stage of one job at a time on one device.
pub struct StageWorker {
    device: Device,
    inner: rookery_stage::StageWorker<TorchFactory>,
}

impl std::fmt::Debug for StageWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageWorker")
            .field("device", &self.device)
            .field("job_id", &self.job_id())
            .finish()
    }
}

impl StageWorker {
    /// A worker with no stage yet; stages it builds live on `device`.
    pub fn new(device: Device) -> Self {
        Self {
            device,
            inner: rookery_stage::StageWorker::new(TorchFactory { device }),
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

impl Trainer for StageWorker {
    fn handle(&mut self, message: ToProvider) -> Vec<ToServer> {
        StageWorker::handle(self, message)
    }
}

/// Builds libtorch stages on one device.
pub struct TorchFactory {
    device: Device,
}

impl BackendFactory for TorchFactory {
    type Backend = TorchStage;

    fn build(&mut self, spec: StageSpec<'_>) -> Result<TorchStage, String> {
        let build = || -> Result<TorchStage, WorkerError> {
            let params = spec
                .params
                .iter()
                .map(|p| Ok((p.name.clone(), tensor_from_wire(p)?)))
                .collect::<Result<Vec<_>, WorkerError>>()?;
            let exec = StageExecutor::new(
                spec.graph,
                spec.range.clone(),
                spec.outputs.to_vec(),
                params,
                self.device,
            )?;
            let mut optimizer = Optimizer::new(spec.optimizer)?;
            restore_optimizer(&mut optimizer, &exec, spec.optimizer_state, self.device)?;
            Ok(TorchStage { exec, optimizer })
        };
        build().map_err(|e| e.to_string())
    }
}

/// A libtorch stage and its optimizer.
#[derive(Debug)]
pub struct TorchStage {
    exec: StageExecutor,
    optimizer: Optimizer,
}

impl Backend for TorchStage {
    type MicroBatch = MicroBatch;
    type Tensor = Tensor;
    type Error = WorkerError;

    fn param_names(&self) -> Vec<String> {
        self.exec.param_names()
    }

    fn set_step_seed(&mut self, seed: u64) {
        self.exec.set_step_seed(seed);
    }

    fn decode(&self, t: &WireTensor) -> Result<Tensor, WorkerError> {
        tensor_from_wire(t)
    }

    fn encode(&self, name: &str, t: &Tensor, dtype: WireDType) -> Result<WireTensor, WorkerError> {
        tensor_to_wire(name, t, dtype)
    }

    fn samples(&self, t: &Tensor) -> Option<usize> {
        (t.dim() > 0).then(|| t.size()[0].max(0) as usize)
    }

    async fn forward(
        &mut self,
        inputs: &[(String, Tensor)],
        offset: u64,
    ) -> Result<(MicroBatch, Vec<(String, Tensor)>), WorkerError> {
        #[cfg(feature = "fault-injection")]
        crate::fault::slow_down();
        let forward = self.exec.forward_at(inputs, true, offset)?;
        Ok((forward.micro_batch, forward.outputs))
    }

    async fn evaluate(
        &mut self,
        inputs: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, WorkerError> {
        Ok(self.exec.evaluate(inputs)?)
    }

    async fn backward(
        &mut self,
        micro_batch: MicroBatch,
        grads: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, WorkerError> {
        Ok(self.exec.backward(micro_batch, grads)?)
    }

    async fn step(&mut self) -> Result<(), WorkerError> {
        Ok(self.exec.step(&mut self.optimizer)?)
    }

    async fn parameters(&mut self) -> Result<Vec<WireTensor>, WorkerError> {
        self.exec
            .parameters()?
            .iter()
            .map(|(name, t)| tensor_to_wire(name, t, WireDType::F32))
            .collect()
    }

    fn set_parameters(&mut self, values: &[WireTensor]) -> Result<(), WorkerError> {
        let values = values
            .iter()
            .map(|t| Ok((t.name.clone(), tensor_from_wire(t)?)))
            .collect::<Result<Vec<_>, WorkerError>>()?;
        Ok(self.exec.set_parameters(&values)?)
    }

    async fn optimizer_state(&mut self) -> Result<Vec<ParamOptimState>, WorkerError> {
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
        batch_size: usize,
    ) -> Result<LeafLossValue<Tensor>, WorkerError> {
        let labels = tensor_from_wire(labels)?;
        let out = micro_batch_loss(loss, y, &labels, batch_size)?;
        Ok(LeafLossValue {
            mean: out.mean,
            grad: out.grad,
        })
    }

    fn loss_value(&self, loss: Loss, y: &Tensor, labels: &WireTensor) -> Result<f64, WorkerError> {
        Ok(loss_value(loss, y, &tensor_from_wire(labels)?)?)
    }

    fn correct(&self, y: &Tensor, labels: &WireTensor) -> Result<u64, WorkerError> {
        let labels = tensor_from_wire(labels)?;
        let hits = y
            .f_argmax(1, false)?
            .f_eq_tensor(&labels.f_to_device(y.device())?)?
            .f_sum(Kind::Int64)?
            .f_int64_value(&[])?;
        Ok(hits.max(0) as u64)
    }
}

/// Loads the optimizer state an assignment carries, checked against the
/// stage's parameters (name and shape) before the optimizer sees it.
fn restore_optimizer(
    optimizer: &mut Optimizer,
    exec: &StageExecutor,
    state: &[ParamOptimState],
    device: Device,
) -> Result<(), WorkerError> {
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

/// A CPU tensor from wire bytes: f32, f16 and bf16 become f32 (`Kind::Float`),
/// i64 stays i64; shaped as declared. Byte counts that do not match the shape
/// and non-finite floats are refused.
pub fn tensor_from_wire(t: &WireTensor) -> Result<Tensor, WorkerError> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| i64::from(d)).collect();
    if t.dtype == WireDType::F32 && cfg!(target_endian = "little") {
        // Checked on the bytes and copied once: activations and gradients
        // arrive for every micro-batch, and a pass over them costs as much as
        // a small layer.
        t.check()?;
        return Ok(Tensor::f_from_data_size(&t.data, &shape, Kind::Float)?);
    }
    let flat = match t.dtype {
        WireDType::I64 => Tensor::f_from_slice(&t.to_i64()?)?,
        WireDType::F32 | WireDType::F16 | WireDType::Bf16 => {
            t.check()?;
            Tensor::f_from_slice(&t.to_f32()?)?
        }
    };
    Ok(flat.f_reshape(shape.as_slice())?)
}

/// Wire bytes of a tensor on any device: floating-point tensors as `dtype`
/// (f32, f16 or bf16), integer tensors as i64 whatever `dtype` says.
pub fn tensor_to_wire(name: &str, t: &Tensor, dtype: WireDType) -> Result<WireTensor, WorkerError> {
    let t = t.f_detach()?.f_to_device(Device::Cpu)?;
    let shape: Vec<usize> = t.size().iter().map(|&d| d.max(0) as usize).collect();
    let numel = shape.iter().product::<usize>();
    if is_float(t.kind()) {
        if !dtype.is_float() {
            return Err(protocol(format!(
                "tensor `{name}` is floating point and cannot travel as {}",
                dtype.as_str()
            )));
        }
        let t = t.f_to_kind(Kind::Float)?.f_contiguous()?;
        if dtype == WireDType::F32 && cfg!(target_endian = "little") {
            // Straight into the wire bytes, one copy.
            let mut bytes = vec![0u8; numel * 4];
            t.f_copy_data_u8(&mut bytes, numel)?;
            return Ok(WireTensor::from_le_bytes(name, &shape, dtype, bytes));
        }
        let mut values = vec![0f32; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_f32(name, &shape, &values, dtype))
    } else {
        let t = t.f_to_kind(Kind::Int64)?.f_contiguous()?;
        let mut values = vec![0i64; numel];
        t.f_copy_data(&mut values, numel)?;
        Ok(WireTensor::from_i64(name, &shape, &values))
    }
}
