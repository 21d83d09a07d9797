//! Our executor as a [`Backend`] of the generic worker: stages built on one
//! shared device ([`OwnFactory`]), the Leaf's loss computed from the read-back
//! output with the kernels' CPU references (a micro-batch's logits are small,
//! and the references sum in f64). With an int8 wire, activations and
//! gradients are packed and unpacked on the device: `decode` holds an int8
//! tensor's payload as it came and `encode` frames the payload the device
//! made, neither touching the values.

use std::collections::BTreeMap;
use std::sync::Arc;

use rookery_kernels::loss::{CrossEntropy, IGNORED, Mse, class_labels};
use rookery_model::Loss;
use rookery_proto::WireTensor;

use crate::device::{BoundCall, Device};
use crate::executor::{MicroBatch, ParamOptimizerState, StageExecutor};
use rookery_proto::{ParamOptimState, WireDType};

use crate::worker::{
    Backend, BackendFactory, LeafLossValue, StageSpec, WeightVersion, WorkerError,
};
use crate::{HostTensor, StageError};

/// Optimizer state as it crossed the wire, decoded for the executor.
fn optimizer_states(states: &[ParamOptimState]) -> Result<Vec<ParamOptimizerState>, String> {
    states
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
        .collect()
}

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

    async fn read_u32(&self, buffer: &Self::Buffer) -> Result<Vec<u32>, StageError> {
        (**self).read_u32(buffer).await
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
        if spec.stash_weights {
            exec.keep_previous_weights().map_err(|e| e.to_string())?;
        }
        exec.set_wire(spec.wire).map_err(|e| e.to_string())?;
        exec.set_precision(spec.precision)
            .map_err(|e| e.to_string())?;
        if !spec.optimizer_state.is_empty() {
            exec.restore_optimizer_state(&optimizer_states(spec.optimizer_state)?)
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
        if t.dtype == WireDType::I8Block
            && let Some(held) = self.hold_packed(t)
        {
            return held;
        }
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
        if !t.is_packed() {
            return Ok(WireTensor::from_f32(name, &t.shape, &t.data, dtype));
        }
        let payload = self.packed_payload(name, t).ok_or_else(|| {
            StageError::Internal(format!(
                "`{name}` is a packed int8 stand-in whose payload the last call did not read back"
            ))
        })?;
        let packed = WireTensor {
            name: name.to_string(),
            dtype: WireDType::I8Block,
            shape: t.shape.iter().map(|&d| d as u32).collect(),
            data: payload.clone(),
        };
        if dtype == WireDType::I8Block {
            return Ok(packed);
        }
        // Asked for another type: the values the payload stands for.
        let values = from_wire(&packed).map_err(|e| StageError::Internal(e.to_string()))?;
        Ok(WireTensor::from_f32(name, &t.shape, &values.data, dtype))
    }

    fn samples(&self, t: &HostTensor) -> Option<usize> {
        t.shape.first().copied()
    }

    async fn forward(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
        version: WeightVersion,
    ) -> Result<(MicroBatch, Vec<(String, HostTensor)>), StageError> {
        StageExecutor::forward_with_weights(self, inputs, offset, version).await
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
        // Refused before the gradients are scaled.
        self.step_target()?;
        StageExecutor::scale_grads(self, grad_scale as f32).await?;
        StageExecutor::step_at_lr(self, lr).await
    }

    fn merge_versions(&mut self) -> Result<(), StageError> {
        StageExecutor::merge_versions(self);
        Ok(())
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
        // Never held packed: parameters keep their values.
        let values = values
            .iter()
            .map(|t| {
                let v = from_wire(t).map_err(|e| StageError::Param {
                    name: t.name.clone(),
                    reason: e.to_string(),
                })?;
                Ok((t.name.clone(), v))
            })
            .collect::<Result<Vec<_>, StageError>>()?;
        StageExecutor::set_parameters(self, &values)
    }

    fn set_optimizer_state(&mut self, states: &[ParamOptimState]) -> Result<(), StageError> {
        let states = optimizer_states(states).map_err(|reason| StageError::Input {
            name: "optimizer state".into(),
            reason,
        })?;
        self.restore_optimizer_state(&states)
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
        step_targets: u64,
    ) -> Result<LeafLossValue<HostTensor>, StageError> {
        let (sum, grad) = host_loss(loss, values(y)?, labels, Some(step_targets))?;
        Ok(LeafLossValue {
            sum,
            grad: HostTensor {
                shape: y.shape.clone(),
                data: grad,
            },
        })
    }

    fn loss_sum(&self, loss: Loss, y: &HostTensor, labels: &WireTensor) -> Result<f64, StageError> {
        Ok(host_loss(loss, values(y)?, labels, None)?.0)
    }

    fn correct(&self, loss: Loss, y: &HostTensor, labels: &WireTensor) -> Result<u64, StageError> {
        let labels = labels.to_i64().map_err(|e| StageError::Grad {
            name: "labels".into(),
            reason: e.to_string(),
        })?;
        Ok(count_correct(loss, values(y)?, &labels))
    }
}

