//! A micro-batch's boundary tensors crossing between host and device: its
//! inputs and output gradients written before its kernels, its outputs
//! and input gradients read back after them, each as f32 or, with an int8
//! wire ([`StageWire`]), as the packed payload, unpacked and packed on the
//! device in the same submission as the kernels ([`crate::packed`]).

use rookery_kernels::spec::numel;
use rookery_model::{DType, Source};
use rookery_proto::{Bytes, WireTensor};

use super::{Activations, BoundCalls, Key, StageExecutor};
use crate::device::Device;
use crate::packed::{PackedIo, Slot, StageWire, Transfers};
use crate::{HostTensor, StageError};

impl<D: Device> StageExecutor<D> {
    /// Makes the stage's boundary tensors travel as `wire` says: with int8,
    /// outputs (when the stage sends them) and input gradients are packed
    /// on the device before they are read back, and int8 inputs and output
    /// gradients ([`Self::hold_packed`]) are unpacked there.
    pub fn set_wire(&mut self, wire: StageWire) -> Result<(), StageError> {
        self.idle("changing how tensors travel")?;
        self.int8 = PackedIo::new(wire);
        Ok(())
    }

    /// What the boundary tensors of this stage's micro-batches have moved
    /// so far.
    pub fn transfers(&self) -> Transfers {
        self.transfers
    }

    /// With an int8 wire, keeps `t` (an int8 tensor, checked) packed for the
    /// next forward, evaluation or backward, which unpacks it on the
    /// device, and gives its stand-in ([`HostTensor::is_packed`]); `None`
    /// without one.
    pub fn hold_packed(&self, t: &WireTensor) -> Option<Result<HostTensor, StageError>> {
        Some(self.int8.as_ref()?.hold(t))
    }

    /// Drops the packed payloads held for the call that just ended: a
    /// stand-in lasts one call.
    pub(super) fn end_call(&self) {
        if let Some(io) = &self.int8 {
            io.end_call();
        }
    }

    /// The int8 payload the last forward, evaluation or backward read back
    /// for its stand-in output or input gradient `t` named `name`.
    pub fn packed_payload(&self, name: &str, t: &HostTensor) -> Option<&Bytes> {
        self.int8.as_ref()?.payload(name, t)
    }

