//! Boundary tensors that travel as the wire's blockwise int8, packed and
//! unpacked on the stage's device by [`rookery_kernels::int8`]'s kernels:
//! a GPU reads back and uploads the payload (about 0.27 of f32's bytes),
//! never the f32 values, and the host never quantizes or dequantizes them.
//! On the CPU device the same calls run the kernels' references, which are
//! the wire's encoder and decoder bit for bit.
//!
//! Between the worker and the executor such a tensor is a *stand-in*
//! ([`HostTensor::is_packed`]: a shape and no values), its payload kept
//! here: [`PackedIo::hold`] keeps an incoming one (the backend's `decode`)
//! for the next forward, evaluation or backward, which uploads it and
//! unpacks it in the same submission as its kernels; the payloads that call
//! reads back stay until the next call, for the backend's `encode` to frame
//! as they are.

use std::collections::HashMap;
use std::sync::Mutex;

use rookery_kernels::int8::{Int8Block, from_words, to_words};
use rookery_kernels::spec::numel;
use rookery_proto::{Bytes, WireDType, WireTensor};

use crate::device::{BoundCall, Device};
use crate::kernel::Kernel;
use crate::{HostTensor, StageError};

/// How a stage's activations and gradients travel, so a backend can ready
/// them on its device (`StageSpec::wire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageWire {
    /// The job's `wire_dtype`.
    pub dtype: WireDType,
    /// Whether the stage's outputs go on the wire: every stage's but the
    /// Leaf's, whose output the loss reads on the host.
    pub sends_outputs: bool,
}

impl StageWire {
    /// f32 both ways (prediction, and stages driven without a worker).
    pub const F32: StageWire = StageWire {
        dtype: WireDType::F32,
        sends_outputs: true,
    };
}

/// Bytes a stage's micro-batches moved between host and device for their
/// boundary tensors (inputs and output gradients written, outputs and
/// input gradients read back), counted in whole 32-bit words as they cross.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    pub uploaded: u64,
    pub read_back: u64,
}

/// Where a packed tensor sits: the stage's input, output, input gradient or
/// output gradient of that index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Slot {
    Input(usize),
    Output(usize),
    InputGrad(usize),
    OutputGrad(usize),
}

impl Slot {
    /// Whether the slot's tensor leaves the device (packed there) rather
    /// than arriving (unpacked there).
    fn leaves(self) -> bool {
        matches!(self, Slot::Output(_) | Slot::InputGrad(_))
    }
}

/// A payload and the tensor it is.
struct Packed {
    name: String,
    shape: Vec<usize>,
    bytes: Bytes,
}

/// A stage's int8 boundary: the kernels and payload buffers by slot and
/// length, incoming payloads awaiting their call and outgoing ones awaiting
/// `encode`.
pub(crate) struct PackedIo<D: Device> {
    sends_outputs: bool,
    kernels: HashMap<(bool, usize), (Kernel, D::Prepared)>,
    buffers: HashMap<(Slot, usize), D::Buffer>,
    /// Held by `decode` (which has `&self`) for the next call.
    inbox: Mutex<Vec<Packed>>,
    /// Read back by the last call.
    outbox: Vec<Packed>,
}

impl<D: Device> PackedIo<D> {
    /// The boundary of a stage whose tensors travel as `wire` says, or
    /// `None` when they are not int8.
    pub(crate) fn new(wire: StageWire) -> Option<Self> {
        (wire.dtype == WireDType::I8Block).then(|| Self {
            sends_outputs: wire.sends_outputs,
            kernels: HashMap::new(),
            buffers: HashMap::new(),
            inbox: Mutex::new(Vec::new()),
            outbox: Vec::new(),
        })
    }

    pub(crate) fn packs_outputs(&self) -> bool {
        self.sends_outputs
    }

    /// Keeps `t`'s int8 payload, checked as the wire checks it (finite
    /// non-negative scales, no -128), for the next call; its stand-in.
    pub(crate) fn hold(&self, t: &WireTensor) -> Result<HostTensor, StageError> {
        t.check().map_err(|e| StageError::Input {
            name: t.name.clone(),
            reason: e.to_string(),
        })?;
        let shape = t.shape_usize();
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        inbox.retain(|p| p.name != t.name);
        inbox.push(Packed {
            name: t.name.clone(),
            shape: shape.clone(),
            bytes: t.data.clone(),
        });
        Ok(HostTensor {
            shape,
            data: Vec::new(),
        })
    }