/// The Leaf's output with its values: never a packed stand-in (the Leaf
/// sends no outputs, so they are read back as f32).
fn values(y: &HostTensor) -> Result<&HostTensor, StageError> {
    if y.is_packed() {
        return Err(StageError::Internal(
            "the loss was given a packed int8 stand-in for the output".into(),
        ));
    }
    Ok(y)
}

fn bad_labels(reason: String) -> StageError {
    StageError::Grad {
        name: "labels".into(),
        reason,
    }
}

/// The micro-batch's summed per-target loss and, for a step whose mean
/// divides by `step_targets`, the gradient of its share `sum / step_targets`
/// (zeros without a step), as `nn.CrossEntropyLoss(ignore_index=..)` and
/// `nn.MSELoss` compute them.
fn host_loss(
    loss: Loss,
    y: &HostTensor,
    labels: &WireTensor,
    step_targets: Option<u64>,
) -> Result<(f64, Vec<f32>), StageError> {
    let labels_shape: Vec<usize> = labels.shape.iter().map(|&d| d as usize).collect();
    match loss {
        Loss::CrossEntropy {
            class_axis,
            ignore_index,
        } => {
            let (Some((n, classes, inner)), Some(want)) =
                (class_axis.split(&y.shape), class_axis.label_shape(&y.shape))
            else {
                return Err(bad_labels(format!(
                    "cross-entropy needs logits with a batch and a class dimension, got shape {:?}",
                    y.shape
                )));
            };
            if labels_shape != want {
                return Err(bad_labels(format!(
                    "labels of shape {labels_shape:?} do not fit logits {:?} with classes at dimension {} (expected {want:?})",
                    y.shape,
                    class_axis.index()
                )));
            }
            let values = labels.to_i64().map_err(|e| bad_labels(e.to_string()))?;
            let classes_of = class_labels(&values, classes, ignore_index).map_err(|(i, c)| {
                bad_labels(format!(
                    "label {c} at position {i} is outside 0..{classes} and is not the ignore_index {ignore_index}"
                ))
            })?;
            let counted = classes_of.iter().filter(|&&c| c != IGNORED).count() as u64;
            let dsum = match step_targets {
                Some(t) if counted > t => {
                    return Err(bad_labels(format!(
                        "a micro-batch of {counted} counted targets cannot be part of a step of {t}"
                    )));
                }
                Some(0) | None => 0.0,
                Some(t) => 1.0 / t as f32,
            };
            Ok(CrossEntropy { n, classes, inner }.reference(&y.data, &classes_of, dsum))
        }
        Loss::Mse => {
            let target = from_wire(labels).map_err(|e| bad_labels(e.to_string()))?;
            if target.shape != y.shape {
                return Err(bad_labels(format!(
                    "targets of shape {:?} for outputs of shape {:?}",
                    target.shape, y.shape
                )));
            }
            let samples = y.shape.first().copied().unwrap_or(0) as u64;
            let share = match step_targets {
                Some(t) if samples == 0 || samples > t => {
                    return Err(bad_labels(format!(
                        "a micro-batch of {samples} samples cannot be part of a step of {t}"
                    )));
                }
                Some(t) => samples as f32 / t as f32,
                None => 0.0,
            };
            let (mean, grad) = Mse { len: y.data.len() }.reference(&y.data, &target.data, share);
            Ok((f64::from(mean) * samples as f64, grad))
        }
    }
}