    pub(super) async fn run_forward_with(
        &mut self,
        inputs: &[(String, HostTensor)],
        offset: u64,
        key: Key,
        set: usize,
        acts: &Activations<D::Buffer>,
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        if let Some(io) = &mut self.int8 {
            io.begin_call();
        }
        let program = &self.programs[&key];
        for (at, node, per_sample) in &program.dropouts {
            let k = rookery_kernels::dropout::key(self.seed, node);
            let first = offset.wrapping_mul(*per_sample);
            self.device.write_u32(
                &acts.saved[*at],
                &[
                    k as u32,
                    (k >> 32) as u32,
                    first as u32,
                    (first >> 32) as u32,
                ],
            )?;
        }
        let mut unpack = Vec::new();
        for (i, shape) in program.input_shapes.iter().enumerate() {
            let (name, tensor) = inputs
                .iter()
                .find(|(n, _)| *n == self.layout.inputs[i].name)
                .ok_or_else(|| StageError::Input {
                    name: self.layout.inputs[i].name.clone(),
                    reason: "missing".into(),
                })?;
            if tensor.shape != *shape {
                return Err(StageError::Input {
                    name: name.clone(),
                    reason: format!("shape {:?} where {:?} is expected", tensor.shape, shape),
                });
            }
            let f32_input = self.layout.inputs[i].dtype == DType::F32;
            if tensor.is_packed() {
                let io = self.int8.as_mut().filter(|_| f32_input);
                let io = io.ok_or_else(|| unheld(name))?;
                let slot = Slot::Input(i);
                self.transfers.uploaded += io.upload(&self.device, slot, name, shape)?;
                unpack.push((slot, i));
                continue;
            }
            if f32_input {
                self.device.write_f32(&acts.inputs[i], &tensor.data)?;
            } else {
                let limit = program
                    .index_checks
                    .iter()
                    .filter(|(at, _)| *at == i)
                    .map(|&(_, size)| size)
                    .min();
                let words = index_words(name, &tensor.data, limit)?;
                self.device.write_u32(&acts.inputs[i], &words)?;
            }
            self.transfers.uploaded += 4 * tensor.data.len() as u64;
        }
        // The f32 outputs that leave packed.
        let mut pack = Vec::new();
        if let Some(io) = self.int8.as_mut().filter(|io| io.packs_outputs()) {
            for (j, (_, src)) in self.layout.outputs.iter().enumerate() {
                let len = match *src {
                    Source::Input(i) if self.layout.inputs[i].dtype == DType::F32 => {
                        numel(&program.input_shapes[i])
                    }
                    Source::Local(l) if self.local_dtypes[l] == DType::F32 => {
                        numel(&program.local_shapes[l])
                    }
                    _ => continue,
                };
                io.ready(&self.device, Slot::Output(j), len)?;
                pack.push(j);
            }
        }
        let mut calls: BoundCalls<'_, D> = Vec::new();
        if let Some(io) = &self.int8 {
            for &(slot, i) in &unpack {
                let len = numel(&program.input_shapes[i]);
                calls.push(io.call(slot, len, &acts.inputs[i])?);
            }
        }
        calls.extend(self.bind(&program.forward, key, set, Some(acts))?);
        let output = |j: usize| -> (&D::Buffer, &Vec<usize>) {
            match self.layout.outputs[j].1 {
                Source::Input(i) => (&acts.inputs[i], &program.input_shapes[i]),
                Source::Local(l) => (&acts.locals[l], &program.local_shapes[l]),
                Source::Param(_) => unreachable!("the layout never sends parameters"),
            }
        };
        if let Some(io) = &self.int8 {
            for &j in &pack {
                let (buffer, shape) = output(j);
                calls.push(io.call(Slot::Output(j), numel(shape), buffer)?);
            }
        }
        self.device.run(&calls).await?;
        drop(calls);
        let mut outputs = Vec::with_capacity(self.layout.outputs.len());
        for (j, (name, src)) in self.layout.outputs.iter().enumerate() {
            let (buffer, shape) = output(j);
            if let Some(io) = self.int8.as_mut().filter(|_| pack.contains(&j)) {
                let (stand_in, moved) = io.read(&self.device, Slot::Output(j), name, shape).await?;
                self.transfers.read_back += moved;
                outputs.push((name.clone(), stand_in));
                continue;
            }
            let mut data = self.device.read_f32(buffer).await?;
            self.transfers.read_back += 4 * data.len() as u64;
            // An integer input sent on holds i32 words.
            if let Source::Input(i) = *src
                && self.layout.inputs[i].dtype != DType::F32
            {
                for v in &mut data {
                    *v = v.to_bits() as i32 as f32;
                }
            }
            outputs.push((
                name.clone(),
                HostTensor {
                    shape: shape.clone(),
                    data,
                },
            ));
        }
        for &p in &program.counted.clone() {
            if let Some(c) = &mut self.params[p].count {
                *c += 1;
            }
        }
        Ok(outputs)
    }