    /// Readies the kernel and the payload buffer of `slot` for `len` values.
    pub(crate) fn ready(&mut self, device: &D, slot: Slot, len: usize) -> Result<(), StageError> {
        let q = Int8Block::new(len);
        if let std::collections::hash_map::Entry::Vacant(e) = self.buffers.entry((slot, len)) {
            e.insert(device.alloc(q.payload_words())?);
        }
        self.kernels.entry((slot.leaves(), len)).or_insert_with(|| {
            let kernel = if slot.leaves() {
                Kernel::Quantize(q)
            } else {
                Kernel::Dequantize(q)
            };
            let prepared = device.prepare(&kernel);
            (kernel, prepared)
        });
        Ok(())
    }

    /// Uploads the held payload of `name` into `slot`'s buffer for `shape`;
    /// the bytes written.
    pub(crate) fn upload(
        &mut self,
        device: &D,
        slot: Slot,
        name: &str,
        shape: &[usize],
    ) -> Result<u64, StageError> {
        let held = {
            let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
            let at = inbox.iter().position(|p| p.name == name);
            at.map(|at| inbox.swap_remove(at))
        };
        let held = held.ok_or_else(|| StageError::Input {
            name: name.to_string(),
            reason: "a packed int8 stand-in whose payload this stage does not hold (decode it right before the call)".into(),
        })?;
        if held.shape != shape {
            return Err(StageError::Input {
                name: name.to_string(),
                reason: format!(
                    "the stand-in's shape {shape:?} is not its payload's {:?}",
                    held.shape
                ),
            });
        }
        let len = numel(shape);
        self.ready(device, slot, len)?;
        let words = to_words(&held.bytes);
        device.write_u32(&self.buffers[&(slot, len)], &words)?;
        Ok(4 * words.len() as u64)
    }

    /// The call that packs `values` into `slot`'s buffer, or unpacks the
    /// buffer into them, for `len` values (readied before).
    pub(crate) fn call<'a>(
        &'a self,
        slot: Slot,
        len: usize,
        values: &'a D::Buffer,
    ) -> Result<BoundCall<'a, D::Prepared, D::Buffer>, StageError> {
        let missing =
            || StageError::Internal(format!("the int8 {slot:?} of {len} values was not readied"));
        let (kernel, prepared) = self
            .kernels
            .get(&(slot.leaves(), len))
            .ok_or_else(missing)?;
        let packed = self.buffers.get(&(slot, len)).ok_or_else(missing)?;
        let buffers = if slot.leaves() {
            vec![values, packed]
        } else {
            vec![packed, values]
        };
        Ok((kernel, prepared, buffers))
    }

    /// Forgets what the last call read back, as a call begins.
    pub(crate) fn begin_call(&mut self) {
        self.outbox.clear();
    }

    /// Forgets any payload held for the call that just ended and not taken
    /// by it: a stand-in lasts one call.
    pub(crate) fn end_call(&self) {
        self.inbox.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Reads back the payload `slot` was packed into (`shape`'s values),
    /// keeps it for `encode` under `name`, and gives its stand-in and the
    /// bytes read.
    pub(crate) async fn read(
        &mut self,
        device: &D,
        slot: Slot,
        name: &str,
        shape: &[usize],
    ) -> Result<(HostTensor, u64), StageError> {
        let q = Int8Block::new(numel(shape));
        let buffer = self.buffers.get(&(slot, q.len)).ok_or_else(|| {
            StageError::Internal(format!(
                "the int8 {slot:?} of {} values was not readied",
                q.len
            ))
        })?;
        let words = device.read_u32(buffer).await?;
        let moved = 4 * words.len() as u64;
        self.outbox.retain(|p| p.name != name);
        self.outbox.push(Packed {
            name: name.to_string(),
            shape: shape.to_vec(),
            bytes: from_words(&words, q.payload_bytes()).into(),
        });
        let stand_in = HostTensor {
            shape: shape.to_vec(),
            data: Vec::new(),
        };
        Ok((stand_in, moved))
    }

    /// The payload the last call read back for the stand-in `t` named
    /// `name`.
    pub(crate) fn payload(&self, name: &str, t: &HostTensor) -> Option<&Bytes> {
        self.outbox
            .iter()
            .find(|p| p.name == name && p.shape == t.shape)
            .map(|p| &p.bytes)
    }
}
