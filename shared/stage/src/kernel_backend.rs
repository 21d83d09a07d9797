//! Our executor as a [`Backend`] of the generic worker: stages built on one
//! shared device ([`OwnFactory`]), the Leaf's loss computed from the read-back
//! output with the kernels' CPU references (a micro-batch's logits are small,
//! and the references sum in f64).

use std::collections::BTreeMap;
use std::sync::Arc;

use rookery_kernels::loss::{CrossEntropy, Mse};
use rookery_model::Loss;
use rookery_proto::WireTensor;

use crate::device::{BoundCall, Device};
use crate::executor::{MicroBatch, ParamOptimizerState, StageExecutor};
use rookery_proto::{ParamOptimState, WireDType};

use crate::worker::{Backend, BackendFactory, LeafLossValue, StageSpec, WorkerError};
use crate::{HostTensor, StageError};

/// Builds [`StageExecutor`]s on one device, shared by every stage this
/// provider is assigned over time.
pub struct OwnFactory<D: Device> {
    device: Arc<D>,
}

// Not derived: the device itself need not be `Clone`, the `Arc` is.
impl<D: Device> Clone for OwnFactory<D> {
    fn clone(&self) -> Self {
        Self {
            device: self.device.clone(),
        }
    }
}

impl<D: Device> OwnFactory<D> {
    pub fn new(device: D) -> Self {
        Self {
            device: Arc::new(device),
        }
    }

    pub fn device(&self) -> &D {
        &self.device
    }
}

impl<D: Device> Device for Arc<D> {
    type Buffer = D::Buffer;
    type Prepared = D::Prepared;

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn alloc(&self, words: usize) -> Result<Self::Buffer, StageError> {
        (**self).alloc(words)
    }

    fn write_f32(&self, buffer: &Self::Buffer, data: &[f32]) -> Result<(), StageError> {
        (**self).write_f32(buffer, data)
    }

    fn write_u32(&self, buffer: &Self::Buffer, data: &[u32]) -> Result<(), StageError> {
        (**self).write_u32(buffer, data)
    }

    fn prepare(&self, kernel: &crate::Kernel) -> Self::Prepared {
        (**self).prepare(kernel)
    }

    async fn run(
        &self,
        calls: &[BoundCall<'_, Self::Prepared, Self::Buffer>],
    ) -> Result<(), StageError> {
        (**self).run(calls).await
    }

    async fn read_f32(&self, buffer: &Self::Buffer) -> Result<Vec<f32>, StageError> {
        (**self).read_f32(buffer).await
    }
}

impl<D: Device> BackendFactory for OwnFactory<D> {
    type Backend = StageExecutor<Arc<D>>;