    pub(super) async fn backward_with(
        &mut self,
        batch: usize,
        set: usize,
        acts: &Activations<D::Buffer>,
        output_grads: &[(String, HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>, StageError> {
        if let Some(io) = &mut self.int8 {
            io.begin_call();
        }
        self.ensure_scratch(batch)?;
        let program = &self.programs[&(batch, true)];
        let scratch = &self.scratch[&batch];
        // The buffer of output `j`'s gradient and its shape, if it has one.
        let grad_of = |j: usize| match self.layout.outputs[j].1 {
            Source::Input(i) if self.layout.inputs[i].requires_grad => {
                Some((&scratch.input_grads[i], &program.input_shapes[i]))
            }
            Source::Local(l) if self.local_dtypes[l] == DType::F32 => {
                Some((&scratch.local_grads[l], &program.local_shapes[l]))
            }
            _ => None,
        };
        let mut unpack = Vec::new();
        for (name, g) in output_grads {
            let err = |reason: String| StageError::Grad {
                name: name.clone(),
                reason,
            };
            let Some(j) = self.layout.outputs.iter().position(|(o, _)| o == name) else {
                return Err(err("not an output of this stage".into()));
            };
            let Some((buffer, shape)) = grad_of(j) else {
                continue;
            };
            if g.shape != *shape {
                return Err(err(format!(
                    "shape {:?} differs from the output's {:?}",
                    g.shape, shape
                )));
            }
            if g.is_packed() {
                let io = self.int8.as_mut().ok_or_else(|| unheld(name))?;
                let slot = Slot::OutputGrad(j);
                self.transfers.uploaded += io.upload(&self.device, slot, name, shape)?;
                unpack.push((slot, numel(shape), buffer));
            } else {
                self.device.write_f32(buffer, &g.data)?;
                self.transfers.uploaded += 4 * g.data.len() as u64;
            }
        }
        // Outputs without a gradient count as zero.
        for (j, (name, _)) in self.layout.outputs.iter().enumerate() {
            if output_grads.iter().any(|(n, _)| n == name) {
                continue;
            }
            if let Some((buffer, shape)) = grad_of(j) {
                let len = numel(shape);
                self.device.write_f32(buffer, &vec![0.0; len])?;
                self.transfers.uploaded += 4 * len as u64;
            }
        }
        // The input gradients that leave packed.
        let grads: Vec<usize> = (0..self.layout.inputs.len())
            .filter(|&i| self.layout.inputs[i].requires_grad)
            .collect();
        if let Some(io) = &mut self.int8 {
            for &i in &grads {
                io.ready(
                    &self.device,
                    Slot::InputGrad(i),
                    numel(&program.input_shapes[i]),
                )?;
            }
        }
        let mut calls: BoundCalls<'_, D> = Vec::new();
        if let Some(io) = &self.int8 {
            for &(slot, len, buffer) in &unpack {
                calls.push(io.call(slot, len, buffer)?);
            }
        }
        calls.extend(self.bind(&program.backward, (batch, true), set, Some(acts))?);
        // This micro-batch's parameter gradients join the step's.
        for &p in &program.params_with_grad {
            let state = &self.params[p];
            let (kernel, prepared) = &self.accumulate[&(state.has_grad, state.len)];
            calls.push((kernel, prepared, vec![&scratch.param_grads[p], &state.grad]));
        }
        if let Some(io) = &self.int8 {
            for &i in &grads {
                let len = numel(&program.input_shapes[i]);
                calls.push(io.call(Slot::InputGrad(i), len, &scratch.input_grads[i])?);
            }
        }
        self.device.run(&calls).await?;
        drop(calls);
        let mut out = Vec::new();
        for i in grads {
            let (name, shape) = (&self.layout.inputs[i].name, &program.input_shapes[i]);
            let (tensor, moved) = match &mut self.int8 {
                Some(io) => {
                    io.read(&self.device, Slot::InputGrad(i), name, shape)
                        .await?
                }
                None => {
                    let data = self.device.read_f32(&scratch.input_grads[i]).await?;
                    let moved = 4 * data.len() as u64;
                    let shape = shape.clone();
                    (HostTensor { shape, data }, moved)
                }
            };
            self.transfers.read_back += moved;
            out.push((name.clone(), tensor));
        }
        let with_grad = program.params_with_grad.clone();
        for p in with_grad {
            self.params[p].has_grad = true;
        }
        Ok(out)
    }
}

/// A stand-in given to a stage that holds no int8 payloads (or for an
/// integer input).
fn unheld(name: &str) -> StageError {
    StageError::Input {
        name: name.to_string(),
        reason: "holds no values: a packed int8 stand-in, but this stage does not take int8 (or not for this tensor)".into(),
    }
}

/// An integer input's values (carried as f32, exact below 2^24) as the i32
/// words the kernels bind, refusing fractions and, when the input indexes an
/// axis of `limit` entries, anything outside `[-limit, limit)` (as the
/// libtorch executor refuses it, before a kernel reads out of bounds).
fn index_words(name: &str, data: &[f32], limit: Option<usize>) -> Result<Vec<u32>, StageError> {
    let err = |reason: String| StageError::Input {
        name: name.to_string(),
        reason,
    };
    let bound = limit.map_or(1 << 24, |n| n as i64);
    data.iter()
        .map(|&v| {
            if v.fract() != 0.0 || !v.is_finite() {
                return Err(err(format!("{v} is not an integer index")));
            }
            let i = v as i64;
            if i < -bound || i >= bound {
                return Err(err(format!(
                    "index out of range: {i} where the axis has size {bound}"
                )));
            }
            Ok(i as i32 as u32)
        })
        .collect()
}