/// Counted labels (every label but cross-entropy's `ignore_index`) whose
/// first highest logit is the label; 0 when the shapes do not fit.
pub fn count_correct(loss: Loss, y: &HostTensor, labels: &[i64]) -> u64 {
    let Loss::CrossEntropy { class_axis, .. } = loss else {
        return 0;
    };
    let Some((n, classes, inner)) = class_axis.split(&y.shape) else {
        return 0;
    };
    if n * inner != labels.len() || classes == 0 {
        return 0;
    }
    let mut hits = 0;
    for (row, &label) in labels.iter().enumerate() {
        if !loss.counts(label) {
            continue;
        }
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

/// A host tensor from wire bytes: floats become f32 (checked finite; int8
/// dequantized on the CPU, its scales and values checked); integers
/// (indices, counters) too, when f32 holds them exactly.
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
        let ce = Loss::cross_entropy();
        assert_eq!(count_correct(ce, &y, &[1, 0, 1]), 2);
        assert_eq!(count_correct(ce, &y, &[1, 1]), 0, "mismatched label count");
        assert_eq!(
            count_correct(ce, &y, &[-100, 0, 2]),
            2,
            "ignored rows count nowhere"
        );
        assert_eq!(count_correct(Loss::Mse, &y, &[1, 0, 1]), 0);
    }

    #[test]
    fn correct_counts_per_token_with_classes_last_or_second() {
        // [1, 2, 3] with classes last: tokens predict 2 and 0.
        let y = HostTensor {
            shape: vec![1, 2, 3],
            data: vec![0.0, 1.0, 2.0, 5.0, 1.0, 0.0],
        };
        let last = Loss::CrossEntropy {
            class_axis: rookery_model::ClassAxis::Last,
            ignore_index: -1,
        };
        assert_eq!(count_correct(last, &y, &[2, 0]), 2);
        assert_eq!(count_correct(last, &y, &[2, -1]), 1);
        // The same numbers with classes second: 3 tokens of 2 classes predict 1, 0 (a tie), 0.
        assert_eq!(count_correct(Loss::cross_entropy(), &y, &[1, 0, 1]), 2);
    }

    #[test]
    fn a_micro_batch_gradient_is_its_share_of_the_step_mean() {
        let y = HostTensor {
            shape: vec![2, 2],
            data: vec![0.0, 0.0, 1.0, -1.0],
        };
        let labels = WireTensor::from_i64("labels", &[2], &[0, -100]);
        let (sum, grad) = host_loss(Loss::cross_entropy(), &y, &labels, Some(4)).unwrap();
        assert!((sum - 2f64.ln()).abs() < 1e-7);
        assert_eq!(grad, vec![(0.5 - 1.0) / 4.0, 0.5 / 4.0, 0.0, 0.0]);
        let e = host_loss(Loss::cross_entropy(), &y, &labels, Some(0)).unwrap_err();
        assert!(e.to_string().contains("1 counted targets"), "{e}");
        let wrong = WireTensor::from_i64("labels", &[2, 1], &[0, 1]);
        let e = host_loss(Loss::cross_entropy(), &y, &wrong, Some(4)).unwrap_err();
        assert!(e.to_string().contains("expected [2]"), "{e}");
    }

    #[test]
    fn int8_activations_decode_within_the_block_bound_and_bad_scales_are_refused() {
        let values: Vec<f32> = (0..100).map(|i| (i as f32 * 0.3).cos() * 4.0).collect();
        let t = WireTensor::from_f32("a", &[4, 25], &values, WireDType::I8Block);
        let host = from_wire(&t).unwrap();
        assert_eq!(host.shape, [4, 25]);
        for (v, block) in values.chunks(64).zip(host.data.chunks(64)) {
            let absmax = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (a, b) in v.iter().zip(block) {
                assert!((a - b).abs() <= absmax * (1.0 / 254.0 + 1e-6), "{a} vs {b}");
            }
        }
        let mut bad = t.data.to_vec();
        bad[4..8].copy_from_slice(&(-1.0f32).to_le_bytes());
        let bad = WireTensor {
            data: bad.into(),
            ..t
        };
        let e = from_wire(&bad).unwrap_err();
        assert!(e.to_string().contains("int8 block 1"), "{e}");
    }
}