    fn build(&mut self, spec: StageSpec<'_>) -> Result<Self::Backend, String> {
        let mut params = BTreeMap::new();
        for p in spec.params {
            // Integer parameters (BatchNorm's `num_batches_tracked`) are
            // counts the executor keeps on the host.
            let t = from_wire(p).map_err(|e| format!("parameter `{}`: {e}", p.name))?;
            params.insert(p.name.clone(), t.data);
        }
        let mut exec = StageExecutor::new(
            self.device.clone(),
            spec.graph,
            spec.range,
            spec.outputs,
            &params,
            spec.optimizer,
        )
        .map_err(|e| e.to_string())?;
        if !spec.optimizer_state.is_empty() {
            let states = spec
                .optimizer_state
                .iter()
                .map(|s| {
                    let slots = s
                        .slots
                        .iter()
                        .map(|t| Ok((t.name.clone(), from_wire(t).map_err(|e| e.to_string())?)))
                        .collect::<Result<_, String>>()?;
                    Ok(ParamOptimizerState {
                        name: s.name.clone(),
                        steps: s.steps,
                        slots,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            exec.restore_optimizer_state(&states)
                .map_err(|e| e.to_string())?;
        }
        Ok(exec)
    }
}

impl<D: Device> Backend for StageExecutor<D> {
    type MicroBatch = MicroBatch;
    type Tensor = HostTensor;
    type Error = StageError;

    fn param_names(&self) -> Vec<String> {
        StageExecutor::param_names(self)
    }

    fn set_step_seed(&mut self, seed: u64) {
        StageExecutor::set_step_seed(self, seed);
    }

    fn decode(&self, t: &WireTensor) -> Result<HostTensor, StageError> {
        from_wire(t).map_err(|e| StageError::Input {
            name: t.name.clone(),
            reason: e.to_string(),
        })
    }

    fn encode(
        &self,
        name: &str,
        t: &HostTensor,
        dtype: WireDType,
    ) -> Result<WireTensor, StageError> {
        Ok(WireTensor::from_f32(name, &t.shape, &t.data, dtype))
    }

    fn samples(&self, t: &HostTensor) -> Option<usize> {
        t.shape.first().copied()
    }

    async fn forward(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
    ) -> Result<(MicroBatch, Vec<(String, HostTensor)>), StageError> {
        StageExecutor::forward_at(self, inputs, offset).await
    }

    async fn evaluate(
        &mut self,
        inputs: &[(String, HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        StageExecutor::evaluate(self, inputs).await
    }

    async fn backward(
        &mut self,
        micro_batch: MicroBatch,
        grads: &[(String, HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        StageExecutor::backward(self, micro_batch, grads).await
    }

    async fn grad_sum_of_squares(&mut self) -> Result<f64, StageError> {
        StageExecutor::grad_sum_of_squares(self).await
    }

    async fn step(&mut self, lr: f64, grad_scale: f64) -> Result<(), StageError> {
        StageExecutor::scale_grads(self, grad_scale as f32).await?;
        StageExecutor::step_at_lr(self, lr).await
    }

    async fn parameters(&mut self) -> Result<Vec<WireTensor>, StageError> {
        let integer = self.param_is_integer();
        Ok(StageExecutor::parameters(self)
            .await?
            .iter()
            .zip(integer)
            .map(|((name, t), integer)| {
                if integer {
                    let values: Vec<i64> = t.data.iter().map(|&v| v as i64).collect();
                    WireTensor::from_i64(name, &t.shape, &values)
                } else {
                    WireTensor::from_f32(name, &t.shape, &t.data, WireDType::F32)
                }
            })
            .collect())
    }

    fn set_parameters(&mut self, values: &[WireTensor]) -> Result<(), StageError> {
        let values = values
            .iter()
            .map(|t| Ok((t.name.clone(), self.decode(t)?)))
            .collect::<Result<Vec<_>, StageError>>()?;
        StageExecutor::set_parameters(self, &values)
    }

    async fn optimizer_state(&mut self) -> Result<Vec<ParamOptimState>, StageError> {
        Ok(StageExecutor::optimizer_state(self)
            .await?
            .into_iter()
            .map(|s| ParamOptimState {
                name: s.name,
                steps: s.steps,
                slots: s
                    .slots
                    .iter()
                    .map(|(slot, t)| WireTensor::from_f32(slot, &t.shape, &t.data, WireDType::F32))
                    .collect(),
            })
            .collect())
    }

    fn leaf_loss(
        &self,
        loss: Loss,
        y: &HostTensor,
        labels: &WireTensor,
        batch_size: usize,
    ) -> Result<LeafLossValue<HostTensor>, StageError> {
        let samples = y.shape.first().copied().unwrap_or(0);
        if samples == 0 || batch_size == 0 || samples > batch_size {
            return Err(StageError::Grad {
                name: "loss".into(),
                reason: format!(
                    "a micro-batch of {samples} samples cannot be part of a batch of {batch_size}"
                ),
            });
        }
        // The gradient of this micro-batch's share of the step's mean loss.
        let share = samples as f32 / batch_size as f32;
        let (mean, grad) = host_loss(loss, y, labels, share)?;
        Ok(LeafLossValue {
            mean: f64::from(mean),
            grad: HostTensor {
                shape: y.shape.clone(),
                data: grad,
            },
        })
    }

    fn loss_value(
        &self,
        loss: Loss,
        y: &HostTensor,
        labels: &WireTensor,
    ) -> Result<f64, StageError> {
        Ok(f64::from(host_loss(loss, y, labels, 1.0)?.0))
    }

    fn correct(&self, y: &HostTensor, labels: &WireTensor) -> Result<u64, StageError> {
        let labels = labels.to_i64().map_err(|e| StageError::Grad {
            name: "labels".into(),
            reason: e.to_string(),
        })?;
        Ok(count_correct(y, &labels))
    }
}

/// The mean loss and its gradient scaled by `scale`, as `nn.CrossEntropyLoss`
/// and `nn.MSELoss` compute them.
fn host_loss(
    loss: Loss,
    y: &HostTensor,
    labels: &WireTensor,
    scale: f32,
) -> Result<(f32, Vec<f32>), StageError> {
    let bad = |reason: String| StageError::Grad {
        name: "labels".into(),
        reason,
    };
    match loss {
        Loss::CrossEntropy => {
            let (Some(&n), Some(&classes)) = (y.shape.first(), y.shape.get(1)) else {
                return Err(bad(format!(
                    "cross-entropy needs logits [N, C, ..], got shape {:?}",
                    y.shape
                )));
            };
            let inner: usize = y.shape.iter().skip(2).product();
            let classes_of = labels.to_i64().map_err(|e| bad(e.to_string()))?;
            if classes_of.len() != n * inner {
                return Err(bad(format!(
                    "{} labels for {} rows of logits",
                    classes_of.len(),
                    n * inner
                )));
            }
            let labels = classes_of
                .iter()
                .map(|&c| {
                    u32::try_from(c)
                        .ok()
                        .filter(|&c| (c as usize) < classes)
                        .ok_or_else(|| bad(format!("class {c} is outside 0..{classes}")))
                })
                .collect::<Result<Vec<u32>, _>>()?;
            Ok(CrossEntropy { n, classes, inner }.reference(&y.data, &labels, scale))
        }
        Loss::Mse => {
            let target = from_wire(labels).map_err(|e| bad(e.to_string()))?;
            if target.shape != y.shape {
                return Err(bad(format!(
                    "targets of shape {:?} for outputs of shape {:?}",
                    target.shape, y.shape
                )));
            }
            Ok(Mse { len: y.data.len() }.reference(&y.data, &target.data, scale))
        }
    }
}

/// Samples of `y` (`[N, C, inner..]` logits) whose first highest class is
/// their label (`[N, inner..]`).
pub fn count_correct(y: &HostTensor, labels: &[i64]) -> u64 {
    let (Some(&n), Some(&classes)) = (y.shape.first(), y.shape.get(1)) else {
        return 0;
    };
    let inner: usize = y.shape.iter().skip(2).product();
    if n * inner != labels.len() || classes == 0 {
        return 0;
    }
    let mut hits = 0;
    for (row, &label) in labels.iter().enumerate() {
        let base = (row / inner) * classes * inner + row % inner;
        let mut best = 0;
        for c in 1..classes {
            if y.data[base + c * inner] > y.data[base + best * inner] {
                best = c;
            }
        }
        if label == best as i64 {
            hits += 1;
        }
    }
    hits
}

/// Integers a host tensor's f32 carries exactly.
const EXACT_INTEGERS: i64 = 1 << 24;

/// A host tensor from wire bytes: floats become f32 (checked finite);
/// integers (indices, counters) too, when f32 holds them exactly.
pub fn from_wire(t: &WireTensor) -> Result<HostTensor, WorkerError> {
    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
    if !t.dtype.is_float() {
        let values = t.to_i64().map_err(|e| WorkerError(e.to_string()))?;
        if let Some(v) = values.iter().find(|v| v.abs() >= EXACT_INTEGERS) {
            return Err(WorkerError(format!(
                "tensor `{}` holds the integer {v}, beyond the {EXACT_INTEGERS} this backend carries exactly",
                t.name
            )));
        }
        let data = values.into_iter().map(|v| v as f32).collect();
        return Ok(HostTensor { shape, data });
    }
    let data = t.to_f32().map_err(|e| WorkerError(e.to_string()))?;
    if let Some(index) = data.iter().position(|v| !v.is_finite()) {
        return Err(WorkerError(format!(
            "tensor `{}` holds a non-finite value at element {index}",
            t.name
        )));
    }
    Ok(HostTensor { shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correct_counts_the_first_highest_logit() {
        let y = HostTensor {
            shape: vec![3, 3],
            data: vec![0.1, 0.9, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0],
        };
        assert_eq!(count_correct(&y, &[1, 0, 1]), 2);
        assert_eq!(count_correct(&y, &[1, 1]), 0, "mismatched label count");
    }
}
